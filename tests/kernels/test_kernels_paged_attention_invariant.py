"""kernels.paged_attention's deterministic decode rows: every decode row of a step in one call of the invariant
attention kernel, reading the pool in place through the rows' block tables; each row must be bitwise what
kernels.batch_invariant's attention gives for that row alone (a one-query decode over exactly its context, keys
gathered contiguous) and for the same position as the last query of a causal prefill. Cases mix contexts in one
step (rows either side of the kernel's 16-key blocks, prefix groups of unequal size and prefix length, single rows,
long and short contexts), a prefill chunk in the same step, pool block sizes 4, 16 and 48, float32 and bfloat16, 1
and 2 threads, the rows in another order. Tolerance: none (torch.equal). The pool's slots that no row may see hold
finite stale data, which must not leak in."""
import math
import random

import pytest
import torch

from kernels.attention import attention
from kernels.batch_invariant import batch_invariant_mode
from kernels.paged_attention import SeqSpan, paged_attention, plan_paged_attention

# (prompt length, [tokens each sample holds beyond the prompt's full blocks]) per prefix group
CASES = {
    "mixed contexts, shared key blocks": [(210, [0, 1, 2, 60, 61, 62, 63, 64]), (64, [0, 1, 3]), (17, [0, 5])],
    "block boundaries": [(63, [0]), (64, [0]), (65, [0]), (127, [0, 1]), (128, [0, 1]), (1, [190, 191, 192])],
    "unequal groups and singles": [(70, [2, 9]), (200, [1, 2, 3, 4, 5, 6, 7]), (3, [40]), (0, [5]), (300, [0])],
    "size classes": [(2100, [0, 3]), (40, [2, 2]), (1100, [1])],
}
HEADS = {"gqa": (2, 4, 32, 32), "mla-like": (4, 4, 48, 32)}  # K, H, D, Dv
NUM_BLOCKS = 2048


def _build(seed: int, groups, bs: int, dims, dtype, prefill: tuple[int, int] | None):
    """A pool holding every sequence's history (finite noise elsewhere) and the step's spans; per span its full
    key/value history [K, cached, D]."""
    K, _, D, Dv = dims
    rng = random.Random(seed)
    torch.manual_seed(seed)
    k_pool = torch.empty(K, NUM_BLOCKS, bs, D, dtype=dtype).normal_()
    v_pool = torch.empty(K, NUM_BLOCKS, bs, Dv, dtype=dtype).normal_()
    free = list(range(NUM_BLOCKS))
    rng.shuffle(free)

    def write(table, start, k_KTD, v_KTD):
        for i in range(k_KTD.shape[1]):
            pos = start + i
            k_pool[:, table[pos // bs], pos % bs] = k_KTD[:, i]
            v_pool[:, table[pos // bs], pos % bs] = v_KTD[:, i]

    spans, histories, start = [], [], 0
    for prompt_len, extras in groups:
        shared = [free.pop() for _ in range(prompt_len // bs)]
        k_shared = torch.randn(K, len(shared) * bs, D).to(dtype)
        v_shared = torch.randn(K, len(shared) * bs, Dv).to(dtype)
        write(shared, 0, k_shared, v_shared)
        for extra in extras:
            cached = len(shared) * bs + extra
            table = shared + [free.pop() for _ in range(-(-(cached + 1) // bs) - len(shared))]
            k_own = torch.randn(K, extra, D).to(dtype)
            v_own = torch.randn(K, extra, Dv).to(dtype)
            write(table, len(shared) * bs, k_own, v_own)
            spans.append(SeqSpan(start, 1, cached, table))
            histories.append((torch.cat([k_shared, k_own], 1), torch.cat([v_shared, v_own], 1)))
            start += 1
    if prefill is not None:
        cached, new = prefill
        table = [free.pop() for _ in range(-(-(cached + new) // bs))]
        k_hist, v_hist = torch.randn(K, cached, D).to(dtype), torch.randn(K, cached, Dv).to(dtype)
        write(table, 0, k_hist, v_hist)
        spans.append(SeqSpan(start, new, cached, table))
        histories.append((k_hist, v_hist))
        start += new
    return (k_pool, v_pool), spans, histories, start


def _step(pool, spans, q, k_new, v_new, scale):
    """Write the step's new keys/values into their slots (the rollout's cache does this), then attend."""
    k_pool, v_pool = pool
    bs = k_pool.shape[2]
    for s in spans:
        for t in range(s.num_new):
            p = s.num_computed + t
            k_pool[:, s.block_table[p // bs], p % bs] = k_new[0, :, s.start + t]
            v_pool[:, s.block_table[p // bs], p % bs] = v_new[0, :, s.start + t]
    with batch_invariant_mode():
        plan = plan_paged_attention(spans, k_pool, deterministic=True)
        return paged_attention(q, k_pool, v_pool, plan, scale=scale)


def _check_rows(out, spans, histories, q, k_new, v_new, scale, prefill_seed: int):
    """Every row equals its lone decode, and its position as the last query of a causal prefill."""
    gen = torch.Generator().manual_seed(prefill_seed)
    for span, (k_hist, v_hist) in zip(spans, histories):
        for t in range(span.num_new):
            row = span.start + t
            k_ctx = torch.cat([k_hist, k_new[0, :, span.start:row + 1]], 1)[None]
            v_ctx = torch.cat([v_hist, v_new[0, :, span.start:row + 1]], 1)[None]
            S = k_ctx.shape[2]
            q_row = q[:, :, row:row + 1]
            earlier = torch.randn(1, q.shape[1], S - 1, q.shape[3], generator=gen).to(q.dtype)
            with batch_invariant_mode():
                alone = attention(q_row, k_ctx, v_ctx, causal=True, q_offset=S - 1, scale=scale, backend="sdpa")
                prefill = attention(torch.cat([earlier, q_row], 2), k_ctx, v_ctx, causal=True, q_offset=0,
                                    scale=scale, backend="sdpa")
            assert torch.equal(out[0, :, row], alone[0, :, 0]), (span, "lone decode")
            assert torch.equal(out[0, :, row], prefill[0, :, -1]), (span, "prefill")


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("bs", [16, 4, 48])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batched_decode_rows_equal_each_row_alone_and_prefill(case, bs, dtype):
    dims = HEADS["gqa" if bs != 48 else "mla-like"]
    K, H, D, Dv = dims
    seed = list(CASES).index(case)
    pool, spans, histories, N = _build(seed, CASES[case], bs, dims, dtype, prefill=(70, 5) if bs == 16 else None)
    q = torch.randn(1, H, N, D).to(dtype)
    k_new, v_new = torch.randn(1, K, N, D).to(dtype), torch.randn(1, K, N, Dv).to(dtype)
    scale = 1 / math.sqrt(D)
    out = _step(pool, spans, q, k_new, v_new, scale)
    assert out.shape == (1, H, N, Dv) and out.dtype == dtype and torch.isfinite(out).all()
    decode = [s for s in spans if s.num_new == 1]
    invariant = plan_paged_attention(spans, pool[0], deterministic=True).invariant
    assert invariant.rows is None if len(decode) == N else invariant.rows.tolist() == [s.start for s in decode]
    _check_rows(out, decode, histories, q, k_new, v_new, scale, seed)


@pytest.mark.parametrize("heads", list(HEADS))
@pytest.mark.parametrize("threads", [1, 2])
def test_a_row_alone_equals_the_row_in_a_batch_in_any_order_and_threads(threads, heads):
    """The same step computed whole, with its rows in reverse order, and each row as the step's only row, at 1 and
    2 threads: bitwise the same rows."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        dims = HEADS[heads]
        K, H, D, Dv = dims
        pool, spans, histories, N = _build(7, CASES["mixed contexts, shared key blocks"], 16, dims, torch.float32,
                                           prefill=None)
        q = torch.randn(1, H, N, D)
        k_new, v_new = torch.randn(1, K, N, D), torch.randn(1, K, N, Dv)
        scale = 1 / math.sqrt(D)
        whole = _step(pool, spans, q, k_new, v_new, scale)
        flip = lambda x: x.flip(2)  # noqa: E731
        reverse = [SeqSpan(i, 1, s.num_computed, s.block_table) for i, s in enumerate(reversed(spans))]
        reversed_out = _step(pool, reverse, flip(q), flip(k_new), flip(v_new), scale)
        assert torch.equal(flip(reversed_out), whole)
        for s in spans:
            row = s.start
            alone = _step(pool, [SeqSpan(0, 1, s.num_computed, s.block_table)], q[:, :, row:row + 1],
                          k_new[:, :, row:row + 1], v_new[:, :, row:row + 1], scale)
            assert torch.equal(alone[0, :, 0], whole[0, :, row])
        _check_rows(whole, spans, histories, q, k_new, v_new, scale, 7)
    finally:
        torch.set_num_threads(previous)
