"""The job's rollout served by the platform: every policy version is published to the weight-sync service under a
lineage the job owns, a deployment of the rollout service follows that lineage (hot-loading each version), and each
sample is a SampleStream request to it, all with the attempt's job-scoped key. The same interface as RolloutProcess
(rollout.py: submit / update / result / close), with the same samples: segments (version, tokens, logprobs), each
tagged with the weight version id the rollout reported for it.

    rollout = RolloutService(Connection(...), lineage=job_id, deployment=f"{job_id}-rollout", base_model=..., ...)
    rollout.update(k, weights_dir)        # publish version k (a PEFT adapter or an HF model directory)
    rollout.submit(batch, requests); rollout.result(batch) -> (samples, stats)
    rollout.close()                       # stop sampling and delete the deployment (the lineage stays)

Versions. Policy version k is published as lineage version n_k (the lineage's numbering: 1, 2, ... across attempts;
a resumed job publishes its restored weights as the next one), and this backend records k <-> (n_k, version id).
The deployment is created after version 0 is published (CreateDeployment of the lineage: the scheduler has the
rollout load it), or reused when an earlier attempt of the job left it live.

Ordering at an update from k to k + 1 (exact per-token versions; a full-weight deployment would otherwise move a
running request onto the new weights silently, services/rollout/weights.py):
1. no new request starts; every stream in flight is cancelled, and update() waits until each reader has stopped:
   every token received so far was produced by k (k + 1 does not exist yet);
2. k + 1 is published (update returns once the weight-sync service holds it);
3. the aborted samples go on as in rollout.py: with partial_rollouts as prompt + their tokens so far (a new segment),
   otherwise from the prompt (their tokens discarded and counted).
Every request is sent with min_weight_version = n_k of the version the loop is at, so the rollout starts it only
once the deployment serves n_k; the stream's first message names the version id it runs on, checked against the
record (a mismatch, e.g. a rollback of the lineage by hand, fails the job: its staleness accounting would be wrong).
So a request's tokens are all one version's, known exactly.

Each sample is its own request (n = 1, seed = the request's seed, as in rollout.py); at most STREAMS run at once
(the rollout's per-account call quota is shared with the job's other calls). A rollout or weight-sync service that
cannot be reached ends the attempt with RolloutLost: the worker retries the job from its last checkpoint.
"""
from __future__ import annotations

import logging
import shutil
import threading
from collections import deque
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np
import torch

from services.common.channels import auth_metadata, open_channel
from services.trainer.rl.rollout import BatchRounds, BatchStats, RolloutLost, Sample, SampleRequest
from services.weightsync.client import publish_dir
from trainyard.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc, weightsync_pb2
from trainyard.v1 import weightsync_pb2_grpc

log = logging.getLogger("trainyard.rl.rollout_service")

STREAMS = 16  # sample requests in flight at once (below the rollout's max_concurrent_calls_per_account default)
# One sample request, its wait for the weight version included (min_weight_version: a version that will not load,
# e.g. damaged bytes, fails the job at this deadline); a generation must end within it.
CALL_TIMEOUT_S = 3600
LOST = (grpc.StatusCode.UNAVAILABLE,)


@dataclass(frozen=True)
class Connection:
    """Where the services are and the key the job calls them with."""

    rollout_url: str
    weightsync_url: str
    scheduler_url: str
    api_key: str
    credentials: grpc.ChannelCredentials | None = None
    max_message_mb: int = 64


@dataclass
class _Out:
    started: bool
    version_id: str = ""
    tokens: list[int] | None = None
    logprobs: list[float] | None = None
    finish_reason: str = ""
    router_ids: torch.Tensor | None = None


class RolloutService:
    # True: every version is published, from 0 to the final one (the user may deploy the lineage), as the engine's
    # save_weights directory (a PEFT adapter or an HF model directory).
    serves_lineage = True

    def __init__(self, conn: Connection, *, lineage: str, deployment: str, base_model: str, lora: bool,
                 partial: bool, max_tokens: int, temperature: float, router_ids: bool = False):
        self.conn, self.lineage, self.deployment, self.base_model = conn, lineage, deployment, base_model
        self.lora, self.partial, self.max_tokens, self.temperature = lora, partial, max_tokens, temperature
        self.router_ids = router_ids
        self.md = auth_metadata(conn.api_key)
        self._channels = [open_channel(u, conn.max_message_mb, conn.credentials)
                          for u in (conn.rollout_url, conn.weightsync_url, conn.scheduler_url)]
        self.rollout = rollout_pb2_grpc.RolloutServiceStub(self._channels[0])
        self.weights = weightsync_pb2_grpc.WeightSyncServiceStub(self._channels[1])
        self.deployments = scheduler_pb2_grpc.DeploymentServiceStub(self._channels[2])
        self.published: dict[int, weightsync_pb2.WeightVersion] = {}  # policy version k -> its lineage version
        self.version = -1  # the policy version requests run on; -1 until version 0 is published
        self._parent: str | None = None
        self._deployed = False
        self._cv = threading.Condition()
        self._updating = False
        self._in_flight: set = set()
        self._batches: deque = deque()
        self._results: dict[int, tuple[list[list[Sample]], BatchStats]] = {}
        self._error: BaseException | None = None
        self._stopping = False
        self._pool = futures.ThreadPoolExecutor(STREAMS, thread_name_prefix="rft-sample")
        self._thread = threading.Thread(target=self._run, name="rft-rollout", daemon=True)
        self._thread.start()

    # -- the loop's interface --------------------------------------------------------------------------------------
    def submit(self, batch: int, requests: list[list[SampleRequest]]) -> None:
        with self._cv:
            self._batches.append((batch, requests))
            self._cv.notify_all()

    def update(self, version: int, weights: Path) -> None:
        """Publish policy version `version` from weights (removed once published); see the module docstring."""
        with self._cv:
            self._updating = True
            for call in list(self._in_flight):
                call.cancel()
            while self._in_flight:
                self._cv.wait()
        try:
            published = self._publish(version, Path(weights))
            if not self._deployed:
                self._deploy()
        except BaseException:
            with self._cv:  # the job fails with it; readers waiting on the gate see the error
                self._updating = False
                self._cv.notify_all()
            raise
        with self._cv:
            self.published[version] = published
            self.version = version
            self._updating = False
            self._cv.notify_all()
        shutil.rmtree(weights, ignore_errors=True)

    def result(self, batch: int) -> tuple[list[list[Sample]], BatchStats]:
        with self._cv:
            while batch not in self._results and self._error is None:
                self._cv.wait()
            if batch not in self._results:
                raise self._error
            return self._results.pop(batch)

    def close(self) -> None:
        with self._cv:
            self._stopping = True
            for call in list(self._in_flight):
                call.cancel()
            self._cv.notify_all()
        self._thread.join(30)
        self._pool.shutdown(wait=True, cancel_futures=True)
        if self._deployed:  # the lineage and its versions stay: the user may deploy the final policy
            try:
                self.deployments.DeleteDeployment(scheduler_pb2.DeleteDeploymentRequest(id=self.deployment),
                                                  metadata=self.md, timeout=60)
            except grpc.RpcError as exc:
                log.warning("could not delete the job's rollout deployment %s: %s", self.deployment, exc.details())
        for channel in self._channels:
            channel.close()

    # -- weights ---------------------------------------------------------------------------------------------------
    def _publish(self, version: int, weights: Path) -> weightsync_pb2.WeightVersion:
        try:
            if self._parent is None:  # a resumed job goes on from the lineage's newest version
                known = self.weights.ListVersions(weightsync_pb2.ListVersionsRequest(lineage=self.lineage),
                                                  metadata=self.md, timeout=60).versions
                self._parent = known[-1].id if known else ""
            kind = weightsync_pb2.WEIGHT_KIND_LORA_ADAPTER if self.lora else weightsync_pb2.WEIGHT_KIND_FULL
            published = publish_dir(self.weights, self.conn.api_key, lineage=self.lineage, parent_id=self._parent,
                                    kind=kind, base_model=self.base_model, directory=weights,
                                    metadata={"policy_version": str(version)})
        except grpc.RpcError as exc:
            raise _failure(exc, f"publishing policy version {version} to lineage '{self.lineage}'") from None
        self._parent = published.id
        log.info("policy version %d is version %d (%s) of lineage '%s'", version, published.version, published.id,
                 self.lineage)
        return published

    def _deploy(self) -> None:
        request = scheduler_pb2.CreateDeploymentRequest(name=self.deployment, lineage=self.lineage)
        try:
            self.deployments.CreateDeployment(request, metadata=self.md, timeout=600)
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.ALREADY_EXISTS:  # else: an earlier attempt's, still following
                raise _failure(exc, f"deploying lineage '{self.lineage}' as '{self.deployment}'") from None
        self._deployed = True

    # -- sampling (the batch thread, and a pool for the streams) ---------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                with self._cv:
                    while not self._batches and not self._stopping:
                        self._cv.wait()
                    if self._stopping:
                        return
                    batch, requests = self._batches.popleft()
                samples, stats = self._sample(requests)
                with self._cv:
                    self._results[batch] = (samples, stats)
                    self._cv.notify_all()
        except BaseException as exc:  # noqa: BLE001 - handed to the loop, which fails (or retries) with it
            with self._cv:
                self._error = exc
                self._cv.notify_all()

    def _sample(self, requests: list[list[SampleRequest]]) -> tuple[list[list[Sample]], BatchStats]:
        rounds = BatchRounds(requests, partial=self.partial, max_tokens=self.max_tokens)
        while rounds.pending:
            with self._cv:
                while (self._updating or self.version < 0) and not self._stopping:
                    self._cv.wait()
                if self._stopping:
                    raise RolloutLost("the job's rollout was closed")
                version = self.version
            jobs = [self._pool.submit(self._one, *rounds.continuation(i), version) for i in rounds.pending]
            for i, job in zip(rounds.pending, jobs):
                out = job.result()
                if not out.started:  # an update came first: not sent
                    rounds.retry(i)
                else:
                    rounds.add(i, version, out.tokens, out.logprobs, out.finish_reason, out.router_ids,
                               out.version_id)
            rounds.next_round()
        return rounds.result()

    def _one(self, tokens: list[int], max_tokens: int, seed: int, version: int) -> _Out:
        """One request of a sample (BatchRounds.continuation) on policy version `version`, read until it ends or an
        update cancels it."""
        params = rollout_pb2.SamplingParams(temperature=self.temperature, max_tokens=max_tokens, seed=seed,
                                            return_router_ids=self.router_ids)
        expected = self.published[version]
        request = rollout_pb2.SampleRequest(model=self.deployment, tokens=common_pb2.TokenList(tokens=tokens),
                                            params=params, min_weight_version=expected.version)
        with self._cv:
            if self._updating or self._stopping or self.version != version:
                return _Out(started=False)
            call = self.rollout.SampleStream(request, metadata=self.md, timeout=CALL_TIMEOUT_S)
            self._in_flight.add(call)
        out = _Out(started=True, tokens=[], logprobs=[])
        try:
            for msg in call:
                if msg.weight_version_id:
                    out.version_id = msg.weight_version_id
                    if msg.weight_version_id != expected.id:
                        raise RuntimeError(
                            f"deployment '{self.deployment}' sampled weight version {msg.weight_version_id}, and the "
                            f"job expected {expected.id} (policy version {version}, version {expected.version} of "
                            f"lineage '{self.lineage}'): was the lineage rolled back or published to by another "
                            "client?")
                for d in msg.deltas:
                    out.tokens += d.tokens
                    out.logprobs += d.logprobs
                    if d.finish_reason:
                        out.finish_reason = d.finish_reason
                    if d.HasField("router_ids"):
                        out.router_ids = _router_ids(d.router_ids)
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.CANCELLED or not (self._updating or self._stopping):
                raise _failure(exc, f"sampling from deployment '{self.deployment}'") from None
        finally:
            with self._cv:
                self._in_flight.discard(call)
                self._cv.notify_all()
        if out.tokens and not out.version_id:
            raise RuntimeError(f"deployment '{self.deployment}' did not name the weight version it sampled")
        return out


def _router_ids(r: rollout_pb2.RouterIds) -> torch.Tensor:
    """[num_tokens, MoE layers, top_k], as the engine's SampledSequence.router_ids (the wire's little-endian bytes)."""
    ids = np.frombuffer(r.ids, dtype=np.dtype(r.dtype).newbyteorder("<")).astype(r.dtype)
    return torch.from_numpy(ids.reshape(r.num_tokens, len(r.layers), r.top_k))


def _failure(exc: grpc.RpcError, what: str) -> Exception:
    """An unreachable service ends the attempt (retried from the last checkpoint); a refusal fails the job."""
    message = f"{what}: {exc.code().name}: {exc.details()}"
    return RolloutLost(message) if exc.code() in LOST else RuntimeError(message)
