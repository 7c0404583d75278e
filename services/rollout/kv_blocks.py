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

Sharing between models: a KVArena is the allocator and the pool of every engine core whose model caches the same
layout (a base model, the full-weight versions and deployments of it, each its own model and engine loop), so their
KV memory together stays within one pool of kv_cache_mb. Its tensors exist only while a block is in use.
"""
from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
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

    def try_append(self, table: list[int], num_computed: int, num_new: int) -> tuple[bool, tuple[int, int] | None]:
        """can_append and append as one step: (False, None) when the blocks are not free, else (True, the copy)."""
        if not self.can_append(table, num_computed, num_new):
            return False, None
        return True, self.append(table, num_computed, num_new)

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


class KVArena(BlockAllocator):
    """A BlockAllocator shared by engine cores stepping in their own threads, with the KVPool its blocks index.

    - Thread-safe: every operation holds the arena's lock, and try_append checks and takes a step's blocks at once.
    - A core that finds no free block (the others hold them) does not grow anything: it waits until blocks come back
      (`listen`: called after every free) and its requests run then; one request that could never fit the pool is
      refused when it is submitted (EngineCore.check).
    - The device tensors are allocated on first use and dropped when the last block comes back (every core idle), so
      an idle arena holds no KV memory; a step holds blocks from schedule to update, so they never go mid-step.
    """

    def __init__(self, layout: KVLayout, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device | str):
        super().__init__(num_blocks, block_size)
        self.layout, self.dtype, self.device = layout, dtype, device
        self._lock = threading.RLock()
        self._pool: KVPool | None = None
        self._listeners: list[Callable[[], None]] = []

    @property
    def pool(self) -> KVPool:
        with self._lock:
            if self._pool is None:
                self._pool = KVPool(self.layout, self.num_blocks, self.block_size, self.dtype, self.device)
            return self._pool

    @property
    def allocated(self) -> bool:
        """Whether the device tensors exist now."""
        return self._pool is not None

    def listen(self, fn: Callable[[], None]) -> None:
        with self._lock:
            self._listeners.append(fn)

    def unlisten(self, fn: Callable[[], None]) -> None:
        with self._lock:
            self._listeners.remove(fn)

    def can_append(self, table: list[int], num_computed: int, num_new: int) -> bool:
        with self._lock:
            return super().can_append(table, num_computed, num_new)

    def append(self, table: list[int], num_computed: int, num_new: int) -> tuple[int, int] | None:
        with self._lock:
            return super().append(table, num_computed, num_new)

    def try_append(self, table: list[int], num_computed: int, num_new: int) -> tuple[bool, tuple[int, int] | None]:
        with self._lock:
            return super().try_append(table, num_computed, num_new)

    def fork(self, table: list[int]) -> list[int]:
        with self._lock:
            return super().fork(table)

    def free(self, table: list[int]) -> None:
        with self._lock:
            super().free(table)
            if self.num_free == self.num_blocks:
                self._pool = None
            listeners = list(self._listeners)
        for fn in listeners:
            fn()
