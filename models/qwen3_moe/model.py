"""Qwen3-MoE's layers: Qwen3's attention (models.common, q/k RMSNorm) and, where args.is_moe_layer, the MoE block of
models/moe.py with the softmax router instead of the dense MLP. Module names are transformers'
Qwen3MoeForCausalLM's, fused experts included (model.layers.N.mlp.experts.gate_up_proj), so in-memory HF state
dicts and PEFT keys map without renaming; per-expert on-disk keys are handled by state_dict_adapter. RoPE is the
dense family's (models.llama.model.rope)."""

from models.common.blocks import MLP, Attention, DecoderLayer
from models.moe import MoE
from models.qwen3_moe.args import ModelArgs


def decoder_layer(args: ModelArgs, layer_idx: int) -> DecoderLayer:
    mlp = MoE(args.moe_args(), layer_idx) if args.is_moe_layer(layer_idx) else MLP(args)
    return DecoderLayer(Attention(args, layer_idx), mlp, args.hidden_size, args.rms_norm_eps)
