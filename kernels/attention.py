"""Causal grouped-query attention on top of torch SDPA.

Shapes: B batch, H query heads, K kv heads (H % K == 0), T new queries, S keys, D head_dim.

The T queries sit at absolute positions q_offset..q_offset+T-1 and the S keys at 0..S-1, so one function serves a
full forward (q_offset=0, T=S), a chunked prefill and a decode step against a KV cache. SDPA's own `is_causal` aligns
the mask to the top-left corner, which is only right when T == S and q_offset == 0; every other case gets an explicit
boolean mask (or none at all when every query already sees every key, e.g. one-token decode).
"""

import torch
import torch.nn.functional as F


def attention(
    q_BHTD: torch.Tensor, k_BKSD: torch.Tensor, v_BKSD: torch.Tensor, *, causal: bool, q_offset: int
) -> torch.Tensor:
    """Returns [B, H, T, D]. Key j is visible to query i iff j <= q_offset + i (when causal)."""
    num_q_heads, num_kv_heads = q_BHTD.shape[1], k_BKSD.shape[1]
    assert num_q_heads % num_kv_heads == 0, (num_q_heads, num_kv_heads)
    T, S = q_BHTD.shape[2], k_BKSD.shape[2]
    gqa = num_q_heads != num_kv_heads
    if not causal or q_offset >= S - 1:
        return F.scaled_dot_product_attention(q_BHTD, k_BKSD, v_BKSD, enable_gqa=gqa)
    if q_offset == 0 and T == S:
        return F.scaled_dot_product_attention(q_BHTD, k_BKSD, v_BKSD, is_causal=True, enable_gqa=gqa)
    device = q_BHTD.device
    query_pos_T1 = torch.arange(q_offset, q_offset + T, device=device)[:, None]
    key_pos_1S = torch.arange(S, device=device)[None, :]
    visible_TS = key_pos_1S <= query_pos_T1
    return F.scaled_dot_product_attention(q_BHTD, k_BKSD, v_BKSD, attn_mask=visible_TS, enable_gqa=gqa)
