"""The cache a model forward sees during one engine step: packed tokens of many sequences over the paged KV pool.

Shapes: N tokens of the step packed in one row ([1, N]), H query heads, K cached heads (G = H / K per group),
S a sequence's context (cached + new), b rows of a decode group, D / Dv key / value head dims, NB blocks in the
pool, BS block size.

The model calls `attend(layer, q, k, v, scale=)` in every attention layer (the contract of models/kv_cache.py). Here
it writes the step's new keys/values into their slots of the pool, then attends each sequence's queries to exactly
its own context, read through its block table:
- a prefill chunk (T > 1 new tokens at q_offset = tokens cached before): one kernels.attention call per sequence
  over its gathered context, causal from q_offset;
- decode rows (one new token each) are batched by context length: rows with the same S (the n samples of a prompt
  advance together) are one gather of whole blocks and, in the fast path, two batched matmuls with the positions
  past S masked (measured on CPU, 8 rows of S = 136: ~3x faster than slicing the keys to S first, which makes the
  matmuls copy them; one attention call per row was ~2x slower than a group, padding every row of the step to the
  longest context with a mask ~5x slower);
- in deterministic mode a decode group is one kernels.attention call instead, which under
  kernels.batch_invariant.batch_invariant_mode() computes every query row with one algorithm whatever the batch,
  the number of queries or the key count beyond what the row sees; so a position's result depends neither on the
  other rows of the step nor on whether it came from a prefill or a decode.
Nothing reads beyond a sequence's length, so the pool's unwritten slots never matter.

The models read `length` (the position of the first new token) and `max_len` only for default positions and an
overflow check; the engine always passes explicit positions, so length is 0 here and max_len the pool's capacity.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kernels import attention
from services.rollout.kv_blocks import KVPool


@dataclass(frozen=True)
class _Prefill:
    start: int  # first row in the packed tokens
    num_new: int
    q_offset: int  # tokens of this sequence cached before the step
    blocks: torch.Tensor  # int64 [ceil(S / BS)]


@dataclass(frozen=True)
class _DecodeGroup:
    rows: torch.Tensor  # int64 [b] rows in the packed tokens
    blocks: torch.Tensor  # int64 [b, ceil(S / BS)]
    context: int  # S, the same for every row of the group


@dataclass(frozen=True)
class SeqSpan:
    """One sequence of the step: rows start .. start + num_new - 1 at positions num_computed .. ."""

    start: int
    num_new: int
    num_computed: int
    block_table: list[int]


class PagedStepCache:
    length = 0

    def __init__(self, pool: KVPool, spans: list[SeqSpan], *, deterministic: bool):
        self.pool = pool
        self.max_len = pool.num_blocks * pool.block_size
        device, bs = pool.k.device, pool.block_size
        slots: list[int] = []
        for s in spans:
            table = s.block_table
            slots += [table[p // bs] * bs + p % bs for p in range(s.num_computed, s.num_computed + s.num_new)]
        self.slots_N = torch.tensor(slots, dtype=torch.int64, device=device)
        self.prefills: list[_Prefill] = []
        by_context: dict[int, list[SeqSpan]] = {}
        self.deterministic = deterministic
        for s in spans:
            context = s.num_computed + s.num_new
            if s.num_new == 1:
                by_context.setdefault(context, []).append(s)
            else:
                blocks = torch.tensor(s.block_table[: -(-context // bs)], dtype=torch.int64, device=device)
                self.prefills.append(_Prefill(s.start, s.num_new, s.num_computed, blocks))
        self.decode_groups = [
            _DecodeGroup(
                rows=torch.tensor([s.start for s in group], dtype=torch.int64, device=device),
                blocks=torch.tensor([s.block_table[: -(-context // bs)] for s in group], dtype=torch.int64,
                                    device=device),
                context=context,
            )
            for context, group in by_context.items()
        ]

    def attend(
        self, layer: int, q_1HND: torch.Tensor, k_1KND: torch.Tensor, v_1KND: torch.Tensor, *,
        scale: float | None = None,
    ) -> torch.Tensor:
        k_pool, v_pool = self.pool.k[layer], self.pool.v[layer]  # [K, NB, BS, D]
        K, Dk, Dv = k_pool.shape[0], k_pool.shape[3], v_pool.shape[3]
        k_pool.view(K, -1, Dk).index_copy_(1, self.slots_N, k_1KND[0])
        v_pool.view(K, -1, Dv).index_copy_(1, self.slots_N, v_1KND[0])
        H, N = q_1HND.shape[1], q_1HND.shape[2]
        out_HND = q_1HND.new_empty(H, N, Dv)
        for p in self.prefills:
            S = p.q_offset + p.num_new
            k_1KSD = k_pool.index_select(1, p.blocks).view(1, K, -1, Dk)[:, :, :S]
            v_1KSD = v_pool.index_select(1, p.blocks).view(1, K, -1, Dv)[:, :, :S]
            q_1HTD = q_1HND[:, :, p.start:p.start + p.num_new]
            out_HND[:, p.start:p.start + p.num_new] = attention(
                q_1HTD, k_1KSD, v_1KSD, causal=True, q_offset=p.q_offset, scale=scale)[0]
        for g in self.decode_groups:
            if self.deterministic:
                out_HbD = _decode_group_attention(q_1HND[0], k_pool, v_pool, g, scale)
            else:
                out_HbD = _decode_group(q_1HND[0], k_pool, v_pool, g, 1.0 / math.sqrt(Dk) if scale is None else scale)
            out_HND.index_copy_(1, g.rows, out_HbD)
        return out_HND[None]


def _gather(k_pool: torch.Tensor, v_pool: torch.Tensor, g: _DecodeGroup) -> tuple[torch.Tensor, torch.Tensor]:
    """The group's whole blocks: keys [K, b, nb * BS, Dk] and values [K, b, nb * BS, Dv] (positions from S on are
    not the sequence's)."""
    K, b = k_pool.shape[0], g.rows.numel()
    flat = g.blocks.view(-1)
    k_KbSD = k_pool.index_select(1, flat).view(K, b, -1, k_pool.shape[3])
    v_KbSD = v_pool.index_select(1, flat).view(K, b, -1, v_pool.shape[3])
    return k_KbSD, v_KbSD


def _decode_group_attention(q_HND: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, g: _DecodeGroup,
                            scale: float | None) -> torch.Tensor:
    """The group through kernels.attention over exactly S keys (the deterministic path); [H, b, Dv]."""
    k_KbSD, v_KbSD = _gather(k_pool, v_pool, g)
    k_bKSD, v_bKSD = (t[:, :, :g.context].transpose(0, 1) for t in (k_KbSD, v_KbSD))
    q_bH1D = q_HND.index_select(1, g.rows).transpose(0, 1)[:, :, None]
    out_bH1D = attention(q_bH1D, k_bKSD, v_bKSD, causal=True, q_offset=g.context - 1, scale=scale)
    return out_bH1D[:, :, 0].transpose(0, 1)


def _decode_group(q_HND: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, g: _DecodeGroup,
                  scale: float) -> torch.Tensor:
    """softmax(q K^T * scale) V for b one-token rows with the same context S; [H, b, Dv]. The matmuls run over
    whole blocks (contiguous rows, no copy) with the positions past S masked: their scores set to -inf and their
    values to 0 (they may hold another sequence's data, or uninitialised memory). Softmax in float32."""
    b, S = g.rows.numel(), g.context
    K, Dk = k_pool.shape[0], k_pool.shape[3]
    H, Dv = q_HND.shape[0], v_pool.shape[-1]
    q_KbGD = q_HND.index_select(1, g.rows).view(K, H // K, b, Dk).transpose(1, 2)
    k_KbSD, v_KbSD = _gather(k_pool, v_pool, g)
    v_KbSD[:, :, S:] = 0
    scores_KbGS = torch.matmul(q_KbGD, k_KbSD.transpose(-1, -2)) * scale
    scores_KbGS[..., S:] = float("-inf")
    probs_KbGS = scores_KbGS.softmax(dim=-1, dtype=torch.float32).to(v_KbSD.dtype)
    out_KbGD = torch.matmul(probs_KbGS, v_KbSD)
    return out_KbGD.transpose(1, 2).reshape(H, b, Dv)
