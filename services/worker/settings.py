"""The worker's settings: the job queue's (services/common/jobqueue.py) and how many ranks a managed job trains on.

managed_nproc = 1 (the default) trains in the worker process itself. With more, the recipe starts a torchrun group of
managed_nproc ranks on this machine for each attempt (services/worker/group.py), laid out by managed_parallel, the
ParallelDims knobs (services/trainer/engine/parallel/dims.py) as a mapping, e.g. {"dp_shard": 2} or, on YAML,
`managed_parallel: {dp_replicate: 2, dp_shard: 2}`; knobs left out take ParallelDims' defaults (dp_shard -1: what
the others leave of managed_nproc). Checked when the worker starts: a layout that does not fit fails with the setting
named (e.g. "managed_parallel.cp").
"""
from __future__ import annotations

import socket
from typing import Literal

from pydantic import Field, model_validator

from services.common.errors import InvalidArgument
from services.common.jobqueue import JobQueueSettings
from services.evaluators.settings import EvaluatorSettings


class WorkerSettings(JobQueueSettings, EvaluatorSettings):
    # Ranks (processes; one accelerator each where there are accelerators) a managed job trains on: 1 = in the worker
    # process, more = a torchrun group started for each attempt (docs/distributed.md, "Managed jobs on several ranks").
    managed_nproc: int = Field(default=1, ge=1)
    # The group's parallel layout: ParallelDims knobs (dp_replicate, dp_shard, cp, ep) whose product is managed_nproc.
    managed_parallel: dict[str, int] = Field(default_factory=dict)
    # How often the worker looks at the group's events and its job's stop flag while the group trains.
    managed_poll_s: float = Field(default=0.1, gt=0)
    # The device inventory (services/common/resources.py): the machine's name in it (its workers share its devices;
    # default: the host name) and, on a machine without GPUs, how many CPU slots it offers jobs.
    worker_host: str = ""
    cpu_slots: int = Field(default=4, ge=1, le=1024)
    # Where an RFT job samples (docs/rft.md, "Where the policy is served"): "service" = a deployment of the rollout
    # service following the job's weight lineage on the weight-sync service; "process" = a rollout engine in a
    # process of the job's own; "auto" = service when rollout_url and weightsync_url are both set (environment or
    # file, as docker-compose.yml does), else process (the embedded quickstart).
    rft_rollout: Literal["auto", "process", "service"] = "auto"

    def rft_rollout_service(self) -> bool:
        if self.rft_rollout == "auto":
            return {"rollout_url", "weightsync_url"} <= self.model_fields_set
        return self.rft_rollout == "service"

    def machine(self) -> str:
        return self.worker_host or socket.gethostname()

    @model_validator(mode="after")
    def _check_parallel(self) -> "WorkerSettings":
        if self.managed_nproc == 1:  # in process: nothing to lay out (and torch stays unimported until a job runs)
            if self.managed_parallel:
                raise InvalidArgument("a layout needs managed_nproc > 1 (1 trains in the worker process)",
                                      field="managed_parallel")
        else:
            self.managed_dims()
        return self

    def managed_dims(self):
        """managed_parallel checked against managed_nproc, as ParallelDims (InvalidArgument names the knob as
        managed_parallel.<knob>)."""
        from services.trainer.engine.parallel.dims import from_mapping

        for knob in ("tp", "pp"):
            if self.managed_parallel.get(knob, 1) != 1:
                raise InvalidArgument(f"{knob} is not available to managed jobs (they train with data, context and "
                                      "expert parallelism)", field=f"managed_parallel.{knob}")
        return from_mapping(self.managed_parallel, world_size=self.managed_nproc, field_prefix="managed_parallel.")
