"""Bad input never changes a session: every rejected call is INVALID_ARGUMENT naming the field (or NOT_FOUND /
FAILED_PRECONDITION), its seq_id is used up, the weights, held gradients and optimizer state stay bitwise as they were,
and the session goes on. A stream that fails after some micro-batches ran restores the gradients held before it."""
from __future__ import annotations

from dataclasses import replace

import grpc
import pytest
import torch

from api_helpers import (
    ADAM, forward_stream, grads, lora, random_tokens, rl_datum, same, sft_datum, stream, tensor, weights, wire,
)
from services.common.errors import InvalidArgument, TrainyardError
from services.trainer.servicer import datum_inputs
from trainyard.v1 import trainer_pb2 as pb


def _snapshot(sess):
    return weights(sess), grads(sess), [{k: v.clone() for k, v in sess.optimizer.state[p].items()}
                                        for p in sess.params]


def _trained(api_env, manager):
    """A session after one step and with gradients of a further call pending."""
    sess = manager.create(api_env.alice, lora(rank=4, seed=1))
    gen = torch.Generator().manual_seed(0)
    good = [sft_datum(random_tokens(gen, 12)), sft_datum(random_tokens(gen, 20))]
    manager.forward(api_env.alice, sess.id, 0, good, "", {}, backward=True)
    manager.optim_step(api_env.alice, sess.id, 0, ADAM)
    manager.forward(api_env.alice, sess.id, 0, good, "", {}, backward=True)
    return sess, good


def _bad_requests(good):
    """Bad calls as clients send them (on the wire), each with the field its error must name."""
    good = [wire(d) for d in good]
    gen = torch.Generator().manual_seed(1)
    rl = [wire(rl_datum(gen, 6)) for _ in range(3)]
    no_adv = pb.Datum()
    no_adv.CopyFrom(rl[2])
    del no_adv.loss_fn_inputs["advantages"]
    nan_adv = pb.Datum()
    nan_adv.CopyFrom(rl[2])
    nan_adv.loss_fn_inputs["advantages"].CopyFrom(tensor([0.5, float("nan"), 0, 0, 0, 0]))
    short = pb.Datum(tokens=[5, 6, 7], loss_fn_inputs={"target_tokens": tensor([6, 7], "int64")})
    floats = pb.Datum(tokens=[5, 6], loss_fn_inputs={"target_tokens": tensor([6.0, 7.0])})
    torn = pb.Datum(tokens=[5, 6], loss_fn_inputs={"target_tokens": pb.TensorData(
        dtype=pb.TensorData.DTYPE_INT64, shape=[2], data=b"\0" * 12)})
    untyped = pb.Datum(tokens=[5, 6], loss_fn_inputs={"target_tokens": pb.TensorData(shape=[2], data=b"\0" * 16)})
    extra = pb.Datum()
    extra.CopyFrom(good[0])
    extra.loss_fn_inputs["foo"].CopyFrom(tensor([1.0] * len(good[0].tokens)))
    wrong_weights = wire(sft_datum([5, 6, 7], weights=[1.0]))
    # numpy's product of this shape wraps around to 0, which an empty buffer "matches"
    overflowing = pb.Datum(tokens=[5, 6], loss_fn_inputs={"target_tokens": pb.TensorData(
        dtype=pb.TensorData.DTYPE_INT64, shape=[2**32, 2**32], data=b"")})
    deep = pb.Datum(tokens=[5], loss_fn_inputs={"target_tokens": pb.TensorData(
        dtype=pb.TensorData.DTYPE_INT64, shape=[1] * 100, data=b"\0" * 8)})
    gen = torch.Generator().manual_seed(2)
    too_long = wire(sft_datum(random_tokens(gen, 3001)))  # 3000 tokens; the tiny model's context is 2048
    return [  # (data, loss_fn, config, micro_batch_tokens, the field named)
        ([good[0], short], "", {}, 0, "data[1].loss_fn_inputs['target_tokens']"),
        ([floats], "", {}, 0, "data[0].loss_fn_inputs['target_tokens']"),
        ([torn], "", {}, 0, "data[0].loss_fn_inputs['target_tokens'].data"),
        ([untyped], "", {}, 0, "data[0].loss_fn_inputs['target_tokens'].dtype"),
        ([good[0], overflowing], "", {}, 0, "data[1].loss_fn_inputs['target_tokens'].data"),
        ([deep], "", {}, 0, "data[0].loss_fn_inputs['target_tokens'].shape"),
        ([good[0], too_long], "", {}, 0, "data[1].tokens"),
        ([good[0], pb.Datum(tokens=[5, 4096], loss_fn_inputs={"target_tokens": tensor([1, 2], "int64")})], "", {},
         0, "data[1].tokens"),
        ([pb.Datum(loss_fn_inputs={"target_tokens": tensor([], "int64")})], "", {}, 0, "data[0].tokens"),
        ([wrong_weights], "", {}, 0, "data[0].loss_fn_inputs['weights']"),
        ([extra], "", {}, 0, "data[0].loss_fn_inputs['foo']"),
        (good, "nope", {}, 0, "loss_fn"),
        (good, "", {"clip_low_threshold": 0.5}, 0, "loss_fn_config['clip_low_threshold']"),
        (rl, "ppo", {"clip_low_threshold": 2.0}, 0, "loss_fn_config['clip_low_threshold']"),
        ([rl[0], rl[1], no_adv], "ppo", {}, 0, "data[2].loss_fn_inputs['advantages']"),
        ([rl[0], rl[1], nan_adv], "ppo", {}, 0, "data[2].loss_fn_inputs['advantages']"),
        (good, "", {}, -1, "micro_batch_tokens"),
        ([], "", {}, 0, "data"),
    ]


def test_bad_input_is_refused_by_field_and_changes_nothing(api_env):
    manager = api_env.manager()
    sess, good = _trained(api_env, manager)
    before = _snapshot(sess)
    seq = sess.next_seq_id
    for data, loss_fn, config, mbt, field in _bad_requests(good):
        for backward in (True, False):
            with pytest.raises(InvalidArgument) as exc:
                manager.forward(api_env.alice, sess.id, 0, datum_inputs(data), loss_fn, config, backward=backward,
                                micro_batch_tokens=mbt)
            assert [v.field for v in exc.value.violations] == [field], exc.value
            seq += 1
    with pytest.raises(InvalidArgument, match="adam.learning_rate"):
        manager.optim_step(api_env.alice, sess.id, 0, replace(ADAM, learning_rate=-1.0))
    with pytest.raises(InvalidArgument, match="adam.beta2"):
        manager.optim_step(api_env.alice, sess.id, 0, replace(ADAM, beta2=float("nan")))
    with pytest.raises(InvalidArgument, match="seq_id"):
        manager.forward(api_env.alice, sess.id, 1, good, "", {}, backward=True)
    with pytest.raises(InvalidArgument, match="name"):
        manager.save_state(api_env.alice, sess.id, 0, "x" * 300)
    after = _snapshot(sess)
    assert same(after[0], before[0]) and same(after[1], before[1]) and same(after[2], before[2])
    assert sess.next_seq_id == seq + 3 and sess.error == "" and sess.optim_steps == 1
    # The session goes on, exactly as one that never saw the bad calls.
    reference = api_env.manager()
    ref, _ = _trained(api_env, reference)
    for m, s in ((manager, sess), (reference, ref)):
        m.optim_step(api_env.alice, s.id, 0, ADAM)
    assert same(weights(sess), weights(ref))


@pytest.mark.parametrize("clip", [0.0, 1.0])
def test_a_step_with_a_non_finite_gradient_applies_nothing(api_env, clip):
    """Weights of 3e38 overflow the loss and its gradients: OptimStep applies nothing (not even its learning rate),
    drops the gradients, says so with INVALID_ARGUMENT, and the session goes on as one whose gradients were
    cleared; clipping (which scales by max_norm / norm) would have spread the NaN to every weight."""
    manager = api_env.manager()
    sess, good = _trained(api_env, manager)
    tokens = random_tokens(torch.Generator().manual_seed(4), 13)
    manager.forward(api_env.alice, sess.id, 0, [sft_datum(tokens, weights=[3e38] * 12)], "", {}, backward=True)
    held_weights, _, held_optimizer = _snapshot(sess)
    groups = [{k: v for k, v in g.items() if k != "params"} for g in sess.optimizer.param_groups]
    with pytest.raises(InvalidArgument, match="gradient norm is (inf|nan)"):
        manager.optim_step(api_env.alice, sess.id, 0, replace(ADAM, learning_rate=0.5, grad_clip_norm=clip))
    after = _snapshot(sess)
    assert same(after[0], held_weights) and same(after[2], held_optimizer)
    assert [{k: v for k, v in g.items() if k != "params"} for g in sess.optimizer.param_groups] == groups
    assert after[1] == [None] * len(sess.params) and sess.error == "" and sess.optim_steps == 1
    reference = api_env.manager()
    ref, _ = _trained(api_env, reference)
    for p in ref.params:  # what the failed step did to the session: its gradients are gone
        p.grad = None
    for m, s in ((manager, sess), (reference, ref)):
        m.forward(api_env.alice, s.id, 0, good, "", {}, backward=True)
        m.optim_step(api_env.alice, s.id, 0, replace(ADAM, grad_clip_norm=clip))
    assert same(weights(sess), weights(ref)) and all(torch.isfinite(w).all() for w in weights(sess).values())


def _watched(messages, sess, seen: list, cancel_at: int | None = None):
    """The client's messages; before handing out message cancel_at (or after the last), note whether the stream's
    micro-batches have left gradients, then break the stream as grpc's request iterator does on a cancelled call."""
    for n, msg in enumerate(messages):
        if n == cancel_at:
            break
        if n == len(messages) - 1:
            seen.append(all(p.grad is not None for p in sess.params))
        yield msg
    seen.append(all(p.grad is not None for p in sess.params))
    if cancel_at is not None:
        raise grpc.RpcError()


@pytest.mark.parametrize("failure", ["bad_datum", "client_cancel"])
def test_a_failed_stream_restores_the_gradients_held_before_it(api_env, failure):
    """Micro-batches of the stream run (and backpropagate) before the failure arrives; afterwards the gradients are
    bitwise those held before the stream, and the session continues as if it never ran."""
    manager = api_env.manager()
    sess, _ = _trained(api_env, manager)
    before = _snapshot(sess)
    gen = torch.Generator().manual_seed(3)
    data = [sft_datum(random_tokens(gen, n)) for n in (20, 20, 20)]
    bad = sft_datum([5, 6, 7], weights=[float("nan"), 1.0])
    header = pb.ForwardBackwardRequest(session_id=sess.id, micro_batch_tokens=19)  # each datum its own micro-batch
    messages, seen = stream(header, [data[:2], data[2:], [bad]]), []
    with pytest.raises(TrainyardError) as exc:
        forward_stream(
            manager, api_env.alice, _watched(messages, sess, seen, cancel_at=3 if failure == "client_cancel" else None))
    assert seen[0]  # the stream's own gradients existed when the failure came
    if failure == "bad_datum":
        assert [v.field for v in exc.value.violations] == ["data[3].loss_fn_inputs['weights']"]
    else:
        assert exc.value.code == grpc.StatusCode.CANCELLED
    after = _snapshot(sess)
    assert same(after[0], before[0]) and same(after[1], before[1]) and same(after[2], before[2])
    assert sess.error == ""
    reference = api_env.manager()
    ref, _ = _trained(api_env, reference)
    for m, s in ((manager, sess), (reference, ref)):
        m.optim_step(api_env.alice, s.id, 0, ADAM)
    assert same(weights(sess), weights(ref))


def test_malformed_streams_are_refused(api_env):
    manager = api_env.manager()
    sess = manager.create(api_env.alice, lora(rank=2))
    d = sft_datum([5, 6, 7, 8])
    header = pb.ForwardBackwardRequest(session_id=sess.id)
    cases = [
        ([pb.ForwardBackwardStreamRequest(datums=pb.DatumBatch(data=[wire(d)]))], "header"),
        ([pb.ForwardBackwardStreamRequest(header=pb.ForwardBackwardRequest(session_id=sess.id, data=[wire(d)]))],
         "header.data"),
        (stream(pb.ForwardBackwardRequest(session_id=sess.id, loss_fn="nope"), [[d]]), "header.loss_fn"),
        (stream(pb.ForwardBackwardRequest(session_id=sess.id, micro_batch_tokens=-5), [[d]]),
         "header.micro_batch_tokens"),
        ([*stream(header, [[d]]), pb.ForwardBackwardStreamRequest(header=header)], "messages[2]"),
        (stream(header, []), "data"),
    ]
    for messages, field in cases:
        with pytest.raises(InvalidArgument) as exc:
            forward_stream(manager, api_env.alice, iter(messages))
        assert [v.field for v in exc.value.violations] == [field], exc.value
    assert grads(sess) == [None] * len(sess.params) and sess.error == ""
    outputs, _ = forward_stream(manager, api_env.alice, iter(stream(header, [[d]])))
    assert len(outputs) == 1
