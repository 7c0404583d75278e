"""Single-device Qwen3-MoE decoder, shared by the trainer and the rollout.

Shapes: B batch, T new tokens, D hidden, V vocab.

Attention, RMSNorm and the dense MLP are models.llama.model's classes (Qwen3's q/k-norm attention; the shapes are
identical), the sparse layers are models.moe.MoE with the softmax router. Module names are transformers'
Qwen3MoeForCausalLM's, fused experts included (model.layers.N.mlp.experts.gate_up_proj), so in-memory HF state
dicts and PEFT keys map without renaming; per-expert on-disk keys are handled by state_dict_adapter.
"""

import torch
from torch import nn

from kernels import Packing, rope_cos_sin, rope_inv_freq
from models.kv_cache import KVCache
from models.llama.model import MLP, Attention, RMSNorm
from models.moe import MoE, RouterReplay
from models.qwen3_moe.args import ModelArgs


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, layer_idx: int):
        super().__init__()
        self.self_attn = Attention(args, layer_idx)
        self.mlp = MoE(args.moe_args(), layer_idx) if args.is_moe_layer(layer_idx) else MLP(args)
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def forward(
        self, h_BTD: torch.Tensor, cos_BTD: torch.Tensor, sin_BTD: torch.Tensor, cache: KVCache | None,
        packing: Packing | None, routing: RouterReplay | None,
    ) -> torch.Tensor:
        h_BTD = h_BTD + self.self_attn(self.input_layernorm(h_BTD), cos_BTD, sin_BTD, cache, packing)
        x_BTD = self.post_attention_layernorm(h_BTD)
        mlp_BTD = self.mlp(x_BTD, routing) if isinstance(self.mlp, MoE) else self.mlp(x_BTD)
        return h_BTD + mlp_BTD


class DecoderStack(nn.Module):
    """The `model.` prefix of HF checkpoints: embeddings, layers, final norm."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(args, i) for i in range(args.num_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)


class CausalLM(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model = DecoderStack(args)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        self.tie_weights()
        # float32 RoPE frequencies per device; a plain dict, not a buffer, so model.to(bf16) cannot round them.
        self._inv_freq: dict[torch.device, torch.Tensor] = {}

    def tie_weights(self) -> None:
        if self.args.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self,
        input_ids_BT: torch.Tensor,
        positions_BT: torch.Tensor | None = None,
        cache: KVCache | None = None,
        *,
        packing: Packing | None = None,
        routing: RouterReplay | None = None,
        return_hidden: bool = False,
    ) -> torch.Tensor:
        """Logits [B,T,V], or the final-normed hidden states [B,T,D] with return_hidden.

        cache and packing as in models.llama (see docs/models.md); routing records or replays each MoE layer's
        expert choice (models.moe.RouterReplay)."""
        B, T = input_ids_BT.shape
        offset = 0 if cache is None else cache.length
        if cache is not None and offset + T > cache.max_len:
            raise ValueError(
                f"KVCache overflow: {offset} cached + {T} new tokens exceeds max_len={cache.max_len}; "
                "allocate a larger cache"
            )
        if packing is not None and cache is not None:
            raise ValueError("packing is for training rows; it cannot be combined with a KV cache")
        if positions_BT is None:
            if packing is not None:
                positions_BT = packing.positions().to(input_ids_BT.device)
            else:
                positions_BT = torch.arange(offset, offset + T, device=input_ids_BT.device).expand(B, T)
        h_BTD = self.model.embed_tokens(input_ids_BT)
        cos_BTD, sin_BTD = rope_cos_sin(positions_BT, self._rope_inv_freq(h_BTD.device), h_BTD.dtype)
        for layer in self.model.layers:
            h_BTD = layer(h_BTD, cos_BTD, sin_BTD, cache, packing, routing)
        if cache is not None:
            cache.length += T
        h_BTD = self.model.norm(h_BTD)
        return h_BTD if return_hidden else self.logits(h_BTD)

    def _rope_inv_freq(self, device: torch.device) -> torch.Tensor:
        if device not in self._inv_freq:
            inv_freq = rope_inv_freq(self.args.head_dim, self.args.rope_theta, self.args.rope_scaling)
            self._inv_freq[device] = inv_freq.to(device)
        return self._inv_freq[device]

    def logits(self, hidden_BTD: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden_BTD)
