"""A Training API session survives its trainer process (services/trainer/sessions.py, "Restarts"): trained over gRPC
with the SDK, the trainer stopped (SIGTERM) or killed (kill -9) and started again, the same session id continues to
weights bitwise equal to an undisturbed session's, and a deployment following its lineage serves the versions
published after the restart. The restarted trainer logs JSON records carrying the session's and the call's ids."""
from __future__ import annotations

import json
import threading

import grpc
import pytest

from services.common.channels import auth_metadata
from tests.integration.test_weight_hot_load import wait_version
from trainyard import ServiceClient, TrainyardError, types
from trainyard.v1 import rollout_pb2_grpc, weightsync_pb2 as wpb, weightsync_pb2_grpc

pytestmark = [pytest.mark.integration, pytest.mark.reliability]

STEPS = 6
RECORDING = {"TRAINYARD_SESSION_STATE_EVERY_STEPS": "2", "TRAINYARD_LOG_FORMAT": "json"}


def _restart(stack, kill: bool = False) -> None:
    if kill:
        stack.kill("trainer")
    else:
        assert stack.stop("trainer") == 0
    stack.start("trainer")
    stack.wait_ready("trainer")


@pytest.fixture(scope="module")
def recording_trainer(stack):
    """The stack's trainer restarted to record sessions every 2 optimizer steps and log JSON; put back after."""
    stack.extra_env.update(RECORDING)
    _restart(stack)
    yield stack
    for key in RECORDING:
        stack.extra_env.pop(key)
    _restart(stack)


@pytest.fixture()
def service(recording_trainer, api_key):
    with ServiceClient(base_url=recording_trainer.url("trainer"), api_key=api_key,
                       rollout_url=recording_trainer.url("rollout"), retry_unavailable_s=180) as s:
        yield s


@pytest.fixture()
def rollout(recording_trainer, api_key):
    with grpc.insecure_channel(recording_trainer.url("rollout")) as ch:
        yield rollout_pb2_grpc.RolloutServiceStub(ch), auth_metadata(api_key)


@pytest.fixture()
def weightsync(recording_trainer, api_key):
    with grpc.insecure_channel(recording_trainer.url("weightsync")) as ch:
        yield weightsync_pb2_grpc.WeightSyncServiceStub(ch), auth_metadata(api_key)


def _batch(step: int) -> list[types.Datum]:
    tokens = [(11 * step + 5 * i) % 900 + 7 for i in range(10 + step)]
    return [types.Datum(types.ModelInput.from_ints(tokens[:-1]), {"target_tokens": tokens[1:]})]


def _train(tc, steps) -> list:
    futures = []
    for step in steps:
        futures.append(tc.forward_backward(_batch(step), "cross_entropy"))
        futures.append(tc.optim_step(types.AdamParams(learning_rate=1e-2)))
    return futures


def _adapter_sha(weightsync, version_id: str) -> str:
    stub, md = weightsync
    version = stub.GetVersion(wpb.GetVersionRequest(id=version_id), metadata=md)
    return next(f.sha256 for f in version.files if f.path.endswith(".safetensors"))


def _undisturbed(service, weightsync) -> str:
    tc = service.create_lora_training_client("tiny-qwen3", rank=4, seed=3).result()
    for f in _train(tc, range(STEPS)):
        f.result()
    return _adapter_sha(weightsync, tc.save_weights_for_sampler("undisturbed").result().version_id)


def _following(client, rollout, tc, name: str):
    first = tc.save_weights_for_sampler("v1").result()
    client.create_deployment(name, lineage=tc.model_id)
    wait_version(*rollout, name, first.version_id)
    return first


def _json_records(stack) -> list[dict]:
    return [json.loads(line) for line in stack.procs["trainer"].log().splitlines() if line.startswith("{")]


def test_sigterm_restart_in_the_middle_of_pipelined_calls(recording_trainer, service, client, rollout, weightsync):
    want = _undisturbed(service, weightsync)
    tc = service.create_lora_training_client("tiny-qwen3", rank=4, seed=3).result()
    first = _following(client, rollout, tc, "follows-sigterm")
    futures = _train(tc, range(STEPS))
    futures[3].result()
    restart = threading.Thread(target=_restart, args=(recording_trainer,))
    restart.start()
    results = [f.result(timeout=300) for f in futures]  # nothing to see for the client: calls are sent again
    restart.join()
    assert [r.step for r in results[1::2]] == list(range(1, STEPS + 1))
    info = tc.get_info()
    assert (info.model_id, info.next_seq_id, info.optim_steps) == (tc.model_id, 2 * STEPS + 2, STEPS)
    after = tc.save_weights_for_sampler("after").result()
    assert _adapter_sha(weightsync, after.version_id) == want
    stub, md = weightsync
    assert stub.GetVersion(wpb.GetVersionRequest(id=after.version_id), metadata=md).parent_id == first.version_id
    wait_version(*rollout, "follows-sigterm", after.version_id)
    recorded = [r for r in _json_records(recording_trainer) if r.get("session_id") == tc.model_id]
    assert any("recorded at seq_id" in r["message"] for r in recorded), recorded
    assert any("restored at seq_id" in r["message"] for r in recorded), recorded
    assert {r["account_id"] for r in recorded} == {client.whoami().id}
    client.delete_deployment("follows-sigterm")


def test_kill_9_goes_back_to_the_last_record_and_the_session_resumes(recording_trainer, service, client, rollout,
                                                                      weightsync):
    want = _undisturbed(service, weightsync)
    tc = service.create_lora_training_client("tiny-qwen3", rank=4, seed=3).result()
    first = _following(client, rollout, tc, "follows-kill")
    for f in _train(tc, range(3)):  # seq_ids 2..7; recorded after step 2 (seq_id 5): the session expects 6
        f.result()
    _restart(recording_trainer, kill=True)
    with pytest.raises(TrainyardError) as exc:
        tc.forward_backward(_batch(3), "cross_entropy").result(timeout=300)
    assert exc.value.code == "ABORTED" and "at seq_id 6 (optimizer step 2)" in exc.value.message
    resumed = service.resume_training_client(tc.model_id)
    info = resumed.get_info()
    assert (info.model_id, info.next_seq_id, info.optim_steps) == (tc.model_id, 6, 2)
    for f in _train(resumed, range(info.optim_steps, STEPS)):
        f.result()
    after = resumed.save_weights_for_sampler("after").result()
    assert _adapter_sha(weightsync, after.version_id) == want
    stub, md = weightsync
    assert stub.GetVersion(wpb.GetVersionRequest(id=after.version_id), metadata=md).parent_id == first.version_id
    wait_version(*rollout, "follows-kill", after.version_id)
    aborted = [r for r in _json_records(recording_trainer)
               if r["logger"] == "trainyard.rpc" and "ABORTED" in r["message"] and r.get("session_id") == tc.model_id]
    assert aborted and {"request_id", "account_id"} <= aborted[0].keys(), aborted
    client.delete_deployment("follows-kill")
