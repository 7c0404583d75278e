"""Managed DPO (services/trainer/dpo.py) on the tiny model: the loss and its gradient against a naive float32
reference, the reference logprobs computed once and kept across a resume, learning a preference (LoRA and
full-parameter), and resuming bit for bit."""

import math

import pytest
import torch
import torch.nn.functional as F
from trainer_helpers import PAIRS, preference_row, write_jsonl

from models.chat import tokenize_sft_example
from models.lora import LoraConfig
from models.tokenizer import load_tokenizer
from services.common.blobstore import BlobStore
from services.common.methods.dpo import DpoHyperparams
from services.scheduler.planner import Planner
from services.trainer import dpo
from services.trainer.data import collate_pairs, tokenize_pairs
from services.trainer.engine import AdamW, TrainingEngine
from services.trainer.engine.checkpoint import STATE_DIR
from services.trainer.sft import SftCheckpoint

SMALL = dict(lora_rank=4, lora_alpha=8.0, max_seq_len=64, beta=0.5)
FULL_WEIGHTS = "model.safetensors"


@pytest.fixture
def pairs_dataset(tmp_path):
    """Ten preference rows: the right sum (chosen) over a fixed refusal (rejected)."""
    return write_jsonl(tmp_path / "pairs.jsonl", [preference_row(a, b) for a, b in PAIRS])


def dpo_run(make_run, **kwargs):
    return make_run(runner=dpo.run_dpo, **kwargs)


def naive_logprob(model, example) -> torch.Tensor:
    """The response's summed logprob the plain way: full float32 logits of the one sequence, log_softmax, gather,
    masked sum."""
    ids = torch.tensor([example.input_ids])
    logprobs = F.log_softmax(model(ids).float()[0, :-1], dim=-1).gather(1, ids[0, 1:, None])[:, 0]
    return (logprobs * torch.tensor(example.loss_mask[1:], dtype=torch.float32)).sum()


@pytest.mark.parametrize("full_parameter", [False, True], ids=["lora", "full"])
def test_loss_and_gradient_match_a_naive_float32_reference(tiny_model_dir, full_parameter):
    """Tolerance: the loss within 1e-5 (relative), every gradient element within rtol 1e-4 + atol 1e-4 x the
    largest element of its tensor: float32 rounding of a packed forward through the chunked logprob head against one
    unpacked full-logits forward per sequence (measured: at most ~2.4e-6 absolute, on an embedding row)."""
    tokenizer = load_tokenizer(tiny_model_dir)
    rows = [preference_row(2, 3), {"prompt": [{"role": "user", "content": "Say hello."}],
                                   "chosen": [{"role": "assistant", "content": "Hello there!"}],
                                   "rejected": [{"role": "assistant", "content": "No."}]},
            {"prompt": "Once upon a time", "chosen": " there was a cat.", "rejected": " it rained."}]
    pairs, skipped = tokenize_pairs(tokenizer, rows, 64)
    assert (len(pairs), skipped) == (3, 0)
    lora = None if full_parameter else LoraConfig(rank=4, alpha=8.0, target_modules=DpoHyperparams().target_modules)
    engine = TrainingEngine.load(tiny_model_dir, lora=lora, seed=0, optimizer=AdamW(learning_rate=1e-3))
    torch.manual_seed(1)
    with torch.no_grad():  # move off the starting point, so the policy differs from any trivial value
        for p in engine.params:
            p.add_(0.02 * torch.randn_like(p))
    beta, eps = 0.5, 0.1
    with torch.no_grad():
        naive_P2 = torch.stack([torch.stack([naive_logprob(engine.model, p.chosen), naive_logprob(engine.model,
                                                                                                   p.rejected)])
                                for p in pairs])
    reference_P2 = naive_P2 + torch.tensor([[0.3, -0.2], [-0.5, 0.1], [0.2, 0.4]])

    mb = collate_pairs(pairs)
    policy_S = engine.sequence_logprobs(mb.input_ids_BT, mb.targets_BT, packing=mb.packing)
    loss_P, chosen_P, rejected_P = dpo.dpo_losses(policy_S, reference_P2, beta=beta, label_smoothing=eps)
    loss_P.mean().backward()
    got = [p.grad.clone() for p in engine.params]
    for p in engine.params:
        p.grad = None

    naive_loss = torch.zeros(())
    for pair, (ref_c, ref_r) in zip(pairs, reference_P2):
        z = beta * ((naive_logprob(engine.model, pair.chosen) - ref_c) - (naive_logprob(engine.model, pair.rejected)
                                                                          - ref_r))
        naive_loss = naive_loss - (1 - eps) * torch.log(torch.sigmoid(z)) - eps * torch.log(torch.sigmoid(-z))
    (naive_loss / len(pairs)).backward()

    assert loss_P.mean().item() == pytest.approx(naive_loss.item() / len(pairs), rel=1e-5)
    torch.testing.assert_close(chosen_P - rejected_P, beta * ((naive_P2[:, 0] - reference_P2[:, 0])
                                                              - (naive_P2[:, 1] - reference_P2[:, 1])),
                               rtol=1e-5, atol=1e-5)
    assert any(g.abs().max() > 0 for g in got)
    for p, g in zip(engine.params, got):
        torch.testing.assert_close(g, p.grad, rtol=1e-4, atol=1e-4 * p.grad.abs().max().item())


def test_only_response_tokens_are_targets(tiny_model_dir):
    tokenizer = load_tokenizer(tiny_model_dir)
    (pair,), _ = tokenize_pairs(tokenizer, [{"prompt": "Once upon a time", "chosen": " a cat.", "rejected": " a"}],
                                64)
    prompt = tokenizer("Once upon a time")["input_ids"]
    for example, response in ((pair.chosen, " a cat."), (pair.rejected, " a")):
        assert example.input_ids[:len(prompt)] == prompt and not any(example.loss_mask[:len(prompt)])
        targets = [t for t, m in zip(example.input_ids, example.loss_mask) if m]
        assert targets == tokenizer(response, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    # A conversation: an assistant turn inside the prompt is context; only the response's turn is a target.
    prompt = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello, how can I help?"},
              {"role": "user", "content": "What is 2 plus 3?"}]
    (pair,), _ = tokenize_pairs(tokenizer, [{"prompt": prompt, "chosen": "It is 5.", "rejected": "No idea."}], 256)
    sft = tokenize_sft_example(tokenizer, {"messages": prompt + [{"role": "assistant", "content": "It is 5."}]}, 256)
    assert pair.chosen.input_ids == sft.input_ids
    last_turn = max(i for i, m in enumerate(sft.loss_mask) if m and not sft.loss_mask[i - 1])  # its first target
    assert pair.chosen.loss_mask == [0] * last_turn + sft.loss_mask[last_turn:]
    assert 0 < sum(pair.chosen.loss_mask) < sum(sft.loss_mask)


@pytest.mark.parametrize("full_parameter, lr", [(False, 2e-3), (True, 1e-4)], ids=["lora", "full"])
def test_a_preference_is_learned(tiny_model_dir, pairs_dataset, tmp_path, make_run, full_parameter, lr):
    hp = DpoHyperparams(**SMALL, full_parameter=full_parameter, learning_rate=lr, max_steps=8, batch_size=4,
                        eval_fraction=0.2, checkpoint_every=4, lr_scheduler="constant")
    hooks = dpo_run(make_run)
    outcome = hooks.run(tiny_model_dir, pairs_dataset, hp, base_model_name="tiny-base", work_dir=tmp_path / "work")
    assert (outcome.step, outcome.stopped) == (8, False)
    assert hooks.info["train pairs"] == 8 and hooks.info["eval pairs"] == 2
    assert hooks.info["mode"] == ("full-parameter" if full_parameter else "LoRA")
    first, last = hooks.metrics[1], hooks.metrics[8]
    print(f"{'full' if full_parameter else 'lora'}: train loss {first['train/loss']:.4f} -> {last['train/loss']:.4f}, "
          f"eval margin {hooks.metrics[4]['eval/reward_margin']:+.3f} -> {last['eval/reward_margin']:+.3f}, "
          f"eval accuracy {last['eval/reward_accuracy']:.2f}")
    assert {"train/loss", "train/reward_margin", "train/reward_accuracy", "train/chosen_reward",
            "train/rejected_reward", "train/lr", "train/grad_norm", "train/pairs", "train/epoch"} <= first.keys()
    assert sorted(k for k in hooks.metrics[4] if k.startswith("eval/")) == [
        "eval/chosen_reward", "eval/loss", "eval/rejected_reward", "eval/reward_accuracy", "eval/reward_margin"]
    if not full_parameter:  # a zero-initialized adapter is the reference: margin 0, loss log 2 at step 1
        assert first["train/loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert last["train/loss"] < 0.5 * math.log(2)
    assert last["train/reward_margin"] > 0 and last["train/reward_accuracy"] == 1.0
    # before training the policy is the reference: every held-out margin 0, accuracy 0 (a tie is not a win)
    assert last["eval/reward_margin"] > 0 and hooks.metrics[4]["eval/reward_margin"] > 0
    assert last["eval/reward_accuracy"] == 1.0
    files = sorted(p.name for p in hooks.checkpoints[-1][0].weights_dir.iterdir())
    assert (FULL_WEIGHTS in files) == full_parameter and ("adapter_model.safetensors" in files) != full_parameter


@pytest.mark.parametrize("full_parameter", [False, True], ids=["lora", "full"])
def test_resume_is_bitwise_identical_and_reuses_the_reference(tiny_model_dir, pairs_dataset, make_run, tmp_path,
                                                              deterministic, monkeypatch, full_parameter):
    passes = []
    real = dpo.reference_logprobs

    def counting(engine, pairs, batch_size, **kwargs):
        passes.append(len(pairs))
        return real(engine, pairs, batch_size, **kwargs)

    monkeypatch.setattr(dpo, "reference_logprobs", counting)
    hp = DpoHyperparams(**SMALL, full_parameter=full_parameter, lora_dropout=0.1, learning_rate=1e-3, max_steps=4,
                        batch_size=2, gradient_accumulation_steps=2, eval_fraction=0.2, warmup_steps=1,
                        checkpoint_every=2)
    straight = dpo_run(make_run)
    straight.run(tiny_model_dir, pairs_dataset, hp, work_dir=tmp_path / "a")
    assert passes == [8, 2]  # one pass over the train pairs and one over the held-out ones
    assert [(c.step, final) for c, final, _ in straight.checkpoints] == [(2, False), (4, True)]

    interrupted = dpo_run(make_run, stop_after_step=2)
    interrupted.run(tiny_model_dir, pairs_dataset, hp, work_dir=tmp_path / "b")
    assert passes == [8, 2] * 2
    ckpt = interrupted.checkpoints[0][0]
    cached = torch.load(ckpt.state_dir / dpo.REFERENCE_FILE)
    straight_cached = torch.load(straight.checkpoints[0][0].state_dir / dpo.REFERENCE_FILE)
    assert cached.keys() == {"train", "eval"} and all(torch.equal(cached[k], straight_cached[k]) for k in cached)

    resumed = dpo_run(make_run)
    outcome = resumed.run(tiny_model_dir, pairs_dataset, hp, resume=ckpt, work_dir=tmp_path / "c")
    assert passes == [8, 2] * 2  # nothing recomputed: the checkpoint's reference logprobs were read
    assert (outcome.step, outcome.stopped) == (4, False)
    assert sorted(resumed.metrics) == [3, 4]
    for step in (3, 4):
        assert resumed.metrics[step] == straight.metrics[step]
    name = FULL_WEIGHTS if full_parameter else "adapter_model.safetensors"
    expected, got = straight.final_weights(name), resumed.final_weights(name)
    assert expected.keys() == got.keys()
    assert all(torch.equal(got[k], expected[k]) for k in expected)


def test_a_checkpoint_must_fit_the_run(tiny_model_dir, pairs_dataset, make_run, tmp_path):
    hp = DpoHyperparams(**SMALL, max_steps=1, batch_size=4, eval_fraction=0.2)
    first = dpo_run(make_run)
    first.run(tiny_model_dir, pairs_dataset, hp, work_dir=tmp_path / "a")
    ckpt = first.checkpoints[-1][0]
    with pytest.raises(ValueError, match="is a LoRA one; this run is full-parameter"):
        dpo_run(make_run).run(tiny_model_dir, pairs_dataset, DpoHyperparams(**SMALL, max_steps=2, full_parameter=True,
                                                                           eval_fraction=0.2),
                              resume=ckpt, work_dir=tmp_path / "b")
    (ckpt.state_dir / dpo.REFERENCE_FILE).unlink()
    with pytest.raises(ValueError, match="no readable DPO reference logprobs"):
        dpo_run(make_run).run(tiny_model_dir, pairs_dataset, hp, resume=SftCheckpoint(1, ckpt.root),
                              work_dir=tmp_path / "c")
    assert not (ckpt.root / STATE_DIR / dpo.REFERENCE_FILE).exists()


def test_the_plan_is_what_the_run_does(tiny_model_dir, pairs_dataset, tmp_path, make_run):
    """PlanJob's numbers for a DPO job (the scheduler's planner process) against the run: pairs split, steps,
    checkpoints, eval passes and the trainable count, LoRA and full-parameter."""
    blobs = BlobStore(tmp_path / "blobs")
    planner = Planner(blobs)
    sha256, _ = blobs.put_file(pairs_dataset)
    try:
        for full_parameter in (False, True):
            hp = DpoHyperparams(**SMALL, full_parameter=full_parameter, epochs=2, batch_size=3, eval_fraction=0.2,
                                checkpoint_every=2)
            planned = planner.plan("dpo", str(tiny_model_dir), sha256, hp.to_json())
            hooks = dpo_run(make_run)
            hooks.run(tiny_model_dir, pairs_dataset, hp, work_dir=tmp_path / f"work-{full_parameter}")
            evals = sum("eval/loss" in m for m in hooks.metrics.values())
            assert (planned["dataset_rows"], planned["train_rows"], planned["eval_rows"], planned["skipped_rows"]) == \
                (10, hooks.info["train pairs"], hooks.info["eval pairs"], 0)
            assert (planned["total_steps"], planned["steps_per_epoch"], planned["checkpoints"],
                    planned["eval_passes"]) == (hooks.total_steps, 3, len(hooks.checkpoints), evals) == (6, 3, 3, 3)
            assert planned["trainable_parameters"] == hooks.info["trainable params"]
            memory = planned["memory"]
            assert memory["gradient_bytes"] == 4 * planned["trainable_parameters"]
            if full_parameter:
                assert planned["trainable_parameters"] == planned["base_parameters"]
                assert (memory["weights_dtype"], memory["trainable_bytes"]) == ("float32", 0)
            else:
                assert 0 < planned["trainable_parameters"] < planned["base_parameters"]
    finally:
        planner.close()


@pytest.mark.parametrize("stop_at_call, completed_steps", [(1, 0), (3, 0), (4, 0), (5, 1)])
def test_stop_is_checked_in_the_reference_pass_and_before_every_micro_batch(tiny_model_dir, pairs_dataset, make_run,
                                                                            tmp_path, stop_at_call, completed_steps):
    """8 train pairs and 2 held out, 4 pairs per micro-batch and per step: checks 1-2 are before the train pairs'
    reference micro-batches, 3 before the held-out pairs', 4 before step 1's micro-batch, 5 before step 2's."""
    hp = DpoHyperparams(**SMALL, max_steps=2, batch_size=4, eval_fraction=0.2, checkpoint_every=1)
    hooks = dpo_run(make_run, stop_at_call=stop_at_call)
    outcome = hooks.run(tiny_model_dir, pairs_dataset, hp, work_dir=tmp_path / "work")
    assert (outcome.step, outcome.stopped) == (completed_steps, True)
    assert hooks.stop_calls == stop_at_call
    assert sorted(hooks.metrics) == list(range(1, completed_steps + 1))
    assert [c.step for c, _, _ in hooks.checkpoints] == list(range(1, completed_steps + 1))
    assert (hooks.total_steps is not None) == (stop_at_call >= 4)  # Started only once the reference is in


def test_grad_accumulation_equals_one_big_batch(tiny_model_dir, pairs_dataset, make_run, tmp_path):
    """A step's loss is the mean over its pairs however its micro-batches split them. Tolerance: float32 rounding of
    sequence logprobs summed in other packings (about 1e-5 of a margin, whose size is beta x a logprob change); a
    small lr, as in SFT's test, keeps Adam from magnifying gradient rounding into the weights."""
    metrics, adapters = [], []
    for batch_size, accum in ((4, 1), (2, 2), (1, 4)):
        hp = DpoHyperparams(**SMALL, learning_rate=3e-5, max_steps=2, batch_size=batch_size,
                            gradient_accumulation_steps=accum, eval_fraction=0.2, checkpoint_every=100)
        hooks = dpo_run(make_run)
        hooks.run(tiny_model_dir, pairs_dataset, hp, work_dir=tmp_path / f"work-{batch_size}")
        metrics.append(hooks.metrics)
        adapters.append(hooks.final_adapter())
    for other in (1, 2):
        for step in (1, 2):
            for key in ("train/loss", "train/reward_margin", "train/grad_norm", "train/pairs"):
                assert metrics[other][step][key] == pytest.approx(metrics[0][step][key], rel=1e-5, abs=1e-5), key
        for key in adapters[0]:
            torch.testing.assert_close(adapters[other][key], adapters[0][key], rtol=0, atol=1e-6)
