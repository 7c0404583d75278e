"""PlanJob's numbers against a real run: the scheduler's planner (its child process, services/trainer/plan.py) plans a
job, then services/trainer/sft.run_sft trains it on the tiny model, its events and a forward recording what it does."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from trainer_helpers import RecordingRun

from kernels.memory import TensorMemoryTracker
from services.common.blobstore import BlobStore
from services.common.methods.sft import SftHyperparams
from services.scheduler.planner import Planner
from services.trainer.engine import TrainingEngine

ROOT = Path(__file__).resolve().parents[3]
SAMPLE = ROOT / "examples" / "data" / "sft_demo.jsonl"  # 20 chat rows
# max_seq_len 40 leaves 6 of the sample's rows without an assistant token (skipped); 14 split 11 / 3.
HP = SftHyperparams(max_seq_len=40, batch_size=3, gradient_accumulation_steps=2, epochs=3, eval_fraction=0.2,
                    checkpoint_every=2, seed=1, learning_rate=2e-3)
MEMORY_FACTOR = 1.5


@pytest.fixture(scope="module")
def plan(tmp_path_factory, tiny_model_dir):
    """Plans of jobs on the sample data and the tiny model, from the scheduler's planner."""
    blobs = BlobStore(tmp_path_factory.mktemp("blobs"))
    planner = Planner(blobs)
    sha256, _ = blobs.put_file(SAMPLE)
    yield lambda hp: planner.plan("sft", str(tiny_model_dir), sha256, hp.to_json())
    planner.close()


def test_the_plan_is_what_the_trainer_does(plan, tiny_model_dir, tmp_path, monkeypatch):
    """Split, skipped rows, steps, tokens, checkpoints, eval passes and the trainable count equal the run's; the memory
    estimate is within MEMORY_FACTOR (1.5) of the measured peak, either way (measured here: estimate 16.1 MiB, peak
    15.5 MiB).

    Measured peak: kernels.memory.TensorMemoryTracker over the whole run_sft (every storage an aten op allocates: the
    adapter, gradients, AdamW state, activations, logprob blocks) plus the loaded base weights' bytes (their storages
    come from the safetensors file, which the tracker does not see). The estimate is meant as an upper bound: it
    takes the largest micro-batch the sampler could form and counts the inputs and outputs of every projection; the
    factor leaves room for kernels that keep more or less than that."""
    planned = plan(HP)
    micro_batches: list[tuple[bool, int]] = []  # (training, tokens) of every forward
    nll_sum = TrainingEngine.nll_sum

    def recording_nll_sum(self, input_ids_BT, targets_BT, *, packing=None):
        micro_batches.append((self.model.training, input_ids_BT.shape[1]))
        return nll_sum(self, input_ids_BT, targets_BT, packing=packing)

    monkeypatch.setattr(TrainingEngine, "nll_sum", recording_nll_sum)
    hooks = RecordingRun(tmp_path / "saved")
    with TensorMemoryTracker() as mem:
        outcome = hooks.run(tiny_model_dir, SAMPLE, HP, work_dir=tmp_path / "work")

    rows = (planned["dataset_rows"], planned["skipped_rows"], planned["train_rows"], planned["eval_rows"])
    assert rows == (20, 6, 11, 3)
    assert ("warning", "skipped 6 of 20 rows with no assistant/completion token within max_seq_len=40") in hooks.logs
    assert (hooks.info["train examples"], hooks.info["eval examples"]) == (planned["train_rows"], planned["eval_rows"])
    assert hooks.info["trainable params"] == planned["trainable_parameters"]
    assert planned["steps_per_epoch"] == 2 and hooks.total_steps == outcome.step == planned["total_steps"] == 6
    first_epoch = range(1, planned["steps_per_epoch"] + 1)
    assert sum(hooks.metrics[s]["train/tokens"] for s in first_epoch) == planned["target_tokens_per_epoch"]
    train_tokens = [n for training, n in micro_batches if training]
    assert len(train_tokens) == planned["total_steps"] * HP.gradient_accumulation_steps
    per_epoch = len(train_tokens) // HP.epochs
    assert sum(train_tokens[:per_epoch]) == planned["tokens_per_epoch"] == sum(train_tokens[per_epoch:2 * per_epoch])
    assert max(train_tokens) <= planned["largest_micro_batch_tokens"]
    assert len(hooks.checkpoints) == planned["checkpoints"] == 3
    assert sum("eval/loss" in m for m in hooks.metrics.values()) == planned["eval_passes"] == 3

    estimate = planned["memory"]["total_bytes"]
    measured = mem.peak_bytes + planned["memory"]["weights_bytes"]
    print(f"memory: estimate {estimate / 2**20:.1f} MiB, measured peak {measured / 2**20:.1f} MiB")
    assert planned["memory"]["weights_bytes"] == 4 * sum(p.numel() for p in _base_parameters(tiny_model_dir))
    assert measured / MEMORY_FACTOR <= estimate <= MEMORY_FACTOR * measured, (estimate, measured)


def _base_parameters(model_dir: Path) -> list[torch.nn.Parameter]:
    from models import load_pretrained

    return list(load_pretrained(model_dir, dtype=torch.float32).parameters())


def test_plans_are_kept_and_failures_are_warnings(plan):
    """A second identical request is answered from the cache; a max_seq_len that leaves nothing to train on is a
    warning in the plan (CreateJob accepts it too: the run fails), not an error of PlanJob."""
    assert plan(HP) is plan(HP)
    nothing = plan(SftHyperparams(max_seq_len=16))
    assert (nothing["train_rows"], nothing["total_steps"], nothing["skipped_rows"]) == (0, 0, 20)
    assert any("the job would fail" in w for w in nothing["warnings"])
    assert any("only 2 optimizer steps" in w for w in plan(SftHyperparams(max_steps=2))["warnings"])
