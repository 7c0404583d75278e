"""The rollout service's transport-agnostic core: which weights a request names, and the prompt as token ids.

A SampleRequest.model is resolved for the caller's account on every call, against the database:
1. a live deployment of the account with that name (status ready or deploying) -> its checkpoint's LoRA adapter on
   the checkpoint's base model. The row is read on every Sample, so a deleted deployment is never served, even while
   its weights are still loaded (the scheduler marks the row deleted before it asks for the unload);
2. else a base model visible to the account (its own, then shared) -> the base weights alone;
3. else NotFound.
A name "trainyard://weights/<version id>" is a weight version the account owns in the weight-sync service (a Training
API SaveWeights): that exact version, on its base model (services/rollout/pinned.py); its checkpoint decides who may:
NotFound once the checkpoint is deleted or expired, and for another account's unless the checkpoint is published
(then served from the checkpoint's files, as a deployment's checkpoint is).

A deployment's checkpoint files are laid out from the object store under <adapters_dir>/<deployment_id>/ once
(hard links, renamed into place whole), each checked against the sha256 its manifest names on the way (DataLoss
otherwise: the scheduler marks the deployment failed), and handed to the engine by that directory; deployment ids
are global, so they double as the engine's adapter ids.
"""
from __future__ import annotations

import contextlib
import logging
import shutil
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy import func, select

from models.chat import check_messages
from services.common import registry
from services.common.blobstore import BlobStore, StoredFile
from services.common.calls import NEVER, Cancellation
from services.common.db import Database
from services.common.errors import Cancelled, FailedPrecondition, InvalidArgument, NotFound, not_found
from services.common.schema import Checkpoint, Deployment, WeightVersion
from services.rollout import sampling
from services.rollout.engine import Engine, RequestHandle, RequestOutput
from services.rollout.pinned import WEIGHTS_PREFIX, PinnedWeights
from services.rollout.sampling import SampledSequence, SamplingParams
from services.rollout.templates import TemplateSandbox
from services.rollout.weights import WeightFollower

log = logging.getLogger("trainyard.rollout")

SERVABLE_STATUSES = ("ready", "deploying")
# A checkpoint deployment's adapter id in the engine: "<deployment id>@<checkpoint id>", so a re-pointed deployment
# (DeploymentCore.repoint) loads its new checkpoint beside the old one, which is unloaded once the new one is in.
ADAPTER_SEP = "@"
CHAT_ROLES = ("system", "user", "assistant", "tool")
# The adapter ids (and files directory) of other accounts' published checkpoints: "published@<checkpoint id>".
PUBLISHED = "published"


@dataclass(frozen=True)
class Prompt:
    """Exactly one of the three is set."""

    text: str | None = None
    tokens: tuple[int, ...] | None = None
    messages: tuple[tuple[str, str], ...] | None = None  # (role, content)


@dataclass(frozen=True)
class LoadedInfo:
    name: str
    base_model: str
    deployment_id: str = ""
    checkpoint_id: str = ""
    lineage: str = ""
    weight_version_id: str = ""
    weight_version: int = 0
    weight_error: str = ""


@dataclass
class SampleResult:
    model: str
    prompt_tokens: list[int]
    sequences: list[SampledSequence]
    prompt_logprobs: list[float] | None = None
    router_layers: list[int] | None = None  # decoder layer of each MoE layer in router_ids, with return_router_ids
    weight_version_id: str = ""  # a deployment following a lineage: the version the request ran on


@dataclass
class SampleStream:
    """A running request: outputs() yields its RequestOutput per engine step and cancels the request when closed
    early (the client went away)."""

    model: str
    prompt_tokens: list[int]
    router_layers: list[int] | None
    handle: RequestHandle
    weight_version_id: str = ""
    tokenizer: object = None  # the model's, which spells the tokens (e.g. OpenAI-style logprobs)

    def outputs(self) -> Iterator[RequestOutput]:
        try:
            yield from self.handle
        finally:
            self.handle.cancel()


@dataclass(frozen=True)
class _Target:
    """Resolved weights: a base model directory and, for a deployment, its adapter (None: the base weights, or a
    full-weight lineage's own copy of them)."""

    info: LoadedInfo
    model_dir: str
    adapter_id: str | None = None
    adapter_files: tuple[StoredFile, ...] = ()  # a checkpoint deployment's files, laid out on first use


class SamplingCore:
    def __init__(self, db: Database, blobs: BlobStore, engine: Engine, adapters_dir: Path,
                 follower: WeightFollower | None = None, pinned: PinnedWeights | None = None,
                 templates: TemplateSandbox | None = None):
        self.db = db
        self.blobs = blobs
        self.engine = engine
        self.adapters_dir = adapters_dir
        self.follower = follower  # deployments that follow a weight lineage (services/rollout/weights.py)
        self.pinned = pinned  # weight versions sampled by path (services/rollout/pinned.py)
        # Chat templates render in worker processes with CPU and memory limits (services/rollout/templates.py).
        self.templates = templates if templates is not None else TemplateSandbox()
        self._materialize_lock = threading.Lock()

    def sample(self, account_id: str, model: str, prompt: Prompt, params: SamplingParams, api_key: str = "",
               cancel: Cancellation = NEVER, *, min_weight_version: int = 0,
               wait_s: float | None = None) -> SampleResult:
        """The whole result; when cancel fires (the client left) the engine drops the request and this raises
        Cancelled."""
        stream = self.sample_stream(account_id, model, prompt, params, api_key,
                                    min_weight_version=min_weight_version, wait_s=wait_s, cancel=cancel)
        cancel.add_callback(stream.handle.cancel)
        result = stream.handle.result()
        if cancel.cancelled:
            raise Cancelled("the client left; the request was dropped")
        return SampleResult(model=model, prompt_tokens=stream.prompt_tokens, sequences=result.sequences,
                            prompt_logprobs=result.prompt_logprobs, router_layers=stream.router_layers,
                            weight_version_id=stream.weight_version_id)

    def sample_stream(self, account_id: str, model: str, prompt: Prompt, params: SamplingParams,
                      api_key: str = "", *, min_weight_version: int = 0, wait_s: float | None = None,
                      cancel: Cancellation = NEVER) -> SampleStream:
        """Resolve, validate and submit; the request runs in the engine while the caller reads its outputs.
        api_key: the caller's, for following a lineage deployment's weights on its behalf. min_weight_version: a
        lineage deployment first waits (up to wait_s, or until cancel fires) until it serves at least that version
        (WeightFollower.using)."""
        sampling.validate_params(params)  # before anything is loaded for a request that cannot run
        if min_weight_version < 0:
            raise InvalidArgument(f"must be >= 0, got {min_weight_version}", field="min_weight_version")
        with self._resolved(account_id, model, api_key, min_weight_version, wait_s, cancel) as target:
            if target.adapter_files:
                self.engine.load_adapter(target.adapter_id, target.model_dir, self._adapter_dir(target), eager=False)
            base = self.engine.base(target.model_dir)
            prompt_ids = self._encode(base.tokenizer, prompt, target.info.name)
            handle = self.engine.submit(target.model_dir, target.adapter_id, prompt_ids, params)
        layers = list(base.core.moe_layers) if params.return_router_ids else None
        return SampleStream(model=model, prompt_tokens=prompt_ids, router_layers=layers, handle=handle,
                            weight_version_id=target.info.weight_version_id, tokenizer=base.tokenizer)

    def load_deployment(self, account_id: str, deployment_id: str, api_key: str = "") -> LoadedInfo:
        with self.db.session() as s:
            dep = registry.find_deployment(s, account_id, deployment_id) if deployment_id else None
            if dep is None:
                raise not_found("deployment", deployment_id)
        try:
            target = self._deployment_target(account_id, dep, api_key)
        except Exception:
            if dep.lineage and self.follower is not None:  # the deployment fails: stop following its lineage
                self.follower.forget(dep.id)
            raise
        if target.adapter_files:
            self.engine.load_adapter(target.adapter_id, target.model_dir, self._adapter_dir(target))
            self._forget_other_checkpoints(dep.id, keep=target.adapter_id)
        log.info("deployment %s (%s) loaded on %s", dep.id, dep.name, target.model_dir)
        return target.info

    def _forget_other_checkpoints(self, dep_id: str, keep: str = "") -> bool:
        """Unload the adapters (and files) of a checkpoint deployment's other checkpoints: after a re-point, the one
        it served before (requests already running on it finish first: the engine frees weights once unused)."""
        forgotten = False
        for adapter_id in self.engine.known_adapters():
            if adapter_id.startswith(dep_id + ADAPTER_SEP) and adapter_id != keep:
                forgotten = self.engine.unload_adapter(adapter_id) or forgotten
                with self._materialize_lock:
                    shutil.rmtree(self.adapters_dir / dep_id / adapter_id.split(ADAPTER_SEP, 1)[1],
                                  ignore_errors=True)
        return forgotten

    def unload_deployment(self, account_id: str, deployment_id: str) -> bool:
        """Free a deployment's weights and files. Deleted deployments count: the scheduler unloads after deleting."""
        with self.db.session() as s:
            dep = s.get(Deployment, deployment_id) if deployment_id else None
            if dep is None or dep.account_id != account_id:
                raise not_found("deployment", deployment_id)
        if dep.lineage:
            return self.follower is not None and self.follower.forget(dep.id)
        unloaded = self._forget_other_checkpoints(dep.id)
        with self._materialize_lock:
            shutil.rmtree(self.adapters_dir / dep.id, ignore_errors=True)
        return unloaded

    def list_loaded(self, account_id: str) -> list[LoadedInfo]:
        """The account's live deployments whose weights are loaded, then loaded base models it can see."""
        adapter_ids = {a.split(ADAPTER_SEP, 1)[0] for a in self.engine.loaded_adapters()}  # their deployments
        model_dirs = set(self.engine.loaded_models())
        with self.db.session() as s:
            deps = s.scalars(select(Deployment).where(
                Deployment.account_id == account_id, Deployment.deleted_at.is_(None),
                Deployment.id.in_(adapter_ids)).order_by(Deployment.name)).all() if adapter_ids else []
            out = [LoadedInfo(name=d.name, base_model=d.base_model, deployment_id=d.id,
                              checkpoint_id=d.checkpoint_id or "") for d in deps]
            followed = s.scalars(select(Deployment).where(
                Deployment.account_id == account_id, Deployment.deleted_at.is_(None),
                Deployment.lineage.is_not(None)).order_by(Deployment.name)).all() if self.follower else []
            for d in followed:
                served, error = self.follower.state(d.id)
                if served is not None or error:
                    out.append(self._lineage_info(d, served, error))
            out += [LoadedInfo(name=m.name, base_model=m.name)
                    for m in registry.visible_models(s, account_id) if m.path in model_dirs]
        return out

    # ---- resolution ---------------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _resolved(self, account_id: str, name: str, api_key: str, min_weight_version: int = 0,
                  wait_s: float | None = None, cancel: Cancellation = NEVER) -> Iterator[_Target]:
        """The weights a request names; for a lineage deployment the version cannot switch inside the block."""
        if not name:
            raise InvalidArgument("required: a deployment name or a base model name", field="model")
        if min_weight_version:
            with self.db.session() as s:
                dep = registry.find_deployment(s, account_id, name)
                latest = s.scalar(select(func.max(WeightVersion.version)).where(
                    WeightVersion.account_id == account_id, WeightVersion.lineage == dep.lineage)) \
                    if dep is not None and dep.lineage else None
            if dep is None or not dep.lineage:
                raise InvalidArgument(f"'{name}' is not a deployment that follows a weight lineage",
                                      field="min_weight_version")
            if min_weight_version > (latest or 0):  # waiting could only end at the deadline
                raise FailedPrecondition(f"min_weight_version {min_weight_version}: lineage '{dep.lineage}' has no "
                                         f"such version yet (its latest is {latest or 0})")
            self._check_servable(dep)
            with self._lineage_target(account_id, dep, api_key, min_weight_version, wait_s, cancel) as target:
                yield target
            return
        if name.startswith(WEIGHTS_PREFIX):
            with self._version_target(account_id, name, api_key) as target:
                yield target
            return
        with self.db.session() as s:
            dep = registry.find_deployment(s, account_id, name)
            m = registry.find_model(s, account_id, name) if dep is None else None
        if dep is not None and dep.lineage:
            self._check_servable(dep)
            with self._lineage_target(account_id, dep, api_key) as target:
                yield target
        elif dep is not None:
            yield self._deployment_target(account_id, dep, api_key)
        elif m is not None:
            yield _Target(info=LoadedInfo(name=m.name, base_model=m.name), model_dir=m.path)
        else:
            raise NotFound(f"model '{name}' not found: no deployment or base model with that name")

    @staticmethod
    def _check_servable(dep: Deployment) -> None:
        if dep.status not in SERVABLE_STATUSES:
            detail = f": {dep.error}" if dep.error else ""
            raise FailedPrecondition(f"deployment '{dep.name}' is {dep.status}{detail}; it cannot be served")

    def _deployment_target(self, account_id: str, dep: Deployment, api_key: str) -> _Target:
        self._check_servable(dep)
        if dep.lineage:
            with self._lineage_target(account_id, dep, api_key) as target:
                return target
        with self.db.session() as s:
            return self._checkpoint_target(s, account_id, dep)

    @contextlib.contextmanager
    def _lineage_target(self, account_id: str, dep: Deployment, api_key: str, min_version: int = 0,
                        wait_s: float | None = None, cancel: Cancellation = NEVER) -> Iterator[_Target]:
        if self.follower is None:
            raise FailedPrecondition(f"deployment '{dep.name}' follows a weight lineage, and this rollout has no "
                                     "weight-sync service configured")
        with self.db.session() as s:
            base = registry.find_model(s, account_id, dep.base_model)
        if base is None:
            raise FailedPrecondition(f"deployment '{dep.name}': its base model '{dep.base_model}' is not registered")
        with self.follower.using(dep.id, dep.lineage, base.path, api_key, min_version=min_version, wait_s=wait_s,
                                 cancel=cancel) as served:
            yield _Target(info=self._lineage_info(dep, served, ""), model_dir=served.model_dir,
                          adapter_id=served.adapter_id)

    @contextlib.contextmanager
    def _version_target(self, account_id: str, name: str, api_key: str) -> Iterator[_Target]:
        version_id = name.removeprefix(WEIGHTS_PREFIX)
        if not version_id:
            raise InvalidArgument(f"expected '{WEIGHTS_PREFIX}<version id>'", field="model")
        with self.db.session() as s:
            ckpt = s.scalar(select(Checkpoint).where(Checkpoint.weight_version_id == version_id))
            if ckpt is not None:  # its checkpoint says who may sample it: the owner, or anyone while published
                try:
                    ckpt = registry.readable_checkpoint(s, account_id, ckpt.id)
                except NotFound:
                    raise not_found("weight version", version_id) from None
                if ckpt.account_id != account_id:
                    yield self._published_target(name, ckpt, version_id)
                    return
        if self.pinned is None:
            raise FailedPrecondition(f"'{name}' names a weight version, and this rollout has no weight-sync service "
                                     "configured")
        if ckpt is None and self.pinned.version(account_id, api_key, version_id).metadata.get("checkpoint_id"):
            raise not_found("weight version", version_id)  # its checkpoint was deleted (or expired and swept)

        def base_model_dir(base_model: str) -> str:
            with self.db.session() as s:
                base = registry.find_model(s, account_id, base_model)
            if base is None:
                raise FailedPrecondition(f"weight version '{version_id}': its base model '{base_model}' is not "
                                         "registered")
            return base.path

        with self.pinned.using(account_id, api_key, version_id, base_model_dir) as (served, version):
            info = LoadedInfo(name=name, base_model=version.base_model, lineage=version.lineage,
                              weight_version_id=version.id, weight_version=version.version)
            yield _Target(info=info, model_dir=served.model_dir, adapter_id=served.adapter_id)

    @staticmethod
    def _published_target(name: str, ckpt: Checkpoint, version_id: str) -> _Target:
        """Another account's published SaveWeights checkpoint, served from its files (read-only: the weight-sync
        service's copy stays its owner's)."""
        if ckpt.kind != "lora_adapter" or not ckpt.model_path:
            raise FailedPrecondition(f"'{name}' is a published {ckpt.kind} checkpoint; only LoRA adapters of other "
                                     "accounts can be sampled")
        info = LoadedInfo(name=name, base_model=ckpt.base_model, deployment_id=PUBLISHED, checkpoint_id=ckpt.id,
                          weight_version_id=version_id)
        return _Target(info=info, model_dir=ckpt.model_path, adapter_id=PUBLISHED + ADAPTER_SEP + ckpt.id,
                       adapter_files=tuple(StoredFile.from_json(f) for f in ckpt.files))

    @staticmethod
    def _lineage_info(dep: Deployment, served, error: str) -> LoadedInfo:
        return LoadedInfo(name=dep.name, base_model=dep.base_model, deployment_id=dep.id, lineage=dep.lineage,
                          weight_version_id=served.version_id if served else "",
                          weight_version=served.version if served else 0, weight_error=error)

    def _checkpoint_target(self, s, account_id: str, dep: Deployment) -> _Target:
        ckpt: Checkpoint = registry.get_checkpoint(s, account_id, dep.checkpoint_id)
        if ckpt.kind != "lora_adapter":
            raise FailedPrecondition(f"deployment '{dep.name}': checkpoint {ckpt.id} is a {ckpt.kind} checkpoint; "
                                     "only LoRA adapter checkpoints can be served")
        model_dir = ckpt.model_path
        if not model_dir:
            base = registry.find_model(s, account_id, ckpt.base_model)
            if base is None:
                raise FailedPrecondition(f"deployment '{dep.name}': its base model '{ckpt.base_model}' is not "
                                         "registered")
            model_dir = base.path
        info = LoadedInfo(name=dep.name, base_model=dep.base_model, deployment_id=dep.id, checkpoint_id=ckpt.id)
        return _Target(info=info, model_dir=model_dir, adapter_id=dep.id + ADAPTER_SEP + ckpt.id,
                       adapter_files=tuple(StoredFile.from_json(f) for f in ckpt.files))

    def _adapter_dir(self, target: _Target) -> Path:
        """The deployment's files on disk, laid out once: a directory that exists is complete (renamed into place)."""
        dest = self.adapters_dir / target.info.deployment_id / target.info.checkpoint_id
        with self._materialize_lock:
            if not dest.is_dir():
                dest.parent.mkdir(parents=True, exist_ok=True)
                tmp = Path(tempfile.mkdtemp(dir=dest.parent, prefix=f".{dest.name}-"))
                try:  # verified on the way: damaged or missing files are DataLoss, and nothing is loaded
                    self.blobs.materialize(target.adapter_files, tmp, what=f"deployment '{target.info.name}': "
                                                                         f"checkpoint {target.info.checkpoint_id}")
                except BaseException:
                    shutil.rmtree(tmp, ignore_errors=True)
                    with contextlib.suppress(OSError):  # the deployment's directory, unless another checkpoint's
                        dest.parent.rmdir()
                    raise
                tmp.rename(dest)
        return dest

    # ---- prompts ------------------------------------------------------------------------------------------------

    def _encode(self, tokenizer, prompt: Prompt, model: str) -> list[int]:
        if prompt.tokens is not None:
            return list(prompt.tokens)
        if prompt.text is not None:
            return encode_text(tokenizer, prompt.text)
        if prompt.messages is not None:
            for i, (role, _) in enumerate(prompt.messages):
                if role not in CHAT_ROLES:
                    raise InvalidArgument(f"must be one of {', '.join(CHAT_ROLES)}, got {role!r}",
                                          field=f"prompt.messages[{i}].role")
            messages = [{"role": r, "content": c} for r, c in prompt.messages]
            try:
                check_messages(tokenizer, messages)
            except ValueError as exc:  # no chat template, or an empty conversation
                raise InvalidArgument(str(exc), field="prompt.messages") from None
            # As encode_chat_prompt does, with the template rendered in the sandbox rather than in this process.
            text = self.templates.render(model, tokenizer.get_chat_template(), messages, add_generation_prompt=True,
                                         variables=dict(tokenizer.special_tokens_map))
            return list(tokenizer(text, add_special_tokens=False)["input_ids"])
        raise InvalidArgument("set one of text, tokens or messages", field="prompt")


def encode_text(tokenizer, text: str) -> list[int]:
    """Raw text with the tokenizer's usual special tokens (e.g. Llama's BOS), but never two BOS when the text
    already starts with one."""
    ids = list(tokenizer(text)["input_ids"])
    bos = tokenizer.bos_token_id
    if bos is not None and len(ids) >= 2 and ids[0] == ids[1] == bos:
        ids = ids[1:]
    return ids
