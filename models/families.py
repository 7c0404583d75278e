"""Model families: which folder of models/ implements a Hugging Face architecture.

Each family package exports ModelArgs (from_hf_config / to_hf_config), CausalLM and state_dict_adapter (from_hf,
to_hf, expected_keys). They are imported on first use, so loading a dense model never imports MoE code.
"""

import importlib
from types import ModuleType

FAMILIES: dict[str, tuple[str, ...]] = {
    "models.llama": ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"),
    "models.qwen3_moe": ("Qwen3MoeForCausalLM",),
    "models.deepseek_v3": ("DeepseekV3ForCausalLM",),
}
ARCHITECTURES = {arch: module for module, archs in FAMILIES.items() for arch in archs}


def family_for_config(config: dict) -> ModuleType:
    """The family package for a config.json dict; ValueError naming the architectures we support otherwise."""
    architectures = config.get("architectures") or []
    if len(architectures) != 1:
        raise ValueError(f"config.json must name exactly one architecture in 'architectures', got {architectures!r}")
    return family_for_architecture(architectures[0])


def family_for_architecture(architecture: str) -> ModuleType:
    module = ARCHITECTURES.get(architecture)
    if module is None:
        raise ValueError(f"Unsupported architecture {architecture!r}; supported: {', '.join(sorted(ARCHITECTURES))}")
    return importlib.import_module(module)
