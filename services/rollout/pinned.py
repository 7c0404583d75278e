"""Sampling one exact weight version: SampleRequest.model = "trainyard://weights/<version id>" (the path a Training
API SaveWeights returns).

Resolution, on every request:
1. GetVersion from the weight-sync service with the caller's API key: a version of another account, or none, is
   NotFound (the weight-sync service scopes versions to their account). Versions never change, so an account's
   successful lookups are remembered; except an ephemeral version's (services/weightsync/store.py), which is looked
   up on every request: once newer ones replaced it the weight-sync service answers FAILED_PRECONDITION naming it,
   passed on as it is, and this rollout drops its copy (the adapter and its files). The first request for a new
   ephemeral version of a lineage also looks up the lineage's older ephemeral versions held here and drops those
   deleted, so an RL loop sampling each version once leaves the lineage's few live ones here, not all it saved.
2. A LoRA adapter version: its files are fetched once into <root>/adapters/<version id>/ and handed to the engine under
   the adapter id "weights@<version id>"; the engine's adapter LRU (max_loaded_adapters) loads its weights on use and
   evicts the least recently used idle adapter, so versions share the slots with deployments.
3. A full-weight version: its files are fetched once into <root>/files/<version id>/ and laid out with the base
   model's config and tokenizer as the model directory <root>/full/<version id>/, which the engine loads as a base
   model of its own. At most max_full_versions of them stay loaded: loading another unloads the least recently
   used one no request is being submitted to (its running requests finish first; it is reloaded from disk when
   sampled again).
A version is never followed or replaced: requests naming it always run on exactly its weights.
"""
from __future__ import annotations

import contextlib
import shutil
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc

from services.common.channels import auth_metadata
from services.common.errors import DataLoss, FailedPrecondition, NotFound, Unavailable, not_found
from services.rollout.weights import Served, fetch_files, layout_full_version
from trainyard.v1 import weightsync_pb2 as wpb

WEIGHTS_PREFIX = "trainyard://weights/"
ADAPTER_PREFIX = "weights@"
LOOKUPS_KEPT = 4096  # (account, version) lookups remembered


class PinnedWeights:
    def __init__(self, engine, stub, root: Path, max_full_versions: int = 2):
        self.engine = engine
        self.stub = stub  # the weight-sync service (WeightSyncServiceStub)
        self.root = Path(root)
        self.max_full_versions = max_full_versions
        self._lock = threading.Lock()  # guards the dictionaries below
        self._lookups: OrderedDict[tuple[str, str], wpb.WeightVersion] = OrderedDict()
        self._fetching: dict[str, threading.Lock] = {}  # one fetch per version at a time
        self._full: OrderedDict[str, int] = OrderedDict()  # loaded full versions (least recent first) -> users
        # (account, lineage) -> the ids of its ephemeral LoRA versions held here, oldest first.
        self._ephemeral: dict[tuple[str, str], dict[str, None]] = {}

    @contextlib.contextmanager
    def using(self, account_id: str, api_key: str, version_id: str,
              base_model_dir: Callable[[str], str]) -> Iterator[tuple[Served, wpb.WeightVersion]]:
        """The version's weights for requests submitted inside the block (a full version is not unloaded while
        it lasts). base_model_dir(name) is the directory of the version's base model for this account."""
        version = self.version(account_id, api_key, version_id)
        base_dir = base_model_dir(version.base_model)
        if version.kind == wpb.WEIGHT_KIND_LORA_ADAPTER:
            if version.ephemeral:
                self._prune_ephemeral(account_id, api_key, version)
            files = self._fetch(api_key, version, self.root / "adapters" / version.id)
            adapter_id = f"{ADAPTER_PREFIX}{version.id}"
            self.engine.load_adapter(adapter_id, base_dir, files, eager=False)
            yield Served(base_dir, adapter_id, version.id, version.version), version
        elif version.kind == wpb.WEIGHT_KIND_FULL:
            model_dir = self.root / "full" / version.id
            if not model_dir.exists():
                files = self._fetch(api_key, version, self.root / "files" / version.id)
                with self._turn(version.id):
                    if not model_dir.exists():
                        layout_full_version(files, base_dir, model_dir)
            self._hold(version.id)
            try:
                self.engine.base(str(model_dir))
                yield Served(str(model_dir), None, version.id, version.version), version
            finally:
                with self._lock:
                    self._full[version.id] -= 1
        else:
            raise FailedPrecondition(f"weight version '{version.id}' has an unknown weight kind {version.kind}")

    def version(self, account_id: str, api_key: str, version_id: str) -> wpb.WeightVersion:
        key = (account_id, version_id)
        with self._lock:
            if key in self._lookups:
                self._lookups.move_to_end(key)
                return self._lookups[key]
        try:
            version = self.stub.GetVersion(wpb.GetVersionRequest(id=version_id), metadata=auth_metadata(api_key))
        except grpc.RpcError as exc:
            if exc.code() in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.INVALID_ARGUMENT):
                raise not_found("weight version", version_id) from None
            if exc.code() == grpc.StatusCode.FAILED_PRECONDITION:  # a deleted ephemeral version
                self._drop_copy(version_id)
                raise FailedPrecondition(exc.details()) from None
            raise Unavailable(f"cannot look up weight version '{version_id}' in the weight-sync service: "
                              f"{exc.details()}") from None
        if version.ephemeral:
            return version
        with self._lock:
            self._lookups[key] = version
            while len(self._lookups) > LOOKUPS_KEPT:
                self._lookups.popitem(last=False)
        return version

    def _prune_ephemeral(self, account_id: str, api_key: str, version: wpb.WeightVersion) -> None:
        """Note version as held here; when it is new, drop the lineage's older held ones the weight-sync service
        has deleted (a lookup that cannot be made now leaves them for the next new version)."""
        with self._lock:
            held = self._ephemeral.setdefault((account_id, version.lineage), {})
            if version.id in held:
                return
            older = list(held)
            held[version.id] = None
        for version_id in older:
            try:
                self.version(account_id, api_key, version_id)
            except FailedPrecondition:  # deleted: version() dropped the copy
                with self._lock:
                    held.pop(version_id, None)
            except (NotFound, Unavailable):
                pass

    def _drop_copy(self, version_id: str) -> None:
        """Forget a deleted ephemeral LoRA version's adapter (requests running on it finish) and its fetched files."""
        if self.engine.unload_adapter(f"{ADAPTER_PREFIX}{version_id}"):
            with self._turn(version_id):
                shutil.rmtree(self.root / "adapters" / version_id, ignore_errors=True)

    def _turn(self, version_id: str) -> threading.Lock:
        with self._lock:
            return self._fetching.setdefault(version_id, threading.Lock())

    def _fetch(self, api_key: str, version: wpb.WeightVersion, dest: Path) -> Path:
        if dest.exists():
            return dest
        with self._turn(version.id):
            try:
                return fetch_files(self.stub, api_key, version, dest)
            except grpc.RpcError as exc:  # DATA_LOSS: the service's stored copy is damaged; else it can be retried
                error = DataLoss if exc.code() == grpc.StatusCode.DATA_LOSS else Unavailable
                raise error(f"cannot fetch weight version '{version.id}': {exc.details()}") from None

    def _hold(self, version_id: str) -> None:
        """Count a user of a full version and unload the least recently used idle ones beyond the limit."""
        with self._lock:
            self._full[version_id] = self._full.get(version_id, 0) + 1
            self._full.move_to_end(version_id)
            idle = [v for v, users in self._full.items() if users == 0]
            for victim in idle[:max(0, len(self._full) - self.max_full_versions)]:
                del self._full[victim]
                self.engine.unload_base(str(self.root / "full" / victim))
