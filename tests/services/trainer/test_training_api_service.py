"""The TrainerService over gRPC, in process, with a real weight-sync server: defaults, the stream equal to the unary
call, SaveWeights publishing adapters and full weights, SaveState / LoadState, GetTokenizer, errors by field."""
from __future__ import annotations

import hashlib

import grpc
import numpy as np
import pytest
import torch
from sqlalchemy import select

from api_helpers import ApiEnv, random_tokens, rl_datum, sft_datum, stream, tensor, to_numpy, wire
from models import load_pretrained
from services.common.auth import issue_key
from services.common.channels import auth_metadata
from services.common.schema import Checkpoint
from services.trainer.app import TrainerSettings, build as build_trainer
from services.trainer.engine.logprobs import target_logprobs
from services.trainer.sessions import TOKENIZER_FILES
from services.weightsync.app import WeightSyncSettings, build as build_weightsync
from services.weightsync.client import fetch_version
from trainyard.v1 import trainer_pb2 as pb, trainer_pb2_grpc, weightsync_pb2 as wpb, weightsync_pb2_grpc


class Services:
    def __init__(self, root, model_dir):
        self.env = ApiEnv(root, model_dir)
        common = dict(data_dir=root, database_url=f"sqlite:///{root / 'trainyard.db'}", host="127.0.0.1",
                      grpc_workers=8, shutdown_grace_s=0)
        self.keys = {name: issue_key(self.env.db, account, "test")[1]
                     for name, account in (("alice", self.env.alice), ("bob", self.env.bob))}
        self.weightsync_server = build_weightsync(WeightSyncSettings(weightsync_port=0, **common))
        self.weightsync_server.start()
        self.trainer_server = build_trainer(TrainerSettings(
            trainer_port=0, weightsync_url=f"127.0.0.1:{self.weightsync_server.port}", micro_batch_tokens=64,
            **common))
        self.trainer_server.start()
        self.channels = [grpc.insecure_channel(f"127.0.0.1:{s.port}")
                         for s in (self.trainer_server, self.weightsync_server)]
        self.trainer = trainer_pb2_grpc.TrainerServiceStub(self.channels[0])
        self.weightsync = weightsync_pb2_grpc.WeightSyncServiceStub(self.channels[1])
        self.md = auth_metadata(self.keys["alice"])
        self.model_dir = model_dir

    def close(self):
        for ch in self.channels:
            ch.close()
        self.trainer_server.stop()
        self.weightsync_server.stop()
        self.env.close()


@pytest.fixture(scope="module")
def services(tmp_path_factory, tiny_model_dir):
    s = Services(tmp_path_factory.mktemp("services"), tiny_model_dir)
    yield s
    s.close()


def _data(seed: int):
    gen = torch.Generator().manual_seed(seed)
    return [wire(sft_datum(random_tokens(gen, n))) for n in (30, 12, 41, 7)]


def test_training_over_grpc(services):
    stub, md = services.trainer, services.md
    default = stub.CreateSession(pb.CreateSessionRequest(base_model="tiny"), metadata=md)
    assert (default.lora_rank, default.lora_alpha, default.vocab_size, default.lineage) == (32, 32.0, 1024,
                                                                                           default.id)
    assert default.created_at.seconds > 0 and len(default.target_modules) == 7
    lora = pb.SessionLora(rank=4)
    unary = stub.CreateSession(pb.CreateSessionRequest(base_model="tiny", lora=lora, seed=7), metadata=md)
    streamed = stub.CreateSession(pb.CreateSessionRequest(base_model="tiny", lora=lora, seed=7), metadata=md)
    data = _data(1)
    want = stub.ForwardBackward(pb.ForwardBackwardRequest(session_id=unary.id, seq_id=1, data=data), metadata=md)
    header = pb.ForwardBackwardRequest(session_id=streamed.id, seq_id=1)
    got = stub.ForwardBackwardStream(iter(stream(header, [data[:1], data[1:]])), metadata=md)
    assert got.SerializeToString(deterministic=True) == want.SerializeToString(deterministic=True)
    assert [list(o.loss_fn_outputs["logprobs"].shape) for o in got.outputs] == [[29], [11], [40], [6]]
    for sess in (unary, streamed):
        step = stub.OptimStep(pb.OptimStepRequest(session_id=sess.id, seq_id=2), metadata=md)
        assert step.step == 1 and step.metrics["learning_rate"] == pytest.approx(1e-4)
    outs = [stub.Forward(pb.ForwardRequest(session_id=s.id, seq_id=3, data=data), metadata=md)
            for s in (unary, streamed)]
    assert outs[0].SerializeToString(deterministic=True) == outs[1].SerializeToString(deterministic=True)

    saved = stub.SaveWeights(pb.SaveWeightsRequest(session_id=unary.id, seq_id=4, name="w"), metadata=md)
    assert saved.path == f"trainyard://weights/{saved.version_id}"
    version = services.weightsync.GetVersion(wpb.GetVersionRequest(id=saved.version_id), metadata=md)
    assert (version.lineage, version.version, version.kind) == (unary.id, 1, wpb.WEIGHT_KIND_LORA_ADAPTER)
    again = stub.SaveWeights(pb.SaveWeightsRequest(session_id=unary.id, seq_id=5), metadata=md)
    assert services.weightsync.GetVersion(wpb.GetVersionRequest(id=again.version_id), metadata=md).parent_id == \
        saved.version_id

    state = stub.SaveState(pb.SaveStateRequest(session_id=unary.id, seq_id=6, name="s"), metadata=md)
    assert state.path == f"trainyard://state/{state.checkpoint_id}"
    with services.env.db.session() as s:
        row = s.get(Checkpoint, state.checkpoint_id)
        assert row.kind == "lora_adapter" and {f["path"] for f in row.state} == {"engine_state.json",
                                                                                  "optimizer.pt", "rng.pt"}
    resumed = stub.CreateSession(pb.CreateSessionRequest(from_state=state.path, with_optimizer=True), metadata=md)
    assert (resumed.lora_rank, resumed.optim_steps) == (4, 1)
    loaded = stub.LoadState(pb.LoadStateRequest(session_id=streamed.id, seq_id=4, path=state.path,
                                                with_optimizer=True), metadata=md)
    assert loaded.id == streamed.id and loaded.next_seq_id == 5
    outs = [stub.Forward(pb.ForwardRequest(session_id=s, data=data), metadata=md) for s in (resumed.id, unary.id)]
    assert outs[0].SerializeToString(deterministic=True) == outs[1].SerializeToString(deterministic=True)

    files: dict[str, bytearray] = {}
    for chunk in stub.GetTokenizer(pb.GetTokenizerRequest(session_id=unary.id), metadata=md):
        assert hashlib.sha256(chunk.data).hexdigest() == chunk.sha256
        buf = files.setdefault(chunk.path, bytearray())
        assert chunk.offset == len(buf)
        buf += chunk.data
    expected = {n: (services.model_dir / n).read_bytes() for n in TOKENIZER_FILES
                if (services.model_dir / n).is_file()}
    assert {"tokenizer.json", "tokenizer_config.json"} <= set(files) and {k: bytes(v) for k, v in files.items()} == \
        expected

    closed = stub.CloseSession(pb.CloseSessionRequest(id=default.id), metadata=md)
    assert closed.closed
    assert stub.GetSession(pb.GetSessionRequest(id=default.id), metadata=md).closed


def test_errors_name_the_field_over_grpc(services):
    stub, md = services.trainer, services.md
    sess = stub.CreateSession(pb.CreateSessionRequest(base_model="tiny", lora=pb.SessionLora(rank=2)), metadata=md)
    gen = torch.Generator().manual_seed(2)
    good = wire(rl_datum(gen, 8))
    bad = pb.Datum()
    bad.CopyFrom(good)
    bad.loss_fn_inputs["advantages"].CopyFrom(tensor([float("nan")] * 8))
    header = pb.ForwardBackwardRequest(session_id=sess.id, loss_fn="ppo", micro_batch_tokens=4)
    with pytest.raises(grpc.RpcError) as exc:
        stub.ForwardBackwardStream(iter(stream(header, [[good], [good, bad]])), metadata=md)
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "data[2].loss_fn_inputs['advantages']" in exc.value.details()
    with pytest.raises(grpc.RpcError) as exc:
        stub.CreateSession(pb.CreateSessionRequest(base_model="tiny", full_parameter=True,
                                                   lora=pb.SessionLora(rank=4)), metadata=md)
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "lora" in exc.value.details()
    bob = auth_metadata(services.keys["bob"])
    for call in (lambda: stub.GetSession(pb.GetSessionRequest(id=sess.id), metadata=bob),
                 lambda: list(stub.GetTokenizer(pb.GetTokenizerRequest(session_id=sess.id), metadata=bob)),
                 lambda: stub.ForwardBackwardStream(iter(stream(pb.ForwardBackwardRequest(session_id=sess.id),
                                                                [[good]])), metadata=bob)):
        with pytest.raises(grpc.RpcError) as exc:
            call()
        assert exc.value.code() == grpc.StatusCode.NOT_FOUND
    info = stub.GetSession(pb.GetSessionRequest(id=sess.id), metadata=md)
    assert info.error == "" and info.next_seq_id == 2


def test_full_parameter_save_weights_publishes_a_model_directory(services, tmp_path):
    stub, md = services.trainer, services.md
    sess = stub.CreateSession(pb.CreateSessionRequest(base_model="tiny", full_parameter=True), metadata=md)
    assert sess.full_parameter and sess.lora_rank == 0
    data = _data(3)
    stub.ForwardBackward(pb.ForwardBackwardRequest(session_id=sess.id, data=data), metadata=md)
    stub.OptimStep(pb.OptimStepRequest(session_id=sess.id, adam=pb.AdamParams(learning_rate=1e-3)), metadata=md)
    saved = stub.SaveWeights(pb.SaveWeightsRequest(session_id=sess.id), metadata=md)
    version = services.weightsync.GetVersion(wpb.GetVersionRequest(id=saved.version_id), metadata=md)
    assert version.kind == wpb.WEIGHT_KIND_FULL and version.lineage == sess.id
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {f.path for f in version.files}
    out = fetch_version(services.weightsync, services.keys["alice"], version, tmp_path / "full")
    model = load_pretrained(out)
    served = stub.Forward(pb.ForwardRequest(session_id=sess.id, data=data[:1]), metadata=md).outputs[0]
    tokens = torch.tensor(list(data[0].tokens))[None]
    targets = torch.from_numpy(to_numpy(data[0].loss_fn_inputs["target_tokens"]).copy())[None]
    with torch.no_grad():
        want = target_logprobs(model, tokens, targets)[0].numpy()
    assert np.abs(to_numpy(served.loss_fn_outputs["logprobs"]) - want).max() <= 1e-5
    with services.env.db.session() as s:
        assert s.get(Checkpoint, saved.checkpoint_id).kind == "full"


def test_a_publish_the_weight_sync_service_refuses_is_unavailable(tmp_path):
    """The trainer's publisher turns the weight-sync call's failure into UNAVAILABLE (the session stays usable, the
    caller saves again); the session manager itself speaks no gRPC."""
    from types import SimpleNamespace

    from services.common.errors import Unavailable
    from services.trainer.app import make_publisher

    class Down(grpc.RpcError):
        def details(self):
            return "connection refused"

    class Stub:
        def PublishVersion(self, requests, **kw):
            raise Down()

    sess = SimpleNamespace(id="sess_x", weight_version_id="", base_model="tiny", optim_steps=3)
    (tmp_path / "adapter_config.json").write_text("{}")
    with pytest.raises(Unavailable, match="connection refused"):
        make_publisher(Stub())("ty_key", sess, tmp_path, "lora_adapter")


def _saved(services, session_id: str) -> tuple[list, int]:
    """(the session's checkpoint rows, the versions of its lineage) as stored."""
    with services.env.db.session() as s:
        rows = s.scalars(select(Checkpoint).where(Checkpoint.session_id == session_id)).all()
    versions = services.weightsync.ListVersions(wpb.ListVersionsRequest(lineage=session_id), metadata=services.md)
    return rows, len(versions.versions)


def _blobs(services) -> set:
    return {p.name for p in (services.env.blobs.root / "sha256").rglob("*") if p.is_file()}


def test_a_bad_save_name_publishes_and_stores_nothing(services):
    """A NUL in the name (which Postgres cannot store: it used to publish the version, then fail the row and the
    session) or a name too long is INVALID_ARGUMENT before any side effect; the session goes on."""
    stub, md = services.trainer, services.md
    sess = stub.CreateSession(pb.CreateSessionRequest(base_model="tiny", lora=pb.SessionLora(rank=2)), metadata=md)
    stub.ForwardBackward(pb.ForwardBackwardRequest(session_id=sess.id, data=_data(5)), metadata=md)
    stub.OptimStep(pb.OptimStepRequest(session_id=sess.id), metadata=md)
    blobs = _blobs(services)
    for call in (stub.SaveWeights, stub.SaveState):
        for name in ("a\x00b", "x" * 300):
            request = (pb.SaveWeightsRequest if call is stub.SaveWeights else pb.SaveStateRequest)(
                session_id=sess.id, name=name)
            with pytest.raises(grpc.RpcError) as exc:
                call(request, metadata=md)
            assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "name" in exc.value.details()
    assert _saved(services, sess.id) == ([], 0) and _blobs(services) == blobs
    info = stub.GetSession(pb.GetSessionRequest(id=sess.id), metadata=md)
    assert info.error == "" and info.optim_steps == 1
    saved = stub.SaveWeights(pb.SaveWeightsRequest(session_id=sess.id, name="fine"), metadata=md)
    rows, versions = _saved(services, sess.id)
    assert [r.name for r in rows] == ["fine"] and versions == 1 and saved.version_id


@pytest.mark.parametrize("save", ["SaveWeights", "SaveState"])
def test_a_database_failure_while_saving_keeps_the_session(services, save):
    """The checkpoint row cannot be written (its table is gone for the moment): the call fails UNAVAILABLE before
    anything is published, and the session stays usable; once the database is back the same save works."""
    stub, md = services.trainer, services.md
    sess = stub.CreateSession(pb.CreateSessionRequest(base_model="tiny", lora=pb.SessionLora(rank=2)), metadata=md)
    stub.ForwardBackward(pb.ForwardBackwardRequest(session_id=sess.id, data=_data(6)), metadata=md)
    stub.OptimStep(pb.OptimStepRequest(session_id=sess.id), metadata=md)
    request = getattr(pb, f"{save}Request")(session_id=sess.id, name="kept")
    with services.env.db.engine.begin() as conn:
        conn.exec_driver_sql("ALTER TABLE checkpoints RENAME TO checkpoints_away")
    try:
        with pytest.raises(grpc.RpcError) as exc:
            getattr(stub, save)(request, metadata=md)
    finally:
        with services.env.db.engine.begin() as conn:
            conn.exec_driver_sql("ALTER TABLE checkpoints_away RENAME TO checkpoints")
    assert exc.value.code() == grpc.StatusCode.UNAVAILABLE, exc.value.details()
    assert _saved(services, sess.id) == ([], 0)
    assert stub.GetSession(pb.GetSessionRequest(id=sess.id), metadata=md).error == ""
    stub.ForwardBackward(pb.ForwardBackwardRequest(session_id=sess.id, data=_data(7)), metadata=md)
    stub.OptimStep(pb.OptimStepRequest(session_id=sess.id), metadata=md)
    getattr(stub, save)(request, metadata=md)
    rows, versions = _saved(services, sess.id)
    assert [r.name for r in rows] == ["kept"] and versions == (1 if save == "SaveWeights" else 0)
