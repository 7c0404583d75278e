"""Causal grouped-query attention on top of torch SDPA.

Shapes: B batch, H query heads, K kv heads (H % K == 0), T new queries, S keys, D head_dim.

The T queries sit at absolute positions q_offset..q_offset+T-1 and the S keys at 0..S-1, so one function serves a
full forward (q_offset=0, T=S), a chunked prefill and a decode step against a KV cache. SDPA's own `is_causal` aligns
the mask to the top-left corner, which is only right when T == S and q_offset == 0; every other case gets an explicit
boolean mask (or none at all when every query already sees every key, e.g. one-token decode).
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class Packing:
    """Several documents packed back to back in one row (B = 1): attention never crosses a document boundary.

    cu_seqlens: int32 [N + 1] cumulative document lengths (0, len0, len0 + len1, ..., T), the layout flash-attn's
    varlen kernels take; max_seqlen: the longest document.
    """

    cu_seqlens: torch.Tensor
    max_seqlen: int

    @classmethod
    def from_lengths(cls, lengths: list[int], device: torch.device | str = "cpu") -> "Packing":
        if not lengths or min(lengths) < 1:
            raise ValueError(f"document lengths must be >= 1, got {lengths}")
        cu = torch.tensor([0, *lengths], dtype=torch.int64).cumsum(0).to(torch.int32)
        return cls(cu_seqlens=cu.to(device), max_seqlen=max(lengths))

    @property
    def total(self) -> int:
        return int(self.cu_seqlens[-1])

    def doc_ids(self) -> torch.Tensor:
        """[T] index of the document each position belongs to."""
        lengths = (self.cu_seqlens[1:] - self.cu_seqlens[:-1]).to(torch.int64)
        return torch.repeat_interleave(torch.arange(len(lengths), device=lengths.device), lengths)

    def positions(self) -> torch.Tensor:
        """[1, T] positions restarting at 0 in every document."""
        doc = self.doc_ids()
        return (torch.arange(doc.numel(), device=doc.device) - self.cu_seqlens[:-1].to(torch.int64)[doc])[None, :]


def attention(
    q_BHTD: torch.Tensor, k_BKSD: torch.Tensor, v_BKSD: torch.Tensor, *, causal: bool, q_offset: int,
    packing: Packing | None = None,
) -> torch.Tensor:
    """Returns [B, H, T, Dv]. Key j is visible to query i iff j <= q_offset + i (when causal) and, with packing,
    both lie in the same document."""
    num_q_heads, num_kv_heads = q_BHTD.shape[1], k_BKSD.shape[1]
    assert num_q_heads % num_kv_heads == 0, (num_q_heads, num_kv_heads)
    T, S = q_BHTD.shape[2], k_BKSD.shape[2]
    gqa = num_q_heads != num_kv_heads
    if packing is not None:
        assert q_offset == 0 and T == S == packing.total and q_BHTD.shape[0] == 1, "packing is for training rows"
        doc_T = packing.doc_ids()
        visible_TS = doc_T[:, None] == doc_T[None, :]
        if causal:
            visible_TS &= torch.ones(T, S, dtype=torch.bool, device=doc_T.device).tril()
        return F.scaled_dot_product_attention(q_BHTD, k_BKSD, v_BKSD, attn_mask=visible_TS, enable_gqa=gqa)
    if not causal or q_offset >= S - 1:
        return F.scaled_dot_product_attention(q_BHTD, k_BKSD, v_BKSD, enable_gqa=gqa)
    if q_offset == 0 and T == S:
        return F.scaled_dot_product_attention(q_BHTD, k_BKSD, v_BKSD, is_causal=True, enable_gqa=gqa)
    device = q_BHTD.device
    query_pos_T1 = torch.arange(q_offset, q_offset + T, device=device)[:, None]
    key_pos_1S = torch.arange(S, device=device)[None, :]
    visible_TS = key_pos_1S <= query_pos_T1
    return F.scaled_dot_product_attention(q_BHTD, k_BKSD, v_BKSD, attn_mask=visible_TS, enable_gqa=gqa)
