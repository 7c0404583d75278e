"""A valid request for every RPC, made of one account's own objects.

The isolation sweep swaps one reference of such a request for another account's object: answered for the owner's
object (the control), the request reaches the lookup, so a refusal of the other account's object is the account
scoping at work and not a complaint about the rest of the request. RPCs not listed take the empty request with the
swept field set.
"""
from __future__ import annotations

import hashlib
import secrets
from collections.abc import Callable

from tests.reliability.references import put, ref_fields, values
from tests.reliability.rpcs import Rpc
from tests.reliability.world import BASE, SEQ, Account, Stubs, datum
from trainyard.client import job_spec
from trainyard.v1 import common_pb2
from trainyard.v1 import rollout_pb2 as rpb
from trainyard.v1 import scheduler_pb2 as spb
from trainyard.v1 import scheduler_pb2_grpc as sg
from trainyard.v1 import trainer_pb2 as tpb
from trainyard.v1 import weightsync_pb2 as wpb

# RPCs that use up the object they name: their control call gets a fresh object of the owner's. (SetCheckpointTtl:
# a short TTL ends the checkpoint.)
DESTRUCTIVE = ("Delete", "Close", "Revoke", "Unload", "SetCheckpointTtl")


def _unique(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(4)}"


class Requests:
    def __init__(self, stubs: Stubs, owner: Account):
        self.stubs = stubs
        self.owner = owner
        self.builders: dict[str, Callable[[], object]] = {
            "DatasetService.UploadDataset": self._upload, "DatasetService.ValidateDataset": self._upload,
            "JobService.CreateJob": lambda: spb.CreateJobRequest(spec=self._spec()),
            "JobService.PlanJob": lambda: spb.PlanJobRequest(spec=self._spec()),
            "JobService.GetTokenStats": lambda: spb.TokenStatsRequest(dataset_id=owner.refs["dataset"][0],
                                                                      base_model=BASE),
            "ModelService.ImportModel": lambda: spb.ImportModelRequest(name=_unique("import"), path=owner.model_dir),
            "DeploymentService.CreateDeployment": lambda: spb.CreateDeploymentRequest(name=_unique("dep")),
            "TrainerService.CreateSession": lambda: tpb.CreateSessionRequest(base_model=BASE,
                                                                            lora=tpb.SessionLora(rank=8)),
            "TrainerService.Forward": lambda: tpb.ForwardRequest(session_id=self._session(), data=[datum(SEQ)]),
            "TrainerService.ForwardBackward": lambda: tpb.ForwardBackwardRequest(session_id=self._session(),
                                                                                data=[datum(SEQ)]),
            "TrainerService.ForwardBackwardStream": lambda: [
                tpb.ForwardBackwardStreamRequest(header=tpb.ForwardBackwardRequest(session_id=self._session())),
                tpb.ForwardBackwardStreamRequest(datums=tpb.DatumBatch(data=[datum(SEQ)]))],
            "TrainerService.OptimStep": lambda: tpb.OptimStepRequest(session_id=self._session(),
                                                                    adam=tpb.AdamParams(learning_rate=1e-3)),
            "TrainerService.SaveWeights": lambda: tpb.SaveWeightsRequest(session_id=self._session(),
                                                                        name=_unique("w")),
            "TrainerService.SaveState": lambda: tpb.SaveStateRequest(session_id=self._session(), name=_unique("s")),
            "TrainerService.LoadState": lambda: tpb.LoadStateRequest(session_id=self._session(),
                                                                    path=owner.refs["state_path"][0]),
            "RolloutService.Sample": self._sample, "RolloutService.SampleStream": self._sample,
            "WeightSyncService.PublishVersion": self._publish,
            "WeightSyncService.FetchVersion": lambda: wpb.FetchVersionRequest(id=owner.refs["version"][3],
                                                                              base_version_id=owner.refs["version"][2]),
            "EvaluatorService.UploadEvaluator": lambda: spb.EvaluatorUploadRequest(
                name=_unique("ev"), content=b"def reward_fn(completion, row):\n    return 1.0\n"),
            "EvaluatorService.TestEvaluator": lambda: spb.EvaluatorTestRequest(
                evaluator=owner.refs["evaluator"][0], dataset_id=owner.refs["dataset"][0], num_rows=1),
            "DeploymentService.RepointDeployment": lambda: spb.RepointDeploymentRequest(
                id=owner.refs["deployment"][0], checkpoint_id=owner.refs["checkpoint"][0]),
            "WeightSyncService.Rollback": lambda: wpb.RollbackRequest(lineage=owner.refs["lineage"][0],
                                                                      version_id=owner.refs["version"][0]),
            # A fresh checkpoint each: the owner's own checkpoints stay private and unexpiring (a published one is
            # readable by every account, by design).
            "CheckpointService.PublishCheckpoint": lambda: spb.PublishCheckpointRequest(id=self.fresh("checkpoint")),
            "CheckpointService.UnpublishCheckpoint": lambda: spb.PublishCheckpointRequest(
                id=self.fresh("checkpoint")),
            "CheckpointService.SetCheckpointTtl": lambda: spb.SetCheckpointTtlRequest(id=self.fresh("checkpoint"),
                                                                                      ttl_seconds=3600),
        }

    def build(self, rpc: Rpc, overrides: dict[tuple[str, ...], str]):
        """The owner's valid request for rpc with overrides applied ({field path: value}; for a client stream, the
        paths are in its first message)."""
        builder = self.builders.get(rpc.full)
        configs = {p[1] for p in overrides if len(p) > 2 and p[0] == "spec"}
        if rpc.full in ("JobService.CreateJob", "JobService.PlanJob") and configs - {"sft"}:
            (config,) = configs  # a reference in another method's settings: a valid job of that method
            spec = self._spec(config)
            request = spb.CreateJobRequest(spec=spec) if rpc.name == "CreateJob" else spb.PlanJobRequest(spec=spec)
        else:
            request = builder() if builder else rpc.request()
        first = request[0] if isinstance(request, list) else request
        for path, value in overrides.items():
            put(first, path, value)
        return request

    def baseline(self, rpc: Rpc):
        """A valid request: the template, or the empty request with every reference set to the owner's object."""
        if rpc.full == "DeploymentService.CreateDeployment":  # exactly one of its references
            return self.build(rpc, {("checkpoint_id",): self.owner.refs["checkpoint"][1]})
        if rpc.full in self.builders:
            return self.build(rpc, {})
        return self.build(rpc, {f.path: self.control_value(rpc, f.path, f.kind) for f in ref_fields(rpc.input)})

    def control_value(self, rpc: Rpc, path: tuple[str, ...], kind: str) -> str:
        """The owner's own object for a field: what the valid request holds there, else the first of its kind (a
        fresh one for an RPC that uses it up)."""
        if rpc.name.startswith(DESTRUCTIVE):
            return self.fresh(kind)
        request = self.build(rpc, {})
        first = request[0] if isinstance(request, list) else request
        for name in path:
            first = getattr(first, name)
        return first or values(self.owner.refs, kind)[0]

    def fresh(self, kind: str) -> str:
        """A new object of the owner's, of the given kind."""
        o, s = self.owner, self.stubs
        sched = s.channels["scheduler"]
        if kind == "api_key":
            return sg.AccountServiceStub(sched).CreateApiKey(spb.CreateApiKeyRequest(name=_unique("k")),
                                                             metadata=o.md).key.id
        if kind == "dataset":
            body = b'{"prompt": "%s", "completion": "x"}\n' % _unique("p").encode()
            msgs = [spb.UploadDatasetRequest(header=spb.UploadDatasetHeader(name=_unique("d"))),
                    spb.UploadDatasetRequest(chunk=body)]
            return sg.DatasetServiceStub(sched).UploadDataset(iter(msgs), metadata=o.md).dataset.id
        if kind in ("deployment", "deployment_id"):
            final = o.refs["checkpoint"][1]  # the job's final checkpoint
            return sg.DeploymentServiceStub(sched).CreateDeployment(
                spb.CreateDeploymentRequest(name=_unique("fresh"), checkpoint_id=final), metadata=o.md).id
        if kind == "checkpoint":  # weights for sampling: no session's recorded state, so it can be deleted
            return s.trainer.SaveWeights(tpb.SaveWeightsRequest(session_id=self._session(), name=_unique("fresh")),
                                         metadata=o.md).checkpoint_id
        if kind == "session":
            return s.trainer.CreateSession(tpb.CreateSessionRequest(base_model=BASE, lora=tpb.SessionLora(rank=4)),
                                           metadata=o.md).id
        if kind == "lineage":  # a new session's, holding an ephemeral version (what DeleteEphemeralVersions deletes)
            session = self.fresh("session")
            s.trainer.SaveWeights(tpb.SaveWeightsRequest(session_id=session, ephemeral=True), metadata=o.md)
            return session
        raise KeyError(kind)

    # -- builders -------------------------------------------------------------------------------------------------
    def _session(self) -> str:
        return self.owner.refs["session"][0]

    def _spec(self, method: str = "sft") -> spb.JobSpec:
        o = self.owner
        model, evaluator = o.refs["model"][0], o.refs["evaluator"][1]
        if method == "rft":
            return job_spec("rft", model, o.prompts_dataset, evaluator=evaluator, steps=1)
        if method == "eval":
            return job_spec("eval", BASE, o.prompts_dataset, evaluator=evaluator)  # of the checkpoints' base model
        if method == "loop":
            return job_spec("loop", model, o.prompts_dataset, evaluator=evaluator, train_datasets=(o.refs["dataset"][0],),
                            deployment=_unique("loop"))
        return job_spec(method, model, o.refs["dataset"][0], max_steps=1)

    def _upload(self) -> list:
        return [spb.UploadDatasetRequest(header=spb.UploadDatasetHeader(name=_unique("up"))),
                spb.UploadDatasetRequest(chunk=self.owner.dataset_bytes)]

    def _sample(self) -> rpb.SampleRequest:
        return rpb.SampleRequest(model=self.owner.refs["deployment_name"][0], text="hello",
                                 params=rpb.SamplingParams(max_tokens=2, temperature=0))

    def _publish(self) -> list:
        """The lineage's current files again, as its next version."""
        o, s = self.owner, self.stubs
        lineage = o.refs["lineage"][0]
        latest = s.weights.GetLineage(wpb.GetLineageRequest(lineage=lineage), metadata=o.md)
        newest = max(s.weights.ListVersions(wpb.ListVersionsRequest(lineage=lineage), metadata=o.md).versions,
                     key=lambda v: v.version)
        chunks = list(s.weights.FetchVersion(wpb.FetchVersionRequest(id=newest.id), metadata=o.md))
        header = wpb.PublishVersionHeader(lineage=lineage, parent_id=newest.id, kind=latest.kind,
                                          base_model=latest.base_model, files=newest.files)
        return [wpb.PublishVersionRequest(header=header)] + [
            wpb.PublishVersionRequest(chunk=common_pb2.FileChunk(
                path=c.path, offset=c.offset, data=c.data, sha256=hashlib.sha256(c.data).hexdigest(),
                file_size=c.file_size)) for c in chunks]
