"""The OpenAI-compatible HTTP endpoint of the real rollout app (services/rollout/app.py build) on free ports.

A temp SQLite database with two accounts: alice owns deployment "alice-dep" (a LoRA adapter that changes the outputs),
bob owns "bob-dep"; the tiny model is the shared base model "tiny". Deterministic mode, so a request's tokens and
logprobs are bitwise the same whatever runs next to it: HTTP answers are compared exactly with gRPC Sample answers
to the same seeded request, streamed answers with non-streamed ones, concurrent requests with lone ones.
"""
import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc
import httpx
import pytest

from services.common import registry
from services.common.auth import create_account
from services.common.blobstore import BlobStore
from services.common.db import Database, migrate
from services.common.schema import SHARED_SCOPE, Checkpoint, Deployment, new_id, utcnow
from services.rollout.app import build
from services.rollout.engine_core import EngineCore
from services.rollout.settings import RolloutSettings
from trainyard.localstack import free_port
from trainyard.v1 import common_pb2, rollout_pb2 as pb, rollout_pb2_grpc as rpc

from rollout_reference import SMALL_POOL_MB

PROMPT = "The quick brown fox"


@dataclass
class Env:
    http: httpx.Client
    stub: rpc.RolloutServiceStub
    keys: dict  # account name -> API key
    core: object  # the app's SamplingCore

    def post(self, path: str, body: dict, who: str | None = "alice") -> httpx.Response:
        return self.http.post(path, json=body, headers=_auth(self.keys.get(who)))

    def ok(self, path: str, body: dict, who: str = "alice") -> dict:
        r = self.post(path, body, who)
        assert r.status_code == 200, r.text
        return r.json()

    def events(self, path: str, body: dict, who: str = "alice") -> list:
        with self.http.stream("POST", path, json={**body, "stream": True}, headers=_auth(self.keys[who])) as r:
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
            lines = [line for line in r.iter_lines() if line]
        assert all(line.startswith("data: ") for line in lines) and lines[-1] == "data: [DONE]"
        return [json.loads(line[6:]) for line in lines[:-1]]

    def sample(self, request: pb.SampleRequest, who: str = "alice") -> pb.SampleResponse:
        return self.stub.Sample(request, metadata=(("authorization", f"Bearer {self.keys[who]}"),), timeout=60)


def _auth(key: str | None) -> dict:
    return {"Authorization": f"Bearer {key}"} if key else {}


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


def _start(data_dir, tiny_model_dir, adapter_dirs, **overrides):
    settings = RolloutSettings(**{
        "data_dir": data_dir, "host": "127.0.0.1", "rollout_port": 0, "openai_port": free_port(), "grpc_workers": 4,
        "shutdown_grace_s": 0, "max_loaded_adapters": 2, "kv_cache_mb": SMALL_POOL_MB, "deterministic": True,
        **overrides})
    migrate(settings.database_url)
    db = Database(settings.database_url)
    blobs = BlobStore(settings.blob_dir)
    keys = {}
    for name in ("alice", "bob"):
        account, _, keys[name] = create_account(db, name)
        _deploy(db, blobs, account.id, f"{name}-dep", tiny_model_dir, adapter_dirs["a" if name == "alice" else "b"])
    with db.session() as s:
        registry.register_model(s, SHARED_SCOPE, "tiny", str(tiny_model_dir))
    server = build(settings)
    server.start()
    return settings, db, keys, server


def _openai_servers(server) -> list:
    """The server's background tasks that serve the OpenAI HTTP endpoint (OpenAIServer.serve)."""
    return [fn for fn in server.spec.background if type(getattr(fn, "__self__", None)).__name__ == "OpenAIServer"]


@pytest.fixture(scope="module")
def env(tmp_path_factory, tiny_model_dir, adapter_dirs):
    settings, db, keys, server = _start(tmp_path_factory.mktemp("rollout_openai"), tiny_model_dir, adapter_dirs)
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    (serve,) = _openai_servers(server)
    with httpx.Client(base_url=f"http://127.0.0.1:{settings.openai_port}", timeout=60) as http:
        yield Env(http, rpc.RolloutServiceStub(channel), keys, serve.__self__.app.core)
    channel.close()
    server.stop()
    db.dispose()


# ---- answers equal the engine's (gRPC Sample) --------------------------------------------------------------------


@pytest.mark.parametrize("model,who", [("alice-dep", "alice"), ("tiny", "bob")])
def test_completion_equals_grpc_sample(env, model, who):
    body = {"model": model, "prompt": PROMPT, "max_tokens": 10, "temperature": 0.9, "seed": 5, "n": 2, "logprobs": 3,
            "top_k": 50, "min_p": 0.01}
    got = env.ok("/v1/completions", body, who)
    want = env.sample(pb.SampleRequest(model=model, text=PROMPT, params=pb.SamplingParams(
        temperature=0.9, seed=5, n=2, max_tokens=10, top_logprobs=3, top_k=50, min_p=0.01)), who)
    assert got["object"] == "text_completion" and got["id"].startswith("cmpl-") and got["model"] == model
    assert [c["index"] for c in got["choices"]] == [0, 1]
    for choice, seq in zip(got["choices"], want.sequences):
        assert (choice["text"], choice["finish_reason"]) == (seq.text, seq.finish_reason)
        lp = choice["logprobs"]
        assert lp["token_logprobs"] == list(seq.logprobs)  # exactly: float32 values through JSON
        assert len(lp["tokens"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == len(seq.tokens)
        for tok, alts, sampled_lp, grpc_top in zip(lp["tokens"], lp["top_logprobs"], seq.logprobs, seq.top_logprobs):
            # The 3 most likely tokens and the sampled one, keyed by text (tokens holding part of a multi-byte
            # character all read U+FFFD, so they can share a key).
            assert set(alts.values()) <= {*grpc_top.logprobs, sampled_lp}
            if not any("\ufffd" in t for t in alts):
                assert alts[tok] == sampled_lp and 3 <= len(alts) <= 4
                assert sorted(alts.values(), reverse=True)[:3] == list(grpc_top.logprobs)
        # text_offset counts characters from the start of the prompt.
        assert lp["text_offset"][0] == len(PROMPT) and lp["text_offset"] == sorted(lp["text_offset"])
        full = PROMPT + choice["text"]
        for tok, off in zip(lp["tokens"], lp["text_offset"]):
            if off + len(tok) <= len(full) and "\ufffd" not in tok:
                assert full[off:off + len(tok)] == tok
    assert got["usage"] == {"prompt_tokens": len(want.prompt_tokens),
                            "completion_tokens": sum(len(s.tokens) for s in want.sequences),
                            "total_tokens": len(want.prompt_tokens) + sum(len(s.tokens) for s in want.sequences)}


def test_chat_equals_grpc_sample(env):
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hello there"}]
    body = {"model": "alice-dep", "messages": messages, "max_completion_tokens": 12, "seed": 7, "n": 2,
            "logprobs": True, "top_logprobs": 2}
    got = env.ok("/v1/chat/completions", body)
    want = env.sample(pb.SampleRequest(model="alice-dep", messages=common_pb2.ChatMessages(messages=[
        common_pb2.ChatMessage(role=m["role"], content=m["content"]) for m in messages]),
        params=pb.SamplingParams(seed=7, n=2, max_tokens=12, top_logprobs=2)))
    assert got["object"] == "chat.completion" and got["id"].startswith("chatcmpl-")
    for i, (choice, seq) in enumerate(zip(got["choices"], want.sequences)):
        assert choice["index"] == i and choice["message"] == {"role": "assistant", "content": seq.text}
        assert choice["finish_reason"] == seq.finish_reason
        content = choice["logprobs"]["content"]
        assert [e["logprob"] for e in content] == list(seq.logprobs) and len(content) == len(seq.tokens)
        for e, top in zip(content, seq.top_logprobs):
            assert [a["logprob"] for a in e["top_logprobs"]] == list(top.logprobs)
            assert bytes(e["bytes"]).decode("utf-8", "replace") == e["token"]
        assert b"".join(bytes(e["bytes"]) for e in content).decode("utf-8", "replace").startswith(seq.text)
    assert got["usage"]["prompt_tokens"] == len(want.prompt_tokens)
    # "developer" is OpenAI's newer name for the system role; text parts are joined.
    dev = [{"role": "developer", "content": [{"type": "text", "text": "You are "}, {"type": "text", "text": "terse."}]},
           messages[1]]
    again = env.ok("/v1/chat/completions", {**body, "messages": dev})
    assert [c["message"] for c in again["choices"]] == [c["message"] for c in got["choices"]]


def test_prompt_forms_n_and_echo(env):
    one = env.ok("/v1/completions", {"model": "tiny", "prompt": PROMPT, "max_tokens": 6, "n": 3, "seed": 11})
    tokens = env.sample(pb.SampleRequest(model="tiny", text=PROMPT, params=pb.SamplingParams(max_tokens=1))
                        ).prompt_tokens
    as_ids = env.ok("/v1/completions", {"model": "tiny", "prompt": list(tokens), "max_tokens": 6, "n": 3, "seed": 11})
    assert [c["text"] for c in as_ids["choices"]] == [c["text"] for c in one["choices"]]
    # A list of prompts: choice p * n + i is sample i of prompt p, as if each prompt were sent alone.
    other = "Hello"
    batch = env.ok("/v1/completions", {"model": "tiny", "prompt": [other, PROMPT], "max_tokens": 6, "n": 3, "seed": 11})
    alone = env.ok("/v1/completions", {"model": "tiny", "prompt": other, "max_tokens": 6, "n": 3, "seed": 11})
    assert [c["index"] for c in batch["choices"]] == list(range(6))
    assert [c["text"] for c in batch["choices"]] == [c["text"] for c in alone["choices"] + one["choices"]]
    assert batch["usage"]["prompt_tokens"] == alone["usage"]["prompt_tokens"] + one["usage"]["prompt_tokens"]
    nested = env.ok("/v1/completions", {"model": "tiny", "prompt": [list(tokens)], "max_tokens": 6, "n": 3, "seed": 11})
    assert nested["choices"] == as_ids["choices"]
    # echo with logprobs 0: the prompt's tokens and logprobs come first (the first token has none).
    echo = env.ok("/v1/completions", {"model": "tiny", "prompt": PROMPT, "max_tokens": 4, "seed": 2, "echo": True,
                                      "logprobs": 0})
    want = env.sample(pb.SampleRequest(model="tiny", text=PROMPT, params=pb.SamplingParams(
        max_tokens=4, seed=2, prompt_logprobs=True)))
    (choice,), (seq,) = echo["choices"], want.sequences
    assert choice["text"] == PROMPT + seq.text
    lp, P = choice["logprobs"], len(want.prompt_tokens)
    assert lp["token_logprobs"] == [None, *want.prompt_logprobs, *seq.logprobs]
    assert lp["top_logprobs"][0] is None and all(len(t) == 1 for t in lp["top_logprobs"][1:])
    assert "".join(lp["tokens"][:P]) == PROMPT and lp["text_offset"][0] == 0 and lp["text_offset"][P] == len(PROMPT)


def test_stop_strings(env):
    base = {"model": "tiny", "prompt": PROMPT, "max_tokens": 24, "temperature": 0}
    free = env.ok("/v1/completions", base)["choices"][0]["text"]
    stop = free[4:6]
    assert len(free) > 6 and stop.strip()
    cut = env.ok("/v1/completions", {**base, "stop": stop})["choices"][0]
    assert (cut["text"], cut["finish_reason"]) == (free[:free.index(stop)], "stop")
    streamed = env.events("/v1/completions", {**base, "stop": [stop, "\u00a7never"]})
    assert "".join(c["choices"][0]["text"] for c in streamed) == cut["text"]
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "temperature": 0, "max_tokens": 24}
    reply = env.ok("/v1/chat/completions", chat)["choices"][0]["message"]["content"]
    stop = reply[3:5]
    assert len(reply) > 5 and stop.strip()
    cut = env.ok("/v1/chat/completions", {**chat, "stop": [stop]})["choices"][0]
    assert (cut["message"]["content"], cut["finish_reason"]) == (reply[:reply.index(stop)], "stop")


# ---- streaming -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("logprobs", [0, 2])
def test_completion_stream_assembles_to_the_response(env, logprobs):
    body = {"model": "alice-dep", "prompt": [PROMPT, "Hello"], "max_tokens": 12, "n": 2, "seed": 3,
            "logprobs": logprobs, "stop": ["the"]}
    whole = env.ok("/v1/completions", body)
    chunks = env.events("/v1/completions", {**body, "stream_options": {"include_usage": True}})
    *chunks, last = chunks
    assert last["choices"] == [] and last["usage"] == whole["usage"]
    assert len(chunks) > 4 and {c["id"] for c in chunks} == {last["id"]}
    for choice in whole["choices"]:
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == choice["index"]]
        assert all(c["object"] == "text_completion" and c["usage"] is None for c in chunks)
        assert "".join(m["text"] for m in mine) == choice["text"]
        assert [m["finish_reason"] for m in mine] == [None] * (len(mine) - 1) + [choice["finish_reason"]]
        for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
            assert [v for m in mine for v in m["logprobs"][key]] == choice["logprobs"][key], key
    echo = env.events("/v1/completions", {"model": "tiny", "prompt": PROMPT, "max_tokens": 5, "echo": True,
                                          "temperature": 0})
    assert echo[0]["choices"][0]["text"] == PROMPT
    assert "".join(c["choices"][0]["text"] for c in echo) == env.ok("/v1/completions", {
        "model": "tiny", "prompt": PROMPT, "max_tokens": 5, "echo": True, "temperature": 0})["choices"][0]["text"]


def test_chat_stream_assembles_to_the_response(env):
    body = {"model": "alice-dep", "messages": [{"role": "user", "content": "Tell me"}], "max_tokens": 12, "n": 2,
            "seed": 9, "logprobs": True, "top_logprobs": 1}
    whole = env.ok("/v1/chat/completions", body)
    chunks = env.events("/v1/chat/completions", body)
    assert all(c["object"] == "chat.completion.chunk" and "usage" not in c for c in chunks)
    for choice in whole["choices"]:
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == choice["index"]]
        assert mine[0]["delta"] == {"role": "assistant", "content": ""}
        assert mine[-1]["delta"] == {} and mine[-1]["finish_reason"] == choice["finish_reason"]
        assert all(m["finish_reason"] is None for m in mine[:-1])
        assert "".join(m["delta"].get("content", "") for m in mine) == choice["message"]["content"]
        assert [e for m in mine if m["logprobs"] for e in m["logprobs"]["content"]] == choice["logprobs"]["content"]


# ---- errors ----------------------------------------------------------------------------------------------------


def _error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return err


def test_auth_errors(env):
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 2}
    for headers in ({}, {"Authorization": "Bearer ty_not-a-key"}, {"Authorization": "Basic abc"}):
        for method, path in (("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("GET", "/v1/models")):
            r = env.http.request(method, path, json=body if method == "POST" else None, headers=headers)
            err = _error(r, 401)
            assert (err["type"], err["code"]) == ("invalid_request_error", "invalid_api_key")
    assert env.http.get("/health").json() == {"status": "ok"}  # no key needed
    assert env.http.get("/v1/models", headers={"x-api-key": env.keys["alice"]}).status_code == 200


def test_unknown_model_and_other_accounts_deployment_are_404(env):
    for model in ("no-such-model", "bob-dep"):
        for path, body in (("/v1/completions", {"prompt": PROMPT}),
                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})):
            err = _error(env.post(path, {"model": model, **body}), 404)
            assert (err["param"], err["code"]) == ("model", "model_not_found")
    assert _error(env.http.get("/v1/models/bob-dep", headers=_auth(env.keys["alice"])), 404)["param"] == "model"


@pytest.mark.parametrize("path,fields,param", [
    ("/v1/completions", {"temperature": -1}, "temperature"),
    ("/v1/completions", {"n": 0}, "n"),
    ("/v1/completions", {"max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"top_p": 0}, "top_p"),
    ("/v1/completions", {"logprobs": 21}, "logprobs"),
    ("/v1/completions", {"temperature": "hot"}, "temperature"),
    ("/v1/completions", {"stop": [""]}, "stop"),
    ("/v1/completions", {"prompt": []}, "prompt"),
    ("/v1/completions", {"prompt": [5000]}, "prompt"),
    ("/v1/completions", {"prompt": ["ok", ""]}, "prompt[1]"),
    ("/v1/completions", {"max_tokens": 5000}, "max_tokens"),
    ("/v1/completions", {"presence_penalty": 0.5}, "presence_penalty"),
    ("/v1/completions", {"echo": True, "logprobs": 2}, "logprobs"),
    ("/v1/completions", {"stream_options": {"include_usage": True}}, "stream_options"),
    ("/v1/completions", {"model": ""}, "model"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    ("/v1/chat/completions", {"max_completion_tokens": 0}, "max_completion_tokens"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"tools": [{"type": "function"}]}, "tools"),
    # A NUL reaches the database through `model` (which Postgres cannot store), so no string may hold one.
    ("/v1/completions", {"model": "ti\x00ny"}, "model"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a\x00b"}]}, "messages[0].content"),
])
def test_bad_params_are_400_naming_the_parameter(env, path, fields, param):
    body = {"model": "tiny", "prompt": PROMPT, "messages": [{"role": "user", "content": "x"}], **fields}
    err = _error(env.post(path, body), 400)
    assert (err["param"], err["type"]) == (param, "invalid_request_error")
    assert err["message"].startswith(param)
    if param != "stream_options":  # a stream is refused the same way, before it starts
        assert _error(env.post(path, {**body, "stream": True}), 400)["param"] == param


def test_bad_bodies(env):
    r = env.http.post("/v1/completions", content=b"{not json", headers=_auth(env.keys["alice"]))
    assert _error(r, 400)["param"] is None
    assert _error(env.post("/v1/completions", [1, 2]), 400)["param"] is None  # type: ignore[arg-type]
    assert _error(env.http.get("/v1/nothing-here"), 404)["code"] is None
    # Python's JSON parser takes NaN, Infinity and 1e999 (which overflows to inf); the endpoint does not.
    for number in (b"NaN", b"-Infinity", b"1e999"):
        body = b'{"model": "tiny", "prompt": "x", "temperature": ' + number + b"}"
        r = env.http.post("/v1/completions", content=body, headers=_auth(env.keys["alice"]))
        assert "not valid JSON" in _error(r, 400)["message"], number


def test_an_unexpected_error_is_an_error_id_its_detail_only_logged(caplog):
    import logging

    import sqlalchemy.exc

    from services.rollout.openai_http import error_response

    exc = sqlalchemy.exc.IntegrityError("INSERT INTO api_keys (key_hash) VALUES (?)", ("ab" * 32,), Exception("x"))
    with caplog.at_level(logging.ERROR, logger="trainyard.rollout.openai"):
        status, body = error_response(exc, {})
    message = body["error"]["message"]
    assert status == 500 and body["error"]["code"] == "internal_error" and "INSERT" not in message
    ref = message.split("error id ")[1][:16]
    assert any(ref in r.getMessage() and r.exc_info[1] is exc for r in caplog.records)


# ---- models ----------------------------------------------------------------------------------------------------


def test_models_are_scoped_to_the_account(env):
    def ids(who):
        r = env.http.get("/v1/models", headers=_auth(env.keys[who]))
        assert r.status_code == 200 and r.json()["object"] == "list"
        return {m["id"]: m for m in r.json()["data"]}

    alice, bob = ids("alice"), ids("bob")
    assert set(alice) == {"alice-dep", "tiny"} and set(bob) == {"bob-dep", "tiny"}
    assert (alice["alice-dep"]["owned_by"], alice["alice-dep"]["parent"]) == ("alice", "tiny")
    assert alice["tiny"]["owned_by"] == "trainyard" and alice["tiny"]["object"] == "model"
    one = env.http.get("/v1/models/alice-dep", headers=_auth(env.keys["alice"]))
    assert one.status_code == 200 and one.json() == alice["alice-dep"]


# ---- concurrency and disconnects -------------------------------------------------------------------------------


def test_concurrent_requests_share_engine_steps(env, monkeypatch):
    sizes = []
    step = EngineCore.step

    def recording_step(self):
        outputs = step(self)
        sizes.append(self.last_batch_size)
        return outputs

    bodies = [("/v1/completions", {"model": "alice-dep" if i % 2 else "tiny", "prompt": f"{PROMPT} {i}",
                                   "max_tokens": 16, "seed": i, "logprobs": 1}) for i in range(6)]
    bodies += [("/v1/chat/completions", {"model": "alice-dep", "messages": [{"role": "user", "content": str(i)}],
                                         "max_tokens": 16, "seed": i}) for i in range(6)]
    alone = [env.ok(path, body) for path, body in bodies]
    monkeypatch.setattr(EngineCore, "step", recording_step)
    start = threading.Barrier(len(bodies))

    def send(item):
        path, body = item
        start.wait()
        return env.ok(path, body)

    with ThreadPoolExecutor(len(bodies)) as pool:
        together = list(pool.map(send, bodies))
    assert max(sizes) >= 6  # they ran in the same engine steps, not one after another
    # Deterministic mode: bitwise the same answers as alone.
    assert [(r["choices"], r["usage"]) for r in together] == [(r["choices"], r["usage"]) for r in alone]


def _tiny_core(env):
    return env.core.engine.base(next(iter(env.core.engine.loaded_models()))).core


def _idle(env, timeout_s: float = 5) -> bool:
    """The engine finished every request and freed every block within timeout_s (the requests below would run for
    about 20 s: 1500 tokens, no end-of-sequence token comes up)."""
    core = _tiny_core(env)
    deadline = time.monotonic() + timeout_s
    while core.has_work() and time.monotonic() < deadline:
        time.sleep(0.02)
    return not core.has_work() and core.scheduler.blocks.num_free == core.scheduler.blocks.num_blocks


def test_a_client_that_goes_away_aborts_its_requests(env):
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 1500, "temperature": 0}
    with env.http.stream("POST", "/v1/completions", json={**body, "stream": True},
                         headers=_auth(env.keys["alice"])) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ") and _tiny_core(env).has_work()
    assert _idle(env)
    with pytest.raises(httpx.ReadTimeout):
        env.http.post("/v1/chat/completions", json={**body, "messages": [{"role": "user", "content": "x"}]},
                      headers=_auth(env.keys["alice"]), timeout=httpx.Timeout(60, read=0.5))
    assert _idle(env)


# ---- the process: settings and shutdown ------------------------------------------------------------------------


def test_endpoint_is_off_by_default_and_a_taken_port_fails_the_start(tmp_path):
    settings = RolloutSettings(data_dir=tmp_path, host="127.0.0.1", rollout_port=0)
    server = build(settings)
    assert settings.openai_port == 0 and _openai_servers(server) == []
    server.stop()
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        with pytest.raises(OSError, match="TRAINYARD_OPENAI_PORT"):
            build(RolloutSettings(data_dir=tmp_path, host="127.0.0.1", rollout_port=0, openai_port=port))


def test_shutdown_lets_a_stream_finish_then_closes_the_port(tmp_path, tiny_model_dir, adapter_dirs):
    settings, db, keys, server = _start(tmp_path, tiny_model_dir, adapter_dirs, shutdown_grace_s=30,
                                        deterministic=False)
    url = f"http://127.0.0.1:{settings.openai_port}"
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 400, "temperature": 0, "stream": True}
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, headers=_auth(keys["alice"]),
                          timeout=60) as r:
            lines = r.iter_lines()
            first = next(lines)
            stopper = threading.Thread(target=server.stop)
            stopper.start()  # SIGTERM's path, while the stream is in flight
            time.sleep(0.3)
            assert stopper.is_alive()  # waiting for the stream
            rest = [line for line in lines if line]
        stopper.join(60)
        assert not stopper.is_alive()
        chunks = [json.loads(line[6:]) for line in [first, *rest[:-1]]]
        assert rest[-1] == "data: [DONE]" and chunks[-1]["choices"][0]["finish_reason"] == "length"
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{url}/health")
    finally:
        server.stop()
        db.dispose()
