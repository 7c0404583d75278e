"""Sampling: parameter validation, next-token choice, and turning sampled tokens into finished sequences.

Shapes: B rows being decoded (the n samples of one prompt that have not finished yet), V vocab.

Choices the API leaves open, fixed here:
- Logprobs are taken from the model's raw distribution, log_softmax(logits) BEFORE temperature, top-k and top-p, in
  float32. That is the quantity an RL trainer recomputes from the same weights, so rollout and trainer logprobs
  compare directly; it is not the log-probability under the (filtered, tempered) distribution actually sampled from.
- temperature 0 is greedy (argmax, lowest id on ties) and draws nothing from the generator.
- Filters apply in Hugging Face's order: temperature, then top-k, then top-p. top-p keeps the smallest set of most
  likely tokens whose mass reaches top_p, and always at least the most likely one.
- Randomness comes from one torch.Generator per request, seeded from params.seed (a random seed when unset), so the
  same seed and the same request give the same tokens on the same hardware and software.
- A sequence ends with finish_reason "stop" on an end-of-sequence or stop_token_ids token (the token is returned in
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
DEFAULT_MAX_TOKENS = 128


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = DEFAULT_MAX_TOKENS
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    n: int = 1


@dataclass
class SampledSequence:
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str = ""


def validate_params(p: SamplingParams) -> None:
    """Checks that need no model; field names follow SampleRequest."""
    if not (math.isfinite(p.temperature) and 0.0 <= p.temperature <= MAX_TEMPERATURE):
        raise InvalidArgument(f"must be between 0 (greedy) and {MAX_TEMPERATURE:g}, got {p.temperature}",
                              field="params.temperature")
    if not (math.isfinite(p.top_p) and 0.0 < p.top_p <= 1.0):
        raise InvalidArgument(f"must satisfy 0 < top_p <= 1, got {p.top_p}", field="params.top_p")
    if p.top_k < 0:
        raise InvalidArgument(f"must be >= 0 (0 = no limit), got {p.top_k}", field="params.top_k")
    if p.max_tokens < 1:
        raise InvalidArgument(f"must be >= 1, got {p.max_tokens}", field="params.max_tokens")
    if not 1 <= p.n <= MAX_N:
        raise InvalidArgument(f"must be between 1 and {MAX_N}, got {p.n}", field="params.n")
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


def make_generator(seed: int | None, device: torch.device | str) -> torch.Generator:
    seed = secrets.randbits(63) if seed is None else seed
    return torch.Generator(device=device).manual_seed(seed & 0xFFFF_FFFF_FFFF_FFFF)


def sample(logits_BV: torch.Tensor, p: SamplingParams, generator: torch.Generator
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Next token per row and its logprob under the raw distribution (see the module docstring)."""
    logits_BV = logits_BV.float()
    logprobs_BV = torch.log_softmax(logits_BV, dim=-1)
    if p.temperature == 0:
        tokens_B = logits_BV.argmax(dim=-1)
    else:
        probs_BV = torch.softmax(filter_logits(logits_BV / p.temperature, p.top_k, p.top_p), dim=-1)
        tokens_B = torch.multinomial(probs_BV, 1, generator=generator).squeeze(1)
    return tokens_B, logprobs_BV.gather(1, tokens_B[:, None]).squeeze(1)


def filter_logits(logits_BV: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Logits with everything outside top-k, then outside the top-p nucleus, set to -inf."""
    if 0 < top_k < logits_BV.shape[-1]:
        kth_B1 = torch.topk(logits_BV, top_k, dim=-1).values[:, -1:]
        logits_BV = logits_BV.masked_fill(logits_BV < kth_B1, float("-inf"))
    if top_p < 1.0:
        sorted_BV, order_BV = torch.sort(logits_BV, dim=-1, descending=True, stable=True)
        probs_BV = torch.softmax(sorted_BV, dim=-1)
        mass_before_BV = probs_BV.cumsum(dim=-1) - probs_BV
        drop_BV = mass_before_BV >= top_p
        drop_BV[:, 0] = False  # keep the most likely token whatever top_p is
        logits_BV = logits_BV.masked_fill(drop_BV.scatter(1, order_BV, drop_BV), float("-inf"))
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

    def append(self, token: int, logprob: float) -> bool:
        """Add one sampled token; returns True when the sequence is finished."""
        assert not self.finished
        self.seq.tokens.append(token)
        self.seq.logprobs.append(logprob)
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
