"""The locally built tiny model directory, and inspect_model_dir's checks of user-supplied directories."""

import hashlib
import json
import shutil
import sys

import pytest
import torch
import transformers

from models import ModelDirError, inspect_model_dir, load_pretrained
from models.tiny import build_tiny_model, main
from models.tokenizer import load_tokenizer


def _digests(path) -> dict[str, str]:
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(path.iterdir())}


def test_build_is_byte_reproducible(tiny_model_dir, tmp_path):
    again = build_tiny_model(tmp_path / "again")
    assert _digests(again) == _digests(tiny_model_dir)
    assert set(_digests(again)) == {
        "config.json", "generation_config.json", "model.safetensors", "special_tokens_map.json",
        "tokenizer.json", "tokenizer_config.json",
    }
    other_seed = build_tiny_model(tmp_path / "seed1", seed=1)
    assert _digests(other_seed)["model.safetensors"] != _digests(tiny_model_dir)["model.safetensors"]


def test_cli_builds_the_same_directory(tiny_model_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["models.tiny", str(tmp_path / "cli")])
    main()
    assert capsys.readouterr().out.strip() == str(tmp_path / "cli")
    assert _digests(tmp_path / "cli") == _digests(tiny_model_dir)


def test_tiny_model_shape_and_tokenizer(tiny_model_dir):
    config = json.loads((tiny_model_dir / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForCausalLM"]
    assert (config["hidden_size"], config["num_hidden_layers"], config["num_attention_heads"]) == (128, 4, 4)
    assert (config["num_key_value_heads"], config["head_dim"], config["intermediate_size"]) == (2, 32, 384)
    assert config["tie_word_embeddings"] is True and config["max_position_embeddings"] == 2048
    tokenizer = load_tokenizer(tiny_model_dir)
    assert len(tokenizer) == config["vocab_size"] == 1024
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token == "<|endoftext|>"
    text = "The assistant answers questions clearly."
    assert tokenizer.decode(tokenizer(text)["input_ids"]) == text
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    ours = load_pretrained(tiny_model_dir)
    ids = torch.tensor([tokenizer(text)["input_ids"]])
    with torch.no_grad():
        assert (ours(ids) - hf(ids).logits).abs().max().item() <= 1e-5


def test_inspect_model_dir_reads_headers_only(tiny_model_dir):
    info = inspect_model_dir(tiny_model_dir)
    model = load_pretrained(tiny_model_dir)
    assert info.num_parameters == sum(p.numel() for p in model.parameters())  # tied lm_head counted once
    assert (info.architecture, info.num_layers, info.hidden_size) == ("Qwen3ForCausalLM", 4, 128)
    assert (info.vocab_size, info.max_position_embeddings, info.torch_dtype) == (1024, 2048, "float32")


def test_inspect_model_dir_errors(tiny_model_dir, tmp_path):
    with pytest.raises(ModelDirError, match="does not exist"):
        inspect_model_dir(tmp_path / "nope")
    (tmp_path / "file").write_text("x")
    with pytest.raises(ModelDirError, match="is not a directory"):
        inspect_model_dir(tmp_path / "file")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelDirError, match="No config.json"):
        inspect_model_dir(tmp_path / "empty")

    broken = tmp_path / "broken"
    shutil.copytree(tiny_model_dir, broken)
    config_text = (broken / "config.json").read_text()
    (broken / "config.json").write_text("{not json")
    with pytest.raises(ModelDirError, match="Cannot read .*config.json"):
        inspect_model_dir(broken)
    config = json.loads(config_text)
    (broken / "config.json").write_text(json.dumps({**config, "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ModelDirError, match="Unsupported architecture 'GPT2LMHeadModel'"):
        inspect_model_dir(broken)
    (broken / "config.json").write_text(config_text)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (broken / name).unlink()
    with pytest.raises(ModelDirError, match="No tokenizer"):
        inspect_model_dir(broken)
    (broken / "model.safetensors").unlink()
    with pytest.raises(ModelDirError, match=r"No \*\.safetensors weights"):
        inspect_model_dir(broken)
    assert issubclass(ModelDirError, ValueError)
