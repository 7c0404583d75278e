"""Routed-expert memory and accuracy: bfloat16 experts (baseline) against 4-bit packed experts (kernels/quant4.py).

    .venv/bin/python bench/expert_memory.py          # one Qwen3-30B-A3B MoE layer: 128 experts, top-8, D=2048, I=768

One random MoE layer (models.moe.MoE, expert weights N(0, 0.02^2) like a fresh init, router likewise) with the shapes
of a published config (models/configs/), run on random hidden states x ~ N(0, 1). Printed side by side:
- expert bytes: real tensor sizes (numel * element_size; packed buffers + scales), and the ratio;
- accuracy: the relative RMS error of the layer output and the mean KL(bf16 || 4-bit) of a random unembedding
  (V=32768, logits std ~2) applied to RMS-normalised hidden states, in two readings: the layer output alone
  (pessimistic: nothing hides the error) and the residual stream x + layer(x). The float32 layer against the bf16
  one gives the noise floor of bf16 itself;
- peak memory of one forward (kernels.memory.TensorMemoryTracker: activations included, so equal peaks mean
  the 4-bit path added nothing above them) and its wall time after a warm-up;
- whole-model expert bytes for each MoE config in models/configs, from the same byte formula.
"""

import argparse
import copy
import json
import time
from pathlib import Path

import torch

from kernels.memory import TensorMemoryTracker
from models.moe import MoE, MoEArgs, quantize_experts_

CONFIGS = Path(__file__).resolve().parent.parent / "models" / "configs"
GIB, MIB = 2**30, 2**20


def packed_bytes_per_weight(block_size: int) -> float:
    return 0.5 + 2 / block_size  # two 4-bit values per byte + one bfloat16 scale per block


def expert_shapes(config: dict) -> tuple[int, int, int, int]:
    """(MoE layers, experts, hidden, moe_intermediate) of a Qwen3-MoE / DeepSeek-V3 style config.json."""
    config = config.get("text_config", config)
    layers = config["num_hidden_layers"]
    if "n_routed_experts" in config:  # DeepSeek-V3 / Kimi K2: dense first_k_dense_replace layers
        moe_layers = layers - config.get("first_k_dense_replace", 0)
        return moe_layers, config["n_routed_experts"], config["hidden_size"], config["moe_intermediate_size"]
    step, dense = config.get("decoder_sparse_step", 1), set(config.get("mlp_only_layers") or ())
    moe_layers = sum(1 for i in range(layers) if i not in dense and (i + 1) % step == 0)
    return moe_layers, config["num_experts"], config["hidden_size"], config["moe_intermediate_size"]


def logprobs(h_ND: torch.Tensor, unembed_VD: torch.Tensor) -> torch.Tensor:
    h_ND = h_ND.float()
    h_ND = h_ND * torch.rsqrt(h_ND.square().mean(-1, keepdim=True) + 1e-6)
    return (h_ND @ unembed_VD.T).log_softmax(-1)


def kl(p_log: torch.Tensor, q_log: torch.Tensor) -> float:
    return (p_log.exp() * (p_log - q_log)).sum(-1).mean().item()


def forward(block: MoE, x_BTD: torch.Tensor) -> tuple[torch.Tensor, int, float]:
    with torch.no_grad():
        block(x_BTD[:, :16])  # warm-up: first-call costs (allocator, BLAS setup) out of the timing
    with torch.no_grad(), TensorMemoryTracker() as mem:
        start = time.perf_counter()
        out = block(x_BTD)
        seconds = time.perf_counter() - start
    return out, mem.peak_bytes, seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="qwen3-30b-a3b", help="a folder of models/configs for the layer shapes")
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--formats", default="nf4,int4")
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    config = json.loads((CONFIGS / args.config / "config.json").read_text())
    _, E, D, I = expert_shapes(config)
    K = config.get("text_config", config)["num_experts_per_tok"]
    torch.manual_seed(0)
    block32 = MoE(MoEArgs(E, K, D, I, "softmax", norm_topk_prob=True), layer_idx=0)
    x_BTD = torch.randn(1, args.tokens, D)
    unembed_VD = torch.randn(32768, D) * (2 / D**0.5)

    ref32, _, _ = forward(block32, x_BTD)
    block = copy.deepcopy(block32).to(torch.bfloat16)
    del block32
    base, base_peak, base_s = forward(block, x_BTD.to(torch.bfloat16))
    base_bytes = block.experts.weight_nbytes()
    one_expert = 2 * I * D * 2  # gate_up_proj of one expert in bf16
    x_ND = x_BTD[0]
    ref_alone, ref_resid = logprobs(base[0], unembed_VD), logprobs(x_ND + base[0].float(), unembed_VD)
    floor = kl(logprobs(ref32[0], unembed_VD), ref_alone)
    floor_rel = ((base.float() - ref32).norm() / ref32.norm()).item()

    print(f"one MoE layer with {args.config} shapes: E={E} experts, top-{K}, D={D}, I={I}; {args.tokens} tokens; "
          f"CPU, {torch.get_num_threads()} threads; compute dtype bfloat16")
    print(f"noise floor, float32 layer vs bf16 layer: rel err {floor_rel:.4f}, KL alone {floor:.3g} nats/token")
    header = f"{'experts':<14}{'bytes':>14}{'ratio':>8}{'rel err':>10}{'KL alone':>11}{'KL resid':>11}" \
             f"{'fwd peak MiB':>14}{'fwd s':>8}"
    print(header)
    print(f"{'bf16 (base)':<14}{base_bytes:>14,}{1.0:>8.2f}{0.0:>10.4f}{0.0:>11.3g}{0.0:>11.3g}"
          f"{base_peak / MIB:>14.1f}{base_s:>8.2f}")
    for fmt in args.formats.split(","):
        quantized = copy.deepcopy(block)
        quantize_experts_(quantized, fmt, args.block_size)
        out, peak, seconds = forward(quantized, x_BTD.to(torch.bfloat16))
        nbytes = quantized.experts.weight_nbytes()
        rel = ((out.float() - base.float()).norm() / base.float().norm()).item()
        kl_alone = kl(ref_alone, logprobs(out[0], unembed_VD))
        kl_resid = kl(ref_resid, logprobs(x_ND + out[0].float(), unembed_VD))
        print(f"{f'{fmt}/{args.block_size}':<14}{nbytes:>14,}{base_bytes / nbytes:>8.2f}{rel:>10.4f}{kl_alone:>11.3g}"
              f"{kl_resid:>11.3g}{peak / MIB:>14.1f}{seconds:>8.2f}")
        del quantized
    print(f"4-bit forward extra peak is bounded by one expert at a time: one expert's gate_up_proj is "
          f"{one_expert / MIB:.1f} MiB in bf16, every expert {base_bytes / MIB:.0f} MiB")

    print(f"\nwhole-model routed-expert weights, bf16 vs 4-bit/{args.block_size} (same byte formula):")
    for folder in sorted(p.name for p in CONFIGS.iterdir() if (p / "config.json").is_file()):
        cfg = json.loads((CONFIGS / folder / "config.json").read_text())
        if not any(k in cfg.get("text_config", cfg) for k in ("num_experts", "n_routed_experts")):
            continue
        layers, e, d, i = expert_shapes(cfg)
        weights = layers * e * 3 * i * d  # gate_up_proj 2I x D + down_proj D x I per expert
        bf16, packed = 2 * weights, weights * packed_bytes_per_weight(args.block_size)
        print(f"  {folder:<20} {layers} MoE layers x {e} experts: {bf16 / GIB:8.1f} GiB -> {packed / GIB:7.1f} GiB "
              f"({bf16 / packed:.2f}x)")


if __name__ == "__main__":
    main()
