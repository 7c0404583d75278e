"""Paged KV memory: a pool of fixed-size blocks per base model, reference counts, per-sequence block tables.

Shapes: L layers, NB blocks in the pool, BS block size (tokens), K cached heads, Dk / Dv key / value head dims
(MLA caches full per-head keys and values: K = heads, Dk = 192, Dv = 128; see ModelArgs.kv_cache_dims).

A sequence's block table is a list of block ids: block i holds its positions i*BS .. i*BS + BS - 1. Two halves:
- BlockAllocator: the host-side accounting (free list, reference counts), plain Python, no tensors. The scheduler
  owns it; it decides which blocks a step writes and which must be copied first.
- KVPool: the device tensors. The runner writes the new keys/values of a step into their slots and copies blocks
  (copy-on-write) before the forward; the paged cache reads blocks through block tables.

Prefix sharing: `fork` gives another sequence the same blocks (each reference counted), e.g. the n samples of one
prompt share the prompt's blocks. Full blocks are never written again, so only the partial last block can need a
private copy: `append` copies it (copy-on-write) before a sequence writes into a block someone else holds.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch


class BlockAllocator:
    def __init__(self, num_blocks: int, block_size: int):
        assert num_blocks >= 1 and block_size >= 1
        self.num_blocks, self.block_size = num_blocks, block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._refs = [0] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    def refcount(self, block: int) -> int:
        return self._refs[block]

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _cost(self, table: list[int], num_computed: int, num_new: int) -> tuple[int, bool]:
        """(fresh blocks needed, whether the partial last block must be copied first) to write num_new tokens
        after num_computed."""
        new = max(0, self.blocks_for(num_computed + num_new) - len(table))
        partial = num_computed % self.block_size
        cow = bool(partial) and self._refs[table[num_computed // self.block_size]] > 1
        return new, cow

    def can_append(self, table: list[int], num_computed: int, num_new: int) -> bool:
        new, cow = self._cost(table, num_computed, num_new)
        return new + cow <= len(self._free)

    def append(self, table: list[int], num_computed: int, num_new: int) -> tuple[int, int] | None:
        """Make table ready for positions num_computed .. num_computed + num_new - 1 (in place). Returns the
        (source, destination) block copy the device must do first, if the partial last block was shared."""
        new, cow = self._cost(table, num_computed, num_new)
        assert new + cow <= len(self._free), "append without can_append"
        copy = None
        if cow:
            i = num_computed // self.block_size
            src, dst = table[i], self._take()
            self._refs[src] -= 1  # still > 0: another sequence holds it
            table[i] = dst
            copy = (src, dst)
        table.extend(self._take() for _ in range(new))
        return copy

    def fork(self, table: list[int]) -> list[int]:
        """A second reference to every block of table (a new table for another sequence)."""
        for b in table:
            self._refs[b] += 1
        return list(table)

    def free(self, table: list[int]) -> None:
        for b in table:
            self._refs[b] -= 1
            assert self._refs[b] >= 0, f"block {b} freed twice"
            if self._refs[b] == 0:
                self._free.append(b)
        table.clear()

    def _take(self) -> int:
        b = self._free.popleft()
        self._refs[b] = 1
        return b


@dataclass(frozen=True)
class KVLayout:
    """What the pool stores per token and layer: K cached heads of Dk key and Dv value dims."""

    num_layers: int
    num_heads: int
    k_dim: int
    v_dim: int

    @classmethod
    def of(cls, args) -> KVLayout:
        """From any family's ModelArgs (as models.kv_cache.KVCache.allocate reads it)."""
        k_dim, v_dim = args.kv_cache_dims if hasattr(args, "kv_cache_dims") else (args.head_dim, args.head_dim)
        return cls(args.num_layers, args.num_kv_heads, k_dim, v_dim)

    def bytes_per_block(self, block_size: int, dtype: torch.dtype) -> int:
        itemsize = torch.empty((), dtype=dtype).element_size()
        return self.num_layers * block_size * self.num_heads * (self.k_dim + self.v_dim) * itemsize


class KVPool:
    """k: [L, K, NB, BS, Dk], v: [L, K, NB, BS, Dv]: heads outermost, so gathering a sequence's blocks gives per-head
    [S, D] keys whose rows are contiguous, which batched matmuls take as they are (a [NB, BS, K, D] layout made
    every decode-attention matmul copy its keys first: measured ~2-4x slower on CPU).

    Allocated uninitialised (zeroing gigabytes up front would only cost time): the fast decode path zeroes a block
    when a step first writes into it (services/rollout/paged_cache.py), and deterministic attention slices every
    sequence to its own length."""

    def __init__(self, layout: KVLayout, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device | str):
        L, K = layout.num_layers, layout.num_heads
        self.layout, self.num_blocks, self.block_size = layout, num_blocks, block_size
        self.k = torch.empty(L, K, num_blocks, block_size, layout.k_dim, dtype=dtype, device=device)
        self.v = torch.empty(L, K, num_blocks, block_size, layout.v_dim, dtype=dtype, device=device)

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        if not copies:
            return
        src = torch.tensor([s for s, _ in copies], device=self.k.device)
        dst = torch.tensor([d for _, d in copies], device=self.k.device)
        self.k[:, :, dst] = self.k[:, :, src]
        self.v[:, :, dst] = self.v[:, :, src]
