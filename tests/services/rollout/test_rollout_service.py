"""The rollout service in-process over gRPC: a temp SQLite database, the object store, and two accounts.

alice owns deployment "alice-dep" (a LoRA adapter that changes the outputs); bob owns "bob-dep"; the tiny model is a
shared base model "tiny". Checks auth, account scoping, model resolution and INVALID_ARGUMENT field reporting.
"""
import time
from dataclasses import dataclass

import grpc
import pytest
import torch

from services.common import registry
from services.common.auth import create_account
from services.common.blobstore import BlobStore
from services.common.db import Database, migrate
from services.common.schema import SHARED_SCOPE, Checkpoint, Deployment, new_id, utcnow
from services.rollout.app import build
from services.rollout.sampling_core import SampleStream
from services.rollout.sampling import SamplingParams
from services.rollout.settings import RolloutSettings
from trainyard.v1 import common_pb2, rollout_pb2 as pb, rollout_pb2_grpc as rpc

from rollout_reference import SMALL_POOL_MB

GREEDY = pb.SamplingParams(temperature=0, max_tokens=12)


@dataclass
class Env:
    stub: rpc.RolloutServiceStub
    db: Database
    alice: tuple
    bob: tuple
    deps: dict  # name -> deployment id
    data_dir: object

    def call(self, method: str, request, who: str | None = "alice"):
        metadata = None if who is None else (("authorization", f"Bearer {getattr(self, who)[1]}"),)
        return getattr(self.stub, method)(request, metadata=metadata, timeout=60)


def _deploy(db, blobs, account_id, name, model_dir, adapter_dir) -> str:
    files = [f.to_json() for f in blobs.put_tree(adapter_dir)]
    with db.session() as s:
        ckpt = Checkpoint(id=new_id("ckpt"), account_id=account_id, kind="lora_adapter", base_model="tiny",
                          model_path=str(model_dir), files=files, final=True, created_at=utcnow())
        s.add(ckpt)
        s.flush()
        dep = Deployment(id=new_id("dep"), account_id=account_id, name=name, checkpoint_id=ckpt.id,
                         base_model="tiny", status="ready", created_at=utcnow(), updated_at=utcnow())
        s.add(dep)
        return dep.id


@pytest.fixture(scope="module")
def env(tmp_path_factory, tiny_model_dir, adapter_dirs, family_dirs):
    data_dir = tmp_path_factory.mktemp("rollout_service")
    settings = RolloutSettings(data_dir=data_dir, host="127.0.0.1", rollout_port=0, grpc_workers=4,
                               shutdown_grace_s=0, max_loaded_adapters=2, kv_cache_mb=SMALL_POOL_MB)
    migrate(settings.database_url)
    db = Database(settings.database_url)
    blobs = BlobStore(settings.blob_dir)
    alice_acct, _, alice_key = create_account(db, "alice")
    bob_acct, _, bob_key = create_account(db, "bob")
    with db.session() as s:
        registry.register_model(s, SHARED_SCOPE, "tiny", str(tiny_model_dir))
        registry.register_model(s, SHARED_SCOPE, "tiny-moe", str(family_dirs["qwen3_moe"]))
    deps = {
        "alice-dep": _deploy(db, blobs, alice_acct.id, "alice-dep", tiny_model_dir, adapter_dirs["a"]),
        "bob-dep": _deploy(db, blobs, bob_acct.id, "bob-dep", tiny_model_dir, adapter_dirs["b"]),
    }
    server = build(settings)
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    yield Env(rpc.RolloutServiceStub(channel), db, (alice_acct.id, alice_key), (bob_acct.id, bob_key), deps,
              data_dir)
    channel.close()
    server.stop()
    db.dispose()


def sample(env, model, who="alice", params=GREEDY, **prompt):
    prompt = prompt or {"text": "The quick brown fox"}
    return env.call("Sample", pb.SampleRequest(model=model, params=params, **prompt), who)


def test_sample_base_model_and_deployment(env):
    base = sample(env, "tiny")
    dep = sample(env, "alice-dep")
    assert base.model == "tiny" and dep.model == "alice-dep"
    assert base.prompt_tokens == dep.prompt_tokens and len(base.prompt_tokens) > 0
    (b,), (d,) = base.sequences, dep.sequences
    assert len(b.tokens) == len(b.logprobs) and b.finish_reason in ("stop", "length")
    assert list(d.logprobs) != list(b.logprobs)  # the adapter is applied
    # The deployment's files were laid out under <data_dir>/rollout/adapters/<deployment id>/<checkpoint id>/.
    (laid_out,) = (env.data_dir / "rollout" / "adapters" / env.deps["alice-dep"]).iterdir()
    assert laid_out.name.startswith("ckpt") and (laid_out / "adapter_config.json").is_file()


def test_prompt_forms_and_n(env):
    text = sample(env, "tiny", text="Hello")
    tokens = sample(env, "tiny", tokens=common_pb2.TokenList(tokens=list(text.prompt_tokens)))
    assert tokens.sequences[0].tokens == text.sequences[0].tokens
    chat = sample(env, "tiny", messages=common_pb2.ChatMessages(
        messages=[common_pb2.ChatMessage(role="user", content="Hello")]))
    assert len(chat.prompt_tokens) > len(text.prompt_tokens)  # the chat template wraps the turn
    many = sample(env, "tiny", params=pb.SamplingParams(n=5, max_tokens=4, seed=1))
    assert len(many.sequences) == 5


def test_unauthenticated_without_key(env):
    with pytest.raises(grpc.RpcError) as exc:
        sample(env, "tiny", who=None)
    assert exc.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_unknown_model_and_other_accounts_deployment_are_not_found(env):
    for name in ("no-such-model", "bob-dep", env.deps["bob-dep"]):
        with pytest.raises(grpc.RpcError) as exc:
            sample(env, name)
        assert exc.value.code() == grpc.StatusCode.NOT_FOUND, name
        assert "no deployment or base model" in exc.value.details()
    assert len(sample(env, "bob-dep", who="bob").sequences) == 1
    with pytest.raises(grpc.RpcError) as exc:
        env.call("LoadDeployment", pb.LoadDeploymentRequest(deployment_id=env.deps["bob-dep"]))
    assert exc.value.code() == grpc.StatusCode.NOT_FOUND


@pytest.mark.parametrize("params,field", [
    (pb.SamplingParams(temperature=-1), "params.temperature"),
    (pb.SamplingParams(top_p=0), "params.top_p"),
    (pb.SamplingParams(n=65), "params.n"),
    (pb.SamplingParams(max_tokens=5000), "params.max_tokens"),
])
def test_bad_params_are_invalid_argument(env, params, field):
    with pytest.raises(grpc.RpcError) as exc:
        sample(env, "tiny", params=params)
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert exc.value.details().startswith(field)


def test_bad_prompts_are_invalid_argument(env):
    for prompt in ({"tokens": common_pb2.TokenList(tokens=[5000])}, {"text": ""},
                   {"messages": common_pb2.ChatMessages(messages=[common_pb2.ChatMessage(role="robot")])}):
        with pytest.raises(grpc.RpcError) as exc:
            sample(env, "tiny", **prompt)
        assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT, prompt
        assert exc.value.details().startswith("prompt"), exc.value.details()


def test_load_list_unload_and_deleted_deployments(env):
    dep_id = env.deps["alice-dep"]
    loaded = env.call("LoadDeployment", pb.LoadDeploymentRequest(deployment_id=dep_id))
    assert (loaded.name, loaded.base_model, loaded.deployment_id) == ("alice-dep", "tiny", dep_id)
    names = {m.name for m in env.call("ListLoaded", pb.ListLoadedRequest()).models}
    assert {"alice-dep", "tiny"} <= names and "bob-dep" not in names
    # Deleted in the database (as the scheduler does before unloading): never served, though still loaded.
    with env.db.session() as s:
        s.get(Deployment, dep_id).deleted_at = utcnow()
    with pytest.raises(grpc.RpcError) as exc:
        sample(env, "alice-dep")
    assert exc.value.code() == grpc.StatusCode.NOT_FOUND
    assert "alice-dep" not in {m.name for m in env.call("ListLoaded", pb.ListLoadedRequest()).models}
    # bob cannot unload alice's deployment; alice can, also after the delete.
    with pytest.raises(grpc.RpcError) as exc:
        env.call("UnloadDeployment", pb.UnloadDeploymentRequest(deployment_id=dep_id), who="bob")
    assert exc.value.code() == grpc.StatusCode.NOT_FOUND
    assert env.call("UnloadDeployment", pb.UnloadDeploymentRequest(deployment_id=dep_id)).unloaded is True
    assert env.call("UnloadDeployment", pb.UnloadDeploymentRequest(deployment_id=dep_id)).unloaded is False
    assert not (env.data_dir / "rollout" / "adapters" / dep_id).exists()


def test_failed_deployment_is_not_served(env, tiny_model_dir, adapter_dirs):
    dep_id = _deploy(env.db, BlobStore(env.data_dir / "blobs"), env.alice[0], "broken", tiny_model_dir,
                     adapter_dirs["c"])
    with env.db.session() as s:
        dep = s.get(Deployment, dep_id)
        dep.status, dep.error = "failed", "rollout could not load it"
    with pytest.raises(grpc.RpcError) as exc:
        sample(env, "broken")
    assert exc.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "failed" in exc.value.details()


@pytest.mark.reliability
def test_a_deployment_whose_stored_files_are_damaged_is_data_loss(env, tiny_model_dir, tmp_path, flip_byte):
    """Its checkpoint's files are verified while they are laid out: DATA_LOSS naming the deployment, checkpoint and
    file, and nothing loaded or left on disk; LoadDeployment (the scheduler then marks it failed) and Sample alike."""
    from rollout_reference import write_adapter

    blobs = BlobStore(env.data_dir / "blobs")
    dep_id = _deploy(env.db, blobs, env.alice[0], "damaged", tiny_model_dir,
                     write_adapter(tiny_model_dir, tmp_path / "adapter", seed=77, b_scale=0.5))
    with env.db.session() as s:
        ckpt = s.get(Checkpoint, s.get(Deployment, dep_id).checkpoint_id)
        weights = next(f for f in ckpt.files if f["path"].endswith(".safetensors"))
    flip_byte(blobs.path(weights["sha256"]), 200)
    for call in (lambda: env.call("LoadDeployment", pb.LoadDeploymentRequest(deployment_id=dep_id)),
                 lambda: sample(env, "damaged")):
        with pytest.raises(grpc.RpcError) as exc:
            call()
        assert exc.value.code() == grpc.StatusCode.DATA_LOSS
        assert (f"deployment 'damaged': checkpoint {ckpt.id} file {weights['path']}: blob {weights['sha256']} is "
                "damaged") in exc.value.details()
    assert not (env.data_dir / "rollout" / "adapters" / dep_id).exists()
    assert "damaged" not in {m.name for m in env.call("ListLoaded", pb.ListLoadedRequest()).models}


# ---- SampleStream and the new SamplingParams fields ------------------------------------------------------------


def _stream(env, model, params, who="alice", **prompt):
    prompt = prompt or {"text": "The quick brown fox"}
    return list(env.call("SampleStream", pb.SampleRequest(model=model, params=params, **prompt), who))


def _joined(messages) -> dict[int, dict]:
    seqs: dict[int, dict] = {}
    for m in messages:
        for d in m.deltas:
            s = seqs.setdefault(d.index, {"tokens": [], "text": "", "logprobs": [], "top": [], "finish": []})
            s["tokens"] += d.tokens
            s["text"] += d.text
            s["logprobs"] += d.logprobs
            s["top"] += [list(t.token_ids) for t in d.top_logprobs]
            s["finish"].append(d.finish_reason)
    return seqs


@pytest.mark.parametrize("model,who", [("tiny", "alice"), ("bob-dep", "bob")])  # alice-dep is deleted above
def test_stream_is_the_unary_answer_in_pieces(env, model, who):
    params = pb.SamplingParams(n=2, seed=3, max_tokens=9, top_logprobs=2, prompt_logprobs=True)
    unary = sample(env, model, who=who, params=params)
    messages = _stream(env, model, params, who=who)
    assert (messages[0].model, list(messages[0].prompt_tokens)) == (model, list(unary.prompt_tokens))
    assert [m.done for m in messages] == [False] * (len(messages) - 1) + [True]
    assert list(messages[-1].prompt_logprobs) == list(unary.prompt_logprobs)
    assert len(unary.prompt_logprobs) == len(unary.prompt_tokens) - 1
    joined = _joined(messages)
    assert len(messages) > 2 and sorted(joined) == [0, 1]  # incremental: more than one message per sequence
    for i, seq in enumerate(unary.sequences):
        got = joined[i]
        assert (got["tokens"], got["text"], got["logprobs"]) == (list(seq.tokens), seq.text, list(seq.logprobs))
        assert got["top"] == [list(t.token_ids) for t in seq.top_logprobs] and len(got["top"]) == len(seq.tokens)
        assert got["finish"][-1] == seq.finish_reason and not any(got["finish"][:-1])  # only the last delta


def test_router_ids_over_grpc(env):
    params = pb.SamplingParams(temperature=0, max_tokens=5, return_router_ids=True)
    (seq,) = sample(env, "tiny-moe", params=params).sequences
    r = seq.router_ids
    assert r.dtype == "uint8" and r.top_k == 2 and list(r.layers) == [1, 2, 3]  # layer 0 is dense (mlp_only)
    ids = torch.frombuffer(bytearray(r.ids), dtype=torch.uint8).view(r.num_tokens, len(r.layers), r.top_k)
    assert r.num_tokens == len(sample(env, "tiny-moe", params=params).prompt_tokens) + len(seq.tokens) - 1
    assert int(ids.max()) < 8
    (final,) = [d for m in _stream(env, "tiny-moe", params) for d in m.deltas if d.finish_reason]
    assert final.router_ids.ids == r.ids


@pytest.mark.parametrize("params,field", [
    (pb.SamplingParams(min_p=1.5), "params.min_p"),
    (pb.SamplingParams(top_logprobs=21), "params.top_logprobs"),
    (pb.SamplingParams(return_router_ids=True), "params.return_router_ids"),  # "tiny" is dense
])
def test_new_params_are_checked_on_both_rpcs(env, params, field):
    for call in (lambda: sample(env, "tiny", params=params), lambda: _stream(env, "tiny", params)):
        with pytest.raises(grpc.RpcError) as exc:
            call()
        assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert exc.value.details().startswith(field)


def test_closing_a_stream_early_aborts_its_request(engine, tiny_model_dir, prompt_ids):
    """What the servicer does when a SampleStream client goes away: close outputs() early."""
    handle = engine.submit(str(tiny_model_dir), None, prompt_ids, SamplingParams(temperature=0, max_tokens=1500))
    stream = SampleStream(model="tiny", prompt_tokens=prompt_ids, router_layers=None, handle=handle)
    outputs = stream.outputs()
    next(outputs)
    outputs.close()
    core = engine.base(str(tiny_model_dir)).core
    deadline = time.monotonic() + 30
    while core.has_work() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not core.has_work()
    assert core.scheduler.blocks.num_free == core.scheduler.blocks.num_blocks


def test_min_weight_version_is_checked_before_anything_waits(env):
    """min_weight_version: refused at once for a model that follows no lineage (naming the field), and for a
    version its lineage does not have yet (a wait for it could only end at the deadline). The wait itself:
    test_rollout_weights.py::test_min_version_waits_for_the_version_within_the_deadline."""
    with env.db.session() as s:
        s.add(Deployment(id=new_id("dep"), account_id=env.alice[0], name="alice-follows", lineage="alice-lineage",
                         base_model="tiny", status="ready", created_at=utcnow(), updated_at=utcnow()))
    for model in ("tiny", "alice-dep"):
        for method in ("Sample", "SampleStream"):
            with pytest.raises(grpc.RpcError) as err:
                out = env.call(method, pb.SampleRequest(model=model, text="hi", params=GREEDY, min_weight_version=1))
                list(out) if method == "SampleStream" else out
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
            assert "min_weight_version" in err.value.details()
    with pytest.raises(grpc.RpcError) as err:
        env.call("Sample", pb.SampleRequest(model="alice-follows", text="hi", params=GREEDY, min_weight_version=3))
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "min_weight_version 3: lineage 'alice-lineage' has no such version yet (its latest is 0)" in \
        err.value.details()
    with pytest.raises(grpc.RpcError) as err:
        env.call("Sample", pb.SampleRequest(model="tiny", text="hi", params=GREEDY, min_weight_version=-1))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "min_weight_version" in err.value.details()
