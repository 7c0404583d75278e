"""PagedStepCache's bookkeeping around kernels.paged_attention (whose numerics tests/kernels checks): attend writes the
step's new keys/values into their slots of the layer's pool (other layers untouched), zeroes every block the step
starts writing before the write, so a pool allocated uninitialised (NaN here) never leaks into a row, and returns
what the kernel gives on the written pool (torch.equal), in both modes."""
import math

import pytest
import torch

from kernels.batch_invariant import batch_invariant_mode
from kernels.paged_attention import SeqSpan, paged_attention, plan_paged_attention
from services.rollout.kv_blocks import KVLayout, KVPool
from services.rollout.paged_cache import PagedStepCache

BS, K, H, D, DV = 4, 2, 4, 8, 6


@pytest.mark.parametrize("deterministic", [False, True])
def test_attend_writes_slots_zeroes_fresh_blocks_and_calls_the_kernel(deterministic):
    torch.manual_seed(0)
    pool = KVPool(KVLayout(2, K, D, DV), num_blocks=16, block_size=BS, dtype=torch.float32, device="cpu")
    pool.k.fill_(float("nan"))  # uninitialised memory
    pool.v.fill_(float("nan"))
    # Cached so far: sequence a 6 tokens in blocks [3, 7] (block 7 half full, its tail zeroed when it was fresh),
    # sequence b 4 tokens in block [5] (full).
    for block in (3, 7, 5):
        pool.k[:, :, block] = torch.randn(2, K, BS, D)
        pool.v[:, :, block] = torch.randn(2, K, BS, DV)
    pool.k[:, :, 7, 2:] = 0
    pool.v[:, :, 7, 2:] = 0
    spans = [SeqSpan(0, 1, 6, [3, 7]),  # decode into block 7 (not fresh)
             SeqSpan(1, 1, 4, [5, 9]),  # decode into block 9 (fresh: starts at its first slot)
             SeqSpan(2, 5, 0, [11, 12])]  # a prefill filling block 11 and starting block 12
    N = 7
    q = torch.randn(1, H, N, D)
    k_new, v_new = torch.randn(1, K, N, D), torch.randn(1, K, N, DV)
    before = pool.k[0].clone()
    cache = PagedStepCache(pool, spans, deterministic=deterministic)
    with batch_invariant_mode(deterministic):
        out = cache.attend(1, q, k_new, v_new, scale=1 / math.sqrt(D))
    assert torch.isfinite(out).all()
    torch.testing.assert_close(pool.k[0], before, rtol=0, atol=0, equal_nan=True)  # another layer's pool
    slots = [(7, 2), (9, 0), (11, 0), (11, 1), (11, 2), (11, 3), (12, 0)]
    for n, (block, slot) in enumerate(slots):
        assert torch.equal(pool.k[1, :, block, slot], k_new[0, :, n])
        assert torch.equal(pool.v[1, :, block, slot], v_new[0, :, n])
    assert torch.equal(pool.k[1, :, 9, 1:], torch.zeros(K, BS - 1, D))  # fresh blocks: zero past the write
    assert torch.equal(pool.k[1, :, 12, 1:], torch.zeros(K, BS - 1, D))
    assert torch.isnan(pool.k[1, :, 13]).all()  # blocks no sequence holds stay as they were
    with batch_invariant_mode(deterministic):
        plan = plan_paged_attention(spans, pool.k[1], deterministic=deterministic)
        want = paged_attention(q, pool.k[1], pool.v[1], plan, scale=1 / math.sqrt(D))
    assert torch.equal(out, want)
