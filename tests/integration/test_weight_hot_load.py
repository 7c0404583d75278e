"""End to end: a Training API step -> SaveWeights publishes a version -> the rollout hot-loads it into a running
deployment -> new samples come from the new weights, checked against the trainer's own logprobs."""
from __future__ import annotations

import time

import grpc
import numpy as np
import pytest

from services.common.channels import auth_metadata
from tests.integration.test_trainer_and_weightsync import datum
from trainyard.v1 import rollout_pb2 as rpb, rollout_pb2_grpc, trainer_pb2 as tpb, trainer_pb2_grpc
from trainyard.v1 import weightsync_pb2 as wpb, weightsync_pb2_grpc

pytestmark = pytest.mark.integration
PROMPT = [5, 17, 33, 60, 71, 88]


def trainer_logprobs(stub, md, session_id: str, tokens: list[int]) -> np.ndarray:
    out = stub.Forward(tpb.ForwardRequest(session_id=session_id, data=[datum(tokens)]), metadata=md)
    return np.frombuffer(out.outputs[0].loss_fn_outputs["logprobs"].data, dtype="<f4")


def wait_version(rollout, md, deployment: str, version_id: str, timeout_s: float = 60) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        loaded = {m.name: m for m in rollout.ListLoaded(rpb.ListLoadedRequest(), metadata=md).models}
        if deployment in loaded and loaded[deployment].weight_version_id == version_id:
            return time.monotonic() - t0
        time.sleep(0.05)
    raise AssertionError(f"{deployment} did not hot-load {version_id}: {loaded.get(deployment)}")


def test_trainer_step_publish_hot_load_sample(stack, client, api_key):
    md = auth_metadata(api_key)
    with grpc.insecure_channel(stack.url("trainer")) as tch, grpc.insecure_channel(stack.url("rollout")) as rch, \
            grpc.insecure_channel(stack.url("weightsync")) as wch:
        trainer = trainer_pb2_grpc.TrainerServiceStub(tch)
        rollout = rollout_pb2_grpc.RolloutServiceStub(rch)
        weights = weightsync_pb2_grpc.WeightSyncServiceStub(wch)
        sess = trainer.CreateSession(tpb.CreateSessionRequest(base_model="tiny-qwen3", lora=tpb.SessionLora(rank=8)),
                                     metadata=md)
        v1 = trainer.SaveWeights(tpb.SaveWeightsRequest(session_id=sess.id, name="v1"), metadata=md)
        dep = client.create_deployment("policy", lineage=sess.id)
        assert dep.lineage == sess.id and dep.checkpoint_id == ""
        wait_version(rollout, md, "policy", v1.version_id)

        def sample() -> rpb.SampleResponse:
            return client.sample("policy", tokens=PROMPT, temperature=0, max_tokens=8)

        before = sample()
        assert before.weight_version_id == v1.version_id
        data = [datum(PROMPT + [2])]
        syncs = []
        for step in range(3):  # train, publish, and the running deployment picks each version up
            trainer.ForwardBackward(tpb.ForwardBackwardRequest(session_id=sess.id, data=data), metadata=md)
            trainer.OptimStep(tpb.OptimStepRequest(session_id=sess.id, adam=tpb.AdamParams(learning_rate=2e-2)),
                              metadata=md)
            published = trainer.SaveWeights(tpb.SaveWeightsRequest(session_id=sess.id, name=f"v{step + 2}"),
                                            metadata=md)
            syncs.append(wait_version(rollout, md, "policy", published.version_id))
            after = sample()
            assert after.weight_version_id == published.version_id
            seq = after.sequences[0]
            want = trainer_logprobs(trainer, md, sess.id, PROMPT + list(seq.tokens))[len(PROMPT) - 1:]
            assert np.abs(np.array(seq.logprobs) - want).max() <= 1e-4  # the rollout serves the trainer's weights
        print(f"weight sync, SaveWeights returned -> deployment serving it: "
              f"{', '.join(f'{s * 1000:.0f} ms' for s in syncs)}")
        assert after.sequences[0].logprobs != before.sequences[0].logprobs
        # Rollback to v1: the deployment serves v1 again.
        weights.Rollback(wpb.RollbackRequest(lineage=sess.id, version_id=v1.version_id), metadata=md)
        wait_version(rollout, md, "policy", v1.version_id)
        again = sample()
        assert again.weight_version_id == v1.version_id
        assert list(again.sequences[0].tokens) == list(before.sequences[0].tokens)
        client.delete_deployment("policy")
