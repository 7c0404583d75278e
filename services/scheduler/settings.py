"""Scheduler settings (env TRAINYARD_*, see services/common/config.py); the job queue's, which workers share, are
services/common/jobqueue.py's JobQueueSettings."""
from __future__ import annotations

from pathlib import Path

from pydantic import Field

from services.common.jobqueue import JobQueueSettings
from services.evaluators.settings import EvaluatorSettings


class SchedulerSettings(JobQueueSettings, EvaluatorSettings):
    max_dataset_mb: int = Field(default=2048, ge=1)
    # Quotas per account, each refused with RESOURCE_EXHAUSTED naming it: live (not deleted) datasets and the bytes
    # they hold (checked before an upload's bytes travel, and with its size before it is stored), and live
    # deployments (deploying or ready: each holds weights in the rollout).
    max_datasets_per_account: int = Field(default=1000, ge=1)
    max_dataset_mb_per_account: int = Field(default=51_200, ge=1)
    max_deployments_per_account: int = Field(default=32, ge=1)
    # ExportMergedModel runs at most this many merges at once (each holds a whole model in the scheduler's host).
    max_merged_exports: int = Field(default=1, ge=1)
    # A running job whose worker has not heartbeaten for worker_lost_after_s is retried.
    worker_lost_after_s: float = Field(default=30.0, gt=0)
    reaper_interval_s: float = Field(default=5.0, gt=0)
    max_job_attempts: int = Field(default=3, ge=1)
    watch_poll_s: float = Field(default=0.5, gt=0)
    # Models every account can use, registered at scheduler start: {"name": "/path/to/hf/dir"}.
    shared_models: dict[str, str] = Field(default_factory=dict)
    # Where `trainyard models import` (ImportModel) may read model directories from, after resolving symlinks; the
    # data and blob directories are never importable, even inside a root. Empty (the default): no imports at all;
    # docker-compose.yml lists its /models volume. An imported model belongs to the importing account alone.
    model_import_roots: list[Path] = Field(default_factory=list)
    # Build (once) and share the tiny model of each family: tiny-qwen3, tiny-qwen3-moe, tiny-deepseek-v3.
    builtin_tiny_models: bool = True

