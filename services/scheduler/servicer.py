"""gRPC adapters for the scheduler's cores. No logic and no try/except here: errors map in the interceptor."""
from __future__ import annotations

import hashlib
import re

from services.common.auth import current_caller
from services.common.errors import InvalidArgument
from services.common.protoconv import opt
from services.scheduler import convert
from services.scheduler.accounts import AccountCore
from services.scheduler.checkpoints import CheckpointCore
from services.common.streams import split_header
from services.scheduler.datasets import DatasetStore, UploadHeader
from services.scheduler.deployments import DeploymentCore
from services.scheduler.devices import DeviceCore


from services.scheduler.evaluators import EvaluatorCore
from services.scheduler.exports import ExportCore
from services.scheduler.jobs import JobCore, NewJob
from trainyard.methods import BY_PROTO, proto as method_proto
from trainyard.v1 import common_pb2, scheduler_pb2 as pb, scheduler_pb2_grpc as rpc


# A page token is the offset of the page's first row: ASCII digits, at most 18 of them so it fits the database's
# 64-bit OFFSET (int() would also take "+5", " 5", "5_0", other scripts' digits and numbers past 2**63).
PAGE_TOKEN = re.compile(r"[0-9]{1,18}")


def page(req: common_pb2.PageRequest) -> tuple[int, int]:
    size = req.page_size or 50
    if not 0 < size <= 500:
        raise InvalidArgument(f"must be between 1 and 500, got {req.page_size}", field="page.page_size")
    if req.page_token and not PAGE_TOKEN.fullmatch(req.page_token):
        raise InvalidArgument("not a token returned by a previous call", field="page.page_token")
    return int(req.page_token or 0), size


def token(next_offset: int | None) -> str:
    return "" if next_offset is None else str(next_offset)


class AccountServicer(rpc.AccountServiceServicer):
    def __init__(self, core: AccountCore):
        self.core = core

    def WhoAmI(self, request, context):
        return convert.account(self.core.account(current_caller().account_id))

    def CreateApiKey(self, request, context):
        key, secret = self.core.create_key(current_caller().account_id, request.name)
        return pb.CreateApiKeyResponse(key=convert.api_key(key), secret=secret)

    def ListApiKeys(self, request, context):
        return pb.ListApiKeysResponse(keys=[convert.api_key(k) for k in self.core.list_keys(current_caller().account_id)])

    def RevokeApiKey(self, request, context):
        caller = current_caller()
        return convert.api_key(self.core.revoke_key(caller.account_id, caller.key_id, request.id))


class ModelServicer(rpc.ModelServiceServicer):
    def __init__(self, core: AccountCore):
        self.core = core

    def ImportModel(self, request, context):
        return convert.model(self.core.import_model(current_caller().account_id, request.name, request.path))

    def ListModels(self, request, context):
        return pb.ListModelsResponse(models=[convert.model(m) for m in self.core.list_models(current_caller().account_id)])

    def GetModel(self, request, context):
        return convert.model(self.core.get_model(current_caller().account_id, request.name))


def _header(h: pb.UploadDatasetHeader) -> UploadHeader:
    if h.format not in convert.DATASET_FORMATS_BACK and h.format != pb.DATASET_FORMAT_UNSPECIFIED:
        raise InvalidArgument(f"unknown format {h.format}", field="header.format")
    if len(h.name) > 256:
        raise InvalidArgument("at most 256 characters", field="header.name")
    if len(h.filename) > 512:
        raise InvalidArgument("at most 512 characters", field="header.filename")
    return UploadHeader(name=h.name, format=convert.DATASET_FORMATS_BACK.get(h.format), filename=h.filename)


class DatasetServicer(rpc.DatasetServiceServicer):
    def __init__(self, store: DatasetStore):
        self.store = store

    def UploadDataset(self, request_iterator, context):
        header, chunks = split_header(request_iterator)
        ds, dedup, mapping = self.store.upload_mapped(current_caller().account_id, _header(header), chunks)
        return pb.UploadDatasetResponse(dataset=convert.dataset(ds), deduplicated=dedup,
                                        mapping=mapping.summary if mapping else "")

    def ValidateDataset(self, request_iterator, context):
        current_caller()
        header, chunks = split_header(request_iterator)
        r = self.store.validate(_header(header), chunks)
        return pb.ValidationReport(
            valid=r.valid, format=convert.DATASET_FORMATS.get(r.format, pb.DATASET_FORMAT_UNSPECIFIED),
            num_rows=r.num_rows, size_bytes=r.size_bytes, truncated=r.truncated,
            mapping=r.mapping.summary if r.mapping else "",
            violations=[common_pb2.FieldViolation(row=e.row, field=e.field, reason=e.reason) for e in r.errors])

    def ListDatasets(self, request, context):
        offset, size = page(request.page)
        rows, nxt = self.store.list(current_caller().account_id, offset, size)
        return pb.ListDatasetsResponse(datasets=[convert.dataset(d) for d in rows], next_page_token=token(nxt))

    def GetDataset(self, request, context):
        return convert.dataset(self.store.get(current_caller().account_id, request.id))

    def PreviewDataset(self, request, context):
        ds, rows = self.store.preview(current_caller().account_id, request.id, request.offset, request.limit)
        return pb.PreviewDatasetResponse(dataset=convert.dataset(ds), rows=[convert.row_struct(r) for r in rows])

    def DeleteDataset(self, request, context):
        return convert.dataset(self.store.delete(current_caller().account_id, request.id))


def _enum(known: dict, value: int, field: str):
    """None for UNSPECIFIED (take the default), the mapped value if known, INVALID_ARGUMENT otherwise."""
    if value == 0:
        return None
    if value not in known:
        raise InvalidArgument(f"unknown value {value}", field=field)
    return known[value]


def _new_job(spec: pb.JobSpec) -> NewJob:
    """The request's method (looked up in trainyard.methods.METHODS) and the settings its config message sets."""
    method = BY_PROTO.get(spec.method)
    if method is None:  # the core names the known methods
        return NewJob("", spec.base_model, spec.dataset_id, spec.display_name, {})
    if spec.WhichOneof("config") not in (None, method.config):
        raise InvalidArgument(f"a {method.name} job takes spec.{method.config}", field="spec.config")
    given = method_proto.read(method.settings, getattr(spec, method.config))
    r = spec.resources
    return NewJob(method.name, spec.base_model, spec.dataset_id, spec.display_name, given,
                  trainer_devices=r.trainer_devices if r.HasField("trainer_devices") else None,
                  rollout_devices=r.rollout_devices if r.HasField("rollout_devices") else None,
                  priority=spec.priority)


class JobServicer(rpc.JobServiceServicer):
    def __init__(self, core: JobCore):
        self.core = core

    def CreateJob(self, request, context):
        return convert.job(self.core.create(current_caller().account_id, _new_job(request.spec)))

    def PlanJob(self, request, context):
        checked, plan = self.core.plan(current_caller().account_id, _new_job(request.spec))
        spec = convert.job_spec(checked.method.name, checked.model.name, checked.dataset.id,
                                request.spec.display_name, checked.settings.to_json())
        return convert.plan(spec, plan)

    def GetTokenStats(self, request, context):
        model, stats = self.core.token_stats(current_caller().account_id, request.dataset_id, request.base_model,
                                             request.max_seq_len)
        return pb.TokenStats(dataset_id=request.dataset_id, base_model=model.name, **stats)

    def GetJob(self, request, context):
        return convert.job(self.core.get(current_caller().account_id, request.id))

    def ListJobs(self, request, context):
        offset, size = page(request.page)
        status = _enum(convert.JOB_STATUS_BACK, request.status, "status")
        rows, nxt = self.core.list(current_caller().account_id, status, offset, size)
        return pb.ListJobsResponse(jobs=[convert.job(j) for j in rows], next_page_token=token(nxt))

    def WatchJob(self, request, context):
        for item in self.core.watch(current_caller().account_id, request.id, request.from_step, context.is_active):
            if item.kind == "job":
                yield pb.JobEvent(job=convert.job(item.row))
            elif item.kind == "metric":
                yield pb.JobEvent(metric=convert.metric(item.row))
            else:
                yield pb.JobEvent(log=convert.job_log(item.row))

    def CancelJob(self, request, context):
        return convert.job(self.core.cancel(current_caller().account_id, request.id))

    def ResumeJob(self, request, context):
        return convert.job(self.core.resume(current_caller().account_id, request.id))

    def ListJobMetrics(self, request, context):
        points = self.core.metrics(current_caller().account_id, request.id)
        return pb.ListJobMetricsResponse(points=[convert.metric(m) for m in points])

    def ListJobLogs(self, request, context):
        logs = self.core.logs(current_caller().account_id, request.id, request.after_id, request.limit)
        return pb.ListJobLogsResponse(logs=[convert.job_log(entry) for entry in logs])


class CheckpointServicer(rpc.CheckpointServiceServicer):
    def __init__(self, core: CheckpointCore, exports: ExportCore):
        self.core = core
        self.exports = exports

    def ListCheckpoints(self, request, context):
        rows, total = self.core.list(current_caller().account_id, request.job_id, request.session_id, request.limit,
                                     request.offset, request.weight_version_id)
        return pb.ListCheckpointsResponse(checkpoints=[convert.checkpoint(c) for c in rows], total=total)

    def GetCheckpoint(self, request, context):
        ckpt = self.core.get(current_caller().account_id, request.id)
        return convert.checkpoint(ckpt, lora_rank=self.core.lora_rank(ckpt))

    def DownloadCheckpoint(self, request, context):
        for f, offset, data in self.core.chunks(current_caller().account_id, request.id):
            yield common_pb2.FileChunk(path=f["path"], offset=offset, data=data, file_size=f["size_bytes"],
                                       sha256=hashlib.sha256(data).hexdigest())

    def DeleteCheckpoint(self, request, context):
        return convert.checkpoint(self.core.delete(current_caller().account_id, request.id))

    def SetCheckpointTtl(self, request, context):
        return convert.checkpoint(self.core.set_ttl(current_caller().account_id, request.id,
                                                    opt(request, "ttl_seconds")))

    def PublishCheckpoint(self, request, context):
        return convert.checkpoint(self.core.set_public(current_caller().account_id, request.id, True))

    def UnpublishCheckpoint(self, request, context):
        return convert.checkpoint(self.core.set_public(current_caller().account_id, request.id, False))

    def ExportMergedModel(self, request, context):
        for path, offset, data, size in self.exports.merged_chunks(current_caller().account_id, request.id):
            yield common_pb2.FileChunk(path=path, offset=offset, data=data, file_size=size,
                                       sha256=hashlib.sha256(data).hexdigest())


class DeploymentServicer(rpc.DeploymentServiceServicer):
    def __init__(self, core: DeploymentCore):
        self.core = core

    def CreateDeployment(self, request, context):
        caller = current_caller()
        dep = self.core.create(caller.account_id, caller.api_key, request.name, request.checkpoint_id, request.job_id,
                               request.lineage)
        return convert.deployment(dep, self.core.job_of(dep))

    def ListDeployments(self, request, context):
        deps = self.core.list(current_caller().account_id, request.include_deleted)
        return pb.ListDeploymentsResponse(deployments=[convert.deployment(d, self.core.job_of(d)) for d in deps])

    def GetDeployment(self, request, context):
        dep = self.core.get(current_caller().account_id, request.id)
        return convert.deployment(dep, self.core.job_of(dep))

    def RepointDeployment(self, request, context):
        caller = current_caller()
        dep = self.core.repoint(caller.account_id, caller.api_key, request.id, request.checkpoint_id)
        return convert.deployment(dep, self.core.job_of(dep))

    def DeleteDeployment(self, request, context):
        caller = current_caller()
        dep = self.core.delete(caller.account_id, caller.api_key, request.id)
        return convert.deployment(dep, self.core.job_of(dep))


class ResourceServicer(rpc.ResourceServiceServicer):
    def __init__(self, core: DeviceCore):
        self.core = core

    def ListDevices(self, request, context):
        r = self.core.list(current_caller().account_id)
        devices = []
        for v in r.devices:
            d = v.device
            devices.append(pb.Device(id=d.id, host=d.host, kind=d.kind, index=d.index, name=d.name,
                                     memory_bytes=d.memory_bytes, free=d.job_id is None,
                                     job_id=d.job_id if v.mine else "", role=d.role if v.mine else "",
                                     held_by_other_account=d.job_id is not None and not v.mine, live=v.live,
                                     heartbeat_at=convert.ts(d.heartbeat_at)))
        return pb.ListDevicesResponse(
            devices=devices,
            quota=pb.DeviceQuota(max_devices=r.max_devices, devices_in_use=r.devices_in_use,
                                 max_queued_jobs=r.max_queued_jobs, queued_jobs=len(r.queued)),
            queue=[pb.DeviceQueueEntry(job_id=j.id, priority=j.priority, devices=j.trainer_devices + j.rollout_devices,
                                       wait_reason=j.wait_reason) for j in r.queued])


class EvaluatorServicer(rpc.EvaluatorServiceServicer):
    def __init__(self, core: EvaluatorCore):
        self.core = core

    def UploadEvaluator(self, request, context):
        row = self.core.store.upload(current_caller().account_id, request.name, request.filename, request.content)
        return convert.evaluator(row)

    def ListEvaluators(self, request, context):
        offset, size = page(request.page)
        rows, nxt = self.core.store.list(current_caller().account_id, request.name, offset, size)
        return pb.EvaluatorListResponse(evaluators=[convert.evaluator(e) for e in rows], next_page_token=token(nxt))

    def GetEvaluator(self, request, context):
        return convert.evaluator(self.core.store.get(current_caller().account_id, request.evaluator))

    def TestEvaluator(self, request, context):
        report = self.core.test(current_caller().account_id, request.evaluator, request.rows, request.completions,
                                request.dataset_id, request.num_rows, request.content)
        return convert.evaluator_test(report)

    def GetEvaluatorSource(self, request, context):
        row, content = self.core.store.source(current_caller().account_id, request.evaluator)
        return pb.EvaluatorSource(evaluator=convert.evaluator(row), content=content)
