"""The cache a model forward sees during one engine step: packed tokens of many sequences over the paged KV pool.

Shapes: N tokens of the step packed in one row ([1, N]), H query heads, K cached heads, D / Dv key / value head dims,
NB blocks in the pool, BS block size.

The model calls `attend(layer, q, k, v, scale=)` in every attention layer (the contract of models/kv_cache.py). Here
it writes the step's new keys/values into their slots of the pool, then attends each sequence's queries to exactly
its own context through kernels.paged_attention (prefill chunks, decode rows; its deterministic mode's decode rows
are bitwise the trainer's). Everything that does not depend on the layer (slots, block tables, the decode rows'
batches) is built once per step. Masked positions of the attention may hold another sequence's data, so every block
is zeroed when a step first writes into it: no slot in use ever holds uninitialised memory (a NaN there would poison
the masked sums).

The models read `length` (the position of the first new token) and `max_len` only for default positions and an
overflow check; the engine always passes explicit positions, so length is 0 here and max_len the pool's capacity.
"""
from __future__ import annotations

import torch

from kernels.paged_attention import SeqSpan, paged_attention, plan_paged_attention
from services.rollout.kv_blocks import KVPool


class PagedStepCache:
    length = 0

    def __init__(self, pool: KVPool, spans: list[SeqSpan], *, deterministic: bool,
                 workspace: dict[str, torch.Tensor] | None = None):
        self.pool = pool
        self.workspace = {} if workspace is None else workspace
        self.max_len = pool.num_blocks * pool.block_size
        device, bs = pool.k.device, pool.block_size
        slots: list[int] = []
        for s in spans:
            table = s.block_table
            slots += [table[p // bs] * bs + p % bs for p in range(s.num_computed, s.num_computed + s.num_new)]
        self.slots_N = torch.tensor(slots, dtype=torch.int64, device=device)
        # Blocks this step starts writing (a write at their first slot): zeroed before the write, so every slot of a
        # block in use holds a sequence's key/value or zero, never uninitialised memory. The fast decode path relies
        # on it: it reads whole blocks, masks scores with -inf and multiplies values by probabilities of exactly 0,
        # which a NaN in a slot past a row's context would poison.
        fresh = [s.block_table[p // bs] for s in spans
                 for p in range(-(-s.num_computed // bs) * bs, s.num_computed + s.num_new, bs)]
        self.fresh_blocks = torch.tensor(fresh, dtype=torch.int64, device=device) if fresh else None
        self.plan = plan_paged_attention(spans, pool.k[0], deterministic=deterministic)

    def attend(
        self, layer: int, q_1HND: torch.Tensor, k_1KND: torch.Tensor, v_1KND: torch.Tensor, *,
        scale: float | None = None,
    ) -> torch.Tensor:
        k_pool, v_pool = self.pool.k[layer], self.pool.v[layer]  # [K, NB, BS, D]
        K, Dk, Dv = k_pool.shape[0], k_pool.shape[3], v_pool.shape[3]
        if self.fresh_blocks is not None:
            k_pool.index_fill_(1, self.fresh_blocks, 0)
            v_pool.index_fill_(1, self.fresh_blocks, 0)
        k_pool.view(K, -1, Dk).index_copy_(1, self.slots_N, k_1KND[0])
        v_pool.view(K, -1, Dv).index_copy_(1, self.slots_N, v_1KND[0])
        return paged_attention(q_1HND, k_pool, v_pool, self.plan, scale=scale, workspace=self.workspace)
