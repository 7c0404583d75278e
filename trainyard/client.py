"""Python client for the platform's control plane (scheduler) and sampling (rollout) services.

    from trainyard import Client
    c = Client()                                  # TRAINYARD_URL / TRAINYARD_API_KEY or `trainyard login`
    ds, _ = c.upload_dataset("train.jsonl")
    plan = c.plan_job("sft", "tiny-qwen3", ds.id, learning_rate=3e-3, max_steps=100)   # nothing created
    job = c.create_sft_job("tiny-qwen3", ds.id, learning_rate=3e-3, max_steps=100)
    for event in c.watch_job(job.id): ...
    c.create_deployment("my-model", job_id=job.id)
    print(c.sample("my-model", messages=[{"role": "user", "content": "Hi"}]).sequences[0].text)

Methods return the API's protobuf messages; failures raise trainyard.errors.TrainyardError with the status code, the
message and any field/row violations.
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import time
import zipfile
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import BinaryIO

import grpc
from google.protobuf import json_format

from trainyard.config import ClientConfig
from trainyard.errors import TrainyardError, translate, translate_iter
from trainyard.methods import method as find_method, proto as method_proto
from trainyard.tls import channel_credentials
from trainyard.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc, scheduler_pb2 as pb, scheduler_pb2_grpc as rpc

UPLOAD_CHUNK = 1 << 20  # 1 MiB: far below the default 4 MiB message limit
TERMINAL = (pb.JOB_STATUS_SUCCEEDED, pb.JOB_STATUS_FAILED, pb.JOB_STATUS_CANCELLED)

DATASET_FORMATS = {
    "auto": pb.DATASET_FORMAT_UNSPECIFIED, "sft_chat": pb.DATASET_FORMAT_SFT_CHAT,
    "sft_prompt_completion": pb.DATASET_FORMAT_SFT_PROMPT_COMPLETION, "dpo": pb.DATASET_FORMAT_DPO,
    "rft": pb.DATASET_FORMAT_RFT,
}


def status_name(status: int) -> str:
    return pb.JobStatus.Name(status).removeprefix("JOB_STATUS_").lower()


def format_name(fmt: int) -> str:
    return pb.DatasetFormat.Name(fmt).removeprefix("DATASET_FORMAT_").lower()


def job_spec(method: str, base_model: str, dataset_id: str, display_name: str = "", *,
             trainer_devices: int | None = None, rollout_devices: int | None = None, priority: int = 0,
             **settings) -> pb.JobSpec:
    """A JobSpec of a method (trainyard.methods.METHODS) with the settings given; None leaves a setting unset (the
    server's default). ValueError for an unknown method or setting (listing the known ones) or an unknown choice.
    trainer_devices / rollout_devices: the devices the job holds on one worker (None: the method's default);
    priority: -10..10, higher starts first (docs/resources.md)."""
    m = find_method(method)
    known = [f.name for f in m.fields()]
    unknown = sorted(set(settings) - set(known))
    if unknown:
        raise ValueError(f"unknown {m.name} setting(s) {unknown}; known: {', '.join(known)}")
    spec = pb.JobSpec(method=m.proto, base_model=base_model, dataset_id=dataset_id, display_name=display_name)
    config = getattr(spec, m.config)
    config.SetInParent()  # the oneof names the method even when every setting is left to its default
    method_proto.write(m.settings, settings, config)
    if trainer_devices is not None:
        spec.resources.trainer_devices = trainer_devices
    if rollout_devices is not None:
        spec.resources.rollout_devices = rollout_devices
    spec.priority = priority
    return spec


def deployment_status_name(status: int) -> str:
    return pb.DeploymentStatus.Name(status).removeprefix("DEPLOYMENT_STATUS_").lower()


def _zip_dir(directory: Path) -> bytes:
    """The directory's files (links left out) as a .zip, paths relative to it."""
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as archive:
        for path in sorted(directory.rglob("*")):
            if path.is_file() and not path.is_symlink() and "__pycache__" not in path.parts:
                archive.write(path, path.relative_to(directory).as_posix())
    return out.getvalue()


def _channel(target: str, config: ClientConfig) -> grpc.Channel:
    """Each client gets its own connections (a local subchannel pool: a new Client never inherits another channel's
    failed connection and its reconnect backoff), and reconnect backoff is capped at 2 s so a restarted server is
    reached again within seconds. TLS when the config names a CA or a client certificate (trainyard/tls.py)."""
    size = 64 * 1024 * 1024
    options = [("grpc.max_receive_message_length", size), ("grpc.max_send_message_length", size),
               ("grpc.enable_http_proxy", 0), ("grpc.use_local_subchannel_pool", 1),
               ("grpc.initial_reconnect_backoff_ms", 200), ("grpc.max_reconnect_backoff_ms", 2000)]
    credentials = channel_credentials(config.tls_ca_file, config.tls_client_cert_file, config.tls_client_key_file)
    if credentials is not None:
        return grpc.secure_channel(target, credentials, options=options)
    return grpc.insecure_channel(target, options=options)


class Client:
    def __init__(self, url: str | None = None, api_key: str | None = None, rollout_url: str | None = None,
                 timeout_s: float = 60.0, *, tls_ca_file: str | None = None, tls_client_cert_file: str | None = None,
                 tls_client_key_file: str | None = None):
        self.config = ClientConfig.resolve(url, rollout_url, api_key, tls_ca_file=tls_ca_file,
                                           tls_client_cert_file=tls_client_cert_file,
                                           tls_client_key_file=tls_client_key_file)
        self.timeout_s = timeout_s
        self._channel = _channel(self.config.url, self.config)
        self._rollout_channel = _channel(self.config.rollout_url, self.config)
        self.accounts = rpc.AccountServiceStub(self._channel)
        self.models = rpc.ModelServiceStub(self._channel)
        self.datasets = rpc.DatasetServiceStub(self._channel)
        self.jobs = rpc.JobServiceStub(self._channel)
        self.checkpoints = rpc.CheckpointServiceStub(self._channel)
        self.deployments = rpc.DeploymentServiceStub(self._channel)
        self.resources = rpc.ResourceServiceStub(self._channel)
        self.evaluators = rpc.EvaluatorServiceStub(self._channel)
        self.rollout = rollout_pb2_grpc.RolloutServiceStub(self._rollout_channel)

    def close(self) -> None:
        self._channel.close()
        self._rollout_channel.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def _md(self) -> tuple:
        if not self.config.api_key:
            return ()
        return (("authorization", f"Bearer {self.config.api_key}"),)

    def _kw(self, timeout: float | None = None) -> dict:
        return {"metadata": self._md, "timeout": timeout or self.timeout_s}

    # -- accounts ------------------------------------------------------------------------------------------------
    @translate
    def whoami(self) -> pb.Account:
        return self.accounts.WhoAmI(pb.WhoAmIRequest(), **self._kw())

    @translate
    def create_api_key(self, name: str = "") -> pb.CreateApiKeyResponse:
        return self.accounts.CreateApiKey(pb.CreateApiKeyRequest(name=name), **self._kw())

    @translate
    def list_api_keys(self) -> list[pb.ApiKey]:
        return list(self.accounts.ListApiKeys(pb.ListApiKeysRequest(), **self._kw()).keys)

    @translate
    def revoke_api_key(self, key_id: str) -> pb.ApiKey:
        return self.accounts.RevokeApiKey(pb.RevokeApiKeyRequest(id=key_id), **self._kw())

    # -- models --------------------------------------------------------------------------------------------------
    @translate
    def import_model(self, name: str, path: str | os.PathLike) -> pb.Model:
        return self.models.ImportModel(pb.ImportModelRequest(name=name, path=str(Path(path).absolute())),
                                       **self._kw())

    @translate
    def list_models(self) -> list[pb.Model]:
        return list(self.models.ListModels(pb.ListModelsRequest(), **self._kw()).models)

    @translate
    def get_model(self, name: str) -> pb.Model:
        return self.models.GetModel(pb.GetModelRequest(name=name), **self._kw())

    # -- datasets ------------------------------------------------------------------------------------------------
    def _upload_stream(self, source: str | os.PathLike | bytes | BinaryIO, name: str, fmt: str,
                       progress: Callable[[int], None] | None) -> Iterator[pb.UploadDatasetRequest]:
        if fmt not in DATASET_FORMATS:
            raise ValueError(f"unknown dataset format {fmt!r}; choose from {', '.join(DATASET_FORMATS)}")
        filename = Path(source).name if isinstance(source, (str, os.PathLike)) else getattr(source, "name", "")
        yield pb.UploadDatasetRequest(header=pb.UploadDatasetHeader(
            name=name or Path(filename).stem, format=DATASET_FORMATS[fmt], filename=Path(filename).name))
        if isinstance(source, bytes):
            chunks: Iterable[bytes] = (source[i:i + UPLOAD_CHUNK] for i in range(0, len(source), UPLOAD_CHUNK))
            yield from self._chunks(chunks, progress)
        elif isinstance(source, (str, os.PathLike)):
            with open(source, "rb") as f:
                yield from self._chunks(iter(lambda: f.read(UPLOAD_CHUNK), b""), progress)
        else:
            yield from self._chunks(iter(lambda: source.read(UPLOAD_CHUNK), b""), progress)

    @staticmethod
    def _chunks(chunks: Iterable[bytes], progress) -> Iterator[pb.UploadDatasetRequest]:
        for chunk in chunks:
            yield pb.UploadDatasetRequest(chunk=chunk)
            if progress:
                progress(len(chunk))

    @translate
    def upload_dataset(self, source: str | os.PathLike | bytes | BinaryIO, name: str = "", format: str = "auto",
                       progress: Callable[[int], None] | None = None) -> tuple[pb.Dataset, bool]:
        """Upload a JSONL file (path, bytes or binary file). Returns (dataset, deduplicated)."""
        resp = self.upload_dataset_reply(source, name, format, progress)
        return resp.dataset, resp.deduplicated

    @translate
    def upload_dataset_reply(self, source: str | os.PathLike | bytes | BinaryIO, name: str = "",
                             format: str = "auto",
                             progress: Callable[[int], None] | None = None) -> pb.UploadDatasetResponse:
        """As upload_dataset, the whole reply: also the mapping applied when the rows were in another tool's
        format (ShareGPT, Alpaca), in words."""
        return self.datasets.UploadDataset(self._upload_stream(source, name, format, progress), **self._kw(3600))

    @translate
    def validate_dataset(self, source, format: str = "auto") -> pb.ValidationReport:
        return self.datasets.ValidateDataset(self._upload_stream(source, "", format, None), **self._kw(3600))

    @translate
    def list_datasets(self) -> list[pb.Dataset]:
        out, tok = [], ""
        while True:
            resp = self.datasets.ListDatasets(pb.ListDatasetsRequest(page=common_pb2.PageRequest(page_size=500,
                                                                                        page_token=tok)), **self._kw())
            out.extend(resp.datasets)
            tok = resp.next_page_token
            if not tok:
                return out

    @translate
    def get_dataset(self, dataset_id: str) -> pb.Dataset:
        return self.datasets.GetDataset(pb.GetDatasetRequest(id=dataset_id), **self._kw())

    @translate
    def preview_dataset(self, dataset_id: str, offset: int = 0, limit: int = 10) -> list[dict]:
        resp = self.datasets.PreviewDataset(pb.PreviewDatasetRequest(id=dataset_id, offset=offset, limit=limit),
                                            **self._kw())
        return [json_format.MessageToDict(r) for r in resp.rows]

    @translate
    def delete_dataset(self, dataset_id: str) -> pb.Dataset:
        return self.datasets.DeleteDataset(pb.DeleteDatasetRequest(id=dataset_id), **self._kw())

    # -- evaluators ----------------------------------------------------------------------------------------------
    @translate
    def upload_evaluator(self, source: str | os.PathLike | bytes, name: str, filename: str = "") -> pb.Evaluator:
        """Upload an evaluator as the next version of name: evaluator.py, a .zip / .tar.gz holding it at the top level,
        a directory (sent as a .zip of its files), or the bytes of one of those."""
        if isinstance(source, bytes):
            content = source
        elif Path(source).is_dir():
            content, filename = _zip_dir(Path(source)), filename or f"{Path(source).name}.zip"
        else:
            content, filename = Path(source).read_bytes(), filename or Path(source).name
        return self.evaluators.UploadEvaluator(pb.EvaluatorUploadRequest(name=name, filename=filename,
                                                                         content=content), **self._kw(120))

    @translate
    def list_evaluators(self, name: str = "") -> list[pb.Evaluator]:
        """The account's evaluators, every version (only name's when given), by name then newest version first."""
        out, tok = [], ""
        while True:
            resp = self.evaluators.ListEvaluators(pb.EvaluatorListRequest(
                name=name, page=common_pb2.PageRequest(page_size=500, page_token=tok)), **self._kw())
            out.extend(resp.evaluators)
            tok = resp.next_page_token
            if not tok:
                return out

    @translate
    def get_evaluator(self, evaluator: str) -> pb.Evaluator:
        """evaluator: a name (the latest version), name@N or a version's id."""
        return self.evaluators.GetEvaluator(pb.EvaluatorGetRequest(evaluator=evaluator), **self._kw())

    @translate
    def test_evaluator(self, evaluator: str, rows: Iterable[dict] = (), completions: Iterable[str] = (),
                       dataset_id: str = "", num_rows: int = 0, timeout_s: float = 600, *,
                       content: bytes = b"") -> pb.EvaluatorTestResponse:
        """Run the evaluator in the server's sandbox on rows (dicts, completions[i] for rows[i]) or on the first
        num_rows rows of a dataset: per-row reward or error, and a summary. content (with evaluator ""): an unsaved
        evaluator's source or package instead of a stored one, run and stored nowhere."""
        request = pb.EvaluatorTestRequest(evaluator=evaluator, rows=[json.dumps(r) for r in rows],
                                          completions=list(completions), dataset_id=dataset_id, num_rows=num_rows,
                                          content=content)
        return self.evaluators.TestEvaluator(request, **self._kw(timeout_s))

    @translate
    def get_evaluator_source(self, evaluator: str) -> pb.EvaluatorSource:
        """A version's stored bytes (evaluator.py's source or its package), as uploaded; evaluator: a name (the
        latest version), name@N or a version's id."""
        return self.evaluators.GetEvaluatorSource(pb.EvaluatorGetRequest(evaluator=evaluator), **self._kw())

    # -- jobs ----------------------------------------------------------------------------------------------------
    @translate
    def create_job(self, method: str, base_model: str, dataset_id: str, display_name: str = "",
                   **settings) -> pb.Job:
        """Create a job of a method ("sft"); settings: the method's declared settings (trainyard/methods/, e.g.
        learning_rate, max_steps, lora_rank), unset ones take the server's defaults."""
        spec = job_spec(method, base_model, dataset_id, display_name, **settings)
        return self.jobs.CreateJob(pb.CreateJobRequest(spec=spec), **self._kw())

    @translate
    def list_devices(self) -> pb.ListDevicesResponse:
        """The worker machines' devices (which of your jobs holds each, which are free), your device and queue quota
        and your queued jobs with what each waits for."""
        return self.resources.ListDevices(pb.ListDevicesRequest(), **self._kw())

    def create_sft_job(self, base_model: str, dataset_id: str, display_name: str = "", **settings) -> pb.Job:
        """Create a LoRA SFT job (settings: trainyard/methods/sft.py, e.g. learning_rate, max_steps, lora_rank)."""
        return self.create_job("sft", base_model, dataset_id, display_name, **settings)

    def create_dpo_job(self, base_model: str, dataset_id: str, display_name: str = "", **settings) -> pb.Job:
        """Create a DPO job on a preference dataset (settings: trainyard/methods/dpo.py, e.g. beta, full_parameter,
        learning_rate, max_steps, lora_rank)."""
        return self.create_job("dpo", base_model, dataset_id, display_name, **settings)

    def create_rft_job(self, base_model: str, dataset_id: str, evaluator: str, display_name: str = "",
                       **settings) -> pb.Job:
        """Create an RFT job scored by an evaluator ("name", "name@N" or "builtin:<name>"; settings:
        trainyard/methods/rft.py, e.g. steps, group_size, loss, mode, max_staleness)."""
        return self.create_job("rft", base_model, dataset_id, display_name, evaluator=evaluator, **settings)

    @translate
    def plan_job(self, method: str, base_model: str, dataset_id: str, **settings) -> pb.JobPlan:
        """What create_job would run, without creating anything: the same checks (the same errors), the settings
        resolved, the split, tokens, steps, checkpoints, trainable parameters and a memory estimate."""
        spec = job_spec(method, base_model, dataset_id, **settings)
        return self.jobs.PlanJob(pb.PlanJobRequest(spec=spec), **self._kw(120))

    @translate
    def get_job(self, job_id: str) -> pb.Job:
        return self.jobs.GetJob(pb.GetJobRequest(id=job_id), **self._kw())

    @translate
    def token_stats(self, dataset_id: str, base_model: str, max_seq_len: int = 0) -> pb.TokenStats:
        """Rows, mean / p95 / max tokens and rows over max_seq_len (0: SFT's default) of a dataset under a base
        model's tokenizer, as a job would tokenize them."""
        return self.jobs.GetTokenStats(pb.TokenStatsRequest(dataset_id=dataset_id, base_model=base_model,
                                                            max_seq_len=max_seq_len), **self._kw(120))

    @translate
    def list_jobs(self, status: str | None = None) -> list[pb.Job]:
        st = getattr(pb, f"JOB_STATUS_{status.upper()}") if status else pb.JOB_STATUS_UNSPECIFIED
        out, tok = [], ""
        while True:
            resp = self.jobs.ListJobs(pb.ListJobsRequest(page=common_pb2.PageRequest(page_size=500, page_token=tok),
                                                         status=st), **self._kw())
            out.extend(resp.jobs)
            tok = resp.next_page_token
            if not tok:
                return out

    @translate
    def cancel_job(self, job_id: str) -> pb.Job:
        return self.jobs.CancelJob(pb.CancelJobRequest(id=job_id), **self._kw())

    @translate
    def resume_job(self, job_id: str) -> pb.Job:
        """Queue a failed or cancelled job again (same id): it continues from its latest checkpoint."""
        return self.jobs.ResumeJob(pb.ResumeJobRequest(id=job_id), **self._kw())

    @translate
    def job_metrics(self, job_id: str) -> list[pb.MetricPoint]:
        return list(self.jobs.ListJobMetrics(pb.ListJobMetricsRequest(id=job_id), **self._kw()).points)

    @translate
    def job_logs(self, job_id: str, after_id: int = 0, limit: int = 0) -> list[pb.JobLog]:
        """Log lines of a job, oldest first (pass the last seen id as after_id to get only newer ones)."""
        return list(self.jobs.ListJobLogs(pb.ListJobLogsRequest(id=job_id, after_id=after_id, limit=limit),
                                          **self._kw()).logs)

    def watch_job(self, job_id: str, from_step: int = 0, reconnect_s: float = 120.0) -> Iterator[pb.JobEvent]:
        """Events until the job ends. Reconnects (resuming from the last metric step) if the stream drops."""
        last_step = from_step
        deadline = None
        while True:
            try:
                for ev in translate_iter(self.jobs.WatchJob(pb.WatchJobRequest(id=job_id, from_step=last_step),
                                                            metadata=self._md)):
                    deadline = None
                    if ev.HasField("metric"):
                        last_step = ev.metric.step + 1
                    yield ev
                return  # the server ends the stream once the job has ended and its history was sent
            except TrainyardError as exc:
                if exc.code != "UNAVAILABLE":
                    raise
                deadline = deadline or time.monotonic() + reconnect_s
                if time.monotonic() > deadline:
                    raise
                time.sleep(1.0)

    def wait_job(self, job_id: str, timeout_s: float = 3600.0) -> pb.Job:
        deadline = time.monotonic() + timeout_s
        while True:
            job = self.get_job(job_id)
            if job.status in TERMINAL:
                return job
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} still {status_name(job.status)} after {timeout_s:.0f}s")
            time.sleep(0.5)

    # -- checkpoints ---------------------------------------------------------------------------------------------
    @translate
    def list_checkpoints(self, job_id: str = "", *, session_id: str = "", weight_version_id: str = "") \
            -> list[pb.Checkpoint]:
        """Every checkpoint of the account (or of a job, a Training API session, a weight version), oldest first."""
        return list(self.checkpoints.ListCheckpoints(pb.ListCheckpointsRequest(
            job_id=job_id, session_id=session_id, weight_version_id=weight_version_id), **self._kw()).checkpoints)

    @translate
    def checkpoints_page(self, limit: int, offset: int = 0, session_id: str = "") -> pb.ListCheckpointsResponse:
        """A page of the account's (or a session's) checkpoints, newest first, with the total count."""
        return self.checkpoints.ListCheckpoints(pb.ListCheckpointsRequest(limit=limit, offset=offset,
                                                                          session_id=session_id), **self._kw())

    @translate
    def delete_checkpoint(self, checkpoint_id: str) -> pb.Checkpoint:
        """Removes the checkpoint and its files (FAILED_PRECONDITION while a deployment or open session uses it)."""
        return self.checkpoints.DeleteCheckpoint(pb.DeleteCheckpointRequest(id=checkpoint_id), **self._kw())

    @translate
    def set_checkpoint_ttl(self, checkpoint_id: str, ttl_seconds: int | None) -> pb.Checkpoint:
        """The checkpoint expires ttl_seconds from now (None: never); expired, it is unreadable and then removed."""
        request = pb.SetCheckpointTtlRequest(id=checkpoint_id)
        if ttl_seconds is not None:
            request.ttl_seconds = ttl_seconds
        return self.checkpoints.SetCheckpointTtl(request, **self._kw())

    @translate
    def publish_checkpoint(self, checkpoint_id: str, public: bool = True) -> pb.Checkpoint:
        """public: every account may read it (download, load as a state, sample); False ends that."""
        call = self.checkpoints.PublishCheckpoint if public else self.checkpoints.UnpublishCheckpoint
        return call(pb.PublishCheckpointRequest(id=checkpoint_id), **self._kw())

    @translate
    def get_checkpoint(self, checkpoint_id: str) -> pb.Checkpoint:
        return self.checkpoints.GetCheckpoint(pb.GetCheckpointRequest(id=checkpoint_id), **self._kw())

    def checkpoint_chunks(self, checkpoint_id: str) -> Iterator[common_pb2.FileChunk]:
        """The raw DownloadCheckpoint stream (the server verifies what it reads; download_checkpoint also checks
        what arrives). A failure raises grpc.RpcError as the chunks are read."""
        return self.checkpoints.DownloadCheckpoint(pb.DownloadCheckpointRequest(id=checkpoint_id), **self._kw(3600))

    @translate
    def download_checkpoint(self, checkpoint_id: str, dest: str | os.PathLike) -> Path:
        """Write the checkpoint's files under dest, each checked as it arrives against the size and sha256 the
        checkpoint's manifest names (what was stored, not a checksum of what the server read). Damage -- DATA_LOSS
        from the server, which verifies its reads too, or a mismatch found here -- removes the files this call
        wrote and raises TrainyardError("DATA_LOSS") naming the checkpoint and the file."""
        manifest = {f.path: f for f in self.get_checkpoint(checkpoint_id).files}
        dest = Path(dest)
        dest.mkdir(parents=True, exist_ok=True)
        hashes = {path: hashlib.sha256() for path in manifest}
        sizes = dict.fromkeys(manifest, 0)
        handles: dict[str, BinaryIO] = {}
        written: list[Path] = []

        def damaged(path: str, detail: str) -> TrainyardError:
            return TrainyardError("DATA_LOSS", f"checkpoint {checkpoint_id} file {path}: {detail}")

        def create(path: str) -> BinaryIO:
            target = (dest / path).resolve()
            if not target.is_relative_to(dest.resolve()):
                raise damaged(path, f"refusing to write outside {dest}")
            target.parent.mkdir(parents=True, exist_ok=True)
            written.append(target)
            return open(target, "wb")

        def check(path: str) -> None:
            f = manifest[path]
            if sizes[path] != f.size_bytes or hashes[path].hexdigest() != f.sha256:
                raise damaged(path, f"received {sizes[path]} bytes hashing to {hashes[path].hexdigest()}; the "
                                    f"checkpoint holds {f.size_bytes} bytes hashing to {f.sha256}")

        try:
            try:
                for chunk in self.checkpoint_chunks(checkpoint_id):
                    if chunk.path not in manifest:
                        raise damaged(chunk.path, "not in the checkpoint's manifest")
                    if chunk.offset != sizes[chunk.path]:
                        raise damaged(chunk.path, f"expected offset {sizes[chunk.path]}, got {chunk.offset}")
                    if chunk.path not in handles:
                        handles[chunk.path] = create(chunk.path)
                    handles[chunk.path].write(chunk.data)
                    hashes[chunk.path].update(chunk.data)
                    sizes[chunk.path] += len(chunk.data)
                    if sizes[chunk.path] >= manifest[chunk.path].size_bytes:
                        check(chunk.path)
            finally:
                for h in handles.values():
                    h.close()
            for path, f in manifest.items():
                if f.size_bytes == 0 and path not in handles:  # sent as no chunks at all
                    create(path).close()
                check(path)
        except BaseException:
            for p in written:
                p.unlink(missing_ok=True)
            raise
        return dest

    @translate
    def export_merged_model(self, checkpoint_id: str, dest: str | os.PathLike) -> Path:
        """Write the LoRA checkpoint merged into its base model (a Hugging Face model directory the server builds)
        under dest. Each chunk is checked against the sha256 it carries and each file against the size every chunk
        names; a mismatch removes the files this call wrote and raises TrainyardError("DATA_LOSS")."""
        dest = Path(dest)
        dest.mkdir(parents=True, exist_ok=True)
        handles: dict[str, BinaryIO] = {}
        sizes: dict[str, tuple[int, int]] = {}  # path -> (bytes received, size the server named)

        def damaged(path: str, detail: str) -> TrainyardError:
            return TrainyardError("DATA_LOSS", f"merged export of checkpoint {checkpoint_id} file {path}: {detail}")

        try:
            try:
                for chunk in self.checkpoints.ExportMergedModel(pb.ExportMergedModelRequest(id=checkpoint_id),
                                                                **self._kw(3600)):
                    if chunk.path not in handles:
                        target = (dest / chunk.path).resolve()
                        if not target.is_relative_to(dest.resolve()):
                            raise damaged(chunk.path, f"refusing to write outside {dest}")
                        handles[chunk.path] = open(target, "wb")
                    got, _ = sizes.get(chunk.path, (0, chunk.file_size))
                    if chunk.offset != got or hashlib.sha256(chunk.data).hexdigest() != chunk.sha256:
                        raise damaged(chunk.path, f"chunk at offset {chunk.offset} (expected {got}) does not match "
                                                  "its sha256")
                    handles[chunk.path].write(chunk.data)
                    sizes[chunk.path] = (got + len(chunk.data), chunk.file_size)
            finally:
                for h in handles.values():
                    h.close()
            for path, (got, size) in sizes.items():
                if got != size:
                    raise damaged(path, f"received {got} of its {size} bytes")
        except BaseException:
            for path in handles:
                (dest / path).unlink(missing_ok=True)
            raise
        return dest

    # -- deployments ---------------------------------------------------------------------------------------------
    @translate
    def repoint_deployment(self, ident: str, checkpoint_id: str) -> pb.Deployment:
        """Serve another checkpoint under a ready checkpoint deployment (by id or name), keeping its id and name."""
        return self.deployments.RepointDeployment(
            pb.RepointDeploymentRequest(id=ident, checkpoint_id=checkpoint_id), **self._kw(600))

    @translate
    def create_deployment(self, name: str, *, job_id: str = "", checkpoint_id: str = "",
                          lineage: str = "") -> pb.Deployment:
        """Serve a job's final checkpoint, a checkpoint, or the current version of a weight lineage (hot-loaded as
        new versions are published). Give exactly one."""
        return self.deployments.CreateDeployment(
            pb.CreateDeploymentRequest(name=name, job_id=job_id, checkpoint_id=checkpoint_id, lineage=lineage),
            **self._kw(600))

    @translate
    def list_deployments(self, include_deleted: bool = False) -> list[pb.Deployment]:
        return list(self.deployments.ListDeployments(pb.ListDeploymentsRequest(include_deleted=include_deleted),
                                                     **self._kw()).deployments)

    @translate
    def get_deployment(self, name_or_id: str) -> pb.Deployment:
        return self.deployments.GetDeployment(pb.GetDeploymentRequest(id=name_or_id), **self._kw())

    @translate
    def delete_deployment(self, name_or_id: str) -> pb.Deployment:
        return self.deployments.DeleteDeployment(pb.DeleteDeploymentRequest(id=name_or_id), **self._kw())

    # -- sampling ------------------------------------------------------------------------------------------------
    @translate
    def sample(self, model: str, prompt: str | None = None, *, messages: list[dict] | None = None,
               tokens: list[int] | None = None, temperature: float | None = None, top_p: float | None = None,
               top_k: int | None = None, max_tokens: int | None = None, stop: list[str] | None = None,
               stop_token_ids: list[int] | None = None, seed: int | None = None,
               n: int | None = None) -> rollout_pb2.SampleResponse:
        """Sample from a deployment (by name) or a base model. Give exactly one of prompt, messages, tokens."""
        if sum(x is not None for x in (prompt, messages, tokens)) != 1:
            raise ValueError("give exactly one of prompt, messages and tokens")
        params = rollout_pb2.SamplingParams(stop=stop or [], stop_token_ids=stop_token_ids or [])
        for name, value in (("temperature", temperature), ("top_p", top_p), ("top_k", top_k),
                            ("max_tokens", max_tokens), ("seed", seed), ("n", n)):
            if value is not None:
                setattr(params, name, value)
        req = rollout_pb2.SampleRequest(model=model, params=params)
        if prompt is not None:
            req.text = prompt
        elif tokens is not None:
            req.tokens.tokens.extend(tokens)
        else:
            req.messages.messages.extend(common_pb2.ChatMessage(role=m["role"], content=m["content"])
                                         for m in messages)
        return self.rollout.Sample(req, **self._kw(600))
