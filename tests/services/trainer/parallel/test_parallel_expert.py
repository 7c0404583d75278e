"""Expert parallelism (services/trainer/engine/parallel/expert.py) on real gloo groups of 2 and 4 ranks.

Named reference: the single-process model (same checkpoint, same adapter, same 4-bit experts) run in the test's
parent process over every rank's tokens at once (rank r feeds rows r*B .. r*B + B - 1, as data-parallel ranks feed
different data). Each rank computes the engine's head (logprobs.token_logprobs) on its own rows and backpropagates
its NLL sum. Compared:
- the routed expert ids each MoE layer chose or replayed (exactly equal), the final hidden states of the rank's rows;
- the loss: the sum of the ranks' losses against the reference's;
- the gradient of every trainable parameter: a rank's held experts (and expert-LoRA factors), summed over the ranks
  holding the same experts (mesh["efsdp"], as FSDP's reduce-scatter will; one rank when ep = world), against the
  matching slice of the reference gradient (ExpertShard.take); every other gradient summed over the data-parallel
  ranks (all_reduce) against the reference's.
Tolerance (float32, CPU): max |ep - ref| <= RTOL * max |ref| per tensor, RTOL = 1e-5. The same rows meet the same
expert weights in the same order (hidden states: bitwise equal, or 2e-7 relative); what differs is the summation
order of the gradients (per source rank, then over ranks), a few float32 roundings (measured max 7e-7 relative).
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from models import load_pretrained
from models.checkpoint import build_on_meta, save_pretrained
from models.lora import (
    LoraConfig, RowAdapters, apply_lora, lora_state_dict, per_row_adapters, save_peft_adapter, set_trainable,
)
from models.moe import Experts, RouterReplay, quantize_experts_
from services.trainer.engine.logprobs import token_logprobs
from services.trainer.engine.parallel import ParallelDims, build_mesh
from services.trainer.engine.parallel.expert import apply_expert_parallel, expert_shards
from tests.services.trainer.parallel.ranks import run_ranks

RTOL = 1e-5
B, T = 2, 8  # rows per rank, tokens per row
LORA = LoraConfig(rank=4, alpha=8.0, target_modules=("o_proj", "down_proj", "experts"))


def _build(model_dir: str, case: dict) -> torch.nn.Module:
    """The whole model of a case: loaded, optionally biased router, LoRA with random factors, 4-bit experts."""
    model = load_pretrained(model_dir)
    if case.get("bias"):
        # DeepSeek's selection bias: every token picks group 0 (experts 0..3), so the ranks holding experts 4..7
        # receive no row at all
        for m in model.modules():
            if hasattr(m, "e_score_correction_bias"):
                m.e_score_correction_bias[:4] = 5.0
    if case.get("quant"):
        quantize_experts_(model, "nf4", 32)
    if case.get("lora"):
        apply_lora(model, LORA, seed=0)
        gen = torch.Generator().manual_seed(3)
        with torch.no_grad():  # B = 0 would leave A without gradient; random factors exercise both
            for tensor in lora_state_dict(model).values():
                tensor.copy_(torch.randn(tensor.shape, generator=gen) * 0.05)
        set_trainable(model, "lora")
    else:
        set_trainable(model, "full")
    return model


def _tokens(world: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(11)
    ids = torch.randint(3, 1000, (world * B, T + 1), generator=gen)
    return ids[:, :-1], ids[:, 1:]


def _forced_routes(model: torch.nn.Module, world: int, experts: tuple[int, ...]) -> dict[int, torch.Tensor]:
    """Replayed ids [world*B, T, K] per MoE layer: K distinct experts per token, drawn from `experts` only."""
    gen = torch.Generator().manual_seed(5)
    routes = {}
    for m in model.modules():
        if hasattr(m, "gate") and isinstance(getattr(m, "experts", None), Experts):
            K = m.args.top_k
            pick = torch.rand(world * B * T, len(experts), generator=gen).topk(K, dim=-1).indices
            routes[m.layer_idx] = torch.tensor(experts)[pick].view(world * B, T, K).to(torch.uint8)
    return routes


def _run(model: torch.nn.Module, ids_BT, targets_BT, routing: RouterReplay) -> tuple[torch.Tensor, torch.Tensor]:
    hidden_BTD = model(ids_BT, routing=routing, return_hidden=True)
    loss = -token_logprobs(model, hidden_BTD.flatten(0, 1), targets_BT.flatten()).sum()
    loss.backward()
    return loss.detach(), hidden_BTD.detach()


def _routing(case: dict, model, world: int, rows: slice) -> RouterReplay:
    if case.get("forced"):
        return RouterReplay.replay({k: v[rows] for k, v in _forced_routes(model, world, case["forced"]).items()})
    return RouterReplay.record()


def _reference(model_dir: str, case: dict, world: int) -> dict:
    model = _build(model_dir, case)
    ids, targets = _tokens(world)
    routing = _routing(case, model, world, slice(None))
    loss, hidden = _run(model, ids, targets, routing)
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    return {"loss": loss, "hidden": hidden, "grads": grads, "routes": routing.expert_ids}


def _ep_rank(model_dir: str, case: dict) -> dict:
    world, rank = dist.get_world_size(), dist.get_rank()
    dims = ParallelDims(dp_shard=world, ep=case.get("ep", world), world_size=world).resolved()
    mesh = build_mesh(dims)
    model = _build(model_dir, case)
    n_blocks = apply_expert_parallel(model, mesh, dims)
    rows = slice(rank * B, (rank + 1) * B)
    ids, targets = _tokens(world)
    routing = _routing(case, model, world, rows)
    loss, hidden = _run(model, ids[rows], targets[rows], routing)
    shards = expert_shards(model)
    held, dense = {}, {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        assert p.grad is not None, f"{name} has no gradient on rank {rank}"
        if name in shards:  # summed over the group's tokens; ranks holding the same experts (efsdp) add theirs
            dist.all_reduce(p.grad, group=mesh["efsdp"].get_group())
            held[name] = p.grad
        else:  # this rank's tokens only: summed over every data-parallel rank
            dist.all_reduce(p.grad, group=mesh["dp"].get_group())
            dense[name] = p.grad
    dist.all_reduce(loss)
    return {"loss": loss, "hidden": hidden, "held": held, "dense": dense if rank == 0 else None,
            "shards": shards, "routes": routing.expert_ids, "blocks": n_blocks}


def _rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return ((a - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


CASES = {
    "qwen3_moe-full-ep2": ("qwen3_moe", 2, {}),
    "qwen3_moe-lora-ep4": ("qwen3_moe", 4, {"lora": True}),
    "deepseek_v3-full-ep4": ("deepseek_v3", 4, {}),
    "deepseek_v3-lora-ep2": ("deepseek_v3", 2, {"lora": True}),
    # uneven: all tokens to experts 0, 1 and 5: ranks 1 and 3 receive no row, rank 0 two experts, rank 2 one
    "qwen3_moe-replay-uneven-ep4": ("qwen3_moe", 4, {"forced": (0, 1, 5)}),
    # a biased router: every token to experts 0..3, held by rank 0; rank 1 receives nothing
    "deepseek_v3-biased-ep2": ("deepseek_v3", 2, {"bias": True}),
    "qwen3_moe-4bit-lora-ep2": ("qwen3_moe", 2, {"quant": True, "lora": True}),
    # ep 2 inside 4 data-parallel ranks: ep groups {0, 1} and {2, 3}; ranks 0 and 2 hold the same experts (efsdp)
    "qwen3_moe-lora-ep2-of-4": ("qwen3_moe", 4, {"lora": True, "ep": 2}),
}


@pytest.mark.parametrize("name", list(CASES))
def test_expert_parallel_matches_one_process(family_dirs, name):
    """Hidden states, routes, loss and every trainable gradient of ep ranks against the single-process model over
    all their tokens (module docstring: reference and tolerance)."""
    family, world, case = CASES[name]
    model_dir = str(family_dirs[family])
    ref = _reference(model_dir, case, world)
    ranks = run_ranks(_ep_rank, world, model_dir, case)
    worst = {"hidden": 0.0, "loss": 0.0, "grad": 0.0}

    assert ranks[0]["blocks"] == len(ref["routes"]) > 0
    for r, out in enumerate(ranks):
        rows = slice(r * B, (r + 1) * B)
        for layer, ids in out["routes"].items():  # the same experts chosen (or replayed) as on one process
            assert torch.equal(ids, ref["routes"][layer][rows]), (r, layer)
        worst["hidden"] = max(worst["hidden"], _rel(out["hidden"], ref["hidden"][rows]))
        worst["loss"] = max(worst["loss"], _rel(out["loss"], ref["loss"]))
        assert set(out["held"]) <= set(out["shards"])
        for pname, grad in out["held"].items():
            worst["grad"] = max(worst["grad"], _rel(grad, out["shards"][pname].take(ref["grads"][pname])))
    dense = ranks[0]["dense"]
    assert set(dense) | set(ranks[0]["held"]) == set(ref["grads"])
    for pname, grad in dense.items():
        worst["grad"] = max(worst["grad"], _rel(grad, ref["grads"][pname]))
    print(f"{name}: max relative difference {worst}")
    assert max(worst.values()) <= RTOL, worst

    if case.get("forced") or case.get("bias"):  # the uneven premise holds: some rank received no row at all
        E = 8  # the tiny MoE models' experts
        counts = torch.zeros(E, dtype=torch.int64)
        for ids in ref["routes"].values():
            counts += torch.bincount(ids.flatten().long(), minlength=E)
        per_rank = counts.view(case.get("ep", world), -1).sum(dim=1)
        assert (per_rank == 0).any() and (per_rank > 0).sum() >= 1, per_rank


def _held_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    shards = expert_shards(model)
    return {k: v.detach().clone() for k, v in model.state_dict().items() if k in shards}


def _split_loaded(model_dir: str, mesh, dims, case: dict | None = None) -> torch.nn.Module:
    model = _build(model_dir, case or {})
    apply_expert_parallel(model, mesh, dims)
    return model


def _meta_and_state_rank(dirs: dict[str, str], tmp_dir: str) -> dict:
    world = dist.get_world_size()
    dims = ParallelDims(dp_shard=world, ep=world, world_size=world).resolved()
    mesh = build_mesh(dims)
    out = {}
    ids = _tokens(world)[0][:B]
    for family in ("qwen3_moe", "deepseek_v3"):
        model_dir = dirs[family]
        loaded = _split_loaded(model_dir, mesh, dims)
        # split on the meta device, then load only the held slices (expert_shards) of the checkpoint's tensors
        on_meta = build_on_meta(model_dir)
        apply_expert_parallel(on_meta, mesh, dims)
        shards = expert_shards(on_meta)
        whole = load_pretrained(model_dir).state_dict()  # stands in for the checkpoint reader
        on_meta.load_state_dict({k: shards[k].take(v) if k in shards else v for k, v in whole.items()}, assign=True)
        on_meta.tie_weights()
        same_state = all(torch.equal(v, on_meta.state_dict()[k]) for k, v in loaded.state_dict().items())
        with torch.no_grad():
            same_forward = torch.equal(loaded(ids), on_meta(ids))
        # an adapter added after the split holds the slice of the one the same seed adds to the whole model
        apply_lora(loaded, LORA, seed=0)
        whole_lora = load_pretrained(model_dir)
        apply_lora(whole_lora, LORA, seed=0)
        shards = expert_shards(loaded)
        same_lora = all(torch.equal(v, shards[k].take(whole_lora.state_dict()[k]) if k in shards else
                                    whole_lora.state_dict()[k]) for k, v in loaded.state_dict().items())
        # 4-bit: quantizing the held experts gives the held slice of the quantized whole model
        quantize_experts_(loaded, "nf4", 32)
        quantize_experts_(whole_lora, "nf4", 32)
        shards = expert_shards(loaded)
        same_quant = all(torch.equal(v, shards[k].take(whole_lora.state_dict()[k]) if k in shards else
                                     whole_lora.state_dict()[k]) for k, v in loaded.state_dict().items())
        out[family] = {"meta_state": same_state, "meta_forward": same_forward, "lora_after": same_lora,
                       "quant_after": same_quant, "held_keys": sorted(shards)}
    # every kind of expert tensor (4-bit buffers, expert LoRA factors) for the gather in the parent
    model = _split_loaded(dirs["qwen3_moe"], mesh, dims, {"quant": True, "lora": True})
    out["held"], out["shards"] = _held_state(model), expert_shards(model)
    with pytest.raises(ValueError, match="per-row LoRA adapters"):
        with per_row_adapters(RowAdapters.from_names(["default", None])):
            model(_tokens(world)[0][:2])
    with pytest.raises(ValueError, match="holds experts [0-9]+..[0-9]+ of 8 .expert parallelism"):
        save_pretrained(model, tmp_dir)  # per-expert keys would be renumbered from 0: refused
    with pytest.raises(ValueError, match="save a PEFT adapter"):
        save_peft_adapter(model, LORA, tmp_dir, "tiny")
    with pytest.raises(ValueError, match="already split"):
        apply_expert_parallel(model, mesh, dims)
    with pytest.raises(ValueError, match="needs routed experts"):
        apply_expert_parallel(load_pretrained(dirs["qwen3"]), mesh, dims)
    return out


def test_split_on_meta_loads_the_held_slices_and_gathers_back(family_dirs, tmp_path):
    """Reference: the loaded whole model. Bitwise: splitting on the meta device then loading the held slices equals
    splitting the loaded model (state and forward); an adapter added, or experts quantized, after the split are the
    held slices of the whole model's; each rank's held tensors put back (ExpertShard.put) rebuild the whole ones.
    Saving a split model as a whole checkpoint or adapter is refused."""
    dirs = {k: str(v) for k, v in family_dirs.items()}
    world = 2
    ranks = run_ranks(_meta_and_state_rank, world, dirs, str(tmp_path))
    for out in ranks:
        for family in ("qwen3_moe", "deepseek_v3"):
            checks = out[family]
            assert checks["meta_state"] and checks["meta_forward"] and checks["lora_after"] and checks["quant_after"]
            kinds = {k.rsplit(".", 1)[-1] for k in checks["held_keys"]}
            assert {"packed", "scales", "gate_up_proj", "down_proj"} <= kinds, kinds  # LoRA tensors keep weight names
    whole = _build(dirs["qwen3_moe"], {"quant": True, "lora": True}).state_dict()
    keys = set(ranks[0]["held"])
    assert keys and all(set(out["held"]) == keys for out in ranks)
    assert any(".lora_A." in k for k in keys) and any(".lora_B." in k for k in keys) and any(
        k.endswith(".packed") for k in keys)
    for key in keys:
        gathered = torch.full_like(whole[key], 7)
        for out in ranks:
            out["shards"][key].put(gathered, out["held"][key])
        assert torch.equal(gathered, whole[key]), key


def test_ep_one_changes_nothing(family_dirs):
    model = load_pretrained(family_dirs["qwen3_moe"])
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert apply_expert_parallel(model, None, ParallelDims(world_size=1).resolved()) == 0
    assert expert_shards(model) == {} and all(m.dispatcher is None for m in model.modules() if isinstance(m, Experts))
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
