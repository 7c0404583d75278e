"""Real shapes: the shipped architecture configs build on the meta device and count exactly as transformers does.

Reference counts: transformers 5.24 `AutoModelForCausalLM.from_config` on the meta device (models/configs/README.md
gives provenance and the published figures they round to).
"""

import pytest
import torch

from models.shapes import CONFIGS_DIR, count_parameters, load_config

EXPECTED = {  # total, active per token
    "deepseek-v3": (671_026_404_352, 37_552_282_624),  # published 671B / 37B
    "kimi-k2-instruct": (1_026_408_209_408, 32_861_477_888),  # published 1T / 32B
    "kimi-k2.5-text": (1_026_408_209_408, 32_861_477_888),
    "qwen3-235b-a22b": (235_093_634_560, 22_190_763_520),  # published 235B / 22B
    "qwen3-30b-a3b": (30_532_122_624, 3_353_032_704),  # published 30.5B / 3.3B
    "qwen3-8b": (8_190_735_360, 8_190_735_360),  # published 8.2B
    "llama-3.3-70b-instruct": (70_553_706_496, 70_553_706_496),  # published 70B
}


def test_every_shipped_config_is_covered():
    assert {d.name for d in CONFIGS_DIR.iterdir() if d.is_dir()} == set(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_meta_device_counts_match(name):
    count = count_parameters(load_config(name))
    assert (count.total, count.active) == EXPECTED[name]
    assert sum(count.by_group.values()) == count.total
    assert len(count.by_layer) == load_config(name)["num_hidden_layers"]


def test_counts_match_transformers_module_by_module():
    """Per group, for the MLA + MoE family: our modules hold exactly transformers' parameters."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = load_config("deepseek-v3")
    ours = count_parameters(config)
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config))
    hf_experts = sum(p.numel() for n, p in hf.named_parameters() if ".mlp.experts." in n)
    hf_attention = sum(p.numel() for n, p in hf.named_parameters() if ".self_attn." in n)
    assert ours.by_group["routed experts"] == hf_experts
    assert ours.by_group["attention"] == hf_attention


def test_unknown_config_name_lists_the_shipped_ones():
    with pytest.raises(ValueError, match="deepseek-v3"):
        load_config("not-a-model")
