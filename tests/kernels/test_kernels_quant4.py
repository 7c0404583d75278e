"""4-bit frozen experts (kernels/quant4.py, models.moe.Experts.quantize_), on the tiny Qwen3-MoE config of
test_models_qwen3_moe (hidden 64, 3 layers with layer 0 dense, 8 experts, top-2, moe_intermediate 32), float32.

Named references and tolerances:
- the byte layout of docs/quant4.md, checked value by value;
- dequantization error per element <= half the largest codebook gap times the block scale (+ 2^-8 of the scale for
  the bfloat16 rounding of the scale);
- the same model dequantized into plain Parameters (kernels.moe "loop" backend): logits, input gradients and LoRA
  gradients BITWISE equal (the 4-bit path runs the same per-expert F.linear on the same dequantized values); with
  the "grouped" backend within 1e-6 absolute;
- memory: real tensor bytes, bfloat16 experts / packed experts >= 3.5; extra peak memory of a quantized forward and
  backward <= 8 bytes per weight of ONE expert (kernels.memory.TensorMemoryTracker).
"""

import copy

import pytest
import torch
import torch.nn.functional as F
import transformers

from kernels.memory import TensorMemoryTracker
from kernels.moe import grouped_mm_supported
from kernels.quant4 import Packed4Weight, codebook, dequantize_4bit, quantize_4bit
from models import load_pretrained
from models.lora import LoraConfig, apply_lora, lora_state_dict, merge_adapter, set_trainable
from models.moe import Experts, MoE, MoEArgs, RouterReplay, dequantize_experts_, quantize_experts_

BLOCK = 32  # moe_intermediate_size 32 is down_proj's input dimension


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    config = transformers.Qwen3MoeConfig(
        vocab_size=211, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=256, rms_norm_eps=1e-6, moe_intermediate_size=32,
        num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[0], tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(config).float()
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    path = tmp_path_factory.mktemp("tiny_qwen3_moe")
    model.save_pretrained(path)
    return path


def _ids(seed: int = 1, shape=(3, 19)) -> torch.Tensor:
    return torch.randint(0, 211, shape, generator=torch.Generator().manual_seed(seed))


def _experts(model) -> list[Experts]:
    return [m for m in model.modules() if isinstance(m, Experts)]


@pytest.mark.parametrize("fmt", ["nf4", "int4"])
def test_packed_layout_is_the_documented_one(fmt):
    # one row, two blocks of 32: block 0 starts [1.0, -1.0, 0.0, 0.0, ...] (absmax 1), block 1 is all 0.25
    w = torch.zeros(1, 64)
    w[0, :2] = torch.tensor([1.0, -1.0])
    w[0, 32:] = 0.25
    packed, scales = quantize_4bit(w, fmt, block_size=32)
    assert packed.dtype == torch.uint8 and packed.shape == (1, 32)
    assert scales.dtype == torch.int16 and scales.shape == (1, 2)
    assert scales.view(torch.bfloat16).tolist() == [[1.0, 0.25]]  # bfloat16 bits in an int16 buffer
    top, bottom, zero = (15, 0, 7) if fmt == "nf4" else (15, 1, 8)  # int4: value (index - 8) / 7
    assert packed[0, 0].item() == top | (bottom << 4)  # feature 0 in the LOW nibble, feature 1 in the HIGH one
    assert packed[0, 1].item() == zero | (zero << 4)
    assert packed[0, 16].item() == top | (top << 4)  # 0.25 / 0.25 = 1.0
    table = codebook(fmt)
    assert table[zero] == 0 and table[top] == 1 and table[bottom] == -1
    assert torch.equal(dequantize_4bit(packed, scales, fmt, torch.float32), w)


@pytest.mark.parametrize("fmt", ["nf4", "int4"])
@pytest.mark.parametrize("block_size", [32, 64])
def test_dequantization_error_is_at_most_half_a_codebook_step(fmt, block_size):
    w = torch.randn(3, 16, 128, generator=torch.Generator().manual_seed(0)) * 0.02
    packed, scales = quantize_4bit(w, fmt, block_size)
    back = dequantize_4bit(packed, scales, fmt, torch.float32)
    scale = scales.view(torch.bfloat16).float().repeat_interleave(block_size, dim=-1)
    half_step = (codebook(fmt).diff().max() / 2).item()
    assert ((back - w).abs() <= (half_step + 2**-8) * scale).all()
    rel = ((back - w).norm() / w.norm()).item()
    print(f"{fmt} block {block_size}: relative RMS error of gaussian weights {rel:.4f}")
    assert rel < 0.12
    assert torch.equal(dequantize_4bit(packed, scales, fmt, torch.bfloat16), back.to(torch.bfloat16))


def test_expert_memory_is_at_least_3_5x_smaller_than_bf16(tiny_dir):
    model = load_pretrained(tiny_dir, dtype=torch.bfloat16)
    bf16_bytes = sum(e.weight_nbytes() for e in _experts(model))
    numel = sum(getattr(e, n).numel() for e in _experts(model) for n in Experts.WEIGHT_NAMES)
    assert bf16_bytes == 2 * numel
    assert quantize_experts_(model, "nf4", BLOCK) == 2
    packed_bytes = sum(e.weight_nbytes() for e in _experts(model))
    assert packed_bytes == numel // 2 + 2 * numel // BLOCK  # 4 bits + one bf16 scale per block
    ratio = bf16_bytes / packed_bytes
    print(f"tiny Qwen3-MoE experts: bf16 {bf16_bytes} B, packed nf4/{BLOCK} {packed_bytes} B, ratio {ratio:.3f}x")
    assert ratio >= 3.5
    block64 = Experts(MoEArgs(8, 2, 128, 64, "softmax", True)).to(torch.bfloat16)
    before = block64.weight_nbytes()
    block64.quantize_("int4", 64)
    assert before / block64.weight_nbytes() == 16 / 4.25  # 4 bits + 16 / 64


def test_forward_and_lora_grads_match_the_dequantized_model_bitwise(tiny_dir):
    quantized = load_pretrained(tiny_dir)
    quantize_experts_(quantized, "nf4", BLOCK)
    params = apply_lora(quantized, LoraConfig(rank=4, alpha=8.0), seed=0)  # attention + experts (default menu)
    with torch.no_grad():
        for tensor in lora_state_dict(quantized).values():
            tensor.normal_(0, 0.1, generator=torch.Generator().manual_seed(3))
    plain = copy.deepcopy(quantized)
    dequantize_experts_(plain, torch.float32)
    assert not any(e.is_quantized for e in _experts(plain))
    assert all(not e.gate_up_proj.requires_grad for e in _experts(plain))
    names = [n for n, p in quantized.named_parameters() if p.requires_grad]
    assert len(names) == len(params)
    q_params = [dict(quantized.named_parameters())[n] for n in names]
    plain_params = [dict(plain.named_parameters())[n] for n in names]
    ids = _ids()

    def step(model, lora_params):
        """Logits, LoRA gradients and the gradient reaching the embedding table (the input gradient)."""
        embeddings = model.model.embed_tokens.weight
        embeddings.requires_grad_(True)
        logits = model(ids)
        F.cross_entropy(logits[:, :-1].reshape(-1, 211), ids[:, 1:].reshape(-1)).backward()
        embeddings.requires_grad_(False)
        return logits.detach(), [p.grad for p in lora_params], embeddings.grad

    for backend, exact in (("loop", True), ("grouped", False)):
        for e in _experts(plain):
            e.backend = backend
        for p in [*params, *plain_params]:
            p.grad = None
        quantized.model.embed_tokens.weight.grad = plain.model.embed_tokens.weight.grad = None
        q_logits, q_grads, q_input_grad = step(quantized, q_params)
        p_logits, p_grads, p_input_grad = step(plain, plain_params)
        pairs = [(q_logits, p_logits), (q_input_grad, p_input_grad), *zip(q_grads, p_grads, strict=True)]
        for ours, ref in pairs:
            if exact:
                assert torch.equal(ours, ref)
            else:
                torch.testing.assert_close(ours, ref, atol=1e-6, rtol=0)
    expert_lora = [p for n, p in quantized.named_parameters() if ".experts.lora." in n]
    assert len(expert_lora) == 8 and all(p.grad.abs().max() > 0 for p in expert_lora)


def test_logits_kl_against_the_unquantized_model(tiny_dir):
    model = load_pretrained(tiny_dir)
    ids = _ids(seed=2, shape=(4, 32))
    with torch.no_grad():
        ref_logprobs = model(ids).log_softmax(-1)
    for fmt in ("nf4", "int4"):
        quantized = copy.deepcopy(model)
        quantize_experts_(quantized, fmt, BLOCK)
        with torch.no_grad():
            logprobs = quantized(ids).log_softmax(-1)
        kl = (ref_logprobs.exp() * (ref_logprobs - logprobs)).sum(-1).mean().item()
        print(f"tiny Qwen3-MoE, experts {fmt}/{BLOCK}: mean KL(unquantized || quantized) = {kl:.3g} nats/token")
        assert 0 < kl < 1e-3


def test_extra_memory_is_one_expert_at_a_time():
    """Weights dominate here (16 experts of 3 x 256 x 256, 32 tokens), so dequantizing all of them would show."""
    torch.manual_seed(0)
    E, D, I, N = 16, 256, 256, 32
    block = MoE(MoEArgs(E, 2, D, I, "softmax", True), layer_idx=0)
    apply_lora(block, LoraConfig(rank=4, target_modules=("experts",)), seed=0)
    experts = block.experts
    x_ND = torch.randn(N, D, requires_grad=True)
    ids_NK = torch.stack([torch.arange(N) % E, (torch.arange(N) + 1) % E], dim=1)  # every expert gets rows
    weights_NK = torch.rand(N, 2)

    def peak(module):
        with TensorMemoryTracker() as mem:
            module(x_ND, ids_NK, weights_NK).sum().backward()
        return mem.peak_bytes, mem.largest_bytes

    plain_peak, _ = peak(experts)
    experts.quantize_("nf4", 64)
    quant_peak, quant_largest = peak(experts)
    one_expert = 2 * I * D  # weights of the largest per-expert matrix, gate_up_proj [2I, D]
    all_experts_bf16 = 2 * E * 3 * I * D
    print(f"forward+backward peak bytes: plain fp32 experts {plain_peak}, 4-bit {quant_peak}; one expert's "
          f"gate_up in fp32 {4 * one_expert}, every expert in bf16 {all_experts_bf16}")
    assert quant_largest <= 4 * one_expert  # no tensor bigger than one expert's weight in float32
    assert quant_peak <= plain_peak + 8 * one_expert
    assert quant_peak < all_experts_bf16 / 2


def test_router_replay_on_quantized_experts():
    torch.manual_seed(0)
    block = MoE(MoEArgs(8, 2, 64, 32, "softmax", True), layer_idx=3)
    quantize_experts_(block, "nf4", 32)
    x = torch.randn(2, 5, 64)
    with torch.no_grad():
        recorded = RouterReplay.record()
        live = block(x, routing=recorded)
        assert torch.equal(block(x, routing=RouterReplay.replay(recorded.expert_ids)), live)


def test_errors_name_the_knob_and_dtype_moves_keep_the_format(tiny_dir):
    model = load_pretrained(tiny_dir)
    with pytest.raises(ValueError, match=r"block_size=64 must divide the input dimension 32; pick one of \(32, 64\)"):
        quantize_experts_(model, "nf4", 64)
    assert not any(e.is_quantized for e in _experts(model))  # nothing half-done
    with pytest.raises(ValueError, match="4-bit format must be one of"):
        quantize_experts_(model, "fp4", 32)
    with pytest.raises(ValueError, match="block_size must be one of"):
        quantize_experts_(model, "nf4", 16)
    with pytest.raises(ValueError, match="has no routed experts"):
        quantize_experts_(model.model.layers["0"], "nf4", 32)

    apply_lora(model, LoraConfig(rank=4, target_modules=("experts",)), seed=0)
    merge_adapter(model, "default")
    with pytest.raises(ValueError, match="is merged into the expert weights; unmerge_adapter it before quantizing"):
        quantize_experts_(model, "nf4", 32)

    model = load_pretrained(tiny_dir)
    quantize_experts_(model, "int4", 32)
    with pytest.raises(ValueError, match="already quantized"):
        quantize_experts_(model, "nf4", 32)
    with pytest.raises(ValueError, match="mode='full' cannot train 4-bit experts"):
        set_trainable(model, "full")
    apply_lora(model, LoraConfig(rank=4, target_modules=("experts",)), seed=0)
    with pytest.raises(ValueError, match="Cannot merge into 4-bit experts"):
        merge_adapter(model, "default")
    model.to(torch.bfloat16)  # float buffers follow model.to(dtype); the packed format must not
    packed = model.model.layers["1"].mlp.experts.gate_up_proj
    assert isinstance(packed, Packed4Weight) and packed.packed.dtype == torch.uint8
    assert packed.scales.dtype == torch.int16 and packed.fmt == "int4" and packed.block_size == 32
    assert model(_ids()).dtype == torch.bfloat16
    assert not grouped_mm_supported(torch.zeros(3, 2), torch.zeros(4, 5, 2))  # rank-2 fp32 rows: 8-byte stride
