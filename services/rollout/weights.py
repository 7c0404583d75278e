"""Deployments that follow a weight lineage: each new version is fetched from the weight-sync service and hot-loaded
between engine steps; while anything about a new version fails, the previous one keeps serving.

Ordering for one deployment moving from version n to version m (the lineage's current version: m = n + 1 after a
publish, any retained version after a rollback):
1. WatchLineage reports current = m.
2. Fetch. A LoRA adapter: m's files in checksummed chunks, each file verified against the sha256 m names as it
   streams (a cut transfer resumes at the last verified byte) into <root>/adapters/<deployment>@<m>/. Full weights:
   the delta n -> m (services/weightsync/codec.py), applied to the CPU copy of n this follower holds; the codec
   checks that copy is n and every record's checksum before it writes anything. When the delta cannot be used (our
   copy is not n, the delta or n's stored files are damaged), m is fetched whole and the follower records why
   (_Follow.fallback, the log).
3. Load. Adapter: engine.load_adapter under the id "<deployment>@<m>", next to n's. Full: engine.update_base_weights,
   written between two engine steps.
4. Switch: requests submitted from now on run on m. Adapter requests already running keep n's slot until they end
   (then n's weights are freed); full-weight requests in flight finish on m.
A failure in 2-3 leaves n serving, is recorded (LoadedModel.weight_error, the log) and retried with backoff for as
long as m is the lineage's current version; damaged stored bytes (DATA_LOSS from the weight-sync service, which
verifies every read) are not retried until the lineage moves on, and a deployment whose first version fails so is
refused with DATA_LOSS.

Threads: no deployment holds one. Every WatchLineage stream of this process is a task on one event loop (a thread of
the follower's, with an asyncio channel); a new target queues its deployment's load (2-3) in a pool of load_workers
threads, at most one load per deployment at a time (a target that arrives meanwhile is loaded next), and retries wait
on the loop's timers. A deployment that stops being followed (forget: undeployed, or it failed to load its first
version) cancels its watch and frees what it served: its adapter, or its full-weight copy of the base model.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from safetensors.torch import load_file

from models.families import family_for_config
from models.model_dir import read_config
from services.common import metrics
from services.common.channels import auth_metadata, open_aio_channel, open_channel
from services.common.calls import NEVER, Cancellation
from services.common.errors import DataLoss, DeadlineExceeded, FailedPrecondition, Unavailable
from services.weightsync.client import fetch_delta, fetch_version
from services.weightsync.codec import apply_delta
from trainyard.v1 import weightsync_pb2 as wpb
from trainyard.v1 import weightsync_pb2_grpc

log = logging.getLogger("trainyard.rollout.weights")

RETRY_S = (0.5, 1.0, 2.0, 5.0, 10.0)
# Files of the base model a full-weight version does not carry but the engine needs to load it.
BASE_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
              "special_tokens_map.json", "tokenizer.model", "vocab.json", "merges.txt")


@dataclass(frozen=True)
class Served:
    """What a deployment's requests run on now."""

    model_dir: str
    adapter_id: str | None  # None for full weights
    version_id: str
    version: int


@dataclass(eq=False)
class _Follow:
    deployment_id: str
    lineage: str
    base_model_dir: str
    api_key: str
    served: Served | None = None  # switched under cv
    target: wpb.WeightVersion | None = None  # the lineage's current version, as last watched
    error: str = ""
    data_loss: bool = False  # error is the weight-sync service's DATA_LOSS: retried only for a newer target
    fallback: str = ""  # the last delta that could not be used, and that the version was fetched whole instead
    held: dict | None = None  # full weights: the served version's tensors (HF names, CPU)
    held_version_id: str = ""
    cv: threading.Condition = field(default_factory=threading.Condition)
    stopped: bool = False
    watch: futures.Future | None = None  # the watch task on the follower's loop
    # Only on the loop: a load is queued or running; the timer of the next retry and the failures so far.
    loading: bool = False
    retry: asyncio.TimerHandle | None = None
    failures: int = 0


class WeightFollower:
    def __init__(self, engine, weightsync_target: str, root: Path, *,
                 stub_factory: Callable[[grpc.Channel], object] = weightsync_pb2_grpc.WeightSyncServiceStub,
                 retry_s: tuple[float, ...] = RETRY_S, credentials: grpc.ChannelCredentials | None = None,
                 load_workers: int = 4):
        self.engine = engine
        self.root = Path(root)
        self.retry_s = retry_s
        self._channel = open_channel(weightsync_target, credentials=credentials)
        self.stub = stub_factory(self._channel)  # fetches (and the pinned versions' lookups)
        self._follows: dict[str, _Follow] = {}
        self._lock = threading.Lock()
        self._pool = futures.ThreadPoolExecutor(max_workers=load_workers, thread_name_prefix="weights-load")
        self._loop = asyncio.new_event_loop()
        threading.Thread(target=self._loop.run_forever, daemon=True, name="weights-watch").start()

        async def watch_stub():
            self._watch_channel = open_aio_channel(weightsync_target, credentials=credentials)
            return weightsync_pb2_grpc.WeightSyncServiceStub(self._watch_channel)

        self._watch_stub = asyncio.run_coroutine_threadsafe(watch_stub(), self._loop).result()

    # ---- what requests use -------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def using(self, deployment_id: str, lineage: str, base_model_dir: str, api_key: str, *, min_version: int = 0,
              wait_s: float | None = None, cancel: Cancellation = NEVER) -> Iterator[Served]:
        """serve(), holding the deployment's switch off for the block: submit the request inside it, so the
        adapter it names cannot be unloaded before the request pins it. min_version: first wait until the
        deployment serves at least that version of its lineage, for at most wait_s seconds (None: until cancel
        fires), else DeadlineExceeded. A caller that publishes version m and then asks for min_version m gets
        m (or a later one) exactly: the switch cannot happen while it holds the block."""
        served = self.serve(deployment_id, lineage, base_model_dir, api_key)
        with self._lock:
            follow = self._follows.get(deployment_id)
        if follow is None:
            raise Unavailable(f"deployment {deployment_id} is being unloaded")
        deadline = None if wait_s is None else time.monotonic() + wait_s
        with follow.cv:
            while not follow.stopped and (follow.served is None or follow.served.version < min_version):
                left = None if deadline is None else deadline - time.monotonic()
                if (left is not None and left <= 0) or cancel.cancelled:
                    now = follow.served.version if follow.served is not None else served.version
                    detail = f"; loading it failed: {follow.error}" if follow.error else ""
                    raise DeadlineExceeded(f"deployment {deployment_id} serves version {now} of lineage '{lineage}' "
                                           f"and the request needs version {min_version} or later (min_weight_"
                                           f"version); it was not loaded before the call's deadline{detail}")
                follow.cv.wait(0.5 if left is None else min(left, 0.5))
            if follow.stopped:
                raise Unavailable(f"deployment {deployment_id} is being unloaded")
            yield follow.served

    def serve(self, deployment_id: str, lineage: str, base_model_dir: str, api_key: str) -> Served:
        """The version requests of this deployment run on now. The first call starts following the lineage and
        returns once its current version is loaded (raising Unavailable as soon as watching or loading fails);
        later calls return at once."""
        with self._lock:
            follow = self._follows.get(deployment_id)
            if follow is None:
                follow = _Follow(deployment_id, lineage, base_model_dir, api_key)
                self._follows[deployment_id] = follow
        with follow.cv:
            follow.api_key = api_key  # the newest caller's key: a revoked key stops being used
            if follow.served is not None:
                return follow.served
            if follow.watch is None:
                follow.watch = asyncio.run_coroutine_threadsafe(self._watch(follow), self._loop)
            while follow.served is None and not follow.stopped:
                if follow.error and follow.target is not None:
                    raise (DataLoss if follow.data_loss else Unavailable)(
                        f"deployment {deployment_id} could not load version {follow.target.version} of lineage "
                        f"'{lineage}': {follow.error}")
                if follow.error:
                    raise Unavailable(f"deployment {deployment_id} could not load lineage '{lineage}': "
                                      f"{follow.error}")
                follow.cv.wait(0.2)
            if follow.served is None:
                raise Unavailable(f"deployment {deployment_id} is being unloaded")
            return follow.served

    def state(self, deployment_id: str) -> tuple[Served | None, str]:
        with self._lock:
            follow = self._follows.get(deployment_id)
        if follow is None:
            return None, ""
        with follow.cv:
            return follow.served, follow.error

    def forget(self, deployment_id: str) -> bool:
        """Stop following; unload what was served (running requests finish first)."""
        with self._lock:
            follow = self._follows.pop(deployment_id, None)
        if follow is None:
            return False
        with follow.cv:
            follow.stopped = True
            follow.cv.notify_all()
            served = follow.served
        if follow.watch is not None:
            follow.watch.cancel()
        self._loop.call_soon_threadsafe(lambda: follow.retry and follow.retry.cancel())
        if served is not None:
            self._unload(served)
        return True

    def close(self) -> None:
        for deployment_id in list(self._follows):
            self.forget(deployment_id)
        self._pool.shutdown(wait=True, cancel_futures=True)
        asyncio.run_coroutine_threadsafe(self._watch_channel.close(), self._loop).result()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._channel.close()

    def _unload(self, served: Served) -> None:
        if served.adapter_id is not None:
            self.engine.unload_adapter(served.adapter_id)  # freed when its last running request ends
        else:  # the deployment's own copy of the base model
            self.engine.unload_base(served.model_dir)

    # ---- following (on the loop, loads in the pool) ------------------------------------------------------------

    async def _watch(self, follow: _Follow) -> None:
        """Keeps follow.target at the lineage's current version; reconnects after a dropped stream."""
        attempt = 0
        while not follow.stopped:
            try:
                stream = self._watch_stub.WatchLineage(wpb.WatchLineageRequest(lineage=follow.lineage),
                                                       metadata=auth_metadata(follow.api_key))
                async for state in stream:
                    attempt = 0
                    follow.target = state.current
                    self._schedule(follow)
            except grpc.RpcError as exc:
                follow.error = f"watching lineage '{follow.lineage}': {exc.details()}"
                with follow.cv:  # brief: serve() waiting for the first version sees the error
                    follow.cv.notify_all()
                log.warning("deployment %s: %s", follow.deployment_id, follow.error)
            await asyncio.sleep(self.retry_s[min(attempt, len(self.retry_s) - 1)])
            attempt += 1

    def _schedule(self, follow: _Follow) -> None:
        """Queue a load of follow.target unless one is queued or running, or it is served already."""
        target = follow.target
        if follow.stopped or follow.loading or target is None or (
                follow.served is not None and follow.served.version_id == target.id):
            return
        if follow.retry is not None:
            follow.retry.cancel()
            follow.retry = None
        follow.loading = True
        self._pool.submit(self._sync, follow, target)

    def _sync(self, follow: _Follow, target: wpb.WeightVersion) -> None:
        """In the pool: move the served version to target; on failure keep the previous one and retry later."""
        start = time.perf_counter()
        try:
            served = self._load(follow, target)
        except Exception as exc:  # noqa: BLE001 - any failure keeps the previous version serving
            follow.error = f"version {target.version} ({target.id}): {_describe(exc)}"
            with follow.cv:
                follow.data_loss = isinstance(exc, grpc.RpcError) and exc.code() == grpc.StatusCode.DATA_LOSS
                follow.cv.notify_all()
            log.warning("deployment %s keeps serving %s: %s", follow.deployment_id,
                        follow.served.version_id if follow.served else "nothing", follow.error)
            self._loop.call_soon_threadsafe(self._failed, follow, target)
            return
        with follow.cv:  # no submit is between serve and pinning its adapter (see using())
            if follow.stopped:  # forgotten while it loaded: it was never served
                self._unload(served)
                return
            previous, follow.served, follow.error, follow.data_loss = follow.served, served, "", False
            follow.cv.notify_all()
            if previous is not None and previous.adapter_id is not None:
                self.engine.unload_adapter(previous.adapter_id)  # freed when its last running request ends
        metrics.WEIGHT_SWAP_SECONDS.observe(time.perf_counter() - start)
        log.info("deployment %s now serves version %d (%s) of lineage '%s'", follow.deployment_id,
                 target.version, target.id, follow.lineage)
        self._loop.call_soon_threadsafe(self._loaded, follow)

    def _loaded(self, follow: _Follow) -> None:
        follow.loading, follow.failures = False, 0
        self._schedule(follow)  # a newer target may have arrived meanwhile

    def _failed(self, follow: _Follow, target: wpb.WeightVersion) -> None:
        """A transient failure is retried with backoff while the target stands; damaged stored bytes (DATA_LOSS) are
        not (fetching them again gives the same damage): only a newer target is loaded."""
        follow.loading = False
        follow.failures += 1
        if follow.target is not target:  # a newer version arrived meanwhile: load it now
            self._schedule(follow)
            return
        if follow.data_loss:
            return
        delay = self.retry_s[min(follow.failures - 1, len(self.retry_s) - 1)]
        follow.retry = self._loop.call_later(delay, self._schedule, follow)

    def _load(self, follow: _Follow, target: wpb.WeightVersion) -> Served:
        if target.kind == wpb.WEIGHT_KIND_LORA_ADAPTER:
            adapter_id = f"{follow.deployment_id}@{target.id}"
            path = self._fetch_files(follow, target, self.root / "adapters" / adapter_id)
            self.engine.load_adapter(adapter_id, follow.base_model_dir, path, eager=True)
            return Served(follow.base_model_dir, adapter_id, target.id, target.version)
        if target.kind == wpb.WEIGHT_KIND_FULL:
            return self._load_full(follow, target)
        raise FailedPrecondition(f"version {target.id} has an unknown weight kind {target.kind}")

    def _load_full(self, follow: _Follow, target: wpb.WeightVersion) -> Served:
        model_dir = self.root / "full" / follow.deployment_id
        if follow.held is None:  # first version: lay it out as a model directory and let the engine load it
            path = self._fetch_files(follow, target, self.root / "full" / f"{follow.deployment_id}@{target.id}")
            held = {}
            for f in path.glob("*.safetensors"):
                held.update(load_file(str(f)))
            if not model_dir.exists():
                layout_full_version(path, follow.base_model_dir, model_dir)
            self.engine.base(str(model_dir))
            self._write_engine(model_dir, held)  # the engine may hold an older layout: make it exactly this version
        else:
            try:
                delta = fetch_delta(self.stub, follow.api_key, target.id, follow.held_version_id)
                held = apply_delta(follow.held, delta, inplace=False)
            except (grpc.RpcError, OSError, ValueError) as exc:
                # Our copy is not the delta's base (BaseMismatchError), the delta or its base is damaged (DATA_LOSS
                # from the server, DeltaFormatError here) or it cannot be had: the whole version can.
                note = (f"version {target.version} ({target.id}): the delta from {follow.held_version_id} could not "
                        f"be used ({_describe(exc)}); fetched the version whole")
                log.warning("deployment %s: %s", follow.deployment_id, note)
                path = self._fetch_files(follow, target, self.root / "full" / f"{follow.deployment_id}@{target.id}")
                held = {}
                for f in path.glob("*.safetensors"):
                    held.update(load_file(str(f)))
                with follow.cv:
                    follow.fallback = note
            self._write_engine(model_dir, held)
        follow.held, follow.held_version_id = held, target.id
        return Served(str(model_dir), None, target.id, target.version)

    def _write_engine(self, model_dir: Path, held: dict) -> None:
        config = read_config(model_dir)
        family = family_for_config(config)
        state = family.state_dict_adapter.from_hf(dict(held), family.ModelArgs.from_hf_config(config))
        self.engine.update_base_weights(str(model_dir), state)

    def _fetch_files(self, follow: _Follow, version: wpb.WeightVersion, dest: Path) -> Path:
        return fetch_files(self.stub, follow.api_key, version, dest)


def _describe(exc: Exception) -> str:
    if isinstance(exc, grpc.RpcError) and isinstance(exc, grpc.Call):
        return f"{exc.code().name}: {exc.details()}"
    return str(exc)


def fetch_files(stub, api_key: str, version: wpb.WeightVersion, dest: Path) -> Path:
    """The version's files under dest (written whole, then renamed into place; a dest that exists is complete).
    Callers fetching one version at once into one dest must take turns."""
    if dest.exists():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=dest.parent, prefix=".fetch-"))
    try:
        fetch_version(stub, api_key, version, staging)
        staging.rename(dest)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return dest


def layout_full_version(files_dir: Path, base_model_dir: str, model_dir: Path) -> Path:
    """A model directory for a full-weight version: links to its files, plus the base model's files it does not
    carry (config, tokenizer); built beside model_dir and renamed into place whole."""
    model_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=model_dir.parent, prefix=".layout-"))
    for f in files_dir.iterdir():
        (staging / f.name).symlink_to(f.resolve())
    for name in BASE_FILES:
        src = Path(base_model_dir) / name
        if src.is_file() and not (staging / name).exists():
            (staging / name).symlink_to(src.resolve())
    staging.rename(model_dir)
    return model_dir
