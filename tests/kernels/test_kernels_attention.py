"""Attention backends (kernels/attention.py) against the reference backend, forward and gradients.

Accuracy bound, per output (out, dq, dk, dv) of every case:
    max|out - truth| <= 2 * max|same_dtype - truth| + 2 * eps(dtype)
where same_dtype is the reference backend computed in the test dtype (plain torch math in that dtype) and truth is
the reference backend in float32 for 16-bit runs. For float32 runs the truth is the reference in float64: a float32
truth would equal same_dtype exactly and shrink the bound to 2 * eps absolute, below one rounding step of outputs
of size ~3, which no kernel that merely orders its sums differently can meet.
"""
# Shapes: B batch, H query heads, K kv heads, T queries, S keys, D query/key head dim, Dv value head dim.

import importlib
from dataclasses import dataclass

import pytest
import torch

from kernels import Packing, blocked_attention
from kernels.attention import attention
from kernels.attention import document_groups, reference_attention
from kernels.backends import optional_module
from kernels.memory import TensorMemoryTracker

pytestmark = pytest.mark.usefixtures("one_thread")

attention_module = importlib.import_module("kernels.attention")  # `kernels.attention` the attribute is the function


@dataclass(frozen=True)
class Case:
    B: int
    H: int
    K: int
    T: int
    S: int
    D: int
    Dv: int
    causal: bool = True
    q_offset: int = 0
    lengths: tuple[int, ...] | None = None  # packed documents
    group_tokens: int | None = None  # overrides SDPA_PACKED_CHUNK_TOKENS
    scale: float | None = None  # None: 1/sqrt(D)


CASES = {
    "causal": Case(2, 4, 4, 33, 33, 64, 64),
    # One SDPA call with a block-diagonal mask (all documents fit one group), including length-1 documents.
    "packed": Case(1, 4, 2, 71, 71, 32, 32, lengths=(17, 1, 40, 1, 9, 3)),
    # Groups of at most 16 tokens: 17 and 40 alone (is_causal), [1] alone, [1, 9, 3] together (mask).
    "packed-grouped": Case(1, 4, 2, 71, 71, 32, 32, lengths=(17, 1, 40, 1, 9, 3), group_tokens=16),
    "gqa": Case(2, 8, 2, 29, 29, 64, 64),
    "mla": Case(2, 4, 4, 37, 37, 192, 128),
    "mla-packed": Case(1, 4, 4, 40, 40, 192, 128, lengths=(10, 1, 29)),
    "mla-yarn-scale": Case(2, 4, 4, 21, 21, 192, 128, scale=0.135234),  # DeepSeek-V3's mscale-adjusted scale
    "decode": Case(2, 8, 2, 1, 20, 64, 64, q_offset=19),
    "prefill-chunk": Case(2, 8, 2, 4, 20, 64, 64, q_offset=16),
    "non-causal": Case(2, 4, 2, 5, 6, 32, 32, causal=False),
}


def _inputs(case: Case, device: str, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(case.B, case.H, case.T, case.D, generator=gen)
    k = torch.randn(case.B, case.K, case.S, case.D, generator=gen)
    v = torch.randn(case.B, case.K, case.S, case.Dv, generator=gen)
    grad_out = torch.randn(case.B, case.H, case.T, case.Dv, generator=gen)
    packing = Packing.from_lengths(list(case.lengths), device) if case.lengths else None
    return [t.to(device) for t in (q, k, v, grad_out)], packing


def _forward_backward(fn, tensors, dtype):
    q, k, v, grad_out = tensors
    q, k, v = (t.to(dtype).requires_grad_() for t in (q, k, v))
    out = fn(q, k, v)
    return [out, *torch.autograd.grad(out, (q, k, v), grad_out.to(dtype))]


def _errors_and_bounds(case: Case, dtype: torch.dtype, backend: str, device: str, monkeypatch):
    if case.group_tokens is not None:
        monkeypatch.setattr(attention_module, "SDPA_PACKED_CHUNK_TOKENS", case.group_tokens)
    tensors, packing = _inputs(case, device)
    kw = {"causal": case.causal, "q_offset": case.q_offset, "packing": packing, "scale": case.scale}
    truth_dtype = torch.float64 if dtype == torch.float32 else torch.float32
    truth = _forward_backward(lambda q, k, v: reference_attention(q, k, v, **kw, compute_dtype=truth_dtype),
                              tensors, truth_dtype)
    same = _forward_backward(lambda q, k, v: reference_attention(q, k, v, **kw, compute_dtype=dtype), tensors, dtype)
    got = _forward_backward(lambda q, k, v: attention(q, k, v, **kw, backend=backend), tensors, dtype)
    assert got[0].shape == (case.B, case.H, case.T, case.Dv) and got[0].dtype == dtype
    eps = torch.finfo(dtype).eps
    rows = {}
    for name, g, s, t in zip(("out", "dq", "dk", "dv"), got, same, truth):
        err = (g.to(truth_dtype) - t).abs().max().item()
        bound = 2 * (s.to(truth_dtype) - t).abs().max().item() + 2 * eps
        rows[name] = (err, bound)
    return rows


def _check(rows, label):
    print(label, "  ".join(f"{n} {e:.2e}/{b:.2e}" for n, (e, b) in rows.items()))
    for name, (err, bound) in rows.items():
        assert err <= bound, f"{label} {name}: max error {err:.3g} > bound {bound:.3g}"


# The reference backend in fp32 is the "same dtype" baseline itself, so that pairing would check nothing.
@pytest.mark.parametrize("backend, dtype", [("sdpa", torch.float32), ("sdpa", torch.bfloat16),
                                            ("reference", torch.bfloat16)], ids=["sdpa-fp32", "sdpa-bf16", "ref-bf16"])
@pytest.mark.parametrize("case", list(CASES))
def test_backend_within_bound_cpu(case, dtype, backend, monkeypatch):
    rows = _errors_and_bounds(CASES[case], dtype, backend, "cpu", monkeypatch)
    _check(rows, f"cpu {backend} {case} {dtype}:")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("backend", ["sdpa", "flash"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("case", list(CASES))
def test_backend_within_bound_cuda(case, dtype, backend, monkeypatch):
    if backend == "flash" and optional_module("flash_attn") is None:
        pytest.skip("flash_attn is not installed")
    rows = _errors_and_bounds(CASES[case], dtype, backend, "cuda", monkeypatch)
    _check(rows, f"cuda {backend} {case} {dtype}:")


def test_document_groups():
    assert document_groups((17, 1, 40, 1, 9, 3), 16) == [(0, 17, 1), (17, 18, 1), (18, 58, 1), (58, 71, 3)]
    assert document_groups((4, 4, 4, 4), 8) == [(0, 8, 2), (8, 16, 2)]
    assert document_groups((5,), 8) == [(0, 5, 1)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_sdpa_packed_never_builds_a_token_by_token_tensor(dtype):
    """Many short documents: the largest allocation is one bucket's block of float32 scores (float32 on CPU: the
    blocked path, at most SCORE_ELEMENTS floats) or one group's (16-bit: SDPA, H x n x n, n <= 512), far below the
    [T, T] mask the old path built and the [H, T, T] scores of the reference."""
    lengths = [37, 1, 64, 5, 90, 3, 128, 44, 17, 60, 11, 29] * 8  # T = 3912
    T, H = sum(lengths), 2
    q, k, v = (torch.randn(1, h, T, 16).to(dtype) for h in (H, 1, 1))
    packing = Packing.from_lengths(lengths)
    with TensorMemoryTracker() as mem:
        out = attention(q, k, v, causal=True, q_offset=0, packing=packing, backend="sdpa")
    group = attention_module.SDPA_PACKED_CHUNK_TOKENS
    bound = 4 * blocked_attention.SCORE_ELEMENTS if dtype == torch.float32 else H * group * group * 4
    assert mem.largest_bytes <= bound < T * T * 4, (mem.largest_bytes, T)
    ref = reference_attention(q.float(), k.float(), v.float(), causal=True, q_offset=0, packing=packing)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)


def test_blocked_attention_buckets_and_blocks():
    """The float32 CPU training path (kernels/blocked_attention.py): buckets bound padding and scores; a long row runs
    in several query blocks and its backward's recomputed probabilities give the math kernel's gradients."""
    lengths = (300, 17, 290, 1, 16, 15, 64)
    buckets = blocked_attention.length_buckets(lengths, heads=4)
    assert sorted(i for b in buckets for i in b) == list(range(len(lengths)))
    for b in buckets:
        longest = lengths[b[0]]
        assert len(b) == 1 or longest * len(b) <= 1.25 * sum(lengths[i] for i in b)
    gen = torch.Generator().manual_seed(0)
    q, k, v, g = (torch.randn(2, h, 70, 16, generator=gen) for h in (4, 2, 2, 4))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    got = blocked_attention.blocked_causal_attention(q, k, v, scale=0.25, block=16)  # 5 blocks, the last short
    want = torch.ops.aten._scaled_dot_product_attention_math(q, k, v, is_causal=True, scale=0.25,
                                                             enable_gqa=True)[0]
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    for a, b in zip(torch.autograd.grad(got, (q, k, v), g), torch.autograd.grad(want, (q, k, v), g)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_auto_and_forced_backends(monkeypatch):
    calls = []
    for name in ("reference", "sdpa", "flash"):
        impl = attention_module._BACKENDS[name]
        monkeypatch.setitem(attention_module._BACKENDS, name,
                            lambda *a, _name=name, _impl=impl, **kw: calls.append(_name) or _impl(*a, **kw))
    q, k, v = torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8)
    monkeypatch.delenv("TRAINYARD_ATTENTION_BACKEND", raising=False)
    attention(q, k, v, causal=True, q_offset=0)  # CPU float32: flash cannot run, so auto is sdpa
    attention(q, k, v, causal=True, q_offset=0, backend="reference")
    monkeypatch.setenv("TRAINYARD_ATTENTION_BACKEND", "reference")
    attention(q, k, v, causal=True, q_offset=0)
    attention(q, k, v, causal=True, q_offset=0, backend="sdpa")  # the argument wins over the environment
    assert calls == ["sdpa", "reference", "reference", "sdpa"]

    monkeypatch.setenv("TRAINYARD_ATTENTION_BACKEND", "flash")
    with pytest.raises(ValueError, match="flash.*cannot run.*TRAINYARD_ATTENTION_BACKEND"):
        attention(q, k, v, causal=True, q_offset=0)
    monkeypatch.setenv("TRAINYARD_ATTENTION_BACKEND", "triton")
    with pytest.raises(ValueError, match="Unknown attention backend 'triton' from the environment variable"):
        attention(q, k, v, causal=True, q_offset=0)


def test_packing_helpers():
    packing = Packing.from_lengths([3, 1, 2])
    assert packing.lengths == (3, 1, 2) and packing.total == 6
    assert packing.doc_ids().tolist() == [0, 0, 0, 1, 2, 2]
    assert packing.positions().tolist() == [[0, 1, 2, 0, 0, 1]]
    direct = Packing(cu_seqlens=packing.cu_seqlens, max_seqlen=3)  # lengths read back from cu_seqlens
    assert direct.lengths == (3, 1, 2)
