"""Qwen3-MoE numerical parity with transformers' Qwen3MoeForCausalLM (the named reference), checkpoints, KV cache.

Tiny random config: hidden 64, 3 layers (layer 0 dense via mlp_only_layers), 8 experts, top-2, moe_intermediate 32,
every parameter perturbed. Tolerances (float32, CPU): logits max abs diff <= 1e-5, loss abs diff <= 1e-6, every
parameter gradient within 1e-5 of the reference relative to that gradient's largest entry. bfloat16: max abs logits
diff <= 1% of the reference's largest logit (observed: 0, bitwise equal on this CPU build).
"""
# Shapes: B batch, T tokens, V vocab.

import json

import pytest
import torch
import torch.nn.functional as F
import transformers
from safetensors.torch import save_file

from kernels import Packing
from models import KVCache, load_pretrained, save_pretrained
from models.moe import MoE, RouterReplay
from models.qwen3_moe import ModelArgs, state_dict_adapter

LOGITS_ATOL = 1e-5
GRAD_RTOL = 1e-5
NUM_EXPERTS, TOP_K = 8, 2


def _hf_config(**overrides) -> transformers.Qwen3MoeConfig:
    kwargs = {
        "vocab_size": 211, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 3, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 32, "max_position_embeddings": 256, "rms_norm_eps": 1e-6,
        "moe_intermediate_size": 32, "num_experts": NUM_EXPERTS, "num_experts_per_tok": TOP_K, "norm_topk_prob": True,
        "mlp_only_layers": [0], "decoder_sparse_step": 1, "tie_word_embeddings": False, "rope_theta": 1000000.0,
    }
    return transformers.Qwen3MoeConfig(**{**kwargs, **overrides})


def _make_hf(seed: int = 0) -> transformers.Qwen3MoeForCausalLM:
    torch.manual_seed(seed)
    model = transformers.Qwen3MoeForCausalLM(_hf_config()).float()
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    return model.eval()


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A directory written by transformers' save_pretrained (per-expert keys on disk) and the in-memory model."""
    model = _make_hf()
    path = tmp_path_factory.mktemp("hf_qwen3_moe")
    model.save_pretrained(path)
    return path, model


@pytest.fixture(scope="module")
def ours(hf_dir):
    return load_pretrained(hf_dir[0])


def _batch(vocab_size: int, seed: int = 1, shape=(3, 19)) -> torch.Tensor:
    return torch.randint(0, vocab_size, shape, generator=torch.Generator().manual_seed(seed))


def _loss(logits_BTV: torch.Tensor, ids_BT: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits_BTV[:, :-1].reshape(-1, logits_BTV.shape[-1]), ids_BT[:, 1:].reshape(-1))


def test_layers_follow_mlp_only_and_sparse_step(ours):
    assert [isinstance(layer.mlp, MoE) for layer in ours.model.layers.values()] == [False, True, True]
    args = ModelArgs.from_hf_config({**_hf_config(decoder_sparse_step=2, mlp_only_layers=[]).to_dict(),
                                     "architectures": ["Qwen3MoeForCausalLM"]})
    assert [args.is_moe_layer(i) for i in range(3)] == [False, True, False]


@pytest.mark.parametrize("experts_implementation", ["grouped_mm", "eager"])
def test_logits_loss_and_grads_match_transformers(experts_implementation, hf_dir):
    path, _ = hf_dir
    hf = _make_hf()  # a private copy: set_experts_implementation changes the model in place
    hf.set_experts_implementation(experts_implementation)
    ours = load_pretrained(path)
    ids = _batch(hf.config.vocab_size)

    hf.zero_grad()
    hf_out = hf(ids, labels=ids)
    hf_out.loss.backward()
    logits = ours(ids)
    loss = _loss(logits, ids)
    loss.backward()

    diff = (logits - hf_out.logits).abs().max().item()
    hf_params, our_params = dict(hf.named_parameters()), dict(ours.named_parameters())
    assert our_params.keys() == hf_params.keys()
    grad_rel = {
        name: ((p.grad - hf_params[name].grad).abs().max() / hf_params[name].grad.abs().max()).item()
        for name, p in our_params.items()
    }
    loss_diff = abs(loss.item() - hf_out.loss.item())
    print(f"qwen3_moe vs HF ({experts_implementation}): logits max abs diff {diff:.3g}, loss diff {loss_diff:.3g}, "
          f"worst relative grad diff {max(grad_rel.values()):.3g}")
    assert diff <= LOGITS_ATOL
    assert loss_diff <= 1e-6
    for name, rel in grad_rel.items():
        assert rel <= GRAD_RTOL, f"{name}: relative grad diff {rel:.3g}"
    for layer in (1, 2):  # every expert received tokens, so every expert slice was compared
        assert (our_params[f"model.layers.{layer}.mlp.experts.down_proj"].grad.flatten(1).abs().amax(1) > 0).all()


def test_bf16_matches_transformers_bf16(hf_dir):
    path, _ = hf_dir
    ours = load_pretrained(path, dtype=torch.bfloat16)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    ids = _batch(ours.args.vocab_size, seed=5)
    with torch.no_grad():
        ref = hf(ids).logits.float()
        diff = (ours(ids).float() - ref).abs().max().item()
    print(f"qwen3_moe bf16: logits max abs diff {diff:.3g} (reference max {ref.abs().max().item():.3g})")
    assert ours.model.layers["1"].mlp.experts.gate_up_proj.dtype == torch.bfloat16
    assert diff <= 0.01 * ref.abs().max().item()


def test_save_pretrained_loads_in_transformers(hf_dir, ours, tmp_path):
    save_pretrained(ours, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["num_experts"] == NUM_EXPERTS and config["mlp_only_layers"] == [0]
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    assert type(reloaded).__name__ == "Qwen3MoeForCausalLM"
    reference = hf_dir[1].state_dict()
    assert all(torch.equal(v, reference[k]) for k, v in reloaded.state_dict().items())  # the exact weights
    ids = _batch(ours.args.vocab_size, seed=2)
    with torch.no_grad():
        ours_logits = ours(ids)
        assert (ours_logits - reloaded(ids).logits).abs().max().item() <= LOGITS_ATOL
    assert ModelArgs.from_hf_config(config) == ours.args
    assert torch.equal(load_pretrained(tmp_path)(ids), ours_logits)


def test_fused_and_sharded_per_expert_checkpoints_load_identically(hf_dir, ours, tmp_path):
    _, hf = hf_dir
    fused = tmp_path / "fused"
    fused.mkdir()
    (fused / "config.json").write_text(json.dumps(ours.args.to_hf_config()))
    save_file({k: v.contiguous() for k, v in hf.state_dict().items()}, fused / "model.safetensors")
    sharded = tmp_path / "sharded"
    hf.save_pretrained(sharded, max_shard_size="50KB")
    assert (sharded / "model.safetensors.index.json").is_file() and len(list(sharded.glob("*.safetensors"))) > 1
    index = json.loads((sharded / "model.safetensors.index.json").read_text())["weight_map"]
    assert "model.layers.1.mlp.experts.7.up_proj.weight" in index

    ids = _batch(ours.args.vocab_size, seed=3)
    with torch.no_grad():
        reference = ours(ids)
        for path in (fused, sharded):
            assert torch.equal(load_pretrained(path)(ids), reference)
        assert (reference - hf(ids).logits).abs().max().item() <= LOGITS_ATOL


def test_state_dict_adapter_round_trip_and_errors(ours):
    state = ours.state_dict()
    hf_state = state_dict_adapter.to_hf(state, ours.args)
    assert "model.layers.2.mlp.experts.3.gate_proj.weight" in hf_state
    assert not any(k.endswith("gate_up_proj") for k in hf_state)
    back = state_dict_adapter.from_hf(dict(hf_state), ours.args)  # from_hf consumes the dict it is given
    assert back.keys() == state.keys() and all(torch.equal(back[k], state[k]) for k in state)
    incomplete = {k: v for k, v in hf_state.items() if k != "model.layers.1.mlp.experts.5.up_proj.weight"}
    with pytest.raises(ValueError, match=r"missing \[model\.layers\.1\.mlp\.experts\.5\.up_proj\.weight\]"):
        state_dict_adapter.from_hf(incomplete, ours.args)
    mixed = {**hf_state, "model.layers.1.mlp.experts.down_proj": state["model.layers.1.mlp.experts.down_proj"]}
    with pytest.raises(ValueError, match="both fused and as per-expert"):
        state_dict_adapter.from_hf(mixed, ours.args)


@torch.no_grad()
def test_prefill_then_decode_matches_full_forward(ours):
    ids = _batch(ours.args.vocab_size, seed=6, shape=(2, 12))
    full = ours(ids)
    cache = KVCache.allocate(ours.args, batch_size=2, max_len=16, dtype=torch.float32, device="cpu")
    steps = [ours(ids[:, :5], cache=cache)]
    steps += [ours(ids[:, t : t + 1], cache=cache) for t in range(5, 12)]
    diff = (torch.cat(steps, dim=1) - full).abs().max().item()
    print(f"qwen3_moe prefill+decode vs full forward: max abs diff {diff:.3g}")
    assert diff <= LOGITS_ATOL


@torch.no_grad()
def test_packed_row_matches_separate_documents(ours):
    docs = [_batch(ours.args.vocab_size, seed=7 + i, shape=(1, n)) for i, n in enumerate((5, 9, 4))]
    packed = ours(torch.cat(docs, dim=1), packing=Packing.from_lengths([5, 9, 4]))
    separate = torch.cat([ours(doc) for doc in docs], dim=1)
    torch.testing.assert_close(packed, separate, atol=LOGITS_ATOL, rtol=0)


def test_router_replay_through_the_model(ours):
    ids = _batch(ours.args.vocab_size, seed=8, shape=(2, 7))
    with torch.no_grad():
        record = RouterReplay.record()
        cache = KVCache.allocate(ours.args, 2, 8, torch.float32, "cpu")
        ours(ids[:, :4], cache=cache, routing=record)
        for t in range(4, 7):
            ours(ids[:, t : t + 1], cache=cache, routing=record)
    assert record.layers == [1, 2]  # the dense layer 0 has no router
    assert record.stacked().shape == (2, 7, 2, TOP_K) and record.stacked().dtype == torch.uint8

    def run(routing):
        ours.zero_grad()
        logits = ours(ids, routing=routing)
        _loss(logits, ids).backward()
        return logits.detach(), {n: p.grad.clone() for n, p in ours.named_parameters()}

    live_logits, live_grads = run(None)
    with torch.no_grad():
        full_record = RouterReplay.record()
        ours(ids, routing=full_record)
    # The cached decode saw the same tokens, so it chose the same experts (no near-ties in this batch) ...
    assert torch.equal(record.stacked(), full_record.stacked())
    # ... and replaying them reproduces the live forward bitwise, gradients included.
    replay_logits, replay_grads = run(RouterReplay.from_stacked(record.layers, record.stacked()))
    assert torch.equal(replay_logits, live_logits)
    assert all(torch.equal(replay_grads[n], live_grads[n]) for n in live_grads)
    assert live_grads["model.layers.1.mlp.gate.weight"].abs().max() > 0


def test_config_fields_and_errors():
    base = {**_hf_config().to_dict(), "architectures": ["Qwen3MoeForCausalLM"]}
    base.pop("num_experts", None)
    written = {**base, "num_local_experts": NUM_EXPERTS}  # what transformers 5.x writes
    published = {k: v for k, v in base.items() if k != "num_local_experts"} | {"num_experts": NUM_EXPERTS}
    assert ModelArgs.from_hf_config(written) == ModelArgs.from_hf_config(published)
    assert ModelArgs.from_hf_config(written).num_experts == NUM_EXPERTS
    with pytest.raises(ValueError, match="missing the required field 'num_experts'"):
        ModelArgs.from_hf_config({k: v for k, v in published.items() if k != "num_experts"})
    with pytest.raises(ValueError, match="use_sliding_window"):
        ModelArgs.from_hf_config({**published, "use_sliding_window": True})
    with pytest.raises(ValueError, match=r"num_experts_per_tok=9 must be in \[1, num_experts=8\]"):
        ModelArgs.from_hf_config({**published, "num_experts_per_tok": 9})
