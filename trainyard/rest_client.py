"""RestClient: Tinker 0.38's RestClient (training runs, checkpoints, TTL, publishing, sessions) over Trainyard's gRPC
services, with Tinker's signatures and futures (docs/tinker_compat.md, "RestClient").

A training run is a Training API session; its checkpoints are the scheduler's checkpoints of that session. Paths are
Trainyard's: "trainyard://state/<checkpoint id>" (save_state) and "trainyard://weights/<version id>"
(save_weights_for_sampler); a checkpoint_id is the checkpoint's id. The answers are the pydantic types of
trainyard/rest_types.py, built by the same functions the HTTP gateway uses.

    rest = service_client.create_rest_client()          # or trainyard.RestClient(base_url=..., api_key=...)
    for ck in rest.list_checkpoints(run_id).result().checkpoints:
        print(ck.checkpoint_type, ck.tinker_path, ck.size_bytes)
    rest.set_checkpoint_ttl_from_tinker_path(path, 3600).result()
    rest.download_checkpoint(path, "out/").result()     # every file checked against its sha256
"""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal, TypeVar

import grpc

from trainyard import types
from trainyard.client import Client
from trainyard.errors import TrainyardError, from_rpc_error
from trainyard.futures import APIFuture, async_twin_signatures
from trainyard.rest_types import STATE_PREFIX, WEIGHTS_PREFIX, checkpoint_path
from trainyard.v1 import scheduler_pb2, trainer_pb2 as tpb

__all__ = ["RestClient"]

T = TypeVar("T")
AccessScope = Literal["owned", "accessible"]

# Tinker's RestClient methods Trainyard does not offer, and why (the AttributeError says so).
REFUSED = {
    "copy_weights": "no projects to copy into; publish the checkpoint (publish_checkpoint_from_tinker_path) and "
                    "other accounts read it where it is",
    "get_external_weights_urls": "no signed URLs over gRPC; use download_checkpoint(path, dest) (the HTTP gateway "
                                 "serves get_external_weights_urls)",
    "get_audit_log": "no audit log", "get_billing_usage": "no billing",
    "get_current_checkpoint_storage_usage": "no storage billing; list_user_checkpoints gives each size_bytes",
    "assign_session_project": "no projects", "export_session_trace": "no session traces",
    "search_sessions": "no session search; list_sessions pages through them newest first",
    "get_sampler": "samplers are client objects here (no server-side sampling sessions)",
    "get_telemetry": "no client telemetry",
}


def _scope(access_scope: str) -> None:
    if access_scope not in ("owned", "accessible"):
        raise ValueError(f"access_scope: must be 'owned' or 'accessible', got {access_scope!r}")


@async_twin_signatures
class RestClient:
    """Tinker's RestClient: made by ServiceClient.create_rest_client() (sharing its addresses, key and threads), or
    constructed with base_url (the trainer's address) and api_key as Tinker's; the scheduler's address comes from
    TRAINYARD_URL or `trainyard login`, as for trainyard.Client. access_scope "accessible" answers as "owned": runs
    are never shared, only checkpoints are (publishing)."""

    def __init__(self, _holder: Any = None, *, base_url: str | None = None, api_key: str | None = None):
        from trainyard.training import ServiceClient

        if _holder is not None and (base_url is not None or api_key is not None):
            raise ValueError("_holder: cannot be combined with base_url or api_key")
        self._owns_service = _holder is None
        self.service = _holder if _holder is not None else ServiceClient(base_url=base_url, api_key=api_key)
        c = self.service.config
        self.client = Client(url=c.url, api_key=c.api_key, rollout_url=c.rollout_url, tls_ca_file=c.tls_ca_file,
                             tls_client_cert_file=c.tls_client_cert_file, tls_client_key_file=c.tls_client_key_file)
        self._account: str | None = None  # the key's account id (whoami), asked once

    def close(self) -> None:
        self.client.close()
        if self._owns_service:
            self.service.close()

    def __getattr__(self, name: str) -> Any:
        refused = REFUSED.get(name.removesuffix("_async"))
        if refused:
            raise AttributeError(f"RestClient.{name}: not provided by Trainyard ({refused})")
        raise AttributeError(name)

    def _account_id(self) -> str:
        if self._account is None:
            self._account = self.client.whoami().id
        return self._account

    def _submit(self, fn: Callable[..., T], *args: Any) -> APIFuture[T]:
        return APIFuture(self.service.pool.submit(fn, *args))

    def _trainer(self, method: str, request: Any) -> Any:
        try:
            return getattr(self.service.trainer, method)(request, metadata=self.service.metadata)
        except grpc.RpcError as exc:
            raise from_rpc_error(exc) from None

    # -- conversions: one place for how this SDK names checkpoints ---------------------------------------------------
    @staticmethod
    def _checkpoint(c: scheduler_pb2.Checkpoint) -> types.Checkpoint:
        return types.Checkpoint.from_proto(c, checkpoint_path(c), c.id)

    def _by_path(self, tinker_path: str) -> scheduler_pb2.Checkpoint:
        """The checkpoint a Trainyard path names (NOT_FOUND when none, or another account's not published)."""
        if tinker_path.startswith(STATE_PREFIX) and len(tinker_path) > len(STATE_PREFIX):
            return self.client.get_checkpoint(tinker_path[len(STATE_PREFIX):])
        if tinker_path.startswith(WEIGHTS_PREFIX) and len(tinker_path) > len(WEIGHTS_PREFIX):
            version_id = tinker_path[len(WEIGHTS_PREFIX):]
            found = self.client.list_checkpoints(weight_version_id=version_id)
            if not found:
                raise TrainyardError("NOT_FOUND", f"no checkpoint of this account holds weight version {version_id}")
            return self.client.get_checkpoint(found[0].id)
        raise ValueError(f"tinker_path: must be '{STATE_PREFIX}<checkpoint id>' or '{WEIGHTS_PREFIX}<version id>' "
                         f"(the path save_state or save_weights_for_sampler returned), got {tinker_path!r}")

    def _run(self, session: tpb.Session) -> types.TrainingRun:
        last = [self._latest(cid) for cid in (session.last_state_checkpoint_id, session.last_weights_checkpoint_id)]
        return types.TrainingRun.from_proto(session, self._account_id(), *last)

    def _latest(self, checkpoint_id: str) -> types.Checkpoint | None:
        """A run's newest checkpoint of a kind; None when it has none, or it expired or went since the run was read."""
        if not checkpoint_id:
            return None
        try:
            return self._checkpoint(self.client.get_checkpoint(checkpoint_id))
        except TrainyardError as exc:
            if exc.code != "NOT_FOUND":
                raise
            return None

    # -- training runs ---------------------------------------------------------------------------------------------
    def get_training_run(self, training_run_id: types.ModelID,
                         access_scope: AccessScope = "owned") -> APIFuture[types.TrainingRun]:
        _scope(access_scope)
        return self._submit(lambda: self._run(self._trainer("GetSession", tpb.GetSessionRequest(id=training_run_id))))

    def get_training_run_by_tinker_path(self, tinker_path: str,
                                        access_scope: AccessScope = "owned") -> APIFuture[types.TrainingRun]:
        """The run (session) that saved the checkpoint at tinker_path."""
        _scope(access_scope)
        return self._submit(lambda: self._run(self._trainer(
            "GetSession", tpb.GetSessionRequest(id=self._session_of(self._by_path(tinker_path))))))

    @staticmethod
    def _session_of(c: scheduler_pb2.Checkpoint) -> str:
        if not c.session_id:
            raise TrainyardError("NOT_FOUND", f"checkpoint {c.id} was written by job {c.job_id}, not a training run")
        return c.session_id

    def list_training_runs(self, limit: int = 20, offset: int = 0, access_scope: AccessScope = "owned",
                           project_id: str | None = None) -> APIFuture[types.TrainingRunsResponse]:
        """The account's sessions, newest first."""
        _scope(access_scope)
        if project_id is not None:
            raise ValueError("project_id: Trainyard has no projects; leave it None")

        def call() -> types.TrainingRunsResponse:
            resp = self._trainer("ListSessions", tpb.ListSessionsRequest(limit=limit, offset=offset))
            return types.TrainingRunsResponse(training_runs=[self._run(s) for s in resp.sessions],
                                              cursor=types.Cursor(offset=offset, limit=limit,
                                                                  total_count=resp.total))

        return self._submit(call)

    # -- checkpoints -------------------------------------------------------------------------------------------------
    def get_weights_info_by_tinker_path(self, tinker_path: str) -> APIFuture[types.WeightsInfoResponse]:
        return self._submit(lambda: types.WeightsInfoResponse.from_proto(self._by_path(tinker_path)))

    def list_checkpoints(self, training_run_id: types.ModelID) -> APIFuture[types.CheckpointsListResponse]:
        """Every checkpoint of the run, oldest first (training states and sampler weights)."""
        return self._submit(lambda: types.CheckpointsListResponse(checkpoints=[
            self._checkpoint(c) for c in self.client.list_checkpoints(session_id=training_run_id)]))

    def list_user_checkpoints(self, limit: int = 100, offset: int = 0) -> APIFuture[types.CheckpointsListResponse]:
        """Every checkpoint of the account (jobs' too), newest first."""

        def call() -> types.CheckpointsListResponse:
            resp = self.client.checkpoints_page(limit, offset)
            return types.CheckpointsListResponse(checkpoints=[self._checkpoint(c) for c in resp.checkpoints],
                                                 cursor=types.Cursor(offset=offset, limit=limit,
                                                                     total_count=resp.total))

        return self._submit(call)

    def delete_checkpoint(self, training_run_id: types.ModelID, checkpoint_id: str) -> APIFuture[None]:
        def call() -> None:
            c = self.client.get_checkpoint(checkpoint_id)
            if c.session_id != training_run_id or c.account_id != self._account_id():
                raise TrainyardError("NOT_FOUND", f"training run {training_run_id} has no checkpoint "
                                                  f"'{checkpoint_id}'")
            self.client.delete_checkpoint(c.id)

        return self._submit(call)

    def delete_checkpoint_from_tinker_path(self, tinker_path: str) -> APIFuture[None]:
        return self._submit(lambda: self._change(tinker_path, self.client.delete_checkpoint))

    def publish_checkpoint_from_tinker_path(self, tinker_path: str) -> APIFuture[None]:
        """Every account may then read it (sample, load as a state, download); only the owner changes it."""
        return self._submit(lambda: self._change(tinker_path, lambda cid: self.client.publish_checkpoint(cid)))

    def unpublish_checkpoint_from_tinker_path(self, tinker_path: str) -> APIFuture[None]:
        return self._submit(lambda: self._change(tinker_path,
                                                 lambda cid: self.client.publish_checkpoint(cid, public=False)))

    def set_checkpoint_ttl_from_tinker_path(self, tinker_path: str, ttl_seconds: int | None) -> APIFuture[None]:
        """Expires ttl_seconds from now (None: never); an expired checkpoint is unreadable, then removed."""
        return self._submit(lambda: self._change(tinker_path,
                                                 lambda cid: self.client.set_checkpoint_ttl(cid, ttl_seconds)))

    def _change(self, tinker_path: str, change: Callable[[str], Any]) -> None:
        change(self._by_path(tinker_path).id)  # the server refuses another account's (NOT_FOUND)

    def download_checkpoint(self, tinker_path: str, dest: str | Path) -> APIFuture[Path]:
        """A Trainyard method (Tinker 0.38 gives signed URLs instead): the checkpoint's files written under dest,
        each checked against the size and sha256 the checkpoint's manifest names (trainyard.Client's download)."""
        return self._submit(lambda: self.client.download_checkpoint(self._by_path(tinker_path).id, dest))

    # -- sessions, identity, capabilities ----------------------------------------------------------------------------
    def get_session(self, session_id: str, access_scope: AccessScope = "owned") -> APIFuture[types.GetSessionResponse]:
        _scope(access_scope)
        return self._submit(lambda: types.GetSessionResponse.from_proto(
            self._trainer("GetSession", tpb.GetSessionRequest(id=session_id))))

    def list_sessions(self, limit: int = 20, offset: int = 0,
                      access_scope: AccessScope = "owned") -> APIFuture[types.ListSessionsResponse]:
        _scope(access_scope)
        return self._submit(lambda: types.ListSessionsResponse(sessions=[
            s.id for s in self._trainer("ListSessions", tpb.ListSessionsRequest(limit=limit, offset=offset)).sessions]))

    def whoami(self) -> APIFuture[types.WhoamiResponse]:
        return self._submit(lambda: types.WhoamiResponse.from_account(self._account_id()))

    def get_server_capabilities(self) -> APIFuture[types.GetServerCapabilitiesResponse]:
        return self._submit(self.service.get_server_capabilities)

    # Tinker's (deprecated) awaitable twins: `await rest.list_checkpoints_async(run_id)` is the result.
    async def get_training_run_async(self, *args, **kwargs) -> types.TrainingRun:
        return await self.get_training_run(*args, **kwargs)

    async def get_training_run_by_tinker_path_async(self, *args, **kwargs) -> types.TrainingRun:
        return await self.get_training_run_by_tinker_path(*args, **kwargs)

    async def list_training_runs_async(self, *args, **kwargs) -> types.TrainingRunsResponse:
        return await self.list_training_runs(*args, **kwargs)

    async def list_checkpoints_async(self, *args, **kwargs) -> types.CheckpointsListResponse:
        return await self.list_checkpoints(*args, **kwargs)

    async def list_user_checkpoints_async(self, *args, **kwargs) -> types.CheckpointsListResponse:
        return await self.list_user_checkpoints(*args, **kwargs)

    async def delete_checkpoint_async(self, *args, **kwargs) -> None:
        return await self.delete_checkpoint(*args, **kwargs)

    async def delete_checkpoint_from_tinker_path_async(self, *args, **kwargs) -> None:
        return await self.delete_checkpoint_from_tinker_path(*args, **kwargs)

    async def publish_checkpoint_from_tinker_path_async(self, *args, **kwargs) -> None:
        return await self.publish_checkpoint_from_tinker_path(*args, **kwargs)

    async def unpublish_checkpoint_from_tinker_path_async(self, *args, **kwargs) -> None:
        return await self.unpublish_checkpoint_from_tinker_path(*args, **kwargs)

    async def set_checkpoint_ttl_from_tinker_path_async(self, *args, **kwargs) -> None:
        return await self.set_checkpoint_ttl_from_tinker_path(*args, **kwargs)

    async def get_session_async(self, *args, **kwargs) -> types.GetSessionResponse:
        return await self.get_session(*args, **kwargs)

    async def list_sessions_async(self, *args, **kwargs) -> types.ListSessionsResponse:
        return await self.list_sessions(*args, **kwargs)

    async def download_checkpoint_async(self, *args, **kwargs) -> Path:
        return await self.download_checkpoint(*args, **kwargs)

