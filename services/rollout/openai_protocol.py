"""OpenAI request bodies -> the rollout's Prompt and SamplingParams; sampled tokens -> OpenAI's logprobs objects.

Parameters are checked here for type and shape and by services/rollout/sampling.py for range (the checks gRPC
requests get). Every mistake is an InvalidArgument whose field is the OpenAI parameter name; errors raised deeper in
the core name SampleRequest fields (params.temperature, prompt.messages[0].role), which `openai_param` renames with
the request's `param_names`. Parameters this server does not implement are accepted only at their neutral value
(presence_penalty 0, no tools, ...), so a request is never served differently from what it asked for; fields this
file does not know are ignored, as vLLM does.
"""
from __future__ import annotations

import codecs
import json
import math
import re
from dataclasses import dataclass, field

from services.common.errors import InvalidArgument, Violation
from services.rollout import sampling
from services.rollout.sampling_core import Prompt
from services.rollout.sampling import SamplingParams

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
CHAT_DEFAULT_MAX_TOKENS = sampling.DEFAULT_MAX_TOKENS
MIN_LOGPROB = -9999.0  # JSON has no -inf; vLLM clamps the same way

# Not implemented here: accepted only when null or one of these "off" values.
UNSUPPORTED = {
    "presence_penalty": (0,), "frequency_penalty": (0,), "repetition_penalty": (1,), "logit_bias": ({},),
    "suffix": ("",), "ignore_eos": (False,), "tools": ([],), "functions": ([],), "tool_choice": ("none", "auto"),
    "function_call": ("none", "auto"), "response_format": ({"type": "text"},),
}
MESSAGE_ROLES = {"developer": "system"}  # OpenAI's newer name for the system role


@dataclass(frozen=True)
class CompletionRequest:
    model: str
    prompts: list[Prompt]  # one engine request each; choice p * n + i is sample i of prompt p
    params: SamplingParams
    stream: bool = False
    include_usage: bool = False
    echo: bool = False
    logprobs: int | None = None  # OpenAI's legacy `logprobs`: alternatives per token; None: no logprobs object
    param_names: dict[str, str] = field(default_factory=dict)  # core field -> OpenAI parameter


@dataclass(frozen=True)
class ChatRequest:
    model: str
    prompt: Prompt
    params: SamplingParams  # params.top_logprobs is the request's top_logprobs
    stream: bool = False
    include_usage: bool = False
    logprobs: bool = False
    param_names: dict[str, str] = field(default_factory=dict)


def openai_param(core_field: str, param_names: dict[str, str]) -> str | None:
    """The OpenAI parameter a core error names: params.temperature -> temperature, prompt.messages[2].role ->
    messages[2].role, with the request's own renames first (e.g. params.top_logprobs -> logprobs)."""
    if not core_field:
        return None
    head, rest = re.match(r"([^\[]*)(.*)", core_field).groups()
    if head in param_names:
        return param_names[head] + rest
    return core_field.removeprefix("params.").removeprefix("prompt.")


# ---- reading request bodies ----------------------------------------------------------------------------------

def read_body(raw: bytes):
    """The body as JSON with what every gRPC request is held to (services/common/request_checks.py): numbers finite
    (Python's parser would take NaN, Infinity and 1e999) and strings without NUL (a model name reaches the database,
    which cannot store one). Violations name the JSON path, e.g. messages[1].content."""
    try:
        body = json.loads(raw, parse_constant=_not_finite, parse_float=_finite)
    except ValueError as exc:
        raise InvalidArgument(f"the request body is not valid JSON: {exc}") from None
    found: list[Violation] = []
    _find_nul(body, "", found)
    if found:
        raise InvalidArgument(violations=found)
    return body


def _not_finite(text: str) -> float:
    raise ValueError(f"{text} is not a number JSON allows")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text} overflows a double")
    return value


def _find_nul(value, path: str, found: list[Violation]) -> None:
    if isinstance(value, str):
        if "\x00" in value:
            found.append(Violation(field=path, reason="must not contain a NUL character"))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _find_nul(item, f"{path}[{i}]", found)
    elif isinstance(value, dict):
        for key, item in value.items():
            where = f"{path}.{key}" if path else key
            if "\x00" in key:
                found.append(Violation(field=where, reason="the key must not contain a NUL character"))
            _find_nul(item, where, found)


_KINDS = {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "an array",
          dict: "an object"}


def _is(value, kind: type) -> bool:
    if kind is bool or isinstance(value, bool):
        return kind is bool and isinstance(value, bool)
    return isinstance(value, (int, float)) if kind is float else isinstance(value, kind)


class _Body:
    """Typed reads of a JSON object's fields: null or absent takes the default; a wrong type names the field."""

    def __init__(self, body):
        if not isinstance(body, dict):
            raise InvalidArgument("the request body must be a JSON object")
        self.body = body

    def get(self, name: str, kind: type, default=None):
        value = self.body.get(name)
        if value is None:
            return default
        if not _is(value, kind):
            raise InvalidArgument(f"must be {_KINDS[kind]}, got {json_type(value)}", field=name)
        return float(value) if kind is float else value

    def unsupported(self, *, n: int) -> None:
        for name, off in UNSUPPORTED.items():
            value = self.body.get(name)
            if value is not None and value not in off:
                raise InvalidArgument(f"is not supported by this server (only {off[0]!r} or null)", field=name)
        best_of = self.body.get("best_of")
        if best_of is not None and best_of != n:
            raise InvalidArgument(f"is not supported by this server (only null or equal to n = {n})", field="best_of")

    def strings(self, name: str) -> tuple[str, ...]:
        value = self.body.get(name)
        if value is None:
            return ()
        if isinstance(value, str):
            return (value,)
        if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
            raise InvalidArgument("must be a string or an array of strings", field=name)
        return tuple(value)

    def token_ids(self, name: str) -> tuple[int, ...]:
        value = self.get(name, list, [])
        if not all(_is(t, int) for t in value):
            raise InvalidArgument("must be an array of integers", field=name)
        return tuple(value)

    def stream_options(self, stream: bool) -> bool:
        """include_usage: a last chunk with the usage (and no choices) before [DONE]."""
        options = self.get("stream_options", dict, {})
        if options and not stream:
            raise InvalidArgument("is only allowed with stream: true", field="stream_options")
        include = options.get("include_usage")
        if include is not None and not isinstance(include, bool):
            raise InvalidArgument(f"must be a boolean, got {json_type(include)}", field="stream_options.include_usage")
        return bool(include)


def json_type(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    return {str: "a string", list: "an array", dict: "an object"}.get(type(value), type(value).__name__)


def _model(b: _Body) -> str:
    model = b.get("model", str, "")
    if not model:
        raise InvalidArgument("required: a deployment name or a base model name (see GET /v1/models)", field="model")
    return model


def _sampling_params(b: _Body, *, max_tokens_name: str, max_tokens_default: int, top_logprobs: int,
                     prompt_logprobs: bool = False) -> SamplingParams:
    top_k = b.get("top_k", int, 0)
    params = SamplingParams(
        temperature=b.get("temperature", float, 1.0), top_p=b.get("top_p", float, 1.0),
        top_k=0 if top_k == -1 else top_k,  # -1 is vLLM's "no limit"
        min_p=b.get("min_p", float, 0.0), max_tokens=b.get(max_tokens_name, int, max_tokens_default),
        stop=b.strings("stop"), stop_token_ids=b.token_ids("stop_token_ids"), seed=b.get("seed", int),
        n=b.get("n", int, 1), top_logprobs=top_logprobs, prompt_logprobs=prompt_logprobs)
    b.unsupported(n=params.n)
    return params


def _checked(params: SamplingParams, param_names: dict[str, str]) -> SamplingParams:
    """The range checks of gRPC requests, reported with OpenAI parameter names."""
    try:
        sampling.validate_params(params)
    except InvalidArgument as exc:
        v = exc.violations[0]
        raise InvalidArgument(v.reason, field=openai_param(v.field, param_names)) from None
    return params


def parse_completion(body) -> CompletionRequest:
    b = _Body(body)
    model = _model(b)
    stream, echo = b.get("stream", bool, False), b.get("echo", bool, False)
    logprobs = b.get("logprobs", int)
    if logprobs is not None and echo and logprobs > 0:
        raise InvalidArgument("with echo, logprobs must be 0: the engine returns the prompt tokens' logprobs but not "
                              "their top alternatives", field="logprobs")
    if logprobs is not None and echo and stream:
        raise InvalidArgument("echo with logprobs cannot stream: the prompt's logprobs arrive with the last output",
                              field="echo")
    names = {"params.top_logprobs": "logprobs"}
    params = _sampling_params(b, max_tokens_name="max_tokens", max_tokens_default=COMPLETIONS_DEFAULT_MAX_TOKENS,
                              top_logprobs=logprobs or 0, prompt_logprobs=echo and logprobs is not None)
    return CompletionRequest(model=model, prompts=_prompts(body.get("prompt")), params=_checked(params, names),
                             stream=stream, include_usage=b.stream_options(stream), echo=echo, logprobs=logprobs,
                             param_names=names)


def _prompts(value) -> list[Prompt]:
    """A string, an array of strings, an array of token ids, or an array of arrays of token ids."""
    if isinstance(value, str):
        return [Prompt(text=value)]
    if isinstance(value, list) and value:
        if all(isinstance(p, str) for p in value):
            return [Prompt(text=p) for p in value]
        if all(_is(t, int) for t in value):
            return [Prompt(tokens=tuple(value))]
        if all(isinstance(p, list) and all(_is(t, int) for t in p) for p in value):
            return [Prompt(tokens=tuple(p)) for p in value]
    raise InvalidArgument("must be a string, an array of strings, an array of token ids or an array of arrays of "
                          f"token ids, got {json_type(value) if value != [] else 'an empty array'}", field="prompt")


def parse_chat(body) -> ChatRequest:
    b = _Body(body)
    model = _model(b)
    stream, logprobs = b.get("stream", bool, False), b.get("logprobs", bool, False)
    top_logprobs = b.get("top_logprobs", int)
    if top_logprobs is not None and not logprobs:
        raise InvalidArgument("requires logprobs: true", field="top_logprobs")
    max_name = "max_completion_tokens" if b.body.get("max_completion_tokens") is not None else "max_tokens"
    names = {"params.max_tokens": max_name, "prompt": "messages"}
    params = _sampling_params(b, max_tokens_name=max_name, max_tokens_default=CHAT_DEFAULT_MAX_TOKENS,
                              top_logprobs=top_logprobs or 0)
    return ChatRequest(model=model, prompt=Prompt(messages=_messages(b.get("messages", list, []))),
                       params=_checked(params, names), stream=stream, include_usage=b.stream_options(stream),
                       logprobs=logprobs, param_names=names)


def _messages(messages: list) -> tuple[tuple[str, str], ...]:
    """(role, content) pairs; content may be a string or an array of text parts (joined), as OpenAI accepts."""
    if not messages:
        raise InvalidArgument("required: a non-empty array of {role, content} messages", field="messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise InvalidArgument("must be an object with a string role", field=f"messages[{i}]")
        content = m.get("content")
        if isinstance(content, list):
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise InvalidArgument("only text parts ({type: text, text}) are supported",
                                      field=f"messages[{i}].content")
            content = "".join(p["text"] for p in content)
        elif content is None:
            content = ""
        elif not isinstance(content, str):
            raise InvalidArgument(f"must be a string or an array of text parts, got {json_type(content)}",
                                  field=f"messages[{i}].content")
        out.append((MESSAGE_ROLES.get(m["role"], m["role"]), content))
    return tuple(out)


# ---- logprobs ---------------------------------------------------------------------------------------------------


def _gpt2_byte_chars() -> dict[str, int]:
    """GPT-2's printable character for each byte, inverted: byte-level BPE vocabularies spell tokens with these."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    chars = {b: chr(b) for b in printable} | {b: chr(256 + i) for i, b in enumerate(others)}
    return {c: b for b, c in chars.items()}


_BYTE_OF_CHAR = _gpt2_byte_chars()


class TokenTexts:
    """Each token's raw bytes and text, for logprobs. Byte-level BPE tokenizers (Qwen, Llama 3, DeepSeek, the tiny
    model) spell every token in GPT-2's byte alphabet, so a token holding part of a multi-byte character gets its
    exact bytes and its text shows U+FFFD, as OpenAI's does; other tokenizers give the token decoded on its own."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
        self._byte_level = type(decoder).__name__ == "ByteLevel"
        self._added = {i: t.content for i, t in tokenizer.added_tokens_decoder.items()}
        self._bytes: dict[int, bytes] = {}

    def bytes(self, token_id: int) -> bytes:
        b = self._bytes.get(token_id)
        if b is None:
            b = self._added[token_id].encode() if token_id in self._added else None
            if b is None and self._byte_level:
                spelled = self.tokenizer.convert_ids_to_tokens(token_id)
                if all(c in _BYTE_OF_CHAR for c in spelled):
                    b = bytes(_BYTE_OF_CHAR[c] for c in spelled)
            if b is None:
                b = self.tokenizer.decode([token_id], skip_special_tokens=False).encode()
            self._bytes[token_id] = b
        return b

    def text(self, token_id: int) -> str:
        return self.bytes(token_id).decode("utf-8", errors="replace")


def finite(logprob: float) -> float:
    return max(logprob, MIN_LOGPROB)


class CompletionLogprobs:
    """OpenAI's legacy `logprobs` object of one choice, built piece by piece as tokens arrive (a stream sends each
    piece): tokens, token_logprobs, top_logprobs ({text: logprob} of the k most likely tokens and the sampled one,
    so up to k + 1 entries) and text_offset, where each token's text starts in characters from the start of the
    prompt (a token that completes a multi-byte character starts at that character)."""

    def __init__(self, texts: TokenTexts, k: int, offset: int):
        self.texts, self.k, self.offset = texts, k, offset
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def _start(self, raw: bytes) -> int:
        """Where a token starts: after the characters decoded so far and, when it does not continue a pending
        incomplete character, after that character's replacement (U+FFFD)."""
        pending = self._utf8.getstate()[0]
        if pending and not (raw and 0x80 <= raw[0] <= 0xBF):
            return self.offset + len(pending.decode("utf-8", errors="replace"))
        return self.offset

    def add(self, tokens: list[int], logprobs: list[float | None],
            top: list[list[tuple[int, float]]] | None = None) -> dict:
        """top None: prompt tokens, whose alternatives the engine does not return (the entry is {token: logprob},
        or null for the first prompt token, which has no logprob)."""
        piece: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for i, (token, logprob) in enumerate(zip(tokens, logprobs)):
            text, raw = self.texts.text(token), self.texts.bytes(token)
            piece["tokens"].append(text)
            piece["text_offset"].append(self._start(raw))
            self.offset += len(self._utf8.decode(raw))
            if logprob is None:
                piece["token_logprobs"].append(None)
                piece["top_logprobs"].append(None)
                continue
            alternatives = {self.texts.text(t): finite(lp) for t, lp in (top[i][:self.k] if top else ())}
            alternatives.setdefault(text, finite(logprob))
            piece["token_logprobs"].append(finite(logprob))
            piece["top_logprobs"].append(alternatives)
        return piece


def joined(*pieces: dict) -> dict:
    return {key: [v for p in pieces for v in p[key]] for key in pieces[0]}


def chat_logprobs(texts: TokenTexts, tokens: list[int], logprobs: list[float],
                  top: list[list[tuple[int, float]]]) -> list[dict]:
    """The `content` list of a chat choice's logprobs: each token with its bytes and its top alternatives."""
    def entry(token: int, logprob: float) -> dict:
        return {"token": texts.text(token), "logprob": finite(logprob), "bytes": list(texts.bytes(token))}

    return [entry(t, lp) | {"top_logprobs": [entry(a, alp) for a, alp in alts]}
            for t, lp, alts in zip(tokens, logprobs, top)]
