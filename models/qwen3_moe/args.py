"""ModelArgs for Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B), parsed from a Hugging Face config.json dict.

Attention is Qwen3's (per-head q/k RMSNorm, GQA); the field names that models.common's Attention, MLP and RMSNorm
read are the same as models.llama.args.ModelArgs, so those classes are reused as they are. A layer is MoE
when it is not in mlp_only_layers and (layer + 1) % decoder_sparse_step == 0, as in transformers. The expert count
is `num_experts` in published configs and `num_local_experts` in what transformers 5.x writes; both are read.
"""

import copy
from dataclasses import dataclass, field

from models.lora_targets import ATTENTION_PROJECTIONS, ModuleNames, decoder_module_names

from kernels.rope_config import DEFAULT_ROPE_THETA, SUPPORTED_ROPE_TYPES, parse_rope_config
from models.moe_args import MoEArgs

ARCHITECTURE = "Qwen3MoeForCausalLM"
SUPPORTED_ARCHITECTURES = (ARCHITECTURE,)
# Keys that to_hf_config rewrites from the dataclass; everything else in the source config is carried over verbatim.
_REWRITTEN_KEYS = ("rope_theta", "rope_scaling", "rope_parameters", "num_local_experts", "torch_dtype")


@dataclass
class ModelArgs:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int  # dense (mlp_only / non-sparse-step) layers
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    router_aux_loss_coef: float = 0.001  # carried for the trainer's load-balancing loss; not used by forward
    rope_theta: float = DEFAULT_ROPE_THETA
    rope_scaling: dict | None = None
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # attention_bias biases q/k/v ...
    o_bias: bool = False  # ... and o_proj
    torch_dtype: str | None = None
    hf_config: dict = field(default_factory=dict, repr=False, compare=False)
    # Fixed by the architecture; fields because models.common's Attention and MLP read them.
    qk_norm: bool = field(default=True, init=False)
    mlp_bias: bool = field(default=False, init=False)

    @property
    def model_type(self) -> str:
        return "qwen3_moe"

    def is_moe_layer(self, layer_idx: int) -> bool:
        return (
            layer_idx not in self.mlp_only_layers
            and self.num_experts > 0
            and (layer_idx + 1) % self.decoder_sparse_step == 0
        )

    def moe_args(self) -> MoEArgs:
        return MoEArgs(
            num_experts=self.num_experts,
            top_k=self.num_experts_per_tok,
            hidden_size=self.hidden_size,
            moe_intermediate_size=self.moe_intermediate_size,
            router="softmax",
            norm_topk_prob=self.norm_topk_prob,
        )

    def lora_module_names(self) -> ModuleNames:
        """The Linear and expert-block names of this architecture (models.lora_targets; equal to the built model's,
        tested)."""
        return decoder_module_names(self.num_layers, ATTENTION_PROJECTIONS, is_moe_layer=self.is_moe_layer,
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
            raise ValueError(f"Expected architectures [{ARCHITECTURE!r}], got {architectures!r}")
        act = config.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"Unsupported hidden_act {act!r} for {ARCHITECTURE}; only 'silu' is implemented")
        if config.get("use_sliding_window"):
            raise ValueError(f"{ARCHITECTURE} with use_sliding_window=true is not supported; set it to false")
        num_experts = config.get("num_experts", config.get("num_local_experts"))
        if num_experts is None:
            raise KeyError("num_experts")
        decoder_sparse_step = int(config.get("decoder_sparse_step", 1))
        if decoder_sparse_step < 1:
            raise ValueError(f"decoder_sparse_step must be >= 1, got {decoder_sparse_step}")
        rope_theta, rope_scaling = parse_rope_config(config, SUPPORTED_ROPE_TYPES, "Qwen3-MoE")
        num_heads = int(config["num_attention_heads"])
        hidden_size = int(config["hidden_size"])
        attention_bias = bool(config.get("attention_bias", False))
        args = cls(
            architecture=ARCHITECTURE,
            vocab_size=int(config["vocab_size"]),
            hidden_size=hidden_size,
            intermediate_size=int(config["intermediate_size"]),
            num_layers=int(config["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(config.get("num_key_value_heads") or num_heads),
            head_dim=int(config.get("head_dim") or hidden_size // num_heads),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(config.get("max_position_embeddings", 2048)),
            num_experts=int(num_experts),
            num_experts_per_tok=int(config["num_experts_per_tok"]),
            moe_intermediate_size=int(config["moe_intermediate_size"]),
            norm_topk_prob=bool(config.get("norm_topk_prob", False)),
            decoder_sparse_step=decoder_sparse_step,
            mlp_only_layers=tuple(int(i) for i in config.get("mlp_only_layers") or ()),
            router_aux_loss_coef=float(config.get("router_aux_loss_coef", 0.001)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            qkv_bias=attention_bias,
            o_bias=attention_bias,
            torch_dtype=config.get("dtype") or config.get("torch_dtype"),
            hf_config=copy.deepcopy(config),
        )
        if any(args.is_moe_layer(i) for i in range(args.num_layers)):
            args.moe_args()  # validates top-k against the expert count with a clear error
        return args

    def to_hf_config(self) -> dict:
        """config.json dict that transformers loads as Qwen3MoeForCausalLM (published-checkpoint field names)."""
        config = {k: v for k, v in copy.deepcopy(self.hf_config).items() if k not in _REWRITTEN_KEYS}
        config.update(
            architectures=[ARCHITECTURE],
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
            num_experts=self.num_experts,
            num_experts_per_tok=self.num_experts_per_tok,
            moe_intermediate_size=self.moe_intermediate_size,
            norm_topk_prob=self.norm_topk_prob,
            decoder_sparse_step=self.decoder_sparse_step,
            mlp_only_layers=list(self.mlp_only_layers),
            router_aux_loss_coef=self.router_aux_loss_coef,
            rope_theta=self.rope_theta,
            tie_word_embeddings=self.tie_word_embeddings,
            attention_bias=self.qkv_bias,
            use_sliding_window=False,
        )
        if self.rope_scaling is not None:
            config["rope_scaling"] = copy.deepcopy(self.rope_scaling)
        if self.torch_dtype is not None:
            config["dtype"] = self.torch_dtype
        return config
