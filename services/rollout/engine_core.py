"""One base model's engine: requests in, a step at a time (schedule -> execute -> update), outputs out.

Single-threaded: services/rollout/engine.py runs `step` in a loop thread per base model and feeds requests to it;
tests drive it directly, which fixes arrival orders step by step.

- schedule: services/rollout/batch_scheduler.py decides the sequences and token counts of the step (a plain dataclass).
- execute: services/rollout/runner.py runs the forward over them and samples.
- update: tokens go to each sample's SequenceBuilder (text, stop strings, finish); a prompt that is fully cached forks
  into its n samples; finished sequences free their blocks; each request gets the step's output (RequestOutput:
  new tokens, text, logprobs per sample; the final one adds finish reasons, router ids and prompt logprobs).

Router ids and prompt logprobs are recorded once per position: a prefill repeated after preemption recomputes
positions that already have them and keeps the first values (bitwise the same in deterministic mode).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from models.moe import MoE
from services.common import metrics
from services.common.errors import InvalidArgument
from services.rollout.kv_blocks import KVArena, KVLayout, KVPool
from services.rollout.runner import ModelRunner, RowSample, StepBatch, StepRow
from services.rollout.sampling import SamplingParams, SequenceBuilder, sample_generators
from services.rollout.batch_scheduler import Request, ScheduledSeq, BatchScheduler, BatchSchedulerConfig, Sequence


@dataclass(frozen=True)
class EngineConfig:
    max_loaded_adapters: int = 8  # LoRA adapters holding weights at once (LRU; in-use ones are never evicted)
    dtype: torch.dtype = torch.float32
    device: str = "cpu"
    max_num_seqs: int = 256  # sequences in one step's batch
    max_num_batched_tokens: int = 2048  # tokens in one step's forward; longer prefills are chunked
    kv_block_size: int = 16  # tokens per KV block
    kv_cache_blocks: int | None = None  # blocks in each KV pool (one per layout); None: from kv_cache_mb
    kv_cache_mb: int = 1024  # memory of each KV pool when kv_cache_blocks is None
    deterministic: bool = False  # batch-invariant numerics (slower): a request's output never depends on the batch

    def num_blocks(self, layout: KVLayout) -> int:
        if self.kv_cache_blocks is not None:
            return self.kv_cache_blocks
        return max(1, self.kv_cache_mb * 2**20 // layout.bytes_per_block(self.kv_block_size, self.dtype))


@dataclass
class SequenceDelta:
    """What one sample gained in a step; finish_reason (and router_ids) are set in its last delta."""

    index: int
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    text: str = ""
    finish_reason: str = ""
    router_ids: torch.Tensor | None = None


@dataclass
class RequestOutput:
    request_id: str
    sequences: list[SequenceDelta] = field(default_factory=list)
    finished: bool = False
    prompt_logprobs: list[float] | None = None  # in the final output, when asked for
    error: BaseException | None = None  # the request failed (the engine step raised)


@dataclass(eq=False)
class _Sample:
    builder: SequenceBuilder
    generator: torch.Generator
    seq: Sequence | None = None
    router_chunks: list[torch.Tensor] = field(default_factory=list)  # positions num_prompt .. of this sample
    router_len: int = 0  # positions recorded, the prompt's included
    sent_tokens: int = 0
    sent_text: int = 0
    final_sent: bool = False


@dataclass(eq=False)
class _RequestState:
    request: Request
    params: SamplingParams
    adapter: str | None
    sink: Callable[[RequestOutput], None]
    prompt_seq: Sequence
    samples: list[_Sample]
    prompt_logprobs: list[float] = field(default_factory=list)
    prompt_router: list[torch.Tensor] = field(default_factory=list)
    prompt_router_len: int = 0
    forked: bool = False


def new_arena(layout: KVLayout, config: EngineConfig) -> KVArena:
    return KVArena(layout, config.num_blocks(layout), config.kv_block_size, config.dtype, config.device)


class EngineCore:
    def __init__(self, model: torch.nn.Module, tokenizer, config: EngineConfig, arena: KVArena | None = None):
        """arena: the KV blocks this core shares with others of the same layout (services/rollout/engine.py keeps
        one per layout); by default a pool of its own."""
        self.model, self.tokenizer, self.config = model, tokenizer, config
        layout = KVLayout.of(model.args)
        self.arena = arena if arena is not None else new_arena(layout, config)
        assert self.arena.layout == layout, (self.arena.layout, layout)
        self.scheduler = BatchScheduler(BatchSchedulerConfig(
            max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
            num_blocks=self.arena.num_blocks, block_size=config.kv_block_size), blocks=self.arena)
        self.runner = ModelRunner(model, self.arena, deterministic=config.deterministic)
        self.moe_layers = [int(i) for i, layer in model.model.layers.items() if isinstance(layer.mlp, MoE)]
        self._requests: dict[str, _RequestState] = {}
        self.num_steps = 0
        self.last_batch_size = 0  # sequences in the latest step

    # ---- requests ---------------------------------------------------------------------------------------------

    def check(self, prompt_len: int, params: SamplingParams) -> None:
        """InvalidArgument when a request can never run on this base model's engine."""
        if params.return_router_ids and not self.moe_layers:
            raise InvalidArgument("this model has no MoE layers, so there are no router ids to return",
                                  field="params.return_router_ids")
        capacity = self.scheduler.capacity_tokens
        if prompt_len + params.max_tokens - 1 > capacity:
            raise InvalidArgument(
                f"the prompt ({prompt_len} tokens) plus {params.max_tokens} tokens do not fit the KV cache of "
                f"{capacity} tokens (raise kv_cache_mb / kv_cache_blocks, or ask for fewer tokens)",
                field="params.max_tokens")

    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams, *,
                    stop_ids: set[int], sink: Callable[[RequestOutput], None], adapter: str | None = None) -> None:
        """Queue a request (validated by the caller, see check). sink receives its outputs, in order, from the
        thread that runs step()."""
        assert request_id not in self._requests, request_id
        self.check(len(prompt_ids), params)
        request = Request(request_id, list(prompt_ids), params.n, params.max_tokens)
        samples = [_Sample(SequenceBuilder(self.tokenizer, params, stop_ids), g)
                   for g in sample_generators(params.seed, params.n, self.config.device)]
        self._requests[request_id] = _RequestState(request, params, adapter, sink, self.scheduler.add(request),
                                                   samples)

    def abort(self, request_id: str) -> bool:
        state = self._requests.pop(request_id, None)
        if state is None:
            return False
        for seq in self._live_sequences(state):
            self.scheduler.finish(seq)
        return True

    def has_work(self) -> bool:
        return bool(self._requests)

    def fail_all(self, error: BaseException) -> None:
        """After a failed step: every request ends with the error and every block is freed."""
        for request_id, state in list(self._requests.items()):
            self.abort(request_id)
            state.sink(RequestOutput(request_id, finished=True, error=error))

    @staticmethod
    def _live_sequences(state: _RequestState) -> list[Sequence]:
        if not state.forked:
            return [state.prompt_seq]
        return [s.seq for s in state.samples if not s.builder.finished]

    # ---- the step ---------------------------------------------------------------------------------------------

    @property
    def pool(self) -> KVPool:
        return self.arena.pool

    def step(self) -> list[RequestOutput]:
        sched = self.scheduler.schedule()
        if not sched.scheduled:  # with work left: the shared arena's blocks are all held by other cores
            self.last_batch_size = 0
            return []
        batch = StepBatch([self._row(item) for item in sched.scheduled], sched.block_copies)
        results = self.runner.execute(batch)
        self.num_steps += 1
        self.last_batch_size = len(batch.rows)
        metrics.ENGINE_TOKENS.labels("prompt").inc(sum(i.num_new for i in sched.scheduled if i.seq.is_prompt))
        metrics.ENGINE_TOKENS.labels("generated").inc(
            sum(i.seq.request.n if i.seq.is_prompt else 1 for i in sched.scheduled if i.samples))
        touched: dict[str, _RequestState] = {}
        for item, result in zip(sched.scheduled, results):
            state = self._requests[item.seq.request.request_id]
            touched[state.request.request_id] = state
            self._update(state, item, result)
        outputs = [self._emit(state) for state in touched.values()]
        return [out for out in outputs if out is not None]

    def _row(self, item: ScheduledSeq) -> StepRow:
        seq, state = item.seq, self._requests[item.seq.request.request_id]
        start = seq.num_computed
        tokens = seq.token_ids[start:start + item.num_new]
        samples: tuple[RowSample, ...] = ()
        if item.samples:
            if seq.is_prompt:
                samples = tuple(RowSample(state.params, s.generator) for s in state.samples)
            else:
                samples = (RowSample(state.params, state.samples[seq.sample_index].generator),)
        prompt_from, targets = start, ()
        if seq.is_prompt and state.params.prompt_logprobs:
            # position p's logits give the logprob of prompt token p + 1; the last prompt position has no target
            prompt_from = max(start, len(state.prompt_logprobs))
            targets = tuple(seq.token_ids[prompt_from + 1:min(start + item.num_new, seq.num_tokens - 1) + 1])
        return StepRow(tokens=tokens, start_pos=start, block_table=seq.block_table, adapter=state.adapter,
                       samples=samples, prompt_targets=targets, prompt_from=prompt_from,
                       record_router=state.params.return_router_ids)

    def _update(self, state: _RequestState, item: ScheduledSeq, result) -> None:
        seq, start = item.seq, item.seq.num_computed
        self.scheduler.advance(item)
        state.prompt_logprobs += result.prompt_logprobs
        if result.router_ids is not None:
            self._record_router(state, seq, start, result.router_ids)
        if not item.samples:
            return
        sampled = result.sampled
        if seq.is_prompt:
            for sample, seq_i in zip(state.samples, self.scheduler.fork(seq, sampled.tokens)):
                sample.seq, sample.router_len = seq_i, state.prompt_router_len
            state.forked = True
            new = list(zip(state.samples, sampled.tokens, sampled.logprobs, sampled.top_logprobs))
        else:
            seq.token_ids.append(sampled.tokens[0])
            new = [(state.samples[seq.sample_index], sampled.tokens[0], sampled.logprobs[0],
                    sampled.top_logprobs[0])]
        for sample, token, logprob, top in new:
            top = top if state.params.top_logprobs else None
            if sample.builder.append(token, logprob, top):
                self.scheduler.finish(sample.seq)

    def _record_router(self, state: _RequestState, seq: Sequence, start: int, ids_TLK: torch.Tensor) -> None:
        if seq.is_prompt:
            skip = state.prompt_router_len - start
            if skip < ids_TLK.shape[0]:
                state.prompt_router.append(ids_TLK[max(skip, 0):])
                state.prompt_router_len = start + ids_TLK.shape[0]
        else:
            sample = state.samples[seq.sample_index]
            skip = sample.router_len - start
            if skip < ids_TLK.shape[0]:
                sample.router_chunks.append(ids_TLK[max(skip, 0):])
                sample.router_len = start + ids_TLK.shape[0]

    def _emit(self, state: _RequestState) -> RequestOutput | None:
        """The request's output for this step (None when a prefill chunk gave it nothing to report)."""
        out = RequestOutput(state.request.request_id)
        for index, sample in enumerate(state.samples):
            b = sample.builder
            seq, stable = b.seq, b.stable_text_len()
            if sample.final_sent or (
                    len(seq.tokens) == sample.sent_tokens and stable == sample.sent_text and not b.finished):
                continue
            delta = SequenceDelta(index, seq.tokens[sample.sent_tokens:], seq.logprobs[sample.sent_tokens:],
                                  seq.top_logprobs[sample.sent_tokens:], seq.text[sample.sent_text:stable])
            sample.sent_tokens, sample.sent_text = len(seq.tokens), stable
            if b.finished:
                delta.finish_reason = seq.finish_reason
                if state.params.return_router_ids:
                    delta.router_ids = self._router_ids(state, sample)
                sample.final_sent = True
            out.sequences.append(delta)
        if all(s.final_sent for s in state.samples):
            out.finished = True
            if state.params.prompt_logprobs:
                out.prompt_logprobs = list(state.prompt_logprobs)
            del self._requests[state.request.request_id]
        if not out.sequences and not out.finished:
            return None
        state.sink(out)
        return out

    def _router_ids(self, state: _RequestState, sample: _Sample) -> torch.Tensor:
        fed = state.request.num_prompt + len(sample.builder.seq.tokens) - 1
        ids = torch.cat([*state.prompt_router, *sample.router_chunks])
        assert ids.shape[0] == fed, (ids.shape, fed)
        return ids
