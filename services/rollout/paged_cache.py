"""The cache a model forward sees during one engine step: packed tokens of many sequences over the paged KV pool.

Shapes: N tokens of the step packed in one row ([1, N]), H query heads, K cached heads (G = H / K per group),
S a sequence's context (cached + new), D / Dv key / value head dims, NB blocks in the pool, BS block size; in a decode
batch R rows, P prefix groups of at most B rows, L keys, C query rows of a GEMM, I GEMM items.

The model calls `attend(layer, q, k, v, scale=)` in every attention layer (the contract of models/kv_cache.py). Here
it writes the step's new keys/values into their slots of the pool, then attends each sequence's queries to exactly
its own context, read through its block table:
- a prefill chunk (T > 1 new tokens at q_offset = tokens cached before): one kernels.attention call per sequence
  over its gathered context, causal from q_offset;
- decode rows (one new token each), fast path: rows forked from one sequence (the n samples of a prompt) form a prefix
  group whose shared full blocks are gathered once and read by one matmul with all the group's queries; each row's
  remaining blocks are gathered per row. Groups go into padded batches (contexts under 2 * DECODE_BATCH_MIN_TOKENS
  together, longer ones by power-of-two size class, at most DECODE_BATCH_BYTES of keys per batch so the gathered
  blocks are still in cache for the matmuls), scores masked by adding -inf and softmaxed in float32, the gathers
  written into buffers reused across layers and steps. Masked positions may hold another sequence's data, so every
  block is zeroed when a step first writes into it: no slot in use ever holds uninitialised memory (a NaN there
  would poison the masked sums);
- decode rows in deterministic mode: the same prefix groups and batches, through _invariant_decode_batch, which
  carries out kernels.batch_invariant's attention arithmetic (what kernels.attention runs under
  batch_invariant_mode(), for a prefill as for a decode) on this layout: every value a row's output is made of comes
  from the same float32 operation on the same operands as when the row is computed alone or as a position of a
  prefill, and key blocks a row does not see add exact zeros. So a position's result depends neither on the other
  rows of the step nor on whether it came from a prefill or a decode, and it is bitwise the trainer's. One batched
  computation per batch, whatever the rows' context lengths.

The models read `length` (the position of the first new token) and `max_len` only for default positions and an
overflow check; the engine always passes explicit positions, so length is 0 here and max_len the pool's capacity.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kernels import attention
from kernels.batch_invariant import KEY_BLOCK, MIN_ROWS, query_rows, suspend_mode
from services.rollout.kv_blocks import KVPool


@dataclass(frozen=True)
class _Prefill:
    start: int  # first row in the packed tokens
    num_new: int
    q_offset: int  # tokens of this sequence cached before the step
    blocks: torch.Tensor  # int64 [ceil(S / BS)]


@dataclass(frozen=True)
class SeqSpan:
    """One sequence of the step: rows start .. start + num_new - 1 at positions num_computed .. ."""

    start: int
    num_new: int
    num_computed: int
    block_table: list[int]


class PagedStepCache:
    length = 0

    def __init__(self, pool: KVPool, spans: list[SeqSpan], *, deterministic: bool,
                 workspace: dict[str, torch.Tensor] | None = None):
        self.pool = pool
        self.workspace = {} if workspace is None else workspace
        self.max_len = pool.num_blocks * pool.block_size
        device, bs = pool.k.device, pool.block_size
        slots: list[int] = []
        for s in spans:
            table = s.block_table
            slots += [table[p // bs] * bs + p % bs for p in range(s.num_computed, s.num_computed + s.num_new)]
        self.slots_N = torch.tensor(slots, dtype=torch.int64, device=device)
        self.prefills: list[_Prefill] = []
        decodes: list[SeqSpan] = []
        self.deterministic = deterministic
        for s in spans:
            if s.num_new == 1:
                decodes.append(s)
            else:
                context = s.num_computed + s.num_new
                blocks = torch.tensor(s.block_table[: -(-context // bs)], dtype=torch.int64, device=device)
                self.prefills.append(_Prefill(s.start, s.num_new, s.num_computed, blocks))
        self.decode_batches: list[_DecodeBatch] = []
        self.invariant_batches: list[_InvariantBatch] = []
        self.decode_rows: torch.Tensor | None = None  # deterministic mode: the batches' rows, in batch order
        # Blocks this step starts writing (a write at their first slot): zeroed before the write, so every slot of a
        # block in use holds a sequence's key/value or zero, never uninitialised memory. Both decode paths rely on
        # it: they read whole blocks, mask scores with -inf and multiply values by probabilities of exactly 0, which a
        # NaN in a slot past a row's context would poison.
        fresh = [s.block_table[p // bs] for s in spans
                 for p in range(-(-s.num_computed // bs) * bs, s.num_computed + s.num_new, bs)]
        self.fresh_blocks = torch.tensor(fresh, dtype=torch.int64, device=device) if fresh else None
        if decodes and deterministic:
            self.invariant_batches = _invariant_batches(decodes, bs, device, pool.k[0, :, 0].numel() * 4)
            rows = [r for b in self.invariant_batches for r in b.rows.tolist()]
            # None: the decode rows are the step's rows 0 .. N - 1, in batch order
            self.decode_rows = None if rows == list(range(len(slots))) else torch.tensor(
                rows, dtype=torch.int64, device=device)
        elif decodes:
            block_bytes = pool.k[0, :, 0].numel() * pool.k.element_size()
            self.decode_batches = _decode_batches(decodes, bs, len(slots), pool.k.dtype, device, block_bytes)

    def attend(
        self, layer: int, q_1HND: torch.Tensor, k_1KND: torch.Tensor, v_1KND: torch.Tensor, *,
        scale: float | None = None,
    ) -> torch.Tensor:
        k_pool, v_pool = self.pool.k[layer], self.pool.v[layer]  # [K, NB, BS, D]
        K, Dk, Dv = k_pool.shape[0], k_pool.shape[3], v_pool.shape[3]
        if self.fresh_blocks is not None:
            k_pool.index_fill_(1, self.fresh_blocks, 0)
            v_pool.index_fill_(1, self.fresh_blocks, 0)
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
        if self.invariant_batches:
            with suspend_mode():  # lays out batch_invariant's attention arithmetic itself: _invariant_decode_batch
                out_HRD = self._invariant_decodes(q_1HND[0], k_pool, v_pool,
                                                  1.0 / math.sqrt(Dk) if scale is None else scale)
            if self.decode_rows is None:
                return out_HRD[None]
            out_HND.index_copy_(1, self.decode_rows, out_HRD)
        for d in self.decode_batches:
            out_HRD = _decode_batch(q_1HND[0], k_pool, v_pool, d, 1.0 / math.sqrt(Dk) if scale is None else scale,
                                    self.workspace)
            if d.all_rows:
                return out_HRD[None]
            out_HND.index_copy_(1, d.rows, out_HRD)
        return out_HND[None]

    def _invariant_decodes(self, q_HND: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                           scale: float) -> torch.Tensor:
        """Every decode row of the step, batch after batch; [H, R, Dv] in q's dtype, rows in batch order. The
        queries are selected and upcast once for all batches; each batch writes its rows of one float32 output."""
        q_HRD = q_HND if self.decode_rows is None else q_HND.index_select(1, self.decode_rows)
        q_HRD = q_HRD.to(torch.float32)
        out_HRV = q_HRD.new_empty(q_HRD.shape[0], q_HRD.shape[1], v_pool.shape[3])
        start = 0
        for d in self.invariant_batches:
            rows = slice(start, start + d.rows.numel())
            _invariant_decode_batch(q_HRD[:, rows], k_pool, v_pool, d, scale, self.workspace, out_HRV[:, rows])
            start = rows.stop
        return out_HRV.to(q_HND.dtype)


# Decode rows whose contexts are all under 2 * this many tokens share one padded batch; longer contexts go to batches
# by power-of-two size class, so padding at most doubles the keys a row reads there (for short contexts another round
# of kernel launches costs more than the padding).
DECODE_BATCH_MIN_TOKENS = 1024
# A decode batch gathers at most about this many bytes of keys (and as many of values) per layer, so the gathered
# blocks are still in cache when the matmuls read them (measured on CPU, 16 prompts x 8 samples: 4 MB beat both one
# batch for the whole step, 8-16 MB, and 0.25-1 MB batches).
DECODE_BATCH_BYTES = 4 << 20


@dataclass(frozen=True)
class _DecodeBatch:
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
                    block_bytes: int) -> list[_DecodeBatch]:
    """The step's decode rows in batches (_grouped_chunks, at most DECODE_BATCH_BYTES of keys each)."""
    return [_decode_batch_layout(chunk, bs, num_tokens, dtype, device)
            for chunk in _grouped_chunks(decodes, bs, block_bytes, DECODE_BATCH_BYTES)]


_Member = tuple[list[SeqSpan], list[int]]  # a prefix group and the blocks all its rows share


def _grouped_chunks(decodes: list[SeqSpan], bs: int, block_bytes: int, budget: int,
                    sort_key=None) -> list[list[_Member]]:
    """Rows forked from one sequence form a prefix group (they start with the same block); groups go by context
    size class (DECODE_BATCH_MIN_TOKENS), optionally sorted within a class by sort_key, then in order into chunks
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
        if sort_key is not None:
            members.sort(key=sort_key)
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
                         dtype: torch.dtype, device) -> _DecodeBatch:
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
    pad_block = groups[0][0].block_table[0]  # any block in use (finite, see fresh_blocks): padding is masked
    Lp, Ls = Cp * bs, Cs * bs
    prefix_lens = [len(p) * bs for p in prefixes]
    group_of_row = [gi for gi, g in enumerate(groups) for _ in g]
    masked_RL = torch.cat([torch.arange(Lp)[None, :] >= torch.tensor([prefix_lens[g] for g in group_of_row])[:, None],
                           torch.arange(Ls)[None, :] >= torch.tensor(suffix_lens)[:, None]], dim=1)
    bias_RL = torch.zeros(masked_RL.shape, dtype=dtype).masked_fill_(masked_RL, float("-inf"))
    tensor = lambda x: torch.tensor(x, dtype=torch.int64, device=device)  # noqa: E731
    return _DecodeBatch(
        rows=tensor(rows), all_rows=rows == list(range(num_tokens)), num_groups=len(groups), group_size=B,
        slots=None if all(len(g) == B for g in groups) else tensor(slots),
        prefix_blocks=tensor([b for p in prefixes for b in p + [pad_block] * (Cp - len(p))]),
        suffix_blocks=tensor([b for x in suffixes for b in x + [pad_block] * (Cs - len(x))]),
        bias_R1L=bias_RL[:, None].to(device),
    )


def _decode_batch(q_HND: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, d: _DecodeBatch,
                  scale: float, workspace: dict[str, torch.Tensor]) -> torch.Tensor:
    """softmax(q K^T * scale) V for the batch's one-token rows; [H, R, Dv]. Scores over the prefix (one matmul per
    group, its rows' queries together) and over each row's suffix are concatenated, masked (-inf added) where a row
    may not look, softmaxed in float32 as one row, and split again for the two value matmuls. Masked positions may
    hold another sequence's keys/values or zeros (never uninitialised memory: see fresh_blocks), so their
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


def _to_groups(x_KRGX: torch.Tensor, d: _DecodeBatch, P: int, B: int) -> torch.Tensor:
    """[K, R, G, X] rows -> [K, P * B, G, X] group slots (empty slots zero)."""
    if d.slots is None:
        return x_KRGX.contiguous()
    K, _, G, X = x_KRGX.shape
    return x_KRGX.new_zeros(K, P * B, G, X).index_copy_(1, d.slots, x_KRGX)


def _from_groups(x_KSGX: torch.Tensor, d: _DecodeBatch) -> torch.Tensor:
    """[K, P * B, G, X] group slots -> [K, R, G, X] rows."""
    return x_KSGX if d.slots is None else x_KSGX.index_select(1, d.slots)


# ------------------------------------------------------------------------------------------- deterministic decode

# A deterministic decode batch gathers at most about this many bytes of keys per layer, counted in float32 (what
# it computes in). Smaller than the fast path's budget: the float32 copies of keys and values must still be in
# cache when the GEMMs read them (measured on the CPU box, bench/rollout.py's workload, 1 thread: 0.75 to 2 MB within
# noise of each other, 0.5 MB 1.15x and 4 MB 1.7x as long as 1 MB).
INVARIANT_DECODE_BATCH_BYTES = 1 << 20


@dataclass(frozen=True)
class _InvariantBatch:
    """Decode rows that _invariant_decode_batch attends together, in prefix groups as for _DecodeBatch (rows forked
    from one sequence share its full blocks). A row's keys are split twice:
    - for the scores: the group's shared full blocks (padded to Cg blocks over the P groups), scored once for all
      the group's rows, then the row's own blocks (padded to Cr over the R rows);
    - for P V, which goes by whole KEY_BLOCKs of the row's positions: the group's shared blocks cut to whole key
      blocks (padded to Cq), then the row's blocks from there on (padded to Cv, whole key blocks). A row's
      probabilities for these come from the group's scores below the group's shared length and from its own above
      (pv_index_R1L).
    Every key count on a GEMM's column side is at least MIN_ROWS. Built on the host once per step; serves every
    layer."""

    rows: torch.Tensor  # int64 [R] rows in the packed tokens, group after group
    num_groups: int  # P
    group_size: int  # B: rows of the largest group (smaller groups are padded with empty query slots)
    slots: torch.Tensor | None  # int64 [R] each row's slot in [P * B]; None when every group has B rows
    score_prefix_blocks: torch.Tensor  # int64 [P * Cg]
    score_suffix_blocks: torch.Tensor  # int64 [R * Cr]
    pv_prefix_blocks: torch.Tensor  # int64 [P * Cq]
    pv_suffix_blocks: torch.Tensor  # int64 [R * Cv'], Cv' <= Cv: up to the last key some row sees (pv_last_keys)
    prefix_bias_P1L: torch.Tensor  # float32 [P, 1, Cg * BS]: 0 where the group's rows may look, -inf elsewhere
    suffix_bias_R1L: torch.Tensor  # float32 [R, 1, Cr * BS]
    pv_prefix_keep_P1L: torch.Tensor  # float32 [P, 1, Cq * BS]: 1 on the group's own whole key blocks, else 0
    # int64 [R, 1, Cv * BS]: where the probability of each P V suffix position is in a row's
    # [group scores (Cg * BS) | own scores (Cr * BS) | one zero]
    pv_index_R1L: torch.Tensor
    # The P V suffix key blocks that some row sees, and the keys of the last of them that some row sees, rounded up
    # to 16: the GEMMs read only these (the rest have probability 0 in every row, and a GEMM over 16, 32 or 48 keys
    # gives the bits of the same GEMM over KEY_BLOCK keys with zeros after them: measured,
    # tests/unit/rollout/test_rollout_deterministic_decode.py), so pv_suffix_blocks hold only the blocks up to there.
    pv_key_blocks: int
    pv_last_keys: int


def _invariant_batches(decodes: list[SeqSpan], bs: int, device, block_bytes: int) -> list[_InvariantBatch]:
    """The step's decode rows in batches (_grouped_chunks, at most INVARIANT_DECODE_BATCH_BYTES of float32 keys
    each), groups sorted within a size class by the key blocks their rows hold past the shared ones (less padding in
    a batch)."""
    unit = math.lcm(bs, KEY_BLOCK) // bs  # pool blocks per whole number of key blocks

    def own_units(member: _Member) -> tuple[int, int]:
        group, shared = member
        start = (len(shared) - len(shared) % unit) * bs
        return max(-(-(s.num_computed + 1 - start) // (unit * bs)) for s in group), len(shared)

    return [_invariant_batch_layout(chunk, bs, unit, device)
            for chunk in _grouped_chunks(decodes, bs, block_bytes, INVARIANT_DECODE_BATCH_BYTES, own_units)]


def _invariant_batch_layout(members: list[tuple[list[SeqSpan], list[int]]], bs: int, unit: int,
                            device) -> _InvariantBatch:
    groups, shared = [g for g, _ in members], [sh for _, sh in members]
    P, B = len(groups), max(len(g) for g in groups)
    min_blocks = -(-MIN_ROWS // bs)
    pv_shared = [len(sh) - len(sh) % unit for sh in shared]  # the shared blocks in whole key blocks
    rows, slots, own, own_lens, pv_own, pv_starts, shared_lens, contexts = [], [], [], [], [], [], [], []
    for gi, group in enumerate(groups):
        for j, s in enumerate(group):
            blocks = -(-(s.num_computed + 1) // bs)
            rows.append(s.start)
            slots.append(gi * B + j)
            own.append(s.block_table[len(shared[gi]):blocks])
            own_lens.append(s.num_computed + 1 - len(shared[gi]) * bs)
            pv_own.append(s.block_table[pv_shared[gi]:blocks])
            pv_starts.append(pv_shared[gi] * bs)
            shared_lens.append(len(shared[gi]) * bs)
            contexts.append(s.num_computed + 1)
    Cg = max(len(sh) for sh in shared)
    Cg = max(Cg, min_blocks) if Cg else 0
    Cr = max(len(x) for x in own)
    Cr = max(Cr, min_blocks) if Cr else 0
    Cq = max(pv_shared)
    Cv = -(-max(len(x) for x in pv_own) // unit) * unit
    Lg, Lr, Lq, Lv = Cg * bs, Cr * bs, Cq * bs, Cv * bs
    seen = max(c - start for c, start in zip(contexts, pv_starts))
    key_blocks = -(-seen // KEY_BLOCK)
    last_keys = -(-(seen - (key_blocks - 1) * KEY_BLOCK) // 16) * 16 if key_blocks else 0
    Cv_read = -(-((key_blocks - 1) * KEY_BLOCK + last_keys) // bs) if key_blocks else 0
    positions_RL = torch.tensor(pv_starts)[:, None] + torch.arange(Lv)[None, :]
    shared_R1, contexts_R1 = torch.tensor(shared_lens)[:, None], torch.tensor(contexts)[:, None]
    pv_index_RL = torch.where(positions_RL < shared_R1, positions_RL,
                              torch.where(positions_RL < contexts_R1, Lg + positions_RL - shared_R1, Lg + Lr))
    pad_block = groups[0][0].block_table[0]  # any block in use (finite, see fresh_blocks): padding is masked
    tensor = lambda x: torch.tensor(x, dtype=torch.int64, device=device)  # noqa: E731
    padded = lambda lists, n: tensor([b for x in lists for b in x + [pad_block] * (n - len(x))])  # noqa: E731

    def bias(lengths: list[int], width: int) -> torch.Tensor:
        masked = torch.arange(width)[None, :] >= torch.tensor(lengths)[:, None]
        return torch.zeros(masked.shape).masked_fill_(masked, float("-inf"))[:, None].to(device)

    keep = torch.arange(Lq)[None, :] < torch.tensor([q * bs for q in pv_shared])[:, None]
    return _InvariantBatch(
        rows=tensor(rows), num_groups=P, group_size=B,
        slots=None if all(len(g) == B for g in groups) else tensor(slots),
        score_prefix_blocks=padded(shared, Cg), score_suffix_blocks=padded(own, Cr),
        pv_prefix_blocks=padded([sh[:q] for sh, q in zip(shared, pv_shared)], Cq),
        pv_suffix_blocks=padded([x[:Cv_read] for x in pv_own], Cv_read), pv_key_blocks=key_blocks,
        pv_last_keys=last_keys,
        prefix_bias_P1L=bias([len(sh) * bs for sh in shared], Lg), suffix_bias_R1L=bias(own_lens, Lr),
        pv_prefix_keep_P1L=keep.to(torch.float32)[:, None].to(device),
        pv_index_R1L=pv_index_RL[:, None].to(device),
    )


def _invariant_decode_batch(q_HRD: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, d: _InvariantBatch,
                            scale: float, workspace: dict[str, torch.Tensor], out_HRV: torch.Tensor) -> None:
    """The batch's one-token rows through kernels.batch_invariant's attention arithmetic, all rows at once: q_HRD
    the batch's queries in float32 [H, R, D], written to out_HRV ([H, R, Dv], float32).

    Per row, each value below comes from the same operation on the same operands as in the kernel's _attention_tile
    (for a lone decode row, or for the row's position in a prefill), so the bits are those: everything in float32;
    a score as an element of bmm(queries [query_rows(n), D], keys^T [D, >= MIN_ROWS]) (it depends neither on how
    many other keys or queries share the GEMM, nor on where they sit in it: measured, see query_rows), times scale;
    -inf where a row may not look; the row max (exact in any order: here the larger of the shared keys' and the
    row's own) and exp; then per KEY_BLOCK keys of the row, in increasing order, a contiguous row sum of the
    probabilities and bmm(probabilities [query_rows(n), KEY_BLOCK], values [KEY_BLOCK, >= MIN_ROWS]),
    accumulated block after block; out / denominator. A key block that a row cannot see (padding to the batch's
    longest) has probabilities exactly 0 and adds exact zeros, as the key blocks past the last key a prefill row
    sees do.

    Shared keys are read once per group, all the group's (row, head) pairs the query rows of one GEMM; a row's own
    keys have its G heads as query rows, padded to query_rows(G). Runs with the mode suspended: the GEMMs here are
    already in the invariant form."""
    K, BS, Dk, Dv = k_pool.shape[0], k_pool.shape[2], k_pool.shape[3], v_pool.shape[3]
    H, R, P, B = q_HRD.shape[0], d.rows.numel(), d.num_groups, d.group_size
    G, KB = H // K, KEY_BLOCK
    Lg, Lr = d.score_prefix_blocks.numel() // P * BS, d.score_suffix_blocks.numel() // R * BS
    Lq, Lv = d.pv_prefix_blocks.numel() // P * BS, d.pv_index_R1L.shape[-1]
    Cp, Cs = query_rows(B * G), query_rows(G)
    q_KRGD = q_HRD.view(K, G, R, Dk).transpose(1, 2)
    # Scores and each row's max: shared keys in group layout [K, P, Cp, Lg], own keys in row layout [K, R, G, Lr].
    dense = d.slots is None and Cp == B * G  # group slots are the rows in order, no padding query rows
    max_KRG = None
    if Lg:
        if dense:
            q_KPCD = q_KRGD.reshape(K, P, Cp, Dk)
        else:
            q_KPCD = q_HRD.new_zeros(K, P, Cp, Dk)
            _into_groups(q_KPCD[:, :, :B * G], q_KRGD, d)
        k_ILD = _gather_f32(workspace, "k_prefix", k_pool, d.score_prefix_blocks).view(K * P, Lg, Dk)
        s_KPCL = torch.bmm(q_KPCD.reshape(K * P, Cp, Dk), k_ILD.transpose(1, 2)).view(K, P, Cp, Lg)
        s_KPCL = torch.add(d.prefix_bias_P1L, s_KPCL, alpha=scale)  # scores * scale + (0 or -inf), bitwise
        if dense:
            max_KRG = s_KPCL.amax(dim=-1).view(K, R, G)
        else:
            max_KRG = _from_groups(s_KPCL[:, :, :B * G].amax(dim=-1).view(K, P * B, G, 1), d)[..., 0]
    if Lr:
        q_KRCD = q_HRD.new_zeros(K, R, Cs, Dk)
        q_KRCD[:, :, :G] = q_KRGD
        k_ILD = _gather_f32(workspace, "k_suffix", k_pool, d.score_suffix_blocks).view(K * R, Lr, Dk)
        s_KRCL = torch.bmm(q_KRCD.view(K * R, Cs, Dk), k_ILD.transpose(1, 2)).view(K, R, Cs, Lr)
        s_KRGL = torch.add(d.suffix_bias_R1L, s_KRCL[:, :, :G], alpha=scale)
        own_max_KRG = s_KRGL.amax(dim=-1)
        max_KRG = own_max_KRG if max_KRG is None else torch.maximum(max_KRG, own_max_KRG)
    max_KRG = max_KRG.clamp(min=torch.finfo(torch.float32).min)  # as the kernel: a row that sees nothing gets 0s
    # Probabilities; a row's [shared | own | 0] in one tensor for the P V suffix positions to index.
    parts = []
    if Lg:
        if dense:
            max_KPC1 = max_KRG.view(K, P, Cp, 1)
        else:
            max_KPC1 = q_HRD.new_zeros(K, P, Cp, 1)
            _into_groups(max_KPC1[:, :, :B * G], max_KRG[..., None], d)
        p_KPCL = s_KPCL.sub_(max_KPC1).exp_()
        parts.append(p_KPCL.view(K, R, G, Lg) if dense else
                     _from_groups(p_KPCL[:, :, :B * G].reshape(K, P * B, G, Lg), d))
    if Lr:
        parts.append(s_KRGL.sub_(max_KRG[..., None]).exp_())
    # P V and the denominators over whole key blocks: the group's shared ones, then each row's.
    sums, out_KRGV = [], None
    if Lq:
        p_KPCQ = p_KPCL[..., :Lq] * d.pv_prefix_keep_P1L  # 0 past the group's own shared key blocks
        if Cp > B * G:
            p_KPCQ[:, :, B * G:] = 0
        sums.append(_from_groups(p_KPCQ[:, :, :B * G].reshape(K, P * B, G, Lq // KB, KB).sum(-1), d))
        v_ILV = _gather_f32(workspace, "v_prefix", v_pool, d.pv_prefix_blocks, pad_to=MIN_ROWS)
        v_ILV = v_ILV.view(K * P, Lq, v_ILV.shape[-1])
        acc_ICV = None
        for p_ICK, v_IKV in zip(p_KPCQ.view(K * P, Cp, Lq).split(KB, dim=-1), v_ILV.split(KB, dim=1)):
            block_ICV = torch.bmm(p_ICK, v_IKV)
            acc_ICV = block_ICV if acc_ICV is None else acc_ICV + block_ICV
        out_KRGV = _from_groups(acc_ICV.view(K, P, Cp, -1)[:, :, :B * G, :Dv].reshape(K, P * B, G, Dv), d)
    if Lv:
        parts.append(q_HRD.new_zeros(K, R, G, 1))
        p_all_KRGX = torch.cat(parts, dim=-1)
        p_KRGV = torch.gather(p_all_KRGX, -1, d.pv_index_R1L[None].expand(K, R, G, Lv))
        sums.append(p_KRGV.view(K, R, G, Lv // KB, KB).sum(-1))
        if Cs > G:
            p_KRCV = q_HRD.new_zeros(K, R, Cs, Lv)
            p_KRCV[:, :, :G] = p_KRGV
        else:
            p_KRCV = p_KRGV
        v_ILV = _gather_f32(workspace, "v_suffix", v_pool, d.pv_suffix_blocks, pad_to=MIN_ROWS)
        v_ILV = v_ILV.view(K * R, -1, v_ILV.shape[-1])
        # Key blocks past the last one some row sees have probability 0 in every row; the last is read up to
        # pv_last_keys. Accumulated in the GEMM's [K * R, Cs, Dv] layout, from the shared blocks' sum on.
        keys = (d.pv_key_blocks - 1) * KB + d.pv_last_keys if d.pv_key_blocks else 0
        acc_ICV = None
        if out_KRGV is not None:
            acc_ICV = v_ILV.new_zeros(K * R, Cs, v_ILV.shape[-1])
            acc_ICV.view(K, R, Cs, -1)[:, :, :G, :Dv] = out_KRGV
        for p_ICK, v_IKV in zip(p_KRCV.view(K * R, Cs, Lv)[:, :, :keys].split(KB, dim=-1),
                                v_ILV[:, :keys].split(KB, dim=1)):
            block_ICV = torch.bmm(p_ICK, v_IKV)
            acc_ICV = block_ICV if acc_ICV is None else acc_ICV + block_ICV
        if acc_ICV is not None:
            out_KRGV = acc_ICV.view(K, R, Cs, -1)[:, :, :G, :Dv]
    sums_KRGn = torch.cat(sums, dim=-1) if len(sums) > 1 else sums[0]
    denominator_KRG = None
    for block_sum_KRG in sums_KRGn.unbind(-1):
        denominator_KRG = block_sum_KRG if denominator_KRG is None else denominator_KRG + block_sum_KRG
    torch.div(out_KRGV, denominator_KRG[..., None], out=out_HRV.view(K, G, R, Dv).transpose(1, 2))


def _into_groups(dst_KPXY: torch.Tensor, x_KRGY: torch.Tensor, d: _InvariantBatch) -> None:
    """Rows [K, R, G, Y] written into group slots [K, P, B * G, Y] (slots of missing rows zero)."""
    K, P, _, Y = dst_KPXY.shape
    B, G = d.group_size, x_KRGY.shape[2]
    if d.slots is not None:
        x_KRGY = x_KRGY.new_zeros(K, P * B, G, Y).index_copy_(1, d.slots, x_KRGY)
    dst_KPXY.view(K, P, B, G, Y).copy_(x_KRGY.view(K, P, B, G, Y))


def _gather_f32(workspace: dict[str, torch.Tensor], name: str, pool: torch.Tensor, blocks: torch.Tensor,
                pad_to: int = 0) -> torch.Tensor:
    """_gather_into, upcast to float32 (exact) into a second reused buffer when the pool holds another dtype, and
    the last dim zero-padded to pad_to (value columns on a GEMM's column side)."""
    gathered = _gather_into(workspace, name, pool, blocks)
    D = gathered.shape[-1]
    if pool.dtype == torch.float32 and D >= pad_to:
        return gathered
    shape = (*gathered.shape[:-1], max(D, pad_to))
    numel = math.prod(shape)
    buffer = workspace.get(name + "_f32")
    if buffer is None or buffer.numel() < numel:
        buffer = workspace[name + "_f32"] = torch.empty(numel, dtype=torch.float32, device=pool.device)
    out = buffer[:numel].view(shape)
    if D >= pad_to:
        return out.copy_(gathered)
    out[..., D:] = 0
    out[..., :D] = gathered
    return out
