"""The DPO recipe on a worker set up for torchrun groups: refused with a message naming the setting, before any
data is read (DPO trains in one process)."""
from __future__ import annotations

import pytest

from services.common.methods.dpo import DpoHyperparams
from services.common.schema import Job
from services.worker.job import JobContext
from services.worker.recipes import recipe
from services.worker.settings import WorkerSettings


def test_a_group_worker_refuses_a_dpo_job(tmp_path):
    settings = WorkerSettings(managed_nproc=2, managed_parallel={"dp_shard": 2})
    job = Job(id="job_1", method="dpo", config=DpoHyperparams().to_json(), model_path="unused", base_model="m")
    ctx = JobContext(job=job, ledger=None, blobs=None, db=None, worker_id="w", heartbeat=None, work=tmp_path,
                     latest_checkpoint=None, settings=settings)
    with pytest.raises(ValueError, match=r"DPO jobs train in one process.*managed_nproc=2 \(TRAINYARD_MANAGED_NPROC\)"):
        recipe("dpo")(ctx)
