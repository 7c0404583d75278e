"""Context parallelism inside the training engine (cp alone, cp x FSDP, cp x ep x FSDP) against the named reference:
the single-process engine (TrainingEngine.load without parallel) on the same model directory, the same datums, the
same loss and the same AdamW settings, run in the test's own process. test_parallel_fsdp.py's pattern and checks.

Each data-parallel rank receives its contiguous share of the datums (split_for_ranks over dp only: the cp ranks of
a group get the SAME datums) and the call's global batch scale. Micro-batches of at most 20 tokens hold datums of
5..12 tokens, so most packed rows are not a multiple of 2 cp tokens (the engine's padding document is exercised)
and some dp ranks run padding micro-batches.

Compared, per rank: the call's loss metric; the per-datum logprobs a ForwardBackward returns (the whole datum's,
gathered over the cp group, in order) against the reference's for the same datums; the gradient of every trainable
parameter (DTensors gathered with full_tensor); the gradient norm and the weights after one clipped AdamW step; the
loaded state exactly. Losses: cross_entropy (signed weights), importance_sampling and ppo (RL inputs whose sampling
logprobs are the reference's logprobs plus noise, so ratios lie around 1 and ppo clips some tokens), and gspo, the
one built-in loss nonlinear in a whole datum's logprobs (its sequence ratio exp(mean(lp - q))). The engine computes
every loss on the whole datum's logprobs on every cp rank (gathered; the graph kept on the rank's own tokens), so
all the built-in losses are available under cp; gspo and grpo/dapo's masks are covered by that.
One case runs with activation checkpointing (the layers' forwards, ring attention included, recomputed in the
backward), against the same reference. Managed SFT's path: engine.nll_sum over a packed batch (value and every gradient) under cp 2 and cp 2 x dp_shard 2.

Tolerances (float32 on the CPU, one thread per rank): ring attention sums its blocks in another order (blockwise
online softmax), and the gradients are summed over the cp and dp ranks in the collective's order, so results agree
to float32 rounding. The FSDP test's bounds (test_parallel_fsdp._compare): loss relative 1e-6; gradients and the
norm max |diff| <= 1e-5 * max |reference| per tensor (measured <= 2.0e-6); weights after the step
5e-7 + 1e-6 |w| elementwise, with AdamW eps 1e-4 (the FSDP test's 1e-7 atol is raised here: AdamW's first step
moves a weight by lr * g / (|g| + eps), so a gradient rounding difference dg moves it by up to lr * dg / eps =
10 dg; ring attention's block sums give dg up to ~2e-6 * max |g| ~ 6e-8 on LoRA B matrices, whose gradients are
near eps, i.e. up to ~6e-7; measured up to 2.4e-7 on those, <= 4.8e-7 on full-parameter weights of order 1);
logprobs max |diff| <= 1e-5 (logprobs of order 5-10; measured 9.5e-7, an ulp); nll_sum relative 1e-6 (measured
<= 1.1e-7), its gradients as above. The measured maxima are printed per case (pytest -s).
"""
from __future__ import annotations

import contextlib

import pytest
import torch

from services.trainer.engine import TrainingEngine
from services.trainer.engine.forward_backward import (Datum, LossRequest, MicroBatcher, check_loss_request, run_call,
                                                      split_for_ranks)
from services.trainer.engine.losses import batch_scale, check_datum
from services.trainer.engine.parallel import ParallelDims
from services.trainer.engine.parallel.expert import expert_shards
from tests.services.trainer.parallel.ranks import run_ranks
from tests.services.trainer.parallel.test_parallel_fsdp import (LORA, SETTINGS, _compare, _datums, _full, _max_rel,
                                                                _named_trainable)

_LOGPROB_ATOL, _NLL_RTOL, _WEIGHT_ATOL = 1e-5, 1e-6, 5e-7
_MICRO_BATCH_TOKENS = 20


def _rl_datums(ce: list[Datum], logprobs: list[torch.Tensor], loss_fn: str, seed: int = 1) -> list[Datum]:
    """RL datums on the CE datums' tokens: sampling logprobs q = the reference's logprobs + N(0, 0.05) noise (ratios
    around 1, some beyond ppo's clip), advantages N(0, 1)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i, (d, lp) in enumerate(zip(ce, logprobs)):
        T = d.length
        inputs = {"target_tokens": d.targets, "logprobs": (lp + 0.05 * torch.randn(T, generator=g)).float(),
                  "advantages": torch.randn(T, generator=g)}
        out.append(Datum(d.tokens, check_datum(loss_fn, inputs, T, 1 << 30, f"data[{i}]")))
    return out


def _train_once(engine: TrainingEngine, datums: list[Datum], req: LossRequest) -> dict:
    """test_parallel_fsdp._train_once with the call's loss and its returned logprobs."""
    out = {"state": {k: _full(v) for k, v in engine.model.state_dict().items()},
           "param_names": [n for n, _ in engine.model.named_parameters()], "lora_keys": []}
    if engine.lora:
        from models.lora import lora_state_dict

        out["lora_keys"] = sorted(lora_state_dict(engine.model))
    share = split_for_ranks(datums, engine.dp_size)[engine.dp_rank]
    c = batch_scale(req.loss_fn, req.config, [d.inputs for d in datums])
    call = engine.loss_call(req, backward=True, deterministic=False, lock=contextlib.nullcontext, batch_scale=c)
    out["logprobs"], out["metrics"] = run_call(call, share)
    trainable = _named_trainable(engine)
    out["grads"] = {n: _full(p.grad) for n, p in trainable.items()}
    out["norm"] = float(engine.step(SETTINGS))
    out["weights"] = {n: _full(p) for n, p in trainable.items()}
    out["steps"] = engine.steps
    return out


def _rank(model_dir, lora, dims: dict, datums: list[Datum], req: LossRequest, ac: bool) -> dict:
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    engine = TrainingEngine.load(model_dir, lora=lora, seed=3, optimizer=SETTINGS, device="cpu",
                                 parallel=ParallelDims(**dims), activation_checkpointing=ac)
    assert engine.context_parallel is not None and engine.context_parallel.size == dims["cp"]
    out = _train_once(engine, datums, req)
    out["rank"], out["dp_rank"] = dist.get_rank(), engine.dp_rank
    out["sharded"] = all(isinstance(p, DTensor) for p in engine.model.parameters())
    out["held"] = expert_shards(engine.model)
    return out


def _case_datums(model_dir, loss_fn: str) -> tuple[list[Datum], int]:
    single = TrainingEngine.load(model_dir, lora=None, seed=3, optimizer=SETTINGS, device="cpu")
    vocab = single.model.args.vocab_size
    ce = _datums(vocab)
    if loss_fn == "cross_entropy":
        return ce, vocab
    req = LossRequest("cross_entropy", {}, _MICRO_BATCH_TOKENS)
    call = single.loss_call(req, backward=False, deterministic=False, lock=contextlib.nullcontext)
    logprobs, _ = run_call(call, ce)
    return _rl_datums(ce, logprobs, loss_fn), vocab


_CASES = [  # (family, lora, world size, dims, loss); "+ac": with activation checkpointing (the ring recomputed)
    ("qwen3", LORA, 2, dict(cp=2), "cross_entropy"),
    ("qwen3", None, 2, dict(cp=2), "ppo"),
    ("qwen3", LORA, 4, dict(dp_shard=2, cp=2), "importance_sampling"),
    ("qwen3", None, 4, dict(dp_shard=2, cp=2), "cross_entropy"),
    ("qwen3_moe", None, 2, dict(cp=2), "cross_entropy"),
    ("qwen3_moe", LORA, 2, dict(cp=2), "gspo"),
    ("qwen3_moe", LORA, 4, dict(dp_shard=2, cp=2), "cross_entropy"),
    ("qwen3_moe", None, 4, dict(dp_shard=2, cp=2), "ppo"),
    ("deepseek_v3", LORA, 2, dict(cp=2), "cross_entropy"),
    ("deepseek_v3", None, 2, dict(cp=2), "importance_sampling+ac"),
    ("deepseek_v3", None, 4, dict(dp_shard=2, cp=2), "cross_entropy"),
    ("deepseek_v3", LORA, 4, dict(dp_shard=2, cp=2), "ppo"),
    ("qwen3_moe", None, 4, dict(dp_shard=2, cp=2, ep=2), "cross_entropy"),  # cp x ep x fsdp
    ("qwen3_moe", LORA, 4, dict(dp_shard=2, cp=2, ep=2), "ppo"),
]


@pytest.mark.parametrize("family, lora, world, dims, loss_fn", _CASES, ids=[
    f"{f}-{'lora' if lo else 'full'}-{w}-{'x'.join(f'{k}{v}' for k, v in d.items())}-{loss}"
    for f, lo, w, d, loss in _CASES])
def test_context_parallel_engine_matches_the_single_process_engine(family_dirs, family, lora, world, dims, loss_fn):
    model_dir = family_dirs[family]
    loss_fn, ac = loss_fn.removesuffix("+ac"), loss_fn.endswith("+ac")
    datums, _ = _case_datums(model_dir, loss_fn)
    config = {"clip_low_threshold": 0.95, "clip_high_threshold": 1.05} if loss_fn == "ppo" else {}
    req = check_loss_request(loss_fn, config, _MICRO_BATCH_TOKENS, _MICRO_BATCH_TOKENS)
    ref_engine = TrainingEngine.load(model_dir, lora=lora, seed=3, optimizer=SETTINGS, device="cpu")
    ref = _train_once(ref_engine, datums, req)
    if loss_fn == "ppo":  # the clip is active on some tokens (their gradient is cut), not on all
        assert 0.0 < ref["metrics"]["clip_fraction:mean"] < 1.0, ref["metrics"]
    batcher = MicroBatcher(_MICRO_BATCH_TOKENS)
    rows = [sum(d.length for d in mb) for share in split_for_ranks(datums, world // dims["cp"])
            for mb in [*(mb for d in share for mb in batcher.add(d)), *batcher.finish()]]
    assert any(n % (2 * dims["cp"]) for n in rows), rows  # the engine pads some rows (its padding document)
    ranks = run_ranks(_rank, world, model_dir, lora, dims, datums, req, ac)
    worst = _compare(ranks, ref, weight_atol=_WEIGHT_ATOL)
    dp_size = world // dims["cp"]
    shares = split_for_ranks(list(range(len(datums))), dp_size)
    worst["logprob_abs"] = 0.0
    for got in ranks:
        want = [ref["logprobs"][i] for i in shares[got["dp_rank"]]]
        assert len(got["logprobs"]) == len(want)
        for g, w in zip(got["logprobs"], want):
            assert g.shape == w.shape
            diff = float((g - w).abs().max())
            worst["logprob_abs"] = max(worst["logprob_abs"], diff)
            assert diff <= _LOGPROB_ATOL, diff
    print(f"\n{family} {'lora' if lora else 'full'} world {world} {dims} {loss_fn} ac={ac}: {worst}")


def _packed_batch(vocab: int, lengths: list[int], seed: int = 5):
    """One packed SFT row (B = 1) of documents of these lengths (sft.py's layout: each document's last target is
    IGNORE_INDEX), its Packing."""
    from kernels import Packing
    from kernels.logprobs import IGNORE_INDEX

    g = torch.Generator().manual_seed(seed)
    tokens, targets = [], []
    for n in lengths:
        doc = torch.randint(3, vocab, (n + 1,), generator=g)
        tokens.append(doc[:-1])
        tgt = doc[1:].clone()
        tgt[-1] = IGNORE_INDEX
        targets.append(tgt)
    return torch.cat(tokens)[None], torch.cat(targets)[None], Packing.from_lengths(lengths)


_SFT_LENGTHS = [7, 12, 4, 10]  # 33 tokens: padded to 36 under cp 2


def _nll_grads(engine: TrainingEngine, packed: bool) -> dict:
    vocab = engine.model.args.vocab_size
    tokens, targets, packing = _packed_batch(vocab, _SFT_LENGTHS)
    if not packed:  # two unpacked rows of 11 tokens (padded to 12)
        tokens, targets, packing = tokens[:, :22].reshape(2, 11), targets[:, :22].reshape(2, 11), None
    nll = engine.nll_sum(tokens, targets, packing=packing)
    nll.backward()
    return {"nll": float(nll.detach()), "grads": {n: _full(p.grad) for n, p in _named_trainable(engine).items()}}


def _nll_rank(model_dir, lora, dims: dict, packed: bool) -> dict:
    from services.common.errors import InvalidArgument

    engine = TrainingEngine.load(model_dir, lora=lora, seed=3, optimizer=SETTINGS, device="cpu",
                                 parallel=ParallelDims(**dims))
    req = LossRequest("cross_entropy", {}, _MICRO_BATCH_TOKENS)
    try:  # ring attention cannot be batch-invariant: refused before any datum
        engine.loss_call(req, backward=True, deterministic=True, lock=contextlib.nullcontext, batch_scale=1.0)
        refused = None
    except InvalidArgument as exc:
        refused = exc.violations[0].field
    return {**_nll_grads(engine, packed), "refused": refused}


@pytest.mark.parametrize("family, lora, world, dims, packed", [
    ("qwen3", LORA, 2, dict(cp=2), True),
    ("deepseek_v3", None, 2, dict(cp=2), False),
    ("qwen3_moe", None, 4, dict(dp_shard=2, cp=2), True),
], ids=["qwen3-lora-cp2-packed", "deepseek_v3-full-cp2-rows", "qwen3_moe-full-dp_shard2xcp2-packed"])
def test_nll_sum_over_context_parallel_matches_the_single_process_engine(family_dirs, family, lora, world, dims,
                                                                          packed):
    """Managed SFT's loss (engine.nll_sum, every rank of the mesh passing the same batch: FSDP then sums the same
    gradient over the dp_shard ranks, so the reference is dp_shard times the single-process gradient) under cp;
    and a deterministic-mode call refused by a cp engine."""
    model_dir = family_dirs[family]
    ref = _nll_grads(TrainingEngine.load(model_dir, lora=lora, seed=3, optimizer=SETTINGS, device="cpu"), packed)
    copies = world // dims["cp"]
    worst = {"nll_rel": 0.0, "grad_rel": 0.0}
    for got in run_ranks(_nll_rank, world, model_dir, lora, dims, packed):
        assert got["refused"] == "deterministic"
        rel = abs(got["nll"] - ref["nll"]) / abs(ref["nll"])
        worst["nll_rel"] = max(worst["nll_rel"], rel)
        assert rel <= _NLL_RTOL, (got["nll"], ref["nll"])
        assert got["grads"].keys() == ref["grads"].keys()
        for n, g in ref["grads"].items():
            rel = _max_rel(got["grads"][n], copies * g)
            worst["grad_rel"] = max(worst["grad_rel"], rel)
            assert rel <= 1e-5, (n, rel)
    print(f"\nnll_sum {family} {'lora' if lora else 'full'} {dims} packed={packed}: {worst}")
