"""Pipeline stages (models/common/pipeline.py): the tiny model of every family (4 layers) split into 2 or 3 stages,
chained, gives bitwise the unsplit model's output (torch.equal; float32, CPU): logits, logits of a packed row, a
prefill + decode through one KV cache per stage, the experts an MoE model's router picks, and a LoRA model. Stages
keep the original layer numbers and state-dict keys."""

import pytest
import torch

from kernels import Packing
from models import KVCache, load_pretrained
from models.common import pipeline_stage
from models.lora import LoraConfig, apply_lora, merge_adapter
from models.moe import RouterReplay

FAMILIES = ("qwen3", "qwen3_moe", "deepseek_v3")
SPLITS = {"2 stages": [[0, 1], [2, 3]], "3 stages": [[0], [1, 2], [3]]}


@pytest.fixture(scope="module", params=FAMILIES)
def model(request, family_dirs):
    return load_pretrained(family_dirs[request.param])


def _stages(model, split):
    return [pipeline_stage(model, layers, first=i == 0, last=i == len(split) - 1) for i, layers in enumerate(split)]


def _chain(stages, x, caches=None, **kwargs):
    for i, stage in enumerate(stages):
        x = stage(x, cache=None if caches is None else caches[i], **kwargs)
    return x


def _ids(B: int, T: int, seed: int) -> torch.Tensor:
    return torch.randint(3, 1000, (B, T), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("split", list(SPLITS))
@torch.no_grad()
def test_chained_stages_equal_the_whole_model_bitwise(model, split):
    stages = _stages(model, SPLITS[split])
    assert stages[0].model.norm is None and stages[0].lm_head is None
    assert all(s.model.embed_tokens is None for s in stages[1:])
    assert [s.layer_ids for s in stages] == SPLITS[split]
    # Every key of the whole model is on exactly one stage, under its own name (the tied lm_head with embed_tokens).
    keys = [k for s in stages for k in s.state_dict()]
    whole = model.state_dict()
    assert set(keys) - {"lm_head.weight"} == set(whole) - {"lm_head.weight"}
    assert len(keys) == len(set(keys))
    for s in stages:
        for k, v in s.state_dict().items():
            assert torch.equal(v, whole[k]), k

    ids_BT = _ids(2, 11, 0)
    hidden_BTD = stages[0](ids_BT)
    assert hidden_BTD.shape == (2, 11, model.args.hidden_size)
    assert torch.equal(_chain(stages, ids_BT), model(ids_BT))
    assert torch.equal(_chain(stages, ids_BT, return_hidden=True), model(ids_BT, return_hidden=True))

    packing = Packing.from_lengths([4, 1, 6, 3])
    packed_1T = _ids(1, 14, 1)
    assert torch.equal(_chain(stages, packed_1T, packing=packing), model(packed_1T, packing=packing))

    caches = [KVCache.allocate(model.args, 2, 11, torch.float32, "cpu", layers=s.layer_ids) for s in stages]
    assert [c.k_LBKSD.shape[0] for c in caches] == [len(s.layer_ids) for s in stages]
    whole_cache = KVCache.allocate(model.args, 2, 11, torch.float32, "cpu")
    for lo, hi in ((0, 6), (6, 7), (7, 8)):
        assert torch.equal(_chain(stages, ids_BT[:, lo:hi], caches), model(ids_BT[:, lo:hi], cache=whole_cache))


@torch.no_grad()
def test_stages_record_and_replay_the_whole_models_expert_choice(model):
    stages = _stages(model, SPLITS["3 stages"])
    ids_BT = _ids(2, 7, 2)
    whole, split = RouterReplay.record(), RouterReplay.record()
    model(ids_BT, routing=whole)
    _chain(stages, ids_BT, routing=split)
    assert whole.layers == split.layers
    assert all(torch.equal(whole.expert_ids[i], split.expert_ids[i]) for i in whole.layers)
    if whole.layers:
        replay = RouterReplay.replay(dict(whole.expert_ids))
        assert torch.equal(_chain(stages, ids_BT, routing=replay), model(ids_BT, routing=replay))


def test_a_stage_names_layers_the_model_holds(model):
    with pytest.raises(ValueError, match=r"layers \[7\] are not in this model"):
        pipeline_stage(model, [3, 7], first=False, last=True)
    first = pipeline_stage(model, [0, 1], first=True, last=False)
    with pytest.raises(ValueError, match=r"layers \[2\] are not in this model"):
        pipeline_stage(first, [2], first=False, last=True)


@torch.no_grad()
def test_stages_of_a_model_with_lora_and_lora_on_a_stage(family_dirs):
    """A LoRA adapter splits with its layers (bitwise the same logits); apply_lora on a stage adapts only the stage's
    layers; a last stage that holds no embedding takes an adapter on its tied lm_head but refuses to merge it."""
    model = load_pretrained(family_dirs["qwen3"])
    apply_lora(model, LoraConfig(rank=4), seed=0)
    gen = torch.Generator().manual_seed(1)
    for name, p in sorted(model.named_parameters()):
        if "lora_B" in name:
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    ids_BT = _ids(2, 9, 3)
    assert torch.equal(_chain(_stages(model, SPLITS["2 stages"]), ids_BT), model(ids_BT))

    base = load_pretrained(family_dirs["qwen3"])
    first = pipeline_stage(base, [0, 1], first=True, last=False)
    apply_lora(first, LoraConfig(rank=4))
    assert {n.split(".")[2] for n, _ in first.named_parameters() if "lora_" in n} == {"0", "1"}
    last = pipeline_stage(base, [2, 3], first=False, last=True)
    apply_lora(last, LoraConfig(target_modules=("lm_head",)), "head")  # beside the tied weight the stage holds
    with pytest.raises(ValueError, match=r"Cannot merge adapter 'head': it adapts \['lm_head'\]"):
        merge_adapter(last, "head")  # its config still says the weight is the embeddings'
