"""Every service's /metrics (docker-compose.yml publishes each on 9100 of its container) moves with real work: a
managed job (scheduler: calls, jobs by status; worker: step time, tokens), a Training API session publishing to a
lineage a deployment follows (trainer: calls, step time, tokens; weightsync: bytes in and out; rollout: bytes
fetched, swap time), and sampling (rollout: engine tokens, KV blocks)."""
from __future__ import annotations

import urllib.request

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from services.common.channels import auth_metadata
from tests.integration.data import chat_rows, jsonl
from tests.integration.test_weight_hot_load import wait_version
from trainyard import ServiceClient, types
from trainyard.client import status_name
from trainyard.v1 import rollout_pb2_grpc

pytestmark = pytest.mark.integration


def scrape(stack, name: str) -> dict[tuple, float]:
    """{(sample name, sorted labels...): value} of a service's /metrics."""
    with urllib.request.urlopen(f"http://{stack.address(name, 9100)}/metrics", timeout=10) as response:
        text = response.read().decode()
    return {(s.name, *sorted(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(samples: dict, name: str, **labels) -> float:
    return samples.get((name, *sorted(labels.items())), 0.0)


def calls(samples: dict, service: str, method: str, code: str = "OK") -> float:
    return value(samples, "trainyard_grpc_requests_total", service=f"trainyard.v1.{service}", method=method,
                 code=code)


def test_metrics_of_every_service_move_with_a_job_and_a_training_api_session(stack, client, api_key):
    names = ("scheduler", "worker", "trainer", "rollout", "weightsync")
    before = {name: scrape(stack, name) for name in names}

    ds, _ = client.upload_dataset(jsonl(chat_rows(8)), name="metrics")
    job = client.create_sft_job("tiny-qwen3", ds.id, max_steps=2, batch_size=4, learning_rate=3e-3)
    done = client.wait_job(job.id, timeout_s=300)
    assert status_name(done.status) == "succeeded"
    account_id = client.whoami().id
    job_lines = [line for line in stack.procs["worker"].log().splitlines() if f"job {job.id}:" in line]
    assert job_lines and all(f"account_id={account_id} job_id={job.id}" in line for line in job_lines), job_lines

    with ServiceClient(base_url=stack.url("trainer"), api_key=api_key, rollout_url=stack.url("rollout")) as service:
        tc = service.create_lora_training_client("tiny-qwen3", rank=4, seed=1).result()
        first = tc.save_weights_for_sampler("m1").result()
        client.create_deployment("metrics-follower", lineage=tc.model_id)
        with grpc.insecure_channel(stack.url("rollout")) as ch:
            rollout = rollout_pb2_grpc.RolloutServiceStub(ch), auth_metadata(api_key)
            wait_version(*rollout, "metrics-follower", first.version_id)
            tokens = list(range(5, 25))
            tc.forward_backward([types.Datum(types.ModelInput.from_ints(tokens[:-1]), {"target_tokens": tokens[1:]})],
                                "cross_entropy").result()
            tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
            second = tc.save_weights_for_sampler("m2").result()
            wait_version(*rollout, "metrics-follower", second.version_id)
        client.sample("metrics-follower", tokens=[5, 6, 7], temperature=0, max_tokens=4)
    client.delete_deployment("metrics-follower")

    after = {name: scrape(stack, name) for name in names}

    def moved(name: str, sample: str, **labels) -> float:
        return value(after[name], sample, **labels) - value(before[name], sample, **labels)

    assert calls(after["scheduler"], "JobService", "CreateJob") - calls(before["scheduler"], "JobService",
                                                                         "CreateJob") == 1
    assert value(after["scheduler"], "trainyard_jobs", status="succeeded") >= 1
    assert ("trainyard_job_queue_depth",) in after["scheduler"]
    # the job's 2 steps are observed; the worker is the stack's, shared with the module's earlier tests, so a step of
    # another job finishing meanwhile (one cancelled or killed earlier and retried) may be counted too
    steps = moved("worker", "trainyard_training_step_seconds_count", driver="managed")
    assert steps >= 2, (steps, done.attempts)
    assert moved("worker", "trainyard_training_tokens_total", driver="managed") > 0
    for method, n in (("CreateSession", 1), ("ForwardBackward", 1), ("OptimStep", 1), ("SaveWeights", 2)):
        assert calls(after["trainer"], "TrainerService", method) - calls(before["trainer"], "TrainerService",
                                                                         method) == n, method
    assert moved("trainer", "trainyard_training_step_seconds_count", driver="session") == 1
    assert moved("trainer", "trainyard_training_tokens_total", driver="session") == len(tokens) - 1
    assert calls(after["trainer"], "TrainerService", "ForwardBackward", "INVALID_ARGUMENT") == calls(
        before["trainer"], "TrainerService", "ForwardBackward", "INVALID_ARGUMENT")
    assert moved("weightsync", "trainyard_weightsync_bytes_total", direction="received") > 0
    assert moved("weightsync", "trainyard_weightsync_bytes_total", direction="sent") > 0
    assert moved("rollout", "trainyard_weight_fetch_bytes_total", kind="files") > 0
    assert moved("rollout", "trainyard_weight_swap_seconds_count") == 2
    assert moved("rollout", "trainyard_engine_tokens_total", kind="generated") > 0
    assert moved("rollout", "trainyard_engine_tokens_total", kind="prompt") >= 3
    kv = [k for k in after["rollout"] if k[0] == "trainyard_kv_cache_blocks"]
    assert kv and all(after["rollout"][k] >= 0 for k in kv)
    assert calls(after["rollout"], "RolloutService", "Sample") - calls(before["rollout"], "RolloutService",
                                                                       "Sample") == 1

