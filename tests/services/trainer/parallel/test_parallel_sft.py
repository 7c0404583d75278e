"""Managed SFT on a group (services/trainer/sft.py with parallel=ParallelDims(...), 2 of run_ranks' real gloo
ranks) against the named reference: the single-process run_sft on the same model, dataset and hyperparameters, run
in the test's own process.

Compared per step: train/loss, train/grad_norm, eval/loss (where evaluated), train/tokens and train/lr; and the
final adapter (weights/adapter_model.safetensors). The cases: two micro-batches per step split 1 / 1 (gradient
accumulation 2), and three per step split 2 / 1 whose epoch's last step has one micro-batch (rank 1 runs padding
micro-batches only), all dp_shard 2; cp 2 (dense) and dp_shard 2 x ep 2 (qwen3_moe) for 2 steps. Resume: the
group's checkpoint at step 2 continued on one process, and the one-process checkpoint at step 2 continued on the
group, each against the uninterrupted one-process run.

Tolerances (float32 on the CPU; the group sums each gradient over the ranks -- and under cp each attention row over
the ring's blocks -- in another order than one process, nothing else differs): losses and grad norms within 1e-6
relative; each final adapter tensor within 1e-4 relative in norm (||got - want|| / ||want||: AdamW's eps 1e-8
divides each gradient element by its own running magnitude, so an element's rounding difference moves its update by
the same relative amount however small the element, and a max-element measure would be dominated by such elements).
Measured (printed with pytest -s): losses and norms <= 2.3e-7 relative; adapter 1.7e-6 (dp_shard 2), 7.6e-7 (uneven,
and its checkpoint resumed on one process), 6.0e-8 (a one-process checkpoint continued on 2 ranks), 4.4e-5 / 1.1e-4
(cp 2 on an Intel Xeon / an AMD EPYC: its bound is 5e-4, _CP_ADAPTER_RTOL), 4.4e-6 (qwen3_moe, dp_shard 2 x ep 2).
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.common.methods.sft import SftHyperparams
from services.trainer.engine.parallel import ParallelDims
from services.trainer.sft import SftCheckpoint, run_sft
from tests.services.trainer.parallel.ranks import run_ranks
from tests.services.trainer.trainer_helpers import PAIRS, RecordingRun, chat_row, write_jsonl

pytestmark = pytest.mark.usefixtures("one_thread")

BASE = dict(lora_rank=4, lora_alpha=8.0, max_seq_len=64, learning_rate=5e-3, max_steps=4, batch_size=2,
            eval_fraction=0.2, checkpoint_every=2, seed=5)
_LOSS_RTOL, _ADAPTER_RTOL = 1e-6, 1e-4
# cp reorders every attention row's sums (the ring's blocks merged by online softmax), so more gradient elements near
# zero differ in their last bits, and AdamW turns each into a full-size update difference: which elements those are
# depends on the CPU's kernels (measured 4.4e-5 on an Intel Xeon, 1.1e-4 on an AMD EPYC). Losses and grad norms stay
# within _LOSS_RTOL; a wrong gradient would move the adapter by O(1).
_CP_ADAPTER_RTOL = 5e-4


class _Never:
    def is_set(self) -> bool:
        return False


def _group_run(model_dir: str, dataset: str, hp_json: dict, work: str, save: str, resume: str | None,
               resume_step: int, layout: dict | None = None) -> dict | None:
    """run_sft on this rank of a group laid out as layout (default: dp_shard over every rank); rank 0 records every
    event (its checkpoints copied under save) and returns them, the other ranks only drive the run."""
    hp = SftHyperparams.from_json(hp_json)
    kwargs = dict(resume=None if resume is None else SftCheckpoint(resume_step, Path(resume)),
                  base_model_name="tiny-base", work_dir=Path(work), parallel=ParallelDims(**(layout or {})))
    if torch.distributed.get_rank() != 0:
        for _ in run_sft(Path(model_dir), Path(dataset), hp, stop=_Never(), **kwargs):
            pass
        return None
    rec = RecordingRun(Path(save))
    outcome = rec.run(Path(model_dir), Path(dataset), hp, **kwargs)
    return {"outcome": (outcome.step, outcome.stopped), "metrics": rec.metrics,
            "checkpoints": {c.step: str(c.root) for c, _, _ in rec.checkpoints}, "adapter": rec.final_adapter()}


def _one_process(model_dir, dataset, hp: SftHyperparams, tmp: Path, resume: SftCheckpoint | None = None) -> dict:
    rec = RecordingRun(tmp / "saved-1p")
    outcome = rec.run(model_dir, dataset, hp, resume=resume, base_model_name="tiny-base", work_dir=tmp / "work-1p")
    return {"outcome": (outcome.step, outcome.stopped), "metrics": rec.metrics,
            "checkpoints": {c.step: str(c.root) for c, _, _ in rec.checkpoints}, "adapter": rec.final_adapter()}


def _on_group(model_dir, dataset, hp: SftHyperparams, tmp: Path, resume: SftCheckpoint | None = None) -> dict:
    return run_ranks(_group_run, 2, str(model_dir), str(dataset), hp.to_json(), str(tmp / "work-2"),
                     str(tmp / "saved-2"), None if resume is None else str(resume.root),
                     0 if resume is None else resume.step)[0]


def _rel(got: float, want: float) -> float:
    return abs(got - want) / max(abs(want), 1e-30)


def _compare(got: dict, want: dict, what: str, adapter_rtol: float = _ADAPTER_RTOL) -> dict[str, float]:
    """Everything within tolerance; the worst relative differences."""
    assert got["outcome"] == want["outcome"]
    assert sorted(got["metrics"]) == sorted(want["metrics"]), what
    worst = {"metrics": 0.0, "adapter": 0.0}
    for step, metrics in want["metrics"].items():
        assert got["metrics"][step].keys() == metrics.keys(), (what, step)
        for key, value in metrics.items():
            if key in ("train/lr", "train/tokens", "train/epoch"):
                assert got["metrics"][step][key] == value, (what, step, key)
                continue
            rel = _rel(got["metrics"][step][key], value)
            worst["metrics"] = max(worst["metrics"], rel)
            assert rel <= _LOSS_RTOL, (what, step, key, got["metrics"][step][key], value)
    assert got["adapter"].keys() == want["adapter"].keys()
    for name, w in want["adapter"].items():
        rel = float((got["adapter"][name] - w).norm() / w.norm())
        worst["adapter"] = max(worst["adapter"], rel)
        assert rel <= adapter_rtol, (what, name, rel)
    print(f"{what}: worst relative difference {worst}")
    return worst


@pytest.fixture
def dataset(tmp_path) -> Path:
    """Ten chat rows: 8 train, 2 eval."""
    return write_jsonl(tmp_path / "chat.jsonl", [chat_row(a, b) for a, b in PAIRS])


def test_a_group_trains_like_one_process(tiny_model_dir, dataset, tmp_path):
    """Gradient accumulation 2: steps of 2 micro-batches, 1 per rank."""
    hp = SftHyperparams(**BASE, gradient_accumulation_steps=2)
    want = _one_process(tiny_model_dir, dataset, hp, tmp_path)
    got = _on_group(tiny_model_dir, dataset, hp, tmp_path)
    assert sorted(got["checkpoints"]) == [2, 4]
    assert all("eval/loss" in got["metrics"][s] for s in (2, 4))
    _compare(got, want, "2 ranks vs one process, accum 2")


def test_uneven_shares_and_resume_on_the_other_layout(tiny_model_dir, dataset, tmp_path):
    """Gradient accumulation 3: 8 examples in steps of 6, so steps of 3 micro-batches (2 / 1) and of 1 (1 / 0: rank
    1 runs a padding micro-batch only). Then the group's step-2 checkpoint continued on one process, and the one
    process's continued on the group, both against the uninterrupted one-process run."""
    hp = SftHyperparams(**BASE, gradient_accumulation_steps=3)
    want = _one_process(tiny_model_dir, dataset, hp, tmp_path / "one")
    group = _on_group(tiny_model_dir, dataset, hp, tmp_path / "group")
    _compare(group, want, "2 ranks vs one process, accum 3 (uneven)")

    from_group = SftCheckpoint(2, Path(group["checkpoints"][2]))
    assert (from_group.state_dir / "dcp").is_dir()  # the sharded checkpoint layout
    on_one = _one_process(tiny_model_dir, dataset, hp, tmp_path / "resumed-1p", resume=from_group)
    on_group = _on_group(tiny_model_dir, dataset, hp, tmp_path / "resumed-2",
                         resume=SftCheckpoint(2, Path(want["checkpoints"][2])))
    tail = {**want, "metrics": {s: m for s, m in want["metrics"].items() if s > 2}}
    _compare(on_one, tail, "2-rank checkpoint resumed on one process")
    _compare(on_group, tail, "one-process checkpoint resumed on 2 ranks")


@pytest.mark.parametrize("family, layout", [("qwen3", {"cp": 2}), ("qwen3_moe", {"dp_shard": 2, "ep": 2})],
                         ids=["cp2", "moe-ep2"])
def test_context_and_expert_parallel_layouts_train_like_one_process(family_dirs, dataset, tmp_path, family, layout):
    """cp 2: both ranks take every micro-batch (dp 1), each runs its half of every sequence. ep 2 on the MoE model:
    FSDP over 2 ranks, each holding half of the experts. 2 steps (one checkpoint, evaluated)."""
    hp = SftHyperparams(**{**BASE, "max_steps": 2}, gradient_accumulation_steps=3)
    want = _one_process(family_dirs[family], dataset, hp, tmp_path)
    got = run_ranks(_group_run, 2, str(family_dirs[family]), str(dataset), hp.to_json(), str(tmp_path / "work-2"),
                    str(tmp_path / "saved-2"), None, 0, layout=layout)[0]
    _compare(got, want, f"{family} {layout} vs one process", _CP_ADAPTER_RTOL if "cp" in layout else _ADAPTER_RTOL)
