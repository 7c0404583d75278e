"""kernels/moe.py (permute, unpermute, grouped_mm) and models/moe.py (routers, MoE block, router replay).

References: permute -> unpermute is checked bitwise against the identity; grouped_mm's "grouped" backend
(torch._grouped_mm) against the "loop" backend, and "loop" against a per-row matmul; the MoE block against
transformers' Qwen3MoeSparseMoeBlock and DeepseekV3MoE (float32, outputs and every gradient within 1e-5 relative).
"""
# Shapes: N tokens, K experts per token, M = N * K rows, E experts, D in features, F out features, B batch, T tokens.

import pytest
import torch
import transformers
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

from kernels import grouped_mm, grouped_mm_supported, permute, unpermute
from models.moe import MoE, MoEArgs, RouterReplay, routed_id_dtype

RTOL = 1e-5
COUNTS = [0, 5, 0, 9, 3, 0, 1, 0]  # empty first, middle and last experts


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _ids(N: int, K: int, experts: list[int], seed: int) -> torch.Tensor:
    """[N, K] distinct expert ids per token, drawn from `experts` only (the others receive no token)."""
    g = _gen(seed)
    rows = [torch.tensor(experts)[torch.randperm(len(experts), generator=g)[:K]] for _ in range(N)]
    return torch.stack(rows)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("K", [1, 2, 3])
def test_permute_unpermute_is_bitwise_identity(K, dtype):
    N, D, E = 7, 16, 8
    x_ND = torch.randn(N, D, generator=_gen(0)).to(dtype)
    ids_NK = _ids(N, K, [1, 4, 6], seed=K).to(torch.uint8)
    x_MD, state = permute(x_ND, ids_NK, E)

    flat = ids_NK.reshape(-1).long()
    assert state.counts_E.tolist() == torch.bincount(flat, minlength=E).tolist()
    assert state.counts_E[[0, 2, 3, 5, 7]].eq(0).all()
    sorted_ids = flat[state.order_M]
    assert (sorted_ids[1:] >= sorted_ids[:-1]).all()
    for e in (1, 4, 6):  # stable: within an expert, assignments keep their flat order
        order_e = state.order_M[sorted_ids == e]
        assert (order_e[1:] > order_e[:-1]).all()
    assert torch.equal(x_MD, x_ND[state.order_M // K])

    assert torch.equal(unpermute(x_MD, torch.ones(N, K, dtype=dtype), state), x_ND * K)
    for k in range(K):
        one_hot_NK = torch.zeros(N, K, dtype=dtype)
        one_hot_NK[:, k] = 1
        assert torch.equal(unpermute(x_MD, one_hot_NK, state), x_ND)


def _per_row_reference(x_MD, w, counts, layout):
    expert_of_row = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts))
    rows = [x_MD[m] @ (w[e] if layout == "EDF" else w[e].T) for m, e in enumerate(expert_of_row.tolist())]
    return torch.stack(rows)


def _operands(layout, dtype, seed=0):
    M, D, F_, E = sum(COUNTS), 24, 40, len(COUNTS)
    g = _gen(seed)
    x_MD = torch.randn(M, D, generator=g).to(dtype)
    w = torch.randn(E, D, F_, generator=g) if layout == "EDF" else torch.randn(E, F_, D, generator=g)
    return x_MD, w.to(dtype), torch.tensor(COUNTS)


@pytest.mark.parametrize("layout", ["EDF", "EFD"])
def test_loop_backend_matches_per_row_matmul(layout):
    x_MD, w, counts_E = _operands(layout, torch.float32)
    out = grouped_mm(x_MD, w, counts_E, layout=layout, backend="loop")
    torch.testing.assert_close(out, _per_row_reference(x_MD, w, COUNTS, layout), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("layout", ["EDF", "EFD"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_backend_matches_loop_values_and_grads(layout, dtype):
    x_MD, w, counts_E = _operands(layout, dtype, seed=1)
    assert grouped_mm_supported(x_MD, w)  # torch._grouped_mm runs on CPU for float32/bfloat16 on this build
    results = {}
    for backend in ("loop", "grouped"):
        x, w_ = x_MD.clone().requires_grad_(), w.clone().requires_grad_()
        out = grouped_mm(x, w_, counts_E, layout=layout, backend=backend)
        out.float().sum().backward()  # a stride-0 incoming gradient, which _grouped_mm's backward rejects alone
        results[backend] = (out.detach(), x.grad, w_.grad)
    tol = 0 if dtype == torch.float32 else 1e-2
    for loop_t, grouped_t in zip(results["loop"], results["grouped"]):
        torch.testing.assert_close(grouped_t, loop_t, atol=tol, rtol=tol)
    empty = [e for e, c in enumerate(COUNTS) if c == 0]
    assert results["grouped"][2][empty].eq(0).all()


def test_backend_selection_and_errors():
    x_MD, w, counts_E = _operands("EDF", torch.float64)
    assert not grouped_mm_supported(x_MD, w)  # _grouped_mm rejects float64: "auto" runs the loop
    torch.testing.assert_close(
        grouped_mm(x_MD, w, counts_E), _per_row_reference(x_MD, w, COUNTS, "EDF"), atol=1e-12, rtol=1e-12
    )
    with pytest.raises(ValueError, match=r"does not support torch\.float64"):
        grouped_mm(x_MD, w, counts_E, backend="grouped")
    with pytest.raises(ValueError, match="Unknown grouped_mm backend .cutlass."):
        grouped_mm(x_MD, w, counts_E, backend="cutlass")
    with pytest.raises(ValueError, match="layout must be one of"):
        grouped_mm(x_MD, w, counts_E, layout="DEF")
    empty = grouped_mm(x_MD[:0], w, torch.zeros(len(COUNTS), dtype=torch.int64), backend="loop")
    assert empty.shape == (0, w.shape[2])


# ---------------------------------------------------------------------------------------------- MoE block vs HF

D, I = 32, 16


def _qwen_pair(seed=0):
    torch.manual_seed(seed)
    config = transformers.Qwen3MoeConfig(
        hidden_size=D, moe_intermediate_size=I, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True
    )
    config._experts_implementation = "eager"
    hf = Qwen3MoeSparseMoeBlock(config)
    ours = MoE(MoEArgs(8, 2, D, I, router="softmax", norm_topk_prob=True), layer_idx=3)
    return _perturbed(hf), ours


def _deepseek_pair(seed=0):
    torch.manual_seed(seed)
    config = transformers.DeepseekV3Config(
        hidden_size=D, moe_intermediate_size=I, n_routed_experts=16, num_experts_per_tok=3, n_group=4,
        topk_group=2, n_shared_experts=2, routed_scaling_factor=2.5, norm_topk_prob=True,
    )
    config._experts_implementation = "eager"
    hf = DeepseekV3MoE(config)
    args = MoEArgs(16, 3, D, I, router="sigmoid", norm_topk_prob=True, n_group=4, topk_group=2,
                   routed_scaling_factor=2.5, n_shared_experts=2)
    hf = _perturbed(hf)
    with torch.no_grad():
        hf.gate.e_score_correction_bias.copy_(torch.randn(16) * 0.1)
    return hf, MoE(args, layer_idx=5)


def _perturbed(module):
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    return module


PAIRS = {"qwen3_moe": _qwen_pair, "deepseek_v3": _deepseek_pair}


@pytest.mark.parametrize("family", list(PAIRS))
def test_moe_block_matches_transformers(family):
    hf, ours = PAIRS[family]()
    ours.load_state_dict(hf.state_dict())
    assert {k: v.shape for k, v in ours.state_dict().items()} == {k: v.shape for k, v in hf.state_dict().items()}
    x = torch.randn(3, 11, D, generator=_gen(1))
    x_hf, x_ours = x.clone().requires_grad_(), x.clone().requires_grad_()
    out_hf, out_ours = hf(x_hf), ours(x_ours)
    grad_out = torch.randn_like(out_hf)
    out_hf.backward(grad_out)
    out_ours.backward(grad_out)
    diff = (out_ours - out_hf).abs().max().item()
    print(f"{family} MoE block vs HF: max abs diff {diff:.3g}")
    assert diff <= RTOL * out_hf.abs().max().item()
    pairs = [(x_ours.grad, x_hf.grad)] + [(p.grad, dict(hf.named_parameters())[n].grad)
                                          for n, p in ours.named_parameters()]
    for ours_grad, hf_grad in pairs:
        assert ((ours_grad - hf_grad).abs().max() / hf_grad.abs().max()).item() <= RTOL


@pytest.mark.parametrize("family", list(PAIRS))
def test_router_choice_and_weights_match_transformers(family):
    hf, ours = PAIRS[family](seed=2)
    ours.load_state_dict(hf.state_dict())
    x_ND = torch.randn(40, D, generator=_gen(3))
    with torch.no_grad():
        _, hf_weights, hf_ids = hf.gate(x_ND)
        scores = ours.gate.scores(x_ND)
        ids = ours.gate.select(scores)
        weights = ours.gate.gate_weights(scores, ids, x_ND.dtype)
    # DeepSeek's top-k is unsorted; compare per token after sorting by expert id.
    hf_order, order = hf_ids.argsort(-1), ids.argsort(-1)
    assert torch.equal(ids.gather(1, order), hf_ids.gather(1, hf_order))
    assert torch.equal(weights.gather(1, order), hf_weights.gather(1, hf_order))
    assert weights.dtype == torch.float32


def test_softmax_router_bf16_dtypes_match_transformers():
    hf, ours = _qwen_pair(seed=4)
    ours.load_state_dict(hf.state_dict())
    hf, ours = hf.to(torch.bfloat16), ours.to(torch.bfloat16)
    x_ND = torch.randn(40, D, generator=_gen(5)).to(torch.bfloat16)
    with torch.no_grad():
        _, hf_weights, hf_ids = hf.gate(x_ND)
        scores = ours.gate.scores(x_ND)
        ids = ours.gate.select(scores)
        weights = ours.gate.gate_weights(scores, ids, x_ND.dtype)
        assert scores.dtype == torch.float32 and weights.dtype == torch.bfloat16
        assert torch.equal(ids, hf_ids) and torch.equal(weights, hf_weights)
        assert torch.equal(ours(x_ND[None]), hf(x_ND[None]))


def test_sigmoid_router_restricts_selection_to_top_groups():
    args = MoEArgs(16, 3, D, I, router="sigmoid", norm_topk_prob=False, n_group=4, topk_group=1)
    block = MoE(args, layer_idx=0)
    with torch.no_grad():
        block.gate.e_score_correction_bias[8:12] = 10.0  # group 2 wins every token through the bias alone
        scores = block.gate.scores(torch.randn(20, D, generator=_gen(6)))
        ids = block.gate.select(scores)
        weights = block.gate.gate_weights(scores, ids, torch.float32)
    assert ((ids >= 8) & (ids < 12)).all()
    assert torch.equal(weights, scores.gather(1, ids))  # weights from the unbiased scores (no renorm here)


# ---------------------------------------------------------------------------------------------- router replay


def _run(block, x_BTD, grad_BTD, routing):
    block.zero_grad()
    x = x_BTD.clone().requires_grad_()
    out = block(x, routing=routing)
    out.backward(grad_BTD)
    return out.detach(), x.grad, {n: p.grad.clone() for n, p in block.named_parameters()}


@pytest.mark.parametrize("family", list(PAIRS))
def test_replaying_the_live_choice_is_bitwise_no_replay(family):
    _, block = PAIRS[family]()
    x_BTD, grad_BTD = torch.randn(2, 9, D, generator=_gen(7)), torch.randn(2, 9, D, generator=_gen(8))
    live = _run(block, x_BTD, grad_BTD, None)
    record = RouterReplay.record()
    recorded = _run(block, x_BTD, grad_BTD, record)
    ids = record.expert_ids[block.layer_idx]
    assert ids.dtype == torch.uint8 and ids.shape == (2, 9, block.args.top_k)
    replayed = _run(block, x_BTD, grad_BTD, RouterReplay.replay(record.expert_ids))
    for run in (recorded, replayed):
        assert torch.equal(run[0], live[0]) and torch.equal(run[1], live[1])
        assert all(torch.equal(run[2][n], live[2][n]) for n in live[2])
    assert live[2]["gate.weight"].abs().max() > 0  # the router is trained under replay too


@pytest.mark.parametrize("family", list(PAIRS))
def test_replaying_other_ids_changes_the_output_and_keeps_router_gradient(family):
    _, block = PAIRS[family]()
    x_BTD, grad_BTD = torch.randn(2, 9, D, generator=_gen(7)), torch.randn(2, 9, D, generator=_gen(8))
    record = RouterReplay.record()
    live = _run(block, x_BTD, grad_BTD, record)
    shifted = {k: ((v.long() + 1) % block.args.num_experts).to(v.dtype) for k, v in record.expert_ids.items()}
    other = _run(block, x_BTD, grad_BTD, RouterReplay.replay(shifted))
    assert not torch.allclose(other[0], live[0])
    assert other[2]["gate.weight"].abs().max() > 0


def test_record_appends_selects_and_replay_checks_shapes():
    _, block = _qwen_pair()
    x_BTD = torch.randn(2, 6, D, generator=_gen(9))
    record = RouterReplay.record()
    with torch.no_grad():
        block(x_BTD[:, :4], routing=record)
        block(x_BTD[:, 4:5], routing=record)
        block(x_BTD[:, 5:], routing=record)
        full = RouterReplay.record()
        block(x_BTD, routing=full)
    assert torch.equal(record.expert_ids[3], full.expert_ids[3])  # the MoE block sees no context: same choice
    assert record.layers == [3] and record.stacked().shape == (2, 6, 1, 2)
    picked = record.select(torch.tensor([1, 1, 0]))
    assert torch.equal(picked.expert_ids[3], record.expert_ids[3][[1, 1, 0]])
    with pytest.raises(ValueError, match=r"shape \(2, 6, 2\) but the forward routes \(2, 4, 2\)"):
        block(x_BTD[:, :4], routing=RouterReplay.replay(record.expert_ids))
    with pytest.raises(ValueError, match="no expert ids for MoE layer 3"):
        block(x_BTD, routing=RouterReplay.replay({}))
    with pytest.raises(ValueError, match="mode must be"):
        RouterReplay("rewind")


def test_routed_id_dtype():
    assert routed_id_dtype(256) == torch.uint8
    assert routed_id_dtype(257) == torch.int16
    assert routed_id_dtype(40000) == torch.int32


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"router": "relu"}, "router must be one of"),
        ({"top_k": 9}, r"num_experts_per_tok=9 must be in \[1, num_experts=8\]"),
        ({"router": "sigmoid", "n_group": 3}, "n_group=3 must divide num_experts=8"),
        ({"router": "sigmoid", "n_group": 8}, "fewer than 2 experts per group"),
        ({"router": "sigmoid", "n_group": 2, "topk_group": 3}, r"topk_group=3 must be in \[1, n_group=2\]"),
        ({"router": "sigmoid", "n_group": 4, "topk_group": 1, "top_k": 3}, "exceeds the experts in topk_group=1"),
    ],
)
def test_moe_args_name_the_bad_knob(overrides, message):
    kwargs = {"num_experts": 8, "top_k": 2, "hidden_size": D, "moe_intermediate_size": I, "router": "softmax",
                  "norm_topk_prob": True}
    with pytest.raises(ValueError, match=message):
        MoEArgs(**{**kwargs, **overrides})
