"""Database rows -> API messages for the scheduler."""
from __future__ import annotations

from google.protobuf import json_format, struct_pb2

from services.common import schema
from services.common.methods import HYPERPARAMS
from services.common.protoconv import ts
from services.scheduler.dataset_formats import DatasetFormat
from trainyard.methods import METHODS, proto as method_proto
from trainyard.methods.spec import as_dict
from trainyard.v1 import scheduler_pb2 as pb

DATASET_FORMATS = {
    DatasetFormat.SFT_CHAT: pb.DATASET_FORMAT_SFT_CHAT,
    DatasetFormat.SFT_PROMPT_COMPLETION: pb.DATASET_FORMAT_SFT_PROMPT_COMPLETION,
    DatasetFormat.DPO: pb.DATASET_FORMAT_DPO,
    DatasetFormat.RFT: pb.DATASET_FORMAT_RFT,
}
DATASET_FORMATS_BACK = {v: k for k, v in DATASET_FORMATS.items()}

JOB_STATUS = {
    "queued": pb.JOB_STATUS_QUEUED,
    "running": pb.JOB_STATUS_RUNNING,
    "succeeded": pb.JOB_STATUS_SUCCEEDED,
    "failed": pb.JOB_STATUS_FAILED,
    "cancelled": pb.JOB_STATUS_CANCELLED,
}
JOB_STATUS_BACK = {v: k for k, v in JOB_STATUS.items()}

DEPLOYMENT_STATUS = {
    "deploying": pb.DEPLOYMENT_STATUS_DEPLOYING,
    "ready": pb.DEPLOYMENT_STATUS_READY,
    "failed": pb.DEPLOYMENT_STATUS_FAILED,
    "deleted": pb.DEPLOYMENT_STATUS_DELETED,
}
CHECKPOINT_KIND = {"lora_adapter": pb.CHECKPOINT_KIND_LORA_ADAPTER, "full": pb.CHECKPOINT_KIND_FULL}


def account(a: schema.Account) -> pb.Account:
    return pb.Account(id=a.id, name=a.name, created_at=ts(a.created_at))


def api_key(k: schema.ApiKey) -> pb.ApiKey:
    return pb.ApiKey(id=k.id, name=k.name, prefix=k.prefix, created_at=ts(k.created_at), revoked_at=ts(k.revoked_at))


def model(m: schema.Model) -> pb.Model:
    return pb.Model(name=m.name, path=m.path, architecture=m.architecture, num_parameters=m.num_parameters,
                    num_layers=m.num_layers, hidden_size=m.hidden_size, vocab_size=m.vocab_size,
                    max_position_embeddings=m.max_position_embeddings, shared=m.scope == schema.SHARED_SCOPE,
                    created_at=ts(m.created_at), torch_dtype=m.torch_dtype)


def dataset(d: schema.Dataset) -> pb.Dataset:
    return pb.Dataset(id=d.id, name=d.name, format=DATASET_FORMATS[DatasetFormat(d.format)], num_rows=d.num_rows,
                      size_bytes=d.size_bytes, sha256=d.sha256, created_at=ts(d.created_at), filename=d.filename)


def row_struct(row: dict) -> struct_pb2.Struct:
    s = struct_pb2.Struct()
    json_format.ParseDict(row, s)
    return s


def job_spec(method: str, base_model: str, dataset_id: str, display_name: str, config: dict) -> pb.JobSpec:
    """A job's spec with every setting set (config: the settings as stored on the job row)."""
    m = METHODS[method]
    spec = pb.JobSpec(method=m.proto, base_model=base_model, dataset_id=dataset_id, display_name=display_name)
    method_proto.write(m.settings, as_dict(HYPERPARAMS[method].from_json(config)), getattr(spec, m.config))
    return spec


def job(j: schema.Job) -> pb.Job:
    spec = job_spec(j.method, j.base_model, j.dataset_id, j.display_name, j.config)
    spec.resources.trainer_devices, spec.resources.rollout_devices = j.trainer_devices, j.rollout_devices
    spec.priority = j.priority
    return pb.Job(
        id=j.id, spec=spec, status=JOB_STATUS[j.status], created_at=ts(j.created_at), started_at=ts(j.started_at),
        finished_at=ts(j.finished_at), error=j.error, step=j.step, total_steps=j.total_steps, attempts=j.attempts,
        cancel_requested=j.cancel_requested, output_checkpoint_id=j.output_checkpoint_id,
        latest_metrics={k: float(v) for k, v in (j.latest_metrics or {}).items()},
    )


def plan(spec: pb.JobSpec, p: dict) -> pb.JobPlan:
    """A planner answer (services/trainer/plan.py) as the API's JobPlan."""
    fields = {k: v for k, v in p.items() if k != "memory"}
    return pb.JobPlan(spec=spec, memory=pb.MemoryEstimate(**p["memory"]), **fields)


def metric(m: schema.JobMetric) -> pb.MetricPoint:
    return pb.MetricPoint(step=m.step, values={k: float(v) for k, v in m.data.items()}, time=ts(m.created_at))


def job_log(entry: schema.JobLog) -> pb.JobLog:
    return pb.JobLog(level=entry.level, message=entry.message, time=ts(entry.created_at), id=entry.id)


def checkpoint(c: schema.Checkpoint, lora_rank: int = 0) -> pb.Checkpoint:
    return pb.Checkpoint(
        id=c.id, job_id=c.job_id or "", step=c.step, kind=CHECKPOINT_KIND.get(c.kind, pb.CHECKPOINT_KIND_UNSPECIFIED), base_model=c.base_model,
        files=[pb.CheckpointFile(path=f["path"], sha256=f["sha256"], size_bytes=f["size_bytes"]) for f in c.files],
        final=c.final, metrics={k: float(v) for k, v in (c.metrics or {}).items()}, created_at=ts(c.created_at),
        session_id=c.session_id or "", name=c.name,
        checkpoint_type="sampler" if c.weight_version_id else "training", weight_version_id=c.weight_version_id,
        size_bytes=sum(int(f["size_bytes"]) for f in [*c.files, *(c.state or [])]), public=c.public,
        user_metadata=c.user_metadata or {}, expires_at=ts(c.expires_at), account_id=c.account_id,
        lora_rank=lora_rank,
    )


def deployment(d: schema.Deployment, job_id: str = "") -> pb.Deployment:
    return pb.Deployment(id=d.id, name=d.name, checkpoint_id=d.checkpoint_id or "", base_model=d.base_model,
                         status=DEPLOYMENT_STATUS[d.status], error=d.error, created_at=ts(d.created_at),
                         job_id=job_id, lineage=d.lineage or "")


def evaluator(e: schema.Evaluator) -> pb.Evaluator:
    return pb.Evaluator(id=e.id, name=e.name, version=e.version, kind=e.kind, filename=e.filename,
                        size_bytes=e.size_bytes, sha256=e.sha256, created_at=ts(e.created_at))


def evaluator_test(report) -> pb.EvaluatorTestResponse:
    """A services.evaluators.store.EvaluationReport as the API's answer."""
    results = [pb.EvaluatorTestResult(row=r.row, completion=r.completion, ok=r.reward is not None,
                                      reward=r.reward or 0.0, error=r.error, observation=r.observation)
               for r in report.results]
    return pb.EvaluatorTestResponse(evaluator=evaluator(report.evaluator) if report.evaluator else None,
                                    results=results,
                                    summary=pb.EvaluatorTestSummary(elapsed_s=report.elapsed_s, **report.summary),
                                    output_tail=report.stderr_tail)
