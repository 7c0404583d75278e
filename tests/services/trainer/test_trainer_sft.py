"""The managed LoRA SFT loop (services/trainer/sft.py) on the tiny model: learning, metrics, checkpoints, resume."""

import json
import math
import shutil

import peft
import pytest
import torch
import transformers
from trainer_helpers import PAIRS, chat_row, write_jsonl

from services.trainer.schedule import lr_multiplier
from services.trainer.sft import SftCheckpoint
from services.common.methods.sft import SftHyperparams

SMALL = dict(lora_rank=4, lora_alpha=8.0, max_seq_len=64, learning_rate=2e-3)


def test_loss_goes_down_on_a_memorization_set(tiny_model_dir, tmp_path, make_run):
    dataset = write_jsonl(tmp_path / "memo.jsonl", [chat_row(a, b) for a, b in PAIRS[:8]])
    hp = SftHyperparams(lora_rank=8, lora_alpha=16.0, learning_rate=3e-3, max_steps=60, batch_size=8,
                        eval_fraction=0.0, checkpoint_every=1000)
    hooks = make_run()
    outcome = hooks.run(tiny_model_dir, dataset, hp, work_dir=tmp_path / "work")
    losses = hooks.losses()
    print(f"memorization: train loss {losses[1]:.4f} at step 1 -> {losses[60]:.4f} at step 60")
    assert (outcome.step, outcome.stopped) == (60, False)
    assert losses[60] < 0.3 * losses[1]
    assert outcome.metrics["train/loss"] == losses[60]


@pytest.mark.parametrize("eval_every, eval_steps", [(0, [2, 4, 5]), (3, [3, 5])])
def test_eval_and_checkpoint_cadence(tiny_model_dir, chat_dataset, tmp_path, make_run, eval_every, eval_steps):
    hp = SftHyperparams(**SMALL, max_steps=5, batch_size=2, eval_fraction=0.2, checkpoint_every=2,
                        eval_every=eval_every)
    hooks = make_run()
    work = tmp_path / "work"
    outcome = hooks.run(tiny_model_dir, chat_dataset, hp, base_model_name="tiny-base", work_dir=work)

    assert hooks.total_steps == 5
    assert hooks.info == {"train examples": 8, "eval examples": 2, "trainable params": hooks.info["trainable params"]}
    assert hooks.info["trainable params"] > 0
    assert sorted(hooks.metrics) == [1, 2, 3, 4, 5]
    for metrics in hooks.metrics.values():
        assert {"train/loss", "train/lr", "train/grad_norm", "train/tokens", "train/epoch"} <= metrics.keys()
    assert sorted(hooks.losses("eval/loss")) == eval_steps
    assert all(math.isfinite(v) and v > 0 for v in hooks.losses("eval/loss").values())
    assert outcome.metrics["eval/loss"] == hooks.metrics[5]["eval/loss"]

    assert [(c.step, final) for c, final, _ in hooks.checkpoints] == [(2, False), (4, False), (5, True)]
    for ckpt, _, metrics in hooks.checkpoints:
        assert sorted(p.name for p in ckpt.weights_dir.iterdir()) == ["adapter_config.json",
                                                                    "adapter_model.safetensors"]
        assert sorted(p.name for p in ckpt.state_dir.iterdir()) == ["engine_state.json", "optimizer.pt", "rng.pt"]
        state = json.loads((ckpt.state_dir / "engine_state.json").read_text())
        assert state["optim_steps"] == ckpt.step and state["base_model"] == "tiny-base"
        assert state["lora"] == {"rank": 4, "alpha": 8.0, "dropout": 0.0, "target_modules": list(hp.target_modules)}
        progress = state["progress"]
        assert (progress["step"], progress["total_steps"], progress["train_examples"]) == (ckpt.step, 5, 8)
        assert metrics == hooks.metrics[ckpt.step] == progress["metrics"]
        config = json.loads((ckpt.weights_dir / "adapter_config.json").read_text())
        assert (config["r"], config["base_model_name_or_path"]) == (4, "tiny-base")
    assert not any((work / "checkpoints").iterdir())  # handed to the hook, then removed


def test_epochs_define_the_steps_and_the_schedule_sets_the_lr(tiny_model_dir, tmp_path, make_run):
    long_row = {"prompt": "The quick brown fox jumps over the lazy dog. " * 20, "completion": "Yes."}
    dataset = write_jsonl(tmp_path / "d.jsonl", [chat_row(a, b) for a, b in PAIRS] + [long_row])
    hp = SftHyperparams(**SMALL, epochs=2, batch_size=3, eval_fraction=0.2, warmup_steps=2,
                        lr_scheduler="cosine", checkpoint_every=100)
    hooks = make_run()
    hooks.run(tiny_model_dir, dataset, hp, work_dir=tmp_path / "work")

    assert ("warning", "skipped 1 of 11 rows with no assistant/completion token within max_seq_len=64") in hooks.logs
    assert hooks.total_steps == 6  # 8 train examples in steps of 3: 3 steps per epoch
    assert [m["train/lr"] for m in hooks.metrics.values()] == [
        hp.learning_rate * lr_multiplier(s, kind="cosine", warmup_steps=2, total_steps=6) for s in range(6)
    ]
    assert [m["train/epoch"] for m in hooks.metrics.values()] == [1 / 3, 2 / 3, 1.0, 4 / 3, 5 / 3, 2.0]
    tokens = [m["train/tokens"] for m in hooks.metrics.values()]
    assert sum(tokens[:3]) == sum(tokens[3:])  # each epoch sees every train example once


def test_grad_accumulation_equals_one_big_batch(tiny_model_dir, make_run, tmp_path):
    # Replies of different lengths, so weighting micro-batches equally instead of by target tokens would show.
    rows = [chat_row(a, b) for a, b in PAIRS[:4]] + [
        {"prompt": f"What is {a} plus {b}?", "completion": " The answer is " + "very " * (a + b) + "clear."}
        for a, b in PAIRS[4:]
    ]
    dataset = write_jsonl(tmp_path / "varied.jsonl", rows)
    # A small lr: Adam divides each element by its own gradient magnitude, so an element whose gradient is ~eps
    # turns float-rounding noise into an update difference proportional to the lr (about 1e-6 at lr 1e-4 for
    # some seeds). The loss and grad-norm checks below are the sharp test of the accumulation arithmetic.
    adapters, metrics = [], []
    for batch_size, accum in ((4, 1), (2, 2)):
        hp = SftHyperparams(**{**SMALL, "learning_rate": 3e-5}, max_steps=3, batch_size=batch_size,
                            gradient_accumulation_steps=accum, eval_fraction=0.2, checkpoint_every=100)
        hooks = make_run()
        hooks.run(tiny_model_dir, dataset, hp, work_dir=tmp_path / f"work-{batch_size}")
        adapters.append(hooks.final_adapter())
        metrics.append(hooks.metrics)
    for step in (1, 2, 3):
        for key in ("train/loss", "train/grad_norm", "train/tokens"):
            assert metrics[1][step][key] == pytest.approx(metrics[0][step][key], rel=1e-6)
    assert adapters[0].keys() == adapters[1].keys()
    for key in adapters[0]:
        torch.testing.assert_close(adapters[1][key], adapters[0][key], rtol=0, atol=1e-6)


RESUME_HP = SftHyperparams(**SMALL, lora_dropout=0.1, max_steps=6, batch_size=2, gradient_accumulation_steps=2,
                           eval_fraction=0.2, warmup_steps=2, checkpoint_every=3)


def test_resume_is_bitwise_identical_to_an_uninterrupted_run(
    tiny_model_dir, chat_dataset, make_run, tmp_path, deterministic
):
    straight = make_run()
    straight.run(tiny_model_dir, chat_dataset, RESUME_HP, work_dir=tmp_path / "a")
    assert [(c.step, final) for c, final, _ in straight.checkpoints] == [(3, False), (6, True)]

    interrupted = make_run(stop_after_step=3)
    outcome = interrupted.run(tiny_model_dir, chat_dataset, RESUME_HP, work_dir=tmp_path / "b")
    assert (outcome.step, outcome.stopped) == (3, True)
    assert [(c.step, final) for c, final, _ in interrupted.checkpoints] == [(3, False)]

    # Resume (a fresh model each time) from the stopped run's checkpoint and from the straight run's step-3 one.
    for ckpt in (interrupted.checkpoints[0][0], straight.checkpoints[0][0]):
        resumed = make_run()
        outcome = resumed.run(tiny_model_dir, chat_dataset, RESUME_HP, resume=ckpt, work_dir=tmp_path / "c")
        assert (outcome.step, outcome.stopped) == (6, False)
        assert ("info", "resumed at step 3 of 6") in resumed.logs
        assert sorted(resumed.metrics) == [4, 5, 6]
        for step in (4, 5, 6):
            assert resumed.metrics[step] == straight.metrics[step]  # losses, grad norms, lr, eval loss: exact
        expected, got = straight.final_adapter(), resumed.final_adapter()
        assert expected.keys() == got.keys()
        assert all(torch.equal(got[k], expected[k]) for k in expected)


def test_resuming_a_final_checkpoint_finishes_without_training(tiny_model_dir, chat_dataset, make_run, tmp_path):
    hp = SftHyperparams(**SMALL, max_steps=2, batch_size=4, eval_fraction=0.2)
    first = make_run()
    first.run(tiny_model_dir, chat_dataset, hp, work_dir=tmp_path / "a")
    again = make_run()
    outcome = again.run(tiny_model_dir, chat_dataset, hp, resume=first.checkpoints[-1][0],
                      work_dir=tmp_path / "b")
    assert (outcome.step, outcome.stopped) == (2, False)
    assert again.metrics == {2: {"eval/loss": first.metrics[2]["eval/loss"]}}
    assert [(c.step, final) for c, final, _ in again.checkpoints] == [(2, True)]
    assert all(torch.equal(again.final_adapter()[k], v) for k, v in first.final_adapter().items())


def test_a_checkpoint_without_state_cannot_be_resumed(tiny_model_dir, chat_dataset, make_run, tmp_path):
    hp = SftHyperparams(**SMALL, max_steps=1, batch_size=4)
    first = make_run()
    first.run(tiny_model_dir, chat_dataset, hp, work_dir=tmp_path / "a")
    adapter_only = SftCheckpoint(step=1, root=tmp_path / "adapter-only")
    shutil.copytree(first.checkpoints[0][0].weights_dir, adapter_only.weights_dir)
    with pytest.raises(ValueError, match="cannot be resumed: not a training state"):
        make_run().run(tiny_model_dir, chat_dataset, hp, resume=adapter_only, work_dir=tmp_path / "b")


@pytest.mark.parametrize("stop_at_call, completed_steps", [(1, 0), (4, 1)])
def test_stop_is_checked_before_every_micro_batch(
    tiny_model_dir, chat_dataset, make_run, tmp_path, stop_at_call, completed_steps
):
    hp = SftHyperparams(**SMALL, max_steps=5, batch_size=2, gradient_accumulation_steps=2, checkpoint_every=1)
    hooks = make_run(stop_at_call=stop_at_call)
    outcome = hooks.run(tiny_model_dir, chat_dataset, hp, work_dir=tmp_path / "work")
    assert (outcome.step, outcome.stopped) == (completed_steps, True)
    assert hooks.stop_calls == stop_at_call  # call 4 is the second micro-batch of step 2
    assert sorted(hooks.metrics) == list(range(1, completed_steps + 1))
    assert all(not final for _, final, _ in hooks.checkpoints)
    assert [c.step for c, _, _ in hooks.checkpoints] == list(range(1, completed_steps + 1))


def test_final_adapter_loads_with_peft(tiny_model_dir, chat_dataset, make_run, tmp_path):
    hp = SftHyperparams(**SMALL, max_steps=2, batch_size=4, target_modules=("q_proj", "v_proj"))
    hooks = make_run()
    hooks.run(tiny_model_dir, chat_dataset, hp, base_model_name="tiny-base", work_dir=tmp_path / "work")
    adapter_dir = hooks.checkpoints[-1][0].weights_dir
    base = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    model = peft.PeftModel.from_pretrained(base, adapter_dir)
    config = model.peft_config["default"]
    assert (config.r, config.lora_alpha, sorted(config.target_modules)) == (4, 8, ["q_proj", "v_proj"])
    layer = model.base_model.model.model.layers[0].self_attn.q_proj
    saved = hooks.final_adapter()
    torch.testing.assert_close(
        layer.lora_B["default"].weight, saved["base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"],
        rtol=0, atol=0,
    )
    assert layer.lora_A["default"].weight.shape == (4, base.config.hidden_size)


def test_no_trainable_examples_is_a_clear_error(tiny_model_dir, tmp_path, make_run):
    row = {"prompt": "Please write a short summary of the article in three sentences. " * 10, "completion": "Ok."}
    dataset = write_jsonl(tmp_path / "d.jsonl", [row] * 3)
    hp = SftHyperparams(**{**SMALL, "max_seq_len": 16})
    with pytest.raises(ValueError, match="None of the 3 dataset rows .* max_seq_len=16"):
        make_run().run(tiny_model_dir, dataset, hp, work_dir=tmp_path / "work")
