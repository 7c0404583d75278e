"""Accounts with one of everything, built through the public API against a running stack.

Each account gets a private model (imported from the compose file's import root), a dataset, a finished managed
job with its checkpoints, a deployment of it, a LoRA session and a full-parameter session (each with weight versions
published to its lineage and a saved state) and a deployment following each lineage. `refs` names these objects by
kind, the way requests refer to them; `secrets` is what no other account may ever be told.
"""
from __future__ import annotations

import secrets as pysecrets
import shutil
import time
from dataclasses import dataclass, field

import grpc
import numpy as np

from services.common.channels import auth_metadata
from tests.conftest import create_account
from tests.integration.data import chat_rows, jsonl
from trainyard import Client
from trainyard.v1 import rollout_pb2 as rpb
from trainyard.v1 import rollout_pb2_grpc, trainer_pb2_grpc, weightsync_pb2_grpc
from trainyard.v1 import trainer_pb2 as tpb

BASE = "tiny-qwen3"
SEQ = [5, 17, 33, 60, 71, 88, 2]


def datum(tokens: list[int]) -> tpb.Datum:
    n = len(tokens) - 1
    targets = np.asarray(tokens[1:], dtype="<i8")
    weights = np.ones(n, dtype="<f4")
    return tpb.Datum(tokens=tokens[:-1], loss_fn_inputs={
        "target_tokens": tpb.TensorData(dtype=tpb.TensorData.DTYPE_INT64, shape=[n], data=targets.tobytes()),
        "weights": tpb.TensorData(dtype=tpb.TensorData.DTYPE_FLOAT32, shape=[n], data=weights.tobytes())})


class Stubs:
    """Channels and stubs of every gRPC service of a stack."""

    def __init__(self, stack):
        self.channels = {name: grpc.insecure_channel(stack.url(name), options=[
            ("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20),
            ("grpc.use_local_subchannel_pool", 1), ("grpc.initial_reconnect_backoff_ms", 200),
            ("grpc.max_reconnect_backoff_ms", 2000)]) for name in ("scheduler", "trainer", "rollout", "weightsync")}
        self.trainer = trainer_pb2_grpc.TrainerServiceStub(self.channels["trainer"])
        self.rollout = rollout_pb2_grpc.RolloutServiceStub(self.channels["rollout"])
        self.weights = weightsync_pb2_grpc.WeightSyncServiceStub(self.channels["weightsync"])

    def close(self) -> None:
        for ch in self.channels.values():
            ch.close()


@dataclass
class Account:
    name: str
    key: str
    id: str = ""
    key_id: str = ""
    refs: dict[str, list[str]] = field(default_factory=dict)
    secrets: set[str] = field(default_factory=set)
    dataset_bytes: bytes = b""
    model_dir: str = ""
    prompts_dataset: str = ""  # an rft dataset (prompts for rft, evaluation and loop jobs), also among refs["dataset"]

    @property
    def md(self):
        return auth_metadata(self.key)

    def add(self, kind: str, *values: str) -> None:
        self.refs.setdefault(kind, []).extend(values)
        self.secrets.update(values)


def wait_loaded(stubs: Stubs, acct: Account, deployment: str, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        loaded = {m.name: m for m in stubs.rollout.ListLoaded(rpb.ListLoadedRequest(), metadata=acct.md).models}
        if deployment in loaded and (not loaded[deployment].lineage or loaded[deployment].weight_version_id):
            return
        time.sleep(0.2)
    raise AssertionError(f"{deployment} of {acct.name} was not loaded within {timeout_s}s")


def step(stubs: Stubs, acct: Account, session_id: str, tokens: list[int] = SEQ) -> None:
    stubs.trainer.ForwardBackward(tpb.ForwardBackwardRequest(session_id=session_id, data=[datum(tokens)]),
                                  metadata=acct.md)
    stubs.trainer.OptimStep(tpb.OptimStepRequest(session_id=session_id, adam=tpb.AdamParams(learning_rate=1e-2)),
                            metadata=acct.md)


def build_account(stack, stubs: Stubs, label: str) -> Account:
    """A new account named after label, holding one of every kind of object."""
    tag = pysecrets.token_hex(4)
    name = f"{label}-{tag}"
    acct = Account(name=name, key=create_account(stack.env_for("scheduler"), name))
    with Client(url=stack.url("scheduler"), rollout_url=stack.url("rollout"), api_key=acct.key) as c:
        me = c.whoami()
        acct.id = me.id
        key = c.list_api_keys()[0]
        acct.key_id = key.id
        acct.secrets.update({me.id, name, key.prefix})
        acct.add("api_key", c.create_api_key(f"{name}-spare").key.id)

        # A private model, imported from the import root the compose file configures.
        acct.model_dir = str(stack.models_dir / f"{name}-model")
        shutil.copytree(stack.data_dir / "models" / BASE, acct.model_dir)
        acct.add("model", c.import_model(f"{name}-model", acct.model_dir).name)

        # Content and seeds of its own: blobs are shared by content, so no other account holds the same bytes (and
        # another account uploading these bytes would find only its own copy, never this one).
        rows = chat_rows(12)
        for row in rows:
            row["messages"][0]["content"] = f"{name}: {row['messages'][0]['content']}"
        acct.dataset_bytes = jsonl(rows)
        ds, _ = c.upload_dataset(acct.dataset_bytes, name=f"{name}-data")
        acct.add("dataset", ds.id)
        prompts = jsonl([{"prompt": f"{name}: {a}+{a}=", "answer": 2 * a} for a in range(4)])
        acct.prompts_dataset = c.upload_dataset(prompts, name=f"{name}-prompts")[0].id
        acct.add("dataset", acct.prompts_dataset)
        reward = f"def reward_fn(completion, row):\n    return float({name!r} in completion)\n".encode()
        ev = c.upload_evaluator(reward, name=f"{name}-reward")
        acct.add("evaluator", ev.id, ev.name, f"{ev.name}@{ev.version}")
        job = c.create_sft_job(BASE, ds.id, f"{name}-job", max_steps=4, checkpoint_every=2, learning_rate=3e-3,
                               batch_size=4, eval_fraction=0.2)
        done = c.wait_job(job.id, timeout_s=300)
        assert done.error == "" and done.output_checkpoint_id, done
        acct.add("job", job.id)
        acct.add("checkpoint", *[ck.id for ck in c.list_checkpoints(job.id)])
        dep = c.create_deployment(f"{name}-dep", job_id=job.id)
        acct.add("deployment", dep.id, dep.name)
        acct.add("deployment_id", dep.id)
        acct.add("deployment_name", dep.name)

        for full in (False, True):
            lora = None if full else tpb.SessionLora(rank=8)
            sess = stubs.trainer.CreateSession(tpb.CreateSessionRequest(
                base_model=BASE, lora=lora, seed=int(tag, 16), full_parameter=full), metadata=acct.md)
            acct.add("session", sess.id)
            acct.add("lineage", sess.lineage)
            v1 = stubs.trainer.SaveWeights(tpb.SaveWeightsRequest(session_id=sess.id, name=f"{name}-w1"),
                                           metadata=acct.md)
            step(stubs, acct, sess.id, [t + int(tag, 16) % 40 for t in SEQ])  # weights of its own
            state = stubs.trainer.SaveState(tpb.SaveStateRequest(session_id=sess.id, name=f"{name}-state"),
                                            metadata=acct.md)
            v2 = stubs.trainer.SaveWeights(tpb.SaveWeightsRequest(session_id=sess.id, name=f"{name}-w2"),
                                           metadata=acct.md)
            acct.add("version", v1.version_id, v2.version_id)
            acct.add("weights_path", v1.path, v2.path)
            acct.add("checkpoint", v1.checkpoint_id, state.checkpoint_id, v2.checkpoint_id)
            acct.add("state_path", state.path)
            follow = c.create_deployment(f"{name}-{'full' if full else 'lora'}-follow", lineage=sess.lineage)
            acct.add("deployment", follow.id, follow.name)
            acct.add("deployment_id", follow.id)
            acct.add("deployment_name", follow.name)
        for name_ in acct.refs["deployment_name"]:
            wait_loaded(stubs, acct, name_)
    # Directories the servers wrote for this account's objects (e.g. a full-weight deployment's model directory):
    # paths another account could ask ImportModel to register.
    acct.add("model_path", *sorted(str(p) for p in stack.data_dir.rglob("*")
                                   if p.is_dir() and any(d in p.name for d in acct.refs["deployment_id"])))
    return acct

