"""The trainer's session API and the weight-sync service as real processes."""
from __future__ import annotations

import hashlib

import grpc
import numpy as np
import pytest

from services.common.channels import auth_metadata
from services.weightsync.client import fetch_version, publish_dir
from trainyard.v1 import common_pb2, trainer_pb2 as tpb, trainer_pb2_grpc, weightsync_pb2 as wpb, weightsync_pb2_grpc

pytestmark = pytest.mark.integration


def tensor(values, dtype) -> tpb.TensorData:
    arr = np.asarray(values, dtype="<i8" if dtype == "int64" else "<f4")
    kind = tpb.TensorData.DTYPE_INT64 if dtype == "int64" else tpb.TensorData.DTYPE_FLOAT32
    return tpb.TensorData(dtype=kind, shape=list(arr.shape), data=arr.tobytes())


def datum(tokens: list[int]) -> tpb.Datum:
    return tpb.Datum(tokens=tokens[:-1], loss_fn_inputs={"target_tokens": tensor(tokens[1:], "int64"),
                                                        "weights": tensor([1.0] * (len(tokens) - 1), "float32")})


@pytest.fixture()
def trainer(stack, api_key):
    with grpc.insecure_channel(stack.url("trainer")) as ch:
        yield trainer_pb2_grpc.TrainerServiceStub(ch), auth_metadata(api_key)


@pytest.fixture()
def weightsync(stack, api_key):
    with grpc.insecure_channel(stack.url("weightsync")) as ch:
        yield weightsync_pb2_grpc.WeightSyncServiceStub(ch), auth_metadata(api_key)


def test_session_trains_saves_and_deploys(trainer, weightsync, client, other_api_key):
    stub, md = trainer
    sess = stub.CreateSession(tpb.CreateSessionRequest(base_model="tiny-qwen3", lora=tpb.SessionLora(rank=8)),
                              metadata=md)
    assert sess.lora_rank == 8 and sess.next_seq_id == 1 and sess.num_trainable_parameters > 0
    data = [datum([5, 17, 33, 60, 2]), datum([7, 8, 9, 2])]
    losses = []
    for step in range(6):
        fb = stub.ForwardBackward(tpb.ForwardBackwardRequest(session_id=sess.id, seq_id=2 * step + 1, data=data,
                                                             loss_fn="cross_entropy"), metadata=md)
        losses.append(fb.metrics["loss:mean"])
        assert [len(o.loss_fn_outputs["logprobs"].data) // 4 for o in fb.outputs] == [4, 3]
        stub.OptimStep(tpb.OptimStepRequest(session_id=sess.id, seq_id=2 * step + 2,
                                            adam=tpb.AdamParams(learning_rate=1e-2)), metadata=md)
    assert losses[-1] < losses[0]
    saved = stub.SaveWeights(tpb.SaveWeightsRequest(session_id=sess.id, seq_id=13, name="api-run"), metadata=md)
    version = weightsync[0].GetVersion(wpb.GetVersionRequest(id=saved.version_id), metadata=weightsync[1])
    assert version.lineage == sess.id and version.version == 1 and version.kind == wpb.WEIGHT_KIND_LORA_ADAPTER
    dep = client.create_deployment("from-api", checkpoint_id=saved.checkpoint_id)
    out = client.sample(dep.name, tokens=[5, 17, 33], temperature=0, max_tokens=2)
    assert len(out.sequences[0].tokens) >= 1
    client.delete_deployment(dep.name)
    # Another account cannot see the session.
    with pytest.raises(grpc.RpcError) as exc:
        stub.GetSession(tpb.GetSessionRequest(id=sess.id), metadata=auth_metadata(other_api_key))
    assert exc.value.code() == grpc.StatusCode.NOT_FOUND


def test_session_bad_input_leaves_state_unchanged(trainer):
    stub, md = trainer
    sess = stub.CreateSession(tpb.CreateSessionRequest(base_model="tiny-qwen3"), metadata=md)
    bad = tpb.Datum(tokens=[1, 2, 3], loss_fn_inputs={"target_tokens": tensor([1, 2], "int64")})
    cases = [
        (tpb.ForwardBackwardRequest(session_id=sess.id, seq_id=1, data=[bad]), "target_tokens"),
        (tpb.ForwardBackwardRequest(session_id=sess.id, seq_id=2, data=[datum([1, 2, 3])], loss_fn="nope"),
         "loss_fn"),
        (tpb.ForwardBackwardRequest(session_id=sess.id, seq_id=3, data=[]), "data"),
        (tpb.ForwardBackwardRequest(session_id=sess.id, seq_id=4, data=[tpb.Datum(
            tokens=[1, 2], loss_fn_inputs={"target_tokens": tensor([1, 2], "int64"),
                                           "weights": tensor([float("nan"), 1.0], "float32")})]), "weights"),
    ]
    for req, field in cases:
        with pytest.raises(grpc.RpcError) as exc:
            stub.ForwardBackward(req, metadata=md)
        assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field in exc.value.details()
    with pytest.raises(grpc.RpcError) as exc:
        stub.OptimStep(tpb.OptimStepRequest(session_id=sess.id, seq_id=5, adam=tpb.AdamParams(learning_rate=-1)),
                       metadata=md)
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "adam.learning_rate" in exc.value.details()
    info = stub.GetSession(tpb.GetSessionRequest(id=sess.id), metadata=md)
    assert info.error == "" and info.optim_steps == 0
    # The session still works.
    stub.ForwardBackward(tpb.ForwardBackwardRequest(session_id=sess.id, seq_id=0, data=[datum([1, 2, 3])]),
                         metadata=md)
    with pytest.raises(grpc.RpcError) as exc:
        stub.GetSession(tpb.GetSessionRequest(id="sess_unknown"), metadata=md)
    assert exc.value.code() == grpc.StatusCode.NOT_FOUND
    stub.CloseSession(tpb.CloseSessionRequest(id=sess.id), metadata=md)
    with pytest.raises(grpc.RpcError) as exc:
        stub.ForwardBackward(tpb.ForwardBackwardRequest(session_id=sess.id, data=[datum([1, 2, 3])]), metadata=md)
    assert exc.value.code() == grpc.StatusCode.FAILED_PRECONDITION


def test_weight_versions_chain_and_resume(weightsync, tmp_path):
    stub, md = weightsync
    key = md[0][1].removeprefix("Bearer ")
    src = tmp_path / "v1"
    src.mkdir()
    (src / "weights.bin").write_bytes(np.random.default_rng(0).bytes(3 * 1024 * 1024 + 17))
    (src / "config.json").write_text('{"a": 1}')
    v1 = publish_dir(stub, key, lineage="lin-a", parent_id="", kind=wpb.WEIGHT_KIND_FULL, base_model="tiny-qwen3",
                     directory=src)
    assert v1.version == 1
    with pytest.raises(grpc.RpcError) as exc:  # stale parent
        publish_dir(stub, key, lineage="lin-a", parent_id="", kind=wpb.WEIGHT_KIND_FULL, base_model="", directory=src)
    assert exc.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    v2 = publish_dir(stub, key, lineage="lin-a", parent_id=v1.id, kind=wpb.WEIGHT_KIND_FULL, base_model="",
                     directory=src)
    assert (v2.version, v2.parent_id) == (2, v1.id)
    listed = stub.ListVersions(wpb.ListVersionsRequest(lineage="lin-a"), metadata=md).versions
    assert [v.version for v in listed] == [1, 2]
    out = fetch_version(stub, key, v2, tmp_path / "out")
    assert (out / "weights.bin").read_bytes() == (src / "weights.bin").read_bytes()
    # Resume from the middle of the big file.
    chunks = list(stub.FetchVersion(wpb.FetchVersionRequest(id=v2.id, from_path="weights.bin",
                                                            from_offset=2 * 1024 * 1024), metadata=md))
    assert chunks[0].offset == 2 * 1024 * 1024 and chunks[0].path == "weights.bin"
    assert all(hashlib.sha256(c.data).hexdigest() == c.sha256 for c in chunks)


def test_corrupt_chunk_is_rejected_and_nothing_is_stored(weightsync):
    stub, md = weightsync
    data = b"x" * 1000
    header = wpb.PublishVersionHeader(lineage="lin-corrupt", kind=wpb.WEIGHT_KIND_FULL, files=[
        wpb.WeightFile(path="w.bin", sha256=hashlib.sha256(data).hexdigest(), size_bytes=len(data))])
    bad = common_pb2.FileChunk(path="w.bin", offset=0, data=data, sha256="0" * 64)
    reqs = iter([wpb.PublishVersionRequest(header=header), wpb.PublishVersionRequest(chunk=bad)])
    with pytest.raises(grpc.RpcError) as exc:
        stub.PublishVersion(reqs, metadata=md)
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "checksum" in exc.value.details()
    assert list(stub.ListVersions(wpb.ListVersionsRequest(lineage="lin-corrupt"), metadata=md).versions) == []


def test_a_rejected_call_uses_up_its_seq_id(trainer):
    """A pipelined call right after a rejected one runs at once instead of waiting for the rejected seq_id."""
    import time

    stub, md = trainer
    sess = stub.CreateSession(tpb.CreateSessionRequest(base_model="tiny-qwen3"), metadata=md)
    bad = tpb.ForwardBackwardRequest(session_id=sess.id, seq_id=1, data=[datum([1, 2, 3])], loss_fn="nope")
    good = tpb.ForwardBackwardRequest(session_id=sess.id, seq_id=2, data=[datum([1, 2, 3])])
    later = stub.ForwardBackward.future(good, metadata=md)  # submitted before seq_id 1 arrives
    time.sleep(0.5)
    with pytest.raises(grpc.RpcError) as exc:
        stub.ForwardBackward(bad, metadata=md)
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert later.result(timeout=30).metrics["loss:sum"] > 0
    assert stub.GetSession(tpb.GetSessionRequest(id=sess.id), metadata=md).next_seq_id == 3
