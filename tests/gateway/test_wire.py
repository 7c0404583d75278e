"""The gateway's protobuf schema and converters against the real tinker SDK's own encoder and decoder (tinker 0.38:
tinker/proto), and its in-memory state (futures, ordering, idempotency) without services. Exact comparisons: the
same bytes and values, bit for bit (float32 values round-trip exactly)."""
from __future__ import annotations

import asyncio
import math

import numpy as np
import pytest
from tinker import types as tt
from tinker.proto import request_conv, response_conv, tinker_public_pb2

from services.gateway import paths, wire
from services.gateway.errors import GatewayError, http_status
from services.gateway.state import CompletionLog, Futures, Idempotency, Sequencer
from trainyard import types
from trainyard.v1 import tinker_wire_pb2


def _fields(descriptor):
    return {f.name: (f.number, f.type, f.is_repeated, f.message_type.name if f.message_type else None,
                     f.enum_type.name if f.enum_type else None) for f in descriptor.fields}


def test_schema_has_the_sdk_field_numbers_and_types():
    theirs, ours = tinker_public_pb2.DESCRIPTOR, tinker_wire_pb2.DESCRIPTOR
    # Every message the gateway reads or writes (all but the SDK's SamplingParams, which asample sends as JSON).
    assert set(ours.message_types_by_name) == set(theirs.message_types_by_name) - {"SamplingParams", "StopStrings",
                                                                                   "StopTokens"}
    for name, message in ours.message_types_by_name.items():
        assert _fields(message) == _fields(theirs.message_types_by_name[name]), name
    for name, enum in theirs.enum_types_by_name.items():
        assert {v.name: v.number for v in enum.values} == \
            {v.name: v.number for v in ours.enum_types_by_name[name].values}, name


def test_a_forward_backward_body_from_the_sdk_encoder_reads_as_the_same_datums():
    tokens, targets = [5, 17, 33, 60], [17, 33, 60, 2]
    request = tt.ForwardBackwardRequest(
        forward_backward_input=tt.ForwardBackwardInput(
            data=[tt.Datum(model_input=tt.ModelInput.from_ints(tokens),
                           loss_fn_inputs={"target_tokens": tt.TensorData(data=targets, dtype="int64", shape=[4]),
                                           "weights": tt.TensorData(data=[1.0, 0.5, 0.25, 0.0], dtype="float32",
                                                                    shape=[4])})],
            loss_fn="importance_sampling", loss_fn_config={"clip": 0.2}),
        model_id="s1", seq_id=7)
    raw = request_conv.forward_backward_request_to_proto(request).SerializeToString()
    msg = tinker_wire_pb2.ForwardBackwardRequest.FromString(raw)
    assert (msg.model_id, msg.seq_id, msg.loss_fn) == ("s1", 7, "importance_sampling")
    assert wire.proto_loss_fn_config(msg) == {"clip": pytest.approx(0.2)}
    d = wire.proto_datum(msg.data[0], "data[0]")
    assert d.model_input.to_ints() == tokens
    assert d.loss_fn_inputs["target_tokens"].tolist() == targets
    assert d.loss_fn_inputs["weights"].tolist() == [1.0, 0.5, 0.25, 0.0]


def test_a_refused_proto_datum_names_its_field():
    msg = tinker_wire_pb2.Datum()
    msg.model_input.add().image.data = b"png"
    with pytest.raises(GatewayError) as err:
        wire.proto_datum(msg, "data[3]")
    assert err.value.field == "data[3].model_input[0]" and http_status(err.value.code) == 400


def test_forward_output_decodes_with_the_sdk_decoder():
    out = types.ForwardBackwardOutput("TensorData", [
        {"logprobs": types.TensorData(np.array([-1.5, -0.25, -3.0], np.float32))},
        {"logprobs": types.TensorData(np.array([[-0.5, -2.0], [-1.0, -4.0]], np.float32))}],
        {"loss:sum": 4.75, "loss:mean": 1.1875})
    got = response_conv.deserialize_proto_response(wire.forward_output_proto(out), tt.ForwardBackwardOutput)
    assert got.metrics == out.metrics
    assert [o["logprobs"].tolist() for o in got.loss_fn_outputs] == [[-1.5, -0.25, -3.0], [[-0.5, -2.0],
                                                                                           [-1.0, -4.0]]]


def test_sample_output_decodes_with_the_sdk_decoder():
    out = types.SampleResponse(
        sequences=[types.SampledSequence("stop", [4, 9, 2], [-0.5, -1.25, -0.125], "q",
                                         [[(4, -0.5), (7, -1.0)], [(9, -1.25), (1, -2.0)], [(2, -0.125), (3, -3.0)]]),
                   types.SampledSequence("length", [8], [-2.5], "r", [[(8, -2.5), (0, -3.5)]])],
        prompt_logprobs=[None, -0.75, -1.5])
    got = response_conv.deserialize_proto_response(wire.sample_proto(out), tt.SampleResponse)
    assert [s.stop_reason for s in got.sequences] == ["stop", "length"]
    assert [s.tokens for s in got.sequences] == [[4, 9, 2], [8]]
    assert [s.logprobs for s in got.sequences] == [[-0.5, -1.25, -0.125], [-2.5]]
    assert got.sequences[0].topk_logprobs == [[(4, -0.5), (7, -1.0)], [(9, -1.25), (1, -2.0)], [(2, -0.125),
                                                                                                (3, -3.0)]]
    assert got.prompt_logprobs == [None, -0.75, -1.5]


def test_paths_map_both_ways_and_refuse_other_shapes():
    assert paths.to_tinker("s1", "trainyard://state/c9") == "tinker://s1/weights/c9"
    assert paths.to_tinker("s1", "trainyard://weights/v3") == "tinker://s1/sampler_weights/v3"
    assert paths.to_trainyard("tinker://s1/weights/c9", "weights") == "trainyard://state/c9"
    assert paths.to_trainyard("tinker://s1/sampler_weights/v3", "sampler_weights") == "trainyard://weights/v3"
    for bad in ("tinker://s1/sampler_weights/v3", "trainyard://state/c9", "tinker://s1/weights/", "tinker://s1"):
        with pytest.raises(paths.BadPath, match="^path: "):
            paths.to_trainyard(bad, "weights")


def test_sequencer_runs_calls_in_seq_id_order_and_skips_refused_ones():
    async def main():
        seq, ran = Sequencer(1), []
        tasks = [asyncio.create_task(seq.turn(i, lambda i=i: ran.append(i))) for i in (4, 2, 5)]
        await asyncio.sleep(0.01)
        assert ran == []  # 1 has not come
        await seq.turn(1, lambda: ran.append(1))
        await seq.skip(3)  # refused with a 400: its turn passes
        await asyncio.gather(*tasks)
        assert ran == [1, 2, 4, 5]
        with pytest.raises(GatewayError, match="seq_id"):
            await seq.turn(2, lambda: None)

    asyncio.run(main())


def test_a_resumed_model_starts_at_the_lowest_seq_id_arriving_at_first():
    """After a gateway restart the SDK may send a batch's later chunks before its first: they wait for it."""
    async def main():
        seq, ran = Sequencer(None), []
        later = [asyncio.create_task(seq.turn(i, lambda i=i: ran.append(i))) for i in (8, 9)]
        await asyncio.sleep(0.1)
        await seq.turn(7, lambda: ran.append(7))
        await asyncio.gather(*later)
        assert ran == [7, 8, 9] and seq.next == 10

    asyncio.run(main())


def test_completion_log_answers_from_a_cursor_and_long_polls():
    async def main():
        log = CompletionLog()
        assert await log.since(0, 0) == ([], 0)
        log.add("r1", failed=False)
        log.add("r2", failed=True)
        entries, cursor = await log.since(0, 5)
        assert [(e["request_id"], e["state"]) for e in entries] == [("r1", "finished"), ("r2", "failed")]
        assert cursor == 2
        waiting = asyncio.create_task(log.since(cursor, 5))
        await asyncio.sleep(0.05)
        assert not waiting.done()  # nothing new: it waits
        log.add("r3", failed=False)
        assert await waiting == ([{"state": "finished", "request_id": "r3"}], 3)
        assert await log.since(3, 0.01) == ([], 3)  # seen entries are gone

    asyncio.run(main())


def test_idempotency_runs_a_key_once_and_a_failure_again():
    async def main():
        once, runs = Idempotency(60), []

        async def work():
            runs.append(1)
            await asyncio.sleep(0.01)
            return {"request_id": f"r{len(runs)}"}

        first = await asyncio.gather(*[once.once("a", "/p", "k", work) for _ in range(3)])
        assert first == [{"request_id": "r1"}] * 3 and len(runs) == 1
        assert await once.once("b", "/p", "k", work) == {"request_id": "r2"}  # another account's key

        async def fail():
            runs.append(1)
            raise GatewayError("UNAVAILABLE", "down")

        for _ in range(2):
            with pytest.raises(GatewayError):
                await once.once("a", "/p", "k2", fail)
        assert len(runs) == 4

    asyncio.run(main())


def test_futures_are_per_account_capped_and_expire():
    async def main():
        futures = Futures(max_pending=2, ttl_s=0.05)

        async def done():
            return lambda proto: ({"ok": True}, "application/json")

        ids = [futures.submit("a", done()) for _ in range(2)]
        with pytest.raises(GatewayError) as full:
            futures.submit("a", done())
        assert http_status(full.value.code) == 429 and full.value.retry_after_s
        futures.submit("b", done())  # another account's room is its own
        with pytest.raises(GatewayError) as other:
            futures.get("b", ids[0])
        assert http_status(other.value.code) == 404
        fut = futures.get("a", ids[0])
        await fut.done.wait()
        fut.retrieved = True
        futures.submit("a", done())  # a retrieved future leaves room
        await asyncio.sleep(0.1)
        with pytest.raises(GatewayError) as gone:
            futures.get("a", ids[0])
        assert http_status(gone.value.code) == 410

    asyncio.run(main())


def test_prompt_logprobs_nan_is_none():
    assert math.isnan(np.frombuffer(wire._f32([math.nan]), "<f4")[0])
