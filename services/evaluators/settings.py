"""The evaluator sandbox's settings, shared by every process that runs evaluators (the scheduler for uploads and
"test on N rows", the workers for jobs): env TRAINYARD_EVALUATOR_*, see services/common/config.py."""
from __future__ import annotations

from pydantic import Field

from services.common.config import TrainyardSettings
from services.evaluators.sandbox import Limits


class EvaluatorSettings(TrainyardSettings):
    # Per call of the evaluator (one row, or one reset/step of an environment): CPU seconds, address space of the
    # sandbox, wall clock; and the processes the sandbox may hold. A breach kills the sandbox; the row gets the reason.
    evaluator_cpu_s: float = Field(default=10.0, gt=0)
    evaluator_memory_mb: int = Field(default=1024, ge=64)
    evaluator_wall_s: float = Field(default=30.0, gt=0)
    evaluator_max_processes: int = Field(default=16, ge=1)
    # Upload size cap (the source file or the .zip / .tar.gz package), and how many rows one TestEvaluator may run.
    max_evaluator_kb: int = Field(default=1024, ge=1, le=1024)
    max_evaluator_test_rows: int = Field(default=100, ge=1, le=100)
    # Quota: evaluator versions an account holds (each up to max_evaluator_kb in the object store).
    max_evaluator_versions_per_account: int = Field(default=1000, ge=1)

    def evaluator_limits(self) -> Limits:
        return Limits(cpu_s=self.evaluator_cpu_s, memory_mb=self.evaluator_memory_mb, wall_s=self.evaluator_wall_s,
                      max_processes=self.evaluator_max_processes)
