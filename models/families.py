"""Model families: each is declared once here, as a ModelSpec naming everything that differs between families.

One decoder (models/common/decoder.py) runs every family. A family supplies its config parser (args.py, no torch),
how to build its decoder layer N (which attention, which MLP or MoE), its RoPE frequencies and attention factor, and
its state-dict adapter (from_hf, to_hf, expected_keys: Hugging Face names <-> ours). They are given as
"module:attribute" paths and imported on first use, so reading a config never imports torch and loading a dense
model never imports MoE code.
"""

import importlib


class ModelSpec:
    def __init__(self, name: str, architectures: tuple[str, ...], *, args: str, decoder_layer: str, rope: str,
                 state_dict_adapter: str):
        self.name = name
        self.architectures = architectures  # transformers' *ForCausalLM names this family loads
        self._paths = {"args": args, "decoder_layer": decoder_layer, "rope": rope,
                       "state_dict_adapter": state_dict_adapter}

    def _load(self, role: str):
        module, _, attribute = self._paths[role].partition(":")
        loaded = importlib.import_module(module)
        return getattr(loaded, attribute) if attribute else loaded

    @property
    def ModelArgs(self) -> type:  # the family's ModelArgs class (from_hf_config, to_hf_config)
        return self._load("args")

    @property
    def CausalLM(self) -> type:  # the one decoder class; it finds its family from args.architecture
        from models.common.decoder import CausalLM

        return CausalLM

    @property
    def state_dict_adapter(self):
        return self._load("state_dict_adapter")

    def decoder_layer(self, args, layer_idx: int):
        """Layer layer_idx of the model (a models.common.DecoderLayer)."""
        return self._load("decoder_layer")(args, layer_idx)

    def rope(self, args):
        """(float32 inverse frequencies [R / 2] of the R rotated dims, the attention factor cos/sin are scaled by)."""
        return self._load("rope")(args)

    def __repr__(self) -> str:
        return f"ModelSpec({self.name!r})"


FAMILIES = (
    ModelSpec(
        "llama", ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"),
        args="models.llama.args:ModelArgs",
        decoder_layer="models.llama.model:decoder_layer",
        rope="models.llama.model:rope",
        state_dict_adapter="models.llama.state_dict_adapter",
    ),
    ModelSpec(
        "qwen3_moe", ("Qwen3MoeForCausalLM",),
        args="models.qwen3_moe.args:ModelArgs",
        decoder_layer="models.qwen3_moe.model:decoder_layer",
        rope="models.llama.model:rope",  # Qwen3's
        state_dict_adapter="models.qwen3_moe.state_dict_adapter",
    ),
    ModelSpec(
        "deepseek_v3", ("DeepseekV3ForCausalLM",),
        args="models.deepseek_v3.args:ModelArgs",
        decoder_layer="models.deepseek_v3.model:decoder_layer",
        rope="models.deepseek_v3.model:rope",
        state_dict_adapter="models.deepseek_v3.state_dict_adapter",
    ),
)
ARCHITECTURES = {arch: spec for spec in FAMILIES for arch in spec.architectures}


def family_for_config(config: dict) -> ModelSpec:
    """The family of a config.json dict; ValueError naming the architectures we support otherwise."""
    architectures = config.get("architectures") or []
    if len(architectures) != 1:
        raise ValueError(f"config.json must name exactly one architecture in 'architectures', got {architectures!r}")
    return family_for_architecture(architectures[0])


def family_for_architecture(architecture: str) -> ModelSpec:
    spec = ARCHITECTURES.get(architecture)
    if spec is None:
        raise ValueError(f"Unsupported architecture {architecture!r}; supported: {', '.join(sorted(ARCHITECTURES))}")
    return spec
