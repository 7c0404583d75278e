"""Context parallelism (CP): every sequence split over the cp ranks, attention computed as a ring (torch.distributed).

Shapes: B rows, T the full (global) row length, cp the context-parallel degree, c = T / (2 cp) tokens per chunk, L =
2 c tokens a rank holds, H query heads, K kv heads (H % K == 0), G = H / K, D q/k head dim, Dv v head dim (MLA: D !=
Dv, e.g. DeepSeek's 192 / 128).

Layout (causal load balancing, "zigzag"): each row is cut into 2 cp chunks of c tokens; rank r holds chunks r and
2 cp - 1 - r, in that order, as its L local tokens. Under causal attention chunk i costs i + 1 chunk pairs, so every
rank does the same work: (r + 1) + (2 cp - r) = 2 cp + 1 pairs. Positions (RoPE) stay the global ones.
ContextLayout holds this layout for one micro-batch: shard() cuts a full [.., T, ..] tensor (tokens, targets,
positions) to the rank's [.., L, ..], gather() puts the ranks' pieces back in order (an all_gather; not
differentiable: for outputs such as logprobs), positions() gives the global positions of the local tokens.
Packed rows (kernels.Packing: documents back to back, B = 1) are supported: the layout keeps the global document ids,
so a query sees a key iff it is at or after it AND in the same document, and positions restart at 0 in every
document, as on one rank. A row whose length is not a multiple of 2 cp is refused (ValueError naming the lengths);
pad it first (trailing padding never influences earlier tokens under causal attention; give it IGNORE_INDEX targets).

Ring attention (RingAttention, an autograd Function over the cp process group, mesh["cp"]):
- forward: the rank's K/V travel around the ring (rank r sends to r + 1 and receives from r - 1 with
  torch.distributed.batch_isend_irecv; the next block is in flight while the current one is computed). At step s
  rank r holds the K/V of rank j = (r - s) mod cp and computes, for each (local query chunk, remote key chunk) pair
  that is not fully masked, the block's attention and log-sum-exp; the blocks are merged with the online-softmax rule
  (out, lse) <- (out e^(lse - lse') + out_b e^(lse_b - lse'), lse' = logaddexp(lse, lse_b)) in float32 accumulators.
  Pair visibility comes from the chunks' global indices: a key chunk before the query chunk is fully visible, the same
  chunk causal (lower triangle), a later one skipped; with packing also the document ids (a pair with no common
  document is skipped). Without packing each step s > 0 computes exactly two full pairs on every rank.
- backward: also a ring (FlashAttention-2's backward per block, probabilities rebuilt from the saved log-sum-exp,
  delta = rowsum(dO * O)). K/V travel as in the forward; with each block travels its float32 dK/dV accumulator: the
  rank holding block j adds its contribution and passes (dK_j, dV_j) on, and after cp steps the sums arrive back at
  their owner. Nothing ever holds the whole sequence's K, V or gradients.
Every block is computed in float32 (inputs cast per block), the output cast to q's dtype; against the reference
attention over the whole sequence the results agree to float32 rounding (the order of the sums differs).

Hook: apply_context_parallel(model, mesh, dims) gives each attention module (models.common.blocks.Attention,
models.deepseek_v3.model.MLAttention) the model's ContextParallel; the module then calls ContextParallel.attention
instead of kernels.attention. The row's ContextLayout travels as the model's `packing` argument (so the decoder also
takes its positions from it): model(layout.shard(tokens_BT), packing=layout). Without apply_context_parallel the
modules' context_parallel is None and the single-process path is unchanged.

Exactness: not bitwise the single-process model (blockwise online softmax sums in another order); float32 results
agree to ~1e-6 relative (tests/services/trainer/parallel/test_parallel_context.py states the tolerance per case).
The gradients of the weights on a cp rank are its tokens' share: their sum over the cp group is the full gradient
(FSDP's reduce-scatter over dp_shard_cp does that sum in training).
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from kernels import Packing, batch_invariant

# P2P tags: a K/V block and a gradient accumulator may be in flight between the same two ranks at once.
_KV_TAG, _GRAD_TAG = 0, 1


class ContextParallel:
    """One model's context-parallel group (the cp dimension of the mesh): its layouts and its ring attention."""

    def __init__(self, group: dist.ProcessGroup):
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        # batch_isend_irecv takes global ranks
        self.next_rank = dist.get_global_rank(group, (self.rank + 1) % self.size)
        self.prev_rank = dist.get_global_rank(group, (self.rank - 1) % self.size)

    def layout(self, seq_len: int | None = None, *, packing: Packing | None = None) -> ContextLayout:
        """The layout of rows of seq_len tokens, or of one packed row (seq_len = packing.total)."""
        if (seq_len is None) == (packing is None):
            raise ValueError("give either seq_len (unpacked rows) or packing (one packed row)")
        return ContextLayout(self, packing.total if packing is not None else seq_len, packing)

    def attention(self, q_BHLD: torch.Tensor, k_BKLD: torch.Tensor, v_BKLD: torch.Tensor, *, layout,
                  cache=None, scale: float | None = None) -> torch.Tensor:
        """Causal attention of the local queries against the whole row's keys: [B, H, L, Dv] in q's dtype. layout is
        what the attention module received as `packing` (the row's ContextLayout); scale defaults to 1/sqrt(D)."""
        if cache is not None:
            raise ValueError("a context-parallel model computes training rows; it has no KV-cache path (decode with "
                             "a model that was not given apply_context_parallel)")
        if not isinstance(layout, ContextLayout):
            what = "a kernels.Packing" if isinstance(layout, Packing) else "no layout"
            raise ValueError(f"a context-parallel model got {what}: pass the row's ContextLayout as packing, "
                             "model(layout.shard(tokens), packing=layout), with layout = ContextParallel.layout("
                             "seq_len) or .layout(packing=...) (it also gives the tokens' global positions)")
        if layout.cp is not self:
            raise ValueError("the ContextLayout belongs to another context-parallel group")
        if batch_invariant.is_active():
            raise ValueError("deterministic (batch-invariant) mode is not available with context parallelism (cp > 1)")
        B, L = q_BHLD.shape[0], q_BHLD.shape[2]
        if L != 2 * layout.chunk:
            raise ValueError(f"this rank holds {L} tokens of the row; its shard of a {layout.seq_len}-token row has "
                             f"{2 * layout.chunk} (shard the inputs with layout.shard)")
        if layout.packing is not None and B != 1:
            raise ValueError(f"a packed row is one row (B = 1), got B = {B}")
        scale = 1.0 / math.sqrt(q_BHLD.shape[-1]) if scale is None else scale
        return RingAttention.apply(q_BHLD, k_BKLD, v_BKLD, layout, scale)

    def shift(self, x: torch.Tensor, tag: int) -> tuple[torch.Tensor, list]:
        """Start sending x to the next rank and receiving the previous rank's into a new buffer: (buffer, works)."""
        recv = torch.empty_like(x)
        works = dist.batch_isend_irecv([
            dist.P2POp(dist.isend, x, self.next_rank, self.group, tag),
            dist.P2POp(dist.irecv, recv, self.prev_rank, self.group, tag),
        ])
        return recv, works


class ContextLayout:
    """One micro-batch's rows under the zigzag layout (module docstring): rank r holds chunks r and 2 cp - 1 - r.

    plan[s] lists the (local query chunk, key chunk of the K/V held at ring step s, mask) pairs to compute, in a
    fixed order; mask is a [c, c] bool (True: visible) or None (all visible). Built on the host once per layout
    (no device syncs), shared by every layer's forward and backward."""

    def __init__(self, cp: ContextParallel, seq_len: int, packing: Packing | None):
        n = 2 * cp.size
        if seq_len % n:
            raise ValueError(f"context parallelism over cp = {cp.size} ranks splits each row into 2 * cp = {n} "
                             f"chunks, so its length must be a multiple of {n}; got {seq_len} tokens (pad the row "
                             f"to {-(-seq_len // n) * n}, padding with IGNORE_INDEX targets)")
        self.cp, self.seq_len, self.chunk, self.packing = cp, seq_len, seq_len // n, packing
        self.chunks = self.chunks_of(cp.rank)
        doc_T = None if packing is None else torch.repeat_interleave(
            torch.arange(len(packing.lengths)), torch.tensor(packing.lengths))
        self._doc_T = doc_T
        self.plan = []
        for step in range(cp.size):
            held = self.chunks_of((cp.rank - step) % cp.size)
            pairs = []
            for qi, q_chunk in enumerate(self.chunks):
                for ki, k_chunk in enumerate(held):
                    visible = self._visible(q_chunk, k_chunk)
                    if visible is not False:
                        pairs.append((qi, ki, visible))
            self.plan.append(pairs)
        self._device_plans: dict[torch.device, list] = {}

    def chunks_of(self, rank: int) -> tuple[int, int]:
        return rank, 2 * self.cp.size - 1 - rank

    def _visible(self, q_chunk: int, k_chunk: int) -> torch.Tensor | None | bool:
        """[c, c] mask of a chunk pair, None when all visible, False when none is."""
        if k_chunk > q_chunk:
            return False
        c = self.chunk
        visible_cc = torch.ones(c, c, dtype=torch.bool).tril() if k_chunk == q_chunk else None
        if self._doc_T is not None:
            q_doc_c, k_doc_c = self._doc_T[q_chunk * c:(q_chunk + 1) * c], self._doc_T[k_chunk * c:(k_chunk + 1) * c]
            same_cc = q_doc_c[:, None] == k_doc_c[None, :]
            visible_cc = same_cc if visible_cc is None else visible_cc & same_cc
            if not visible_cc.any():
                return False
            if visible_cc.all():
                return None
        return visible_cc

    def device_plan(self, device: torch.device) -> list:
        if device not in self._device_plans:
            self._device_plans[device] = [[(qi, ki, None if m is None else m.to(device)) for qi, ki, m in pairs]
                                          for pairs in self.plan]
        return self._device_plans[device]

    def index(self) -> torch.Tensor:
        """[L] the global positions in the row of the rank's local tokens."""
        c = self.chunk
        return torch.cat([torch.arange(i * c, (i + 1) * c) for i in self.chunks])

    def shard(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """The rank's [.., L, ..] of a full row tensor [.., T, ..] (tokens, targets, positions: dim 1 of [B, T])."""
        if x.shape[dim] != self.seq_len:
            raise ValueError(f"expected {self.seq_len} tokens along dim {dim}, got shape {tuple(x.shape)}")
        c = self.chunk
        return torch.cat([x.narrow(dim, i * c, c) for i in self.chunks], dim=dim)

    def positions(self) -> torch.Tensor:
        """[1, L] RoPE positions of the local tokens (broadcast over rows): global positions, or with packing the
        positions restarting at 0 in every document, as the single-process model uses."""
        if self.packing is None:
            return self.index()[None]
        return self.shard(self.packing.positions().cpu())

    def gather(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """The full row [.., T, ..] from every rank's [.., L, ..] (an all_gather over the cp group; not
        differentiable)."""
        parts = [torch.empty_like(x) for _ in range(self.cp.size)]
        dist.all_gather(parts, x.contiguous(), group=self.cp.group)
        chunks: list[torch.Tensor | None] = [None] * (2 * self.cp.size)
        for rank, part in enumerate(parts):
            first, second = part.split(self.chunk, dim=dim)
            a, b = self.chunks_of(rank)
            chunks[a], chunks[b] = first, second
        return torch.cat(chunks, dim=dim)


# ------------------------------------------------------------------------------------------------------ ring attention


def _block_forward(qs_BKGcD, k_BKcD, v_BKcD, mask_cc):
    """One chunk pair: (out [B, K, G, c, Dv] normalized within the block, lse [B, K, G, c]); rows with no visible
    key give out 0 and lse -inf. qs: queries times the scale, float32."""
    s_BKGcc = torch.matmul(qs_BKGcD, k_BKcD.transpose(-1, -2).unsqueeze(2))
    if mask_cc is not None:
        s_BKGcc.masked_fill_(~mask_cc, -math.inf)
    lse_BKGc = torch.logsumexp(s_BKGcc, dim=-1)
    p_BKGcc = torch.exp(s_BKGcc - lse_BKGc.masked_fill(lse_BKGc == -math.inf, 0.0)[..., None])
    return torch.matmul(p_BKGcc, v_BKcD.unsqueeze(2)), lse_BKGc


def _merge_(out_BKGcD, lse_BKGc, block_out, block_lse) -> None:
    """Online softmax: fold a block's (out, lse) into the accumulators, in place."""
    new_lse = torch.logaddexp(lse_BKGc, block_lse)
    safe = new_lse.masked_fill(new_lse == -math.inf, 0.0)  # both -inf: the row has seen no key yet, stays 0
    out_BKGcD.mul_(torch.exp(lse_BKGc - safe)[..., None]).add_(block_out * torch.exp(block_lse - safe)[..., None])
    lse_BKGc.copy_(new_lse)


def _block_backward(qs_BKGcD, dout_BKGcD, lse_BKGc, delta_BKGc, k_BKcD, v_BKcD, mask_cc):
    """One chunk pair's (d qs, dk, dv) given the final lse and delta = rowsum(dO * O)."""
    s_BKGcc = torch.matmul(qs_BKGcD, k_BKcD.transpose(-1, -2).unsqueeze(2))
    if mask_cc is not None:
        s_BKGcc.masked_fill_(~mask_cc, -math.inf)
    p_BKGcc = torch.exp(s_BKGcc - lse_BKGc[..., None])
    dv_BKcD = torch.matmul(p_BKGcc.transpose(-1, -2), dout_BKGcD).sum(2)
    dp_BKGcc = torch.matmul(dout_BKGcD, v_BKcD.transpose(-1, -2).unsqueeze(2))
    ds_BKGcc = p_BKGcc * (dp_BKGcc - delta_BKGc[..., None])
    dqs_BKGcD = torch.matmul(ds_BKGcc, k_BKcD.unsqueeze(2))
    dk_BKcD = torch.matmul(ds_BKGcc.transpose(-1, -2), qs_BKGcD).sum(2)
    return dqs_BKGcD, dk_BKcD, dv_BKcD


def _pack(*xs: torch.Tensor) -> torch.Tensor:
    """One flat buffer (one message per ring step)."""
    return torch.cat([x.reshape(-1) for x in xs])


def _unpack(buf: torch.Tensor, *shapes: torch.Size) -> list[torch.Tensor]:
    return [part.view(shape) for part, shape in zip(buf.split([math.prod(s) for s in shapes]), shapes)]


def _wait(works: list) -> None:
    for work in works:
        work.wait()


class RingAttention(torch.autograd.Function):
    """Causal ring attention of the local [B, H, L, D] queries over the row's keys (module docstring)."""

    @staticmethod
    def forward(ctx, q_BHLD, k_BKLD, v_BKLD, layout: ContextLayout, scale: float):
        cp = layout.cp
        B, H, L, D = q_BHLD.shape
        K, Dv, c = k_BKLD.shape[1], v_BKLD.shape[-1], layout.chunk
        qs_BKGLD = (q_BHLD.float() * scale).view(B, K, H // K, L, D)
        out_BKGLD = qs_BKGLD.new_zeros(B, K, H // K, L, Dv)
        lse_BKGL = qs_BKGLD.new_full((B, K, H // K, L), -math.inf)
        kv = _pack(k_BKLD, v_BKLD)
        for step, pairs in enumerate(layout.device_plan(q_BHLD.device)):
            pending = cp.shift(kv, _KV_TAG) if step < cp.size - 1 else None
            k_held, v_held = _unpack(kv, k_BKLD.shape, v_BKLD.shape)
            for qi, ki, mask_cc in pairs:
                q_rows, k_rows = slice(qi * c, (qi + 1) * c), slice(ki * c, (ki + 1) * c)
                block_out, block_lse = _block_forward(qs_BKGLD[:, :, :, q_rows], k_held[:, :, k_rows].float(),
                                                      v_held[:, :, k_rows].float(), mask_cc)
                _merge_(out_BKGLD[:, :, :, q_rows], lse_BKGL[:, :, :, q_rows], block_out, block_lse)
            if pending is not None:
                _wait(pending[1])
                kv = pending[0]
        out_BHLD = out_BKGLD.view(B, H, L, Dv).to(q_BHLD.dtype)
        ctx.save_for_backward(q_BHLD, k_BKLD, v_BKLD, out_BHLD, lse_BKGL)
        ctx.layout, ctx.scale = layout, scale
        return out_BHLD

    @staticmethod
    def backward(ctx, dout_BHLD):
        q_BHLD, k_BKLD, v_BKLD, out_BHLD, lse_BKGL = ctx.saved_tensors
        layout, scale = ctx.layout, ctx.scale
        cp, c = layout.cp, layout.chunk
        B, H, L, D = q_BHLD.shape
        K, Dv = k_BKLD.shape[1], v_BKLD.shape[-1]
        qs_BKGLD = (q_BHLD.float() * scale).view(B, K, H // K, L, D)
        dout_BKGLD = dout_BHLD.float().reshape(B, K, H // K, L, Dv)
        delta_BKGL = (dout_BKGLD * out_BHLD.float().view(B, K, H // K, L, Dv)).sum(-1)
        dqs_BKGLD = torch.zeros_like(qs_BKGLD)
        kv = _pack(k_BKLD, v_BKLD)
        grad_shapes = (k_BKLD.shape, v_BKLD.shape)
        arriving = None  # the held block's dK/dV accumulated by the ranks before this one, in flight
        for step, pairs in enumerate(layout.device_plan(q_BHLD.device)):
            pending = cp.shift(kv, _KV_TAG) if step < cp.size - 1 else None
            k_held, v_held = _unpack(kv, k_BKLD.shape, v_BKLD.shape)
            dkv = torch.zeros(kv.numel(), dtype=torch.float32, device=kv.device)
            dk_held, dv_held = _unpack(dkv, *grad_shapes)
            for qi, ki, mask_cc in pairs:
                q_rows, k_rows = slice(qi * c, (qi + 1) * c), slice(ki * c, (ki + 1) * c)
                dqs, dk, dv = _block_backward(
                    qs_BKGLD[:, :, :, q_rows], dout_BKGLD[:, :, :, q_rows], lse_BKGL[:, :, :, q_rows],
                    delta_BKGL[:, :, :, q_rows], k_held[:, :, k_rows].float(), v_held[:, :, k_rows].float(), mask_cc)
                dqs_BKGLD[:, :, :, q_rows] += dqs
                dk_held[:, :, k_rows] += dk
                dv_held[:, :, k_rows] += dv
            if arriving is not None:
                _wait(arriving[1])
                dkv += arriving[0]
            arriving = cp.shift(dkv, _GRAD_TAG)  # on to the next rank, which holds this block at the next step
            if pending is not None:
                _wait(pending[1])
                kv = pending[0]
        _wait(arriving[1])  # after cp steps every block's sums are back at its owner
        dk_BKLD, dv_BKLD = _unpack(arriving[0], *grad_shapes)
        dq_BHLD = (dqs_BKGLD * scale).view(B, H, L, D).to(q_BHLD.dtype)
        return dq_BHLD, dk_BKLD.to(k_BKLD.dtype), dv_BKLD.to(v_BKLD.dtype), None, None


# ---------------------------------------------------------------------------------------------------------------- hook


def apply_context_parallel(model: torch.nn.Module, mesh, dims) -> ContextParallel | None:
    """Make every attention module of model (a CausalLM or a pipeline stage of one) attend through ring attention
    over mesh["cp"]; returns the ContextParallel (its layout() shards each micro-batch), or None when dims.cp == 1
    (the model is left as it is)."""
    if dims.cp == 1:
        return None
    cp_mesh = mesh["cp"]
    if cp_mesh.size() != dims.cp:
        raise ValueError(f"the mesh's cp dimension has {cp_mesh.size()} ranks, dims.cp is {dims.cp}")
    cp = ContextParallel(cp_mesh.get_group())
    for number, layer in model.model.layers.items():
        attn = layer.self_attn
        if not hasattr(type(attn), "context_parallel"):
            raise TypeError(f"layer {number}'s {type(attn).__name__} has no context-parallel hook")
        attn.context_parallel = cp
    return cp


def context_parallel_of(model: torch.nn.Module) -> ContextParallel | None:
    """The ContextParallel apply_context_parallel gave model's attention modules, None when it was not applied."""
    for layer in model.model.layers.values():
        return getattr(layer.self_attn, "context_parallel", None)
    return None


def padded_packing(lengths: list[int], cp: ContextParallel, device: torch.device | str = "cpu") -> Packing:
    """The Packing of documents of these lengths back to back, plus, when their total is not a multiple of 2 cp, a
    trailing padding document of the missing tokens (fewer than 2 cp): its own document, so no real token attends
    to it (it comes last, and causal attention never looks ahead anyway); give its tokens IGNORE_INDEX targets."""
    pad = -sum(lengths) % (2 * cp.size)
    return Packing.from_lengths(list(lengths) + ([pad] if pad else []), device)


class SumOverGroup(torch.autograd.Function):
    """x summed over a process group (an all_reduce) in the forward; the backward passes the gradient to the local
    x unchanged. For a rank's share of a sum whose other shares' gradients flow on their own ranks (a cp rank's
    tokens' NLL: FSDP then sums the weights' gradients over the cp group), so every rank reads the whole value and
    backpropagates only through its own share, exactly once."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        out = x.detach().clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def with_local_graph(full: torch.Tensor, local: torch.Tensor, layout: ContextLayout) -> torch.Tensor:
    """The whole row's values [T, ...] (layout.gather of local, detached) with this rank's positions replaced by
    local [L, ...] itself: the result's values are the whole row's, and a gradient reaches exactly this rank's
    tokens through local (the other positions' gradients flow on their own ranks, which compute the same)."""
    return full.detach().index_put((layout.index().to(full.device),), local)
