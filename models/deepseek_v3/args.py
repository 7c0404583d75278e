"""ModelArgs for DeepSeek-V3 and Kimi K2 (multi-head latent attention + DeepSeek MoE), from a Hugging Face config.

Kimi K2 publishes the same architecture (`architectures: ["DeepseekV3ForCausalLM"]`) under model_type "kimi_k2";
both parse to the same ModelArgs. What the config names and this model does not run is refused here, at load time,
with the field to change: another scoring function or top-k method, MoE every other layer, grouped KV heads, partial
rotary, rope types other than default/llama3/yarn. Three fields are deliberately not carried into a saved config:
- `quantization_config`: we load and save plain bf16/fp32 tensors; an FP8 checkpoint's scale tensors are refused by
  the state-dict adapter (dequantize first).
- `auto_map`: the remote-code files it names are not written next to our checkpoints; transformers' native
  DeepseekV3 class loads them.
- `num_nextn_predict_layers` (multi-token prediction): the MTP module sits at layer index num_hidden_layers in a
  DeepSeek checkpoint; this model does not run it, the adapter skips its weights on load, and a saved config says 0.
"""

import copy
from dataclasses import dataclass, field

from models.lora_targets import ModuleNames, decoder_module_names

from kernels.rope_config import DEFAULT_ROPE_THETA, ROPE_TYPES_WITH_ATTENTION_FACTOR, parse_rope_config, yarn_mscale
from models.moe_args import MoEArgs

ARCHITECTURE = "DeepseekV3ForCausalLM"
SUPPORTED_ARCHITECTURES = (ARCHITECTURE,)
MODEL_TYPE = "deepseek_v3"
ACCEPTED_MODEL_TYPES = ("deepseek_v3", "kimi_k2")
# Keys that to_hf_config rewrites from the dataclass or drops (see the module docstring); head_dim and qk_head_dim
# are derived values transformers' config writes and recomputes on load.
_REWRITTEN_KEYS = (
    "rope_theta", "rope_scaling", "rope_parameters", "quantization_config", "auto_map", "torch_dtype", "head_dim",
    "qk_head_dim",
)
# Fields a config must spell out: a missing one would otherwise take the 671B model's value from transformers'
# defaults, which is never what a smaller config means.
_REQUIRED = (
    "vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
    "num_attention_heads", "kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
    "n_routed_experts", "num_experts_per_tok", "first_k_dense_replace",
)


@dataclass
class ModelArgs:
    vocab_size: int
    hidden_size: int
    intermediate_size: int  # the dense MLP of the first first_k_dense_replace layers
    moe_intermediate_size: int  # each routed expert (the shared experts: n_shared_experts times this)
    num_layers: int
    num_heads: int
    q_lora_rank: int | None  # None: plain q_proj; else q_a_proj -> q_a_layernorm -> q_b_proj
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    n_routed_experts: int
    num_experts_per_tok: int
    first_k_dense_replace: int
    n_shared_experts: int = 1
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    norm_topk_prob: bool = True
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 4096
    rope_theta: float = DEFAULT_ROPE_THETA
    rope_scaling: dict | None = None  # HF rope_scaling dict with "rope_type"; None = plain RoPE
    rope_interleave: bool = True  # DeepSeek's checkpoints store the rope dims as interleaved pairs
    attention_bias: bool = False  # biases q_a_proj, kv_a_proj_with_mqa and o_proj (never q_proj/q_b_proj/kv_b_proj)
    tie_word_embeddings: bool = False
    torch_dtype: str | None = None
    # MTP modules in the source checkpoint (layer indices num_layers..); not run, their weights are skipped on load.
    num_nextn_predict_layers: int = field(default=0, compare=False)
    # The source config.json, kept so that save_pretrained round-trips fields we do not model (token ids, etc.).
    hf_config: dict = field(default_factory=dict, repr=False, compare=False)

    architecture = ARCHITECTURE
    model_type = MODEL_TYPE

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def head_dim(self) -> int:
        """The query/key head dim (nope + rope). transformers' config calls qk_rope_head_dim `head_dim`; we do not."""
        return self.qk_head_dim

    @property
    def num_kv_heads(self) -> int:
        """MLA expands the latent into one key/value head per query head."""
        return self.num_heads

    @property
    def kv_cache_dims(self) -> tuple[int, int]:
        """(key, value) head dims of the KVCache: full per-head keys (nope + rope) and values, not the latent."""
        return self.qk_head_dim, self.v_head_dim

    @property
    def softmax_mscale(self) -> float:
        """DeepSeek's YaRN magnitude correction of the attention logits: mscale(factor, mscale_all_dim) when a
        scaled rope sets mscale_all_dim, else 1.0 (transformers' yarn_apply_mscale; the logits get its square)."""
        if self.rope_scaling is not None and self.rope_scaling.get("mscale_all_dim", 0):
            return yarn_mscale(self.rope_scaling["factor"], self.rope_scaling["mscale_all_dim"])
        return 1.0

    @property
    def softmax_scale(self) -> float:
        """The attention logits' scale, 1/sqrt(qk_head_dim) * softmax_mscale^2 (same order as transformers)."""
        mscale = self.softmax_mscale
        scale = self.qk_head_dim ** (-0.5)
        return scale if mscale == 1.0 else scale * mscale * mscale

    def moe_args(self) -> MoEArgs:
        return MoEArgs(
            num_experts=self.n_routed_experts,
            top_k=self.num_experts_per_tok,
            hidden_size=self.hidden_size,
            moe_intermediate_size=self.moe_intermediate_size,
            router="sigmoid",
            norm_topk_prob=self.norm_topk_prob,
            n_group=self.n_group,
            topk_group=self.topk_group,
            routed_scaling_factor=self.routed_scaling_factor,
            n_shared_experts=self.n_shared_experts,
        )

    def is_moe_layer(self, layer_idx: int) -> bool:
        return layer_idx >= self.first_k_dense_replace

    def lora_module_names(self) -> ModuleNames:
        """The Linear and expert-block names of this architecture (models.lora_targets; equal to the built model's,
        tested)."""
        q = ("q_proj",) if self.q_lora_rank is None else ("q_a_proj", "q_b_proj")
        return decoder_module_names(self.num_layers, (*q, "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"),
                                    is_moe_layer=self.is_moe_layer, shared_experts=self.n_shared_experts > 0,
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
        if architectures != [ARCHITECTURE]:
            raise ValueError(
                f"config.json must list exactly the architecture {ARCHITECTURE!r}, got {architectures!r}"
            )
        model_type = config.get("model_type", MODEL_TYPE)
        if model_type not in ACCEPTED_MODEL_TYPES:
            raise ValueError(
                f"model_type {model_type!r} is not a DeepSeek-V3 layout; accepted: {', '.join(ACCEPTED_MODEL_TYPES)}"
            )
        missing = [k for k in _REQUIRED if k not in config]
        if missing:
            raise KeyError(missing[0])
        _check_supported(config)
        num_heads = int(config["num_attention_heads"])
        q_lora_rank = config["q_lora_rank"]
        args = cls(
            vocab_size=int(config["vocab_size"]),
            hidden_size=int(config["hidden_size"]),
            intermediate_size=int(config["intermediate_size"]),
            moe_intermediate_size=int(config["moe_intermediate_size"]),
            num_layers=int(config["num_hidden_layers"]),
            num_heads=num_heads,
            q_lora_rank=None if q_lora_rank is None else int(q_lora_rank),
            kv_lora_rank=int(config["kv_lora_rank"]),
            qk_nope_head_dim=int(config["qk_nope_head_dim"]),
            qk_rope_head_dim=int(config["qk_rope_head_dim"]),
            v_head_dim=int(config["v_head_dim"]),
            n_routed_experts=int(config["n_routed_experts"]),
            num_experts_per_tok=int(config["num_experts_per_tok"]),
            first_k_dense_replace=int(config["first_k_dense_replace"]),
            n_shared_experts=int(config.get("n_shared_experts", 1)),
            # transformers' defaults when absent; null means no group limit
            n_group=int(_or(config.get("n_group", 8), 1)),
            topk_group=int(_or(config.get("topk_group", 4), 1)),
            routed_scaling_factor=float(config.get("routed_scaling_factor", 2.5)),
            norm_topk_prob=bool(config.get("norm_topk_prob", True)),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(config.get("max_position_embeddings", 4096)),
            rope_interleave=bool(config.get("rope_interleave", True)),
            attention_bias=bool(config.get("attention_bias", False)),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            torch_dtype=config.get("dtype") or config.get("torch_dtype"),
            num_nextn_predict_layers=int(config.get("num_nextn_predict_layers") or 0),
            hf_config={k: v for k, v in copy.deepcopy(config).items() if k != "quantization_config"},
        )
        args.rope_theta, args.rope_scaling = parse_rope_config(config, ROPE_TYPES_WITH_ATTENTION_FACTOR, "DeepSeek-V3")
        if args.first_k_dense_replace < 0:
            raise ValueError(f"first_k_dense_replace must be >= 0, got {args.first_k_dense_replace}")
        args.moe_args()  # building MoEArgs checks the routing knobs (n_group, topk_group, ...) and names them
        return args

    def to_hf_config(self) -> dict:
        """config.json dict that transformers 5.x loads as its native DeepseekV3ForCausalLM (model_type
        deepseek_v3 also for a Kimi K2 source). Rope settings use the `rope_theta` / `rope_scaling` form."""
        config = {k: v for k, v in copy.deepcopy(self.hf_config).items() if k not in _REWRITTEN_KEYS}
        config.update(
            architectures=[ARCHITECTURE],
            model_type=MODEL_TYPE,
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            moe_intermediate_size=self.moe_intermediate_size,
            num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_heads,
            q_lora_rank=self.q_lora_rank,
            kv_lora_rank=self.kv_lora_rank,
            qk_nope_head_dim=self.qk_nope_head_dim,
            qk_rope_head_dim=self.qk_rope_head_dim,
            v_head_dim=self.v_head_dim,
            n_routed_experts=self.n_routed_experts,
            num_experts_per_tok=self.num_experts_per_tok,
            first_k_dense_replace=self.first_k_dense_replace,
            moe_layer_freq=1,
            n_shared_experts=self.n_shared_experts,
            n_group=self.n_group,
            topk_group=self.topk_group,
            routed_scaling_factor=self.routed_scaling_factor,
            norm_topk_prob=self.norm_topk_prob,
            scoring_func="sigmoid",
            topk_method="noaux_tc",
            hidden_act="silu",
            rms_norm_eps=self.rms_norm_eps,
            max_position_embeddings=self.max_position_embeddings,
            rope_theta=self.rope_theta,
            rope_interleave=self.rope_interleave,
            attention_bias=self.attention_bias,
            tie_word_embeddings=self.tie_word_embeddings,
            num_nextn_predict_layers=0,  # the MTP module's weights are not part of this model
        )
        if self.rope_scaling is not None:
            config["rope_scaling"] = copy.deepcopy(self.rope_scaling)
        if self.torch_dtype is not None:
            config["dtype"] = self.torch_dtype
        return config


def _or(value, default):
    return default if value is None else value


def _check_supported(config: dict) -> None:
    """ValueError naming the field for every DeepSeek option this model does not implement."""
    act = config.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"Unsupported hidden_act {act!r}; only 'silu' is implemented")
    num_heads = int(config["num_attention_heads"])
    num_kv_heads = config.get("num_key_value_heads")
    if num_kv_heads not in (None, num_heads):
        raise ValueError(
            f"num_key_value_heads={num_kv_heads} must equal num_attention_heads={num_heads}: multi-head latent "
            "attention expands its latent into one key/value head per query head"
        )
    if config.get("scoring_func", "sigmoid") != "sigmoid":
        raise ValueError(
            f"Unsupported scoring_func {config['scoring_func']!r}; DeepSeek-V3 routing is 'sigmoid'"
        )
    if config.get("topk_method", "noaux_tc") != "noaux_tc":
        raise ValueError(
            f"Unsupported topk_method {config['topk_method']!r}; only 'noaux_tc' (sigmoid scores plus "
            "e_score_correction_bias, group-limited) is implemented"
        )
    if (config.get("moe_layer_freq") or 1) != 1:
        raise ValueError(
            f"moe_layer_freq={config['moe_layer_freq']} is not supported: every layer from first_k_dense_replace "
            "on is an MoE layer (as in transformers' DeepseekV3 and every published DeepSeek-V3 / Kimi K2 config)"
        )
    if int(config["qk_rope_head_dim"]) % 2:
        raise ValueError(f"qk_rope_head_dim must be even, got {config['qk_rope_head_dim']}")
    if not config.get("n_shared_experts", 1):
        raise ValueError("n_shared_experts must be >= 1 (transformers' DeepseekV3 always has a shared expert)")
