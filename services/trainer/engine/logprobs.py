"""The training engine's logprob head: the one place the trainer turns hidden states into target logprobs.

Shapes: B rows, T tokens per row, N tokens back to back, K targets per position ([N, K]), D hidden, V vocab,
C tokens per chunk.

- token_logprobs: float32 logprobs of targets at final-normed hidden states, C tokens at a time, never holding [N, V]
  logits (kernels/logprobs.py on model.unembedding_weight() when lm_head is a plain unembedding; in deterministic
  mode, or when LoRA wraps lm_head, each chunk is model.logits -> log_softmax -> gather, recomputed in backward).
  Training API calls and managed SFT both use it.
- target_nll_sum: the summed NLL of a batch's target tokens (IGNORE_INDEX elsewhere): SFT's and validation's loss.
- sequence_logprob_sums: each packed sequence's summed target logprobs: DPO's policy and reference logprobs.
- target_logprobs: the reference formula (one forward to full logits, log_softmax in float32, gather). The rollout
  (services/rollout/runner.py) computes a sampled token's logprob the same way, so with deterministic=True
  (kernels.batch_invariant) a sequence's logprobs here are bitwise the rollout's deterministic-mode logprobs, whatever
  else either side batched it with; token_logprobs(deterministic=True) equals it bitwise too (tested).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from kernels import Packing
from kernels.batch_invariant import batch_invariant_mode
from kernels.logprobs import IGNORE_INDEX, chunked_logprobs, default_chunk_size


def token_logprobs(model: nn.Module, hidden_ND: torch.Tensor, targets: torch.Tensor, *, deterministic: bool = False,
                   chunk_size: int | None = None) -> torch.Tensor:
    """float32 logprobs of targets ([N] or [N, K]; IGNORE_INDEX gives 0) under the model's raw distribution at
    hidden_ND (final-normed), chunk_size tokens at a time (default: kernels.logprobs.default_chunk_size of the
    vocabulary), never holding [N, V] logits."""
    chunk = chunk_size or default_chunk_size(model.args.vocab_size)
    weight_VD = model.unembedding_weight()
    if not deterministic and weight_VD is not None:
        return chunked_logprobs(hidden_ND, None, 0.0, weight_VD, targets, chunk_size=chunk,
                                ignore_index=IGNORE_INDEX)
    parts = [checkpoint(_chunk_logprobs, model, hidden_ND[i:i + chunk], targets[i:i + chunk], deterministic,
                        use_reentrant=False) for i in range(0, hidden_ND.shape[0], chunk)]
    return torch.cat(parts)


def _chunk_logprobs(model: nn.Module, hidden_CD: torch.Tensor, targets: torch.Tensor,
                    deterministic: bool) -> torch.Tensor:
    # The mode is entered here (not around the caller) so that the recomputation in backward, which runs outside
    # any mode, computes the same ops as the forward did.
    with batch_invariant_mode(deterministic):
        logprobs_CV = F.log_softmax(model.logits(hidden_CD).float(), dim=-1)
    targets_CK = targets if targets.dim() == 2 else targets[:, None]
    valid_CK = targets_CK != IGNORE_INDEX
    out_CK = torch.where(valid_CK, logprobs_CV.gather(1, torch.where(valid_CK, targets_CK, 0)), 0.0)
    return out_CK if targets.dim() == 2 else out_CK[:, 0]


def target_nll_sum(model: nn.Module, input_ids_BT: torch.Tensor, targets_BT: torch.Tensor, *,
                   chunk_size: int | None = None, packing: Packing | None = None) -> torch.Tensor:
    """Summed float32 NLL of the target tokens (IGNORE_INDEX elsewhere) through token_logprobs. With packing, the
    row (B = 1) holds several sequences back to back (the model's `packing`); the targets then end each sequence
    with IGNORE_INDEX."""
    hidden_BTD = model(input_ids_BT, packing=packing, return_hidden=True)
    return -token_logprobs(model, hidden_BTD.flatten(0, 1), targets_BT.flatten(), chunk_size=chunk_size).sum()


def sequence_logprob_sums(model: nn.Module, input_ids_BT: torch.Tensor, targets_BT: torch.Tensor, *,
                          packing: Packing, chunk_size: int | None = None) -> torch.Tensor:
    """[S] float32: the summed logprobs of each packed sequence's target tokens (IGNORE_INDEX elsewhere), the row
    (B = 1) holding S sequences back to back as packing says, through token_logprobs."""
    hidden_BTD = model(input_ids_BT, packing=packing, return_hidden=True)
    logprobs_N = token_logprobs(model, hidden_BTD.flatten(0, 1), targets_BT.flatten(), chunk_size=chunk_size)
    doc_N = packing.doc_ids().to(logprobs_N.device)
    return torch.zeros(len(packing.lengths), device=logprobs_N.device).index_add(0, doc_N, logprobs_N)


def target_logprobs(model: nn.Module, tokens_BT: torch.Tensor, targets_BT: torch.Tensor, *,
                    deterministic: bool = False) -> torch.Tensor:
    """logprobs_BT[b, t] = log p(targets[b, t] | tokens[b, :t + 1]) under the model's raw distribution."""
    with batch_invariant_mode(enabled=deterministic):
        logits_BTV = model(tokens_BT).float()
        return torch.gather(F.log_softmax(logits_BTV, dim=-1), -1, targets_BT.unsqueeze(-1)).squeeze(-1)
