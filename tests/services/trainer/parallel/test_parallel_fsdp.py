"""The engine over a mesh (FSDP2, HSDP, activation checkpointing, the model built on the meta device) against the
named reference: the single-process engine (TrainingEngine.load without parallel) on the same model directory, the
same datums, the same loss and the same AdamW settings, run in the test's own process.

Each rank receives its contiguous share of the datums (split_for_ranks) and the call's global batch scale; micro-
batches are small so that ranks run different numbers of them (the padding micro-batches are exercised).

Compared: the call's loss metrics; the gradient of every trainable parameter (DTensors gathered with full_tensor);
the gradient norm and the weights after one AdamW step with clipping active (the norm is above the clip); the
model's state right after loading (the weights exactly, the LoRA adapter's seeded init exactly); state-dict keys,
parameter names and PEFT adapter keys unchanged (HF names) with FSDP and activation checkpointing applied.

Tolerances (float32 on the CPU, one thread per rank): the sharded run sums each gradient over ranks in the
collective's order instead of one process's micro-batch order, so results agree to float32 rounding: loss relative
1e-6; gradients and the gradient norm max |diff| <= 1e-5 * max |reference| per tensor (measured <= 7.3e-7);
weights after the step |diff| <= 1e-7 + 1e-6 * |w| elementwise (measured max |diff| 4.8e-7 in full-parameter
runs, a few float32 ulps of weights of order 1: updates differing below an ulp round to different neighbours).
AdamW's first step moves a weight by lr * g / (|g| + eps) (g clipped): a rounding difference dg moves it by
lr * dg * eps / (|g| + eps)^2, up to lr * dg / eps where g ~ 0 (an entry whose true gradient is ~0 takes the sign of
its rounding noise). The clipped gradients here have max |g| ~ 0.03, so dg ~ 1e-9: with torch's eps 1e-8 that can
move such a weight by a sizeable part of lr (measured up to 7.4e-6), which says nothing about the sharding; the
test's eps 1e-4 bounds it by ~1e-8.
Activation checkpointing (the "-ac" cases) is compared with the same reference, which runs without it.
"""
from __future__ import annotations

import contextlib

import pytest
import torch
from torch.distributed.tensor import DTensor

from models.lora import LoraConfig, lora_state_dict
from services.common.errors import InvalidArgument
from services.trainer.engine import AdamW, TrainingEngine
from services.trainer.engine.forward_backward import Datum, LossRequest, MicroBatcher, run_call, split_for_ranks
from services.trainer.engine.losses import batch_scale, check_datum
from services.trainer.engine.parallel import ParallelDims
from services.trainer.engine.parallel.expert import expert_shards
from services.trainer.engine.parallel.fsdp import mixed_precision
from services.trainer.engine.parallel.parallelize import parallelize
from tests.services.trainer.parallel.ranks import run_ranks

LORA = LoraConfig(rank=4, alpha=8.0)  # the default targets: every projection, routed experts included
SETTINGS = AdamW(learning_rate=1e-3, eps=1e-4, weight_decay=0.01, grad_clip_norm=0.5)  # eps: see the docstring
REQ = LossRequest("cross_entropy", {}, micro_batch_tokens=20)
_LOSS_RTOL, _GRAD_RTOL, _WEIGHT_ATOL, _WEIGHT_RTOL = 1e-6, 1e-5, 1e-7, 1e-6


def _datums(vocab: int, n: int = 7, seed: int = 0) -> list[Datum]:
    """n cross-entropy datums of 5..12 tokens, longest first (so the first ranks' shares make more micro-batches
    than the last ones'), with signed weights (some zero)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i, T in enumerate(sorted(torch.randint(5, 13, (n,), generator=g).tolist(), reverse=True)):
        tokens = torch.randint(3, vocab, (T,), generator=g)
        weights = torch.randn(T, generator=g)
        weights[0] = 0.0
        inputs = {"target_tokens": torch.roll(tokens, -1), "weights": weights}
        out.append(Datum(tokens, check_datum("cross_entropy", inputs, T, vocab, f"data[{i}]")))
    return out


def _micro_batches(datums: list[Datum]) -> int:
    batcher = MicroBatcher(REQ.micro_batch_tokens)
    return sum(len(batcher.add(d)) for d in datums) + len(batcher.finish())


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def _named_trainable(engine: TrainingEngine) -> dict[str, torch.nn.Parameter]:
    names = {id(p): n for n, p in engine.model.named_parameters()}
    return {names[id(p)]: p for p in engine.params}


def _train_once(engine: TrainingEngine, datums: list[Datum]) -> dict:
    """Load state, one ForwardBackward over this rank's share, gradients, one AdamW step; everything gathered."""
    out = {"state": {k: _full(v) for k, v in engine.model.state_dict().items()},
           "param_names": [n for n, _ in engine.model.named_parameters()],
           "lora_keys": sorted(lora_state_dict(engine.model)) if engine.lora else []}
    share = split_for_ranks(datums, engine.dp_size)[engine.dp_rank]
    c = batch_scale(REQ.loss_fn, REQ.config, [d.inputs for d in datums])
    call = engine.loss_call(REQ, backward=True, deterministic=False, lock=contextlib.nullcontext, batch_scale=c)
    _, out["metrics"] = run_call(call, share)
    trainable = _named_trainable(engine)
    out["grads"] = {n: _full(p.grad) for n, p in trainable.items()}
    out["norm"] = float(engine.step(SETTINGS))
    out["weights"] = {n: _full(p) for n, p in trainable.items()}
    out["steps"] = engine.steps
    return out


def _rank(model_dir, lora, dims: dict, activation_checkpointing: bool) -> dict:
    import torch.distributed as dist

    engine = TrainingEngine.load(model_dir, lora=lora, seed=3, optimizer=SETTINGS, device="cpu",
                                 parallel=ParallelDims(**dims), activation_checkpointing=activation_checkpointing)
    datums = _datums(engine.model.args.vocab_size)
    out = _train_once(engine, datums)
    out["rank"] = dist.get_rank()
    out["sharded"] = all(isinstance(p, DTensor) for p in engine.model.parameters())
    out["held"] = expert_shards(engine.model)  # expert parallelism: the experts this rank holds
    return out


def _reference(model_dir, lora) -> dict:
    engine = TrainingEngine.load(model_dir, lora=lora, seed=3, optimizer=SETTINGS, device="cpu")
    return {**_train_once(engine, _datums(engine.model.args.vocab_size)), "vocab": engine.model.args.vocab_size}


def _max_rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-30))


def _compare(ranks: list[dict], ref: dict, *, weight_atol: float = _WEIGHT_ATOL) -> dict:
    """Assert every rank against the reference; return the largest differences seen. weight_atol: the weights'
    absolute tolerance after the step (the module docstring's; a caller with larger gradient rounding states its)."""
    worst = {"loss_rel": 0.0, "grad_rel": 0.0, "weight_abs": 0.0}
    whole = ref
    for got in ranks:
        assert got["sharded"] and got["steps"] == 1
        held = got["held"]  # under expert parallelism: compare the experts this rank holds
        ref = {part: ({k: held[k].take(v) if k in held else v for k, v in whole[part].items()}
                      if part in ("state", "grads", "weights") else whole[part]) for part in whole}
        assert list(got["state"]) == list(ref["state"]) and got["param_names"] == ref["param_names"]
        assert got["lora_keys"] == ref["lora_keys"]
        for k, v in ref["state"].items():  # loaded weights and the adapter's seeded init: exact copies
            assert torch.equal(got["state"][k], v), k
        loss, want = got["metrics"]["loss:sum"], ref["metrics"]["loss:sum"]
        worst["loss_rel"] = max(worst["loss_rel"], abs(loss - want) / abs(want))
        assert abs(loss - want) <= _LOSS_RTOL * abs(want), (loss, want)
        assert got["grads"].keys() == ref["grads"].keys()
        for n, g in ref["grads"].items():
            rel = _max_rel(got["grads"][n], g)
            worst["grad_rel"] = max(worst["grad_rel"], rel)
            assert rel <= _GRAD_RTOL, (n, rel)
        assert abs(got["norm"] - ref["norm"]) <= _GRAD_RTOL * ref["norm"] and ref["norm"] > SETTINGS.grad_clip_norm
        for n, w in ref["weights"].items():
            diff = (got["weights"][n] - w).abs()
            worst["weight_abs"] = max(worst["weight_abs"], float(diff.max()))
            assert bool((diff <= weight_atol + _WEIGHT_RTOL * w.abs()).all()), (n, float(diff.max()))
    return worst


_CASES = [  # (family, lora, world size, dims, activation checkpointing)
    ("qwen3", LORA, 2, dict(dp_shard=2), False),
    ("qwen3", None, 2, dict(dp_shard=2), False),
    ("qwen3_moe", LORA, 2, dict(dp_shard=2), False),
    ("qwen3_moe", None, 2, dict(dp_shard=2), True),
    ("deepseek_v3", LORA, 2, dict(dp_shard=2), True),
    ("deepseek_v3", None, 2, dict(dp_shard=2), False),
    ("qwen3", None, 4, dict(dp_shard=4), False),
    ("qwen3_moe", LORA, 4, dict(dp_replicate=2, dp_shard=2), False),  # HSDP
    ("qwen3_moe", None, 2, dict(dp_shard=2, ep=2), False),  # ep x fsdp: experts split, efsdp of size 1
    ("qwen3_moe", LORA, 4, dict(dp_shard=4, ep=2), False),  # efsdp 2 shards the held experts
    ("deepseek_v3", None, 4, dict(dp_shard=4, ep=4), True),
    ("deepseek_v3", LORA, 4, dict(dp_replicate=2, dp_shard=2, ep=2), False),  # HSDP x ep
]


@pytest.mark.parametrize("family, lora, world, dims, ac", _CASES, ids=[
    f"{f}-{'lora' if lo else 'full'}-{w}-{'x'.join(f'{k}{v}' for k, v in d.items())}{'-ac' if ac else ''}"
    for f, lo, w, d, ac in _CASES])
def test_sharded_engine_matches_the_single_process_engine(family_dirs, family, lora, world, dims, ac):
    model_dir = family_dirs[family]
    ref = _reference(model_dir, lora)
    shares = split_for_ranks(_datums(ref["vocab"]), world)
    assert len({_micro_batches(share) for share in shares}) > 1, shares  # some rank runs padding micro-batches
    ranks = run_ranks(_rank, world, model_dir, lora, dims, ac)
    worst = _compare(ranks, ref)
    print(f"\n{family} {'lora' if lora else 'full'} world {world} {dims} ac={ac}: {worst}")


@pytest.mark.parametrize("knob", ["tp"])
def test_parallelize_refuses_dimensions_it_does_not_apply_yet(knob):
    degrees = {"dp_shard": 1, knob: 2}
    dims = ParallelDims(world_size=2, field_prefix="parallel.", **degrees).resolved()
    with pytest.raises(InvalidArgument) as exc:
        parallelize(torch.nn.Module(), dims, None, param_dtype=None)
    assert exc.value.violations[0].field == f"parallel.{knob}"


def test_mixed_precision_follows_the_device():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert mixed_precision(cpu, full_parameter=True).param_dtype is None
    assert mixed_precision(cuda, full_parameter=True).param_dtype == torch.bfloat16
    assert mixed_precision(cuda, full_parameter=False).param_dtype is None  # bf16 base, float32 adapter as stored
    assert {mixed_precision(d, full_parameter=f).reduce_dtype for d in (cpu, cuda) for f in (True, False)} == {
        torch.float32}


def _rank_expert_units(model_dir, dims: dict) -> dict:
    """The FSDP layout of ep > 1 alone (fsdp.apply_fsdp without expert parallelism's split): the routed experts are
    their own units on mesh["efsdp"], the rest of each layer on mesh["dp_shard_cp"]."""
    import torch.distributed as dist

    from models.families import family_for_config
    from models.lora import set_trainable
    from models.model_dir import read_config
    from services.trainer.engine.parallel import build_mesh
    from services.trainer.engine.parallel.fsdp import apply_fsdp
    from services.trainer.engine.parallel.parallelize import load_hf_weights

    resolved = ParallelDims(**dims).resolved(dist.get_world_size())
    mesh = build_mesh(resolved)
    family = family_for_config(read_config(model_dir))
    with torch.device("meta"):
        model = family.CausalLM(family.ModelArgs.from_hf_config(read_config(model_dir)))
    set_trainable(model, "full")
    apply_fsdp(model, resolved, mesh, mp_policy=mixed_precision(torch.device("cpu"), full_parameter=True))
    model.to_empty(device="cpu")
    load_hf_weights(model, model_dir, family)
    engine = TrainingEngine(model.train(), list(model.parameters()), optimizer=SETTINGS, device=torch.device("cpu"),
                            lora=None, parallel=resolved, mesh=mesh)
    datums = _datums(model.args.vocab_size, n=8)
    call = engine.loss_call(REQ, backward=True, deterministic=False, lock=contextlib.nullcontext, batch_scale=1.0)
    run_call(call, split_for_ranks(datums, engine.dp_size)[engine.dp_rank])
    meshes = {n: sorted(dist.get_process_group_ranks(p.device_mesh.get_group())) for n, p in
              model.named_parameters()}
    return {"grads": {n: _full(p.grad) for n, p in model.named_parameters()}, "meshes": meshes,
            "efsdp": sorted(dist.get_process_group_ranks(mesh["efsdp"].get_group()))}


def test_routed_experts_are_sharded_over_efsdp_and_reduced_only_there(family_dirs):
    """4 ranks, dp_shard 4, ep 2 (efsdp 2: ranks {0, 2} and {1, 3}), expert parallelism itself not applied: every
    rank still holds all the experts. Dense gradients are the sum over all four ranks' datums; the experts'
    gradients only over their efsdp group's (once expert parallelism splits them, the ep ranks hold different
    experts and must not be summed). Reference: the single-process engine on those datums; tolerance as above."""
    model_dir = family_dirs["qwen3_moe"]
    ranks = run_ranks(_rank_expert_units, 4, model_dir, dict(dp_shard=4, ep=2))
    single = TrainingEngine.load(model_dir, lora=None, seed=3, optimizer=SETTINGS, device="cpu")
    datums = _datums(single.model.args.vocab_size, n=8)
    shares = split_for_ranks(datums, 4)

    def reference(chosen: list[Datum]) -> dict[str, torch.Tensor]:
        call = single.loss_call(REQ, backward=True, deterministic=False, lock=contextlib.nullcontext)
        run_call(call, chosen)
        grads = {n: p.grad.clone() for n, p in single.model.named_parameters()}
        single.model.zero_grad(set_to_none=True)
        return grads

    everything = reference(datums)
    for r, got in enumerate(ranks):
        assert got["efsdp"] == [r % 2, r % 2 + 2]
        experts = reference([d for s in got["efsdp"] for d in shares[s]])
        for n, g in got["grads"].items():
            is_expert = ".mlp.experts." in n
            assert got["meshes"][n] == (got["efsdp"] if is_expert else [0, 1, 2, 3]), n
            want = experts[n] if is_expert else everything[n]
            assert _max_rel(g, want) <= _GRAD_RTOL, (r, n, _max_rel(g, want))
        assert any(".mlp.experts." in n for n in got["grads"])


def test_activation_checkpointing_on_one_process_keeps_names_and_gradients_bitwise(family_dirs):
    """The single-process engine with activation_checkpointing: the same state-dict keys, parameter names and PEFT
    keys, and bitwise the same loss and gradients (the recomputed forward runs the same ops on the same inputs)."""
    runs = []
    for ac in (False, True):
        engine = TrainingEngine.load(family_dirs["deepseek_v3"], lora=LORA, seed=3, optimizer=SETTINGS, device="cpu",
                                     activation_checkpointing=ac)
        datums = _datums(engine.model.args.vocab_size)
        call = engine.loss_call(REQ, backward=True, deterministic=False, lock=contextlib.nullcontext)
        _, metrics = run_call(call, datums)
        runs.append((list(engine.model.state_dict()), [n for n, _ in engine.model.named_parameters()],
                     sorted(lora_state_dict(engine.model)), metrics, _named_trainable(engine)))
    (keys, names, peft, metrics, params), (ac_keys, ac_names, ac_peft, ac_metrics, ac_params) = runs
    assert (keys, names, peft, metrics) == (ac_keys, ac_names, ac_peft, ac_metrics)
    assert all(torch.equal(params[n].grad, ac_params[n].grad) for n in params)


def _rank_calls(model_dir, shares_of: str) -> dict:
    """A forward-only call over this rank's share (its metrics): shares_of "split" (even shares), "last_empty" (the
    first rank takes every datum) or "none" (no rank has a datum: refused on every rank)."""
    engine = TrainingEngine.load(model_dir, lora=LORA, seed=3, optimizer=SETTINGS, device="cpu",
                                 parallel=ParallelDims(dp_shard=2))
    datums = _datums(engine.model.args.vocab_size)
    shares = {"split": split_for_ranks(datums, engine.dp_size), "last_empty": [datums, []], "none": [[], []]}[shares_of]
    call = engine.loss_call(REQ, backward=False, deterministic=False, lock=contextlib.nullcontext, batch_scale=1.0)
    try:
        logprobs, metrics = run_call(call, shares[engine.dp_rank])
    except InvalidArgument as exc:
        return {"refused": exc.violations[0].field}
    return {"metrics": metrics, "logprobs": logprobs}


def test_forward_only_calls_and_a_rank_without_datums(family_dirs):
    """A Forward over a mesh: each rank's logprobs are its own datums', the metrics the whole call's (reference:
    the single-process engine, loss relative 1e-6, logprobs 1e-5 absolute). A rank without any datum of the call
    (fewer datums than ranks) runs padding micro-batches only: it returns no logprobs and the metrics are still the
    whole call's."""
    model_dir = family_dirs["qwen3"]
    single = TrainingEngine.load(model_dir, lora=LORA, seed=3, optimizer=SETTINGS, device="cpu")
    datums = _datums(single.model.args.vocab_size)
    call = single.loss_call(REQ, backward=False, deterministic=False, lock=contextlib.nullcontext)
    want_logprobs, want = run_call(call, datums)
    for shares_of in ("split", "last_empty"):
        ranks = run_ranks(_rank_calls, 2, model_dir, shares_of)
        got_logprobs = [lp for r in ranks for lp in r["logprobs"]]
        assert len(got_logprobs) == len(want_logprobs)
        assert all(float((g - w).abs().max()) <= 1e-5 for g, w in zip(got_logprobs, want_logprobs))
        if shares_of == "last_empty":
            assert ranks[1]["logprobs"] == []
        for r in ranks:
            assert r["metrics"].keys() == want.keys()
            assert abs(r["metrics"]["loss:sum"] - want["loss:sum"]) <= _LOSS_RTOL * abs(want["loss:sum"])
    assert run_ranks(_rank_calls, 2, model_dir, "none") == [{"refused": "data"}, {"refused": "data"}]
