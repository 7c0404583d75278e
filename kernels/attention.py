"""Causal grouped-query attention behind one dispatcher: reference (fp32 math), sdpa (PyTorch) and flash (flash-attn).

Shapes: B batch, H query heads, K kv heads (H % K == 0), T new queries, S keys, D query/key head dim, Dv value head
dim (MLA uses D = 192, Dv = 128; every other family D = Dv).

The T queries sit at absolute positions q_offset..q_offset+T-1 and the S keys at 0..S-1: key j is visible to query i
iff j <= q_offset + i (when causal) and, with packing, both lie in the same document. So one function serves a full
forward (q_offset=0, T=S), a chunked prefill and a decode step against a KV cache. The scale is 1/sqrt(D) unless
given.

Backends (kernels/backends.py picks one: the `backend=` argument, else TRAINYARD_ATTENTION_BACKEND, else "auto"):
- "reference": softmax(Q K^T * scale + mask) V written out in float32 (or `compute_dtype`) with a dense [T, S] mask;
  the ground truth the others are tested against, too slow and memory-hungry for training.
- "sdpa": torch.nn.functional.scaled_dot_product_attention (its math kernel for float32 on CPU, see
  _sdpa_kernel; V zero-padded to D when Dv < D, so the fused kernels apply). Packed rows run per group of
  whole documents (at most SDPA_PACKED_CHUNK_TOKENS tokens, or one longer document alone with is_causal), so no
  [T, T] mask is ever built. float32 on CPU, causal over whole rows or packed documents (what training runs), takes
  the math kernel's formula in query blocks instead (kernels/blocked_attention.py: no work between documents, no
  [L, L] probabilities kept for backward).
- "flash": flash_attn_func / flash_attn_varlen_func, only for CUDA float16/bfloat16 tensors when flash_attn imports.
  flash-attn needs Dv == D, so V is zero-padded to D and the output sliced back to Dv (padding columns of V only
  add zero columns to the output). Its causal mask is aligned to the bottom-right corner, which is ours exactly when
  q_offset == S - T (what a KV cache gives).
"auto" is flash when it can run the inputs, else sdpa.
"""

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels import batch_invariant
from kernels.backends import AUTO, env_var, optional_module, requested_backend
from kernels.blocked_attention import blocked_causal_attention, packed_causal_attention

ATTENTION_BACKENDS = ("reference", "sdpa", "flash")
# A group of short packed documents is one SDPA call with a [n, n] boolean mask, n <= this; a longer document runs
# alone with is_causal and no mask. Bigger groups mean fewer calls but more masked-out work within each group.
SDPA_PACKED_CHUNK_TOKENS = 512
FLASH_MAX_HEAD_DIM = 256


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
        packing = cls(cu_seqlens=cu.to(device), max_seqlen=max(lengths))
        packing.__dict__["lengths"] = tuple(int(n) for n in lengths)  # known already: spare the device sync
        return packing

    @functools.cached_property
    def lengths(self) -> tuple[int, ...]:
        """Document lengths on the host (read once per Packing)."""
        return tuple((self.cu_seqlens[1:] - self.cu_seqlens[:-1]).tolist())  # .tolist() syncs, once per Packing

    @property
    def total(self) -> int:
        return sum(self.lengths)

    def doc_ids(self) -> torch.Tensor:
        """[T] index of the document each position belongs to."""
        lengths = (self.cu_seqlens[1:] - self.cu_seqlens[:-1]).to(torch.int64)
        docs = torch.arange(len(lengths), device=lengths.device)
        return torch.repeat_interleave(docs, lengths, output_size=self.total)

    def positions(self) -> torch.Tensor:
        """[1, T] positions restarting at 0 in every document."""
        doc = self.doc_ids()
        return (torch.arange(doc.numel(), device=doc.device) - self.cu_seqlens[:-1].to(torch.int64)[doc])[None, :]


def attention(
    q_BHTD: torch.Tensor, k_BKSD: torch.Tensor, v_BKSD: torch.Tensor, *, causal: bool, q_offset: int,
    packing: Packing | None = None, scale: float | None = None, backend: str = AUTO,
) -> torch.Tensor:
    """Returns [B, H, T, Dv] in q's dtype; see the module docstring for the visibility rule and the backends.
    scale multiplies Q K^T (default 1/sqrt(D); MLA with YaRN passes its mscale-adjusted one)."""
    B, H, T, D = q_BHTD.shape
    K, S = k_BKSD.shape[1], k_BKSD.shape[2]
    assert H % K == 0 and k_BKSD.shape == (B, K, S, D) and v_BKSD.shape[:3] == (B, K, S), (
        q_BHTD.shape, k_BKSD.shape, v_BKSD.shape,
    )
    if packing is not None:
        assert q_offset == 0 and T == S == packing.total and B == 1, "packing is for training rows"
    if batch_invariant.is_active():  # deterministic mode: the batch-invariant kernel, whatever the backend
        return batch_invariant.invariant_attention_positions(
            q_BHTD, k_BKSD, v_BKSD, causal=causal, q_offset=q_offset, packing=packing, scale=scale)
    name = requested_backend("attention", backend, ATTENTION_BACKENDS)
    if name == AUTO:
        name = "flash" if _flash_unsupported(q_BHTD, k_BKSD, v_BKSD, causal, q_offset, packing) is None else "sdpa"
    elif name == "flash":
        reason = _flash_unsupported(q_BHTD, k_BKSD, v_BKSD, causal, q_offset, packing)
        if reason is not None:
            raise ValueError(
                f"attention backend 'flash' cannot run these inputs: {reason}; pass backend='sdpa' or 'auto' "
                f"(or unset {env_var('attention')})"
            )
    return _BACKENDS[name](q_BHTD, k_BKSD, v_BKSD, causal=causal, q_offset=q_offset, packing=packing, scale=scale)


# ---------------------------------------------------------------------------------------------------------- reference


def visible_mask(
    T: int, S: int, *, causal: bool, q_offset: int, packing: Packing | None, device: torch.device
) -> torch.Tensor | None:
    """[T, S] bool, True where query i may attend to key j; None when every query sees every key."""
    visible_TS = None
    if causal:
        query_pos_T1 = torch.arange(q_offset, q_offset + T, device=device)[:, None]
        visible_TS = torch.arange(S, device=device)[None, :] <= query_pos_T1
    if packing is not None:
        doc_T = packing.doc_ids().to(device)
        same_doc_TS = doc_T[:, None] == doc_T[None, :]
        visible_TS = same_doc_TS if visible_TS is None else visible_TS & same_doc_TS
    return visible_TS


def reference_attention(
    q_BHTD: torch.Tensor, k_BKSD: torch.Tensor, v_BKSD: torch.Tensor, *, causal: bool, q_offset: int,
    packing: Packing | None = None, scale: float | None = None, compute_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """softmax(Q K^T * scale + mask) V (scale defaults to 1/sqrt(D), masked scores are -inf) computed in
    compute_dtype and returned in q's dtype.

    compute_dtype=float32 is the ground truth; compute_dtype=q.dtype is what plain torch math gives in that dtype,
    the yardstick for how far a fast kernel may be from the truth."""
    groups = q_BHTD.shape[1] // k_BKSD.shape[1]
    q = q_BHTD.to(compute_dtype)
    k_BHSD = k_BKSD.to(compute_dtype).repeat_interleave(groups, dim=1)
    v_BHSD = v_BKSD.to(compute_dtype).repeat_interleave(groups, dim=1)
    scale = 1.0 / math.sqrt(q_BHTD.shape[-1]) if scale is None else scale
    scores_BHTS = (q @ k_BHSD.transpose(-1, -2)) * scale
    visible_TS = visible_mask(
        q.shape[2], k_BKSD.shape[2], causal=causal, q_offset=q_offset, packing=packing, device=q.device
    )
    if visible_TS is not None:
        scores_BHTS = scores_BHTS.masked_fill(~visible_TS, float("-inf"))
    return (scores_BHTS.softmax(-1) @ v_BHSD).to(q_BHTD.dtype)


# --------------------------------------------------------------------------------------------------------------- sdpa


def sdpa_attention(
    q_BHTD: torch.Tensor, k_BKSD: torch.Tensor, v_BKSD: torch.Tensor, *, causal: bool, q_offset: int,
    packing: Packing | None = None, scale: float | None = None,
) -> torch.Tensor:
    """SDPA with the mask rules of _sdpa; float32 on CPU runs SDPA's math kernel (see _sdpa_kernel)."""
    D, Dv = q_BHTD.shape[-1], v_BKSD.shape[-1]
    sdpa = _sdpa_kernel(q_BHTD)
    if sdpa is _sdpa_math and causal and (packing is not None or (q_offset == 0 and q_BHTD.shape[2] == k_BKSD.shape[2])):
        # Training-shaped calls: the math kernel's formula in query blocks (kernels/blocked_attention.py).
        scale = 1.0 / math.sqrt(D) if scale is None else scale
        if packing is not None:
            return packed_causal_attention(q_BHTD, k_BKSD, v_BKSD, lengths=packing.lengths, scale=scale)
        return blocked_causal_attention(q_BHTD, k_BKSD, v_BKSD, scale=scale)
    if Dv < D and sdpa is F.scaled_dot_product_attention:
        # The fused kernels need Dv == D; zero columns of V give zero columns of the output.
        v_BKSD = F.pad(v_BKSD, (0, D - Dv))
    if packing is not None:
        return _sdpa_packed(sdpa, q_BHTD, k_BKSD, v_BKSD, causal, packing, scale)[..., :Dv]
    return _sdpa(sdpa, q_BHTD, k_BKSD, v_BKSD, causal=causal, q_offset=q_offset, scale=scale)[..., :Dv]


def _sdpa_kernel(q_BHTD: torch.Tensor) -> Callable[..., torch.Tensor]:
    """SDPA's fused CPU kernel (FlashAttention-style: its backward rebuilds P from the saved log-sum-exp and uses
    rowsum(dO * O)) gives float32 dq/dk/dv with up to ~3x the error of plain float32 math, over the accuracy
    bound the tests hold every backend to (docs/kernels.md). float32 on CPU is this project's numerics configuration
    (parity tests, the CPU demo), so it gets the math kernel, called directly: the sdpa_kernel() context manager
    flips process-wide flags, which concurrent threads (gRPC servers) would race on. Everything else gets what SDPA
    picks."""
    if q_BHTD.device.type == "cpu" and q_BHTD.dtype == torch.float32:
        return _sdpa_math
    return F.scaled_dot_product_attention


def _sdpa_math(q, k, v, attn_mask=None, is_causal=False, scale=None, enable_gqa=False) -> torch.Tensor:
    if attn_mask is not None:  # the kernel adds its mask; SDPA's front end turns a boolean one into 0 / -inf first
        attn_mask = torch.zeros(attn_mask.shape, dtype=q.dtype, device=q.device).masked_fill_(~attn_mask, -math.inf)
    return torch.ops.aten._scaled_dot_product_attention_math(
        q, k, v, attn_mask, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa
    )[0]


def _sdpa(
    sdpa: Callable[..., torch.Tensor], q_BHTD: torch.Tensor, k_BKSD: torch.Tensor, v_BKSD: torch.Tensor, *,
    causal: bool, q_offset: int, scale: float | None,
) -> torch.Tensor:
    """SDPA's own `is_causal` aligns the mask to the top-left corner, which is only right when T == S and
    q_offset == 0; other causal cases get an explicit boolean mask, or none when every query already sees every key
    (e.g. one-token decode)."""
    gqa = q_BHTD.shape[1] != k_BKSD.shape[1]
    T, S = q_BHTD.shape[2], k_BKSD.shape[2]
    if not causal or q_offset >= S - 1:
        return sdpa(q_BHTD, k_BKSD, v_BKSD, scale=scale, enable_gqa=gqa)
    if q_offset == 0 and T == S:
        return sdpa(q_BHTD, k_BKSD, v_BKSD, is_causal=True, scale=scale, enable_gqa=gqa)
    visible_TS = visible_mask(T, S, causal=True, q_offset=q_offset, packing=None, device=q_BHTD.device)
    return sdpa(q_BHTD, k_BKSD, v_BKSD, attn_mask=visible_TS, scale=scale, enable_gqa=gqa)


def document_groups(lengths: tuple[int, ...], max_tokens: int) -> list[tuple[int, int, int]]:
    """(start, end, number of documents) of consecutive whole documents, greedily filled up to max_tokens tokens; a
    document longer than max_tokens forms a group of its own."""
    groups, start, end, count = [], 0, 0, 0
    for length in lengths:
        if count and end + length - start > max_tokens:
            groups.append((start, end, count))
            start, count = end, 0
        end, count = end + length, count + 1
    groups.append((start, end, count))
    return groups


def _sdpa_packed(
    sdpa: Callable[..., torch.Tensor], q_1HTD: torch.Tensor, k_1KTD: torch.Tensor, v_1KTD: torch.Tensor,
    causal: bool, packing: Packing, scale: float | None,
) -> torch.Tensor:
    gqa = q_1HTD.shape[1] != k_1KTD.shape[1]
    if len(packing.lengths) == 1:
        return sdpa(q_1HTD, k_1KTD, v_1KTD, is_causal=causal, scale=scale, enable_gqa=gqa)
    doc_T = packing.doc_ids().to(q_1HTD.device)
    outs = []
    for start, end, count in document_groups(packing.lengths, SDPA_PACKED_CHUNK_TOKENS):
        q, k, v = q_1HTD[:, :, start:end], k_1KTD[:, :, start:end], v_1KTD[:, :, start:end]
        if count == 1:
            outs.append(sdpa(q, k, v, is_causal=causal, scale=scale, enable_gqa=gqa))
            continue
        doc_n = doc_T[start:end]
        visible_nn = doc_n[:, None] == doc_n[None, :]
        if causal:
            visible_nn &= torch.ones_like(visible_nn).tril()
        outs.append(sdpa(q, k, v, attn_mask=visible_nn, scale=scale, enable_gqa=gqa))
    return torch.cat(outs, dim=2)


# -------------------------------------------------------------------------------------------------------------- flash


def _flash_unsupported(
    q_BHTD: torch.Tensor, k_BKSD: torch.Tensor, v_BKSD: torch.Tensor, causal: bool, q_offset: int,
    packing: Packing | None,
) -> str | None:
    """Why flash-attn cannot run these inputs, or None when it can."""
    D, Dv = q_BHTD.shape[-1], v_BKSD.shape[-1]
    T, S = q_BHTD.shape[2], k_BKSD.shape[2]
    if not q_BHTD.is_cuda:
        return f"the tensors are on {q_BHTD.device.type}, flash-attn needs CUDA"
    if q_BHTD.dtype not in (torch.float16, torch.bfloat16) or not q_BHTD.dtype == k_BKSD.dtype == v_BKSD.dtype:
        return f"dtypes {q_BHTD.dtype}/{k_BKSD.dtype}/{v_BKSD.dtype}, flash-attn needs one of float16 or bfloat16"
    if D > FLASH_MAX_HEAD_DIM or Dv > D:
        return f"head dims D={D}, Dv={Dv}; flash-attn needs Dv <= D <= {FLASH_MAX_HEAD_DIM}"
    if packing is None and causal and q_offset < S - 1 and q_offset != S - T:
        return f"causal queries at q_offset={q_offset} do not end at the last of S={S} keys"
    if optional_module("flash_attn") is None:
        return "the flash_attn package is not installed"
    return None


def flash_attention(
    q_BHTD: torch.Tensor, k_BKSD: torch.Tensor, v_BKSD: torch.Tensor, *, causal: bool, q_offset: int,
    packing: Packing | None = None, scale: float | None = None,
) -> torch.Tensor:
    flash_attn = optional_module("flash_attn")
    D, Dv = q_BHTD.shape[-1], v_BKSD.shape[-1]
    if Dv < D:
        v_BKSD = F.pad(v_BKSD, (0, D - Dv))
    if packing is not None:
        cu_seqlens = packing.cu_seqlens.to(device=q_BHTD.device, dtype=torch.int32)
        out_THD = flash_attn.flash_attn_varlen_func(
            q_BHTD[0].transpose(0, 1), k_BKSD[0].transpose(0, 1), v_BKSD[0].transpose(0, 1),
            cu_seqlens, cu_seqlens, packing.max_seqlen, packing.max_seqlen, softmax_scale=scale, causal=causal,
        )
        out_BHTD = out_THD.transpose(0, 1)[None]
    else:
        # Every key is visible to every query once q_offset >= S - 1; otherwise flash's bottom-right causal mask
        # is ours because q_offset == S - T (checked by _flash_unsupported).
        causal = causal and q_offset < k_BKSD.shape[2] - 1
        out_BTHD = flash_attn.flash_attn_func(
            q_BHTD.transpose(1, 2), k_BKSD.transpose(1, 2), v_BKSD.transpose(1, 2), softmax_scale=scale, causal=causal
        )
        out_BHTD = out_BTHD.transpose(1, 2)
    return out_BHTD[..., :Dv]


_BACKENDS = {"reference": reference_attention, "sdpa": sdpa_attention, "flash": flash_attention}
