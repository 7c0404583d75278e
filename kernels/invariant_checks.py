"""Deterministic mode's start-up self-check (kernels.batch_invariant.self_check): each invariant the mode relies on,
verified on this machine in well under a second, at 1 thread and at the process's thread count.

A check is (op, kernel path, function returning True when the invariant holds). The kernel path says which code
computed the op: the invariant kernels' build (kernels/csrc/invariant.c and the instruction set it vectorizes with),
or torch's own CPU kernel with its capability and the BLAS / oneDNN caps in force, so a failure names what to look
at.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kernels import native


@dataclass(frozen=True)
class Check:
    op: str
    path: Callable[[], str]
    holds: Callable[[], bool]


def native_path() -> str:
    return f"kernels/csrc/invariant.c, {native.isa()} build (bf16 GEMM: {native.bf16_dot()})"


def torch_path() -> str:
    caps = [f"{v}={os.environ[v]}" for v in ("ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS", "ONEDNN_MAX_CPU_ISA")
            if os.environ.get(v)]
    return f"torch {torch.__version__} CPU kernel, capability {torch.backends.cpu.get_cpu_capability()}" + (
        f" ({', '.join(caps)})" if caps else "")


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _thread_counts() -> list[int]:
    return sorted({1, torch.get_num_threads()})


def _each_thread_count(fn: Callable[[], bool]) -> Callable[[], bool]:
    """fn must hold at 1 thread and at the process's count, and give the same bits at both (fn returns a result
    tuple: (holds, tensors to compare across thread counts))."""

    def run() -> bool:
        threads = torch.get_num_threads()
        seen = []
        try:
            for n in _thread_counts():
                torch.set_num_threads(n)
                ok, values = fn()
                if not ok:
                    return False
                seen.append(values)
        finally:
            torch.set_num_threads(threads)
        return all(torch.equal(a, b) for other in seen[1:] for a, b in zip(seen[0], other))

    return run


def _gemm() -> tuple[bool, list[torch.Tensor]]:
    """A row's GEMM result alone, at any offset among 37 rows, in both operand layouts, split over K."""
    from kernels.batch_invariant import invariant_linear, invariant_mm

    ok, outs = True, []
    for dtype in (torch.float32, torch.bfloat16):
        W = torch.randn(80, 300, generator=_gen(1)).to(dtype)
        X = torch.randn(37, 300, generator=_gen(2)).to(dtype)
        full = invariant_linear(X, W)
        ok &= all(torch.equal(invariant_linear(X[s : s + m], W), full[s : s + m]) for m, s in ((1, 0), (1, 36), (5, 3),
                                                                                              (13, 20)))
        ok &= torch.equal(invariant_mm(X, W.t().contiguous()), full)
        if dtype == torch.float32:
            part = native.gemm(X[:, :130], W.t()[:130])
            ok &= torch.equal(native.gemm(X[:, 130:], W.t()[130:], part, accumulate=True), full)
        outs.append(full)
    return ok, outs


def _attention() -> tuple[bool, list[torch.Tensor]]:
    """Prefill rows == the same rows decoded against keys 0..p, chunked prefill == full, a paged read == a contiguous
    one, a -inf mask == a key range."""
    from kernels.batch_invariant import attend, causal_ranges, invariant_attention

    L, G, Kh, D = 40, 2, 2, 24
    q = torch.randn(1, Kh * G, L, D, generator=_gen(3))
    k, v = torch.randn(1, Kh, L, D, generator=_gen(4)), torch.randn(1, Kh, L, D, generator=_gen(5))
    full = invariant_attention(q, k, v, is_causal=True, enable_gqa=True)
    ok = True
    for p in (0, 17, 39):
        lo, hi = causal_ranges(1, 1, p + 1, causal=True, q_offset=p)
        ok &= torch.equal(attend(q[:, :, p : p + 1], k[:, :, : p + 1], v[:, :, : p + 1], lo, hi, D**-0.5),
                          full[:, :, p : p + 1])
    lo, hi = causal_ranges(1, 15, L, causal=True, q_offset=25)
    ok &= torch.equal(attend(q[:, :, 25:], k, v, lo, hi, D**-0.5), full[:, :, 25:])
    mask = torch.ones(L, L, dtype=torch.bool).tril()
    ok &= torch.equal(invariant_attention(q, k, v, attn_mask=mask, enable_gqa=True), full)
    # the same keys through a block table of a pool of blocks of 8 slots, blocks in scrambled order
    blocks = torch.randperm(L // 8, generator=_gen(6))
    pool_k = torch.zeros(Kh, L // 8, 8, D)
    pool_v = torch.zeros(Kh, L // 8, 8, D)
    pool_k[:, blocks] = k[0].view(Kh, L // 8, 8, D)
    pool_v[:, blocks] = v[0].view(Kh, L // 8, 8, D)
    out = torch.empty(Kh * G, 1, D)
    lo, hi = torch.zeros(1, 1, dtype=torch.int32), torch.tensor([[L]], dtype=torch.int32)
    native.attention(q[0, :, L - 1 :].contiguous(), pool_k, pool_v, lo, hi, scale=D**-0.5, q_strides=(0, D, 0),
                     k_strides=(0, pool_k.stride(0), pool_k.stride(1), D), v_strides=(0, pool_v.stride(0),
                     pool_v.stride(1), D), shape=(1, Kh, G, 1, D, D), out=out, out_strides=(0, D, 0),
                     table=blocks[None].contiguous(), block_size=8)
    ok &= torch.equal(out[:, 0], full[0, :, L - 1])
    return ok, [full]


def _elementwise_native() -> tuple[bool, list[torch.Tensor]]:
    """silu / sigmoid / exp of an element: the same alone, at any offset, in any tensor size."""
    x = torch.randn(5000, generator=_gen(7)) * 6
    outs, ok = [], True
    for op in ("silu", "sigmoid", "exp"):
        whole = native.unary(op, x)
        ok &= torch.equal(native.unary(op, x.flip(0)).flip(0), whole)
        ok &= all(torch.equal(native.unary(op, x[s : s + n]), whole[s : s + n]) for s, n in ((0, 1), (4999, 1),
                                                                                            (7, 33), (100, 4097)))
        outs.append(whole)
    return ok, outs


def _row_ops() -> tuple[bool, list[torch.Tensor]]:
    """torch's row reductions the mode leaves alone (softmax, log_softmax, logsumexp, rms_norm's mean, a chunked
    long sum): a row alone == the row among others."""
    from kernels.batch_invariant import _reduction
    from kernels.norm import rms_norm

    X = torch.randn(19, 3000, generator=_gen(8))
    long_X = torch.randn(3, 40_000, generator=_gen(9))
    ops = {
        "softmax": lambda x: x.softmax(-1), "log_softmax": lambda x: x.log_softmax(-1),
        "logsumexp": lambda x: torch.logsumexp(x, -1), "rms_norm": lambda x: rms_norm(x, torch.ones(3000), 1e-6),
        "rms_norm bf16": lambda x: rms_norm(x.bfloat16(), torch.ones(3000, dtype=torch.bfloat16), 1e-6),
    }
    outs, ok = [], True
    for op in ops.values():
        full = op(X)
        ok &= all(torch.equal(op(X[s : s + m]), full[s : s + m]) for m, s in ((1, 0), (1, 18), (4, 6)))
        outs.append(full)
    long_sum = _reduction(torch.sum, long_X, -1, mean=False)
    ok &= torch.equal(_reduction(torch.sum, long_X[1:2], -1, mean=False), long_sum[1:2])
    return ok, [*outs, long_sum]


def _elementwise_torch() -> tuple[bool, list[torch.Tensor]]:
    """torch's elementwise math the models use (RoPE's cos / sin, exp, rsqrt, tanh, log): an element's bits the
    same alone and in a long tensor (vectorized body vs scalar tail)."""
    x = torch.randn(4099, generator=_gen(10)) * 5
    outs, ok = [], True
    for op in (torch.cos, torch.sin, torch.exp, torch.tanh, lambda t: torch.rsqrt(t.abs() + 1e-3),
               lambda t: torch.log(t.abs() + 1e-3)):
        whole = op(x)
        ok &= all(torch.equal(op(x[s : s + n]), whole[s : s + n]) for s, n in ((0, 1), (4098, 1), (5, 7), (1, 33)))
        outs.append(whole)
    return ok, outs


CHECKS = [
    Check("GEMM (F.linear / matmul / grouped expert GEMMs)", native_path, _each_thread_count(_gemm)),
    Check("attention (prefill / chunked prefill / decode / paged)", native_path, _each_thread_count(_attention)),
    Check("silu / sigmoid / exp", native_path, _each_thread_count(_elementwise_native)),
    Check("row reductions (softmax, log_softmax, logsumexp, rms_norm, long sums)", torch_path,
          _each_thread_count(_row_ops)),
    Check("elementwise math (cos, sin, exp, tanh, rsqrt, log)", torch_path, _each_thread_count(_elementwise_torch)),
]


def run_checks(checks: list[Check]) -> float:
    """Runs the checks; raises DeterminismError at the first that fails. Returns the seconds taken."""
    from kernels.batch_invariant import DeterminismError

    start = time.perf_counter()
    for check in checks:
        try:
            holds = check.holds()
        except DeterminismError:
            raise
        except Exception as e:  # a kernel that cannot even run here is as fatal as one that is not invariant
            raise DeterminismError(
                f"deterministic mode refused: its self-check of {check.op} failed to run on this machine "
                f"(kernel path: {check.path()}): {type(e).__name__}: {e}") from e
        if not holds:
            raise DeterminismError(
                f"deterministic mode refused: {check.op} is not batch-invariant on this machine (kernel path: "
                f"{check.path()}); a row's result changed with the batch, its position or the thread count")
    return time.perf_counter() - start
