"""LoRA target names without torch (models/lora_targets.py): each family's ModelArgs.lora_module_names() equals the
module names of the model built from the same config (on the meta device), for the tiny model of every family and
every published large config in models/configs/; the torch-free check agrees with apply_lora's."""
from pathlib import Path

import pytest

from models.checkpoint import build_on_meta
from models.model_dir import read_config
from models.lora import _linears, check_targets
from models.lora_targets import check_targets_for_config
from models.moe import Experts
from models.tiny import build_tiny_model

CONFIG_DIRS = sorted(p for p in (Path(__file__).resolve().parents[2] / "models" / "configs").iterdir() if p.is_dir())


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    return [build_tiny_model(tmp_path_factory.mktemp(f), family=f) for f in ("qwen3", "qwen3_moe", "deepseek_v3")]


def _all_dirs(tiny_dirs):
    return [*tiny_dirs, *CONFIG_DIRS]


def test_config_names_equal_the_built_models(tiny_dirs):
    assert len(CONFIG_DIRS) >= 5
    for model_dir in _all_dirs(tiny_dirs):
        model = build_on_meta(model_dir)
        linears, tied = _linears(model)
        experts = [n for n, m in model.named_modules() if isinstance(m, Experts)]
        names = model.args.lora_module_names()
        assert (names.linears, names.tied, names.experts) == (list(linears), tied, experts), model_dir.name


@pytest.mark.parametrize("targets", [("q_proj",), ("q_a_proj", "experts"), ("experts.down_proj",), ("lm_head",),
                                     ("down_proj", "shared_experts.up_proj"), ("nope",), ("q_proj", "nope")])
def test_the_torch_free_check_agrees_with_apply_lora(tiny_dirs, targets):
    for model_dir in _all_dirs(tiny_dirs):
        def outcome(check):
            try:
                check()
                return None
            except ValueError as exc:
                return str(exc)
        want = outcome(lambda: check_targets(build_on_meta(model_dir), targets))
        got = outcome(lambda: check_targets_for_config(read_config(model_dir), targets))
        assert got == want, (model_dir.name, targets)
