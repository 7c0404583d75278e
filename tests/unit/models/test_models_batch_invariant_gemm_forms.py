"""Probes for the GEMM and silu forms kernels/batch_invariant.py relies on beyond the transposed product: queries on a
GEMM's row side padded only to query_rows' classes (attention), a linear layer's GEMM issued directly, and silu run
through torch's vectorized loop in pieces. Each measures, on whatever machine runs it, the property the code assumes
(docs/deterministic.md); a BLAS or CPU that breaks one fails here first. Tolerance: none (torch.equal), except silu
against plain torch (1e-6 relative in float32, bf16 rounding in bf16) and its gradient (1e-6 relative).
"""
import pytest
import torch
import torch.nn.functional as F

from kernels.batch_invariant import MIN_ROWS, SILU_ALIGN, batch_invariant_mode, invariant_linear, query_rows


@pytest.fixture(autouse=True)
def restore_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("threads", [1, 2])
def test_probe_row_side_counts_in_one_class_round_a_row_alike(threads):
    """q [n, D] x k^T [D, S] (attention scores) and p [n, 64] x v [64, Dv] (P V): a row's bits are the same for every
    n that query_rows returns (4, 8, 12 and up), at any key count and offset; 1-3 rows round differently."""
    torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(threads)
    counts = sorted({query_rows(n) for n in range(1, 40)} | {64, 256})
    differ_small = False
    for D, S in ((32, 16), (64, 100), (64, 1000), (128, 300), (192, 64)):
        q, k = torch.randn(300, D, generator=gen), torch.randn(S + 40, D, generator=gen)
        ref = torch.bmm(q[None], k[None].transpose(1, 2))[0]
        for n in counts:
            for offset in (0, 7):
                out = torch.bmm(q[None, offset:offset + n], k[None, 3:3 + S].transpose(1, 2))[0]
                assert torch.equal(out, ref[offset:offset + n, 3:3 + S]), (D, S, n, offset)
        differ_small |= not torch.equal(torch.mm(q[:2], k.t()), ref[:2])
    for Dv in (16, 64, 128):
        p, v = torch.rand(300, 64, generator=gen), torch.randn(64, Dv, generator=gen)
        ref = torch.bmm(p[None], v[None])[0]
        for n in counts:
            assert torch.equal(torch.bmm(p[None, 5:5 + n], v[None])[0], ref[5:5 + n]), (Dv, n)
    assert all(query_rows(n) >= n and (query_rows(n) in (4, 8) or query_rows(n) >= 12) for n in range(1, 300))
    assert differ_small, "2 query rows rounded like 300 here: the padding to query_rows may no longer be needed"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("threads", [1, 2])
def test_linear_direct_form_is_the_transposed_product(dtype, threads):
    """invariant_linear issues x w^T directly (rows padded to MIN_ROWS); bitwise what the transposed product
    (w x^T)^T, chunked by 256 rows past 512, gives, and a row's bits do not depend on M."""
    torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(3)
    for K, N in ((512, 1536), (1536, 512), (128, 384), (4096, 1024)):
        W, X = torch.randn(N, K, generator=gen).to(dtype), torch.randn(1100, K, generator=gen).to(dtype)
        full = invariant_linear(X, W)
        transposed = torch.cat([torch.mm(W, X[s:e].t()).t() for s, e in ((0, 256), (256, 512), (512, 768),
                                                                          (768, 1100))])
        assert torch.equal(full, transposed), (K, N)
        for M in (1, 2, 5, 13, 16, 100, 600):
            assert torch.equal(invariant_linear(X[7:7 + M], W), full[7:7 + M]), (K, N, M)
    assert MIN_ROWS >= 12


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("threads", [1, 2])
def test_silu_bits_depend_only_on_the_value(dtype, threads):
    """Under the mode, silu of an element is the same wherever it sits (tensor size, offset, layout, thread count),
    including tensors longer than torch's parallel grain and sizes that are not a multiple of SILU_ALIGN."""
    torch.set_num_threads(threads)
    x = (torch.randn(300_001, generator=torch.Generator().manual_seed(4)) * 4).to(dtype)
    with batch_invariant_mode():
        whole = F.silu(x)
        assert torch.equal(F.silu(x.flip(0)).flip(0), whole)
        assert torch.equal(F.silu(x[12_345:12_345 + 77_777]), whole[12_345:12_345 + 77_777])
        assert torch.equal(F.silu(x[:SILU_ALIGN + 3]), whole[:SILU_ALIGN + 3])
        assert torch.equal(F.silu(x[:300_000].view(600, 500).t()), whole[:300_000].view(600, 500).t())
    torch.testing.assert_close(whole.float(), F.silu(x.float()), rtol=1e-2 if dtype == torch.bfloat16 else 1e-6,
                               atol=0)


def test_silu_gradient_under_the_mode():
    x = torch.randn(5000, generator=torch.Generator().manual_seed(5), requires_grad=True)
    with batch_invariant_mode():
        y = F.silu(x)
        (y * torch.arange(5000.0)).sum().backward()
    grad = x.grad.clone()
    x.grad = None
    (F.silu(x) * torch.arange(5000.0)).sum().backward()
    torch.testing.assert_close(grad, x.grad, rtol=1e-6, atol=0)
    with batch_invariant_mode(), torch.no_grad():
        assert torch.equal(y.detach(), F.silu(x.detach()))  # the same forward bits with and without autograd
