"""LoRA in PEFT format, checked against the peft library (the named reference).

Tolerance: float32 logits max abs diff <= 1e-5 between our model with an adapter and
peft.PeftModel over transformers' model with the same adapter, in both directions.
"""

import json

import peft
import pytest
import torch
import torch.nn.functional as F
import transformers
from torch import nn

from models import load_pretrained
from models.lora import (
    LoraConfig,
    LoRALinear,
    adapter_names,
    apply_lora,
    load_peft_adapter,
    lora_state_dict,
    merge_adapter,
    remove_adapter,
    save_peft_adapter,
    set_active_adapter,
    unmerge_adapter,
)

PEFT_ATOL = 1e-5
# What the DEFAULT_TARGETS menu resolves to on the dense tiny Qwen3 (no MLA projections, no routed experts).
DENSE_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# transformers warns about its own deprecated attribute when peft wraps a model; not ours to fix.
pytestmark = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")


def _ids(seed: int = 0, shape=(2, 16)) -> torch.Tensor:
    return torch.randint(3, 1024, shape, generator=torch.Generator().manual_seed(seed))


def _train(model, params, steps: int = 5) -> list[float]:
    """A few AdamW steps of next-token loss on a fixed batch, so the adapter's B matrices move away from zero."""
    optimizer = torch.optim.AdamW(params, lr=1e-2)
    ids = _ids(seed=10, shape=(4, 24))
    losses = []
    model.train()
    for _ in range(steps):
        logits = model(ids)
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def _hf_model(tiny_model_dir):
    return transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


def test_trained_adapter_loads_in_peft_with_identical_logits(tiny_model_dir, tmp_path):
    model = load_pretrained(tiny_model_dir)
    cfg = LoraConfig(rank=8, alpha=16.0)
    params = apply_lora(model, cfg, seed=0)
    assert len(params) == 2 * len(DENSE_TARGETS) * model.args.num_layers
    assert all(p.requires_grad for p in params)
    trainable = {id(p) for p in params}
    assert not any(p.requires_grad for p in model.parameters() if id(p) not in trainable)

    losses = _train(model, params)
    assert losses[-1] < losses[0]
    save_peft_adapter(model, cfg, tmp_path, base_model_name_or_path=str(tiny_model_dir))

    config = json.loads((tmp_path / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["task_type"] == "CAUSAL_LM"
    assert config["r"] == 8 and config["lora_alpha"] == 16 and config["target_modules"] == sorted(DENSE_TARGETS)
    peft_model = peft.PeftModel.from_pretrained(_hf_model(tiny_model_dir), tmp_path).eval()

    model.eval()
    ids = _ids(seed=1)
    with torch.no_grad():
        ours, ref = model(ids), peft_model(ids).logits
        set_active_adapter(model, None)
        base = model(ids)
    diff = (ours - ref).abs().max().item()
    print(f"our LoRA vs peft.PeftModel: max abs logits diff {diff:.3g}")
    assert diff <= PEFT_ATOL
    assert (ours - base).abs().max().item() > 1e-3  # the adapter really changes the model


def test_load_peft_written_adapter_matches_peft(tiny_model_dir, tmp_path):
    torch.manual_seed(0)
    peft_cfg = peft.LoraConfig(
        r=4, lora_alpha=12, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False,
        task_type="CAUSAL_LM",
    )
    peft_model = peft.get_peft_model(_hf_model(tiny_model_dir), peft_cfg).eval()
    peft_model.save_pretrained(tmp_path)

    model = load_pretrained(tiny_model_dir)
    cfg = load_peft_adapter(model, tmp_path, adapter_name="ext")
    assert cfg == LoraConfig(rank=4, alpha=12.0, dropout=0.0, target_modules=cfg.target_modules)
    assert sorted(cfg.target_modules) == ["down_proj", "q_proj", "v_proj"]
    ids = _ids(seed=2)
    with torch.no_grad():
        diff = (model(ids) - peft_model(ids).logits).abs().max().item()
    print(f"load_peft_adapter vs peft.PeftModel: max abs logits diff {diff:.3g}")
    assert diff <= PEFT_ATOL


def _randomize_adapter(model, name: str, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for tensor in lora_state_dict(model, name).values():
            tensor.copy_(torch.randn(tensor.shape, generator=gen) * 0.1)


def test_merge_unmerge_is_exact_within_fp_tolerance(tiny_model_dir):
    model = load_pretrained(tiny_model_dir)
    original = {k: v.clone() for k, v in model.state_dict().items()}
    apply_lora(model, LoraConfig(rank=4), seed=0)
    _randomize_adapter(model, "default", seed=1)
    ids = _ids(seed=3)
    with torch.no_grad():
        unmerged = model(ids)
        merge_adapter(model, "default")
        merged = model(ids)
        with pytest.raises(ValueError, match="already merged"):
            merge_adapter(model, "default")
        with pytest.raises(ValueError, match="merged into the weights"):
            set_active_adapter(model, None)
        unmerge_adapter(model, "default")
        after = model(ids)
    # Merging rounds W + s*B@A once in fp32; logits (magnitude ~10 with the tiny model's final-norm gain of 4)
    # then differ by a few ulps of their size.
    torch.testing.assert_close(merged, unmerged, atol=5e-5, rtol=0)
    torch.testing.assert_close(after, unmerged, atol=5e-5, rtol=0)
    state = model.state_dict()
    for key, value in original.items():
        torch.testing.assert_close(state[key], value, atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match="is not merged"):
        unmerge_adapter(model, "default")


def test_several_adapters_switch_and_remove(tiny_model_dir):
    model = load_pretrained(tiny_model_dir)
    base_keys = set(model.state_dict())
    ids = _ids(seed=4)
    with torch.no_grad():
        base = model(ids)
    apply_lora(model, LoraConfig(rank=4, target_modules=("q_proj", "v_proj")), adapter_name="a", seed=0)
    apply_lora(model, LoraConfig(rank=2, target_modules=("o_proj", "down_proj")), adapter_name="b", seed=1)
    assert adapter_names(model) == ["a", "b"]
    _randomize_adapter(model, "a", seed=5)
    _randomize_adapter(model, "b", seed=6)
    with torch.no_grad():
        set_active_adapter(model, "a")
        out_a = model(ids)
        set_active_adapter(model, "b")
        out_b = model(ids)
        set_active_adapter(model, None)
        assert torch.equal(model(ids), base)
        assert (out_a - out_b).abs().max() > 1e-3
        remove_adapter(model, "a")
        set_active_adapter(model, "b")
        assert torch.equal(model(ids), out_b)
        with pytest.raises(ValueError, match=r"No LoRA adapter named 'a'; loaded adapters: \['b'\]"):
            set_active_adapter(model, "a")
        remove_adapter(model, "b")
        assert torch.equal(model(ids), base)
    assert not any(isinstance(m, LoRALinear) for m in model.modules())
    assert isinstance(model.model.layers["0"].self_attn.o_proj, nn.Linear)
    assert set(model.state_dict()) == base_keys


@pytest.mark.filterwarnings("ignore:Model has `tie_word_embeddings=True` and a tied layer:UserWarning")  # peft's
def test_an_adapter_on_the_tied_unembedding(tiny_model_dir, tmp_path):
    """LoRA on lm_head when it is tied to the input embeddings E (the tiny Qwen3 ties them, as the small Qwen3 models
    do): the logits are h E^T + (alpha / r) (h A^T) B^T, checked against that formula computed naively in float64
    from the float32 tensors (tolerance 1e-5 absolute: float32 products summed in another order, logits of order
    1). Training moves A and B only: E, shared by the embedding and the head, is unchanged and still one Parameter.
    The PEFT files (lm_head in target_modules) give the same logits in peft.PeftModel, and merging is refused."""
    model = load_pretrained(tiny_model_dir)
    assert model.args.tie_word_embeddings and model.lm_head.weight is model.model.embed_tokens.weight
    embeddings = model.model.embed_tokens.weight.detach().clone()
    cfg = LoraConfig(rank=4, alpha=8.0, target_modules=("lm_head",))
    params = apply_lora(model, cfg, "head", seed=0)
    assert isinstance(model.lm_head, LoRALinear) and model.lm_head.weight is model.model.embed_tokens.weight
    assert [p.shape for p in params] == [(4, model.args.hidden_size), (model.args.vocab_size, 4)]
    with torch.no_grad():
        params[1].normal_(0, 0.5, generator=torch.Generator().manual_seed(2))

    ids = _ids(seed=3)
    hidden = []
    hook = model.lm_head.register_forward_pre_hook(lambda module, args: hidden.append(args[0].detach()))
    with torch.no_grad():
        logits = model(ids)
    hook.remove()
    h, (a, b) = hidden[0].double(), (p.detach().double() for p in params)
    reference = h @ embeddings.double().T + (cfg.alpha / cfg.rank) * (h @ a.T) @ b.T
    torch.testing.assert_close(logits.double(), reference, atol=1e-5, rtol=0)

    losses = _train(model, params)
    assert losses[-1] < losses[0]
    assert model.model.embed_tokens.weight.grad is None
    assert torch.equal(model.model.embed_tokens.weight, embeddings)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    with pytest.raises(ValueError, match=r"Cannot merge adapter 'head': it adapts \['lm_head'\].*embeddings"):
        merge_adapter(model, "head")

    save_peft_adapter(model, cfg, tmp_path, base_model_name_or_path=str(tiny_model_dir), adapter_name="head")
    assert json.loads((tmp_path / "adapter_config.json").read_text())["target_modules"] == ["lm_head"]
    model.eval()
    reloaded = load_pretrained(tiny_model_dir)
    load_peft_adapter(reloaded, tmp_path, "head")
    ids = _ids(seed=4)
    with torch.no_grad():
        ours = model(ids)
        assert torch.equal(reloaded(ids), ours)
        ref = peft.PeftModel.from_pretrained(_hf_model(tiny_model_dir), tmp_path).eval()(ids).logits
    # Logits reach ~10 here (B drawn large), so float32 rounding of the reordered sums is relative: 1e-5 of them.
    torch.testing.assert_close(ours, ref, atol=PEFT_ATOL, rtol=1e-5)


def test_bad_targets_and_bad_adapter_files(tiny_model_dir, tmp_path):
    model = load_pretrained(tiny_model_dir)
    with pytest.raises(ValueError, match=r"Unknown LoRA target_modules \['qproj'\]; valid module names are .*'q_proj'"):
        apply_lora(model, LoraConfig(target_modules=("qproj",)))

    good = tmp_path / "good"
    apply_lora(model, LoraConfig(rank=4, target_modules=("q_proj",)), adapter_name="x", seed=0)
    save_peft_adapter(model, LoraConfig(rank=4, target_modules=("q_proj",)), good, "tiny", adapter_name="x")
    with pytest.raises(ValueError, match="does not match the rank"):
        save_peft_adapter(model, LoraConfig(rank=8, target_modules=("q_proj",)), tmp_path / "bad_rank", "tiny", "x")

    fresh = load_pretrained(tiny_model_dir)
    with pytest.raises(ValueError, match="No adapter_config.json"):
        load_peft_adapter(fresh, tmp_path / "nowhere")
    config = json.loads((good / "adapter_config.json").read_text())
    (good / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    with pytest.raises(ValueError, match="unsupported LoRA options are set: use_dora"):
        load_peft_adapter(fresh, good)
    (good / "adapter_config.json").write_text(json.dumps({**config, "r": 8}))
    with pytest.raises(ValueError, match=r"lora_A\.weight: file \(4, 128\) vs model \(8, 128\)"):
        load_peft_adapter(fresh, good)
    assert adapter_names(fresh) == []  # a failed load leaves the model as it was
    (good / "adapter_config.json").write_text(json.dumps({**config, "target_modules": ["q_proj", "k_proj"]}))
    with pytest.raises(ValueError, match="missing keys.*k_proj"):
        load_peft_adapter(fresh, good)
    assert adapter_names(fresh) == []


def test_projections_of_one_input_share_one_A_gemm(tiny_model_dir):
    """models.lora_layers.project: q/k/v (and gate/up) of one adapter run their A matrices as one GEMM; outputs and
    every gradient equal the layers run one by one (float32; tolerance 1e-6 relative to the largest entry, the GEMMs
    summing the same products in other blocks). With dropout, or per-row adapters, it runs them one by one."""
    from models.lora_layers import project

    model = load_pretrained(tiny_model_dir)
    params = apply_lora(model, LoraConfig(rank=4, alpha=8.0), seed=0)
    _train(model, params, steps=2)
    attn = model.model.layers["0"].self_attn
    linears = (attn.q_proj, attn.k_proj, attn.v_proj)
    x = torch.randn(2, 7, model.args.hidden_size, generator=torch.Generator().manual_seed(1), requires_grad=True)
    fused = project(x, linears)
    alone = [m(x) for m in linears]
    weights = [p for m in linears for p in (m.lora_A["default"].weight, m.lora_B["default"].weight)]
    g = [torch.randn_like(o) for o in alone]
    grads_fused = torch.autograd.grad(fused, [x, *weights], g)
    grads_alone = torch.autograd.grad(alone, [x, *weights], g)
    for a, b in zip([*fused, *grads_fused], [*alone, *grads_alone]):
        assert (a - b).abs().max().item() <= 1e-6 * b.abs().max().item()
    attn.q_proj.lora_dropout["default"] = nn.Dropout(0.1)  # dropout: each layer draws its own mask, one by one
    torch.manual_seed(3)
    with_dropout = project(x, linears)
    torch.manual_seed(3)
    assert all(torch.equal(a, m(x)) for a, m in zip(with_dropout, linears))
