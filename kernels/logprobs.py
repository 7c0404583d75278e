"""Token logprobs (and entropies) of the model's distribution, in chunks of tokens, never holding [N, V] logits.

Shapes: N tokens (the leading dims of hidden, flattened), C tokens per chunk, D hidden, V vocab.

Semantics, shared by chunked_logprobs and logprobs_reference (the naive fp32 computation it is tested against):
    h        = rms_norm(hidden, norm_weight, eps)   when norm_weight is given (kernels.norm: float32 statistics, cast
               back to hidden's dtype, times the weight), else hidden itself (already normed, e.g. return_hidden)
    logits   = F.linear(h, unembed_weight) in h's dtype (what lm_head computes), then upcast to float32
    logprob  = log_softmax(logits)[target]        float32; 0 where target == ignore_index, with no gradient there
    entropy  = -sum_v p_v log p_v                 float32, for every token (ignored targets included)
targets hold one id per token (hidden's leading shape) or K ids per token (that shape + [K]: K logprobs gathered from
the same logits, e.g. a top-K distillation target). logprobs have targets' shape, entropy hidden's leading shape.
Gradients reach hidden, norm_weight and unembed_weight (those that require grad).

Memory: the forward keeps per-token float32 results and the log-sum-exp [N] only; the backward recomputes each
chunk's logits from the saved inputs. So the largest temporaries are two or three [C, V] float32 blocks per chunk,
plus the [V, D] unembedding gradient (accumulated in float32) when unembed_weight requires grad. Chunking changes
no per-token value beyond float rounding of the matmul blocking; gradients are sums over chunks.
"""

import torch
import torch.nn.functional as F

from kernels.norm import rms_norm

IGNORE_INDEX = -100  # the target id that carries no logprob, as in torch.nn.functional.cross_entropy
CHUNK_LOGITS_BYTES = 64 * 2**20  # default_chunk_size: one float32 [C, V] block stays under this


def default_chunk_size(vocab_size: int) -> int:
    """Tokens per chunk so that one float32 [C, V] block is at most CHUNK_LOGITS_BYTES (128 tokens at V = 128k)."""
    return max(1, CHUNK_LOGITS_BYTES // (4 * vocab_size))


def chunked_logprobs(
    hidden: torch.Tensor, norm_weight: torch.Tensor | None, eps: float, unembed_weight_VD: torch.Tensor,
    targets: torch.Tensor, *, chunk_size: int, return_entropy: bool = False, ignore_index: int = IGNORE_INDEX,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """logprobs (and entropy with return_entropy) of targets under softmax(unembed(norm(hidden))); see the module
    docstring for the exact semantics. hidden is [..., D] (e.g. [N, D] or [B, T, D]) and targets [...] or [..., K]."""
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    lead = hidden.shape[:-1]
    if targets.shape != lead and targets.shape[:-1] != lead:
        raise ValueError(f"targets {tuple(targets.shape)} must have hidden's leading shape {tuple(lead)} "
                         f"(or that shape + [K])")
    hidden_ND = hidden.reshape(-1, hidden.shape[-1])
    targets_NK = targets.reshape(hidden_ND.shape[0], 1 if targets.shape == lead else targets.shape[-1])
    out = _ChunkedLogprobs.apply(
        hidden_ND, norm_weight, unembed_weight_VD, targets_NK, eps, chunk_size, return_entropy, ignore_index
    )
    if return_entropy:
        return out[0].view(targets.shape), out[1].view(lead)
    return out.view(targets.shape)


def logprobs_reference(
    hidden: torch.Tensor, norm_weight: torch.Tensor | None, eps: float, unembed_weight_VD: torch.Tensor,
    targets: torch.Tensor, *, return_entropy: bool = False, ignore_index: int = IGNORE_INDEX,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The same function written out over all tokens at once (materialises [..., V] float32 logits)."""
    h = rms_norm(hidden, norm_weight, eps) if norm_weight is not None else hidden
    logp = F.linear(h, unembed_weight_VD).float().log_softmax(-1)
    per_token = targets.shape == hidden.shape[:-1]
    targets_K = targets[..., None] if per_token else targets
    valid = targets_K != ignore_index
    logprobs = torch.where(valid, logp.gather(-1, torch.where(valid, targets_K, 0)), 0.0)
    logprobs = logprobs[..., 0] if per_token else logprobs
    if return_entropy:
        return logprobs, -(logp.exp() * logp).sum(-1)
    return logprobs


def _normed(x_CD: torch.Tensor, norm_weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    return rms_norm(x_CD, norm_weight, eps) if norm_weight is not None else x_CD


class _ChunkedLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden_ND, norm_weight, unembed_VD, targets_NK, eps, chunk_size, return_entropy, ignore_index):
        N = hidden_ND.shape[0]
        logprobs_NK = torch.empty(targets_NK.shape, dtype=torch.float32, device=hidden_ND.device)
        lse_N = torch.empty(N, dtype=torch.float32, device=hidden_ND.device)
        entropy_N = torch.empty_like(lse_N) if return_entropy else None
        valid_NK = targets_NK != ignore_index
        safe_targets_NK = torch.where(valid_NK, targets_NK, 0)
        for start in range(0, N, chunk_size):
            rows = slice(start, start + chunk_size)
            logits_CV = F.linear(_normed(hidden_ND[rows], norm_weight, eps), unembed_VD).float()
            lse_C = torch.logsumexp(logits_CV, -1)
            lse_N[rows] = lse_C
            logprobs_NK[rows] = logits_CV.gather(1, safe_targets_NK[rows]) - lse_C[:, None]
            if return_entropy:
                # H = lse - sum_v p_v z_v, with p = exp(z - lse); a batched dot product, so no third [C, V] block.
                p_CV = torch.exp(logits_CV - lse_C[:, None])
                entropy_N[rows] = lse_C - (p_CV[:, None, :] @ logits_CV[:, :, None]).view(-1)
        logprobs_NK.masked_fill_(~valid_NK, 0.0)
        ctx.save_for_backward(hidden_ND, norm_weight, unembed_VD, safe_targets_NK, valid_NK, lse_N, entropy_N)
        ctx.eps, ctx.chunk_size = eps, chunk_size
        ctx.set_materialize_grads(False)  # an output the loss does not use arrives as None: no work for it
        return (logprobs_NK, entropy_N) if return_entropy else logprobs_NK

    @staticmethod
    def backward(ctx, grad_logprobs_NK, grad_entropy_N=None):
        hidden_ND, norm_weight, unembed_VD, targets_NK, valid_NK, lse_N, entropy_N = ctx.saved_tensors
        need_hidden, need_norm, need_unembed = ctx.needs_input_grad[:3]
        grad_hidden_ND = torch.zeros_like(hidden_ND) if need_hidden else None
        grad_norm_D = torch.zeros_like(norm_weight, dtype=torch.float32) if need_norm else None
        grad_unembed_VD = torch.zeros_like(unembed_VD, dtype=torch.float32) if need_unembed else None
        if grad_logprobs_NK is None:
            grad_logprobs_NK = torch.zeros(targets_NK.shape, dtype=torch.float32, device=lse_N.device)
        grad_lp_NK = torch.where(valid_NK, grad_logprobs_NK, 0.0)  # an ignored target's logprob is a constant 0
        # d sum_k g_k logprob_k / dz = sum_k g_k onehot(target_k) - (sum_k g_k) p  (one column: the same numbers)
        grad_lp_N1 = grad_lp_NK if grad_lp_NK.shape[1] == 1 else grad_lp_NK.sum(1, keepdim=True)
        for start in range(0, hidden_ND.shape[0], ctx.chunk_size):
            rows = slice(start, start + ctx.chunk_size)
            with torch.enable_grad():
                x_CD = hidden_ND[rows].detach().requires_grad_(need_hidden)
                w_D = norm_weight.detach().requires_grad_(need_norm) if norm_weight is not None else None
                h_CD = _normed(x_CD, w_D, ctx.eps)
            logits_CV = F.linear(h_CD.detach(), unembed_VD)
            # d logprob / dz = onehot(target) - p;  d entropy / dz = -p (log p + H)
            logp_CV = logits_CV.float().sub_(lse_N[rows, None])
            p_CV = logp_CV.exp()
            coef_CV = grad_lp_N1[rows]
            if grad_entropy_N is not None:
                coef_CV = logp_CV.add_(entropy_N[rows, None]).mul_(grad_entropy_N[rows, None]).add_(coef_CV)
            grad_logits_CV = p_CV.mul_(coef_CV).neg_()
            grad_logits_CV.scatter_add_(1, targets_NK[rows], grad_lp_NK[rows])
            grad_logits_CV = grad_logits_CV.to(logits_CV.dtype)  # the gradient lm_head's matmul would receive
            if need_unembed:  # each chunk's [V, D] contribution accumulates in fp32, never rounded to bf16
                grad_unembed_VD.addmm_(grad_logits_CV.T.float(), h_CD.detach().float())
            if need_hidden or need_norm:
                grad_h_CD = grad_logits_CV @ unembed_VD
                if norm_weight is None:
                    grad_hidden_ND[rows] = grad_h_CD
                else:
                    inputs = [t for t, needed in ((x_CD, need_hidden), (w_D, need_norm)) if needed]
                    grads = iter(torch.autograd.grad(h_CD, inputs, grad_h_CD))
                    if need_hidden:
                        grad_hidden_ND[rows] = next(grads)
                    if need_norm:
                        grad_norm_D += next(grads)
        grad_norm_D = grad_norm_D.to(norm_weight.dtype) if need_norm else None
        grad_unembed_VD = grad_unembed_VD.to(unembed_VD.dtype) if need_unembed else None
        return grad_hidden_ND, grad_norm_D, grad_unembed_VD, None, None, None, None, None
