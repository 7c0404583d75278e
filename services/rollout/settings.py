"""Rollout service settings (env TRAINYARD_*, see services/common/config.py)."""
from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field, field_validator

from services.common.config import TrainyardSettings
from services.rollout.engine_core import EngineConfig

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class RolloutSettings(TrainyardSettings):
    # Serving threads: a unary Sample waits in one for the engine, so they bound the requests in flight, and one
    # account's calls are bounded below them (the engine batches up to max_num_seqs sequences; a sampling loop with
    # more requests in flight than the quota asks for n samples per request, or queues them).
    grpc_workers: int = Field(default=256, ge=1)
    max_concurrent_calls_per_account: int = Field(default=128, ge=1)
    # LoRA adapters holding weights at once (least recently used are freed first and reloaded on their next use).
    max_loaded_adapters: int = Field(default=8, ge=1)
    # Full-weight versions sampled by path ("trainyard://weights/<id>") held in memory at once, each a copy of the
    # base model (the least recently used idle one is unloaded first and reloaded from disk on its next use).
    max_pinned_full_versions: int = Field(default=2, ge=1)
    # Lineage deployments loading a new weight version at once (each load in a thread of a pool this size; the
    # others wait their turn). Watching their lineages takes no thread per deployment.
    weight_load_workers: int = Field(default=4, ge=1)
    # Precision and device of the base weights; adapters stay float32 (as peft keeps them).
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    device: str = Field(default="cpu", description="torch device for the models, e.g. 'cpu' or 'cuda:0'")
    # Continuous batching (services/rollout/batch_scheduler.py): sequences and tokens in one engine step; a longer
    # prefill is split into chunks of the remaining token budget.
    max_num_seqs: int = Field(default=256, ge=1)
    max_num_batched_tokens: int = Field(default=2048, ge=1)
    # Paged KV cache per base model: block size in tokens, and the pool size in blocks (0: from kv_cache_mb).
    kv_block_size: int = Field(default=16, ge=1)
    kv_cache_blocks: int = Field(default=0, ge=0)
    kv_cache_mb: int = Field(default=1024, ge=1)
    # Batch-invariant numerics: a request's tokens and logprobs are bitwise the same whatever else is batched with it
    # (kernels/batch_invariant.py; slower).
    deterministic: bool = False
    # The OpenAI-compatible HTTP endpoint (services/rollout/openai_http.py, docs/openai.md), served by this process
    # next to gRPC on `host`. 0 (the default) turns it off, so a rollout started in tests or next to another one
    # takes no fixed port; docker-compose.yml sets 8000. At most openai_max_requests engine requests of HTTP calls
    # (one per prompt) are waited on at once, each by a worker thread; more wait for a turn.
    openai_port: int = Field(default=0, ge=0, le=65535)
    openai_max_requests: int = Field(default=512, ge=1)
    # Chat templates (model content, so untrusted) render in worker processes (services/rollout/templates.py): at
    # most chat_template_workers at once, each render stopped past chat_template_cpu_s of CPU (whole seconds) or
    # chat_template_memory_mb of memory, with an error naming the model.
    chat_template_workers: int = Field(default=2, ge=1)
    chat_template_cpu_s: int = Field(default=1, ge=1)
    chat_template_memory_mb: int = Field(default=512, ge=64)

    @field_validator("device")
    @classmethod
    def _device(cls, v: str) -> str:
        try:
            return str(torch.device(v))
        except RuntimeError as exc:
            raise ValueError(f"not a torch device: {v!r} ({exc})") from None

    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    def engine_config(self) -> EngineConfig:
        return EngineConfig(
            max_loaded_adapters=self.max_loaded_adapters, dtype=self.torch_dtype(), device=self.device,
            max_num_seqs=self.max_num_seqs, max_num_batched_tokens=self.max_num_batched_tokens,
            kv_block_size=self.kv_block_size, kv_cache_blocks=self.kv_cache_blocks or None,
            kv_cache_mb=self.kv_cache_mb, deterministic=self.deterministic)

    def adapters_dir(self):
        return self.data_dir / "rollout" / "adapters"
