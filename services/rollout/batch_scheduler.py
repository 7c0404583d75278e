"""The batch scheduler: which sequences run in the next engine step, how many tokens each, and their KV blocks.

Plain Python, no tensors: it owns the waiting and running queues and the BlockAllocator; the runner does the work
it decides (services/rollout/engine_core.py wires the two).

A request starts as one prompt sequence. When its prompt is fully in the cache, the last prompt position's logits
are sampled n times and the prompt sequence forks into n sample sequences that share its blocks (`fork`), the
partial last block copied on first write. Each step (`schedule`):
1. Running sequences, oldest first: a decode step (1 token) or the next chunk of a prefill, within the token budget
   (max_num_batched_tokens) and the batch size (max_num_seqs). When blocks run out, the newest running sequence is
   preempted (recompute): it frees its blocks and goes back to the front of the waiting queue with its tokens
   (prompt + generated), to be prefilled again later; the oldest sequence is never preempted for a newer one, and
   any one request fits the pool alone (checked at add), so everything finishes and nothing is lost.
2. If nothing was preempted: waiting sequences in order (preempted ones first, then new requests FCFS), each
   admitted when its first chunk's blocks fit and the batch has room for its samples (a request with n samples
   counts n; one alone is admitted even when n exceeds max_num_seqs, and its samples then run max_num_seqs at a
   time).
When the allocator is shared (a KVArena: other engine cores hold some blocks), a step may schedule nothing: this
core's sequences were preempted or wait, holding no block, until the others return theirs.
A prefill longer than the remaining budget is split into chunks (chunked prefill); a chunk that does not reach the
end of a sequence's known tokens produces no sample.
"""
from __future__ import annotations

import enum
import itertools
from collections import deque
from dataclasses import dataclass, field

from services.rollout.kv_blocks import BlockAllocator


@dataclass(frozen=True)
class BatchSchedulerConfig:
    max_num_seqs: int = 256  # sequences in one step's batch
    max_num_batched_tokens: int = 2048  # tokens in one step's forward (prefill chunks + decodes)
    num_blocks: int = 4096  # KV blocks in the pool
    block_size: int = 16  # tokens per block


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    """The scheduler's view of a request: its prompt, how many samples, and the largest context it can reach."""

    request_id: str
    prompt_ids: list[int]
    n: int
    max_tokens: int

    @property
    def num_prompt(self) -> int:
        return len(self.prompt_ids)

    @property
    def max_context(self) -> int:
        return self.num_prompt + self.max_tokens - 1  # the last sampled token is never fed back


@dataclass(eq=False)
class Sequence:
    """Tokens whose keys/values are (to be) cached: token_ids[:num_computed] are in the blocks of block_table.
    sample_index None: a request's prompt sequence (before it forks into its samples)."""

    seq_id: int
    request: Request
    token_ids: list[int]
    sample_index: int | None = None
    num_computed: int = 0
    block_table: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    num_preemptions: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def is_prompt(self) -> bool:
        return self.sample_index is None


@dataclass(frozen=True)
class ScheduledSeq:
    seq: Sequence
    num_new: int  # feed token_ids[num_computed : num_computed + num_new]
    samples: bool  # the chunk ends at the last known token: its logits give the next token (n for a prompt)


@dataclass
class BatchSchedulerOutput:
    scheduled: list[ScheduledSeq]
    block_copies: list[tuple[int, int]]  # (source, destination) copy-on-write, before the forward
    preempted: list[Sequence]

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new for s in self.scheduled)


class BatchScheduler:
    def __init__(self, config: BatchSchedulerConfig, blocks: BlockAllocator | None = None):
        """blocks: the allocator, when it is shared with other schedulers (a KVArena); else a private one."""
        self.config = config
        self.blocks = blocks if blocks is not None else BlockAllocator(config.num_blocks, config.block_size)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._ids = itertools.count()
        self.num_preemptions = 0

    @property
    def capacity_tokens(self) -> int:
        return self.config.num_blocks * self.config.block_size

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, request: Request) -> Sequence:
        """Queue a request's prompt sequence. The caller checked that request.max_context fits the pool."""
        assert request.max_context <= self.capacity_tokens
        seq = Sequence(next(self._ids), request, list(request.prompt_ids))
        self.waiting.append(seq)
        return seq

    def schedule(self) -> BatchSchedulerOutput:
        budget, cfg = self.config.max_num_batched_tokens, self.config
        scheduled: list[ScheduledSeq] = []
        copies: list[tuple[int, int]] = []
        preempted: list[Sequence] = []
        i = 0
        while i < len(self.running) and budget > 0 and len(scheduled) < cfg.max_num_seqs:
            seq = self.running[i]
            num_new = min(seq.num_tokens - seq.num_computed, budget)
            while not self._try_append(seq, num_new, copies, scheduled):
                victim = self.running.pop()  # the newest; never one scheduled already (those are before i)
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
            else:
                budget -= num_new
                i += 1
        # A prompt sequence becomes n sample sequences: count them as such against the batch size.
        occupied = sum(seq.request.n if seq.is_prompt else 1 for seq in self.running)
        while self.waiting and not preempted and budget > 0 and len(scheduled) < cfg.max_num_seqs:
            seq = self.waiting[0]
            samples = seq.request.n if seq.is_prompt else 1
            if self.running and occupied + samples > cfg.max_num_seqs:
                break
            occupied += samples
            num_new = min(seq.num_tokens - seq.num_computed, budget)
            if not self._try_append(seq, num_new, copies, scheduled):
                break
            self.waiting.popleft()
            seq.status = Status.RUNNING
            self.running.append(seq)
            budget -= num_new
        return BatchSchedulerOutput(scheduled=scheduled, block_copies=copies, preempted=preempted)

    def _try_append(self, seq: Sequence, num_new: int, copies: list, scheduled: list) -> bool:
        """Take the blocks seq's next num_new tokens need and schedule it; False (nothing taken) if they are not
        free. One step of the allocator, which a KVArena shares with other engine cores."""
        ok, copy = self.blocks.try_append(seq.block_table, seq.num_computed, num_new)
        if not ok:
            return False
        if copy is not None:
            copies.append(copy)
        scheduled.append(ScheduledSeq(seq, num_new, samples=seq.num_computed + num_new == seq.num_tokens))
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.blocks.free(seq.block_table)
        seq.num_computed = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)

    # ---- updates from a step's results (the engine core calls these after execute) ------------------------------

    def advance(self, item: ScheduledSeq) -> None:
        item.seq.num_computed += item.num_new

    def fork(self, prompt: Sequence, first_tokens: list[int]) -> list[Sequence]:
        """Replace a prompt sequence whose prompt is cached by one sample sequence per first token; they share its
        blocks and take its place (and priority) in the running queue."""
        assert prompt.is_prompt and prompt.num_computed == prompt.num_tokens
        samples = []
        for index, token in enumerate(first_tokens):
            table = prompt.block_table if index == 0 else self.blocks.fork(prompt.block_table)
            samples.append(Sequence(next(self._ids), prompt.request, [*prompt.token_ids, token], sample_index=index,
                                    num_computed=prompt.num_computed, block_table=table, status=Status.RUNNING))
        at = self.running.index(prompt)
        self.running[at:at + 1] = samples
        prompt.block_table = []
        prompt.status = Status.FINISHED
        return samples

    def finish(self, seq: Sequence) -> None:
        """A sequence is done (stopped, or its request aborted): free its blocks and drop it from the queues."""
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
        elif seq.status is Status.WAITING:
            self.waiting.remove(seq)
        self.blocks.free(seq.block_table)
        seq.status = Status.FINISHED
