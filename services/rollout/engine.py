"""The sampling engine: base models, LoRA adapters on them, and KV-cached generation with the trainer's model code.

Shapes: B rows still decoding (<= n), P prompt tokens, V vocab.

One request at a time per base model (a lock): the prompt is prefilled once with batch 1, the cache is expanded to
the n samples with KVCache.select, and the rows are decoded together one token per step; a row that finishes is
dropped from the batch (and from the cache), so it costs nothing afterwards. Continuous batching and a paged cache
will replace `_generate` behind the same `generate` call.

Adapters are known by id (a deployment id) with the directory they load from. At most max_loaded_adapters hold
weights at once, least recently used first out; an evicted adapter stays known and is loaded again from its
directory on its next use. Only unload_adapter forgets one.

Locking: `_lock` guards the engine's dictionaries and is only ever held briefly; a base model's `lock` guards its
module tree (adding, removing and switching adapters, and forward passes). A thread never holds two base locks, and
takes `_lock` inside a base lock, never the other way round, so there is no lock-order cycle.
"""
from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from models import CausalLM, KVCache, load_pretrained
from models.lora import load_peft_adapter, remove_adapter, set_active_adapter
from models.tokenizer import eos_token_ids, load_tokenizer
from services.common.errors import FailedPrecondition, NotFound
from services.rollout import sampling
from services.rollout.sampling import SampledSequence, SamplingParams, SequenceBuilder

log = logging.getLogger("trainyard.rollout.engine")


@dataclass
class BaseModel:
    model_dir: str
    model: CausalLM
    tokenizer: object
    eos_ids: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    lock: threading.Lock = field(default_factory=threading.Lock)
    resident: set[str] = field(default_factory=set)  # adapter ids whose weights are in `model`

    @property
    def vocab_size(self) -> int:
        return self.model.args.vocab_size

    @property
    def max_context(self) -> int:
        return self.model.args.max_position_embeddings


@dataclass
class _Adapter:
    model_dir: str
    adapter_dir: Path


class Engine:
    def __init__(self, *, max_loaded_adapters: int = 8, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu"):
        assert max_loaded_adapters >= 1
        self.max_loaded_adapters = max_loaded_adapters
        self.dtype = dtype
        self.device = torch.device(device)
        self._lock = threading.Lock()
        self._load_lock = threading.Lock()  # base-model loads are rare and slow; one at a time
        self._bases: dict[str, BaseModel] = {}
        self._adapters: dict[str, _Adapter] = {}
        self._lru: OrderedDict[str, None] = OrderedDict()  # resident adapter ids, least recently used first

    # ---- base models -------------------------------------------------------------------------------------------

    def base(self, model_dir: str) -> BaseModel:
        """The base model for a directory, loaded on first use."""
        with self._lock:
            if model_dir in self._bases:
                return self._bases[model_dir]
        with self._load_lock:
            with self._lock:
                if model_dir in self._bases:
                    return self._bases[model_dir]
            log.info("loading base model %s (%s on %s)", model_dir, self.dtype, self.device)
            try:
                tokenizer = load_tokenizer(model_dir)
                model = load_pretrained(model_dir, self.dtype, self.device)
                eos_ids = tuple(eos_token_ids(tokenizer, model_dir))
            except (OSError, ValueError) as exc:  # ModelDirError is a ValueError: the directory is not usable
                raise FailedPrecondition(f"cannot load the base model in {model_dir}: {exc}") from None
            base = BaseModel(model_dir=model_dir, model=model, tokenizer=tokenizer, eos_ids=eos_ids,
                             dtype=self.dtype, device=self.device)
            with self._lock:
                self._bases[model_dir] = base
            return base

    def loaded_models(self) -> list[str]:
        with self._lock:
            return list(self._bases)

    # ---- adapters ----------------------------------------------------------------------------------------------

    def load_adapter(self, adapter_id: str, model_dir: str, adapter_dir: str | Path, *, eager: bool = True) -> None:
        """Know adapter_id by its PEFT directory; eager: load its weights now rather than on first use (a no-op when
        they are loaded already). Raises FailedPrecondition when the files do not fit the base model."""
        with self._lock:
            entry = _Adapter(model_dir, Path(adapter_dir))
            known = self._adapters.setdefault(adapter_id, entry)
        assert known == entry, f"adapter {adapter_id} is known as {known}, not {entry}"
        if not eager:
            return
        base = self.base(model_dir)
        with base.lock:
            self._make_resident(base, adapter_id)
        self._evict_over_limit(keep=adapter_id)

    def unload_adapter(self, adapter_id: str) -> bool:
        """Forget an adapter and free its weights. False when it was not known."""
        with self._lock:
            entry = self._adapters.pop(adapter_id, None)
            base = None if entry is None else self._bases.get(entry.model_dir)
        if entry is None:
            return False
        if base is not None:
            with base.lock:
                self._drop_resident(base, adapter_id)
        return True

    def loaded_adapters(self) -> list[str]:
        """Ids of the adapters whose weights are loaded now."""
        with self._lock:
            return list(self._lru)

    def _make_resident(self, base: BaseModel, adapter_id: str) -> None:
        """Under base.lock: load the adapter's weights if they are not in the model, and mark it most recent."""
        if adapter_id not in base.resident:
            with self._lock:
                entry = self._adapters.get(adapter_id)
            if entry is None:
                raise NotFound(f"adapter '{adapter_id}' is not loaded")
            log.info("loading adapter %s from %s", adapter_id, entry.adapter_dir)
            try:
                load_peft_adapter(base.model, entry.adapter_dir, adapter_id)
            except ValueError as exc:  # files that do not fit the base model: forget them
                with self._lock:
                    self._adapters.pop(adapter_id, None)
                raise FailedPrecondition(f"cannot load adapter '{adapter_id}' on {base.model_dir}: {exc}") from None
            base.resident.add(adapter_id)
        with self._lock:
            self._lru[adapter_id] = None
            self._lru.move_to_end(adapter_id)

    def _drop_resident(self, base: BaseModel, adapter_id: str) -> None:
        """Under base.lock."""
        if adapter_id in base.resident:
            remove_adapter(base.model, adapter_id)
            base.resident.discard(adapter_id)
        with self._lock:
            self._lru.pop(adapter_id, None)

    def _evict_over_limit(self, keep: str) -> None:
        """Free least recently used adapters until at most max_loaded_adapters hold weights. Called with no base lock
        held; the limit may be exceeded by concurrent loads for the moment between their load and this call."""
        while True:
            with self._lock:
                victims = [a for a in self._lru if a != keep]
                if len(self._lru) <= self.max_loaded_adapters or not victims:
                    return
                victim = victims[0]
                base = self._bases[self._adapters[victim].model_dir] if victim in self._adapters else None
            if base is None:
                with self._lock:
                    self._lru.pop(victim, None)
                continue
            log.info("evicting adapter %s (least recently used)", victim)
            with base.lock:
                self._drop_resident(base, victim)

    # ---- generation --------------------------------------------------------------------------------------------

    def generate(self, model_dir: str, adapter_id: str | None, prompt_ids: Sequence[int],
                 params: SamplingParams) -> list[SampledSequence]:
        """params.n samples of the prompt from the base model, or from it with adapter adapter_id (which must have
        been given to load_adapter). Raises InvalidArgument for params that do not fit the model."""
        sampling.validate_params(params)
        base = self.base(model_dir)
        sampling.validate_prompt(prompt_ids, params, vocab_size=base.vocab_size, max_context=base.max_context)
        if adapter_id is not None:
            with self._lock:
                entry = self._adapters.get(adapter_id)
            if entry is None or entry.model_dir != model_dir:
                raise NotFound(f"adapter '{adapter_id}' is not loaded on {model_dir}")
        with base.lock:
            if adapter_id is not None:
                self._make_resident(base, adapter_id)
            set_active_adapter(base.model, adapter_id)
            out = _generate(base, list(prompt_ids), params)
        if adapter_id is not None:
            self._evict_over_limit(keep=adapter_id)
        return out

    def close(self) -> None:
        with self._lock:
            self._bases.clear()
            self._adapters.clear()
            self._lru.clear()


@torch.inference_mode()
def _generate(base: BaseModel, prompt_ids: list[int], p: SamplingParams) -> list[SampledSequence]:
    model, device = base.model, base.device
    generator = sampling.make_generator(p.seed, device)
    stop_ids = {*base.eos_ids, *p.stop_token_ids}
    rows = [SequenceBuilder(base.tokenizer, p, stop_ids) for _ in range(p.n)]
    # The last sampled token is never fed back, so the cache needs P + max_tokens - 1 slots.
    cache = KVCache.allocate(model.args, 1, len(prompt_ids) + p.max_tokens - 1, base.dtype, device)
    prompt_1P = torch.tensor([prompt_ids], dtype=torch.long, device=device)
    logits_BV = model(prompt_1P, cache=cache)[:, -1].expand(p.n, -1)
    cache = cache.select(torch.zeros(p.n, dtype=torch.long, device=device))
    active = list(range(p.n))  # row index of each batch position
    while True:
        tokens_B, logprobs_B = sampling.sample(logits_BV, p, generator)
        # .tolist() syncs: the host decides which rows go on (stop ids, stop strings, lengths).
        keep = [i for i, (t, lp) in enumerate(zip(tokens_B.tolist(), logprobs_B.tolist()))
                if not rows[active[i]].append(t, lp)]
        if not keep:
            break
        if len(keep) < len(active):
            keep_B = torch.tensor(keep, dtype=torch.long, device=device)
            cache, tokens_B = cache.select(keep_B), tokens_B.index_select(0, keep_B)
            active = [active[i] for i in keep]
        logits_BV = model(tokens_B[:, None], cache=cache)[:, -1]
    return [r.seq for r in rows]
