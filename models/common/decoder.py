"""The one decoder every family runs: embed -> RoPE cos/sin -> layers -> final norm -> lm_head.

Shapes: B batch, T new tokens, D hidden, R rotated dims per head, V vocab.

Module names are transformers' *ForCausalLM's (model.embed_tokens, model.layers.N...., model.norm, lm_head), so
Hugging Face checkpoints and PEFT adapter keys map without renaming. The layers live in an nn.ModuleDict keyed by
their number in the whole model: a pipeline stage holding layers 4..7 keeps the keys model.layers.4.* .. and the
layer indices its KV cache and router replay use (models/common/pipeline.py makes stages). What a family changes
(its layers, its RoPE) comes from its ModelSpec (models/families.py). Parallelism is applied from outside; nothing
here knows about meshes.
"""

import torch
from torch import nn

from kernels import Packing, rope_cos_sin
from models.common.blocks import RMSNorm
from models.families import family_for_architecture
from models.kv_cache import KVCache


class DecoderStack(nn.Module):
    """The `model.` prefix of HF checkpoints: embeddings, layers, final norm. A pipeline stage sets embed_tokens
    and/or norm to None."""

    def __init__(self, args, spec):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleDict({str(i): spec.decoder_layer(args, i) for i in range(args.num_layers)})
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)


class CausalLM(nn.Module):
    """args: any family's ModelArgs; args.architecture picks the family (models.families)."""

    def __init__(self, args):
        super().__init__()
        self.args = args
        self.spec = family_for_architecture(args.architecture)
        self.model = DecoderStack(args, self.spec)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        self.tie_weights()
        # float32 RoPE frequencies per device; a plain dict, not a buffer, so model.to(bf16) cannot round them.
        self._rope: dict[torch.device, tuple[torch.Tensor, float]] = {}

    def tie_weights(self) -> None:
        """Share one Parameter between embed_tokens and lm_head when the config ties them (also after a
        meta-device load, where assign=True replaces parameters and breaks the sharing)."""
        if self.args.tie_word_embeddings and self.model.embed_tokens is not None and self.lm_head is not None:
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def layer_ids(self) -> list[int]:
        """The numbers of the layers this model holds (all of them, or a pipeline stage's)."""
        return [int(i) for i in self.model.layers]

    def forward(
        self,
        inputs: torch.Tensor,
        positions_BT: torch.Tensor | None = None,
        cache: KVCache | None = None,
        *,
        packing: Packing | None = None,
        routing=None,
        return_hidden: bool = False,
    ) -> torch.Tensor:
        """Logits [B,T,V], or the final-normed hidden states [B,T,D] with return_hidden (so a caller can compute
        logprobs in chunks without materialising [B,T,V]).

        inputs: token ids [B,T], or, when model.embed_tokens is None (a later pipeline stage), the previous stage's
        hidden states [B,T,D]. A stage without model.norm returns its last layer's hidden states [B,T,D].

        With a cache the tokens are written at cache.length.. and cache.length advances by T. With packing (B = 1)
        the row holds several documents: attention stays within each, and positions restart at 0 in each unless
        positions_BT is given. Under context parallelism (services/trainer/engine/parallel/context.py) packing is
        the row's ContextLayout instead: inputs are this rank's shard, positions the shard's global ones. routing:
        a models.moe.RouterReplay that records the experts every MoE layer picks,
        or forces them (a dense model has no router and ignores it)."""
        B, T = inputs.shape[:2]
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
                positions_BT = packing.positions().to(inputs.device)
            else:
                positions_BT = torch.arange(offset, offset + T, device=inputs.device).expand(B, T)
        h_BTD = inputs if self.model.embed_tokens is None else self.model.embed_tokens(inputs)
        inv_freq, attention_factor = self._rope_frequencies(h_BTD.device)
        cos_BTR, sin_BTR = rope_cos_sin(positions_BT, inv_freq, h_BTD.dtype, attention_factor)
        for layer in self.model.layers.values():
            h_BTD = layer(h_BTD, cos_BTR, sin_BTR, cache, packing, routing)
        if cache is not None:
            cache.length += T
        if self.model.norm is None:
            return h_BTD
        h_BTD = self.model.norm(h_BTD)
        return h_BTD if return_hidden or self.lm_head is None else self.logits(h_BTD)

    def _rope_frequencies(self, device: torch.device) -> tuple[torch.Tensor, float]:
        if device not in self._rope:
            inv_freq, attention_factor = self.spec.rope(self.args)
            self._rope[device] = inv_freq.to(device), attention_factor
        return self._rope[device]

    def logits(self, hidden_BTD: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden_BTD)

    def unembedding_weight(self) -> torch.Tensor | None:
        """W [V, D] when the logits are exactly hidden @ W.T (lm_head a plain bias-free Linear), so a caller may
        compute them from W in chunks; None when lm_head computes more than that (a LoRA adapter on it)."""
        head = self.lm_head
        return head.weight if type(head) is nn.Linear and head.bias is None else None
