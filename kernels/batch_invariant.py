"""Batch-invariant ("deterministic") mode: a sequence's logits do not depend on what else is in the batch.

Shapes: M rows (tokens) of a GEMM, N its output columns, K its contraction, I attention items (batch x kv heads),
G query heads per kv head, T queries, S keys, R = T * G query rows of one item, D / Dv head dims.

Under `batch_invariant_mode()` the ops whose per-row result changes with the batch on CPU (measured in
tests/unit/models/test_models_batch_invariant.py, written down in docs/deterministic.md) are rerouted to versions whose
arithmetic for a row depends only on that row:

- GEMMs (F.linear, matmul / @, mm, bmm, addmm, einsum, torch._grouped_mm). MKL picks its sgemm kernel by the
  operand shapes, so a row computed alone (M = 1), in a 2-3 row block, or in a thread's small share of a batch gets
  different rounding. Here every GEMM is issued as `out^T = w^T x^T` (the rows on the side MKL does not split across
  threads) with both free dimensions zero-padded to at least MIN_ROWS; from 12 rows up that kernel's rows agree
  bitwise at any M, offset and thread count (1 and 2 tested). A linear layer's GEMM is issued directly as x w^T
  with x's rows padded the same way: measured bitwise the transposed product's result (float32 and bfloat16), without
  its transposed copy of the output.
- Attention (F.scaled_dot_product_attention and the aten math kernel kernels/attention.py calls): one algorithm for
  full prefill, chunked prefill and decode. Scores are one GEMM per (batch row, kv head), queries on its row side
  (padded to query_rows(R): 4, 8 or at least 12 rows, the counts in which MKL rounds a row alike) and keys on its
  column side (padded to MIN_ROWS), then the row max (exact in any order) and exp; P V (one GEMM per key block,
  queries on the row side) and the softmax denominator (a contiguous row sum per key block) are accumulated over key
  blocks of KEY_BLOCK keys in increasing order. The last block is zero-padded to KEY_BLOCK keys, and a block past a
  row's last visible key adds exact zeros, so a row decoded against a cache and the same row in a (chunked) prefill
  give the same bits. The rollout's paged cache lays out the same arithmetic for all decode rows of a step at once
  (services/rollout/paged_cache.py, under suspend_mode()).
- F.silu and sigmoid: torch's vectorized and scalar (tail) loops differ in the last bit, and which elements land in
  the tail depends on the tensor size and the thread split. silu runs torch's own kernel on pieces that keep every
  element in the vectorized loop (a whole number of SILU_ALIGN elements, fewer than torch's parallel grain); sigmoid
  becomes 1 / (1 + exp(-x)) from exp, add and divide, whose vector and scalar paths agree.
- sum / mean over a last dimension longer than SUM_CHUNK: a single output row that long is split across threads;
  here it is summed in chunks of SUM_CHUNK, then over the chunks.

Everything else (softmax, log_softmax, logsumexp, shorter reductions, elementwise ops, the MoE unpermute sum) was
measured batch-invariant as torch runs it and passes through. The mode is a TorchFunctionMode, whose stack is
thread-local: entering it on the rollout's engine thread changes nothing for other threads.
"""

import contextlib
import functools
import math
import string
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

MIN_ROWS = 16  # every GEMM issued here has both free dims >= this (zero rows pad smaller ones)
GEMM_ROW_CHUNK = 256  # long GEMMs run this many rows at a time (any chunk size >= MIN_ROWS gives the same bits)
KEY_BLOCK = 64  # attention sums P V over key blocks of this many keys, in increasing order
QUERY_TILE_ROWS = 256  # attention query rows per tile; causal tiles skip key blocks no row of theirs can see
SUM_CHUNK = 8192  # last-dim sums / means longer than this run in chunks of this size
SILU_ALIGN = 256  # silu runs on pieces whose length is a multiple of this (of any vector loop's step)...
SILU_CHUNK = 127 * SILU_ALIGN  # ...and at most this long: under torch's parallel grain (32768), one thread each


@contextlib.contextmanager
def batch_invariant_mode(enabled: bool = True) -> Iterator[None]:
    """Within the block (on this thread), logits and logprobs of a row are bitwise independent of the batch: its
    size, its other rows, and whether a position is computed in a full prefill, a chunked prefill or a decode step.
    `enabled=False` is a no-op, so a caller can write `with batch_invariant_mode(cfg.deterministic):`."""
    if not enabled:
        yield
        return
    with _BatchInvariantMode():
        yield


@contextlib.contextmanager
def suspend_mode() -> Iterator[None]:
    """Within the block, torch calls on this thread run as plain torch even under batch_invariant_mode(): for code
    that issues the mode's arithmetic itself (services/rollout/paged_cache.py's deterministic decode attention)
    and must not have its GEMMs rerouted a second time. Also skips the mode's per-call interception."""
    with torch._C.DisableTorchFunction():
        yield


# ------------------------------------------------------------------------------------------------------------- GEMMs


def _pad_dim(t: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    """t zero-padded at the end of dim (0, 1 or 2) to at least `size` entries."""
    missing = size - t.shape[dim]
    if missing <= 0:
        return t
    return F.pad(t, (0, 0) * (t.dim() - 1 - dim) + (0, missing))


def invariant_mm(x_MK: torch.Tensor, w_KN: torch.Tensor) -> torch.Tensor:
    """x @ w as the transposed product (w^T x^T)^T with both free dims padded to MIN_ROWS; [M, N], contiguous.

    More than 2 * GEMM_ROW_CHUNK rows go GEMM_ROW_CHUNK at a time (a short last chunk joins the one before), so
    each chunk's transposed result is copied back while it is still in cache; any chunk of >= 12 rows gives a row
    the same bits (see the module docstring).

    A linear layer's operands (x with contiguous rows, w the transposed view of a row-major [N, K] weight, N >=
    MIN_ROWS) take the direct product x w instead, rows padded to MIN_ROWS: measured bitwise the transposed
    product's result at every M from 12 up (float32 and bfloat16, 1 and 2 threads, K up to 4096), without its
    transposed copy of the output."""
    M, N = x_MK.shape[0], w_KN.shape[1]
    if w_KN.stride(0) == 1 and x_MK.stride(-1) == 1 and N >= MIN_ROWS:
        out_MN = torch.mm(_pad_dim(x_MK, 0, MIN_ROWS), w_KN)
        return out_MN if out_MN.shape[0] == M else out_MN[:M]
    w_NK = _pad_dim(w_KN.t(), 0, MIN_ROWS)
    if M <= 2 * GEMM_ROW_CHUNK:
        return torch.mm(w_NK, _pad_dim(x_MK, 0, MIN_ROWS).t()).t()[:M, :N].contiguous()
    starts = list(range(0, M, GEMM_ROW_CHUNK))
    if M - starts[-1] < MIN_ROWS:
        starts.pop()
    out_MN = x_MK.new_empty(M, N)
    for start, end in zip(starts, [*starts[1:], M]):
        out_MN[start:end] = torch.mm(w_NK, x_MK[start:end].t()).t()[:, :N]
    return out_MN


def invariant_bmm(a_BMK: torch.Tensor, b_BKN: torch.Tensor) -> torch.Tensor:
    """Batched invariant_mm; per item the same bits as invariant_mm (measured for 1 to 300 items)."""
    M, N = a_BMK.shape[1], b_BKN.shape[2]
    out_BNM = torch.bmm(_pad_dim(b_BKN.transpose(1, 2), 1, MIN_ROWS), _pad_dim(a_BMK, 1, MIN_ROWS).transpose(1, 2))
    return out_BNM.transpose(1, 2)[:, :M, :N].contiguous()


def invariant_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """torch.matmul's semantics (1-D operands, broadcast batch dims) on invariant_mm / invariant_bmm."""
    if a.dim() == 0 or b.dim() == 0:
        raise ValueError(f"matmul needs operands of at least 1 dimension, got {a.dim()}-D and {b.dim()}-D")
    if b.dim() == 1:
        return invariant_matmul(a, b[:, None])[..., 0]
    if a.dim() == 1:
        return invariant_matmul(a[None], b)[..., 0, :]
    if b.dim() == 2:
        return invariant_mm(a.reshape(-1, a.shape[-1]), b).view(*a.shape[:-1], b.shape[-1])
    batch = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    a3 = a.expand(*batch, *a.shape[-2:]).reshape(-1, *a.shape[-2:])
    b3 = b.expand(*batch, *b.shape[-2:]).reshape(-1, *b.shape[-2:])
    return invariant_bmm(a3, b3).view(*batch, a.shape[-2], b.shape[-1])


def invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    out = invariant_mm(x.reshape(-1, x.shape[-1]), weight.t()).view(*x.shape[:-1], weight.shape[0])
    return out if bias is None else out + bias


def invariant_grouped_mm(
    a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor | None = None, bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """torch._grouped_mm for a [M, K] x [E, K, N] with offs (group e is rows offs[e-1]..offs[e]) or [E, M, K] x
    [E, K, N]: one invariant GEMM per group. Reads offs on the host (one sync per call)."""
    if bias is not None:
        raise ValueError("torch._grouped_mm with bias is not supported under batch_invariant_mode")
    if a.dim() == 3 and b.dim() == 3 and offs is None:
        out = invariant_bmm(a, b)
    elif a.dim() == 2 and b.dim() == 3 and offs is not None:
        outs, start = [], 0
        for e, end in enumerate(offs.tolist()):  # .tolist() syncs
            if end > start:
                outs.append(invariant_mm(a[start:end], b[e]))
            start = end
        if start < a.shape[0]:  # rows past the last offset belong to no group
            outs.append(a.new_zeros(a.shape[0] - start, b.shape[2]))
        out = torch.cat(outs) if outs else a.new_zeros(0, b.shape[2])
    else:
        raise ValueError(
            f"torch._grouped_mm of {a.dim()}-D x {b.dim()}-D operands (offs={'set' if offs is not None else None}) "
            "is not supported under batch_invariant_mode; it reroutes 2-D x 3-D with offs and 3-D x 3-D without"
        )
    return out if out_dtype is None else out.to(out_dtype)


def invariant_einsum(equation: str, *operands) -> torch.Tensor:
    """torch.einsum with every pairwise contraction (left to right) done as one invariant_bmm."""
    if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
        operands = tuple(operands[0])
    inputs, output = _parse_einsum(equation.replace(" ", ""), [op.dim() for op in operands])
    if len(operands) == 1:
        return torch.einsum(f"{inputs[0]}->{output}", operands[0])
    acc, acc_subs = operands[0], inputs[0]
    for i in range(1, len(operands)):
        later = set(output).union(*inputs[i + 1 :])
        acc, acc_subs = _contract(acc, acc_subs, operands[i], inputs[i], later)
    return torch.einsum(f"{acc_subs}->{output}", acc)  # a permutation (and sums of dims only it holds)


def _parse_einsum(equation: str, ndims: list[int]) -> tuple[list[str], str]:
    """Input subscripts with '...' spelled out as capital letters, and the output subscripts."""
    lhs, arrow, rhs = equation.partition("->")
    inputs = lhs.split(",")
    if len(inputs) != len(ndims):
        raise ValueError(f"einsum equation {equation!r} names {len(inputs)} operands, got {len(ndims)}")
    ellipsis_dims = max((n - len(s.replace("...", "")) for s, n in zip(inputs, ndims) if "..." in s), default=0)
    spare = "".join(c for c in string.ascii_uppercase if c not in equation)[:ellipsis_dims]
    spelled = [s.replace("...", spare[ellipsis_dims - (n - len(s.replace("...", ""))) :]) for s, n in zip(inputs, ndims)]
    if arrow:
        out = rhs.replace("...", spare)
    else:
        counts = {c: "".join(spelled).count(c) for c in "".join(spelled)}
        out = spare + "".join(sorted(c for c, n in counts.items() if n == 1 and c not in spare))
    return spelled, out


def _contract(a: torch.Tensor, sa: str, b: torch.Tensor, sb: str, keep: set[str]) -> tuple[torch.Tensor, str]:
    """a (subscripts sa) times b (sb), summing the shared letters not in keep: [batch, left, right] result."""
    a = torch.einsum(f"{sa}->{''.join(c for c in sa if c in sb or c in keep)}", a)  # sum dims only a holds
    sa = "".join(c for c in sa if c in sb or c in keep)
    b = torch.einsum(f"{sb}->{''.join(c for c in sb if c in sa or c in keep)}", b)
    sb = "".join(c for c in sb if c in sa or c in keep)
    batch = [c for c in sa if c in sb and c in keep]
    summed = [c for c in sa if c in sb and c not in keep]
    left, right = [c for c in sa if c not in sb], [c for c in sb if c not in sa]
    sizes = {c: n for s, t in ((sa, a), (sb, b)) for c, n in zip(s, t.shape) if n != 1}
    dims = lambda letters: [sizes.get(c, 1) for c in letters]
    a3 = torch.einsum(f"{sa}->{''.join(batch + left + summed)}", a).expand(*dims(batch + left + summed))
    b3 = torch.einsum(f"{sb}->{''.join(batch + summed + right)}", b).expand(*dims(batch + summed + right))
    nb, nl, ns, nr = (math.prod(dims(g)) for g in (batch, left, summed, right))
    out = invariant_bmm(a3.reshape(nb, nl, ns), b3.reshape(nb, ns, nr))
    return out.view(*dims(batch + left + right)), "".join(batch + left + right)


# --------------------------------------------------------------------------------------------------------- attention


def invariant_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None = None,
    is_causal: bool = False, scale: float | None = None, enable_gqa: bool = False,
) -> torch.Tensor:
    """F.scaled_dot_product_attention's semantics (is_causal aligned top-left; attn_mask boolean, True = attend, or
    additive), computed in float32 (fp16/bf16 inputs are upcast) so that a query row's output depends only on that
    row, its visible keys and their values: see the module docstring. q [..., H, T, D], k [..., K, S, D],
    v [..., K, S, Dv] with equal leading dims; returns [..., H, T, Dv] in q's dtype."""
    *lead, H, T, D = q.shape
    Kh, S, Dv = k.shape[-3], k.shape[-2], v.shape[-1]
    if list(k.shape[:-3]) != lead or list(v.shape[:-3]) != lead:
        raise ValueError(f"attention batch dims must match: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if H != Kh and not (enable_gqa and H % Kh == 0):
        raise ValueError(f"{H} query heads and {Kh} kv heads need enable_gqa=True and H % K == 0")
    B, G = math.prod(lead), H // Kh
    I, cdtype = B * Kh, torch.promote_types(q.dtype, torch.float32)
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    mask_bhTS = _additive_mask(attn_mask, is_causal, T, S, cdtype, q.device)
    key_count_T = [S] * T if mask_bhTS is None else _visible_key_count(mask_bhTS)
    k_ISD, v_ISV = k.reshape(I, S, D), v.reshape(I, S, Dv)
    q_IRD = q.reshape(B, Kh, G, T, D).transpose(2, 3).reshape(I, T * G, D)  # rows (t, g)
    if q.dtype != cdtype:
        q_IRD, k_ISD, v_ISV = q_IRD.to(cdtype), k_ISD.to(cdtype), v_ISV.to(cdtype)
    tile = max(1, QUERY_TILE_ROWS // G)
    outs = []
    for t0 in range(0, T, tile):
        t1 = min(T, t0 + tile)
        mask = None if mask_bhTS is None else _tile_mask(mask_bhTS, t0, t1, Kh, G)
        n_keys = max(key_count_T[t0:t1])
        outs.append(_attention_tile(q_IRD[:, t0 * G : t1 * G], k_ISD, v_ISV, mask, n_keys, scale, B, Kh))
    out_IRV = torch.cat(outs, dim=1) if len(outs) > 1 else outs[0]
    out = out_IRV.reshape(B, Kh, T, G, Dv).transpose(2, 3).reshape(*lead, H, T, Dv)
    return out if out.dtype == q.dtype else out.to(q.dtype)


def query_rows(n: int) -> int:
    """The row count a GEMM with n query rows on its row side is padded to: 4, 8, or n from 12 up. On this side
    MKL's sgemm rounds a row the same in every count of one class (measured at 1 and 2 threads: 4, 8 and every
    count from 12; 1-3 and, at 2 threads, 5-7 and 9-11 each differ), so a decode row's 1-2 heads need not be padded
    to MIN_ROWS."""
    return 4 if n <= 4 else 8 if n <= 8 else max(n, 12)


def _attention_tile(
    q_IRD: torch.Tensor, k_ISD: torch.Tensor, v_ISV: torch.Tensor, mask_bhRS: torch.Tensor | None, n_keys: int,
    scale: float, B: int, Kh: int,
) -> torch.Tensor:
    """One tile of query rows against keys 0..n_keys-1 (the last key any of its rows sees); [I, R, Dv].

    GEMMs: queries on the row side padded to query_rows(R), keys (scores) or value columns (P V) on the column side
    padded to MIN_ROWS, keys padded to whole blocks; the elementwise softmax runs on the real [I, R, n_keys]
    (elementwise ops and max round the same in any shape and layout). In place only on fresh buffers and only when
    autograd is not recording."""
    I, R, _ = q_IRD.shape
    Dv = v_ISV.shape[-1]
    Rp, S_pad = query_rows(R), -(-n_keys // KEY_BLOCK) * KEY_BLOCK
    scores_IRS = torch.bmm(_pad_dim(q_IRD, 1, Rp), _pad_dim(k_ISD[:, :n_keys], 1, MIN_ROWS).transpose(1, 2))
    scores_IRS = scores_IRS[:, :R, :n_keys] * scale
    inplace = not (torch.is_grad_enabled() and scores_IRS.requires_grad)  # in place on fresh buffers only
    if mask_bhRS is not None:
        mask_bhRS = mask_bhRS[..., :n_keys]
        scores_bhRS = scores_IRS.view(B, Kh, R, n_keys)
        scores_IRS = (scores_bhRS.add_(mask_bhRS) if inplace else scores_bhRS + mask_bhRS).view(I, R, n_keys)
    # Row max, exact in any order; clamped so that a row that sees no key gets exp(-inf) = 0, not NaN.
    max_IR1 = scores_IRS.amax(dim=-1, keepdim=True).clamp(min=torch.finfo(scores_IRS.dtype).min)
    # Probabilities in a contiguous zero-padded [I, Rp, S_pad]: the block row sums below are then inner reductions
    # (torch reduces a strided dim with a kernel whose rounding depends on the number of rows).
    p_IRS = scores_IRS.new_zeros(I, Rp, S_pad)
    p_IRS[:, :R, :n_keys] = scores_IRS.sub_(max_IR1).exp_() if inplace else torch.exp(scores_IRS - max_IR1)
    out_IRV = denominator_IR = None
    for start in range(0, S_pad, KEY_BLOCK):  # fixed order; blocks past a row's last key add exact zeros
        keys = slice(start, start + KEY_BLOCK)
        v_IKV = _pad_dim(_pad_dim(v_ISV[:, start : min(start + KEY_BLOCK, n_keys)], 1, KEY_BLOCK), 2, MIN_ROWS)
        block_IRV = torch.bmm(p_IRS[:, :, keys], v_IKV)
        block_IR = p_IRS[:, :R, keys].sum(-1)
        out_IRV = block_IRV if out_IRV is None else out_IRV + block_IRV
        denominator_IR = block_IR if denominator_IR is None else denominator_IR + block_IR
    return out_IRV[:, :R, :Dv] / denominator_IR[:, :, None]


def _additive_mask(
    attn_mask: torch.Tensor | None, is_causal: bool, T: int, S: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor | None:
    """[b, h, T, S] additive mask (b in {1, B}, h in {1, H}; 0 / -inf, or the caller's additive values), None when
    every query sees every key."""
    mask = None
    if is_causal:
        visible_TS = torch.ones(T, S, dtype=torch.bool, device=device).tril()
        mask = torch.zeros(1, 1, T, S, dtype=dtype, device=device).masked_fill_(~visible_TS, -math.inf)
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            attn_mask = torch.zeros(attn_mask.shape, dtype=dtype, device=device).masked_fill_(~attn_mask, -math.inf)
        attn_mask = attn_mask.to(dtype)
        while attn_mask.dim() < 4:
            attn_mask = attn_mask[None]
        attn_mask = attn_mask.reshape(-1, *attn_mask.shape[-3:])
        mask = attn_mask if mask is None else mask + attn_mask
    return mask


def _visible_key_count(mask_bhTS: torch.Tensor) -> list[int]:
    """Per query: 1 + the last key any batch row or head may see (at least 1). Read on the host."""
    visible_TS = (mask_bhTS > -math.inf).flatten(0, 1).any(0)
    last_T = torch.where(visible_TS, torch.arange(1, visible_TS.shape[1] + 1, device=visible_TS.device), 0)
    return [max(n, 1) for n in last_T.amax(-1).tolist()]  # .tolist() syncs, once per attention call


def _tile_mask(mask_bhTS: torch.Tensor, t0: int, t1: int, Kh: int, G: int) -> torch.Tensor:
    """The tile's mask as [b, 1 or Kh, (t1 - t0) * G, S], rows in the (t, g) order of the query rows."""
    b, h, _, S = mask_bhTS.shape
    m = mask_bhTS[:, :, t0:t1]
    if h == 1:
        return m[:, :, :, None].expand(b, 1, t1 - t0, G, S).reshape(b, 1, (t1 - t0) * G, S)
    return m.view(b, Kh, G, t1 - t0, S).transpose(2, 3).reshape(b, Kh, (t1 - t0) * G, S)


# --------------------------------------------------------------------------------------- elementwise and reductions


def _one_plus_exp_neg(x32: torch.Tensor) -> torch.Tensor:
    """1 + exp(-x); in place on one temporary when autograd is not recording (fewer fresh buffers to fault in)."""
    if torch.is_grad_enabled() and x32.requires_grad:
        return 1.0 + torch.exp(-x32)
    return torch.neg(x32).exp_().add_(1.0)


def invariant_silu(x: torch.Tensor) -> torch.Tensor:
    """torch's own silu, every element through its vectorized loop: a piece of the flattened tensor per call, each a
    whole number of SILU_ALIGN elements (no scalar tail) and shorter than torch's parallel grain (no split across
    threads, whose boundaries would create tails); the last elements are computed in a zero-padded piece. An element's
    bits then depend only on its value. Autograd: torch's silu backward."""
    if torch.is_grad_enabled() and x.requires_grad:
        return _VectorizedSilu.apply(x)
    return _vectorized_silu(x)


def _vectorized_silu(x: torch.Tensor) -> torch.Tensor:
    flat = x.reshape(-1)
    n = flat.numel()
    out = torch.empty(n, dtype=x.dtype, device=x.device)
    whole = n - n % SILU_ALIGN
    for start in range(0, whole, SILU_CHUNK):
        end = min(start + SILU_CHUNK, whole)
        torch.ops.aten.silu.out(flat[start:end], out=out[start:end])
    if whole < n:
        piece = flat.new_zeros(SILU_ALIGN)
        piece[: n - whole] = flat[whole:]
        out[whole:] = torch.ops.aten.silu(piece)[: n - whole]
    return out.view(x.shape)


class _VectorizedSilu(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return _vectorized_silu(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        return torch.ops.aten.silu_backward(grad, x)


def invariant_sigmoid(x: torch.Tensor) -> torch.Tensor:
    x32 = x.to(torch.promote_types(x.dtype, torch.float32))
    return _one_plus_exp_neg(x32).reciprocal_().to(x.dtype)


def _reduction(func, *args, mean: bool, **kwargs) -> torch.Tensor:
    """sum / mean: a reduction over a last dim longer than SUM_CHUNK is chunked, anything else passes through."""
    x, dim = args[0], args[1] if len(args) > 1 else kwargs.get("dim")
    if isinstance(dim, (tuple, list)) and len(dim) == 1:
        dim = dim[0]
    if not isinstance(dim, int) or not x.is_floating_point() or x.dim() == 0 or dim % x.dim() != x.dim() - 1:
        return func(*args, **kwargs)
    L = x.shape[-1]
    if L <= SUM_CHUNK:
        return func(*args, **kwargs)
    keepdim = args[2] if len(args) > 2 else kwargs.get("keepdim", False)
    dtype = kwargs.get("dtype")
    n = -(-L // SUM_CHUNK)
    parts = F.pad(x, (0, n * SUM_CHUNK - L)).view(*x.shape[:-1], n, SUM_CHUNK).sum(-1, dtype=dtype)
    out = parts.sum(-1, keepdim=keepdim)
    return out / L if mean else out


# -------------------------------------------------------------------------------------------------------------- mode


def _sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    if dropout_p:
        raise ValueError("attention dropout is random per batch; batch_invariant_mode needs dropout_p=0")
    return invariant_attention(query, key, value, attn_mask, is_causal, scale, enable_gqa)


def _sdpa_math(
    query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, dropout_mask=None, *, scale=None,
    enable_gqa=False,
):
    """aten._scaled_dot_product_attention_math returns (out, attention weights); no caller here reads the weights,
    so an empty tensor stands in for them."""
    out = _sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    return out, out.new_empty(0)


def _addmm(input, mat1, mat2, *, beta=1, alpha=1):
    product = invariant_mm(mat1, mat2)
    return (input if beta == 1 else beta * input) + (product if alpha == 1 else alpha * product)


def _addmm_(input, mat1, mat2, *, beta=1, alpha=1):
    return input.copy_(_addmm(input, mat1, mat2, beta=beta, alpha=alpha))


_HANDLERS = {
    F.linear: invariant_linear,
    torch.matmul: invariant_matmul,
    torch.Tensor.matmul: invariant_matmul,
    torch.Tensor.__matmul__: invariant_matmul,
    torch.mm: invariant_mm,
    torch.Tensor.mm: invariant_mm,
    torch.bmm: invariant_bmm,
    torch.Tensor.bmm: invariant_bmm,
    torch.addmm: _addmm,
    torch.Tensor.addmm: _addmm,
    torch.Tensor.addmm_: _addmm_,
    torch.einsum: invariant_einsum,
    torch._grouped_mm: invariant_grouped_mm,
    F.scaled_dot_product_attention: _sdpa,
    torch.ops.aten._scaled_dot_product_attention_math: _sdpa_math,
    torch.ops.aten._scaled_dot_product_attention_math.default: _sdpa_math,
    F.silu: lambda x, inplace=False: x.copy_(invariant_silu(x)) if inplace else invariant_silu(x),
    torch.sigmoid: invariant_sigmoid,
    torch.Tensor.sigmoid: invariant_sigmoid,
}
for _func, _mean in ((torch.sum, False), (torch.Tensor.sum, False), (torch.mean, True), (torch.Tensor.mean, True)):
    _HANDLERS[_func] = functools.partial(_reduction, _func, mean=_mean)


class _BatchInvariantMode(TorchFunctionMode):
    """Reroutes the ops in _HANDLERS; the handlers run with this mode off (torch pops a mode while its
    __torch_function__ runs), so their own torch calls are plain ones."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        return _HANDLERS.get(func, func)(*args, **(kwargs or {}))
