"""PlanJob's numbers against a real run: the scheduler's planner (its child process, services/trainer/plan.py) plans a
job, then services/trainer/sft.run_sft trains it on the tiny model with hooks and a forward that record what it does."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from trainer_helpers import RecordingHooks

from kernels.memory import TensorMemoryTracker
from services.common.blobstore import BlobStore
from services.common.methods.sft import SftHyperparams
from services.scheduler.planner import Planner
from services.trainer.engine import TrainingEngine
from services.trainer.sft import run_sft

ROOT = Path(__file__).resolve().parents[3]
SAMPLE = ROOT / "examples" / "data" / "sft_demo.jsonl"  # 20 chat rows
# max_seq_len 40 leaves 6 of the sample's rows without an assistant token (skipped); 14 split 11 / 3.
HP = SftHyperparams(max_seq_len=40, batch_size=3, gradient_accumulation_steps=2, epochs=3, eval_fraction=0.2,
                    checkpoint_every=2, seed=1, learning_rate=2e-3)
MEMORY_FACTOR = 1.5


@pytest.fixture(scope="module")
def planner(tmp_path_factory):
    blobs = BlobStore(tmp_path_factory.mktemp("blobs"))
    p = Planner(blobs)
    p.sha256, _ = blobs.put_file(SAMPLE)
    yield p
    p.close()


def test_the_plan_is_what_the_trainer_does(planner, tiny_model_dir, tmp_path, monkeypatch):
    """Split, skipped rows, steps, tokens, checkpoints, eval passes and the trainable count equal the run's; the memory
    estimate is within MEMORY_FACTOR (1.5) of the measured peak, either way (measured here: estimate 16.1 MiB, peak
    15.5 MiB).

    Measured peak: kernels.memory.TensorMemoryTracker over the whole run_sft (every storage an aten op allocates: the
    adapter, gradients, AdamW state, activations, logprob blocks) plus the loaded base weights' bytes (their storages
    come from the safetensors file, which the tracker does not see). The estimate is meant as an upper bound: it
    takes the largest micro-batch the sampler could form and counts the inputs and outputs of every projection; the
    factor leaves room for kernels that keep more or less than that."""
    plan = planner.plan("sft", str(tiny_model_dir), planner.sha256, HP.to_json())
    micro_batches: list[tuple[bool, int]] = []  # (training, tokens) of every forward
    nll_sum = TrainingEngine.nll_sum

    def recording_nll_sum(self, input_ids_BT, targets_BT, *, packing=None):
        micro_batches.append((self.model.training, input_ids_BT.shape[1]))
        return nll_sum(self, input_ids_BT, targets_BT, packing=packing)

    monkeypatch.setattr(TrainingEngine, "nll_sum", recording_nll_sum)
    hooks = RecordingHooks(tmp_path / "saved")
    with TensorMemoryTracker() as mem:
        outcome = run_sft(tiny_model_dir, SAMPLE, HP, hooks, work_dir=tmp_path / "work")

    assert (plan["dataset_rows"], plan["skipped_rows"], plan["train_rows"], plan["eval_rows"]) == (20, 6, 11, 3)
    assert ("warning", "skipped 6 of 20 rows with no assistant/completion token within max_seq_len=40") in hooks.logs
    assert (hooks.info["train examples"], hooks.info["eval examples"]) == (plan["train_rows"], plan["eval_rows"])
    assert hooks.info["trainable params"] == plan["trainable_parameters"]
    assert plan["steps_per_epoch"] == 2 and hooks.total_steps == outcome.step == plan["total_steps"] == 6
    first_epoch = range(1, plan["steps_per_epoch"] + 1)
    assert sum(hooks.metrics[s]["train/tokens"] for s in first_epoch) == plan["target_tokens_per_epoch"]
    train_tokens = [n for training, n in micro_batches if training]
    assert len(train_tokens) == plan["total_steps"] * HP.gradient_accumulation_steps
    per_epoch = len(train_tokens) // HP.epochs
    assert sum(train_tokens[:per_epoch]) == plan["tokens_per_epoch"] == sum(train_tokens[per_epoch:2 * per_epoch])
    assert max(train_tokens) <= plan["largest_micro_batch_tokens"]
    assert len(hooks.checkpoints) == plan["checkpoints"] == 3
    assert sum("eval/loss" in m for m in hooks.metrics.values()) == plan["eval_passes"] == 3

    estimate = plan["memory"]["total_bytes"]
    measured = mem.peak_bytes + plan["memory"]["weights_bytes"]
    print(f"memory: estimate {estimate / 2**20:.1f} MiB, measured peak {measured / 2**20:.1f} MiB")
    assert plan["memory"]["weights_bytes"] == 4 * sum(p.numel() for p in _base_parameters(tiny_model_dir))
    assert measured / MEMORY_FACTOR <= estimate <= MEMORY_FACTOR * measured, (estimate, measured)


def _base_parameters(model_dir: Path) -> list[torch.nn.Parameter]:
    from models import load_pretrained

    return list(load_pretrained(model_dir, dtype=torch.float32).parameters())


def test_plans_are_kept_and_failures_are_warnings(planner, tiny_model_dir):
    """A second identical request is answered from the cache; a max_seq_len that leaves nothing to train on is a
    warning in the plan (CreateJob accepts it too: the run fails), not an error of PlanJob."""
    first = planner.plan("sft", str(tiny_model_dir), planner.sha256, HP.to_json())
    assert planner.plan("sft", str(tiny_model_dir), planner.sha256, HP.to_json()) is first
    nothing = SftHyperparams(max_seq_len=16).to_json()
    plan = planner.plan("sft", str(tiny_model_dir), planner.sha256, nothing)
    assert (plan["train_rows"], plan["total_steps"], plan["skipped_rows"]) == (0, 0, 20)
    assert any("the job would fail" in w for w in plan["warnings"])
    few = planner.plan("sft", str(tiny_model_dir), planner.sha256, SftHyperparams(max_steps=2).to_json())
    assert any("only 2 optimizer steps" in w for w in few["warnings"])
