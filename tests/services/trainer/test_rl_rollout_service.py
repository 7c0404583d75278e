"""The RFT rollout backend over the platform's services (services/trainer/rl/rollout_service.py), against the real
scheduler, rollout and weight-sync servers in this process: exact per-token versions across a weight update in the
middle of a batch (each segment's logprobs are those of the model its version names, to float rounding, and its
weight version id is the one published for it), and the RL loop's router replay and LoRA versions through it."""
from __future__ import annotations

import json
import shutil
import threading
import time

import pytest
import torch

from models import load_pretrained
from services.common.methods.rft import RftHyperparams
from services.trainer.rl.loop import SAMPLES_FILE, run_rft
from services.trainer.rl.rewards import builtin
from services.trainer.rl.rollout import SampleRequest
from services.trainer.rl.rollout_service import Connection, RolloutService
from services.trainer.sft import Checkpoint, Metrics
from tests.services.common.inprocess import Platform
from trainyard.v1 import rollout_pb2, scheduler_pb2, scheduler_pb2_grpc, weightsync_pb2, weightsync_pb2_grpc


def _connection(platform: Platform) -> Connection:
    return Connection(rollout_url=platform.url("rollout"), weightsync_url=platform.url("weightsync"),
                      scheduler_url=platform.url("scheduler"), api_key=platform.keys["alice"])


def _sequence_logprobs(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    ids = torch.tensor(prompt + tokens)
    with torch.no_grad():
        logits = model(ids[None])[0].float()
    return torch.log_softmax(logits[len(prompt) - 1:-1], dim=-1).gather(1, ids[len(prompt):, None])[:, 0]


@pytest.mark.parametrize("partial", [True, False])
def test_an_update_mid_batch_cancels_and_tags_every_token_with_its_version(tiny_model_dir, tmp_path_factory,
                                                                           partial):
    """Long samples in flight when version 1 is published: their streams are cancelled first, then with partial
    rollouts each continues on version 1 (min_weight_version), every token's version being the one whose weights
    produced it; without, the sample is redone on version 1 alone. The deployment is deleted at close."""
    from models.tiny import build_tiny_model

    root = tmp_path_factory.mktemp("svc")
    other_dir = build_tiny_model(root / "other", seed=1)
    v0, v1 = load_pretrained(tiny_model_dir).eval(), load_pretrained(other_dir).eval()
    platform = Platform(root / "platform", tiny_model_dir)
    rollout = RolloutService(_connection(platform), lineage="rl-test", deployment="rl-test-rollout",
                             base_model="tiny", lora=False, partial=partial, max_tokens=400, temperature=1.0)
    try:
        rollout.update(0, shutil.copytree(tiny_model_dir, root / "v0"))
        prompt = [5, 17, 42]
        rollout.submit(0, [[SampleRequest(prompt, seed=99)]])
        rollout.result(0)  # the deployment has loaded version 0 and sampled
        rollout.submit(1, [[SampleRequest(prompt, seed=s) for s in range(3)]])
        time.sleep(0.5)  # decoding under way: 400 tokens take longer than that
        rollout.update(1, shutil.copytree(other_dir, root / "v1"))
        (group,), stats = rollout.result(1)
        ids = {k: v.id for k, v in rollout.published.items()}
    finally:
        rollout.close()
    try:
        deployments = scheduler_pb2_grpc.DeploymentServiceStub(platform.channel("scheduler")).ListDeployments(
            scheduler_pb2.ListDeploymentsRequest(include_deleted=True), metadata=platform.metadata()).deployments
        assert [d.status for d in deployments] == [scheduler_pb2.DEPLOYMENT_STATUS_DELETED]
        lineage = weightsync_pb2_grpc.WeightSyncServiceStub(platform.channel("weightsync")).ListVersions(
            weightsync_pb2.ListVersionsRequest(lineage="rl-test"), metadata=platform.metadata()).versions
        assert [(v.id, v.version) for v in lineage] == [(ids[0], 1), (ids[1], 2)]  # kept after the job
    finally:
        platform.close()
    models = {0: v0, 1: v1}
    for s in group:
        if partial:
            assert s.versions in ([0, 1], [1], [0])
        else:
            assert s.versions == [1] and all(seg.version == 1 for seg in s.segments if seg.tokens)
        done: list[int] = []
        for seg in s.segments:
            if seg.tokens:
                assert seg.version_id == ids[seg.version]
                expected = _sequence_logprobs(models[seg.version], prompt + done, seg.tokens)
                torch.testing.assert_close(torch.tensor(seg.logprobs), expected, rtol=0, atol=1e-4)
            done += seg.tokens
    if partial:
        assert any(s.versions == [0, 1] for s in group), [s.versions for s in group]
        assert stats.discarded_tokens == 0
    else:
        assert stats.discarded_tokens > 0


def _run(platform, model_dir, data, work, **kw):
    hp = RftHyperparams.from_request({**dict(evaluator="builtin:digit_share", full_parameter=True,
                                             prompts_per_step=4, group_size=4, max_tokens=3, learning_rate=1e-3),
                                      **kw})
    conn = _connection(platform)

    def backend(model_dir, *, lora, partial, max_tokens, temperature, router_ids, work_dir, torch_threads):
        return RolloutService(conn, lineage="rl-run", deployment="rl-run-rollout", base_model="tiny", lora=lora,
                              partial=partial, max_tokens=max_tokens, temperature=temperature, router_ids=router_ids)
    events = []
    for ev in run_rft(model_dir, data, hp, reward=builtin(hp.evaluator), stop=threading.Event(), work_dir=work,
                      base_model_name="tiny", rollout=backend):
        if isinstance(ev, Checkpoint):
            ev.samples = [json.loads(line) for line in open(ev.checkpoint.state_dir / SAMPLES_FILE)]
        events.append(ev)
    return events


@pytest.fixture(scope="module")
def arithmetic(tmp_path_factory):
    path = tmp_path_factory.mktemp("rl") / "data.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"{a}+{b}=", "answer": a + b}) + "\n"
                            for a in range(10) for b in range(10)))
    return path


def test_loop_replays_the_routes_the_rollout_service_returns(family_dirs, arithmetic, tmp_path):
    """Router replay through SampleStream: the trainer replays the routes of the rollout's forward, so the
    rollout/trainer KL stays at numerics level (as with the rollout process, tests/services/trainer/test_rl.py)."""
    platform = Platform(tmp_path / "platform", family_dirs["qwen3_moe"])
    try:
        events = _run(platform, family_dirs["qwen3_moe"], arithmetic, tmp_path / "run", steps=1, router_replay=True)
    finally:
        platform.close()
    (metrics,) = [e.metrics for e in events if isinstance(e, Metrics)]
    assert metrics["kl/k3_rollout_trainer"] < 1e-3
    (ckpt,) = [e for e in events if isinstance(e, Checkpoint)]
    assert all(len(s["weight_version_ids"]) == 1 for s in ckpt.samples)


def test_lora_versions_are_published_and_sampled(tiny_model_dir, arithmetic, tmp_path):
    platform = Platform(tmp_path / "platform", tiny_model_dir)
    try:
        events = _run(platform, tiny_model_dir, arithmetic, tmp_path / "run", steps=2, full_parameter=False,
                      lora_rank=4, mode="async", max_staleness=1, checkpoint_every=2)
        lineage = weightsync_pb2_grpc.WeightSyncServiceStub(platform.channel("weightsync")).ListVersions(
            weightsync_pb2.ListVersionsRequest(lineage="rl-run"), metadata=platform.metadata()).versions
    finally:
        platform.close()
    assert [(v.kind, v.metadata["policy_version"]) for v in lineage] == [
        (weightsync_pb2.WEIGHT_KIND_LORA_ADAPTER, str(k)) for k in range(3)]  # 0, 1 and the final 2
    policy = {v.id: int(v.metadata["policy_version"]) for v in lineage}
    (ckpt,) = [e for e in events if isinstance(e, Checkpoint)]
    assert len(ckpt.samples) == 2 * 4 * 4
    for s in ckpt.samples:
        assert [policy[i] for i in s["weight_version_ids"]] == s["versions"]
        assert s["staleness"] <= 1


def test_a_version_the_job_did_not_publish_fails_the_job_loudly(tiny_model_dir, tmp_path):
    """Someone else publishes to the job's lineage: the deployment moves to that version, the stream names it, and
    the backend refuses to label its tokens as the job's version."""
    from services.weightsync.client import publish_dir

    platform = Platform(tmp_path / "platform", tiny_model_dir)
    rollout = RolloutService(_connection(platform), lineage="rl-other", deployment="rl-other-rollout",
                             base_model="tiny", lora=False, partial=True, max_tokens=4, temperature=1.0)
    try:
        rollout.update(0, shutil.copytree(tiny_model_dir, tmp_path / "v0"))
        ws = weightsync_pb2_grpc.WeightSyncServiceStub(platform.channel("weightsync"))
        publish_dir(ws, platform.keys["alice"], lineage="rl-other", parent_id=rollout.published[0].id,
                    kind=weightsync_pb2.WEIGHT_KIND_FULL, base_model="tiny", directory=tiny_model_dir)
        deadline = time.monotonic() + 60
        while True:  # the deployment has moved on to the foreign version
            loaded = {m.name: m for m in rollout.rollout.ListLoaded(rollout_pb2.ListLoadedRequest(),
                                                                    metadata=platform.metadata()).models}
            if loaded["rl-other-rollout"].weight_version == 2:
                break
            assert time.monotonic() < deadline
            time.sleep(0.1)
        rollout.submit(0, [[SampleRequest([5, 17, 42], seed=1)]])
        with pytest.raises(RuntimeError, match=r"sampled weight version \S+, and the job expected \S+ \(policy "
                                               r"version 0"):
            rollout.result(0)
    finally:
        rollout.close()
        platform.close()
