"""Chunked logprobs (kernels/logprobs.py) against the naive float32 computation (logprobs_reference).

Tolerance (float32, CPU): logprobs and entropies within 1e-5 absolute; every gradient (hidden, norm weight, unembedding
weight) within 1e-5 of the reference relative to that gradient's largest entry. Memory: peak temporary tensor memory
over forward + backward (kernels.memory.TensorMemoryTracker) at most 10% of the naive computation's.
"""
# Shapes: N tokens, B batch, T tokens per row, D hidden, V vocab.

import pytest
import torch
import torch.nn.functional as F

from kernels.logprobs import IGNORE_INDEX, chunked_logprobs, default_chunk_size, logprobs_reference
from kernels.memory import TensorMemoryTracker
from models.llama import CausalLM, ModelArgs
from models.lora import LoraConfig, apply_lora
from services.trainer.engine.logprobs import target_nll_sum

pytestmark = pytest.mark.usefixtures("one_thread")

VALUE_ATOL = 1e-5
GRAD_RTOL = 1e-5


def _inputs(lead_shape, D=48, V=1000, seed=0, with_norm=True):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(*lead_shape, D, generator=gen).requires_grad_()
    norm_weight = (1 + 0.1 * torch.randn(D, generator=gen)).requires_grad_() if with_norm else None
    unembed_VD = (0.2 * torch.randn(V, D, generator=gen)).requires_grad_()
    targets = torch.randint(0, V, lead_shape, generator=gen)
    targets.view(-1)[::7] = IGNORE_INDEX
    cotangents = torch.randn(*lead_shape, generator=gen), torch.randn(*lead_shape, generator=gen)
    return hidden, norm_weight, unembed_VD, targets, cotangents


def _values_and_grads(fn, hidden, norm_weight, unembed_VD, targets, cotangents, return_entropy):
    params = [t for t in (hidden, norm_weight, unembed_VD) if t is not None]
    out = fn(hidden, norm_weight, 1e-6, unembed_VD, targets, return_entropy=return_entropy)
    outs = out if return_entropy else (out,)
    loss = sum((o * c).sum() for o, c in zip(outs, cotangents))
    return [o.detach() for o in outs], torch.autograd.grad(loss, params)


@pytest.mark.parametrize("return_entropy", [False, True], ids=["logprobs", "entropy"])
@pytest.mark.parametrize("with_norm", [True, False], ids=["norm", "no-norm"])
@pytest.mark.parametrize("lead_shape, chunk_size", [((300,), 37), ((3, 50), 64), ((2, 9), 1000)],
                         ids=["ND-uneven-chunks", "NTD", "one-chunk"])
def test_values_and_grads_match_naive_fp32(lead_shape, chunk_size, with_norm, return_entropy):
    inputs = _inputs(lead_shape, with_norm=with_norm)
    got_values, got_grads = _values_and_grads(
        lambda *a, **kw: chunked_logprobs(*a, chunk_size=chunk_size, **kw), *inputs, return_entropy
    )
    ref_values, ref_grads = _values_and_grads(logprobs_reference, *inputs, return_entropy)
    for got, ref in zip(got_values, ref_values):
        assert got.shape == lead_shape and got.dtype == torch.float32
        assert (got - ref).abs().max().item() <= VALUE_ATOL
    targets = inputs[3]
    assert torch.all(got_values[0][targets == IGNORE_INDEX] == 0)
    for got, ref in zip(got_grads, ref_grads):
        rel = ((got - ref).abs().max() / ref.abs().max()).item()
        assert rel <= GRAD_RTOL, rel


@pytest.mark.parametrize("with_norm", [True, False], ids=["norm", "no-norm"])
def test_k_targets_per_token_match_naive_fp32(with_norm):
    """[..., K] targets: K logprobs per token from the same logits (repeated ids and ignored slots included); the
    entropy keeps the tokens' shape. A [..., 1] target gives the per-token form's values and gradients bitwise."""
    hidden, norm_weight, unembed_VD, _, (cot, cot_entropy) = _inputs((3, 40), with_norm=with_norm)
    gen = torch.Generator().manual_seed(1)
    targets = torch.randint(0, unembed_VD.shape[0], (3, 40, 5), generator=gen)
    targets[..., 4] = targets[..., 0]
    targets.view(-1)[::9] = IGNORE_INDEX
    cot_K = torch.randn(3, 40, 5, generator=gen)
    got_values, got_grads = _values_and_grads(
        lambda *a, **kw: chunked_logprobs(*a, chunk_size=17, **kw), hidden, norm_weight, unembed_VD, targets,
        (cot_K, cot_entropy), True,
    )
    ref_values, ref_grads = _values_and_grads(
        logprobs_reference, hidden, norm_weight, unembed_VD, targets, (cot_K, cot_entropy), True
    )
    assert got_values[0].shape == (3, 40, 5) and got_values[1].shape == (3, 40)
    for got, ref in zip(got_values, ref_values):
        assert (got - ref).abs().max().item() <= VALUE_ATOL
    assert torch.all(got_values[0][targets == IGNORE_INDEX] == 0)
    for got, ref in zip(got_grads, ref_grads):
        assert ((got - ref).abs().max() / ref.abs().max()).item() <= GRAD_RTOL
    flat_targets = targets[..., 1]
    flat = _values_and_grads(lambda *a, **kw: chunked_logprobs(*a, chunk_size=17, **kw), hidden, norm_weight,
                             unembed_VD, flat_targets, (cot,), False)
    one = _values_and_grads(lambda *a, **kw: chunked_logprobs(*a, chunk_size=17, **kw), hidden, norm_weight,
                            unembed_VD, flat_targets[..., None], (cot[..., None],), False)
    assert torch.equal(flat[0][0], one[0][0][..., 0])
    assert all(torch.equal(a, b) for a, b in zip(flat[1], one[1]))


def test_bf16_inputs_match_naive_bf16_semantics():
    """bf16 hidden and weights: the same bf16 matmul per token, so the float32 values agree to float32 rounding;
    the bf16 gradients within a few bf16 rounding steps (4 * 2^-8 of the largest entry: the chunked unembedding
    gradient is summed in float32, the naive one comes out of one bf16 matmul)."""
    hidden, norm_weight, unembed_VD, targets, cotangents = _inputs((200,), D=64)
    inputs = [t.detach().bfloat16().requires_grad_() for t in (hidden, norm_weight, unembed_VD)]
    got_values, got_grads = _values_and_grads(
        lambda *a, **kw: chunked_logprobs(*a, chunk_size=33, **kw), *inputs, targets, cotangents, True
    )
    ref_values, ref_grads = _values_and_grads(logprobs_reference, *inputs, targets, cotangents, True)
    for got, ref in zip(got_values, ref_values):
        assert got.dtype == torch.float32 and (got - ref).abs().max().item() <= 1e-4
    for got, ref in zip(got_grads, ref_grads):
        assert got.dtype == torch.bfloat16
        assert ((got.float() - ref.float()).abs().max() / ref.float().abs().max()).item() <= 4 * 2**-8


def test_only_requested_gradients_and_no_grad_mode():
    hidden, norm_weight, unembed_VD, targets, _ = _inputs((40,))
    unembed_VD.requires_grad_(False)  # a frozen (e.g. tied, LoRA-trained) lm_head
    (grad_hidden,) = torch.autograd.grad(
        chunked_logprobs(hidden, None, 0.0, unembed_VD, targets, chunk_size=16).sum(), [hidden]
    )
    (ref,) = torch.autograd.grad(logprobs_reference(hidden, None, 0.0, unembed_VD, targets).sum(), [hidden])
    assert ((grad_hidden - ref).abs().max() / ref.abs().max()).item() <= GRAD_RTOL
    with torch.no_grad():
        out = chunked_logprobs(hidden, norm_weight, 1e-6, unembed_VD, targets, chunk_size=16)
    assert not out.requires_grad


def test_clear_errors():
    hidden, _, unembed_VD, targets, _ = _inputs((10,))
    with pytest.raises(ValueError, match="chunk_size must be >= 1"):
        chunked_logprobs(hidden, None, 0.0, unembed_VD, targets, chunk_size=0)
    with pytest.raises(ValueError, match="leading shape"):
        chunked_logprobs(hidden, None, 0.0, unembed_VD, targets[:5], chunk_size=4)


def test_peak_memory_at_most_a_tenth_of_naive():
    """Forward + backward, w.r.t. hidden and the unembedding, N=1024 tokens, V=16384 (bench/logprobs_memory.py
    measures N=8192, V=128k)."""
    N, D, V, chunk = 1024, 64, 16384, 32
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(N, D, generator=gen).requires_grad_()
    unembed_VD = (0.1 * torch.randn(V, D, generator=gen)).requires_grad_()
    targets = torch.randint(0, V, (N,), generator=gen)
    peaks = {}
    for name, fn in (("naive", logprobs_reference),
                     ("chunked", lambda *a: chunked_logprobs(*a, chunk_size=chunk))):
        hidden.grad = unembed_VD.grad = None
        with TensorMemoryTracker() as mem:
            fn(hidden, None, 0.0, unembed_VD, targets).sum().backward()
        peaks[name] = mem.peak_bytes
    ratio = peaks["chunked"] / peaks["naive"]
    print(f"peak bytes naive {peaks['naive']}, chunked {peaks['chunked']}, ratio {ratio:.3f}")
    assert peaks["naive"] >= 2 * N * V * 4  # sanity: the naive side holds [N, V] float32 blocks
    assert peaks["chunked"] <= 0.1 * peaks["naive"]


def test_default_chunk_size():
    assert default_chunk_size(131072) == 128
    assert default_chunk_size(10**9) == 1


def _tiny_llama(tie: bool) -> CausalLM:
    args = ModelArgs.from_hf_config({
        "architectures": ["LlamaForCausalLM"], "vocab_size": 97, "hidden_size": 32, "intermediate_size": 48,
        "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64,
        "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": tie,
    })
    torch.manual_seed(0)
    model = CausalLM(args)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0, 0.1)
    return model


@pytest.mark.parametrize("lm_head_lora", [False, True], ids=["plain-lm_head", "lora-lm_head"])
def test_trainer_nll_matches_cross_entropy_over_logits(lm_head_lora):
    """services/trainer/sft.py's loss: chunked over a plain lm_head, per-chunk recomputation when LoRA wraps it."""
    model = _tiny_llama(tie=False)
    targets = ("q_proj", "lm_head") if lm_head_lora else ("q_proj",)
    params = apply_lora(model, LoraConfig(rank=4, alpha=8.0, dropout=0.0, target_modules=targets), seed=0)
    with torch.no_grad():
        for p in params:
            p.normal_(0, 0.1)
    gen = torch.Generator().manual_seed(1)
    ids_BT = torch.randint(0, 97, (3, 21), generator=gen)
    targets_BT = torch.randint(0, 97, (3, 21), generator=gen)
    targets_BT[:, :4] = IGNORE_INDEX
    nll = target_nll_sum(model, ids_BT, targets_BT, chunk_size=8)
    grads = torch.autograd.grad(nll, params)
    ref = F.cross_entropy(model(ids_BT).flatten(0, 1), targets_BT.flatten(), ignore_index=IGNORE_INDEX,
                          reduction="sum")
    ref_grads = torch.autograd.grad(ref, params)
    assert abs(nll.item() - ref.item()) <= VALUE_ATOL * abs(ref.item())
    for got, want in zip(grads, ref_grads):
        assert ((got - want).abs().max() / want.abs().max()).item() <= GRAD_RTOL
