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
    out["layers"] = [m.layer_ids for m in engine.stage_models]
    return out


def _merged(ranks: list[dict], ref: dict, pp: int) -> list[dict]:
    """One result per data-parallel coordinate: its pp ranks' parts together, in the reference's order (the tied
    lm_head copy checked equal to the embeddings and dropped, as the single-process engine has one Parameter)."""
    by_dp = defaultdict(list)
    for r in ranks:
        by_dp[r["dp_rank"]].append(r)
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
    shares = split_for_ranks(list(range(len(datums))), len(merged))
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
]


@pytest.mark.parametrize("family, lora, world, dims", _CASES, ids=[
    f"{f}-{'lora' if lo else 'full'}-{w}-{'x'.join(f'{k}{v}' for k, v in d.items())}" for f, lo, w, d in _CASES])
def test_pipeline_engine_matches_the_single_process_engine(family_dirs, family, lora, world, dims):
    ranks, worst = _check(family_dirs[family], lora, world, dims)
    assert sorted(r["layers"] for r in ranks) == [[[0, 1]], [[0, 1]], [[2, 3]], [[2, 3]]]  # 4 layers, 2 stages
    print(f"\n{family} {'lora' if lora else 'full'} world {world} {dims}: {worst}")
