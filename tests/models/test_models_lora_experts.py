"""LoRA on routed experts (models.lora_layers.ExpertsLoRA), default targets on all-MoE models, set_trainable.

Named references and tolerances (float32, CPU):
- a naive per-expert loop computing W_e + scaling * B_e @ A_e explicitly, token by token: outputs and LoRA gradients
  within 1e-5 (outputs absolute, gradients relative to their largest entry);
- peft.PeftModel on transformers' Qwen3MoeForCausalLM with the same adapter (peft's `target_parameters`), both
  directions: logits max abs diff <= 1e-5;
- merge -> unmerge restores the expert weights within 1e-6 absolute (one fp32 rounding of W + delta - delta).
Bitwise: a freshly added adapter (B = 0) gives the base logits; replaying the live routing gives the unreplayed
outputs and gradients.
"""
# Shapes: N tokens, K top-k, E experts, D hidden, I moe_intermediate_size, r rank.

import json

import peft
import pytest
import torch
import torch.nn.functional as F
import transformers

from models import load_pretrained
from models.lora import (
    DEFAULT_TARGETS,
    ExpertsLoRA,
    LoraConfig,
    adapter_names,
    apply_lora,
    load_peft_adapter,
    lora_state_dict,
    merge_adapter,
    remove_adapter,
    save_peft_adapter,
    set_active_adapter,
    set_trainable,
    unmerge_adapter,
)
from models.moe import MoE, RouterReplay
from models.qwen3_moe import CausalLM, ModelArgs

ATOL = 1e-5
E, K, D, I = 8, 2, 64, 48  # 2I != D, so a transposed gate_up factor cannot pass for the right one
pytestmark = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")


def _hf_config(**overrides) -> transformers.Qwen3MoeConfig:
    """All-MoE like Qwen3-30B-A3B (mlp_only_layers empty): no dense gate_proj/up_proj/down_proj anywhere."""
    kwargs = {
        "vocab_size": 211, "hidden_size": D, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 32, "max_position_embeddings": 256, "moe_intermediate_size": I,
        "num_experts": E, "num_experts_per_tok": K, "norm_topk_prob": True, "mlp_only_layers": [],
        "tie_word_embeddings": False,
    }
    return transformers.Qwen3MoeConfig(**{**kwargs, **overrides})


def _make_hf() -> transformers.Qwen3MoeForCausalLM:
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(_hf_config()).float()
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    return model.eval()


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf_qwen3_moe_all_moe")
    _make_hf().save_pretrained(path)
    return path


def _ids(seed: int = 1, shape=(2, 11)) -> torch.Tensor:
    return torch.randint(0, 211, shape, generator=torch.Generator().manual_seed(seed))


def _randomize(model, name: str = "default", seed: int = 5, std: float = 0.1) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for tensor in lora_state_dict(model, name).values():
            tensor.copy_(torch.randn(tensor.shape, generator=gen) * std)


def test_default_targets_cover_attention_and_experts_of_an_all_moe_model(hf_dir):
    model = load_pretrained(hf_dir)
    params = apply_lora(model, LoraConfig(rank=4), seed=0)
    layer = model.model.layers["0"]
    assert isinstance(layer.mlp.experts.lora, ExpertsLoRA)
    assert {type(getattr(layer.self_attn, n)).__name__ for n in ("q_proj", "k_proj", "v_proj", "o_proj")} == {
        "LoRALinear"
    }
    # 4 attention Linears x (A, B) + 2 fused expert tensors x (A, B), per layer
    assert len(params) == (4 * 2 + 2 * 2) * model.args.num_layers
    lora = layer.mlp.experts.lora
    assert tuple(lora.lora_A["default"]["gate_up_proj"].shape) == (E * 4, D)  # [E*r, D]
    assert tuple(lora.lora_B["default"]["gate_up_proj"].shape) == (2 * I, 4 * E)  # [2I, r*E]
    assert tuple(lora.lora_A["default"]["down_proj"].shape) == (E * 4, I)
    assert tuple(lora.lora_B["default"]["down_proj"].shape) == (D, 4 * E)
    assert set(DEFAULT_TARGETS) >= {"q_proj", "gate_proj", "experts"}

    fresh = load_pretrained(hf_dir)
    with pytest.raises(ValueError, match=r"Unknown LoRA target_modules \['gate_proj'\]; valid module names are "
                                         r"\[.*'experts', 'experts.down_proj', 'experts.gate_up_proj'"):
        apply_lora(fresh, LoraConfig(target_modules=("q_proj", "gate_proj")))
    apply_lora(fresh, LoraConfig(rank=2, target_modules=("experts.down_proj",)), seed=0)
    lora = fresh.model.layers["1"].mlp.experts.lora
    assert list(lora.lora_A["default"]) == ["down_proj"]
    assert type(fresh.model.layers["1"].self_attn.q_proj).__name__ == "Linear"


def test_fresh_adapter_is_bitwise_base_and_inits_follow_peft(hf_dir):
    model = load_pretrained(hf_dir)
    ids = _ids()
    with torch.no_grad():
        base = model(ids)
    params = apply_lora(model, LoraConfig(rank=8, target_modules=("q_proj", "experts")), seed=0)
    with torch.no_grad():
        assert torch.equal(model(ids), base)
    A = model.model.layers["0"].mlp.experts.lora.lora_A["default"]["gate_up_proj"]
    assert A.abs().max() <= 1 / D**0.5  # kaiming-uniform a=sqrt(5): bound 1/sqrt(fan_in), fan_in = D per expert
    assert all(p.abs().max() == 0 for p in params[1::2])  # every B starts at zero

    gaussian = load_pretrained(hf_dir)
    apply_lora(gaussian, LoraConfig(rank=8, target_modules=("experts",), init="gaussian"), seed=0)
    A = gaussian.model.layers["0"].mlp.experts.lora.lora_A["default"]["down_proj"]
    assert abs(A.std().item() - 1 / 8) < 0.01  # peft's "gaussian": std 1/r
    with pytest.raises(ValueError, match="LoRA init must be one of"):
        LoraConfig(init="pissa")


def _naive_moe(block: MoE, x_ND: torch.Tensor, lora: ExpertsLoRA, name: str) -> torch.Tensor:
    """Token by token, expert by expert, with W_e + scaling * B_e @ A_e built explicitly from peft's layout."""
    scores = block.gate.scores(x_ND)
    ids_NK = block.gate.select(scores)
    weights_NK = block.gate.gate_weights(scores, ids_NK, x_ND.dtype)
    r, s = lora.rank(name), lora.scaling[name]

    def effective(weight: str, e: int) -> torch.Tensor:
        A = lora.lora_A[name][weight][e * r : (e + 1) * r]  # rows e*r .. e*r+r-1
        B = lora.lora_B[name][weight][:, e::E]  # columns j*E + e
        return getattr(block.experts, weight)[e] + s * B @ A

    rows = []
    for n in range(x_ND.shape[0]):
        out = torch.zeros(D)
        for k in range(K):
            e = int(ids_NK[n, k])
            gate, up = (effective("gate_up_proj", e) @ x_ND[n]).chunk(2)
            out = out + weights_NK[n, k] * (effective("down_proj", e) @ (F.silu(gate) * up))
        rows.append(out)
    return torch.stack(rows)


@pytest.mark.parametrize("backend", ["loop", "grouped"])
def test_expert_lora_matches_naive_per_expert_reference_values_and_grads(hf_dir, backend):
    model = load_pretrained(hf_dir)
    apply_lora(model, LoraConfig(rank=4, alpha=12.0, target_modules=("experts",)), seed=0)
    _randomize(model)
    block = model.model.layers["1"].mlp
    block.experts.backend = backend
    lora = block.experts.lora
    x_ND = torch.randn(13, D, generator=torch.Generator().manual_seed(3))
    grad_ND = torch.randn(13, D, generator=torch.Generator().manual_seed(4))

    def run(fn):
        for p in lora.parameters():
            p.grad = None
        out = fn()
        (out * grad_ND).sum().backward()
        return out.detach(), [p.grad.clone() for p in lora.parameters()]

    ours, ours_grads = run(lambda: block(x_ND[None])[0])
    ref, ref_grads = run(lambda: _naive_moe(block, x_ND, lora, "default"))
    torch.testing.assert_close(ours, ref, atol=ATOL, rtol=0)
    for g, g_ref in zip(ours_grads, ref_grads, strict=True):
        assert g.abs().max() > 0
        torch.testing.assert_close(g, g_ref, atol=ATOL * g_ref.abs().max().item(), rtol=0)
    # and the base parameters took no gradient: they are frozen
    assert block.experts.gate_up_proj.grad is None and block.gate.weight.grad is None


def test_only_lora_params_get_gradients_through_the_model(hf_dir):
    model = load_pretrained(hf_dir)
    params = apply_lora(model, LoraConfig(rank=4), seed=0)
    _randomize(model)
    ids = _ids(seed=2)
    logits = model(ids)
    F.cross_entropy(logits[:, :-1].reshape(-1, 211), ids[:, 1:].reshape(-1)).backward()
    trainable = {id(p) for p in params}
    assert all(p.grad is not None and p.grad.abs().max() > 0 for p in params)
    assert all(p.grad is None and not p.requires_grad for p in model.parameters() if id(p) not in trainable)


def test_merge_unmerge_experts_is_exact_within_fp_tolerance(hf_dir):
    model = load_pretrained(hf_dir)
    apply_lora(model, LoraConfig(rank=4, alpha=8.0), seed=0)
    _randomize(model, seed=7)
    experts = model.model.layers["0"].mlp.experts
    before = {n: getattr(experts, n).detach().clone() for n in ("gate_up_proj", "down_proj")}
    ids = _ids(seed=3)
    with torch.no_grad():
        unmerged = model(ids)
        merge_adapter(model, "default")
        merged = model(ids)
        A = experts.lora.lora_A["default"]["down_proj"].view(E, 4, I)
        B = experts.lora.lora_B["default"]["down_proj"].view(D, 4, E).permute(2, 0, 1)
        torch.testing.assert_close(experts.down_proj, before["down_proj"] + 2.0 * torch.bmm(B, A), atol=1e-6, rtol=0)
        unmerge_adapter(model, "default")
        after = model(ids)
    torch.testing.assert_close(merged, unmerged, atol=ATOL, rtol=0)
    torch.testing.assert_close(after, unmerged, atol=ATOL, rtol=0)
    for n, w in before.items():
        torch.testing.assert_close(getattr(experts, n).detach(), w, atol=1e-6, rtol=0)


def test_several_expert_adapters_switch_and_remove(hf_dir):
    model = load_pretrained(hf_dir)
    base_keys = set(model.state_dict())
    ids = _ids(seed=4)
    with torch.no_grad():
        base = model(ids)
    apply_lora(model, LoraConfig(rank=4, target_modules=("experts",)), adapter_name="a", seed=0)
    apply_lora(model, LoraConfig(rank=2, target_modules=("o_proj", "experts.down_proj")), adapter_name="b", seed=1)
    assert adapter_names(model) == ["a", "b"]
    _randomize(model, "a", seed=5)
    _randomize(model, "b", seed=6)
    with torch.no_grad():
        set_active_adapter(model, "a")
        out_a = model(ids)
        set_active_adapter(model, "b")
        out_b = model(ids)
        set_active_adapter(model, None)
        assert torch.equal(model(ids), base)
        assert (out_a - out_b).abs().max() > 1e-3 and (out_a - base).abs().max() > 1e-3
        remove_adapter(model, "a")
        set_active_adapter(model, "b")
        assert torch.equal(model(ids), out_b)
        remove_adapter(model, "b")
        assert torch.equal(model(ids), base)
    assert all(layer.mlp.experts.lora is None for layer in model.model.layers.values())
    assert set(model.state_dict()) == base_keys


def test_router_replay_with_expert_lora_is_bitwise_no_replay(hf_dir):
    model = load_pretrained(hf_dir)
    params = apply_lora(model, LoraConfig(rank=4), seed=0)
    _randomize(model)
    ids = _ids(seed=8)

    def run(routing):
        for p in params:
            p.grad = None
        logits = model(ids, routing=routing)
        logits.square().mean().backward()
        return logits.detach(), [p.grad.clone() for p in params]

    with torch.no_grad():
        recorded = RouterReplay.record()
        model(ids, routing=recorded)
    plain, plain_grads = run(None)
    replayed, replayed_grads = run(RouterReplay.replay(recorded.expert_ids))
    assert torch.equal(plain, replayed)
    assert all(torch.equal(a, b) for a, b in zip(plain_grads, replayed_grads, strict=True))


def test_peft_loads_our_expert_adapter_with_identical_logits(hf_dir, tmp_path):
    model = load_pretrained(hf_dir)
    cfg = LoraConfig(rank=4, alpha=8.0, target_modules=("q_proj", "v_proj", "experts", "lm_head"))
    apply_lora(model, cfg, seed=0)
    _randomize(model, seed=9)
    save_peft_adapter(model, cfg, tmp_path, base_model_name_or_path=str(hf_dir))
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    assert config["target_modules"] == ["lm_head", "q_proj", "v_proj"]
    assert config["target_parameters"] == ["experts.down_proj", "experts.gate_up_proj"]

    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    peft_model = peft.PeftModel.from_pretrained(hf, tmp_path).eval()
    ids = _ids(seed=10)
    with torch.no_grad():
        ours, ref = model(ids), peft_model(ids).logits
        set_active_adapter(model, None)
        base = model(ids)
    diff = (ours - ref).abs().max().item()
    print(f"our expert LoRA vs peft.PeftModel (target_parameters): max abs logits diff {diff:.3g}")
    assert diff <= ATOL
    assert (ours - base).abs().max() > 1e-2


@pytest.mark.filterwarnings("ignore:Setting `save_embedding_layers` to `True`:UserWarning")  # peft, on lm_head
def test_load_peft_written_expert_adapter_matches_peft(hf_dir, tmp_path):
    torch.manual_seed(0)
    peft_cfg = peft.LoraConfig(
        r=3, lora_alpha=9, target_modules=["k_proj", "lm_head"],
        target_parameters=["gate_up_proj", "down_proj"], init_lora_weights=False,  # bare names: parameter suffixes
    )
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    peft_model = peft.get_peft_model(hf, peft_cfg).eval()
    peft_model.save_pretrained(tmp_path)  # also writes lm_head.base_layer.weight (save_embedding_layers)

    model = load_pretrained(hf_dir)
    cfg = load_peft_adapter(model, tmp_path, adapter_name="ext")
    assert cfg.rank == 3 and set(cfg.target_modules) == {"k_proj", "lm_head", "experts.gate_up_proj",
                                                         "experts.down_proj"}
    ids = _ids(seed=11)
    with torch.no_grad():
        diff = (model(ids) - peft_model(ids).logits).abs().max().item()
    print(f"load_peft_adapter (target_parameters) vs peft.PeftModel: max abs logits diff {diff:.3g}")
    assert diff <= ATOL

    # our own round trip: save what we loaded, load it into a fresh model, same logits bitwise
    save_peft_adapter(model, cfg, tmp_path / "ours", "hf", adapter_name="ext")
    again = load_pretrained(hf_dir)
    load_peft_adapter(again, tmp_path / "ours")
    with torch.no_grad():
        assert torch.equal(again(ids), model(ids))


def test_peft_loads_our_deepseek_v3_expert_adapter(tmp_path):
    """MLA + routed experts on transformers' DeepseekV3ForCausalLM (sigmoid router, shared expert, dense layer 0)."""
    config = transformers.DeepseekV3Config(
        vocab_size=101, hidden_size=64, intermediate_size=96, moe_intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2, n_group=2,
        topk_group=1, n_shared_experts=1, first_k_dense_replace=1, q_lora_rank=32, kv_lora_rank=16,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, max_position_embeddings=256,
        routed_scaling_factor=2.5,
    )
    torch.manual_seed(0)
    hf = transformers.DeepseekV3ForCausalLM(config).float()
    with torch.no_grad():
        for param in hf.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    hf.save_pretrained(tmp_path / "base")
    model = load_pretrained(tmp_path / "base")
    # Not gate_proj/up_proj/down_proj: on qwen3_moe / deepseek_v3 peft rewrites those names onto the fused experts
    # (its transformers v4 -> v5 conversion), so LoRA on shared/dense MLP Linears cannot load in peft (docs/lora.md).
    cfg = LoraConfig(rank=4, target_modules=("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj",
                                             "experts"))
    apply_lora(model, cfg, seed=0)
    _randomize(model, seed=13)
    save_peft_adapter(model, cfg, tmp_path / "adapter", base_model_name_or_path="tiny-deepseek")
    base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32)
    peft_model = peft.PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    ids = torch.randint(0, 101, (2, 11), generator=torch.Generator().manual_seed(14))
    with torch.no_grad():
        diff = (model(ids) - peft_model(ids).logits).abs().max().item()
    print(f"our DeepSeek-V3 MLA + expert LoRA vs peft.PeftModel: max abs logits diff {diff:.3g}")
    assert diff <= ATOL


def test_set_trainable_full_and_lora(hf_dir):
    model = load_pretrained(hf_dir)
    params = set_trainable(model, "full")
    assert len(params) == len(list(model.parameters())) and all(p.requires_grad for p in params)
    assert not any("lora" in n for n, _ in model.named_parameters())
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    ids = _ids(seed=12)
    optimizer = torch.optim.SGD(params, lr=0.1)
    logits = model(ids)
    F.cross_entropy(logits[:, :-1].reshape(-1, 211), ids[:, 1:].reshape(-1)).backward()
    optimizer.step()
    changed = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    for name in ("model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.down_proj",
                 "model.layers.0.mlp.gate.weight", "model.layers.1.self_attn.q_proj.weight", "lm_head.weight"):
        assert name in changed

    with pytest.raises(ValueError, match="mode='lora' needs an active LoRA adapter"):
        set_trainable(model, "lora")
    lora_params = apply_lora(model, LoraConfig(rank=2), seed=0)
    with pytest.raises(ValueError, match=r"mode='full' trains the base weights, but the model holds LoRA adapters "
                                         r"\['default'\]"):
        set_trainable(model, "full")
    again = set_trainable(model, "lora")
    assert {id(p) for p in again} == {id(p) for p in lora_params}
    assert sum(p.requires_grad for p in model.parameters()) == len(lora_params)
    with pytest.raises(ValueError, match="training mode must be one of"):
        set_trainable(model, "half")


def test_a_tied_unembedding_takes_an_adapter_beside_the_shared_weight_and_refuses_merging():
    config = {**_hf_config(tie_word_embeddings=True).to_dict(), "architectures": ["Qwen3MoeForCausalLM"]}
    model = CausalLM(ModelArgs.from_hf_config(config))
    apply_lora(model, LoraConfig(target_modules=("q_proj", "lm_head")), "tied")
    assert adapter_names(model) == ["tied"] and model.lm_head.weight is model.model.embed_tokens.weight
    assert not model.model.embed_tokens.weight.requires_grad
    with pytest.raises(ValueError, match=r"Cannot merge adapter 'tied': it adapts \['lm_head'\], whose weight is "
                                         r"the input embeddings' \(tie_word_embeddings\)"):
        merge_adapter(model, "tied")
