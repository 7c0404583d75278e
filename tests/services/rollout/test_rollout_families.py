"""Every model family through the engine, and router replay capture for the MoE ones.

Qwen3-MoE (softmax router) and DeepSeek-V3 (MLA with kv_cache_dims (Dqk, Dv), sigmoid router): greedy decoding
through the paged engine equals the naive full forward (float32, 1e-5). Router ids: [P + G - 1, MoE layers, top_k]
uint8 per sample; replaying them in a trainer-style forward over prompt + completion (RouterReplay.from_stacked)
gives the same logits as the plain forward, and the rollout's logprobs are those logits' log_softmax.
"""
import pytest
import torch

from models import load_pretrained
from models.moe import RouterReplay
from models.tokenizer import load_tokenizer
from services.rollout.sampling import SamplingParams

from rollout_reference import Arrival, drive, make_core, naive_greedy

TOL = 1e-5
MOE = ("qwen3_moe", "deepseek_v3")


@pytest.fixture(scope="module")
def loaded(family_dirs):
    return {f: (load_pretrained(d), load_tokenizer(d)) for f, d in family_dirs.items()}


PROMPT = [11, 400, 23, 7, 512, 98, 3, 64, 250]


@pytest.mark.parametrize("family", ["qwen3", *MOE])
def test_greedy_through_the_paged_engine_matches_the_naive_forward(loaded, family):
    model, tokenizer = loaded[family]
    run = drive(make_core(model, tokenizer, kv_block_size=4), [
        Arrival("r", PROMPT, SamplingParams(temperature=0, max_tokens=12))])
    (seq,) = run.results["r"].sequences
    tokens, logprobs = naive_greedy(model, PROMPT, 12, stop_ids=set())
    assert seq.tokens == tokens
    torch.testing.assert_close(torch.tensor(seq.logprobs), torch.tensor(logprobs), atol=TOL, rtol=0)


def test_mla_cache_holds_key_and_value_head_dims(loaded):
    model, tokenizer = loaded["deepseek_v3"]
    core = make_core(model, tokenizer)
    k_dim, v_dim = model.args.kv_cache_dims
    assert (core.pool.k.shape[-1], core.pool.v.shape[-1]) == (k_dim, v_dim) and k_dim != v_dim


@torch.inference_mode()
def _trainer_logits(model, ids: list[int], routing=None) -> torch.Tensor:
    return model(torch.tensor([ids]), routing=routing).float()[0]


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("family", MOE)
def test_router_ids_replayed_by_the_trainer_give_the_same_logits(loaded, family, deterministic):
    model, tokenizer = loaded[family]
    params = SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=7, return_router_ids=True)
    core = make_core(model, tokenizer, deterministic=deterministic, kv_block_size=4)
    result = drive(core, [Arrival("r", PROMPT, params)]).results["r"]
    layers = core.moe_layers
    top_k = model.model.layers[str(layers[0])].mlp.args.top_k
    for seq in result.sequences:
        ids = PROMPT + seq.tokens
        recorded = seq.router_ids
        assert recorded.dtype == torch.uint8 and tuple(recorded.shape) == (len(ids) - 1, len(layers), top_k)
        # The trainer's forward covers every position; the last one (never fed in the rollout) takes its live
        # choice, from a recording forward.
        live = RouterReplay.record()
        plain = _trainer_logits(model, ids, live)
        full_TLK = torch.cat([recorded, live.stacked()[0, -1:]])
        replayed = _trainer_logits(model, ids, RouterReplay.from_stacked(layers, full_TLK[None]))
        torch.testing.assert_close(replayed, plain, atol=TOL, rtol=0)
        logprobs = torch.log_softmax(replayed, dim=-1)[len(PROMPT) - 1:-1]
        expected = logprobs.gather(1, torch.tensor(seq.tokens)[:, None]).squeeze(1)
        torch.testing.assert_close(torch.tensor(seq.logprobs), expected, atol=TOL, rtol=0)
        # The rollout recorded the choice the trainer's router makes (the sampled tokens are far from ties here).
        assert torch.equal(recorded, live.stacked()[0, :-1])


def test_router_ids_survive_preemption_and_chunked_prefill(loaded):
    model, tokenizer = loaded["qwen3_moe"]
    params = SamplingParams(n=3, temperature=1.0, seed=8, max_tokens=6, return_router_ids=True)
    arrivals = [Arrival(f"r{i}", PROMPT[i:] + PROMPT[:i], params) for i in range(3)]
    alone = {a.name: drive(make_core(model, tokenizer, deterministic=True), [a]).results[a.name] for a in arrivals}
    run = drive(make_core(model, tokenizer, deterministic=True, kv_cache_blocks=7, kv_block_size=4,
                          max_num_batched_tokens=5), arrivals)
    assert run.core.scheduler.num_preemptions > 0
    for a in arrivals:
        for got, ref in zip(run.results[a.name].sequences, alone[a.name].sequences):
            assert torch.equal(got.router_ids, ref.router_ids) and got.tokens == ref.tokens
