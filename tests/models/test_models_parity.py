"""Numerical parity with transformers' *ForCausalLM (the named reference) for Llama, Qwen2 and Qwen3.

Tolerance (float32, CPU): logits max abs diff <= 1e-5, loss abs diff <= 1e-6, every parameter gradient within
1e-5 of the reference relative to that gradient's largest entry.
"""
# Shapes: B batch, T tokens, V vocab.

import json

import pytest
import torch
import torch.nn.functional as F
import transformers
from safetensors.torch import load_file, save_file

from models import ModelArgs, load_pretrained, save_pretrained

FAMILIES = ["llama", "qwen2", "qwen3"]
LOGITS_ATOL = 1e-5
GRAD_RTOL = 1e-5


def _batch(vocab_size: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab_size, (3, 19), generator=torch.Generator().manual_seed(seed))


def _loss(logits_BTV: torch.Tensor, ids_BT: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits_BTV[:, :-1].reshape(-1, logits_BTV.shape[-1]), ids_BT[:, 1:].reshape(-1))


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_loss_and_grads_match_transformers(family, hf_model_dirs):
    path, hf = hf_model_dirs[family]
    ours = load_pretrained(path)
    ids = _batch(hf.config.vocab_size)

    hf.zero_grad()
    hf_out = hf(ids, labels=ids)
    hf_out.loss.backward()
    logits = ours(ids)
    loss = _loss(logits, ids)
    loss.backward()

    diff = (logits - hf_out.logits).abs().max().item()
    hf_params = dict(hf.named_parameters())
    our_params = dict(ours.named_parameters())
    assert our_params.keys() == hf_params.keys()
    grad_rel = {
        name: ((param.grad - hf_params[name].grad).abs().max() / hf_params[name].grad.abs().max()).item()
        for name, param in our_params.items()
    }
    print(
        f"{family}: logits max abs diff {diff:.3g}, loss diff {abs(loss.item() - hf_out.loss.item()):.3g}, "
        f"worst relative grad diff {max(grad_rel.values()):.3g}"
    )
    assert diff <= LOGITS_ATOL
    assert abs(loss.item() - hf_out.loss.item()) <= 1e-6
    for name, rel in grad_rel.items():
        assert rel <= GRAD_RTOL, f"{name}: relative grad diff {rel:.3g}"


@pytest.mark.parametrize("family", FAMILIES)
def test_save_pretrained_loads_in_transformers(family, hf_model_dirs, tmp_path):
    path, _ = hf_model_dirs[family]
    ours = load_pretrained(path)
    save_pretrained(ours, tmp_path)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    assert type(reloaded).__name__ == ours.args.architecture
    ids = _batch(ours.args.vocab_size, seed=2)
    with torch.no_grad():
        diff = (reloaded(ids).logits - ours(ids)).abs().max().item()
    assert diff <= LOGITS_ATOL
    assert ModelArgs.from_hf_config(json.loads((tmp_path / "config.json").read_text())) == ours.args


def test_load_sharded_checkpoint(hf_model_dirs, tmp_path):
    _, hf = hf_model_dirs["qwen3"]
    hf.save_pretrained(tmp_path, max_shard_size="50KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    ours = load_pretrained(tmp_path)
    ids = _batch(hf.config.vocab_size, seed=3)
    with torch.no_grad():
        assert (ours(ids) - hf(ids).logits).abs().max().item() <= LOGITS_ATOL


def test_right_padding_needs_no_mask(hf_model_dirs):
    ours = load_pretrained(hf_model_dirs["qwen2"][0])
    ids = _batch(ours.args.vocab_size, seed=4)
    padded = ids.clone()
    padded[1, 11:] = 0
    with torch.no_grad():
        full, short = ours(padded), ours(ids[1:2, :11])
    torch.testing.assert_close(full[1, :11], short[0], atol=LOGITS_ATOL, rtol=0)


def test_load_in_bf16_matches_transformers_bf16(hf_model_dirs):
    path, _ = hf_model_dirs["qwen3"]
    ours = load_pretrained(path, dtype=torch.bfloat16)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    ids = _batch(ours.args.vocab_size, seed=5)
    with torch.no_grad():
        ref = hf(ids).logits.float()
        diff = (ours(ids).float() - ref).abs().max().item()
    assert ours.model.embed_tokens.weight.dtype == torch.bfloat16
    assert diff <= 0.05 * ref.abs().max().item()  # bf16 rounding only; kernels may differ in accumulation order


def _copy_with_state(src, dst, edit):
    dst.mkdir()
    (dst / "config.json").write_text((src / "config.json").read_text())
    state = load_file(src / "model.safetensors")
    edit(state)
    save_file(state, dst / "model.safetensors")


def test_missing_and_unexpected_keys_are_named(hf_model_dirs, tmp_path):
    path, _ = hf_model_dirs["llama"]
    _copy_with_state(path, tmp_path / "missing", lambda s: s.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(ValueError, match=r"missing keys \[model\.layers\.1\.mlp\.up_proj\.weight\]"):
        load_pretrained(tmp_path / "missing")
    _copy_with_state(path, tmp_path / "extra", lambda s: s.update({"model.layers.9.foo": torch.zeros(1)}))
    with pytest.raises(ValueError, match=r"unexpected keys \[model\.layers\.9\.foo\]"):
        load_pretrained(tmp_path / "extra")
    _copy_with_state(path, tmp_path / "shape", lambda s: s.update({"model.norm.weight": torch.zeros(3)}))
    with pytest.raises(ValueError, match=r"model\.norm\.weight: checkpoint \(3,\) vs model \(64,\)"):
        load_pretrained(tmp_path / "shape")


def test_unsupported_architecture_is_named():
    with pytest.raises(ValueError, match="Unsupported architecture 'GPT2LMHeadModel'.*LlamaForCausalLM"):
        ModelArgs.from_hf_config({"architectures": ["GPT2LMHeadModel"]})
    config = {
        "architectures": ["Qwen2ForCausalLM"], "use_sliding_window": True, "vocab_size": 8, "hidden_size": 8,
        "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 1,
    }
    with pytest.raises(ValueError, match="use_sliding_window"):
        ModelArgs.from_hf_config(config)
    config = {**config, "use_sliding_window": False, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}
    with pytest.raises(ValueError, match="Unsupported rope type 'yarn'"):
        ModelArgs.from_hf_config(config)


def test_transformers5_rope_parameters_format():
    config = {
        "architectures": ["LlamaForCausalLM"], "vocab_size": 8, "hidden_size": 8, "intermediate_size": 8,
        "num_hidden_layers": 1, "num_attention_heads": 1, "max_position_embeddings": 64,
        "rope_parameters": {
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 16,
        },
    }
    args = ModelArgs.from_hf_config(config)
    assert args.rope_theta == 500000.0
    assert args.rope_scaling == {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16,
    }
