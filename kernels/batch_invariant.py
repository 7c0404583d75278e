"""Batch-invariant ("deterministic") mode: a sequence's logits do not depend on what else is in the batch.

Shapes: M rows (tokens) of a GEMM, N its output columns, K its contraction; J sequences (batch rows), H query heads,
Kh kv heads, G = H / Kh, T queries, S keys, D / Dv head dims.

Under `batch_invariant_mode()` every op whose per-row result a BLAS or torch's loop structure could make depend on
the batch is computed by the kernels of kernels/csrc/invariant.c (kernels/native.py), whose arithmetic is fixed in
the source: each output is one chain of float32 operations in a fixed order, whatever the batch, the tiling, the
thread count or the instruction set (docs/deterministic.md). Nothing relies on which kernel a library picks for a
shape:

- GEMMs (F.linear, matmul / @, mm, bmm, addmm, einsum, torch._grouped_mm): out[m, n] = the fma chain over k in
  increasing order. F.linear, x @ w.T and an einsum of the same product give the same bits.
- Attention (kernels.attention under the mode, F.scaled_dot_product_attention and the aten math kernel): per query
  row, scores as fma chains over the head dim, the max over its visible keys, the kernel's exp, then the
  probability-weighted values and the denominator as chains over the visible keys in increasing order. A key a row
  cannot see is skipped, which is bitwise the same as a key of probability 0: a full prefill, a chunked prefill and
  a decode step against a cache (contiguous or the rollout's paged pool, read in place through its block table)
  give a position the same bits.
- F.silu and sigmoid: the kernel's elementwise code (its own exp), so an element's bits depend only on its value.
- sum / mean over a last dimension longer than SUM_CHUNK: torch splits one long row across threads; here it is
  summed in chunks of SUM_CHUNK, then over the chunks.

What passes through to torch (softmax, log_softmax, logsumexp and shorter row reductions, rms_norm, exp / cos / sin
and the other elementwise ops, top-k, gathers) is checked, with the kernels, by a self-check the first time the mode
is entered in a process (`self_check`): in well under a second it verifies on this machine, at 1 thread and at the
process's thread count, that each op's result for a row is the same alone and among others; if one is not, the mode
refuses with DeterminismError naming the op and its kernel path, never running silently non-deterministic.

Autograd works through the mode: the kernels' ops are autograd Functions whose backward is plain torch. The mode
is a TorchFunctionMode, whose stack is thread-local: entering it on the rollout's engine thread changes nothing for
other threads.
"""

import contextlib
import functools
import math
import string
import threading
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from kernels import native

SUM_CHUNK = 8192  # last-dim sums / means longer than this run in chunks of this size

_local = threading.local()  # depth: mode entries on this thread; suspended: suspend_mode() entries


class DeterminismError(RuntimeError):
    """Deterministic mode cannot hold its guarantee on this machine (an op failed the self-check)."""


@contextlib.contextmanager
def batch_invariant_mode(enabled: bool = True) -> Iterator[None]:
    """Within the block (on this thread), logits and logprobs of a row are bitwise independent of the batch: its
    size, its other rows, and whether a position is computed in a full prefill, a chunked prefill or a decode step.
    `enabled=False` is a no-op, so a caller can write `with batch_invariant_mode(cfg.deterministic):`. The first
    entry in a process runs self_check() (DeterminismError if this machine breaks an invariant)."""
    if not enabled:
        yield
        return
    self_check()
    _local.depth = getattr(_local, "depth", 0) + 1
    try:
        with _BatchInvariantMode():
            yield
    finally:
        _local.depth -= 1


@contextlib.contextmanager
def suspend_mode() -> Iterator[None]:
    """Within the block, torch calls on this thread run as plain torch even under batch_invariant_mode(): for code
    that calls the invariant kernels itself (kernels/paged_attention.py's deterministic decode rows), and
    for the backward formulas here."""
    _local.suspended = getattr(_local, "suspended", 0) + 1
    try:
        with torch._C.DisableTorchFunction():
            yield
    finally:
        _local.suspended -= 1


def is_active() -> bool:
    """Whether batch_invariant_mode is on for this thread (and not suspended)."""
    return getattr(_local, "depth", 0) > 0 and getattr(_local, "suspended", 0) == 0


# ------------------------------------------------------------------------------------------------------------- GEMMs


def _result(out32: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return out32 if dtype == torch.float32 else out32.to(dtype)


def _gemm_dtype(a: torch.Tensor, b: torch.Tensor) -> torch.dtype:
    dtype = torch.promote_types(a.dtype, b.dtype)
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"batch_invariant_mode computes float32 / bfloat16 / float16 GEMMs, got {a.dtype} x {b.dtype}")
    return dtype


class _Gemm(torch.autograd.Function):
    """a [M, K] @ b [K, N] through the kernel; backward in plain torch."""

    @staticmethod
    def forward(ctx, a_MK: torch.Tensor, b_KN: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(a_MK, b_KN)
        return _result(native.gemm(a_MK, b_KN), _gemm_dtype(a_MK, b_KN))

    @staticmethod
    def backward(ctx, grad_MN: torch.Tensor):
        a_MK, b_KN = ctx.saved_tensors
        with suspend_mode():
            grad_a = grad_MN.to(a_MK.dtype) @ b_KN.t().to(a_MK.dtype) if ctx.needs_input_grad[0] else None
            grad_b = a_MK.t().to(b_KN.dtype) @ grad_MN.to(b_KN.dtype) if ctx.needs_input_grad[1] else None
        return grad_a, grad_b


def _needs_grad(*tensors: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def invariant_mm(x_MK: torch.Tensor, w_KN: torch.Tensor) -> torch.Tensor:
    """x @ w: every output the fma chain over k in increasing order; [M, N] in the operands' dtype."""
    if x_MK.dim() != 2 or w_KN.dim() != 2:
        raise ValueError(f"mm needs 2-D operands, got {x_MK.dim()}-D and {w_KN.dim()}-D")
    if not (x_MK.is_floating_point() and w_KN.is_floating_point()):
        return torch.mm(x_MK, w_KN)  # integer products are exact
    if _needs_grad(x_MK, w_KN):
        return _Gemm.apply(x_MK, w_KN)
    return _result(native.gemm(x_MK, w_KN), _gemm_dtype(x_MK, w_KN))


def invariant_bmm(a_BMK: torch.Tensor, b_BKN: torch.Tensor) -> torch.Tensor:
    """Batched invariant_mm: each item the same bits as invariant_mm."""
    if a_BMK.shape[0] != b_BKN.shape[0]:
        raise ValueError(f"bmm batch sizes differ: {tuple(a_BMK.shape)} x {tuple(b_BKN.shape)}")
    if a_BMK.shape[0] == 0:
        return a_BMK.new_empty(0, a_BMK.shape[1], b_BKN.shape[2])
    return torch.stack([invariant_mm(a, b) for a, b in zip(a_BMK.unbind(0), b_BKN.unbind(0))])


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


def attend(
    q_JHTD: torch.Tensor, k_JKSD: torch.Tensor, v_JKSV: torch.Tensor, lo_JT: torch.Tensor, hi_JT: torch.Tensor,
    scale: float, mask_JHTS: torch.Tensor | None = None,
) -> torch.Tensor:
    """The kernel's attention: query row (j, h, t) over keys lo_JT[j, t] .. hi_JT[j, t] - 1 of sequence j (plus
    the additive mask_JHTS, which may be an expanded view); [J, H, T, Dv] in q's dtype. Autograd: plain torch's
    softmax attention in the backward."""
    if _needs_grad(q_JHTD, k_JKSD, v_JKSV):
        return _Attention.apply(q_JHTD, k_JKSD, v_JKSV, lo_JT, hi_JT, scale, mask_JHTS)
    return _attend_native(q_JHTD, k_JKSD, v_JKSV, lo_JT, hi_JT, scale, mask_JHTS)


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 or t.shape[-1] == 1 else t.contiguous()


def _attend_native(q, k, v, lo_JT, hi_JT, scale, mask):
    J, H, T, D = q.shape
    Kh, S, Dv = k.shape[1], k.shape[2], v.shape[3]
    if H % Kh:
        raise ValueError(f"{H} query heads are not a multiple of {Kh} kv heads")
    q, k, v = (_last_dim_contiguous(t) for t in (q, k, v))
    out = torch.empty(J, H, T, Dv, dtype=torch.float32, device=q.device)
    mask_strides = (0, 0, 0)
    if mask is not None:
        mask = _last_dim_contiguous(mask.to(torch.float32).expand(J, H, T, S))
        mask_strides = (mask.stride(0), mask.stride(1), mask.stride(2))
    native.attention(
        q, k, v, lo_JT.to(torch.int32).contiguous(), hi_JT.to(torch.int32).contiguous(), scale=scale,
        q_strides=(q.stride(0), q.stride(1), q.stride(2)), k_strides=(k.stride(0), k.stride(1), 0, k.stride(2)),
        v_strides=(v.stride(0), v.stride(1), 0, v.stride(2)), shape=(J, Kh, H // Kh, T, D, Dv), out=out,
        out_strides=(out.stride(0), out.stride(1), out.stride(2)), mask=mask, mask_strides=mask_strides)
    return _result(out, q.dtype)


def reference_softmax_attention(q, k, v, lo_JT, hi_JT, scale, mask=None) -> torch.Tensor:
    """The same attention in plain torch (float32 math, dense masks): the backward's formula and a test reference."""
    J, H, T, _ = q.shape
    Kh, S = k.shape[1], k.shape[2]
    G = H // Kh
    k32, v32 = k.float().repeat_interleave(G, 1), v.float().repeat_interleave(G, 1)
    scores = (q.float() @ k32.transpose(-1, -2)) * scale
    pos_S = torch.arange(S, device=q.device)
    visible = (pos_S >= lo_JT[:, None, :, None]) & (pos_S < hi_JT[:, None, :, None])
    if mask is not None:
        scores = scores + mask.float()
    scores = scores.masked_fill(~visible, -math.inf)
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # a row that sees no key: zeros, as the kernel
    return (probs @ v32).to(q.dtype)


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, lo_JT, hi_JT, scale, mask):
        ctx.save_for_backward(q, k, v, lo_JT, hi_JT, mask)
        ctx.scale = scale
        return _attend_native(q, k, v, lo_JT, hi_JT, scale, mask)

    @staticmethod
    def backward(ctx, grad):
        q, k, v, lo_JT, hi_JT, mask = ctx.saved_tensors
        with suspend_mode(), torch.enable_grad():
            leaves = [t.detach().requires_grad_(need) for t, need in zip((q, k, v), ctx.needs_input_grad[:3])]
            out = reference_softmax_attention(*leaves, lo_JT, hi_JT, ctx.scale, mask)
            wanted = [t for t in leaves if t.requires_grad]
            grads = iter(torch.autograd.grad(out, wanted, grad))
        return (*(next(grads) if t.requires_grad else None for t in leaves), None, None, None, None)


def causal_ranges(J: int, T: int, S: int, *, causal: bool, q_offset: int = 0, device=None) -> tuple:
    """lo, hi [J, T] (int32) for T queries at positions q_offset .. against keys 0 .. S-1."""
    t_T = torch.arange(T, device=device, dtype=torch.int64)
    hi_T = torch.clamp(t_T + q_offset + 1, max=S) if causal else torch.full((T,), S, dtype=torch.int64, device=device)
    lo_JT = torch.zeros(J, T, dtype=torch.int32, device=device)
    return lo_JT, hi_T.to(torch.int32)[None].expand(J, T).contiguous()


def invariant_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None = None,
    is_causal: bool = False, scale: float | None = None, enable_gqa: bool = False,
) -> torch.Tensor:
    """F.scaled_dot_product_attention's semantics (is_causal aligned top-left; attn_mask boolean, True = attend, or
    additive) on the kernel's attention. q [..., H, T, D], k [..., Kh, S, D], v [..., Kh, S, Dv] with equal leading
    dims; returns [..., H, T, Dv] in q's dtype."""
    *lead, H, T, D = q.shape
    Kh, S, Dv = k.shape[-3], k.shape[-2], v.shape[-1]
    if list(k.shape[:-3]) != lead or list(v.shape[:-3]) != lead:
        raise ValueError(f"attention batch dims must match: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if H != Kh and not (enable_gqa and H % Kh == 0):
        raise ValueError(f"{H} query heads and {Kh} kv heads need enable_gqa=True and H % K == 0")
    J = math.prod(lead)
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    lo_JT, hi_JT = causal_ranges(J, T, S, causal=is_causal, device=q.device)
    mask = None
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            attn_mask = torch.zeros(attn_mask.shape, device=q.device).masked_fill_(~attn_mask, -math.inf)
        mask = attn_mask.to(torch.float32).expand(*lead, H, T, S).reshape(J, H, T, S)
    out = attend(q.reshape(J, H, T, D), k.reshape(J, Kh, S, D), v.reshape(J, Kh, S, Dv), lo_JT, hi_JT, scale, mask)
    return out.view(*lead, H, T, Dv)


def invariant_attention_positions(
    q_BHTD: torch.Tensor, k_BKSD: torch.Tensor, v_BKSV: torch.Tensor, *, causal: bool, q_offset: int, packing=None,
    scale: float | None = None,
) -> torch.Tensor:
    """kernels.attention's contract (queries at q_offset.., keys at 0.., optional kernels.attention.Packing) on the
    kernel's attention, with no mask tensor: each query's visible keys are a range."""
    B, _, T, D = q_BHTD.shape
    if packing is not None:
        lo_JT, hi_JT = packed_ranges(packing, causal=causal)
    else:
        lo_JT, hi_JT = causal_ranges(B, T, k_BKSD.shape[2], causal=causal, q_offset=q_offset, device=q_BHTD.device)
    return attend(q_BHTD, k_BKSD, v_BKSV, lo_JT, hi_JT, 1.0 / math.sqrt(D) if scale is None else scale)


def packed_ranges(packing, *, causal: bool) -> tuple:
    """lo, hi [1, T] for documents packed back to back (a kernels.attention.Packing): a query sees its own document
    (up to itself if causal)."""
    doc_T = packing.doc_ids()
    cu = packing.cu_seqlens.to(torch.int64)
    hi_T = torch.arange(doc_T.numel(), device=doc_T.device) + 1 if causal else cu[1:][doc_T]
    return cu[:-1][doc_T].to(torch.int32)[None], hi_T.to(torch.int32)[None]


# --------------------------------------------------------------------------------------- elementwise and reductions


class _Unary(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, op):
        ctx.save_for_backward(x)
        ctx.op = op
        return _result(native.unary(op, x), x.dtype)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        with suspend_mode():
            if ctx.op == "silu":
                return torch.ops.aten.silu_backward(grad, x), None
            y = torch.sigmoid(x)
            return grad * y * (1 - y), None


def _unary(op: str, x: torch.Tensor) -> torch.Tensor:
    if not x.is_floating_point():
        raise ValueError(f"{op} needs a floating-point tensor, got {x.dtype}")
    if _needs_grad(x):
        return _Unary.apply(x, op)
    return _result(native.unary(op, x), x.dtype)


def invariant_silu(x: torch.Tensor) -> torch.Tensor:
    """x / (1 + exp(-x)) per element in the kernel (its own exp): bits depend only on the value."""
    return _unary("silu", x)


def invariant_sigmoid(x: torch.Tensor) -> torch.Tensor:
    return _unary("sigmoid", x)


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


# -------------------------------------------------------------------------------------------------------- self-check

_checked: list[bool] = []
_check_lock = threading.Lock()


def self_check(checks: list | None = None) -> None:
    """Verify the mode's invariants on this machine, once per process (or the given checks, every call): raises
    DeterminismError naming the op and its kernel path when one fails. Takes well under a second."""
    if checks is None and _checked:  # every mode entry after the first (the rollout enters once per step)
        return
    from kernels.invariant_checks import CHECKS, run_checks  # imported here: it imports this module

    if checks is not None:
        run_checks(checks)
        return
    with _check_lock:
        if not _checked:
            with suspend_mode():
                run_checks(CHECKS)
            _checked.append(True)
