"""ModelArgs for the dense Llama 3 / Qwen2 / Qwen3 family, parsed from a Hugging Face config.json dict.

The three architectures differ only in small switches (qkv bias, per-head q/k RMSNorm, tied embeddings, head_dim),
so one dataclass describes all of them. Configs from transformers 4.x (`rope_theta` + `rope_scaling`) and 5.x
(`rope_parameters`) are both accepted. Features we do not implement (sliding-window layers, partial rotary, other
activations) raise ValueError here, at load time, rather than producing a model that silently computes something
else.
"""

import copy
from dataclasses import dataclass, field

from models.lora_targets import ATTENTION_PROJECTIONS, ModuleNames, decoder_module_names

from kernels.rope_config import DEFAULT_ROPE_THETA, SUPPORTED_ROPE_TYPES, parse_rope_config

MODEL_TYPES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}
SUPPORTED_ARCHITECTURES = tuple(MODEL_TYPES)
# Keys that to_hf_config rewrites from the dataclass; everything else in the source config is carried over verbatim.
_ROPE_KEYS = ("rope_theta", "rope_scaling", "rope_parameters")


@dataclass
class ModelArgs:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope_theta: float = DEFAULT_ROPE_THETA
    rope_scaling: dict | None = None  # HF rope_scaling dict with "rope_type"; None = plain RoPE
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2 always, Llama/Qwen3 when attention_bias
    o_bias: bool = False  # Llama/Qwen3 attention_bias also biases o_proj; Qwen2 never does
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k before RoPE
    torch_dtype: str | None = None
    # The source config.json, kept so that save_pretrained round-trips fields we do not model (token ids, etc.).
    hf_config: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def model_type(self) -> str:
        return MODEL_TYPES[self.architecture]

    def lora_module_names(self) -> ModuleNames:
        """The Linear names of this architecture (models.lora_targets; equal to the built model's, tested)."""
        return decoder_module_names(self.num_layers, ATTENTION_PROJECTIONS,
                                    tie_word_embeddings=self.tie_word_embeddings)

    @classmethod
    def from_hf_config(cls, config: dict) -> "ModelArgs":
        try:
            return cls._from_hf_config(config)
        except KeyError as e:
            raise ValueError(f"config.json is missing the required field {e.args[0]!r}") from None

    @classmethod
    def _from_hf_config(cls, config: dict) -> "ModelArgs":
        architectures = config.get("architectures") or []
        if len(architectures) != 1:
            raise ValueError(
                f"config.json must list exactly one architecture in 'architectures', got {architectures!r}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        arch = architectures[0]
        if arch not in MODEL_TYPES:
            raise ValueError(
                f"Unsupported architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        act = config.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"Unsupported hidden_act {act!r} for {arch}; only 'silu' is implemented")
        if config.get("use_sliding_window"):
            raise ValueError(f"{arch} with use_sliding_window=true is not supported; set it to false")
        rope_theta, rope_scaling = parse_rope_config(config, SUPPORTED_ROPE_TYPES, "the dense Llama/Qwen model")
        num_heads = int(config["num_attention_heads"])
        hidden_size = int(config["hidden_size"])
        attention_bias = bool(config.get("attention_bias", False))
        is_qwen2 = arch == "Qwen2ForCausalLM"
        return cls(
            architecture=arch,
            vocab_size=int(config["vocab_size"]),
            hidden_size=hidden_size,
            intermediate_size=int(config["intermediate_size"]),
            num_layers=int(config["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(config.get("num_key_value_heads") or num_heads),
            head_dim=int(config.get("head_dim") or hidden_size // num_heads),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(config.get("max_position_embeddings", 2048)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            qkv_bias=is_qwen2 or attention_bias,
            o_bias=(not is_qwen2) and attention_bias,
            mlp_bias=arch == "LlamaForCausalLM" and bool(config.get("mlp_bias", False)),
            qk_norm=arch == "Qwen3ForCausalLM",
            torch_dtype=config.get("dtype") or config.get("torch_dtype"),
            hf_config=copy.deepcopy(config),
        )

    def to_hf_config(self) -> dict:
        """config.json dict that transformers (4.x and 5.x) loads as this architecture.

        Rope settings are written in the widely understood `rope_theta` / `rope_scaling` form."""
        config = {k: v for k, v in copy.deepcopy(self.hf_config).items() if k not in _ROPE_KEYS}
        config.pop("torch_dtype", None)
        config.update(
            architectures=[self.architecture],
            model_type=self.model_type,
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            hidden_act="silu",
            rms_norm_eps=self.rms_norm_eps,
            max_position_embeddings=self.max_position_embeddings,
            rope_theta=self.rope_theta,
            tie_word_embeddings=self.tie_word_embeddings,
        )
        if self.rope_scaling is not None:
            config["rope_scaling"] = copy.deepcopy(self.rope_scaling)
        if self.architecture != "Qwen2ForCausalLM":
            config["attention_bias"] = self.qkv_bias
        if self.architecture == "LlamaForCausalLM":
            config["mlp_bias"] = self.mlp_bias
        if self.torch_dtype is not None:
            config["dtype"] = self.torch_dtype
        return config
