"""Forward / ForwardBackward (services/trainer/engine/forward_backward.py): micro-batching, the streamed call equal to
the unary one bitwise, gradients accumulating across calls, every built-in loss against an unpacked reference, [T, K]
targets and deterministic-mode logprobs bitwise equal to target_logprobs. float32, CPU, one torch thread.

Reference tolerance (test_losses_match_an_unpacked_reference): outputs within 1e-5 absolute, gradients within 1e-4 of
the reference's largest entry (packing, chunked logprobs and summation order change float32 rounding only)."""
from __future__ import annotations

import shutil

import pytest
import torch

from api_helpers import (
    ADAM, VOCAB, forward_stream, grads, lora, random_tokens, rl_datum, same, sft_datum, stream, weights,
)
from models import load_pretrained, save_pretrained
from services.common import registry
from services.common.schema import SHARED_SCOPE
from services.trainer.engine import losses
from services.trainer.datums import check_datum
from services.trainer.engine.forward_backward import Datum, MicroBatcher
from services.trainer.session_spec import CreateSpec, LoraSpec
from services.trainer.engine.logprobs import target_logprobs
from trainyard.v1 import trainer_pb2 as pb


def test_micro_batches_pack_datums_in_order_up_to_the_limit():
    batcher = MicroBatcher(6)
    done = []
    for n in (3, 4, 2, 10, 1, 6, 1):
        done += batcher.add(Datum(torch.zeros(n, dtype=torch.int64), {}))
    done += batcher.finish()
    assert [[d.length for d in mb] for mb in done] == [[3], [4, 2], [10], [1], [6], [1]]


def _rl_data(seed: int, mask: bool):
    gen = torch.Generator().manual_seed(seed)
    return [rl_datum(gen, n, mask=mask) for n in (9, 31, 4, 17, 12, 26)]


@pytest.mark.parametrize("loss_fn", ["cross_entropy", "grpo"])
def test_stream_equals_unary_call_bitwise(api_env, loss_fn):
    """Same datums, same micro_batch_tokens: the stream (datums arriving in uneven batches, after gradients of an
    earlier call) gives the unary call's gradients, logprobs and metrics bit for bit, and the same weights after
    OptimStep."""
    manager = api_env.manager()
    unary = manager.create(api_env.alice, lora(rank=4, seed=5))
    streamed = manager.create(api_env.alice, lora(rank=4, seed=5))
    gen = torch.Generator().manual_seed(1)
    if loss_fn == "cross_entropy":
        data = [sft_datum(random_tokens(gen, n)) for n in (10, 32, 5, 18, 13, 27)]
    else:
        data = _rl_data(1, mask=True)
    first = [sft_datum(random_tokens(gen, 8))]
    for sess in (unary, streamed):
        manager.forward(api_env.alice, sess.id, 0, first, "cross_entropy", {}, backward=True)
    cfg = {"clip_low_threshold": 0.7} if loss_fn == "grpo" else {}
    want = manager.forward(api_env.alice, unary.id, 0, data, loss_fn, cfg, backward=True, micro_batch_tokens=40)
    header = pb.ForwardBackwardRequest(session_id=streamed.id, loss_fn=loss_fn, loss_fn_config=cfg,
                                       micro_batch_tokens=40)
    got = forward_stream(manager, api_env.alice, iter(stream(header, [data[:1], data[1:3], [], data[3:]])))
    assert same(got[0], want[0]) and got[1] == want[1]
    assert same(grads(streamed), grads(unary))
    for sess in (unary, streamed):
        manager.optim_step(api_env.alice, sess.id, 0, ADAM)
    assert same(weights(streamed), weights(unary))


def test_gradients_accumulate_across_calls_until_optim_step(api_env):
    """Two calls of one datum each leave the gradients of one call of both (each datum its own micro-batch)."""
    manager = api_env.manager()
    two_calls = manager.create(api_env.alice, lora(rank=4, seed=5))
    one_call = manager.create(api_env.alice, lora(rank=4, seed=5))
    gen = torch.Generator().manual_seed(2)
    data = [sft_datum(random_tokens(gen, 20)), sft_datum(random_tokens(gen, 25))]
    for d in data:
        manager.forward(api_env.alice, two_calls.id, 0, [d], "", {}, backward=True)
    manager.forward(api_env.alice, one_call.id, 0, data, "", {}, backward=True, micro_batch_tokens=20)
    assert same(grads(two_calls), grads(one_call))
    held = grads(two_calls)
    manager.forward(api_env.alice, two_calls.id, 0, data, "", {}, backward=False)  # Forward touches no gradient
    assert same(grads(two_calls), held)
    manager.optim_step(api_env.alice, two_calls.id, 0, ADAM)
    assert grads(two_calls) == [None] * len(two_calls.params)


def _reference(sess, data, loss_fn: str, config: dict):
    """c * sum_i datum_loss_i over each datum's own unpacked forward (target_logprobs, or a plain log_softmax for
    [T, K] targets): (per-datum logprobs, loss, gradients)."""
    cfg = losses.resolve_config(loss_fn, config)
    context = sess.holder.model.args.max_position_embeddings
    datums = [check_datum(d, i, loss_fn, VOCAB, context) for i, d in enumerate(data)]
    with sess.use() as model:
        total, outputs = 0.0, []
        for d in datums:
            if d.targets.dim() == 2:
                lp = torch.log_softmax(model(d.tokens[None])[0].float(), -1).gather(1, d.targets)
            else:
                lp = target_logprobs(model, d.tokens[None], d.targets[None])[0]
            total = total + losses.datum_loss(loss_fn, cfg, lp, d.inputs)[0]
            outputs.append(lp.detach())
        c = losses.batch_scale(loss_fn, cfg, [d.inputs for d in datums])
        return outputs, float(c * total.detach()), torch.autograd.grad(c * total, sess.params)


@pytest.mark.parametrize("loss_fn", list(losses.LOSS_FNS))
def test_losses_match_an_unpacked_reference(api_env, loss_fn):
    manager = api_env.manager()
    sess = manager.create(api_env.alice, lora(rank=4, seed=3))
    gen = torch.Generator().manual_seed(3)
    warm = [sft_datum(random_tokens(gen, 30))]  # a trained adapter, so every LoRA factor carries gradient
    manager.forward(api_env.alice, sess.id, 0, warm, "", {}, backward=True)
    manager.optim_step(api_env.alice, sess.id, 0, ADAM)
    if loss_fn == "cross_entropy":
        data = [sft_datum(random_tokens(gen, n), weights=torch.rand(n - 1, generator=gen).tolist())
                for n in (9, 33, 14)]
        n = 11
        data.append(sft_datum(random_tokens(gen, n), weights=torch.rand(n - 1, 4, generator=gen).tolist(),
                              k_targets=torch.randint(0, VOCAB, (n - 1, 4), generator=gen).tolist()))
    else:
        data = _rl_data(4, mask=loss_fn in ("gspo", "grpo", "dr_grpo", "dapo"))
    outputs, metrics = manager.forward(api_env.alice, sess.id, 0, data, loss_fn, {}, backward=True,
                                       micro_batch_tokens=32)
    want_outputs, want_loss, want_grads = _reference(sess, data, loss_fn, {})
    for got, want in zip(outputs, want_outputs):
        assert got.shape == want.shape and (got - want).abs().max().item() <= 1e-5
    for got, want in zip(grads(sess), want_grads):
        assert (got - want).abs().max().item() <= 1e-4 * want.abs().max().item()
    assert metrics["loss:sum"] == pytest.approx(want_loss, rel=1e-5, abs=1e-6)
    assert set(metrics) >= {"loss:sum", "loss:mean"}


def test_k_targets_gather_k_logprobs_per_position(api_env):
    manager = api_env.manager()
    sess = manager.create(api_env.alice, lora(rank=4, seed=3))
    gen = torch.Generator().manual_seed(5)
    tokens = random_tokens(gen, 16)
    k_targets = torch.randint(0, VOCAB, (15, 3), generator=gen)
    k_targets[:, 0] = torch.tensor(tokens[1:])
    data = [sft_datum(random_tokens(gen, 9)), sft_datum(tokens, k_targets=k_targets.tolist()), sft_datum(tokens)]
    outputs, _ = manager.forward(api_env.alice, sess.id, 0, data, "", {}, backward=False)
    assert [tuple(o.shape) for o in outputs] == [(8,), (15, 3), (15,)]
    assert (outputs[1][:, 0] - outputs[2]).abs().max().item() <= 1e-6  # the same targets, [T] and [T, K] form
    with sess.use() as model, torch.no_grad():
        want = torch.log_softmax(model(torch.tensor(tokens[:-1])[None])[0], -1).gather(1, k_targets)
    assert (outputs[1] - want).abs().max().item() <= 1e-5


def test_deterministic_logprobs_are_target_logprobs_bitwise(api_env):
    """Deterministic mode: whatever a datum shares its micro-batch with, its logprobs are those of
    target_logprobs(deterministic=True) on it alone (and so a deterministic rollout's), bit for bit."""
    manager = api_env.manager(deterministic=True)
    sess = manager.create(api_env.alice, lora(rank=4, seed=3))
    gen = torch.Generator().manual_seed(6)
    data = [sft_datum(random_tokens(gen, n)) for n in (6, 70, 33, 129, 2)]
    manager.forward(api_env.alice, sess.id, 0, data, "", {}, backward=True)
    manager.optim_step(api_env.alice, sess.id, 0, ADAM)
    outputs, _ = manager.forward(api_env.alice, sess.id, 0, data, "", {}, backward=False)
    with sess.use() as model, torch.no_grad():
        for d, got in zip(data, outputs):
            tokens, targets = d.tokens[None], d.loss_fn_inputs["target_tokens"][None]
            assert torch.equal(got, target_logprobs(model, tokens, targets, deterministic=True)[0])


@pytest.mark.parametrize("tied", [False, True])
def test_train_unembed(api_env, tmp_path, tied):
    """train_unembed adapts lm_head, untied (a copy of the tiny model with a head of its own) or tied to the input
    embeddings (the tiny model itself): LoRA then wraps the unembedding, whose logprobs are computed chunk by chunk
    through the adapter (recomputed in backward); they and the gradients match the unpacked reference. A tied head's
    weight, the embeddings, stays frozen, unchanged and shared."""
    base = "tiny"
    if not tied:
        base, untied = "tiny-untied", tmp_path / "untied"
        model = load_pretrained(api_env.model_dir)
        model.args.tie_word_embeddings = False
        model.lm_head = torch.nn.Linear(model.args.hidden_size, model.args.vocab_size, bias=False)
        with torch.no_grad():
            model.lm_head.weight.copy_(model.model.embed_tokens.weight)
        save_pretrained(model, untied)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copyfile(api_env.model_dir / name, untied / name)
        with api_env.db.session() as s:
            registry.register_model(s, SHARED_SCOPE, base, str(untied))
    manager = api_env.manager()
    sess = manager.create(api_env.alice, CreateSpec(base_model=base, lora=LoraSpec(rank=4, train_unembed=True),
                                                    seed=1))
    assert sess.lora.target_modules[-1] == "lm_head"
    with sess.use() as model:
        embeddings = model.model.embed_tokens.weight.detach().clone()
    gen = torch.Generator().manual_seed(8)
    manager.forward(api_env.alice, sess.id, 0, [sft_datum(random_tokens(gen, 20))], "", {}, backward=True)
    manager.optim_step(api_env.alice, sess.id, 0, ADAM)
    with sess.use() as model:
        assert torch.equal(model.model.embed_tokens.weight, embeddings)
        assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    data = [sft_datum(random_tokens(gen, n)) for n in (9, 26)]
    outputs, _ = manager.forward(api_env.alice, sess.id, 0, data, "", {}, backward=True)
    want_outputs, _, want_grads = _reference(sess, data, "cross_entropy", {})
    for got, want in zip(outputs, want_outputs):
        assert (got - want).abs().max().item() <= 1e-5
    for got, want in zip(grads(sess), want_grads):
        assert (got - want).abs().max().item() <= 1e-4 * want.abs().max().item()
