"""No account can starve another on the rollout: unary Sample stops computing when its client leaves, lineage
deployments are followed without a thread each and a failed one stops being followed, and live deployments are
bounded per account (max_deployments_per_account, through the scheduler's core and a real rollout server).

Real weight-sync and rollout servers in process, on SQLite; the session's shared engine for the core checks."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest
from rollout_reference import SMALL_POOL_MB, write_adapter
from safetensors.torch import load_file, save_file
from sqlalchemy import select

from services.common import registry
from services.common.auth import create_account
from services.common.blobstore import BlobStore
from services.common.calls import Cancellation
from services.common.channels import auth_metadata, wait_healthy
from services.common.db import Database, migrate
from services.common.errors import Cancelled, ResourceExhausted, Unavailable
from services.common.schema import SHARED_SCOPE, Checkpoint, Deployment, new_id, utcnow
from services.rollout.app import build as build_rollout
from services.rollout.engine import Engine
from services.rollout.sampling import SamplingParams
from services.rollout.sampling_core import Prompt, SamplingCore
from services.rollout.settings import RolloutSettings
from services.rollout.templates import TemplateSandbox
from services.rollout.weights import WeightFollower
from services.scheduler.app import RolloutGateway
from services.scheduler.deployments import DeploymentCore
from services.weightsync.app import WeightSyncSettings
from services.weightsync.app import build as build_weightsync
from services.weightsync.client import publish_dir
from trainyard.localstack import ROOT, free_port
from trainyard.v1 import common_pb2, rollout_pb2_grpc, weightsync_pb2_grpc
from trainyard.v1 import rollout_pb2 as rpb
from trainyard.v1 import weightsync_pb2 as wpb

FOLLOWED = 80  # lineage deployments of one rollout (the old design held 2 threads each, and 1 of weight sync's 64)


class Env:
    def __init__(self, root: Path, model_dir: Path):
        self.root, self.model_dir = root, model_dir
        common = dict(data_dir=root, host="127.0.0.1", shutdown_grace_s=0)
        migrate(WeightSyncSettings(**common).database_url)
        self.ws_settings = WeightSyncSettings(weightsync_port=0, watch_poll_s=0.05, **common)
        self.db = Database(self.ws_settings.database_url)
        self.blobs = BlobStore(self.ws_settings.blob_dir)
        (self.alice, _, self.key), (self.bob, _, self.bob_key) = (create_account(self.db, n) for n in ("alice", "bob"))
        with self.db.session() as s:
            registry.register_model(s, SHARED_SCOPE, "tiny", str(model_dir))
        self.weightsync = build_weightsync(self.ws_settings)
        self.weightsync.start()
        self.ws_target = f"127.0.0.1:{self.weightsync.port}"
        self.rollout = build_rollout(RolloutSettings(rollout_port=0, grpc_workers=4, kv_cache_mb=SMALL_POOL_MB,
                                                     weightsync_url=self.ws_target, **common))
        self.rollout.start()
        self.rollout_target = f"127.0.0.1:{self.rollout.port}"
        self.channels = [grpc.insecure_channel(t) for t in (self.ws_target, self.rollout_target)]
        self.ws = weightsync_pb2_grpc.WeightSyncServiceStub(self.channels[0])
        self.rollout_stub = rollout_pb2_grpc.RolloutServiceStub(self.channels[1])
        self.gateway = RolloutGateway(self.rollout_target, 64)  # the scheduler's way to the rollout
        self.parents: dict[str, str] = {}

    def publish(self, lineage: str, directory: Path) -> wpb.WeightVersion:
        v = publish_dir(self.ws, self.key, lineage=lineage, parent_id=self.parents.get(lineage, ""),
                        kind=wpb.WEIGHT_KIND_LORA_ADAPTER, base_model="tiny", directory=directory)
        self.parents[lineage] = v.id
        return v

    def checkpoint(self, account_id: str, adapter_dir: Path) -> str:
        files = [f.to_json() for f in self.blobs.put_tree(adapter_dir)]
        with self.db.session() as s:
            ckpt = Checkpoint(id=new_id("ckpt"), account_id=account_id, kind="lora_adapter", base_model="tiny",
                              model_path=str(self.model_dir), files=files, final=True, created_at=utcnow())
            s.add(ckpt)
        return ckpt.id

    def close(self) -> None:
        for ch in [*self.channels, self.gateway.channel]:
            ch.close()
        self.rollout.stop()
        self.weightsync.stop()
        self.db.dispose()


@pytest.fixture(scope="module")
def env(tmp_path_factory, tiny_model_dir):
    e = Env(tmp_path_factory.mktemp("rollout_fair"), tiny_model_dir)
    yield e
    e.close()


def _threads(prefix: str) -> int:
    return sum(1 for t in threading.enumerate() if t.name.startswith(prefix))


def test_sample_stops_computing_when_its_client_leaves(env, engine, prompt_ids):
    core = SamplingCore(env.db, env.blobs, engine, env.root / "adapters")
    engine_core = engine.base(str(env.model_dir)).core
    cancel = threading.Timer(0.5, (cancellation := Cancellation()).cancel)
    cancel.start()
    started = time.monotonic()
    with pytest.raises(Cancelled):
        core.sample(env.alice.id, "tiny", Prompt(tokens=tuple(prompt_ids)),
                    SamplingParams(temperature=0, max_tokens=1500), cancel=cancellation)
    assert time.monotonic() - started < 20
    deadline = time.monotonic() + 10
    while engine_core.has_work() and time.monotonic() < deadline:
        time.sleep(0.02)
    steps = engine_core.num_steps
    time.sleep(0.3)
    assert not engine_core.has_work() and engine_core.num_steps == steps  # the request was dropped, not finished
    assert engine_core.scheduler.blocks.num_free == engine_core.scheduler.blocks.num_blocks


def test_a_sample_whose_client_leaves_stops_computing_over_grpc(env, prompt_ids):
    """1500 tokens take the tiny model seconds; the client gives up after one, and the rollout goes idle at once."""
    request = rpb.SampleRequest(model="tiny", tokens=common_pb2.TokenList(tokens=prompt_ids),
                                params=rpb.SamplingParams(temperature=0, max_tokens=1500))
    with pytest.raises(grpc.RpcError) as late:
        env.rollout_stub.Sample(request, metadata=auth_metadata(env.key), timeout=1.0)
    assert late.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    time.sleep(0.5)  # the abort reaches the engine loop between two steps
    cpu = time.process_time()
    time.sleep(2)
    assert time.process_time() - cpu < 0.5  # this process (the rollout's engine included) computes nothing


@pytest.mark.reliability
def test_many_lineage_deployments_hold_no_thread_each(env, engine, tmp_path):
    v1 = env.publish("many", write_adapter(env.model_dir, tmp_path / "v1", seed=61, b_scale=0.5))
    before = _threads("weights-")
    follower = WeightFollower(engine, env.ws_target, tmp_path / "follower", retry_s=(0.05, 0.1), load_workers=2)
    try:
        for i in range(FOLLOWED):
            assert follower.serve(f"dep-many-{i}", "many", str(env.model_dir), env.key).version_id == v1.id
        assert _threads("weights-") - before <= 3  # its watch loop and load pool, whatever the number of deployments
        assert _threads("weightsync") <= env.ws_settings.grpc_workers + 1
        v2 = env.publish("many", write_adapter(env.model_dir, tmp_path / "v2", seed=62, b_scale=0.5))
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and any(
                follower.state(f"dep-many-{i}")[0].version_id != v2.id for i in range(FOLLOWED)):
            time.sleep(0.05)
        assert {follower.state(f"dep-many-{i}")[0].version_id for i in range(FOLLOWED)} == {v2.id}
    finally:
        follower.close()
    assert not [a for a in engine.loaded_adapters() if a.startswith("dep-many-")]


def _broken_adapter(model_dir: Path, out: Path) -> Path:
    """An adapter whose tensors do not fit the tiny model (each one a row short)."""
    write_adapter(model_dir, out, seed=70, b_scale=0.5)
    tensors = load_file(out / "adapter_model.safetensors")
    save_file({k: v[:-1].contiguous() for k, v in tensors.items()}, out / "adapter_model.safetensors")
    return out


def test_a_lineage_deployment_that_fails_to_load_stops_being_followed(env, tmp_path):
    env.publish("broken", _broken_adapter(env.model_dir, tmp_path / "broken"))
    with pytest.raises(Unavailable, match="could not load"):
        DeploymentCore(env.db, env.gateway.load, env.gateway.unload).create(env.alice.id, env.key, "broken-dep", "",
                                                                            "", lineage="broken")
    with env.db.session() as s:
        dep = s.scalar(select(Deployment).where(Deployment.name == "broken-dep"))
        assert dep.status == "failed"
    time.sleep(0.5)  # a follower still retrying would report its error here
    loaded = env.rollout_stub.ListLoaded(rpb.ListLoadedRequest(), metadata=auth_metadata(env.key), timeout=30)
    assert dep.id not in [m.deployment_id for m in loaded.models]


def test_live_deployments_are_bounded_per_account(env, adapter_dirs):
    core = DeploymentCore(env.db, env.gateway.load, env.gateway.unload, max_per_account=2)
    ckpt = env.checkpoint(env.alice.id, adapter_dirs["a"])
    first = core.create(env.alice.id, env.key, "quota-a", ckpt, "")
    core.create(env.alice.id, env.key, "quota-b", ckpt, "")
    with pytest.raises(ResourceExhausted, match=r"quota max_deployments_per_account \(2\) reached"):
        core.create(env.alice.id, env.key, "quota-c", ckpt, "")
    bob = core.create(env.bob.id, env.bob_key, "quota-a", env.checkpoint(env.bob.id, adapter_dirs["b"]), "")
    core.delete(env.alice.id, env.key, first.id)
    core.create(env.alice.id, env.key, "quota-c", ckpt, "")  # a deleted deployment frees its place
    core.delete(env.bob.id, env.bob_key, bob.id)


def test_deployments_of_one_base_share_one_bounded_kv_pool(tiny_model_dir, tmp_path, prompt_ids):
    """A full-weight deployment is a model directory of its own (its own engine loop) with its base's KV layout: it
    draws from the base's pool instead of reserving another kv_cache_mb, requests that do not fit at once wait for
    each other's blocks, and the pool holds no memory once they are done."""
    deployed = tmp_path / "full-deployment"
    deployed.mkdir()
    for f in tiny_model_dir.iterdir():
        (deployed / f.name).symlink_to(f)
    params = SamplingParams(temperature=0, max_tokens=60)
    blocks_per_request = -(-(len(prompt_ids) + params.max_tokens) // 16)
    engine = Engine(kv_cache_blocks=blocks_per_request * 3 // 2, kv_block_size=16, deterministic=True)
    try:
        base, full = engine.base(str(tiny_model_dir)), engine.base(str(deployed))
        assert base.core.arena is full.core.arena and len(engine.kv_arenas()) == 1
        (alone,) = engine.generate(str(tiny_model_dir), None, prompt_ids, params)
        assert not base.core.arena.allocated  # idle: the pool's memory went with the last block
        handles = [engine.submit(d, None, prompt_ids, params) for d in (str(tiny_model_dir), str(deployed)) * 2]
        for handle in handles:  # deterministic mode: bitwise the request alone, however they waited
            (seq,) = handle.result().sequences
            assert (seq.tokens, seq.logprobs) == (alone.tokens, alone.logprobs)
        assert base.core.arena.num_free == base.core.arena.num_blocks and not base.core.arena.allocated
    finally:
        engine.close()


LOOP = "{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}{{ messages[0]['content'] }}"
HUNGRY = "{{ messages[0]['content'] * 3000000000 }}"
CHAT = (("user", "hi"),)


@pytest.fixture(scope="module")
def template_models(env, tmp_path_factory):
    """Copies of the tiny model whose chat template loops for hours ("loopy") or asks for 3 GB ("hungry")."""
    root = tmp_path_factory.mktemp("templates")
    for name, template in (("loopy", LOOP), ("hungry", HUNGRY)):
        model = root / name
        model.mkdir()
        for f in env.model_dir.iterdir():
            if f.name != "tokenizer_config.json":
                (model / f.name).symlink_to(f)
        config = json.loads((env.model_dir / "tokenizer_config.json").read_text())
        (model / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
        with env.db.session() as s:
            registry.register_model(s, SHARED_SCOPE, name, str(model))
    return root


def test_templates_past_their_cpu_or_memory_are_stopped_with_an_error_naming_them(env, engine, template_models):
    sandbox = TemplateSandbox(workers=1, cpu_s=1, memory_mb=256)
    core = SamplingCore(env.db, env.blobs, engine, env.root / "adapters", templates=sandbox)
    params = SamplingParams(temperature=0, max_tokens=4)
    try:
        started = time.monotonic()
        with pytest.raises(ResourceExhausted, match=r"chat template of 'loopy' was stopped after 1 s of CPU"):
            core.sample(env.alice.id, "loopy", Prompt(messages=CHAT), params)
        assert time.monotonic() - started < 15
        with pytest.raises(ResourceExhausted, match=r"chat template of 'hungry' needed more than 256 MB"):
            core.sample(env.alice.id, "hungry", Prompt(messages=CHAT), params)
        # The one worker recovered from both: a well-behaved template renders as apply_chat_template does.
        result = core.sample(env.alice.id, "tiny", Prompt(messages=CHAT), params)
        tokenizer = engine.base(str(env.model_dir)).tokenizer
        assert result.prompt_tokens == list(tokenizer.apply_chat_template(
            [{"role": "user", "content": "hi"}], tokenize=True, add_generation_prompt=True, return_dict=False))
    finally:
        sandbox.close()


def test_closing_the_sandbox_ends_a_busy_render_at_once(template_models):
    sandbox = TemplateSandbox(workers=1, cpu_s=30)
    failures = []

    def render():
        try:
            sandbox.render("loopy", LOOP, [{"role": "user", "content": "hi"}], add_generation_prompt=True,
                           variables={})
        except Unavailable as exc:
            failures.append(exc)

    t = threading.Thread(target=render)
    t.start()
    time.sleep(2)  # the worker started and is looping
    closed = time.monotonic()
    sandbox.close()
    t.join(10)
    assert not t.is_alive() and time.monotonic() - closed < 5 and "shutting down" in str(failures[0])


@pytest.mark.reliability
def test_a_busy_template_does_not_hold_the_rollouts_shutdown(env, template_models, tmp_path):
    """The rollout as its own process with a 30 s grace period: SIGTERM while a looping template renders, and it is
    gone long before the grace period is over."""
    port = free_port()
    proc_env = {**os.environ, "PYTHONPATH": str(ROOT), "TRAINYARD_DATA_DIR": str(env.root), "TRAINYARD_HOST":
                "127.0.0.1", "TRAINYARD_ROLLOUT_PORT": str(port), "TRAINYARD_WEIGHTSYNC_URL": env.ws_target,
                "TRAINYARD_SHUTDOWN_GRACE_S": "30", "TRAINYARD_TORCH_THREADS": "1",
                "TRAINYARD_KV_CACHE_MB": str(SMALL_POOL_MB), "TRAINYARD_CHAT_TEMPLATE_CPU_S": "5"}
    with open(tmp_path / "rollout.log", "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "services.rollout"], env=proc_env, cwd=ROOT, stdout=log,
                                stderr=subprocess.STDOUT)
    try:
        wait_healthy(f"127.0.0.1:{port}", timeout_s=120)
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = rollout_pb2_grpc.RolloutServiceStub(channel).Sample.future(
                rpb.SampleRequest(model="loopy", messages=common_pb2.ChatMessages(messages=[
                    common_pb2.ChatMessage(role="user", content="hi")]), params=rpb.SamplingParams(max_tokens=4)),
                metadata=auth_metadata(env.key), timeout=120)
            time.sleep(2)  # rendering
            proc.send_signal(signal.SIGTERM)
            sent = time.monotonic()
            proc.wait(timeout=25)
            assert time.monotonic() - sent < 25
            assert call.exception().code() in (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
