"""Context parallelism (services/trainer/engine/parallel/context.py) on real gloo groups of 4 ranks, cp = 4 and
dp_shard 2 x cp 2 (two cp groups, each on its own data), against named single-process references:

- the ring attention op alone vs kernels.attention.reference_attention (float32) over the whole sequence: the output
  and dq / dk / dv, causal, GQA (4 query heads on 2 kv heads) and MLA head dims (tiny form of DeepSeek's 192 / 128:
  D = 48, Dv = 32, its own scale), unpacked rows (B = 2) and packed rows whose documents straddle the chunk
  boundaries. Tolerance: max |cp - ref| <= 2e-6 * max |ref| per tensor (float32; the blockwise online softmax sums
  in another order than the reference, so they differ by rounding only: measured <= 7.2e-7); one bfloat16 MLA case
  within 8e-3 (one bf16 rounding of float32 results on both sides; measured 3.4e-3);
- whole models (qwen3, qwen3_moe, deepseek_v3), full and LoRA training (LoRA B drawn nonzero so every A has a
  gradient), unpacked rows (B = 2) and packed rows: the engine's loss (services/trainer/engine/logprobs.py
  target_nll_sum on each rank's shard, summed over the cp ranks) and the gradient of every trainable parameter
  (summed over the cp ranks) vs the single-process model's. Tolerance: loss within 1e-6 relative (measured <= 8.5e-8);
  each parameter's gradient max |cp - ref| <= 1e-5 * max |ref| (measured <= 2.3e-6: the attention's rounding
  differences, ~5e-7, carried through 4 layers, the q/k RMSNorms and the MoE routers);
- a row whose length is not a multiple of 2 * cp is refused with a ValueError naming the lengths (not padded: the
  caller pads, see the module's docstring).

One group per cp runs every case (cp_group_results): a rank process's cost is its imports, not the tiny computations.
"""
from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist

from kernels import Packing
from kernels.attention import reference_attention
from kernels.logprobs import IGNORE_INDEX
from services.trainer.engine.parallel import ParallelDims, build_mesh
from services.trainer.engine.parallel.context import ContextParallel, apply_context_parallel
from tests.services.trainer.parallel.ranks import run_ranks

pytestmark = pytest.mark.usefixtures("one_thread")

OP_TOL = 2e-6
LOSS_TOL = 1e-6
GRAD_TOL = 1e-5


# Every case runs on 4 ranks: cp = 4, and dp_shard 2 x cp 2 (two cp groups, ranks {0, 1} and {2, 3}, each on its own
# data: so the ring's group-rank -> global-rank mapping and the groups' separation are exercised too).
WORLD = 4


def _dims(cp: int) -> ParallelDims:
    return ParallelDims(cp=cp, dp_shard=WORLD // cp, world_size=WORLD).resolved()


def _rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    """max |a - ref| / max |ref| (an all-zero ref, e.g. an expert no token chose, must be matched exactly)."""
    return float((a - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


# ------------------------------------------------------------------------------------------------------ the op alone

# (name, B, H, K, D, Dv, document lengths or None, dtype); T = 32 so that cp = 2 and cp = 4 both cut it into 2 cp
# chunks.
OP_CASES = [
    ("gqa", 2, 4, 2, 16, 16, None, torch.float32),
    ("mla", 1, 4, 4, 48, 32, None, torch.float32),
    ("gqa_packed", 1, 4, 2, 16, 16, [3, 9, 1, 12, 7], torch.float32),
    ("mla_packed", 1, 4, 4, 48, 32, [16, 5, 11], torch.float32),
    ("mla_bf16", 2, 4, 4, 48, 32, None, torch.bfloat16),
]
# bf16 inputs: both sides compute in float32 and round the result (and the gradients) to bf16 once, so they differ by
# at most about one bf16 ulp (2^-8 relative) of an entry.
OP_TOL_BF16 = 8e-3
T_OP = 32


def _op_inputs(case, seed: int = 0) -> dict:
    _, B, H, K, D, Dv, lengths, dtype = case
    g = torch.Generator().manual_seed(seed)
    shapes = {"q": (B, H, T_OP, D), "k": (B, K, T_OP, D), "v": (B, K, T_OP, Dv), "dout": (B, H, T_OP, Dv)}
    return {**{n: torch.randn(shape, generator=g).to(dtype) for n, shape in shapes.items()},
            "lengths": lengths, "scale": 0.3 if Dv != D else None}


def _ring_op(cp: ContextParallel, cases: list[dict]) -> dict:
    results = {}
    for name, x in cases:
        layout = cp.layout(packing=Packing.from_lengths(x["lengths"])) if x["lengths"] else cp.layout(T_OP)
        q, k, v = (layout.shard(x[n], dim=2).requires_grad_() for n in ("q", "k", "v"))
        out = cp.attention(q, k, v, layout=layout, scale=x["scale"])
        out.backward(layout.shard(x["dout"], dim=2))
        results[name] = {n: layout.gather(t.detach(), dim=2)
                         for n, t in (("out", out), ("dq", q.grad), ("dk", k.grad), ("dv", v.grad))}
    results["refused"] = _refusals(cp)
    return results


def _refusals(cp: ContextParallel) -> dict[str, str]:
    """The ValueError message of each misuse."""
    layout = cp.layout(T_OP)
    q = torch.zeros(1, 2, 2 * layout.chunk, 8)
    misuses = {
        "indivisible": lambda: cp.layout(T_OP + 2),
        "plain packing": lambda: cp.attention(q, q, q, layout=Packing.from_lengths([T_OP])),
        "no layout": lambda: cp.attention(q, q, q, layout=None),
        "unsharded": lambda: cp.attention(torch.zeros(1, 2, T_OP, 8), q, q, layout=layout),
        "kv cache": lambda: cp.attention(q, q, q, layout=layout, cache=object()),
    }
    messages = {}
    for name, misuse in misuses.items():
        try:
            misuse()
        except ValueError as exc:
            messages[name] = str(exc)
    return messages


# ------------------------------------------------------------------------------------------------------ whole models

T_MODEL = 32
PACKED_LENGTHS = [6, 13, 2, 11]  # documents straddling chunk boundaries for cp = 2 (chunks of 8) and 4 (of 4)


def _batch(vocab: int, packed: bool, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    B = 1 if packed else 2
    tokens = torch.randint(3, vocab, (B, T_MODEL), generator=g)
    targets = torch.randint(3, vocab, (B, T_MODEL), generator=g)
    targets[:, ::5] = IGNORE_INDEX
    return tokens, targets


def _model(model_dir, mode: str):
    """The family's tiny model, trainable as mode says; LoRA's B matrices drawn nonzero (a fresh adapter's B = 0
    would give its A matrices zero gradients, hiding any error in them)."""
    from models import load_pretrained
    from models.lora import LoraConfig, apply_lora, set_trainable

    model = load_pretrained(model_dir)
    if mode == "lora":
        apply_lora(model, LoraConfig(rank=4, alpha=8.0), seed=1)
        g = torch.Generator().manual_seed(2)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.02)
    set_trainable(model, mode)
    return model


def _loss_and_grads(model, tokens, targets, packing) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    from services.trainer.engine.logprobs import target_nll_sum

    loss = target_nll_sum(model, tokens, targets, packing=packing)
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.requires_grad}


def _cp_model(mesh, dims: ParallelDims, model_dir, cases: list[tuple[str, bool]], vocab: int, seed: int) -> dict:
    group = mesh["cp"].get_group()
    results = {}
    for mode, packed in cases:
        model = _model(model_dir, mode)
        cp = apply_context_parallel(model, mesh, dims)
        tokens, targets = _batch(vocab, packed, seed)
        layout = cp.layout(packing=Packing.from_lengths(PACKED_LENGTHS)) if packed else cp.layout(T_MODEL)
        loss, grads = _loss_and_grads(model, layout.shard(tokens), layout.shard(targets), layout)
        dist.all_reduce(loss, group=group)
        for grad in grads.values():
            dist.all_reduce(grad, group=group)
        results[(mode, packed)] = (loss, grads)
    return results


MODEL_CASES = [("full", False), ("full", True), ("lora", False), ("lora", True)]
FAMILIES = ("qwen3", "qwen3_moe", "deepseek_v3")


# ------------------------------------------------------------------------------------------------------------ tests


def _everything(cp: int, op_inputs: list[list], model_dirs: dict, vocabs: dict) -> dict:
    """Every case on one group of WORLD ranks: each rank process imports the model code once (the imports, not the
    tiny computations, are what a group costs). A cp group's data is seeded by its dp index (op_inputs[dp])."""
    dims = _dims(cp)
    mesh = build_mesh(dims)
    dp = mesh["dp"].get_local_rank()
    return {"dp": dp, "op": _ring_op(ContextParallel(mesh["cp"].get_group()), op_inputs[dp]),
            "models": {family: _cp_model(mesh, dims, model_dirs[family], MODEL_CASES, vocabs[family], seed=dp)
                       for family in model_dirs}}


@pytest.fixture(scope="module")
def cp_group_results(family_dirs):
    """cp -> every rank's results of _everything (one run of WORLD ranks per cp and module, when first asked)."""
    from models.model_dir import read_config

    runs = {}

    def results(cp: int) -> list[dict]:
        if cp not in runs:
            op_inputs = [[(case[0], _op_inputs(case, seed=dp)) for case in OP_CASES] for dp in range(WORLD // cp)]
            dirs = {f: family_dirs[f] for f in FAMILIES}
            vocabs = {f: read_config(d)["vocab_size"] for f, d in dirs.items()}
            runs[cp] = run_ranks(_everything, WORLD, cp, op_inputs, dirs, vocabs)
            # the mesh's documented order (pp, dp_replicate, dp_shard, cp, tp): rank = dp * cp + cp index
            assert [got["dp"] for got in runs[cp]] == [rank // cp for rank in range(WORLD)]
        return runs[cp]

    return results


@pytest.mark.parametrize("cp", [2, 4])
def test_ring_attention_matches_the_reference_over_the_whole_sequence(cp_group_results, cp):
    ranks = cp_group_results(cp)
    for case, dp in itertools.product(OP_CASES, range(WORLD // cp)):
        name, x = case[0], _op_inputs(case, seed=dp)
        packing = Packing.from_lengths(x["lengths"]) if x["lengths"] else None
        q, k, v = (x[n].clone().requires_grad_() for n in ("q", "k", "v"))
        ref = reference_attention(q, k, v, causal=True, q_offset=0, packing=packing, scale=x["scale"])
        ref.backward(x["dout"])
        expected = {"out": ref.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}
        tol = OP_TOL if case[-1] == torch.float32 else OP_TOL_BF16
        for rank, got in enumerate(ranks[dp * cp:(dp + 1) * cp], start=dp * cp):
            for n, ref_t in expected.items():
                assert got["op"][name][n].dtype == ref_t.dtype
                err = _rel(got["op"][name][n].float(), ref_t.float())
                assert err <= tol, f"cp {cp} rank {rank} {name} {n}: max rel diff {err:.2e} > {tol}"


@pytest.mark.parametrize("cp", [2, 4])
def test_misuses_are_refused_with_a_clear_error(cp_group_results, cp):
    refused = cp_group_results(cp)[0]["op"]["refused"]
    # A row not divisible into 2 cp chunks is refused (not padded), naming the lengths and the padded length.
    n = 2 * cp
    assert f"2 * cp = {n} chunks" in refused["indivisible"] and f"got {T_OP + 2} tokens" in refused["indivisible"]
    assert f"pad the row to {-(-(T_OP + 2) // n) * n}" in refused["indivisible"]
    assert "got a kernels.Packing" in refused["plain packing"] and "layout(packing=" in refused["plain packing"]
    assert "got no layout" in refused["no layout"]
    assert f"this rank holds {T_OP} tokens" in refused["unsharded"] and "layout.shard" in refused["unsharded"]
    assert "no KV-cache path" in refused["kv cache"]


def test_without_context_parallelism_the_model_is_left_as_it_is(tiny_model_dir):
    from models import load_pretrained

    model = load_pretrained(tiny_model_dir)
    assert apply_context_parallel(model, None, ParallelDims(world_size=1).resolved()) is None
    assert all(layer.self_attn.context_parallel is None for layer in model.model.layers.values())


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("family", FAMILIES)
def test_whole_model_loss_and_gradients_match_the_single_process_model(cp_group_results, family_dirs, family, cp):
    from models.model_dir import read_config

    ranks = cp_group_results(cp)
    model_dir = family_dirs[family]
    vocab = read_config(model_dir)["vocab_size"]
    for (mode, packed), dp in itertools.product(MODEL_CASES, range(WORLD // cp)):
        model = _model(model_dir, mode)
        tokens, targets = _batch(vocab, packed, seed=dp)
        ref_loss, ref_grads = _loss_and_grads(model, tokens, targets,
                                              Packing.from_lengths(PACKED_LENGTHS) if packed else None)
        case = f"{family} cp {cp} {mode} {'packed' if packed else 'rows'}"
        for rank, got in enumerate(ranks[dp * cp:(dp + 1) * cp], start=dp * cp):
            loss, grads = got["models"][family][(mode, packed)]
            assert grads.keys() == ref_grads.keys()
            loss_err = abs(float(loss - ref_loss)) / abs(float(ref_loss))
            assert loss_err <= LOSS_TOL, f"{case} rank {rank}: loss {float(loss)} vs {float(ref_loss)}"
            worst = max((_rel(grads[n], g), n) for n, g in ref_grads.items())
            assert worst[0] <= GRAD_TOL, f"{case} rank {rank}: {worst[1]} grad max rel diff {worst[0]:.2e}"
