"""Pipeline parallelism inside the training engine (TrainingEngine.load(parallel=ParallelDims(pp=2, ...))): each
stage sharded over the rest of the mesh (FSDP, expert parallelism), against the named reference, the single-process
engine (TrainingEngine.load without parallel) on the same model directory, datums, loss and AdamW settings, run in
the test's own process. test_parallel_fsdp.py's pattern and checks.

Each data-parallel rank receives its contiguous share of the datums (split_for_ranks over dp) and the call's global
batch scale; the pp ranks of a pipeline receive the same share. A rank returns what it holds (its stages' state,
gradients and weights after one clipped AdamW step, gathered over the stage's shards); the ranks at one
data-parallel coordinate together hold the whole model once (the tied lm_head of the last stage is a second copy of
the first stage's embeddings: its gradient and weights must equal theirs exactly), and are compared as one with
test_parallel_fsdp._compare: the loaded state exactly (weights, the LoRA adapter's seeded init: apply_stage_lora
draws the single-process engine's values), the loss metric, every trainable gradient, the global gradient norm
(summed over the stages; the clip is active) and the weights after the step. The logprobs every rank returns (its
datums', broadcast from the last stage) are compared with the reference's too.

Tolerances (float32 on the CPU, one thread per rank): the pipeline's rows are padded to micro_batch_tokens (matmuls
of another shape), gradients are summed over the dp ranks in the collective's order and the tied gradient's copies
in another order, so results agree to float32 rounding: loss relative 1e-6; gradients and the norm max |diff| <=
1e-5 * max |reference| per tensor; logprobs max |diff| <= 1e-5; weights after the step 5e-7 + 1e-6 |w| elementwise
with AdamW eps 1e-4 (test_parallel_context_engine.py's bound and reasoning: a gradient rounding difference dg moves
a weight by up to lr * dg / eps = 10 dg). The measured maxima are printed per case (pytest -s) and recorded in
docs/distributed.md.
"""
from __future__ import annotations

import contextlib
import math
from collections import defaultdict

import pytest
import torch
from torch.distributed.tensor import DTensor

from services.common.errors import InvalidArgument
from services.trainer.engine import TrainingEngine
from services.trainer.engine.forward_backward import run_call, split_for_ranks
from services.trainer.engine.losses import batch_scale
from services.trainer.engine.parallel import ParallelDims
from services.trainer.engine.parallel.expert import expert_shards
from tests.services.trainer.parallel.ranks import run_ranks
from tests.services.trainer.parallel.test_parallel_context_engine import _train_once
from tests.services.trainer.parallel.test_parallel_fsdp import LORA, REQ, SETTINGS, _compare, _datums, _full

_LOGPROB_ATOL, _WEIGHT_ATOL = 1e-5, 5e-7
TIED = "lm_head.weight"


def _stage_result(engine: TrainingEngine, datums) -> dict:
    """_train_once over this rank's stages: the state, gradients and weights of the tensors it holds (whole)."""
    from models.lora import lora_state_dict

    models = engine.stage_models
    out = {"state": {k: _full(v) for m in models for k, v in m.state_dict().items()},
           "param_names": [n for m in models for n, _ in m.named_parameters()],
           "lora_keys": sorted(k for m in models for k in lora_state_dict(m)) if engine.lora else []}
    share = split_for_ranks(datums, engine.dp_size)[engine.dp_rank]
    c = batch_scale(REQ.loss_fn, REQ.config, [d.inputs for d in datums])
    call = engine.loss_call(REQ, backward=True, deterministic=False, lock=contextlib.nullcontext, batch_scale=c)
    out["logprobs"], out["metrics"] = run_call(call, share)
    names = {id(p): n for m in models for n, p in m.named_parameters()}
    trainable = {names[id(p)]: p for p in engine.params}
    out["grads"] = {n: _full(p.grad) for n, p in trainable.items()}
    out["norm"] = float(engine.step(SETTINGS))
    out["weights"] = {n: _full(p) for n, p in trainable.items()}
    out["steps"] = engine.steps
    out["sharded"] = all(isinstance(p, DTensor) for m in models for p in m.parameters())
    out["held"] = {k: v for m in models for k, v in expert_shards(m).items()}
    return out


def _rank(model_dir, lora, dims: dict) -> dict:
    import torch.distributed as dist

    engine = TrainingEngine.load(model_dir, lora=lora, seed=3, optimizer=SETTINGS, device="cpu",
                                 parallel=ParallelDims(**dims))
    out = _stage_result(engine, _datums(engine.model.args.vocab_size))
    out["rank"], out["dp_rank"], out["pp_rank"] = dist.get_rank(), engine.dp_rank, engine.mesh["pp"].get_local_rank()
    out["cp_rank"] = engine.mesh["cp"].get_local_rank()
    out["layers"] = [m.layer_ids for m in engine.stage_models]
    return out


def _merged(ranks: list[dict], ref: dict, pp: int) -> list[dict]:
    """One result per (data-parallel, context-parallel) coordinate: its pp ranks' parts together, in the reference's
    order (the tied lm_head copy checked equal to the embeddings and dropped, as the single-process engine has one
    Parameter)."""
    by_dp = defaultdict(list)
    for r in ranks:
        by_dp[r["dp_rank"], r["cp_rank"]].append(r)
    out = []
    for parts in by_dp.values():
        assert sorted(p["pp_rank"] for p in parts) == list(range(pp))
        first = parts[0]
        for p in parts:  # every rank returns the whole call's metrics and the global norm
            assert p["metrics"] == first["metrics"] and p["norm"] == first["norm"] and p["steps"] == first["steps"]
        merged = {k: first[k] for k in ("metrics", "norm", "steps")}
        merged["sharded"] = all(p["sharded"] for p in parts)
        for part in ("state", "grads", "weights", "held"):
            union: dict = {}
            for p in parts:
                assert not union.keys() & p[part].keys(), part
                union.update(p[part])
            if part in ("grads", "weights") and TIED in union and "model.embed_tokens.weight" in union:
                assert torch.equal(union.pop(TIED), union["model.embed_tokens.weight"]), part
            merged[part] = union
        assert merged["state"].keys() == ref["state"].keys()
        merged["state"] = {k: merged["state"][k] for k in ref["state"]}
        names = {n for p in parts for n in p["param_names"]} - ({TIED} - set(ref["param_names"]))
        assert names == set(ref["param_names"])
        merged["param_names"] = ref["param_names"]
        merged["lora_keys"] = sorted(k for p in parts for k in p["lora_keys"])
        logprobs = [p["logprobs"] for p in parts]
        assert all(len(lp) == len(logprobs[0]) and all(torch.equal(a, b) for a, b in zip(lp, logprobs[0]))
                   for lp in logprobs)
        merged["logprobs"], merged["dp_rank"] = logprobs[0], first["dp_rank"]
        out.append(merged)
    return out


def _check(model_dir, lora, world: int, dims: dict) -> tuple[list[dict], dict]:
    ref_engine = TrainingEngine.load(model_dir, lora=lora, seed=3, optimizer=SETTINGS, device="cpu")
    datums = _datums(ref_engine.model.args.vocab_size)
    ref = _train_once(ref_engine, datums, REQ)
    ranks = run_ranks(_rank, world, str(model_dir), lora, dims)
    merged = _merged(ranks, ref, dims["pp"])
    worst = _compare(merged, ref, weight_atol=_WEIGHT_ATOL)
    shares = split_for_ranks(list(range(len(datums))), world // (dims["pp"] * dims.get("cp", 1)))
    worst["logprob_abs"] = 0.0
    for got in merged:
        want = [ref["logprobs"][i] for i in shares[got["dp_rank"]]]
        assert len(got["logprobs"]) == len(want)
        for g, w in zip(got["logprobs"], want):
            worst["logprob_abs"] = max(worst["logprob_abs"], float((g - w).abs().max()))
    assert worst["logprob_abs"] <= _LOGPROB_ATOL, worst
    return ranks, worst


_CASES = [  # (family, lora, world size, dims)
    ("qwen3", LORA, 4, dict(pp=2, dp_shard=2)),
    ("qwen3", None, 4, dict(pp=2, dp_shard=2)),
    ("qwen3_moe", LORA, 4, dict(pp=2, dp_shard=2)),
    ("qwen3_moe", None, 4, dict(pp=2, dp_shard=2)),
    ("deepseek_v3", LORA, 4, dict(pp=2, dp_shard=2)),
    ("deepseek_v3", None, 4, dict(pp=2, dp_shard=2)),
    ("qwen3_moe", LORA, 4, dict(pp=2, dp_shard=2, pipeline_schedule="interleaved_1f1b")),
    ("qwen3", None, 6, dict(pp=3, dp_shard=2)),  # a middle stage: it adds zeros (its shard) to the tied gradient
]
_LAYERS = {  # (schedule, pp): each rank's stages' layers, by (pp rank, dp rank); 4 layers
    ("1f1b", 2): [[[0, 1]], [[0, 1]], [[2, 3]], [[2, 3]]],
    ("interleaved_1f1b", 2): [[[0], [2]], [[0], [2]], [[1], [3]], [[1], [3]]],  # 4 stages, 2 per rank
    ("1f1b", 3): [[[0]], [[0]], [[1, 2]], [[1, 2]], [[3]], [[3]]],  # the middle stage takes the extra layer
}


def _case_id(f, lo, w, d) -> str:
    return f"{f}-{'lora' if lo else 'full'}-{w}-{'x'.join(f'{k}{v}' for k, v in d.items())}"


@pytest.mark.parametrize("family, lora, world, dims", _CASES, ids=[_case_id(*c) for c in _CASES])
def test_pipeline_engine_matches_the_single_process_engine(family_dirs, family, lora, world, dims):
    ranks, worst = _check(family_dirs[family], lora, world, dims)
    assert [r["layers"] for r in sorted(ranks, key=lambda r: (r["pp_rank"], r["dp_rank"]))] == _LAYERS[
        dims.get("pipeline_schedule", "1f1b"), dims["pp"]]
    print(f"\n{family} {'lora' if lora else 'full'} world {world} {dims}: {worst}")


_4D_CASES = [  # world 8: pp 2 x dp_shard 2 x cp 2, with ep 2 (carved from dp_shard x cp) for the MoE families
    ("qwen3", LORA, 8, dict(pp=2, dp_shard=2, cp=2)),
    ("qwen3_moe", None, 8, dict(pp=2, dp_shard=2, cp=2, ep=2)),
    ("deepseek_v3", LORA, 8, dict(pp=2, dp_shard=2, cp=2, ep=2)),
    # the other training mode of each family
    ("qwen3", None, 8, dict(pp=2, dp_shard=2, cp=2)),
    ("qwen3_moe", LORA, 8, dict(pp=2, dp_shard=2, cp=2, ep=2)),
    ("deepseek_v3", None, 8, dict(pp=2, dp_shard=2, cp=2, ep=2)),
]


@pytest.mark.parametrize("family, lora, world, dims", _4D_CASES, ids=[_case_id(*c) for c in _4D_CASES])
def test_pipeline_engine_4d_matches_the_single_process_engine(family_dirs, family, lora, world, dims):
    """Context parallelism inside the pipeline: every row laid out with the zigzag layout (each stage sends this
    rank's [1, N / cp, D]), ring attention inside each stage, the last stage's loss on the whole datums' gathered
    logprobs (forward_backward.context_parallel_loss); experts over ep inside each stage."""
    ranks, worst = _check(family_dirs[family], lora, world, dims)
    assert {r["cp_rank"] for r in ranks} == {0, 1}
    print(f"\n{family} {'lora' if lora else 'full'} world {world} {dims}: {worst}")


# -- checkpoints -------------------------------------------------------------------------------------------------------
def _snapshot(engine: TrainingEngine) -> dict:
    """test_parallel_checkpoint._snapshot over this rank's stages: the whole trainable weights and AdamW moments of
    what it holds (gathered over the stage's shards), by name."""
    from services.trainer.engine.parallel.sharded_checkpoint import gather_whole

    names = {id(p): n for m in engine.stage_models for n, p in m.named_parameters()}
    params = {names[id(p)]: p for p in engine.params}
    out = {"steps": engine.steps, "dp_rank": engine.dp_rank}
    for part, of in (("weights", lambda p: p), ("exp_avg", lambda p: engine.optimizer.state[p]["exp_avg"]),
                     ("exp_avg_sq", lambda p: engine.optimizer.state[p]["exp_avg_sq"])):
        out[part] = {n: t.detach().clone()  # a single-process engine's are the live tensors
                     for n, t in gather_whole(engine, {n: of(p) for n, p in params.items()}).items()}
    out["adam_steps"] = sorted({float(engine.optimizer.state[p]["step"]) for p in params.values()})
    return out


def _train_save(model_dir, lora, dims: dict, root: str) -> dict:
    from pathlib import Path

    from tests.services.trainer.parallel.test_parallel_checkpoint import BASE, _engine, _step

    engine = _engine(model_dir, lora, dims)  # dims None: the single-process engine
    _step(engine, seed=0)
    engine.save(Path(root), base_model=BASE, progress={"step": 1})
    saved = _snapshot(engine)
    _step(engine, seed=1)
    return {"saved": saved, "continued": _snapshot(engine)}


def _load_train(model_dir, lora, dims: dict, root: str) -> dict:
    from pathlib import Path

    from services.trainer.engine.checkpoint import read_checkpoint
    from tests.services.trainer.parallel.test_parallel_checkpoint import _engine, _step

    engine = _engine(model_dir, lora, dims)
    engine.restore(read_checkpoint(Path(root)), rng=True)
    loaded = _snapshot(engine)
    _step(engine, seed=1)
    return {"loaded": loaded, "continued": _snapshot(engine)}


def _whole(ranks: list[dict], key: str) -> dict:
    """The snapshots of the ranks at data-parallel coordinate 0 (one per stage) together: the whole model's (the
    tied lm_head copy checked equal to the embeddings and dropped)."""
    parts = [r[key] for r in ranks if r[key]["dp_rank"] == 0]
    out = {"steps": parts[0]["steps"], "adam_steps": sorted({s for p in parts for s in p["adam_steps"]})}
    for part in ("weights", "exp_avg", "exp_avg_sq"):
        union: dict = {}
        for p in parts:
            assert not union.keys() & p[part].keys()
            union.update(p[part])
        if TIED in union and "model.embed_tokens.weight" in union:
            assert torch.equal(union.pop(TIED), union["model.embed_tokens.weight"]), part
        out[part] = union
    return out


_CKPT_CASES = [  # (family, lora, (world, dims) saving, [(world, dims) loading ...])
    ("qwen3", None, (4, dict(pp=2, dp_shard=2)), [(4, dict(pp=2, dp_shard=2)), (4, dict(dp_shard=4))]),
    ("qwen3_moe", LORA, (4, dict(pp=2, dp_shard=2)), [(4, dict(dp_shard=4, ep=2))]),
    ("qwen3", None, (1, None), [(4, dict(pp=2, dp_shard=2))]),  # a single-process checkpoint into stages
    ("qwen3_moe", LORA, (1, None), [(4, dict(pp=2, dp_shard=2))]),
]


@pytest.mark.parametrize("family, lora, save, loads", _CKPT_CASES, ids=[
    f"{c[0]}-{'lora' if c[1] else 'full'}-{'pp' if c[2][1] else 'single'}" for c in _CKPT_CASES])
def test_pipeline_engine_checkpoint_continues_like_the_uninterrupted_run(family_dirs, tmp_path, family, lora, save,
                                                                          loads):
    """Save after one step under pp 2 x dp_shard 2 (or on one process), then (a) the uninterrupted run's next step
    and (b) a fresh engine restoring the checkpoint and taking the same step: on the same layout bitwise the same;
    on another layout (DCP reshards the stages' tensors into dp_shard 4, ep 2 for the MoE; a single-process
    checkpoint's optimizer.pt is split into the stages by name) restored bitwise and continued within
    test_parallel_checkpoint.py's tolerances. The export (weights/, gathered from both stages by rank 0) restores
    into the single-process engine as the saved weights exactly, and that engine writes the same bytes."""
    from services.trainer.engine.checkpoint import read_checkpoint
    from tests.services.trainer.parallel.test_parallel_checkpoint import BASE, _compare, _engine, _same_export

    model_dir, root = str(family_dirs[family]), tmp_path / "ckpt"
    first = (run_ranks(_train_save, save[0], model_dir, lora, save[1], str(root)) if save[1] is not None
             else [_train_save(model_dir, lora, None, str(root))])
    saved, continued = _whole(first, "saved"), _whole(first, "continued")
    ckpt = read_checkpoint(root)
    assert ckpt.optim_steps == 1 and ckpt.has_dcp == (save[1] is not None)
    assert ckpt.parallel is None if save[1] is None else ckpt.parallel["pp"] == 2
    single = _engine(model_dir, lora, None)
    single.restore(ckpt, optimizer=False)
    names = {id(p): n for n, p in single.model.named_parameters()}
    got = {names[id(p)]: p.detach() for p in single.params}
    assert got.keys() == saved["weights"].keys()
    for n, w in saved["weights"].items():
        assert torch.equal(got[n], w), n
    single.save_weights(tmp_path / "single-export", base_model=BASE)
    _same_export(ckpt.weights_dir, tmp_path / "single-export")
    for world, dims in loads:
        ranks = run_ranks(_load_train, world, model_dir, lora, dims, str(root))
        _compare(_whole(ranks, "loaded"), saved, bitwise=True)
        worst = _compare(_whole(ranks, "continued"), continued, bitwise=dims == save[1])
        print(f"\n{family} {'lora' if lora else 'full'} {save[1]} -> {dims}: continued {worst}")


# -- settings and refusals ---------------------------------------------------------------------------------------------
def test_pipeline_settings_are_checked_by_name(family_dirs):
    from models.checkpoint import build_on_meta
    from services.trainer.engine.parallel.dims import from_mapping
    from services.trainer.engine.parallel.parallelize import parallelize

    with pytest.raises(InvalidArgument) as exc:
        from_mapping({"pp": 2, "pipeline_schedule": "zigzag"}, world_size=4, field_prefix="parallel.")
    assert exc.value.violations[0].field == "parallel.pipeline_schedule"
    assert from_mapping({"pp": 2, "pipeline_schedule": "zbv"}, world_size=4).dp_shard == 2
    whole = build_on_meta(family_dirs["qwen3"])  # 4 layers
    for degrees, field in ((dict(pp=8), "parallel.pp"),  # 8 stages
                           (dict(pp=4, pipeline_schedule="interleaved_1f1b"), "parallel.pp"),  # 2 per rank: 8
                           (dict(pp=2, tp=2), "parallel.tp"),
                           (dict(pp=2, pipeline_schedule="zbv"), "parallel.pipeline_schedule")):
        dims = ParallelDims(field_prefix="parallel.", **degrees).resolved(math.prod(
            v for k, v in degrees.items() if k != "pipeline_schedule"))
        with pytest.raises(InvalidArgument) as exc:
            parallelize(whole, dims, None, param_dtype=None)
        assert exc.value.violations[0].field == field, degrees


def _refusals(model_dir, single_root: str) -> dict:
    """What a pp 2 engine refuses, each with the field it names (or the error's text)."""
    from pathlib import Path

    from services.trainer.engine.checkpoint import CheckpointMismatch, read_checkpoint
    from services.trainer.engine.forward_backward import Datum, LossRequest

    engine = TrainingEngine.load(model_dir, lora=LORA, seed=3, optimizer=SETTINGS, device="cpu",
                                 parallel=ParallelDims(pp=2, field_prefix="parallel."))
    out = {}
    tokens = torch.arange(3, 13)[None]
    for name, call in (
            ("nll_sum", lambda: engine.nll_sum(tokens, tokens)),
            ("deterministic", lambda: engine.loss_call(REQ, backward=True, deterministic=True,
                                                       lock=contextlib.nullcontext)),
            ("too_long", lambda: run_call(engine.loss_call(LossRequest("cross_entropy", {}, 8), backward=True,
                                                           deterministic=False, lock=contextlib.nullcontext),
                                          [Datum(tokens[0], {"target_tokens": tokens[0],
                                                             "weights": torch.ones(10)})]))):
        try:
            call()
            out[name] = None
        except InvalidArgument as exc:
            out[name] = exc.violations[0].field
    assert all(p.grad is None for p in engine.params)  # nothing ran
    try:  # a full-parameter checkpoint into a LoRA engine
        engine.restore(read_checkpoint(Path(single_root)))
        out["checkpoint"] = None
    except CheckpointMismatch as exc:
        out["checkpoint"] = str(exc)
    return out


def test_pipeline_engine_refuses_what_it_cannot_run(family_dirs, tmp_path):
    """nll_sum (managed SFT's forward: a pipeline has no loss tensor to backpropagate), deterministic mode, a datum
    longer than the pipeline's rows, and a checkpoint of the other training mode: refused with the field or reason
    named, on every rank alike."""
    from tests.services.trainer.parallel.test_parallel_checkpoint import BASE, _engine

    model_dir = str(family_dirs["qwen3"])
    _engine(model_dir, None, None).save(tmp_path, base_model=BASE, progress={})
    for got in run_ranks(_refusals, 2, model_dir, str(tmp_path)):
        assert got["nll_sum"] == "parallel.pp" and got["deterministic"] == "deterministic"
        assert got["too_long"] == "data[0]"
        assert "full-parameter" in got["checkpoint"]
