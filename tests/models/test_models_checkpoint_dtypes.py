"""A bf16 load keeps DeepSeek's router and selection bias in float32, as transformers does, so expert choices match."""

import torch
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

from models import load_pretrained


def test_bf16_load_keeps_the_deepseek_router_in_float32(tmp_path):
    torch.manual_seed(0)
    cfg = DeepseekV3Config(vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4,
                           num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1, q_lora_rank=32,
                           kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                           max_position_embeddings=64)
    DeepseekV3ForCausalLM(cfg).save_pretrained(tmp_path)
    ours = load_pretrained(tmp_path, dtype=torch.bfloat16)
    hf = DeepseekV3ForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    router = {n: t.dtype for n, t in [*ours.named_parameters(), *ours.named_buffers()] if ".mlp.gate." in n}
    assert router and set(router.values()) == {torch.float32}, router
    assert ours.model.layers["1"].self_attn.o_proj.weight.dtype == torch.bfloat16
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        diff = (ours(ids).float() - hf(ids).logits.float()).abs().max().item()
    assert diff <= 2 ** -7, diff  # one bf16 ulp at the logits' magnitude (|logits| < 1 here)


def test_sharded_save_loads_in_transformers_and_back(tmp_path):
    from transformers import AutoModelForCausalLM

    from models import save_pretrained
    from models.tiny import build_tiny_model

    model = load_pretrained(build_tiny_model(tmp_path / "src", family="qwen3_moe"))
    save_pretrained(model, tmp_path / "sharded", max_shard_bytes=1 << 20)
    shards = sorted(p.name for p in (tmp_path / "sharded").glob("*.safetensors"))
    assert len(shards) > 2 and (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    ids = torch.randint(3, 1000, (1, 9), generator=torch.Generator().manual_seed(0))
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "sharded", dtype=torch.float32)
    again = load_pretrained(tmp_path / "sharded")
    with torch.no_grad():
        ref = model(ids)
        assert torch.equal(again(ids), ref)
        assert (hf(ids).logits - ref).abs().max() <= 1e-5


def test_saving_4bit_experts_is_refused(tmp_path):
    import pytest

    from models import save_pretrained
    from models.moe import quantize_experts_
    from models.tiny import build_tiny_model

    model = load_pretrained(build_tiny_model(tmp_path / "src", family="qwen3_moe"))
    quantize_experts_(model, block_size=32)
    with pytest.raises(ValueError, match="4-bit frozen experts"):
        save_pretrained(model, tmp_path / "out")
    assert not (tmp_path / "out" / "model.safetensors").exists()
