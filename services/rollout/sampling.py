"""Sampling: parameter validation, next-token choice, and turning sampled tokens into finished sequences.

Shapes: R rows to sample this step (one per sequence that gets a token; a prompt's n samples are n rows of the same
logits), V vocab.

Choices the API leaves open, fixed here:
- Logprobs are taken from the model's raw distribution, log_softmax(logits) BEFORE temperature, top-k, top-p and
  min-p, in float32. That is the quantity an RL trainer recomputes from the same weights, so rollout and trainer
  logprobs compare directly; it is not the log-probability under the (filtered, tempered) distribution actually
  sampled from. The top_logprobs alternatives and the prompt logprobs are of the same raw distribution.
- temperature 0 is greedy (argmax, lowest id on ties) and draws nothing from the generator.
- Filters apply in Hugging Face's order: temperature, then top-k, then top-p, then min-p. top-k keeps every token
  tied with the k-th; top-p keeps the smallest set of most likely tokens whose mass reaches top_p, and always at
  least the most likely one; min-p keeps the tokens with probability >= min_p * (the largest probability).
- Randomness comes from one torch.Generator per sample (seeded from params.seed and the sample's index; a random
  seed when unset), and a row draws only when it samples a token, so a sample's tokens do not depend on the other
  requests or samples in the batch, nor on preemption. A draw is what torch.multinomial(probs, 1) does: V
  exponential variates q from the sample's generator, then argmax(probs / q).
- Everything is per row (elementwise ops, per-row reductions), so a row's result does not depend on the batch.
- A sequence ends with finish_reason "stop" on an end-of-sequence (unless ignore_eos) or stop_token_ids token (the token is returned in
  `tokens` with its logprob, as RL training needs it, but is not part of `text`), or when a stop string first
  appears in the decoded text: `tokens` then end with the token that completed the stop string (that token may
  decode to more than the stop string's tail) and `text` ends right before the stop string. Otherwise it ends with
  "length" after max_tokens tokens. `text` is always the decoding of `tokens` minus any final stop token (other
  special tokens are kept, as decoded), cut before the stop string if one matched. Stop strings are looked for in
  the generated text only, never in the prompt.
"""
from __future__ import annotations

import math
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from services.common.errors import InvalidArgument

MAX_N = 64
MAX_TEMPERATURE = 10.0
MAX_TOP_LOGPROBS = 20
DEFAULT_MAX_TOKENS = 128


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    max_tokens: int = DEFAULT_MAX_TOKENS
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    n: int = 1
    top_logprobs: int = 0  # alternatives (token id, logprob) per sampled token, the most likely first
    prompt_logprobs: bool = False  # logprob of every prompt token after the first, given its prefix
    return_router_ids: bool = False  # MoE models: the experts each MoE layer chose at every position fed
    ignore_eos: bool = False  # end-of-sequence tokens do not end a sample (only stop, stop_token_ids, max_tokens)


@dataclass
class SampledSequence:
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str = ""
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)  # per token, with top_logprobs > 0
    # With return_router_ids: [P + len(tokens) - 1, num MoE layers, top_k] expert ids (uint8 for <= 256 experts) of
    # every position fed to the model (the prompt, then each sampled token but the last), MoE layers in order.
    router_ids: torch.Tensor | None = None


def validate_params(p: SamplingParams) -> None:
    """Checks that need no model; field names follow SampleRequest."""
    if not (math.isfinite(p.temperature) and 0.0 <= p.temperature <= MAX_TEMPERATURE):
        raise InvalidArgument(f"must be between 0 (greedy) and {MAX_TEMPERATURE:g}, got {p.temperature}",
                              field="params.temperature")
    if not (math.isfinite(p.top_p) and 0.0 < p.top_p <= 1.0):
        raise InvalidArgument(f"must satisfy 0 < top_p <= 1, got {p.top_p}", field="params.top_p")
    if p.top_k < 0:
        raise InvalidArgument(f"must be >= 0 (0 = no limit), got {p.top_k}", field="params.top_k")
    if not (math.isfinite(p.min_p) and 0.0 <= p.min_p <= 1.0):
        raise InvalidArgument(f"must satisfy 0 <= min_p <= 1 (0 = off), got {p.min_p}", field="params.min_p")
    if p.max_tokens < 1:
        raise InvalidArgument(f"must be >= 1, got {p.max_tokens}", field="params.max_tokens")
    if not 1 <= p.n <= MAX_N:
        raise InvalidArgument(f"must be between 1 and {MAX_N}, got {p.n}", field="params.n")
    if not 0 <= p.top_logprobs <= MAX_TOP_LOGPROBS:
        raise InvalidArgument(f"must be between 0 and {MAX_TOP_LOGPROBS}, got {p.top_logprobs}",
                              field="params.top_logprobs")
    if any(not s for s in p.stop):
        raise InvalidArgument("stop strings must be non-empty", field="params.stop")
    if any(t < 0 for t in p.stop_token_ids):
        raise InvalidArgument("token ids must be >= 0", field="params.stop_token_ids")


def validate_prompt(prompt_ids: Sequence[int], p: SamplingParams, *, vocab_size: int, max_context: int,
                    prompt_field: str = "prompt") -> None:
    """Checks against the model: the prompt fits the vocabulary and leaves room for max_tokens in the context."""
    if not prompt_ids:
        raise InvalidArgument("the prompt is empty", field=prompt_field)
    bad = [t for t in prompt_ids if not 0 <= t < vocab_size]
    if bad:
        raise InvalidArgument(f"token ids must be in [0, {vocab_size}) for this model, got {bad[:5]}",
                              field=prompt_field)
    room = max_context - len(prompt_ids)
    if room < 1:
        raise InvalidArgument(f"the prompt has {len(prompt_ids)} tokens; the model's context is {max_context}",
                              field=prompt_field)
    if p.max_tokens > room:
        raise InvalidArgument(f"{p.max_tokens} does not fit: the model's context is {max_context} tokens and the "
                              f"prompt takes {len(prompt_ids)}, so at most {room}", field="params.max_tokens")


_MASK64 = 0xFFFF_FFFF_FFFF_FFFF


def _splitmix64(x: int) -> int:
    x = (x + 0x9E37_79B9_7F4A_7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58_476D_1CE4_E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D0_49BB_1331_11EB) & _MASK64
    return x ^ (x >> 31)


def sample_generators(seed: int | None, n: int, device: torch.device | str) -> list[torch.Generator]:
    """One generator per sample: sample i is seeded with splitmix64(seed + i), so the samples draw independent
    streams and sample i's stream does not depend on n. No seed: a fresh random one."""
    seed = secrets.randbits(63) if seed is None else seed
    return [torch.Generator(device=device).manual_seed(_splitmix64((seed + i) & _MASK64)) for i in range(n)]


@dataclass(frozen=True)
class SampleRow:
    """Sample one token from logits row `row` with this sample's params and generator."""

    row: int
    params: SamplingParams
    generator: torch.Generator


@dataclass
class Sampled:
    tokens: list[int]
    logprobs: list[float]
    top_logprobs: list[list[tuple[int, float]]]  # per row: params.top_logprobs alternatives


def sample(logits_RV: torch.Tensor, logprobs_RV: torch.Tensor, rows: Sequence[SampleRow]) -> Sampled:
    """A token per SampleRow, its raw logprob and the raw top alternatives (see the module docstring).
    logits_RV: the rows' logits; logprobs_RV: log_softmax(logits_RV.float())."""
    index_S = torch.tensor([r.row for r in rows], device=logits_RV.device)
    logits_SV = logits_RV.index_select(0, index_S).float()
    logprobs_SV = logprobs_RV.index_select(0, index_S)
    tokens_S = logits_SV.argmax(dim=-1)
    drawn = [i for i, r in enumerate(rows) if r.params.temperature > 0]
    if drawn:
        params = [rows[i].params for i in drawn]
        drawn_D = torch.tensor(drawn, device=logits_RV.device)
        temperature_D1 = torch.tensor([[p.temperature] for p in params], device=logits_RV.device)
        logits_DV = filter_logits(logits_SV.index_select(0, drawn_D) / temperature_D1, [p.top_k for p in params],
                                  [p.top_p for p in params], [p.min_p for p in params])
        probs_DV = torch.softmax(logits_DV, dim=-1)
        noise_DV = torch.stack([torch.empty_like(probs_DV[0]).exponential_(generator=rows[i].generator)
                                for i in drawn])
        tokens_S.index_copy_(0, drawn_D, (probs_DV / noise_DV).argmax(dim=-1))
    chosen_S = logprobs_SV.gather(1, tokens_S[:, None]).squeeze(1)
    ks = [r.params.top_logprobs for r in rows]
    top: list[list[tuple[int, float]]] = [[] for _ in rows]
    if max(ks):
        values_SK, ids_SK = logprobs_SV.topk(max(ks), dim=-1)
        # .tolist() syncs: the host needs the alternatives (as it needs the tokens below).
        for i, (ids, values) in enumerate(zip(ids_SK.tolist(), values_SK.tolist())):
            top[i] = list(zip(ids[:ks[i]], values[:ks[i]]))
    return Sampled(tokens=tokens_S.tolist(), logprobs=chosen_S.tolist(), top_logprobs=top)


def _per_row(value, rows: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.tensor(value if isinstance(value, (list, tuple)) else [value] * rows, dtype=dtype, device=device)


def filter_logits(logits_BV: torch.Tensor, top_k, top_p, min_p=0.0) -> torch.Tensor:
    """Logits with everything outside top-k, then outside the top-p nucleus, then below min_p times the largest
    probability set to -inf. top_k / top_p / min_p: one value for every row or a list with one per row (top_k 0,
    top_p 1 and min_p 0 are off)."""
    B, V = logits_BV.shape
    device = logits_BV.device
    k_B = _per_row(top_k, B, torch.int64, device)
    active_k_B = (k_B > 0) & (k_B < V)
    if bool(active_k_B.any()):
        k_max = int(k_B[active_k_B].max())
        kth_B1 = logits_BV.topk(k_max, dim=-1).values.gather(1, (k_B.clamp(1, k_max) - 1)[:, None])
        kth_B1 = kth_B1.masked_fill(~active_k_B[:, None], float("-inf"))
        logits_BV = logits_BV.masked_fill(logits_BV < kth_B1, float("-inf"))
    p_B = _per_row(top_p, B, torch.float32, device)
    if bool((p_B < 1.0).any()):
        sorted_BV, order_BV = torch.sort(logits_BV, dim=-1, descending=True, stable=True)
        probs_BV = torch.softmax(sorted_BV, dim=-1)
        mass_before_BV = probs_BV.cumsum(dim=-1) - probs_BV
        drop_BV = (mass_before_BV >= p_B[:, None]) & (p_B < 1.0)[:, None]
        drop_BV[:, 0] = False  # keep the most likely token whatever top_p is
        logits_BV = logits_BV.masked_fill(drop_BV.scatter(1, order_BV, drop_BV), float("-inf"))
    min_p_B = _per_row(min_p, B, torch.float32, device)
    if bool((min_p_B > 0.0).any()):
        probs_BV = torch.softmax(logits_BV, dim=-1)
        threshold_B1 = probs_BV.max(dim=-1, keepdim=True).values * min_p_B[:, None]
        logits_BV = logits_BV.masked_fill(probs_BV < threshold_B1, float("-inf"))
    return logits_BV


class SequenceBuilder:
    """One row's tokens, logprobs and text as it is decoded; says when the row is finished.

    Text is detokenized incrementally, as vLLM does: decode the tokens since the previous emission together with the
    chunk emitted last (as context) and keep the difference, holding text back while it ends in an incomplete UTF-8
    character. A long generation so costs O(length) decoding, not O(length^2)."""

    def __init__(self, tokenizer, p: SamplingParams, stop_ids: set[int]):
        self.tokenizer = tokenizer
        self.max_tokens = p.max_tokens
        self.stop = p.stop
        self.longest_stop = max((len(s) for s in p.stop), default=0)
        self.stop_ids = stop_ids
        self.seq = SampledSequence()
        self._text_tokens: list[int] = []  # tokens that make up text (a final stop token does not)
        self._prefix_offset = 0  # _text_tokens[_prefix_offset:_read_offset] is the chunk emitted last
        self._read_offset = 0

    @property
    def finished(self) -> bool:
        return bool(self.seq.finish_reason)

    def append(self, token: int, logprob: float, top_logprobs: list[tuple[int, float]] | None = None) -> bool:
        """Add one sampled token; returns True when the sequence is finished."""
        assert not self.finished
        self.seq.tokens.append(token)
        self.seq.logprobs.append(logprob)
        if top_logprobs is not None:
            self.seq.top_logprobs.append(top_logprobs)
        if token in self.stop_ids:
            self._emit(final=True)
            self.seq.finish_reason = "stop"
        else:
            self._text_tokens.append(token)
            last = len(self.seq.tokens) >= self.max_tokens
            if self._cut_at_stop_string(self._emit(final=last)):
                self.seq.finish_reason = "stop"
            elif last:
                self.seq.finish_reason = "length"
        return self.finished

    def stable_text_len(self) -> int:
        """How much of text is final: a stop string found later starts at most longest_stop - 1 characters before
        the current end (and cuts the text there), so a stream holds those back until the sequence finishes."""
        if self.finished or not self.stop:
            return len(self.seq.text)
        return max(0, len(self.seq.text) - self.longest_stop + 1)

    def _decode(self, start: int, end: int | None = None) -> str:
        return self.tokenizer.decode(self._text_tokens[start:end], skip_special_tokens=False)

    def _emit(self, *, final: bool) -> int:
        """Append the newly decodable text; returns how many characters were added. final: emit held-back text."""
        if self._read_offset == len(self._text_tokens):
            return 0
        prefix = self._decode(self._prefix_offset, self._read_offset)
        full = self._decode(self._prefix_offset)
        if not final and (len(full) <= len(prefix) or full.endswith("\ufffd")):
            return 0  # an incomplete multi-byte character: wait for the rest of its bytes
        new_text = full[len(prefix):]
        self.seq.text += new_text
        self._prefix_offset, self._read_offset = self._read_offset, len(self._text_tokens)
        return len(new_text)

    def _cut_at_stop_string(self, new_chars: int) -> bool:
        """Earlier text held no stop string, so a match must end inside the last new_chars characters."""
        if not self.stop or not new_chars:
            return False
        text = self.seq.text
        start = max(0, len(text) - new_chars - self.longest_stop + 1)
        hits = [i for i in (text.find(s, start) for s in self.stop) if i >= 0]
        if not hits:
            return False
        self.seq.text = text[:min(hits)]
        return True
