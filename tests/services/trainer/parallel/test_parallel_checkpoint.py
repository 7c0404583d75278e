"""Checkpoints of the sharded engine (parallel/sharded_checkpoint.py: torch.distributed.checkpoint under state/dcp/,
the weights gathered by rank 0) against the named references: the uninterrupted run on the saving layout, and the
single-process engine (TrainingEngine.load without parallel, run in the test's own process) for exports and for
loads on one process.

Each case trains k = 1 AdamW step (clipping active) on N ranks, saves, and trains one more step ("uninterrupted");
then an engine on another layout (M ranks, another ep, or one process) restores the checkpoint and takes the same
step. Compared: the restored weights and AdamW moments and the step count right after loading (exactly: DCP copies
the bytes, resharded), the weights and moments after the continued step, and the export (weights/) against what
the single-process engine writes for the same weights (identical bytes).

Tolerances (float32 on the CPU): the same layout continues bitwise (the same ranks run the same ops). Another layout
sums each gradient over ranks in another order, so the continued step agrees as in test_parallel_fsdp.py: weights
|diff| <= 1e-7 + 1e-6 * |w| elementwise (a few ulps; AdamW eps 1e-4 as there, so that a ~0 gradient's rounding
noise cannot move a weight by a sizeable part of lr), moments max |diff| <= 1e-5 * max |reference| per tensor.
Measured (printed per case with pytest -s): restored state bitwise everywhere; continued on the same layout (4 -> 4)
bitwise; on another layout weights max |diff| 1.2e-7 (full-parameter, weights of order 1), 7.5e-9 (LoRA), moments
max relative 6.7e-6 (qwen3_moe full, ep 2 -> one process: the gradients' rounding, squared in exp_avg_sq).
"""
from __future__ import annotations

import contextlib
import filecmp
import math
from pathlib import Path

import pytest
import torch

from services.trainer.engine import AdamW, TrainingEngine
from services.trainer.engine.checkpoint import CheckpointMismatch, read_checkpoint
from services.trainer.engine.forward_backward import run_call, split_for_ranks
from services.trainer.engine.losses import batch_scale
from services.trainer.engine.parallel import ParallelDims
from services.trainer.engine.parallel.sharded_checkpoint import saved_keys
from tests.services.trainer.parallel.ranks import run_ranks
from tests.services.trainer.parallel.test_parallel_fsdp import LORA, REQ, _datums

SETTINGS = AdamW(learning_rate=1e-3, eps=1e-4, weight_decay=0.01, grad_clip_norm=0.5)
_WEIGHT_ATOL, _WEIGHT_RTOL, _MOMENT_RTOL = 1e-7, 1e-6, 1e-5
BASE = "tiny-base"


def _engine(model_dir, lora, dims: dict | None) -> TrainingEngine:
    return TrainingEngine.load(model_dir, lora=lora, seed=3, optimizer=SETTINGS, device="cpu",
                               parallel=None if dims is None else ParallelDims(**dims))


def _step(engine: TrainingEngine, seed: int) -> float:
    datums = _datums(engine.model.args.vocab_size, seed=seed)
    c = batch_scale(REQ.loss_fn, REQ.config, [d.inputs for d in datums])
    call = engine.loss_call(REQ, backward=True, deterministic=False, lock=contextlib.nullcontext, batch_scale=c)
    run_call(call, split_for_ranks(datums, engine.dp_size)[engine.dp_rank])
    return float(engine.step(SETTINGS))


def _snapshot(engine: TrainingEngine) -> dict:
    """The whole trainable weights and AdamW moments (gathered from the shards and the ep ranks), the step count."""
    names = {id(p): n for n, p in engine.model.named_parameters()}
    params = {names[id(p)]: p for p in engine.params}
    out = {"steps": engine.steps}
    for part, of in (("weights", lambda p: p), ("exp_avg", lambda p: engine.optimizer.state[p]["exp_avg"]),
                     ("exp_avg_sq", lambda p: engine.optimizer.state[p]["exp_avg_sq"])):
        tensors = {n: of(p) for n, p in params.items()}
        if engine.mesh is None:
            out[part] = {n: t.detach().clone() for n, t in tensors.items()}
        else:
            from services.trainer.engine.parallel.sharded_checkpoint import gather_whole

            out[part] = {n: t.detach() for n, t in gather_whole(engine, tensors).items()}
    out["adam_steps"] = sorted({float(engine.optimizer.state[p]["step"]) for p in params.values()})
    return out


def _train_save(model_dir, lora, dims: dict | None, root: str) -> dict:
    """k = 1 step, save under root, one more step: the snapshots at the save and after the uninterrupted step."""
    engine = _engine(model_dir, lora, dims)
    _step(engine, seed=0)
    engine.save(Path(root), base_model=BASE, progress={"step": 1})
    saved = _snapshot(engine)
    _step(engine, seed=1)
    return {"saved": saved, "continued": _snapshot(engine)}


def _load_train(model_dir, lora, dims: dict | None, root: str) -> dict:
    """Restore root into a fresh engine of this layout, then the same second step: the snapshots."""
    engine = _engine(model_dir, lora, dims)
    engine.restore(read_checkpoint(Path(root)), rng=True)
    loaded = _snapshot(engine)
    _step(engine, seed=1)
    return {"loaded": loaded, "continued": _snapshot(engine)}


def _run(model_dir, lora, world: int, dims: dict | None, fn, root: Path) -> dict:
    """fn on `world` ranks (dims) or in this process (world 1, dims None): rank 0's result."""
    if dims is None:
        return fn(model_dir, lora, None, str(root))
    return run_ranks(fn, world, model_dir, lora, dims, str(root))[0]


def _max_rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-30))


def _compare(got: dict, want: dict, *, bitwise: bool) -> dict:
    worst = {"weight_abs": 0.0, "moment_rel": 0.0}
    assert got["steps"] == want["steps"] and got["adam_steps"] == want["adam_steps"]
    for part in ("weights", "exp_avg", "exp_avg_sq"):
        assert got[part].keys() == want[part].keys()
        for n, w in want[part].items():
            g = got[part][n]
            if bitwise:
                assert torch.equal(g, w), (part, n, float((g - w).abs().max()))
            elif part == "weights":
                diff = (g - w).abs()
                worst["weight_abs"] = max(worst["weight_abs"], float(diff.max()))
                assert bool((diff <= _WEIGHT_ATOL + _WEIGHT_RTOL * w.abs()).all()), (n, float(diff.max()))
            else:
                rel = _max_rel(g, w)
                worst["moment_rel"] = max(worst["moment_rel"], rel)
                assert rel <= _MOMENT_RTOL, (part, n, rel)
    return worst


def _same_export(a: Path, b: Path) -> None:
    names = sorted(p.name for p in a.iterdir())
    assert names == sorted(p.name for p in b.iterdir()) and names
    match, mismatch, errors = filecmp.cmpfiles(a, b, names, shallow=False)
    assert not mismatch and not errors, (mismatch, errors)


_CASES = [  # (family, lora, (world, dims) saving, [(world, dims) loading ...]); dims None: the single-process engine
    ("qwen3", LORA, (2, dict(dp_shard=2)), [(4, dict(dp_shard=4)), (1, None)]),
    ("qwen3", None, (4, dict(dp_shard=4)), [(2, dict(dp_shard=2)), (4, dict(dp_shard=4))]),
    ("qwen3", None, (1, None), [(2, dict(dp_shard=2))]),
    ("qwen3_moe", None, (2, dict(dp_shard=2, ep=2)), [(1, None), (2, dict(dp_shard=2))]),
    ("qwen3_moe", LORA, (2, dict(dp_shard=2)), [(2, dict(dp_shard=2, ep=2))]),
    ("qwen3_moe", LORA, (1, None), [(2, dict(dp_shard=2, ep=2))]),  # optimizer.pt's moments into held experts
]


def _name(case) -> str:
    family, lora, save, loads = case
    layout = lambda wd: "1" if wd[1] is None else f"{wd[0]}{''.join(f'-{k}{v}' for k, v in wd[1].items())}"  # noqa
    return f"{family}-{'lora' if lora else 'full'}-{layout(save)}-to-{'+'.join(layout(w) for w in loads)}"


@pytest.mark.parametrize("family, lora, save, loads", _CASES, ids=[_name(c) for c in _CASES])
def test_checkpoint_continues_on_another_layout(family_dirs, tmp_path, family, lora, save, loads):
    model_dir = family_dirs[family]
    root = tmp_path / "ckpt"
    first = _run(model_dir, lora, *save, _train_save, root)
    ckpt = read_checkpoint(root)
    assert ckpt.optim_steps == 1 and ckpt.progress == {"step": 1} and (ckpt.lora is None) == (lora is None)
    assert ckpt.has_dcp == (save[1] is not None)
    if save[1] is not None:
        assert ckpt.parallel["world_size"] == save[0] and ckpt.parallel["ep"] == save[1].get("ep", 1)
    single = _engine(model_dir, lora, None)
    if save[1] is not None:  # every trainable tensor stored whole, whatever the ep (lora_B as its [F, r, E] view)
        whole = {f"model.{n}": p.numel() for n, p in single.model.named_parameters() if p.requires_grad}
        stored = {k: math.prod(v) for k, v in saved_keys(ckpt.state_dir / "dcp").items() if k.startswith("model.")}
        assert stored == whole
    if ckpt.has_dcp:  # a distributed LoRA checkpoint into a full-parameter engine, or the reverse: refused
        with pytest.raises(CheckpointMismatch, match="LoRA"):
            _engine(model_dir, None if lora else LORA, None).restore(ckpt)
    # the export: the single-process engine with the same weights writes the same files
    single.restore(ckpt, optimizer=False)
    single.save_weights(tmp_path / "single-export", base_model=BASE)
    _same_export(ckpt.weights_dir, tmp_path / "single-export")
    for world, dims in loads:
        got = _run(model_dir, lora, world, dims, _load_train, root)
        _compare(got["loaded"], first["saved"], bitwise=True)  # restored exactly, resharded
        same_layout = (world, dims) == save
        worst = _compare(got["continued"], first["continued"], bitwise=same_layout)
        print(f"\n{_name((family, lora, save, [(world, dims)]))}: continued {worst}")


def _pending_save(model_dir, lora, dims: dict, root: str) -> dict:
    """One step, then a ForwardBackward whose gradients are still pending at the save: the gathered gradients."""
    from services.trainer.engine.parallel.sharded_checkpoint import gather_whole

    engine = _engine(model_dir, lora, dims)
    _step(engine, seed=0)
    datums = _datums(engine.model.args.vocab_size, seed=1)
    c = batch_scale(REQ.loss_fn, REQ.config, [d.inputs for d in datums])
    call = engine.loss_call(REQ, backward=True, deterministic=False, lock=contextlib.nullcontext, batch_scale=c)
    run_call(call, split_for_ranks(datums, engine.dp_size)[engine.dp_rank])
    engine.save(Path(root), base_model=BASE, progress={})
    names = {id(p): n for n, p in engine.model.named_parameters()}
    return {n: g.detach() for n, g in gather_whole(engine, {names[id(p)]: p.grad for p in engine.params}).items()}


def test_pending_gradients_of_an_expert_parallel_engine_restore_on_one_process(family_dirs, tmp_path):
    """Gradients pending at the save (a session saved between ForwardBackward and OptimStep) are in state/dcp/
    (grad.<name>, experts whole) and restore exactly into the single-process engine, with restore(gradients=True)
    only; the same engine's own gradients for those datums agree to the sharding's rounding (test_parallel_fsdp)."""
    model_dir = family_dirs["qwen3_moe"]
    saved = run_ranks(_pending_save, 2, model_dir, LORA, dict(dp_shard=2, ep=2), str(tmp_path))[0]
    single = _engine(model_dir, LORA, None)
    single.restore(read_checkpoint(tmp_path))
    assert all(p.grad is None for p in single.params)
    single.restore(read_checkpoint(tmp_path), gradients=True)
    names = {id(p): n for n, p in single.model.named_parameters()}
    got = {names[id(p)]: p.grad for p in single.params}
    assert got.keys() == saved.keys() and any(".experts." in n for n in got)
    for n, g in saved.items():
        assert torch.equal(got[n], g), n
    own = _engine(model_dir, LORA, None)
    _step(own, seed=0)
    datums = _datums(own.model.args.vocab_size, seed=1)
    run_call(own.loss_call(REQ, backward=True, deterministic=False, lock=contextlib.nullcontext), datums)
    own_names = {id(p): n for n, p in own.model.named_parameters()}
    for p in own.params:
        assert _max_rel(got[own_names[id(p)]], p.grad) <= 1e-5, own_names[id(p)]
