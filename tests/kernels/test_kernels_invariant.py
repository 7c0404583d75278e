"""The batch-invariant kernels (kernels/csrc/invariant.c through kernels/native.py) and deterministic mode's
self-check.

What the mode relies on, asserted as the product promises it: a row's GEMM / attention / silu result depends only on
that row's operands (not on M, its offset, the operand layout, a split over K, the thread count), and, since every
output is one fixed chain of IEEE operations, the AVX-512, AVX2 and scalar builds of the kernels give the same bits
(the builds this machine can run; on AMX, bf16 x bf16 GEMMs excepted). Accuracy against named references: float64 products (GEMM, attention, exp /
silu / sigmoid) within stated float32 tolerances. Tolerance for invariance: none (torch.equal).
"""
import math

import pytest
import torch
import torch.nn.functional as F

from kernels import batch_invariant, native
from kernels.attention import Packing
from kernels.batch_invariant import DeterminismError, batch_invariant_mode, reference_softmax_attention
from kernels.invariant_checks import CHECKS, Check, run_checks

THREADS = (1, 2)
pytestmark = pytest.mark.usefixtures("one_thread")  # the process's thread count back after the tests that set 2


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _builds() -> dict[str, object]:
    """Every build of the kernels this CPU can run: native, and the narrower ones its flags allow."""
    flags = native._cpu_flags().split()
    names = ["native", "scalar"] + (["avx2"] if {"avx2", "fma"} <= set(flags) else [])
    return {name: native.library(name) for name in names}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("threads", THREADS)
def test_gemm_row_depends_only_on_its_operands(dtype, threads):
    torch.set_num_threads(threads)
    for K, N in ((512, 1536), (1536, 512), (100, 33), (4096, 64)):
        W = torch.randn(N, K, generator=_gen(K)).to(dtype)
        X = torch.randn(700, K, generator=_gen(N)).to(dtype)
        full = native.gemm(X, W.t())
        for M in (1, 2, 3, 5, 12, 13, 16, 97, 300):
            for offset in (0, 7, 699 - M):
                assert torch.equal(native.gemm(X[offset:offset + M], W.t()), full[offset:offset + M]), (K, N, M)
        assert torch.equal(native.gemm(X, W.t().contiguous()), full)  # [K, N] row-major: the same chains
        assert torch.equal(native.gemm(X.t().contiguous().t(), W.t()), full)  # column-major x
        split = K // 3 // 32 * 32  # bf16 x bf16 chains go by pairs of k (by 32 on AMX): a split continues one there
        part = native.gemm(X[:, :split], W.t()[:split])
        assert torch.equal(native.gemm(X[:, split:], W.t()[split:], part, accumulate=True), full)
        truth = X.double() @ W.double().t()
        err = ((full.double() - truth).abs() / (X.double().abs() @ W.double().abs().t())).max().item()
        assert err <= K * 6e-8, (K, N, err)  # a sequential float32 sum: relative to sum |x||w|, <= K * 2^-24


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_build_gives_the_same_bits(dtype):
    """GEMM, attention and the elementwise ops: one chain of IEEE operations per output, whatever the ISA."""
    builds = _builds()
    assert native.isa(builds["native"]) in ("avx512", "avx2", "scalar") and native.isa(builds["scalar"]) == "scalar"
    W, X = torch.randn(300, 200, generator=_gen(1)).to(dtype), torch.randn(45, 200, generator=_gen(2)).to(dtype)
    gemms = {name: native.gemm(X, W.t(), lib=lib) for name, lib in builds.items()}
    x = (torch.randn(5000, generator=_gen(3)) * 10).to(dtype)
    unaries = {name: [native.unary(op, x, lib=lib) for op in native.UNARY_OPS] for name, lib in builds.items()}
    q, k, v = (torch.randn(2, h, 70, 40, generator=_gen(4 + h)).to(dtype) for h in (4, 2, 2))
    lo, hi = batch_invariant.causal_ranges(2, 70, 70, causal=True)
    attns = {}
    for name, lib in builds.items():
        out = torch.empty(2, 4, 70, 40)
        native.attention(q, k, v, lo, hi, scale=0.15, q_strides=q.stride()[:3], k_strides=(k.stride(0), k.stride(1),
                         0, k.stride(2)), v_strides=(v.stride(0), v.stride(1), 0, v.stride(2)),
                         shape=(2, 2, 2, 70, 40, 40), out=out, out_strides=out.stride()[:3], lib=lib)
        attns[name] = out
    # AMX rounds inside its 32-k chunk its own way: a build on it matches the others save for bf16 x bf16 GEMMs
    # (scripts/test_deterministic.sh runs this again with TRAINYARD_INVARIANT_AMX=0: the AVX512_BF16 path)
    same_gemm = [n for n in builds if not (dtype == torch.bfloat16 and native.bf16_dot(builds[n]) == "amx_bf16")]
    for name in same_gemm:
        assert torch.equal(gemms[name], gemms[same_gemm[0]]), name
    for name in builds:
        assert all(torch.equal(a, b) for a, b in zip(unaries[name], unaries["native"])), name
        assert torch.equal(attns[name], attns["native"]), name


def test_elementwise_accuracy_against_float64():
    """The kernel's exp within 2 ulp (relative 2.4e-7) of float64 over [-87, 88]; silu and sigmoid within 4e-7
    relative; exp(-inf) = 0, sigmoid / silu of large |x| saturate without NaN."""
    x = torch.linspace(-87, 88, 200_001)
    exp = native.unary("exp", x).double()
    assert ((exp - x.double().exp()).abs() / x.double().exp()).max().item() <= 2.4e-7
    y = torch.linspace(-80, 80, 200_001)
    sig = torch.sigmoid(y.double())
    assert ((native.unary("sigmoid", y).double() - sig).abs() / sig).max().item() <= 4e-7
    silu = y.double() * sig
    rel = ((native.unary("silu", y).double() - silu).abs() / silu.abs().clamp(min=1e-30)).max().item()
    assert rel <= 4e-7
    edge = torch.tensor([-math.inf, -1e30, -100.0, 0.0, 100.0, 1e30])
    assert native.unary("exp", edge)[:3].tolist() == [0.0, 0.0, 0.0] and native.unary("exp", edge)[3] == 1.0
    assert torch.isfinite(native.unary("sigmoid", edge[1:])).all() and torch.isfinite(native.unary("silu", edge[1:])).all()


@pytest.mark.parametrize("threads", THREADS)
@pytest.mark.parametrize("case", ["causal gqa", "mla dims", "packed", "additive mask", "bf16"])
def test_attention_against_float64_and_row_invariance(case, threads):
    """The kernel's attention vs a float64 softmax reference (float32: 2e-6; bf16 inputs: bf16 output rounding),
    and each query row alone (its keys only) bitwise equal to the same row in the full call."""
    torch.set_num_threads(threads)
    H, Kh, T, D, Dv, dtype, mask = 4, 2, 90, 32, 32, torch.float32, None
    if case == "mla dims":
        H, Kh, D, Dv = 4, 4, 48, 24
    if case == "bf16":
        dtype = torch.bfloat16
    q = torch.randn(1, H, T, D, generator=_gen(1)).to(dtype)
    k, v = torch.randn(1, Kh, T, D, generator=_gen(2)).to(dtype), torch.randn(1, Kh, T, Dv, generator=_gen(3)).to(dtype)
    lo, hi = batch_invariant.causal_ranges(1, T, T, causal=True)
    if case == "packed":
        lo, hi = batch_invariant.packed_ranges(Packing.from_lengths([17, 1, 42, 30]), causal=True)
    if case == "additive mask":
        mask = torch.randn(1, 1, T, T, generator=_gen(4)).expand(1, H, T, T)
    out = batch_invariant.attend(q, k, v, lo, hi, 0.2, mask)
    truth = reference_softmax_attention(q.double(), k.double(), v.double(), lo, hi, 0.2,
                                        None if mask is None else mask.double())
    err = (out.double() - truth).abs().max().item()
    assert err <= (1.6e-2 if dtype == torch.bfloat16 else 2e-6), err
    for t in (0, 1, 16, 17, 59, 89):
        a, b = int(lo[0, t]), int(hi[0, t])
        alone = batch_invariant.attend(q[:, :, t:t + 1], k[:, :, a:b], v[:, :, a:b],
                                       torch.zeros(1, 1, dtype=torch.int32), torch.tensor([[b - a]], dtype=torch.int32),
                                       0.2, None if mask is None else mask[:, :, t:t + 1, a:b])
        assert torch.equal(alone[:, :, 0], out[:, :, t]), t


def test_attention_gradients_match_plain_torch():
    """Autograd through the mode's attention: the backward is plain torch's softmax attention (1e-5)."""
    q, k, v = (torch.randn(2, h, 30, 16, generator=_gen(h), requires_grad=True) for h in (4, 2, 2))
    grads = {}
    for mode in (False, True):
        for t in (q, k, v):
            t.grad = None
        with batch_invariant_mode(mode):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        (out * torch.arange(16.0)).sum().backward()
        grads[mode] = [t.grad.clone() for t in (q, k, v)]
    for a, b in zip(grads[True], grads[False]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_self_check_passes_fast_here():
    seconds = run_checks(CHECKS)
    print(f"\nself-check: {seconds * 1e3:.1f} ms on {native.isa()} ({torch.get_num_threads()} threads)")
    assert seconds < 1.0


def test_self_check_refuses_naming_the_op_and_the_kernel_path(monkeypatch):
    """A machine where an op is not invariant: entering the mode raises, naming the op and the kernel path, and
    never runs the block."""
    broken = Check("GEMM (F.linear / matmul / grouped expert GEMMs)", lambda: "kernels/csrc/invariant.c, test build",
                   lambda: False)
    with pytest.raises(DeterminismError, match=r"GEMM .* not batch-invariant .*kernel path: kernels/csrc/invariant"):
        batch_invariant.self_check([broken])
    crashing = Check("attention", lambda: "torch test kernel", lambda: 1 / 0)
    with pytest.raises(DeterminismError, match=r"self-check of attention failed to run .*torch test kernel"):
        batch_invariant.self_check([crashing])
    monkeypatch.setattr(batch_invariant, "_checked", [])
    monkeypatch.setattr("kernels.invariant_checks.CHECKS", [broken])
    ran = []
    with pytest.raises(DeterminismError):
        with batch_invariant_mode():
            ran.append(True)
    assert ran == []


def test_probe_plain_torch_linear_rows_by_batch_size():
    """Printed, not asserted: which row counts make plain torch's F.linear round a row differently from the row
    alone on this machine (docs/deterministic.md shows one machine's table); the mode's are always none."""
    W, X = torch.randn(1536, 512, generator=_gen(5)), torch.randn(257, 512, generator=_gen(6))
    for dtype in (torch.float32, torch.bfloat16):
        Wd, Xd = W.to(dtype), X.to(dtype)
        table = {}
        for threads in THREADS:
            torch.set_num_threads(threads)
            alone = torch.cat([F.linear(Xd[i:i + 1], Wd) for i in range(0, 257, 16)])
            table[threads] = [M for M in (1, 2, 5, 7, 9, 64, 257)
                              if not torch.equal(F.linear(Xd[:M], Wd)[::16], alone[: -(-M // 16)])]
            with batch_invariant_mode():
                mine = torch.cat([F.linear(Xd[i:i + 1], Wd) for i in range(0, 257, 16)])
                assert torch.equal(F.linear(Xd, Wd)[::16], mine)
        print(f"\nplain {dtype} F.linear, M whose rows differ from the row alone, by thread count: {table} "
              f"({native._cpu_flags().count('avx512')} avx512 flags)")
