"""Causal attention for training on the CPU: query blocks over right-padded rows, probabilities recomputed in backward.

Shapes: n rows (documents), H query heads, K kv heads, G = H / K, L a row's (padded) length, D / Dv head dims, b queries
in a block, e = the keys a block sees (its last query's position + 1), T packed tokens.

The float32 CPU path of kernels.attention (SDPA's math kernel: docs/kernels.md on why not its fused one) keeps every
[L, L] probability matrix for backward and, for packed documents, spends half its work on masked-out pairs between
documents. This path computes the same formula per query row -- scores (q * scale) k^T, causal -inf, softmax, p @ v;
backward through torch's own softmax backward -- but:
- block by block of queries, each against only the keys it can see (causal: the first e of its row);
- saving only the scaled q, k and v: backward recomputes each block's probabilities with the same ops on the same
  shapes, so they are bitwise the forward's, and its peak holds one block's [b, e] scores instead of every layer's
  [L, L];
- packed documents (models' Packing) are gathered into rows of similar length, right-padded, one batched call per
  bucket: causal masking already hides a row's padding from its real queries (padding comes after them), so no
  document mask is built and no work is spent between documents.
GQA runs as grouped GEMMs: the G query heads of a kv head are one [G * b, D] operand, so k and v are never repeated.
"""
from __future__ import annotations

import functools
import math

import torch

# Queries per block: the [n, H, b, e] scores of one block are the only per-block temporaries.
BLOCK = 256
# A bucket of packed documents pads each to its longest; it takes the next (shorter) document while the padding stays
# within this share of its tokens and its block's scores within SCORE_ELEMENTS floats.
MAX_PADDING = 0.25
SCORE_ELEMENTS = 1 << 22


@functools.lru_cache(maxsize=16)
def _diagonal_mask(b: int, groups: int, device: torch.device) -> torch.Tensor:
    """[G * b, b] True where query i of a block (of each of the G heads) may not see the block's key j > i. Keys
    before the block are visible to all of its queries, so only the block's own b keys need a mask."""
    i = torch.arange(b, device=device)
    return (i[None, :] > i[:, None]).repeat(groups, 1)


def _block_probs(qs_nKGbD: torch.Tensor, k_nKeD: torch.Tensor, start: int) -> torch.Tensor:
    """Softmax of one block's scores (qs: queries already multiplied by the scale), causal keys masked."""
    n, K, G, b, D = qs_nKGbD.shape
    s_nKMe = torch.matmul(qs_nKGbD.reshape(n, K, G * b, D), k_nKeD.transpose(-1, -2))
    s_nKMe[..., start:].masked_fill_(_diagonal_mask(b, G, s_nKMe.device), -math.inf)
    return torch.softmax(s_nKMe, dim=-1)


class _BlockedCausal(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q_nHLD, k_nKLD, v_nKLD, scale: float, block: int):
        n, H, L, _ = q_nHLD.shape
        K, Dv = k_nKLD.shape[1], v_nKLD.shape[-1]
        # The scale goes on the queries ([L, D], not every [L, L] score), as SDPA's math kernel also scales them.
        qs_nKGLD = (q_nHLD * scale).view(n, K, H // K, L, -1)
        out_nKGLD = q_nHLD.new_empty(n, K, H // K, L, Dv)
        for start in range(0, L, block):
            stop = min(start + block, L)
            p_nKMe = _block_probs(qs_nKGLD[:, :, :, start:stop], k_nKLD[:, :, :stop], start)
            out_nKGLD[:, :, :, start:stop] = torch.matmul(p_nKMe, v_nKLD[:, :, :stop]).view(
                n, K, H // K, stop - start, Dv)
        ctx.save_for_backward(qs_nKGLD, k_nKLD, v_nKLD)
        ctx.scale, ctx.block = scale, block
        return out_nKGLD.view(n, H, L, Dv)

    @staticmethod
    def backward(ctx, dout_nHLD):
        qs_nKGLD, k_nKLD, v_nKLD = ctx.saved_tensors
        n, K, G, L, D = qs_nKGLD.shape
        H, Dv = K * G, v_nKLD.shape[-1]
        dout_nKGLD = dout_nHLD.contiguous().view(n, K, G, L, Dv)
        dq_nKGLD = torch.empty_like(qs_nKGLD)
        dk_nKLD, dv_nKLD = torch.zeros_like(k_nKLD), torch.zeros_like(v_nKLD)
        for start in range(0, L, ctx.block):
            stop = min(start + ctx.block, L)
            b = stop - start
            qs_nKMD = qs_nKGLD[:, :, :, start:stop].reshape(n, K, G * b, D)
            p_nKMe = _block_probs(qs_nKGLD[:, :, :, start:stop], k_nKLD[:, :, :stop], start)
            dout_nKMD = dout_nKGLD[:, :, :, start:stop].reshape(n, K, G * b, Dv)
            dv_nKLD[:, :, :stop] += torch.matmul(p_nKMe.transpose(-1, -2), dout_nKMD)
            dp_nKMe = torch.matmul(dout_nKMD, v_nKLD[:, :, :stop].transpose(-1, -2))
            ds_nKMe = torch._softmax_backward_data(dp_nKMe, p_nKMe, -1, p_nKMe.dtype)
            dq_nKGLD[:, :, :, start:stop] = torch.matmul(ds_nKMe, k_nKLD[:, :, :stop]).view(n, K, G, b, D)
            dk_nKLD[:, :, :stop] += torch.matmul(ds_nKMe.transpose(-1, -2), qs_nKMD)
        return (dq_nKGLD * ctx.scale).view(n, H, L, D), dk_nKLD, dv_nKLD, None, None


def blocked_causal_attention(q_nHLD: torch.Tensor, k_nKLD: torch.Tensor, v_nKLD: torch.Tensor, *, scale: float,
                             block: int = BLOCK) -> torch.Tensor:
    """Causal attention of n right-padded rows (query i sees keys 0..i of its row): [n, H, L, Dv]."""
    return _BlockedCausal.apply(q_nHLD.contiguous(), k_nKLD.contiguous(), v_nKLD.contiguous(), scale, block)


def length_buckets(lengths: tuple[int, ...], heads: int, block: int = BLOCK) -> list[list[int]]:
    """Documents (indices) grouped into buckets of similar length, longest first, for one padded call each: a
    bucket's padding stays within MAX_PADDING of its tokens and its largest block of scores ([rows, heads, block,
    longest]) within SCORE_ELEMENTS (a document alone may exceed it by its own block)."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    buckets: list[list[int]] = []
    real = 0
    for i in order:
        if buckets:
            bucket = buckets[-1]
            longest, count = lengths[bucket[0]], len(bucket) + 1
            scores = count * heads * min(longest, block) * longest
            if longest * count <= (real + lengths[i]) * (1 + MAX_PADDING) and scores <= SCORE_ELEMENTS:
                bucket.append(i)
                real += lengths[i]
                continue
        buckets.append([i])
        real = lengths[i]
    return buckets


def packed_causal_attention(q_1HTD: torch.Tensor, k_1KTD: torch.Tensor, v_1KTD: torch.Tensor, *,
                            lengths: tuple[int, ...], scale: float, block: int = BLOCK) -> torch.Tensor:
    """Causal attention within each of the packed documents of one row ([1, H, T, D], documents back to back with
    these lengths): [1, H, T, Dv]."""
    T, device = q_1HTD.shape[2], q_1HTD.device
    starts = [0]
    for n in lengths[:-1]:
        starts.append(starts[-1] + n)
    # Row T of the padded-out inputs is zeros: a bucket's padding reads it.
    q_HTD, k_KTD, v_KTD = (torch.cat([x[0], x.new_zeros(x.shape[1], 1, x.shape[3])], dim=1)
                           for x in (q_1HTD, k_1KTD, v_1KTD))
    pieces, where = [], []
    for bucket in length_buckets(lengths, q_1HTD.shape[1], block):
        L = lengths[bucket[0]]
        idx_nL = torch.full((len(bucket), L), T, dtype=torch.int64)
        for r, d in enumerate(bucket):
            idx_nL[r, :lengths[d]] = torch.arange(starts[d], starts[d] + lengths[d])
        idx = idx_nL.flatten().to(device)
        q, k, v = (x.index_select(1, idx).unflatten(1, (len(bucket), L)).transpose(0, 1)
                   for x in (q_HTD, k_KTD, v_KTD))
        out_nHLD = blocked_causal_attention(q, k, v, scale=scale, block=block)
        pieces.append(out_nHLD.transpose(0, 1).flatten(1, 2))  # [H, n * L]
        where.append(idx_nL.flatten())
    # Each real token's output sits at one place of the padded outputs: gather them back in token order.
    flat_pos = torch.cat(where)
    source = torch.empty(T, dtype=torch.int64)
    real = flat_pos < T
    source[flat_pos[real]] = torch.arange(flat_pos.numel())[real]
    out_HTD = torch.cat(pieces, dim=1).index_select(1, source.to(device))
    return out_HTD[None]
