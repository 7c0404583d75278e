"""Attention over a paged KV pool for one step of packed sequences (the rollout's engine step): every sequence's
queries attend to exactly its own context, read through its block table.

Shapes: N tokens of the step packed in one row ([1, N]), H query heads, K cached heads (G = H / K per group), S a
sequence's context (cached + new), D / Dv key / value head dims, NB blocks in the pool, BS block size; in a decode
batch R rows, P prefix groups of at most B rows, L keys, C query rows of a GEMM, I GEMM items.

Two calls: plan_paged_attention(seqs, ...) once per step on the host (block tables to device tensors, decode rows
grouped into batches), then paged_attention(q, k_pool, v_pool, plan) in every layer, after the caller has written the
step's new keys/values into their slots of the pool:
- a prefill chunk (T > 1 new tokens at q_offset = tokens cached before): one kernels.attention call per sequence
  over its gathered context, causal from q_offset;
- decode rows (one new token each), fast path: rows forked from one sequence (the n samples of a prompt) form a prefix
  group whose shared full blocks are gathered once and read by one matmul with all the group's queries; each row's
  remaining blocks are gathered per row. Groups go into padded batches (contexts under 2 * DECODE_BATCH_MIN_TOKENS
  together, longer ones by power-of-two size class, at most DECODE_BATCH_BYTES of keys per batch so the gathered
  blocks are still in cache for the matmuls), scores masked by adding -inf and softmaxed in float32, the gathers
  written into buffers reused across layers and steps. Masked positions may hold another sequence's data, so the
  pool must hold finite values in every slot of a block in use (the rollout zeroes a block when a step first writes
  into it): a NaN there would poison the masked sums;
- decode rows in deterministic mode: one call of the batch-invariant attention kernel (kernels/native.py,
  kernels/csrc/invariant.c: what kernels.attention runs under batch_invariant_mode(), for a prefill as for a decode)
  for every decode row of the step, reading each row's keys and values in place in the pool through its block
  table. The kernel's arithmetic for a query row is fixed by the row's query and its visible keys alone, so a
  position's result depends neither on the other rows of the step nor on whether it came from a prefill or a
  decode, and it is bitwise the trainer's.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kernels import native
from kernels.attention import attention


@dataclass(frozen=True)
class SeqSpan:
    """One sequence of the step: rows start .. start + num_new - 1 at positions num_computed .. ."""

    start: int
    num_new: int
    num_computed: int
    block_table: list[int]


@dataclass(frozen=True)
class PrefillChunk:
    start: int  # first row in the packed tokens
    num_new: int
    q_offset: int  # tokens of this sequence cached before the step
    blocks: torch.Tensor  # int64 [ceil(S / BS)]


@dataclass(frozen=True)
class PagedAttentionPlan:
    """What every layer of a step reuses: the prefill chunks, and the decode rows as deterministic mode's one kernel
    call (invariant) or as the fast path's batches (decode_batches)."""

    prefills: list[PrefillChunk]
    invariant: InvariantDecodes | None
    decode_batches: list[DecodeBatch]


def plan_paged_attention(seqs: list[SeqSpan], k_pool: torch.Tensor, *, deterministic: bool,
                         batch_bytes: int | None = None) -> PagedAttentionPlan:
    """The step's plan, built on the host once. k_pool: any layer's key pool [K, NB, BS, D] (for its block size,
    dtype and device). batch_bytes: keys gathered per fast-path decode batch (DECODE_BATCH_BYTES by default)."""
    device, bs = k_pool.device, k_pool.shape[2]
    num_tokens = sum(s.num_new for s in seqs)
    prefills: list[PrefillChunk] = []
    decodes: list[SeqSpan] = []
    for s in seqs:
        if s.num_new == 1:
            decodes.append(s)
        else:
            context = s.num_computed + s.num_new
            blocks = torch.tensor(s.block_table[: -(-context // bs)], dtype=torch.int64, device=device)
            prefills.append(PrefillChunk(s.start, s.num_new, s.num_computed, blocks))
    invariant, decode_batches = None, []
    if decodes and deterministic:
        invariant = InvariantDecodes.build(decodes, num_tokens, device)
    elif decodes:
        block_bytes = k_pool[:, 0].numel() * k_pool.element_size()
        budget = DECODE_BATCH_BYTES if batch_bytes is None else batch_bytes
        decode_batches = _decode_batches(decodes, bs, num_tokens, k_pool.dtype, device, block_bytes, budget)
    return PagedAttentionPlan(prefills, invariant, decode_batches)


def paged_attention(q_1HND: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, plan: PagedAttentionPlan, *,
                    scale: float | None = None, workspace: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
    """[1, H, N, Dv]: each of the step's queries against its sequence's context in the layer's pools k_pool
    [K, NB, BS, D] / v_pool [K, NB, BS, Dv], which already hold the step's new keys/values. workspace: gather
    buffers to reuse across layers and steps (the fast decode path's)."""
    K, Dk, Dv = k_pool.shape[0], k_pool.shape[3], v_pool.shape[3]
    H, N = q_1HND.shape[1], q_1HND.shape[2]
    out_HND = q_1HND.new_empty(H, N, Dv)
    for p in plan.prefills:
        S = p.q_offset + p.num_new
        k_1KSD = k_pool.index_select(1, p.blocks).view(1, K, -1, Dk)[:, :, :S]
        v_1KSD = v_pool.index_select(1, p.blocks).view(1, K, -1, Dv)[:, :, :S]
        q_1HTD = q_1HND[:, :, p.start:p.start + p.num_new]
        out_HND[:, p.start:p.start + p.num_new] = attention(
            q_1HTD, k_1KSD, v_1KSD, causal=True, q_offset=p.q_offset, scale=scale)[0]
    if plan.invariant is not None:
        out_HRV = plan.invariant.attend(q_1HND[0], k_pool, v_pool, 1.0 / math.sqrt(Dk) if scale is None else scale)
        if plan.invariant.rows is None:
            return out_HRV[None]
        out_HND.index_copy_(1, plan.invariant.rows, out_HRV)
    for d in plan.decode_batches:
        out_HRD = _decode_batch(q_1HND[0], k_pool, v_pool, d, 1.0 / math.sqrt(Dk) if scale is None else scale,
                                {} if workspace is None else workspace)
        if d.all_rows:
            return out_HRD[None]
        out_HND.index_copy_(1, d.rows, out_HRD)
    return out_HND[None]


@dataclass(frozen=True)
class InvariantDecodes:
    """Deterministic mode's decode rows of a step: one kernel call reads each row's context in place through its
    block table (built on the host once per step; serves every layer)."""

    rows: torch.Tensor | None  # int64 [R] rows in the packed tokens; None when they are the step's rows 0 .. N - 1
    tables_RC: torch.Tensor  # int64 [R, C] block tables, padded with block 0 (never read: past every row's context)
    lo_R1: torch.Tensor  # int32 [R, 1] first visible key: 0
    hi_R1: torch.Tensor  # int32 [R, 1] the row's context length (cached keys + its own)

    @classmethod
    def build(cls, decodes: list[SeqSpan], num_tokens: int, device) -> InvariantDecodes:
        rows = [s.start for s in decodes]
        width = max(len(s.block_table) for s in decodes)
        tables = [s.block_table + [0] * (width - len(s.block_table)) for s in decodes]
        return cls(
            rows=None if rows == list(range(num_tokens)) else torch.tensor(rows, dtype=torch.int64, device=device),
            tables_RC=torch.tensor(tables, dtype=torch.int64, device=device),
            lo_R1=torch.zeros(len(rows), 1, dtype=torch.int32, device=device),
            hi_R1=torch.tensor([[s.num_computed + 1] for s in decodes], dtype=torch.int32, device=device))

    def attend(self, q_HND: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, scale: float) -> torch.Tensor:
        """[H, R, Dv] in q's dtype: every decode row against its context in the pool ([K, NB, BS, D])."""
        q_HRD = (q_HND if self.rows is None else q_HND.index_select(1, self.rows)).contiguous()
        H, R, D = q_HRD.shape
        K, Dv = k_pool.shape[0], v_pool.shape[3]
        out_HRV = torch.empty(H, R, Dv, dtype=torch.float32, device=q_HND.device)
        native.attention(
            q_HRD, k_pool, v_pool, self.lo_R1, self.hi_R1, scale=scale, q_strides=(D, R * D, 0),
            k_strides=(0, k_pool.stride(0), k_pool.stride(1), k_pool.stride(2)),
            v_strides=(0, v_pool.stride(0), v_pool.stride(1), v_pool.stride(2)), shape=(R, K, H // K, 1, D, Dv),
            out=out_HRV, out_strides=(Dv, R * Dv, 0), table=self.tables_RC, block_size=k_pool.shape[2])
        return out_HRV if q_HND.dtype == torch.float32 else out_HRV.to(q_HND.dtype)


# Decode rows whose contexts are all under 2 * this many tokens share one padded batch; longer contexts go to batches
# by power-of-two size class, so padding at most doubles the keys a row reads there (for short contexts another round
# of kernel launches costs more than the padding).
DECODE_BATCH_MIN_TOKENS = 1024
# A decode batch gathers at most about this many bytes of keys (and as many of values) per layer, so the gathered
# blocks are still in cache when the matmuls read them (measured on CPU, 16 prompts x 8 samples: 4 MB beat both one
# batch for the whole step, 8-16 MB, and 0.25-1 MB batches).
DECODE_BATCH_BYTES = 4 << 20


@dataclass(frozen=True)
class DecodeBatch:
    """Decode rows attended together in one padded layout of two parts. Prefix: the full blocks that every row of a
    prefix group holds in common (the n samples of a prompt share the prompt's blocks), gathered once per group
    and padded to Cp blocks over the P groups; a group's rows are queries of one matmul against them (a group of
    one holds all its full blocks here). Suffix: each row's remaining blocks, padded to Cs blocks over the R rows.
    Everything here is built on the host once per step and serves every layer."""

    rows: torch.Tensor  # int64 [R] rows in the packed tokens, group after group
    all_rows: bool  # rows == 0 .. N - 1: the step is this batch alone, in order
    num_groups: int  # P
    group_size: int  # B: rows of the largest group (smaller groups are padded with empty query slots)
    slots: torch.Tensor | None  # int64 [R] each row's slot in [P * B]; None when every group has B rows
    prefix_blocks: torch.Tensor  # int64 [P * Cp]
    suffix_blocks: torch.Tensor  # int64 [R * Cs]
    bias_R1L: torch.Tensor  # [R, 1, (Cp + Cs) * BS] 0 where a row may look, -inf elsewhere (prefix, then suffix)


def _decode_batches(decodes: list[SeqSpan], bs: int, num_tokens: int, dtype: torch.dtype, device,
                    block_bytes: int, budget: int) -> list[DecodeBatch]:
    """The step's decode rows in batches (_grouped_chunks, at most budget bytes of keys each)."""
    return [_decode_batch_layout(chunk, bs, num_tokens, dtype, device)
            for chunk in _grouped_chunks(decodes, bs, block_bytes, budget)]


_Member = tuple[list[SeqSpan], list[int]]  # a prefix group and the blocks all its rows share


def _grouped_chunks(decodes: list[SeqSpan], bs: int, block_bytes: int, budget: int) -> list[list[_Member]]:
    """Rows forked from one sequence form a prefix group (they start with the same block); groups go by context
    size class (DECODE_BATCH_MIN_TOKENS), then in order into chunks
    whose gathered keys stay under budget bytes (block_bytes: one block's keys over every head; a group larger than
    the budget is a chunk alone)."""
    groups: dict[int, list[SeqSpan]] = {}
    for s in decodes:
        groups.setdefault(s.block_table[0], []).append(s)
    by_size: dict[int, list[_Member]] = {}
    for group in groups.values():
        size_class = max(max(s.num_computed + 1 for s in group), DECODE_BATCH_MIN_TOKENS).bit_length()
        by_size.setdefault(size_class, []).append((group, _common_prefix(group, bs)))
    chunks = []
    for members in by_size.values():
        chunk, chunk_bytes = [], 0
        for group, shared in members:
            nbytes = block_bytes * (len(shared) + sum(-(-(s.num_computed + 1) // bs) - len(shared) for s in group))
            if chunk and chunk_bytes + nbytes > budget:
                chunks.append(chunk)
                chunk, chunk_bytes = [], 0
            chunk.append((group, shared))
            chunk_bytes += nbytes
        chunks.append(chunk)
    return chunks


def _common_prefix(group: list[SeqSpan], bs: int) -> list[int]:
    """The leading blocks every sequence of the group holds, limited to blocks full in all of them."""
    limit = min(s.num_computed + 1 for s in group) // bs
    first = group[0].block_table
    common = 0
    while common < limit and all(s.block_table[common] == first[common] for s in group):
        common += 1
    return first[:common]


def _decode_batch_layout(members: list[tuple[list[SeqSpan], list[int]]], bs: int, num_tokens: int,
                         dtype: torch.dtype, device) -> DecodeBatch:
    groups, prefixes = [g for g, _ in members], [p for _, p in members]
    B = max(len(g) for g in groups)
    Cp = max(len(p) for p in prefixes)
    rows, slots, suffixes, suffix_lens = [], [], [], []
    for gi, (group, prefix) in enumerate(zip(groups, prefixes)):
        for j, s in enumerate(group):
            rows.append(s.start)
            slots.append(gi * B + j)
            suffixes.append(s.block_table[len(prefix):-(-(s.num_computed + 1) // bs)])
            suffix_lens.append(s.num_computed + 1 - len(prefix) * bs)
    Cs = max(len(x) for x in suffixes)
    pad_block = groups[0][0].block_table[0]  # any block in use (finite, see the docstring): padding is masked
    Lp, Ls = Cp * bs, Cs * bs
    prefix_lens = [len(p) * bs for p in prefixes]
    group_of_row = [gi for gi, g in enumerate(groups) for _ in g]
    masked_RL = torch.cat([torch.arange(Lp)[None, :] >= torch.tensor([prefix_lens[g] for g in group_of_row])[:, None],
                           torch.arange(Ls)[None, :] >= torch.tensor(suffix_lens)[:, None]], dim=1)
    bias_RL = torch.zeros(masked_RL.shape, dtype=dtype).masked_fill_(masked_RL, float("-inf"))
    tensor = lambda x: torch.tensor(x, dtype=torch.int64, device=device)
    return DecodeBatch(
        rows=tensor(rows), all_rows=rows == list(range(num_tokens)), num_groups=len(groups), group_size=B,
        slots=None if all(len(g) == B for g in groups) else tensor(slots),
        prefix_blocks=tensor([b for p in prefixes for b in p + [pad_block] * (Cp - len(p))]),
        suffix_blocks=tensor([b for x in suffixes for b in x + [pad_block] * (Cs - len(x))]),
        bias_R1L=bias_RL[:, None].to(device),
    )


def _decode_batch(q_HND: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, d: DecodeBatch,
                  scale: float, workspace: dict[str, torch.Tensor]) -> torch.Tensor:
    """softmax(q K^T * scale) V for the batch's one-token rows; [H, R, Dv]. Scores over the prefix (one matmul per
    group, its rows' queries together) and over each row's suffix are concatenated, masked (-inf added) where a row
    may not look, softmaxed in float32 as one row, and split again for the two value matmuls. Masked positions may
    hold another sequence's keys/values or zeros (never uninitialised memory: see the docstring), so their
    probabilities are exactly 0 and they add nothing."""
    K, Dk, Dv = k_pool.shape[0], k_pool.shape[3], v_pool.shape[3]
    H, R, P, B = q_HND.shape[0], d.rows.numel(), d.num_groups, d.group_size
    G = H // K
    q_HRD = q_HND if d.all_rows else q_HND.index_select(1, d.rows)
    q_KRGD = q_HRD.view(K, G, R, Dk).transpose(1, 2)
    Lp = d.prefix_blocks.numel() // P * k_pool.shape[2]
    Ls = d.suffix_blocks.numel() // R * k_pool.shape[2]
    scores = []
    if Lp:
        k_KPLD = _gather_into(workspace, "k_prefix", k_pool, d.prefix_blocks).view(K, P, Lp, Dk)
        q_KPQD = _to_groups(q_KRGD, d, P, B).view(K, P, B * G, Dk)
        scores_KPQL = torch.matmul(q_KPQD, k_KPLD.transpose(-1, -2))
        scores.append(_from_groups(scores_KPQL.view(K, P * B, G, Lp), d))
    if Ls:
        k_KRLD = _gather_into(workspace, "k_suffix", k_pool, d.suffix_blocks).view(K, R, Ls, Dk)
        scores.append(torch.matmul(q_KRGD, k_KRLD.transpose(-1, -2)))
    scores_KRGL = torch.cat(scores, dim=-1) if len(scores) > 1 else scores[0]
    scores_KRGL = torch.add(d.bias_R1L, scores_KRGL, alpha=scale)
    probs_KRGL = scores_KRGL.softmax(dim=-1, dtype=torch.float32).to(q_HND.dtype)
    out_KRGD = None
    if Ls:
        v_KRLD = _gather_into(workspace, "v_suffix", v_pool, d.suffix_blocks)
        out_KRGD = torch.matmul(probs_KRGL[..., Lp:], v_KRLD.view(K, R, Ls, Dv))
    if Lp:
        v_KPLD = _gather_into(workspace, "v_prefix", v_pool, d.prefix_blocks)
        probs_KPQL = _to_groups(probs_KRGL[..., :Lp], d, P, B).view(K, P, B * G, Lp)
        prefix_KRGD = _from_groups(torch.matmul(probs_KPQL, v_KPLD.view(K, P, Lp, Dv)).view(K, P * B, G, Dv), d)
        out_KRGD = prefix_KRGD if out_KRGD is None else out_KRGD.add_(prefix_KRGD)
    return out_KRGD.transpose(1, 2).reshape(H, R, Dv)


def _gather_into(workspace: dict[str, torch.Tensor], name: str, pool: torch.Tensor,
                 blocks: torch.Tensor) -> torch.Tensor:
    """pool[:, blocks] ([K, n, BS, D]) written into a buffer kept across layers and steps: a fresh multi-MB tensor per
    gather costs page faults, and a reused one is still in cache when the matmul reads it."""
    K, _, BS, D = pool.shape
    numel = K * blocks.numel() * BS * D
    buffer = workspace.get(name)
    if buffer is None or buffer.numel() < numel or buffer.dtype != pool.dtype:
        buffer = workspace[name] = pool.new_empty(numel)
    return torch.index_select(pool, 1, blocks, out=buffer[:numel].view(K, -1, BS, D))


def _to_groups(x_KRGX: torch.Tensor, d: DecodeBatch, P: int, B: int) -> torch.Tensor:
    """[K, R, G, X] rows -> [K, P * B, G, X] group slots (empty slots zero)."""
    if d.slots is None:
        return x_KRGX.contiguous()
    K, _, G, X = x_KRGX.shape
    return x_KRGX.new_zeros(K, P * B, G, X).index_copy_(1, d.slots, x_KRGX)


def _from_groups(x_KSGX: torch.Tensor, d: DecodeBatch) -> torch.Tensor:
    """[K, P * B, G, X] group slots -> [K, R, G, X] rows."""
    return x_KSGX if d.slots is None else x_KSGX.index_select(1, d.slots)
