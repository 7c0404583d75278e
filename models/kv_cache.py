"""Preallocated key/value cache shared by every family (the rollout decodes with it).

Shapes: L layers held, B rows, K kv heads, S positions, T new positions, H query heads, D head dim. Keys and values
may have different head dims (MLA's keys carry the rope part, 192 = 128 + 64, its values 128): a family whose cached
heads differ from num_kv_heads x head_dim says so with ModelArgs.kv_cache_dims = (k_dim, v_dim).

Layers are addressed by their number in the whole model (Attention.layer_idx); a cache for a pipeline stage holds
only that stage's layers (allocate(..., layers=stage.layer_ids)).
"""

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from kernels.attention import attention


@dataclass(eq=False)
class KVCache:
    """Preallocated keys/values for every layer it holds; all rows share `length` (the rollout left-aligns each
    batch).

    `length` is a host int so that deciding where to write never syncs with the device."""

    k_LBKSD: torch.Tensor
    v_LBKSD: torch.Tensor
    length: int = 0
    layers: tuple[int, ...] | None = None  # the layer number each of the L slots holds; None: 0 .. L - 1

    def __post_init__(self):
        self.layers = tuple(range(self.k_LBKSD.shape[0]) if self.layers is None else self.layers)
        self._slot = {layer: i for i, layer in enumerate(self.layers)}

    @classmethod
    def allocate(
        cls, args, batch_size: int, max_len: int, dtype: torch.dtype, device: torch.device | str,
        layers: Iterable[int] | None = None,
    ) -> "KVCache":
        """args: any family's ModelArgs (num_layers, num_kv_heads, head_dim or kv_cache_dims). layers: the layer
        numbers to hold (a pipeline stage's); all of the model's by default."""
        layers = tuple(range(args.num_layers) if layers is None else layers)
        k_dim, v_dim = args.kv_cache_dims if hasattr(args, "kv_cache_dims") else (args.head_dim, args.head_dim)
        shape = (len(layers), batch_size, args.num_kv_heads, max_len)
        return cls(
            k_LBKSD=torch.zeros(*shape, k_dim, dtype=dtype, device=device),
            v_LBKSD=torch.zeros(*shape, v_dim, dtype=dtype, device=device),
            layers=layers,
        )

    @property
    def batch_size(self) -> int:
        return self.k_LBKSD.shape[1]

    @property
    def max_len(self) -> int:
        return self.k_LBKSD.shape[3]

    def select(self, row_indices: torch.Tensor) -> "KVCache":
        """New cache whose row i is this cache's row row_indices[i], e.g. one prompt's prefill repeated n times."""
        return KVCache(
            k_LBKSD=self.k_LBKSD.index_select(1, row_indices),
            v_LBKSD=self.v_LBKSD.index_select(1, row_indices),
            length=self.length,
            layers=self.layers,
        )

    def update(
        self, layer: int, k_BKTD: torch.Tensor, v_BKTD: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the layer's new keys/values at length..length+T and return views over everything cached so far."""
        end = self.length + k_BKTD.shape[2]
        slot = self._slot[layer]
        self.k_LBKSD[slot, :, :, self.length : end] = k_BKTD
        self.v_LBKSD[slot, :, :, self.length : end] = v_BKTD
        return self.k_LBKSD[slot, :, :, :end], self.v_LBKSD[slot, :, :, :end]

    def attend(
        self, layer: int, q_BHTD: torch.Tensor, k_BKTD: torch.Tensor, v_BKTD: torch.Tensor, *,
        scale: float | None = None,
    ) -> torch.Tensor:
        """What an attention layer does with its cache: write the new keys/values (update) and attend the T new
        queries, at positions length..length+T-1, to everything cached so far. Returns [B, H, T, Dv].

        This is the whole contract between a model's attention and its cache: another cache (the rollout's paged
        one, services/rollout/paged_cache.py) implements attend with per-row lengths and block tables."""
        k_BKSD, v_BKSD = self.update(layer, k_BKTD, v_BKTD)
        return attention(q_BHTD, k_BKSD, v_BKSD, causal=True, q_offset=self.length, scale=scale)
