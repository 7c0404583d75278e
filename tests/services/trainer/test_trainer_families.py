"""Managed LoRA SFT on the MoE families: the default adapter covers attention and every routed expert, the loss falls,
the saved adapter reloads onto the base model, and a resumed run matches an uninterrupted one bit for bit."""

import pytest
import torch
from safetensors.torch import load_file
from trainer_helpers import PAIRS, chat_row, write_jsonl

from models import load_pretrained
from models.lora import load_peft_adapter
from models.tiny import build_tiny_model
from models.tokenizer import load_tokenizer
from services.trainer.data import batches, load_sft_data
from services.trainer.engine.logprobs import target_nll_sum
from services.common.methods.sft import SftHyperparams

FAMILIES = ("qwen3_moe", "deepseek_v3")


@pytest.fixture(scope="module", params=FAMILIES)
def family_model(request, tmp_path_factory):
    return request.param, build_tiny_model(tmp_path_factory.mktemp(request.param), family=request.param)


def test_lora_sft_trains_attention_and_experts(family_model, tmp_path, make_run):
    family, model_dir = family_model
    data = write_jsonl(tmp_path / "d.jsonl", [chat_row(a, b) for a, b in PAIRS])
    hp = SftHyperparams.from_request({"max_steps": 30, "learning_rate": 5e-3, "batch_size": 10, "lora_rank": 8,
                                      "checkpoint_every": 30, "eval_fraction": 0.2})
    hooks = make_run()
    outcome = hooks.run(model_dir, data, hp, work_dir=tmp_path / "work")
    assert not outcome.stopped
    losses = [hooks.metrics[s]["train/loss"] for s in sorted(hooks.metrics)]
    assert losses[-1] < 0.5 * losses[0], (family, losses[0], losses[-1])
    _, final, _ = hooks.checkpoints[-1]
    assert final
    adapter = hooks.save_dir / "step-30-final" / "weights"
    keys = load_file(str(adapter / "adapter_model.safetensors"))
    assert any(".mlp.experts." in k for k in keys), "no expert LoRA in the adapter"
    assert any(".self_attn." in k for k in keys)
    # The saved adapter, loaded onto a fresh base, reproduces the trained model's final eval loss (1e-5).
    model = load_pretrained(model_dir)
    load_peft_adapter(model, adapter)
    data_split = load_sft_data(data, load_tokenizer(model_dir), max_seq_len=hp.max_seq_len,
                               eval_fraction=hp.eval_fraction, seed=hp.seed)
    with torch.no_grad():
        nll = sum(target_nll_sum(model, mb.input_ids_BT, mb.targets_BT, packing=mb.packing) for mb in batches(data_split.eval, 10))
    tokens = sum(mb.num_targets for mb in batches(data_split.eval, 10))
    assert abs(nll.item() / tokens - hooks.metrics[30]["eval/loss"]) < 1e-5


def test_resume_is_bitwise_on_moe(family_model, tmp_path, make_run, deterministic):
    family, model_dir = family_model
    data = write_jsonl(tmp_path / "d.jsonl", [chat_row(a, b) for a, b in PAIRS])
    hp = SftHyperparams.from_request({"max_steps": 6, "learning_rate": 5e-3, "batch_size": 4, "lora_rank": 4,
                                      "checkpoint_every": 3, "eval_fraction": 0.0})
    straight = make_run()
    straight.run(model_dir, data, hp, work_dir=tmp_path / "a")
    first = make_run(stop_after_step=3)
    first.run(model_dir, data, hp, work_dir=tmp_path / "b")
    resumed = make_run()
    resumed.run(model_dir, data, hp, resume=first.checkpoints[0][0], work_dir=tmp_path / "c")
    a = load_file(str(straight.save_dir / "step-6-final" / "weights" / "adapter_model.safetensors"))
    b = load_file(str(resumed.save_dir / "step-6-final" / "weights" / "adapter_model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), family
