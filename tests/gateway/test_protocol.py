"""The gateway's wire protocol with httpx, as the SDK speaks it: a zstd protobuf forward_backward body, an idempotent
retry, auth, isolation between accounts, back-pressure, the long poll and expired futures. Against the in-process
gateway with small limits (conftest.py: long poll 0.5 s, futures kept 4 s, 4 pending per account)."""
from __future__ import annotations

import time

import httpx
import numpy as np
import pytest
import zstandard
from tinker import types as tt
from tinker.proto import request_conv, response_conv

pytestmark = pytest.mark.integration
BASE = "tiny-qwen3"
TOKENS = [5, 17, 33, 60, 71, 88, 2]


def client(url: str, key: str | None) -> httpx.Client:
    return httpx.Client(base_url=url, headers={"X-API-Key": key} if key else {}, timeout=60)


def result(http: httpx.Client, request_id: str, proto: bool = False) -> httpx.Response:
    """retrieve_future until it is not try_again."""
    while True:
        r = http.post("/api/v1/retrieve_future", json={"request_id": request_id},
                      headers={"Accept": "application/x-protobuf"} if proto else {})
        if r.status_code != 200 or "protobuf" in r.headers["content-type"] or r.json().get("type") != "try_again":
            return r


def new_model(http: httpx.Client) -> str:
    session = http.post("/api/v1/create_session", json={"tags": [], "user_metadata": {}, "sdk_version": "0.38.0"})
    created = http.post("/api/v1/create_model", json={
        "session_id": session.json()["session_id"], "model_seq_id": 0, "base_model": BASE,
        "lora_config": {"rank": 4, "seed": 0, "train_unembed": False}})
    assert created.status_code == 200, created.text
    return result(http, created.json()["request_id"]).json()["model_id"]


def fb_body(model_id: str, seq_id: int, forward_only: bool = False) -> bytes:
    n = len(TOKENS) - 1
    request = tt.ForwardBackwardRequest(
        forward_backward_input=tt.ForwardBackwardInput(data=[tt.Datum(
            model_input=tt.ModelInput.from_ints(TOKENS[:-1]),
            loss_fn_inputs={"target_tokens": tt.TensorData(data=TOKENS[1:], dtype="int64", shape=[n])})],
            loss_fn="cross_entropy"),
        model_id=model_id, seq_id=seq_id)
    msg = request_conv.forward_backward_request_to_proto(request)
    msg.forward_only = forward_only
    return zstandard.ZstdCompressor().compress(msg.SerializeToString())


def post_fb(http: httpx.Client, body: bytes, **headers: str) -> httpx.Response:
    return http.post("/api/v1/forward_backward", content=body, headers={
        "Content-Type": "application/x-protobuf", "Content-Encoding": "zstd", **headers})


def test_bad_keys_are_refused_with_401(small_gateway, api_key):
    for key in (None, api_key, "tml-ty_not-a-key"):
        r = client(small_gateway, key).post("/api/v1/create_session", json={})
        assert r.status_code == 401 and r.json()["code"] == "UNAUTHENTICATED", (key, r.text)
    assert client(small_gateway, None).get("/api/v1/healthz").status_code == 200


def test_zstd_protobuf_forward_backward_and_a_protobuf_result(small_gateway, tinker_key):
    http = client(small_gateway, tinker_key)
    model_id = new_model(http)
    r = post_fb(http, fb_body(model_id, 1, forward_only=True))
    assert r.status_code == 200, r.text
    got = result(http, r.json()["request_id"], proto=True)
    assert got.headers["content-type"] == "application/x-protobuf"
    out = response_conv.deserialize_proto_response(got.content, tt.ForwardBackwardOutput)
    (logprobs,) = [o["logprobs"].to_numpy() for o in out.loss_fn_outputs]
    assert logprobs.shape == (len(TOKENS) - 1,) and np.all(logprobs < 0)
    as_json = result(http, r.json()["request_id"]).json()  # kept: retrieved again, as JSON this time
    np.testing.assert_array_equal(np.float32(as_json["loss_fn_outputs"][0]["logprobs"]["data"]), logprobs)
    # The same datum as a JSON body (forward_backward with forward_only, then forward): the same logprobs.
    n = len(TOKENS) - 1
    datum = {"model_input": {"chunks": [{"type": "encoded_text", "tokens": TOKENS[:-1]}]},
             "loss_fn_inputs": {"target_tokens": {"data": TOKENS[1:], "dtype": "int64", "shape": [n]}}}
    fb_input = {"data": [datum], "loss_fn": "cross_entropy"}
    for seq_id, route, body in ((2, "forward_backward", {"forward_backward_input": fb_input, "forward_only": True}),
                                (3, "forward", {"forward_input": fb_input})):
        r = http.post(f"/api/v1/{route}", json={"model_id": model_id, "seq_id": seq_id, **body})
        assert r.status_code == 200, r.text
        out = result(http, r.json()["request_id"]).json()
        np.testing.assert_array_equal(np.float32(out["loss_fn_outputs"][0]["logprobs"]["data"]), logprobs)


def test_a_retried_request_runs_once(small_gateway, tinker_key):
    http = client(small_gateway, tinker_key)
    model_id = new_model(http)
    step = {"model_id": model_id, "seq_id": 1, "adam_params": {"learning_rate": 1e-3}}
    first, again = (http.post("/api/v1/optim_step", json=step, headers={"X-Idempotency-Key": "step-1"})
                    for _ in range(2))
    assert first.json()["request_id"] == again.json()["request_id"]
    assert result(http, first.json()["request_id"]).status_code == 200
    info = http.post("/api/v1/get_info", json={"model_id": model_id}).json()
    assert info["optim_steps"] == 1 and info["next_seq_id"] == 2


def test_another_account_sees_none_of_it(small_gateway, tinker_key, other_tinker_key):
    http, other = client(small_gateway, tinker_key), client(small_gateway, other_tinker_key)
    model_id = new_model(http)
    request_id = post_fb(http, fb_body(model_id, 1, forward_only=True)).json()["request_id"]
    assert other.post("/api/v1/retrieve_future", json={"request_id": request_id}).status_code == 404
    assert other.post("/api/v1/cancel_future", json={"request_id": request_id}).status_code == 404
    assert other.post("/api/v1/get_info", json={"model_id": model_id}).status_code == 404
    r = post_fb(other, fb_body(model_id, 2, forward_only=True))
    assert r.status_code == 404, r.text
    assert result(http, request_id, proto=True).status_code == 200


def test_long_poll_try_again_then_result_then_410(small_gateway, tinker_key):
    """A request sent before its predecessor waits for it (try_again after the 0.5 s long poll); once its
    predecessor comes both run, in order; a result is kept 4 s after it finished, then 410."""
    http = client(small_gateway, tinker_key)
    model_id = new_model(http)
    second = post_fb(http, fb_body(model_id, 2, forward_only=True)).json()["request_id"]
    waiting = http.post("/api/v1/retrieve_future", json={"request_id": second})
    assert waiting.json() == {"type": "try_again", "request_id": second, "queue_state": "active"}
    first = post_fb(http, fb_body(model_id, 1, forward_only=True)).json()["request_id"]
    for request_id in (first, second):
        assert result(http, request_id, proto=True).status_code == 200
    time.sleep(4.5)
    assert http.post("/api/v1/retrieve_future", json={"request_id": first}).status_code == 410


def test_over_the_pending_cap_is_429(small_gateway, tinker_key):
    http = client(small_gateway, tinker_key)
    model_id = new_model(http)
    # seq_id 1 never comes: these wait, not retrieved, and fill the account's 4 pending futures.
    pending = [post_fb(http, fb_body(model_id, seq, forward_only=True)) for seq in (2, 3, 4, 5)]
    assert all(r.status_code == 200 for r in pending), [r.text for r in pending]
    over = post_fb(http, fb_body(model_id, 6, forward_only=True))
    assert over.status_code == 429 and over.headers["retry-after"] == "1" and "max_pending" in over.json()["error"]
    for r in pending:
        assert http.post("/api/v1/cancel_future", json={"request_id": r.json()["request_id"]}).status_code == 200
    for r in pending:
        failed = result(http, r.json()["request_id"]).json()
        assert failed["category"] == "server" and "cancelled" in failed["error"]


def test_a_bad_body_is_400_naming_the_field(small_gateway, tinker_key):
    http = client(small_gateway, tinker_key)
    model_id = new_model(http)
    r = http.post("/api/v1/optim_step", json={"model_id": model_id, "seq_id": 1,
                                              "adam_params": {"learning_rate": "fast"}})
    assert r.status_code == 400 and r.json()["field"].startswith("adam_params"), r.text
    # its seq_id was given up: the next one runs
    ok = http.post("/api/v1/optim_step", json={"model_id": model_id, "seq_id": 2, "adam_params": {}})
    assert result(http, ok.json()["request_id"]).status_code == 200
    r = post_fb(http, b"\x00not zstd")
    assert r.status_code == 400 and r.json()["field"] == "body"
    bomb = post_fb(http, zstandard.ZstdCompressor().compress(bytes(2 << 20)))  # 2 MiB of zeros, over max_body_mb
    assert bomb.status_code == 400 and "max_body_mb" in bomb.json()["error"], bomb.text
    assert http.post("/api/v1/optim_step", content=bytes(2 << 20)).status_code == 413


def test_finishing_a_session_closes_its_models(small_gateway, tinker_key):
    http = client(small_gateway, tinker_key)
    session_id = http.post("/api/v1/create_session", json={}).json()["session_id"]
    assert http.post("/api/v1/session_heartbeat", json={"session_id": session_id}).status_code == 200
    created = http.post("/api/v1/create_model", json={"session_id": session_id, "model_seq_id": 0,
                                                      "base_model": BASE, "lora_config": {"rank": 4,
                                                                                          "train_unembed": False}})
    model_id = result(http, created.json()["request_id"]).json()["model_id"]
    finish = http.post(f"/api/v1/sessions/{session_id}/finish", json={"reason": {"type": "success"}})
    assert finish.status_code == 200, finish.text
    assert http.post("/api/v1/session_heartbeat", json={"session_id": session_id}).status_code == 410
    assert http.post("/api/v1/get_info", json={"model_id": model_id}).json()["closed"] is True


def test_the_stack_gateway_counts_its_requests(stack, tinker_key):
    http = client(stack.gateway_url(), tinker_key)
    assert http.post("/api/v1/create_session", json={}).status_code == 200
    scraped = httpx.get(f"http://{stack.address('gateway', 9100)}/metrics", timeout=10).text
    assert 'trainyard_gateway_requests_total{route="/api/v1/create_session",status="200"}' in scraped
