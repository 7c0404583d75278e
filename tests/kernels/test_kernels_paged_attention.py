"""kernels.paged_attention's fast decode path against a naive fp64 reference: every row attends exactly its own
context read through its block table. Cases cover samples of a prompt sharing prefix blocks (prefix groups of equal
and unequal size), rows with no full shared block, contexts past the short-context batch (size classes), batches split
by the byte budget, and a step mixing a prefill chunk with decode rows. Tolerance: fp32 1e-5 absolute; the pool's
slots that no row may see hold NaN-free stale data, which must not leak in (probabilities exactly 0)."""
import math
import random

import pytest
import torch

from kernels import paged_attention as paged
from kernels.paged_attention import SeqSpan, paged_attention, plan_paged_attention

BS, K, H, D, DV = 4, 2, 4, 8, 6
NUM_BLOCKS = 4096


def _reference(q_HD, k_KSD, v_KSD, scale):
    G = H // K
    k_HSD = k_KSD.repeat_interleave(G, 0).double()
    v_HSD = v_KSD.repeat_interleave(G, 0).double()
    probs_HS = (torch.einsum("hd,hsd->hs", q_HD.double(), k_HSD) * scale).softmax(-1)
    return torch.einsum("hs,hsd->hd", probs_HS, v_HSD)


def _build(seed: int, groups: list[tuple[int, int, list[int]]], prefill: tuple[int, int] | None):
    """groups: (prompt length, cached-prefix length shared, [extra tokens each sample holds beyond it]). Returns pool,
    spans, and each row's full key/value history for the reference."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    k_pool = torch.empty(K, NUM_BLOCKS, BS, D).normal_()  # stale data everywhere: finite, must be masked out
    v_pool = torch.empty(K, NUM_BLOCKS, BS, DV).normal_()
    free = list(range(NUM_BLOCKS))
    rng.shuffle(free)
    spans, histories, start = [], [], 0
    for prompt_len, _, extras in groups:
        shared_blocks = [free.pop() for _ in range(prompt_len // BS)]
        shared_k = torch.randn(K, len(shared_blocks) * BS, D)
        shared_v = torch.randn(K, len(shared_blocks) * BS, DV)
        for i, b in enumerate(shared_blocks):
            k_pool[:, b] = shared_k[:, i * BS:(i + 1) * BS]
            v_pool[:, b] = shared_v[:, i * BS:(i + 1) * BS]
        for extra in extras:
            cached = len(shared_blocks) * BS + extra  # tokens cached before this step
            own = [free.pop() for _ in range(-(-(cached + 1) // BS) - len(shared_blocks))]
            table = shared_blocks + own
            own_k = torch.randn(K, cached - len(shared_blocks) * BS, D)
            own_v = torch.randn(K, cached - len(shared_blocks) * BS, DV)
            for p in range(own_k.shape[1]):
                pos = len(shared_blocks) * BS + p
                k_pool[:, table[pos // BS], pos % BS] = own_k[:, p]
                v_pool[:, table[pos // BS], pos % BS] = own_v[:, p]
            spans.append(SeqSpan(start, 1, cached, table))
            histories.append((torch.cat([shared_k, own_k], 1), torch.cat([shared_v, own_v], 1)))
            start += 1
    if prefill is not None:
        cached, new = prefill
        table = [free.pop() for _ in range(-(-(cached + new) // BS))]
        k_hist, v_hist = torch.randn(K, cached, D), torch.randn(K, cached, DV)
        for p in range(cached):
            k_pool[:, table[p // BS], p % BS] = k_hist[:, p]
            v_pool[:, table[p // BS], p % BS] = v_hist[:, p]
        spans.append(SeqSpan(start, new, cached, table))
        histories.append((k_hist, v_hist))
        start += new
    return (k_pool, v_pool), spans, histories, start


def _attend(pool, spans, q, k_new, v_new, scale, *, deterministic=False, batch_bytes=None):
    """Write the step's new keys/values into their slots (the rollout's cache does this), then attend."""
    k_pool, v_pool = pool
    bs = k_pool.shape[2]
    for s in spans:
        for t in range(s.num_new):
            p = s.num_computed + t
            k_pool[:, s.block_table[p // bs], p % bs] = k_new[0, :, s.start + t]
            v_pool[:, s.block_table[p // bs], p % bs] = v_new[0, :, s.start + t]
    plan = plan_paged_attention(spans, k_pool, deterministic=deterministic, batch_bytes=batch_bytes)
    return paged_attention(q, k_pool, v_pool, plan, scale=scale, workspace={})


CASES = {
    "equal groups": ([(16, 0, [0, 1, 2, 3]), (9, 0, [0, 0, 5])], None),
    "unequal groups and singles": ([(12, 0, [0, 3]), (20, 0, [1, 2, 7, 7, 9]), (2, 0, [30]), (0, 0, [5])], None),
    "long contexts": ([(1100, 0, [0, 3, 8]), (40, 0, [2, 2]), (2100, 0, [1])], None),
    "with prefill": ([(16, 0, [0, 1]), (8, 0, [3])], (13, 6)),
}


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("budget", [paged.DECODE_BATCH_BYTES, 256])
def test_fast_paged_attention_matches_reference(name, budget):
    groups, prefill = CASES[name]
    pool, spans, histories, N = _build(list(CASES).index(name), groups, prefill)
    q = torch.randn(1, H, N, D)
    k_new, v_new = torch.randn(1, K, N, D), torch.randn(1, K, N, DV)
    scale = 1 / math.sqrt(D)
    out = _attend(pool, spans, q, k_new, v_new, scale, batch_bytes=budget)
    assert out.shape == (1, H, N, DV) and torch.isfinite(out).all()
    for span, (k_hist, v_hist) in zip(spans, histories):
        for t in range(span.num_new):
            row = span.start + t
            k_ctx = torch.cat([k_hist, k_new[0, :, span.start:row + 1]], 1)
            v_ctx = torch.cat([v_hist, v_new[0, :, span.start:row + 1]], 1)
            ref = _reference(q[0, :, row], k_ctx, v_ctx, scale)
            torch.testing.assert_close(out[0, :, row].double(), ref, atol=1e-5, rtol=0)


def test_batches_split_by_budget_and_size_class():
    groups, _ = CASES["long contexts"]
    (k_pool, _), spans, _, N = _build(1, groups, None)
    one = plan_paged_attention(spans, k_pool, deterministic=False).decode_batches
    # size classes (contexts up to 2 * DECODE_BATCH_MIN_TOKENS share one): {1100.., 40..} and {2100..}
    assert [b.rows.tolist() for b in one] == [[0, 1, 2, 3, 4], [5]]
    many = plan_paged_attention(spans, k_pool, deterministic=False, batch_bytes=1).decode_batches
    assert len(many) == 3  # one group per batch when every group exceeds the budget
    rows = sorted(r for b in many for r in b.rows.tolist())
    assert rows == list(range(N))
