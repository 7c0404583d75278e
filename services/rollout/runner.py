"""Execute one engine step: one forward over the packed tokens of every scheduled sequence, then the logits and
samples the step needs.

Shapes: N tokens of the step packed in one row ([1, N]), R logits rows computed (the last position of each sequence
that samples, plus the prompt positions whose logprobs were asked for), V vocab, L MoE layers, K experts per token.

- Inputs: ids and positions [1, N]; the paged cache (services/rollout/paged_cache.py) writes KV blocks and attends
  through them (kernels/paged_attention.py).
- Multi-LoRA: when the model holds adapters, models.lora.per_row_adapters gives every token its sequence's adapter
  (or none), so requests for different adapters and for the base model share the forward, expert LoRA included.
- Only the R rows that need logits go through the unembedding (a prefill chunk without prompt logprobs needs none).
- Router replay capture: a RouterReplay in record mode when some sequence of the step asked for router ids.
- Deterministic mode: the forward, the unembedding and the sampling run under kernels.batch_invariant's
  batch_invariant_mode() (GEMMs, grouped expert GEMMs, attention, silu in the invariant kernels) and the paged
  cache's decode rows go through the same attention kernel, so a row's numbers cannot depend on the rest of the
  batch. The engine's own
  ops are per row (packing and gathers move data; sampling is per row, services/rollout/sampling.py).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

from kernels.batch_invariant import batch_invariant_mode
from kernels.paged_attention import SeqSpan
from models.lora import LoRALinear, RowAdapters, per_row_adapters
from models.moe import Experts, RouterReplay
from services.rollout.kv_blocks import KVArena
from services.rollout.paged_cache import PagedStepCache
from services.rollout.sampling import Sampled, SampleRow, SamplingParams, sample


@dataclass(frozen=True)
class RowSample:
    params: SamplingParams
    generator: torch.Generator


@dataclass(frozen=True)
class StepRow:
    """One scheduled sequence: feed `tokens` at positions start_pos.. through its blocks."""

    tokens: list[int]
    start_pos: int
    block_table: list[int]
    adapter: str | None = None  # adapter name in the model; None = base weights
    samples: tuple[RowSample, ...] = ()  # tokens to draw from the last position's logits (n for a prompt)
    prompt_targets: tuple[int, ...] = ()  # logprob of these targets at positions prompt_from, prompt_from + 1, ...
    prompt_from: int = 0
    record_router: bool = False


@dataclass
class StepBatch:
    rows: list[StepRow]
    block_copies: list[tuple[int, int]] = field(default_factory=list)


@dataclass
class RowResult:
    sampled: Sampled | None = None
    prompt_logprobs: list[float] = field(default_factory=list)
    router_ids: torch.Tensor | None = None  # [len(tokens), L, K] on the host


class ModelRunner:
    def __init__(self, model: torch.nn.Module, arena: KVArena, *, deterministic: bool):
        self.model, self.arena, self.deterministic = model, arena, deterministic
        self.device = torch.device(arena.device)
        self._mode = batch_invariant_mode if deterministic else contextlib.nullcontext
        self._workspace: dict[str, torch.Tensor] = {}  # the paged cache's gather buffers, reused every step
        self.refresh_lora()

    def refresh_lora(self) -> None:
        """Call after adding or removing adapters: whether the model holds any LoRA layer."""
        self.has_lora = any(isinstance(m, LoRALinear) or (isinstance(m, Experts) and m.lora is not None)
                            for m in self.model.modules())

    @torch.inference_mode()
    def execute(self, batch: StepBatch) -> list[RowResult]:
        pool = self.arena.pool  # allocated while the step's sequences hold blocks
        pool.copy_blocks(batch.block_copies)
        ids: list[int] = []
        positions: list[int] = []
        spans: list[SeqSpan] = []
        for row in batch.rows:
            spans.append(SeqSpan(len(ids), len(row.tokens), row.start_pos, row.block_table))
            ids += row.tokens
            positions += range(row.start_pos, row.start_pos + len(row.tokens))
        ids_1N = torch.tensor([ids], dtype=torch.long, device=self.device)
        positions_1N = torch.tensor([positions], dtype=torch.long, device=self.device)
        cache = PagedStepCache(pool, spans, deterministic=self.deterministic, workspace=self._workspace)
        recorder = RouterReplay.record() if any(r.record_router for r in batch.rows) else None
        adapters_N = [row.adapter for row in batch.rows for _ in row.tokens]

        # Which packed rows need logits: the prompt-logprob positions and the last position of sampling rows.
        logit_rows: dict[int, int] = {}
        for row, span in zip(batch.rows, spans):
            first = span.start + row.prompt_from - row.start_pos
            for i in range(len(row.prompt_targets)):
                logit_rows.setdefault(first + i, len(logit_rows))
            if row.samples:
                logit_rows.setdefault(span.start + span.num_new - 1, len(logit_rows))

        results = [RowResult() for _ in batch.rows]
        with self._mode():
            with self._adapters(adapters_N):
                hidden_1ND = self.model(ids_1N, positions_1N, cache=cache, routing=recorder, return_hidden=True)
            if logit_rows:
                index_R = torch.tensor(list(logit_rows), dtype=torch.long, device=self.device)
                with self._adapters([adapters_N[n] for n in logit_rows]):  # an adapter may hold lm_head
                    logits_RV = self.model.logits(hidden_1ND[0].index_select(0, index_R)).float()
                logprobs_RV = torch.log_softmax(logits_RV, dim=-1)
                sample_rows = []
                for i, (row, span) in enumerate(zip(batch.rows, spans)):
                    last = logit_rows.get(span.start + span.num_new - 1)
                    sample_rows += [(i, SampleRow(last, s.params, s.generator)) for s in row.samples]
                if sample_rows:
                    sampled = sample(logits_RV, logprobs_RV, [s for _, s in sample_rows])
                    self._split_samples(results, sample_rows, sampled)
                self._prompt_logprobs(batch.rows, spans, logit_rows, logprobs_RV, results)
        if recorder is not None:
            ids_NLK = recorder.stacked()[0].cpu()
            for row, span, result in zip(batch.rows, spans, results):
                if row.record_router:
                    result.router_ids = ids_NLK[span.start:span.start + span.num_new]
        return results

    def _adapters(self, names: list[str | None]):
        """Each row's adapter for the LoRA layers (a no-op while the model holds none)."""
        if not self.has_lora:
            return contextlib.nullcontext()
        return per_row_adapters(RowAdapters.from_names(names, self.device))

    @staticmethod
    def _split_samples(results: list[RowResult], sample_rows: list, sampled: Sampled) -> None:
        for j, (i, _) in enumerate(sample_rows):
            if results[i].sampled is None:
                results[i].sampled = Sampled([], [], [])
            out = results[i].sampled
            out.tokens.append(sampled.tokens[j])
            out.logprobs.append(sampled.logprobs[j])
            out.top_logprobs.append(sampled.top_logprobs[j])

    def _prompt_logprobs(self, rows: list[StepRow], spans: list[SeqSpan], logit_rows: dict[int, int],
                         logprobs_RV: torch.Tensor, results: list[RowResult]) -> None:
        picks, targets, owners = [], [], []
        for i, (row, span) in enumerate(zip(rows, spans)):
            first = span.start + row.prompt_from - row.start_pos
            for j, target in enumerate(row.prompt_targets):
                picks.append(logit_rows[first + j])
                targets.append(target)
                owners.append(i)
        if not picks:
            return
        picks_P = torch.tensor(picks, dtype=torch.long, device=self.device)
        targets_P1 = torch.tensor(targets, dtype=torch.long, device=self.device)[:, None]
        values = logprobs_RV.index_select(0, picks_P).gather(1, targets_P1).squeeze(1).tolist()  # .tolist() syncs
        for owner, value in zip(owners, values):
            results[owner].prompt_logprobs.append(value)
