"""DeepSeek-V3 / Kimi K2 (models/deepseek_v3) against transformers 5.24's DeepseekV3ForCausalLM, the named reference.

Tiny random configs (hidden 64, 3 layers, 8 routed experts top-2 in 2 groups, MLA ranks 32/16, head dims 16+8/16)
with every parameter and e_score_correction_bias perturbed, so each path carries signal. Tolerances, float32 CPU:
logits max abs diff <= 1e-5, loss abs diff <= 1e-6, every parameter gradient within 1e-5 of the reference relative
to that gradient's largest entry, KV-cache decode and packed rows within 1e-5 of the full forward. bfloat16: logits
within 5% of the largest reference logit, with transformers' expert choice replayed into ours (a random tiny router
sits on near-ties that bf16 rounding flips on either side; see test_bf16_matches_transformers_bf16).
"""
# Shapes: B batch, T tokens, V vocab, K experts per token.

import json

import pytest
import torch
import torch.nn.functional as F
import transformers
from safetensors.torch import load_file, save_file
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf_ds

from kernels import Packing
from kernels.rope import rope_attention_factor, rope_frequencies
from models import KVCache, load_pretrained, save_pretrained
from models.deepseek_v3 import CausalLM, ModelArgs
from models.moe import RouterReplay
from models.shapes import CONFIGS_DIR

LOGITS_ATOL = 1e-5
GRAD_RTOL = 1e-5
MOE_LAYERS = {"mla": [1, 2], "yarn": [1, 2], "plain_q": [2]}

_TINY = {
    "vocab_size": 101, "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32,
    "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 4, "n_routed_experts": 8,
    "num_experts_per_tok": 2, "n_group": 2, "topk_group": 1, "n_shared_experts": 1, "first_k_dense_replace": 1,
    "q_lora_rank": 32, "kv_lora_rank": 16, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16,
    "max_position_embeddings": 256, "routed_scaling_factor": 2.5,
}
VARIANTS = {
    "mla": dict(_TINY),
    # YaRN with mscale != mscale_all_dim: both the cos/sin attention factor and the softmax mscale^2 are non-trivial.
    "yarn": dict(
        _TINY, norm_topk_prob=False,
        rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "beta_fast": 32,
                      "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.8},
    ),
    # Plain q_proj, half-split rope, biases, tied embeddings, two dense layers, a double-width shared expert.
    "plain_q": dict(
        _TINY, q_lora_rank=None, rope_interleave=False, attention_bias=True, tie_word_embeddings=True,
        first_k_dense_replace=2, n_shared_experts=2, rope_theta=50000.0,
    ),
}


def make_hf_model(variant: str, seed: int = 0) -> transformers.DeepseekV3ForCausalLM:
    torch.manual_seed(seed)
    model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**VARIANTS[variant])).float()
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.05)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.add_(torch.randn_like(buffer) * 0.05)
    return model.eval()


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    """variant -> (directory written by transformers' save_pretrained, the in-memory transformers model)."""
    dirs = {}
    for variant in VARIANTS:
        model = make_hf_model(variant)
        path = tmp_path_factory.mktemp(f"hf_deepseek_{variant}")
        model.save_pretrained(path)
        dirs[variant] = (path, model)
    return dirs


def _batch(vocab_size: int, seed: int = 1, shape=(3, 19)) -> torch.Tensor:
    return torch.randint(0, vocab_size, shape, generator=torch.Generator().manual_seed(seed))


def _loss(logits_BTV: torch.Tensor, ids_BT: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits_BTV[:, :-1].reshape(-1, logits_BTV.shape[-1]), ids_BT[:, 1:].reshape(-1))


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_loss_and_grads_match_transformers(variant, hf_dirs):
    path, hf = hf_dirs[variant]
    ours = load_pretrained(path)
    assert min(k for k in load_file(path / "model.safetensors") if ".experts." in k).endswith(
        "experts.0.down_proj.weight"
    ), "transformers saves per-expert keys"
    ids = _batch(hf.config.vocab_size)

    hf.zero_grad()
    hf_out = hf(ids, labels=ids)
    hf_out.loss.backward()
    logits = ours(ids)
    loss = _loss(logits, ids)
    loss.backward()

    diff = (logits - hf_out.logits).abs().max().item()
    hf_params = dict(hf.named_parameters())
    our_params = dict(ours.named_parameters())
    assert our_params.keys() == hf_params.keys()
    grad_rel = {}
    for name, param in our_params.items():
        ref = hf_params[name].grad
        scale = ref.abs().max().item()
        grad_rel[name] = (param.grad - ref).abs().max().item() / (scale if scale > 0 else 1.0)
    print(
        f"{variant}: logits max abs diff {diff:.3g}, loss diff {abs(loss.item() - hf_out.loss.item()):.3g}, "
        f"worst relative grad diff {max(grad_rel.values()):.3g} ({max(grad_rel, key=grad_rel.get)})"
    )
    assert diff <= LOGITS_ATOL
    assert abs(loss.item() - hf_out.loss.item()) <= 1e-6
    for name, rel in grad_rel.items():
        assert rel <= GRAD_RTOL, f"{name}: relative grad diff {rel:.3g}"


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_save_pretrained_loads_in_transformers(variant, hf_dirs, tmp_path):
    path, _ = hf_dirs[variant]
    ours = load_pretrained(path)
    save_pretrained(ours, tmp_path)
    saved = load_file(tmp_path / "model.safetensors")
    assert "model.layers.2.mlp.experts.7.up_proj.weight" in saved and not any(k.endswith("gate_up_proj") for k in saved)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    assert type(reloaded).__name__ == "DeepseekV3ForCausalLM"
    ids = _batch(ours.args.vocab_size, seed=2)
    with torch.no_grad():
        diff = (reloaded(ids).logits - ours(ids)).abs().max().item()
    print(f"{variant}: save_pretrained -> transformers from_pretrained, logits max abs diff {diff:.3g}")
    assert diff <= LOGITS_ATOL
    assert ModelArgs.from_hf_config(json.loads((tmp_path / "config.json").read_text())) == ours.args


def test_fused_and_per_expert_checkpoints_load_identically(hf_dirs, tmp_path):
    """transformers 5.x in-memory names (fused experts) load like the per-expert file transformers writes."""
    path, hf = hf_dirs["yarn"]
    save_file({k: v.contiguous() for k, v in hf.state_dict().items()}, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    assert "model.layers.1.mlp.experts.gate_up_proj" in load_file(tmp_path / "model.safetensors")
    fused, per_expert = load_pretrained(tmp_path), load_pretrained(path)
    ids = _batch(hf.config.vocab_size, seed=3)
    with torch.no_grad():
        fused_logits, ref = fused(ids), hf(ids).logits
        assert torch.equal(fused_logits, per_expert(ids))
    assert (fused_logits - ref).abs().max().item() <= LOGITS_ATOL


def _edit_checkpoint(src, dst, edit_state, edit_config=lambda c: None):
    dst.mkdir()
    config = json.loads((src / "config.json").read_text())
    edit_config(config)
    (dst / "config.json").write_text(json.dumps(config))
    state = load_file(src / "model.safetensors")
    edit_state(state)
    save_file(state, dst / "model.safetensors")


def _add_mtp_layer(state):
    """The shape of DeepSeek-V3's MTP module at layer index num_hidden_layers (here 3)."""
    mtp = {k.replace("model.layers.2.", "model.layers.3."): v.clone() for k, v in state.items()
           if k.startswith("model.layers.2.")}
    mtp.update({
        "model.layers.3.embed_tokens.weight": state["model.embed_tokens.weight"].clone(),
        "model.layers.3.enorm.weight": torch.ones(64), "model.layers.3.hnorm.weight": torch.ones(64),
        "model.layers.3.eh_proj.weight": torch.zeros(64, 128),
        "model.layers.3.shared_head.norm.weight": torch.ones(64),
        "model.layers.3.shared_head.head.weight": state["lm_head.weight"].clone(),
    })
    state.update(mtp)


def test_mtp_layer_is_skipped_and_other_surplus_layers_are_not(hf_dirs, tmp_path):
    path, hf = hf_dirs["mla"]

    def one_mtp_layer(config):
        config["num_nextn_predict_layers"] = 1

    _edit_checkpoint(path, tmp_path / "mtp", _add_mtp_layer, one_mtp_layer)
    ours = load_pretrained(tmp_path / "mtp")
    assert ours.args.num_nextn_predict_layers == 1 and len(ours.model.layers) == 3
    ids = _batch(hf.config.vocab_size, seed=4)
    with torch.no_grad():
        assert (ours(ids) - hf(ids).logits).abs().max().item() <= LOGITS_ATOL
    assert ours.args.to_hf_config()["num_nextn_predict_layers"] == 0  # the saved model carries no MTP weights

    def no_mtp(config):
        config["num_nextn_predict_layers"] = 0

    _edit_checkpoint(path, tmp_path / "surplus", _add_mtp_layer, no_mtp)
    with pytest.raises(ValueError, match=r"unexpected keys \[model\.layers\.3\."):
        load_pretrained(tmp_path / "surplus")


def test_bad_checkpoints_are_named(hf_dirs, tmp_path):
    path, _ = hf_dirs["mla"]
    _edit_checkpoint(
        path, tmp_path / "fp8",
        lambda s: s.update({"model.layers.0.self_attn.q_a_proj.weight_scale_inv": torch.ones(1, 1)}),
    )
    with pytest.raises(ValueError, match="FP8 checkpoint.*weight_scale_inv.*bf16 copy"):
        load_pretrained(tmp_path / "fp8")
    _edit_checkpoint(path, tmp_path / "missing", lambda s: s.pop("model.layers.2.mlp.experts.5.up_proj.weight"))
    with pytest.raises(ValueError, match=r"missing \[model\.layers\.2\.mlp\.experts\.5\.up_proj\.weight\]"):
        load_pretrained(tmp_path / "missing")
    _edit_checkpoint(
        path, tmp_path / "extra",
        lambda s: s.update({"model.layers.1.mlp.experts.8.down_proj.weight": torch.zeros(64, 32)}),
    )
    with pytest.raises(ValueError, match=r"n_routed_experts=8: missing \[\]; unexpected \[.*experts\.8\.down_proj"):
        load_pretrained(tmp_path / "extra")


@pytest.mark.parametrize("variant", ["yarn", "plain_q"])
@torch.no_grad()
def test_kv_cache_decode_matches_full_forward(variant, hf_dirs):
    ours = load_pretrained(hf_dirs[variant][0])
    ids = _batch(ours.args.vocab_size, seed=5, shape=(2, 12))
    full = ours(ids)
    cache = KVCache.allocate(ours.args, batch_size=2, max_len=16, dtype=torch.float32, device="cpu")
    assert cache.k_LBKSD.shape == (3, 2, 4, 16, 24) and cache.v_LBKSD.shape == (3, 2, 4, 16, 16)
    steps = [ours(ids[:, :3], cache=cache), ours(ids[:, 3:5], cache=cache)]  # prefill in two chunks
    steps += [ours(ids[:, t : t + 1], cache=cache) for t in range(5, 12)]
    assert cache.length == 12
    diff = (torch.cat(steps, dim=1) - full).abs().max().item()
    print(f"{variant}: chunked prefill + decode vs full forward, max abs diff {diff:.3g}")
    assert diff <= LOGITS_ATOL


@torch.no_grad()
def test_packed_row_matches_separate_documents(hf_dirs):
    ours = load_pretrained(hf_dirs["yarn"][0])
    lengths = [7, 5, 9]
    docs = [_batch(ours.args.vocab_size, seed=10 + i, shape=(1, n)) for i, n in enumerate(lengths)]
    packed = ours(torch.cat(docs, dim=1), packing=Packing.from_lengths(lengths))
    separate = torch.cat([ours(doc) for doc in docs], dim=1)
    assert (packed - separate).abs().max().item() <= LOGITS_ATOL


@pytest.mark.parametrize("variant", ["mla", "plain_q"])
@torch.no_grad()
def test_router_replay_reaches_every_moe_layer(variant, hf_dirs):
    ours = load_pretrained(hf_dirs[variant][0])
    ids = _batch(ours.args.vocab_size, seed=6, shape=(2, 9))
    record = RouterReplay.record()
    logits = ours(ids, routing=record)
    assert record.layers == MOE_LAYERS[variant]
    assert record.stacked().shape == (2, 9, len(MOE_LAYERS[variant]), 2)
    assert torch.equal(ours(ids, routing=RouterReplay.replay(record.expert_ids)), logits)


def test_bf16_matches_transformers_bf16(hf_dirs):
    """bf16 logits within 5% of the largest reference logit, with transformers' expert choice replayed into ours.

    Without the replay the comparison measures routing flips, not our numerics: the tiny random router's sigmoid
    scores sit within bf16 rounding of each other, and bf16 transformers itself differs from fp32 transformers by
    up to a third of the largest logit on such a model."""
    path, _ = hf_dirs["yarn"]
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    ours = load_pretrained(path, dtype=torch.bfloat16)
    chosen = {}
    for i in MOE_LAYERS["yarn"]:
        hf.model.layers[i].mlp.gate.register_forward_hook(lambda m, inp, out, i=i: chosen.__setitem__(i, out[2]))
    ids = _batch(ours.args.vocab_size, seed=7)
    with torch.no_grad():
        ref = hf(ids).logits.float()
        replay = RouterReplay.replay({i: chosen[i].view(*ids.shape, -1) for i in MOE_LAYERS["yarn"]})
        diff = (ours(ids, routing=replay).float() - ref).abs().max().item()
    print(f"bf16 (transformers routing replayed): logits max abs diff {diff:.3g} of max |logit| {ref.abs().max():.3g}")
    assert ours.model.embed_tokens.weight.dtype == torch.bfloat16
    assert diff <= 0.05 * ref.abs().max().item()


def _shipped(name: str) -> dict:
    return json.loads((CONFIGS_DIR / name / "config.json").read_text())


@pytest.mark.parametrize("name", ["deepseek-v3", "kimi-k2-instruct"])
def test_published_configs_match_transformers_shapes_and_scales(name):
    config = _shipped(name)
    args = ModelArgs.from_hf_config(config)
    assert args.kv_cache_dims == (192, 128) and args.qk_head_dim == 192 and args.num_kv_heads == args.num_heads
    hf_config = transformers.DeepseekV3Config.from_dict(
        {**args.to_hf_config(), "num_hidden_layers": args.first_k_dense_replace + 1}
    )
    with torch.device("meta"):
        hf_attn = hf_ds.DeepseekV3Attention(hf_config, 0)
    assert args.softmax_scale == hf_attn.scaling
    rotary = hf_ds.DeepseekV3RotaryEmbedding(hf_config)
    inv_freq, factor = rope_frequencies(args.qk_rope_head_dim, args.rope_theta, args.rope_scaling)
    assert torch.equal(inv_freq, rotary.inv_freq) and factor == rotary.attention_scaling
    assert rope_attention_factor(args.rope_scaling) == factor
    # Dense and MoE layers at the published sizes, on the meta device: identical names and shapes.
    small = ModelArgs.from_hf_config({**config, "num_hidden_layers": args.first_k_dense_replace + 1})
    with torch.device("meta"):
        ours = {k: v.shape for k, v in CausalLM(small).state_dict().items()}
        ref = {k: v.shape for k, v in transformers.DeepseekV3ForCausalLM(hf_config).state_dict().items()}
    assert ours == ref


def test_kimi_k2_config_round_trips_as_native_deepseek_v3():
    config = {
        **_shipped("kimi-k2-instruct"), "auto_map": {"AutoConfig": "configuration_deepseek.DeepseekV3Config"},
        "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]},
        "num_nextn_predict_layers": 1,
    }
    args = ModelArgs.from_hf_config(config)
    assert config["model_type"] == "kimi_k2" and args.n_routed_experts == 384 and args.n_group == 1
    assert args.routed_scaling_factor == 2.827 and args.rope_scaling["beta_fast"] == 1.0
    out = args.to_hf_config()
    assert out["model_type"] == "deepseek_v3" and out["num_nextn_predict_layers"] == 0
    assert not {"quantization_config", "auto_map", "torch_dtype"} & out.keys() and out["dtype"] == "bfloat16"
    assert out["bos_token_id"] == 163584  # unmodelled fields carry over
    assert ModelArgs.from_hf_config(out) == args
    assert transformers.DeepseekV3Config.from_dict(out).n_routed_experts == 384


@pytest.mark.parametrize(
    "edit,message",
    [
        ({"scoring_func": "softmax"}, "Unsupported scoring_func 'softmax'"),
        ({"topk_method": "group_limited_greedy"}, "Unsupported topk_method 'group_limited_greedy'"),
        ({"moe_layer_freq": 2}, "moe_layer_freq=2 is not supported"),
        ({"num_key_value_heads": 2}, "num_key_value_heads=2 must equal num_attention_heads=4"),
        ({"hidden_act": "gelu"}, "Unsupported hidden_act 'gelu'"),
        ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "Unsupported rope type 'dynamic'"),
        ({"rope_scaling": {"type": "yarn"}}, "needs a numeric 'factor'"),
        ({"n_group": 3}, "n_group=3 must divide num_experts=8"),
        ({"topk_group": 3}, r"topk_group=3 must be in \[1, n_group=2\]"),
        ({"model_type": "deepseek_v2"}, "model_type 'deepseek_v2' is not a DeepSeek-V3 layout"),
        ({"architectures": ["LlamaForCausalLM"]}, "exactly the architecture 'DeepseekV3ForCausalLM'"),
        ({"kv_lora_rank": None}, None),
    ],
)
def test_unsupported_options_are_clear_errors(edit, message):
    config = {**VARIANTS["mla"], "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", **edit}
    if message is None:  # a required field removed
        del config["kv_lora_rank"]
        message = "missing the required field 'kv_lora_rank'"
    with pytest.raises(ValueError, match=message):
        ModelArgs.from_hf_config(config)
