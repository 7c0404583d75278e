"""Hot-loading weight versions into the running engine: a real weight-sync server in process, a WeightFollower on
the shared engine, LoRA and full-weight lineages, pinning, rollback and every failure the transport can meet.

Every check compares the engine's logprobs with a plain forward of the model holding the expected weights (fp32,
no cache: rollout_reference.naive_logprobs_TV), within 1e-5.
"""
import copy
import hashlib
import threading
import time
from pathlib import Path

import grpc
import pytest
import torch
from sqlalchemy import select

from models import load_pretrained, save_pretrained
from models.lora import load_peft_adapter
from rollout_reference import naive_logprobs_TV, write_adapter
from services.common.auth import create_account
from services.common.blobstore import BlobStore
from services.common.db import Database, migrate
from services.common.errors import DataLoss, DeadlineExceeded
from services.common.schema import WeightDelta
from services.rollout.sampling import SamplingParams
from services.rollout.weights import WeightFollower
from services.weightsync.app import WeightSyncSettings, build
from services.weightsync.client import publish_dir
from trainyard.v1 import common_pb2, weightsync_pb2 as wpb, weightsync_pb2_grpc

ATOL = 1e-5
SAMPLE = SamplingParams(temperature=1.0, max_tokens=8, seed=3, n=2)


class Env:
    def __init__(self, root: Path, tiny_model_dir: Path):
        self.root = root
        settings = WeightSyncSettings(data_dir=root / "data", host="127.0.0.1", weightsync_port=0, grpc_workers=8,
                                      shutdown_grace_s=0, watch_poll_s=0.05)
        migrate(settings.database_url)
        self.db = Database(settings.database_url)
        _, _, self.key = create_account(self.db, "alice")
        self.server = build(settings)
        self.server.start()
        self.target = f"127.0.0.1:{self.server.port}"
        self.channel = grpc.insecure_channel(self.target)
        self.stub = weightsync_pb2_grpc.WeightSyncServiceStub(self.channel)
        self.model_dir = tiny_model_dir
        self.parents: dict[str, str] = {}

    def publish(self, lineage: str, kind: int, directory: Path, ephemeral: bool = False) -> wpb.WeightVersion:
        v = publish_dir(self.stub, self.key, lineage=lineage, parent_id=self.parents.get(lineage, ""), kind=kind,
                        base_model="tiny", directory=directory, ephemeral=ephemeral)
        self.parents[lineage] = v.id
        return v

    def follower(self, engine, name: str, **kw) -> WeightFollower:
        return WeightFollower(engine, self.target, self.root / name, retry_s=(0.05, 0.1), **kw)

    def close(self) -> None:
        self.channel.close()
        self.server.stop()
        self.db.dispose()


@pytest.fixture(scope="module")
def env(tmp_path_factory, tiny_model_dir):
    e = Env(tmp_path_factory.mktemp("weights"), tiny_model_dir)
    yield e
    e.close()


def wait_served(follower, dep: str, version_id: str, timeout: float = 60):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        served, _ = follower.state(dep)
        if served is not None and served.version_id == version_id:
            return served
        time.sleep(0.02)
    raise AssertionError(f"{dep} did not reach {version_id}: {follower.state(dep)}")


def check_against(model, prompt_ids, sequences):
    for seq in sequences:
        ref = naive_logprobs_TV(model, prompt_ids + seq.tokens)
        want = [ref[len(prompt_ids) - 1 + i, t].item() for i, t in enumerate(seq.tokens)]
        assert max(abs(a - b) for a, b in zip(seq.logprobs, want)) <= ATOL


def adapter_model(model_dir, adapter_dir):
    model = load_pretrained(model_dir)
    load_peft_adapter(model, adapter_dir)
    return model


def test_lora_versions_hot_load_and_pin_running_requests(env, engine, prompt_ids, tmp_path):
    v1_dir = write_adapter(env.model_dir, tmp_path / "v1", seed=11, b_scale=0.5)
    v2_dir = write_adapter(env.model_dir, tmp_path / "v2", seed=12, b_scale=0.5)
    v1 = env.publish("lora-a", wpb.WEIGHT_KIND_LORA_ADAPTER, v1_dir)
    follower = env.follower(engine, "lora")
    try:
        served = follower.serve("dep-lora", "lora-a", str(env.model_dir), env.key)
        assert (served.version_id, served.version) == (v1.id, 1) and served.adapter_id == f"dep-lora@{v1.id}"
        # A long request starts on v1 and is still running when v2 arrives: it finishes on v1's weights.
        running = engine.submit(served.model_dir, served.adapter_id, prompt_ids,
                                SamplingParams(temperature=1.0, max_tokens=48, seed=5))
        v2 = env.publish("lora-a", wpb.WEIGHT_KIND_LORA_ADAPTER, v2_dir)
        now = wait_served(follower, "dep-lora", v2.id)
        check_against(adapter_model(env.model_dir, v1_dir), prompt_ids, running.result().sequences)
        fresh = engine.generate(now.model_dir, now.adapter_id, prompt_ids, SAMPLE)
        check_against(adapter_model(env.model_dir, v2_dir), prompt_ids, fresh)
        assert served.adapter_id not in engine.loaded_adapters()  # v1's slot freed once its last request ended
    finally:
        follower.close()


@pytest.fixture(scope="module")
def full_versions(env, tmp_path_factory):
    """Three full-weight versions of the tiny model as a rollout receives them (bf16): v1, then two real AdamW steps
    on float32 master weights (v2, v3)."""
    root = tmp_path_factory.mktemp("full")
    model = load_pretrained(env.model_dir)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=2e-4)
    ids = torch.randint(3, 1000, (4, 24), generator=torch.Generator().manual_seed(0))
    dirs = []
    for step in range(3):
        if step:
            loss = torch.nn.functional.cross_entropy(model(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())
            loss.backward()
            opt.step()
            opt.zero_grad()
        out = root / f"v{step + 1}"
        save_pretrained(copy.deepcopy(model).to(torch.bfloat16), out)  # tensors + config.json (the rollout takes
        # the tokenizer from the base model)
        dirs.append(out)
    return dirs


def test_full_weights_move_by_delta_and_roll_back(env, engine, prompt_ids, full_versions):
    v1 = env.publish("full-a", wpb.WEIGHT_KIND_FULL, full_versions[0])
    follower = env.follower(engine, "full")
    try:
        served = follower.serve("dep-full", "full-a", str(env.model_dir), env.key)
        check_against(load_pretrained(full_versions[0]), prompt_ids,
                      engine.generate(served.model_dir, None, prompt_ids, SAMPLE))
        v2 = env.publish("full-a", wpb.WEIGHT_KIND_FULL, full_versions[1])
        t0 = time.monotonic()
        now = wait_served(follower, "dep-full", v2.id)
        sync_s = time.monotonic() - t0
        print(f"full-weight sync (publish seen -> hot-loaded): {sync_s * 1000:.0f} ms")
        assert now.model_dir == served.model_dir  # the same engine base, weights written in place
        check_against(load_pretrained(full_versions[1]), prompt_ids,
                      engine.generate(now.model_dir, None, prompt_ids, SAMPLE))
        with env.db.session() as s:  # it travelled as a delta, far smaller than the tensors
            delta = s.query(WeightDelta).filter_by(base_version_id=v1.id, version_id=v2.id).one()
        full_bytes = sum(f.size_bytes for f in v2.files)
        print(f"delta {delta.size_bytes} bytes vs {full_bytes} for the whole version")
        assert delta.size_bytes < full_bytes / 3, (delta.size_bytes, full_bytes)
        # Rollback to v1: consumers move back (by a delta v2 -> v1), and forward again on the next publish.
        env.stub.Rollback(wpb.RollbackRequest(lineage="full-a", version_id=v1.id),
                          metadata=(("authorization", f"Bearer {env.key}"),))
        wait_served(follower, "dep-full", v1.id)
        check_against(load_pretrained(full_versions[0]), prompt_ids,
                      engine.generate(served.model_dir, None, prompt_ids, SAMPLE))
        v3 = env.publish("full-a", wpb.WEIGHT_KIND_FULL, full_versions[2])
        wait_served(follower, "dep-full", v3.id)
        check_against(load_pretrained(full_versions[2]), prompt_ids,
                      engine.generate(served.model_dir, None, prompt_ids, SAMPLE))
    finally:
        follower.close()


class Faulty:
    """The weight-sync stub with transport faults injected into FetchVersion streams (the server is real)."""

    def __init__(self, channel, faults: list[str]):
        self._stub = weightsync_pb2_grpc.WeightSyncServiceStub(channel)
        self.faults = faults  # consumed one per FetchVersion call: "corrupt", "cut", "bad-file", "ok"
        self.calls = 0

    def __getattr__(self, name):
        return getattr(self._stub, name)

    def FetchVersion(self, request, **kw):
        self.calls += 1
        fault = self.faults.pop(0) if self.faults else "ok"
        for i, chunk in enumerate(self._stub.FetchVersion(request, **kw)):
            if fault == "cut" and i == 1:
                raise _Cut()
            if fault == "corrupt" and i == 0:
                chunk = common_pb2.FileChunk(path=chunk.path, offset=chunk.offset,
                                             data=bytes([chunk.data[0] ^ 0xFF]) + chunk.data[1:],
                                             sha256=chunk.sha256, file_size=chunk.file_size)
            if fault == "bad-file":  # damaged at rest: each chunk self-consistent, the file checksum is not
                data = bytes([chunk.data[0] ^ 1]) + chunk.data[1:]
                chunk = common_pb2.FileChunk(path=chunk.path, offset=chunk.offset, data=data,
                                             sha256=hashlib.sha256(data).hexdigest(), file_size=chunk.file_size)
            yield chunk


class _Cut(grpc.RpcError, grpc.Call):
    def code(self):
        return grpc.StatusCode.UNAVAILABLE

    def details(self):
        return "connection cut mid-transfer (injected)"

    # grpc.Call's other abstract methods are not used by the client
    def initial_metadata(self): ...
    def trailing_metadata(self): ...
    def is_active(self): return False
    def time_remaining(self): return None
    def cancel(self): ...
    def add_callback(self, callback): ...


@pytest.mark.parametrize("faults", [["corrupt"], ["cut"], ["cut", "corrupt"]], ids=["corrupt-chunk", "cut", "both"])
def test_transfer_faults_are_retried_within_one_load(env, engine, prompt_ids, tmp_path, faults):
    lineage = f"lora-{'-'.join(faults)}"
    v1 = env.publish(lineage, wpb.WEIGHT_KIND_LORA_ADAPTER, write_adapter(env.model_dir, tmp_path / "v1", seed=21,
                                                                           b_scale=0.5))
    stub = {}
    follower = env.follower(engine, lineage, stub_factory=lambda ch: stub.setdefault("s", Faulty(ch, list(faults))))
    try:
        served = follower.serve(f"dep-{lineage}", lineage, str(env.model_dir), env.key)
        assert served.version_id == v1.id and stub["s"].calls >= len(faults) + 1
        check_against(adapter_model(env.model_dir, tmp_path / "v1"), prompt_ids,
                      engine.generate(served.model_dir, served.adapter_id, prompt_ids, SAMPLE))
    finally:
        follower.close()


def test_a_version_that_keeps_failing_leaves_the_previous_one_serving(env, engine, prompt_ids, tmp_path):
    v1_dir = write_adapter(env.model_dir, tmp_path / "v1", seed=31, b_scale=0.5)
    v2_dir = write_adapter(env.model_dir, tmp_path / "v2", seed=32, b_scale=0.5)
    v1 = env.publish("lora-bad", wpb.WEIGHT_KIND_LORA_ADAPTER, v1_dir)
    holder = {}
    follower = env.follower(engine, "bad", stub_factory=lambda ch: holder.setdefault("s", Faulty(ch, [])))
    try:
        follower.serve("dep-bad", "lora-bad", str(env.model_dir), env.key)
        holder["s"].faults.extend(["bad-file"] * 9)  # every attempt at v2 arrives with a checksum mismatch
        v2 = env.publish("lora-bad", wpb.WEIGHT_KIND_LORA_ADAPTER, v2_dir)
        deadline = time.monotonic() + 30
        while "checksum" not in follower.state("dep-bad")[1] and time.monotonic() < deadline:
            time.sleep(0.02)
        served, error = follower.state("dep-bad")
        assert served.version_id == v1.id and "checksum" in error and v2.id in error
        check_against(adapter_model(env.model_dir, v1_dir), prompt_ids,
                      engine.generate(served.model_dir, served.adapter_id, prompt_ids, SAMPLE))
        holder["s"].faults.clear()  # the store is healthy again: the retry loads v2
        served = wait_served(follower, "dep-bad", v2.id)
        assert follower.state("dep-bad")[1] == ""
        check_against(adapter_model(env.model_dir, v2_dir), prompt_ids,
                      engine.generate(served.model_dir, served.adapter_id, prompt_ids, SAMPLE))
    finally:
        follower.close()


def test_wrong_delta_base_falls_back_to_the_whole_version(env, engine, prompt_ids, full_versions):
    env.publish("full-b", wpb.WEIGHT_KIND_FULL, full_versions[0])
    follower = env.follower(engine, "wrong-base")
    try:
        follower.serve("dep-wb", "full-b", str(env.model_dir), env.key)
        follow = follower._follows["dep-wb"]
        next(iter(follow.held.values())).view(torch.uint8).flatten()[0] ^= 1  # our copy is no longer v1, bit-wise
        v2 = env.publish("full-b", wpb.WEIGHT_KIND_FULL, full_versions[1])
        served = wait_served(follower, "dep-wb", v2.id)
        check_against(load_pretrained(full_versions[1]), prompt_ids,
                      engine.generate(served.model_dir, None, prompt_ids, SAMPLE))
    finally:
        follower.close()


def test_hot_load_under_concurrent_sampling_loses_nothing(env, engine, prompt_ids, tmp_path):
    dirs = [write_adapter(env.model_dir, tmp_path / f"v{i}", seed=40 + i, b_scale=0.5) for i in range(4)]
    versions = [env.publish("lora-busy", wpb.WEIGHT_KIND_LORA_ADAPTER, dirs[0])]
    follower = env.follower(engine, "busy")
    results, errors, stop = [], [], threading.Event()

    def client(k: int) -> None:
        while not stop.is_set():
            try:
                served = follower.serve("dep-busy", "lora-busy", str(env.model_dir), env.key)
                seqs = engine.generate(served.model_dir, served.adapter_id, prompt_ids,
                                       SamplingParams(temperature=1.0, max_tokens=6, seed=k, n=2))
                results.append((served.version_id, seqs))
            except Exception as exc:  # noqa: BLE001 - collected: the test fails on any
                errors.append(exc)

    try:
        follower.serve("dep-busy", "lora-busy", str(env.model_dir), env.key)
        threads = [threading.Thread(target=client, args=(k,)) for k in range(3)]
        for t in threads:
            t.start()
        for d in dirs[1:]:
            versions.append(env.publish("lora-busy", wpb.WEIGHT_KIND_LORA_ADAPTER, d))
            wait_served(follower, "dep-busy", versions[-1].id)
            time.sleep(0.3)
        stop.set()
        for t in threads:
            t.join(60)
        assert not errors, errors
        by_version = {v.id: d for v, d in zip(versions, dirs)}
        seen = {vid for vid, _ in results}
        assert len(results) >= 6 and len(seen) >= 2, (len(results), seen)
        models = {vid: adapter_model(env.model_dir, by_version[vid]) for vid in seen}
        for vid, seqs in results:  # every request ran wholly on the version it started on
            check_against(models[vid], prompt_ids, seqs)
    finally:
        follower.close()


# ---- damaged stored bytes ---------------------------------------------------------------------------------------

def server_blobs(env) -> BlobStore:
    return BlobStore(env.root / "data" / "blobs")


@pytest.mark.reliability
def test_a_damaged_cached_delta_falls_back_to_the_whole_version(env, engine, prompt_ids, full_versions, flip_byte):
    """The delta v1 -> v2 cached by the service is damaged at rest: the service ends its fetch with DATA_LOSS (and
    drops it), and the follower fetches v2 whole instead of retrying the delta forever, recording why."""
    md = (("authorization", f"Bearer {env.key}"),)
    v1 = env.publish("full-c", wpb.WEIGHT_KIND_FULL, full_versions[0])
    v2 = env.publish("full-c", wpb.WEIGHT_KIND_FULL, full_versions[1])
    delta = b"".join(c.data for c in env.stub.FetchVersion(
        wpb.FetchVersionRequest(id=v2.id, base_version_id=v1.id), metadata=md))  # encoded and cached now
    with env.db.session() as s:
        cached = s.scalars(select(WeightDelta).where(WeightDelta.version_id == v2.id)).one()
    flip_byte(server_blobs(env).path(cached.sha256), len(delta) // 2)
    env.stub.Rollback(wpb.RollbackRequest(lineage="full-c", version_id=v1.id), metadata=md)
    follower = env.follower(engine, "damaged-delta")
    try:
        follower.serve("dep-dd", "full-c", str(env.model_dir), env.key)  # v1, fetched whole
        env.stub.Rollback(wpb.RollbackRequest(lineage="full-c", version_id=v2.id), metadata=md)
        served = wait_served(follower, "dep-dd", v2.id)
        check_against(load_pretrained(full_versions[1]), prompt_ids,
                      engine.generate(served.model_dir, None, prompt_ids, SAMPLE))
        note = follower._follows["dep-dd"].fallback
        assert f"the delta from {v1.id} could not be used (DATA_LOSS: delta from weight version {v1.id} to " \
               f"{v2.id}: blob {cached.sha256} is damaged" in note and note.endswith("fetched the version whole")
    finally:
        follower.close()


@pytest.mark.reliability
def test_a_damaged_stored_version_is_data_loss_and_not_fetched_again(env, engine, prompt_ids, tmp_path, flip_byte):
    """Damage at rest is final: the first load fails with DataLoss naming the version and file (a deployment of it
    is refused, never served), and the follower does not fetch the same damage again until the lineage moves on."""
    v1 = env.publish("lora-damaged", wpb.WEIGHT_KIND_LORA_ADAPTER,
                     write_adapter(env.model_dir, tmp_path / "v1", seed=51, b_scale=0.5))
    damaged = next(f for f in v1.files if f.path.endswith(".safetensors"))
    flip_byte(server_blobs(env).path(damaged.sha256), 100)
    holder = {}
    follower = env.follower(engine, "damaged", stub_factory=lambda ch: holder.setdefault("s", Faulty(ch, [])))
    try:
        with pytest.raises(DataLoss, match=f"weight version {v1.id} file {damaged.path}: blob {damaged.sha256} is "
                                           "damaged"):
            follower.serve("dep-damaged", "lora-damaged", str(env.model_dir), env.key)
        time.sleep(0.5)  # retry_s is (0.05, 0.1): a transient failure would have been fetched again by now
        assert holder["s"].calls == 1
        v2_dir = write_adapter(env.model_dir, tmp_path / "v2", seed=52, b_scale=0.5)
        v2 = env.publish("lora-damaged", wpb.WEIGHT_KIND_LORA_ADAPTER, v2_dir)
        served = wait_served(follower, "dep-damaged", v2.id)
        check_against(adapter_model(env.model_dir, v2_dir), prompt_ids,
                      engine.generate(served.model_dir, served.adapter_id, prompt_ids, SAMPLE))
    finally:
        follower.close()


def test_min_version_waits_for_the_version_within_the_deadline(env, engine, prompt_ids, tmp_path):
    """min_weight_version (SampleRequest): a request for version >= m waits until the deployment serves m, and is
    then submitted on exactly m (the switch is held off inside the block); a version that does not arrive in time
    is DeadlineExceeded naming the setting, and the request is never submitted on the older version."""
    v1_dir = write_adapter(env.model_dir, tmp_path / "v1", seed=21, b_scale=0.5)
    v1 = env.publish("lora-min", wpb.WEIGHT_KIND_LORA_ADAPTER, v1_dir)
    v2_dir = write_adapter(env.model_dir, tmp_path / "v2", seed=22, b_scale=0.5)
    follower = env.follower(engine, "min-version")
    try:
        assert follower.serve("dep-min", "lora-min", str(env.model_dir), env.key).version_id == v1.id
        with pytest.raises(DeadlineExceeded, match="needs version 2 or later.*min_weight_version"):
            with follower.using("dep-min", "lora-min", str(env.model_dir), env.key, min_version=2, wait_s=0.3):
                raise AssertionError("entered the block on version 1")
        got = {}

        def request():
            with follower.using("dep-min", "lora-min", str(env.model_dir), env.key, min_version=2,
                                wait_s=60) as served:
                got["served"] = served
                got["sequences"] = engine.generate(served.model_dir, served.adapter_id, prompt_ids, SAMPLE)

        waiting = threading.Thread(target=request)
        waiting.start()
        time.sleep(0.3)
        assert waiting.is_alive() and not got  # still waiting: version 2 is not published yet
        v2 = env.publish("lora-min", wpb.WEIGHT_KIND_LORA_ADAPTER, v2_dir)
        waiting.join(60)
        assert (got["served"].version_id, got["served"].version) == (v2.id, 2)
        check_against(adapter_model(env.model_dir, v2_dir), prompt_ids, got["sequences"])
        # Already there: no wait.
        with follower.using("dep-min", "lora-min", str(env.model_dir), env.key, min_version=1, wait_s=0) as served:
            assert served.version_id == v2.id
    finally:
        follower.close()
