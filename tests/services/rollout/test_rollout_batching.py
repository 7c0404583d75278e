"""Continuous batching, paged KV, prefix sharing, chunked prefill and preemption, against running each request alone.

Deterministic mode (kernels/batch_invariant.py): every request's tokens, logprobs, top-logprob alternatives, prompt
logprobs and router ids must be bitwise equal to running it alone on a fresh engine, whatever arrives with it and
when, at any batch size, with chunked prefill, and with preemption (recompute) forced by a tiny KV pool. Fast mode:
equal greedy tokens and logprobs within 1e-5 (float32). Every scenario ends with every KV block free.
"""
import pytest
import torch

from services.trainer.engine.logprobs import target_logprobs
from models import load_pretrained
from models.tokenizer import load_tokenizer
from services.common.errors import InvalidArgument
from services.rollout.sampling import SamplingParams

from rollout_reference import Arrival, assert_blocks_all_free, drive, make_core, outcome

TOL = 1e-5


@pytest.fixture(scope="module")
def loaded(family_dirs):
    return {f: (load_pretrained(d), load_tokenizer(d)) for f, d in family_dirs.items()}


def _prompt(length: int, seed: int) -> list[int]:
    return torch.randint(3, 1000, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def requests(moe: bool) -> list[Arrival]:
    """Five requests that differ in every knob: prompt length, n, sampling filters, what they return."""
    router = dict(return_router_ids=moe)
    return [
        Arrival("r0", _prompt(9, 0), SamplingParams(n=3, temperature=0.9, seed=1, max_tokens=8, top_logprobs=2)),
        Arrival("r1", _prompt(3, 1), SamplingParams(temperature=0, max_tokens=10, prompt_logprobs=True, **router)),
        Arrival("r2", _prompt(17, 2), SamplingParams(n=2, temperature=1.2, top_k=20, top_p=0.9, min_p=0.05,
                                                      seed=2, max_tokens=6, **router)),
        Arrival("r3", _prompt(5, 3), SamplingParams(n=4, temperature=0.7, seed=3, max_tokens=7)),
        Arrival("r4", _prompt(12, 4), SamplingParams(temperature=1.0, seed=4, max_tokens=9, prompt_logprobs=True,
                                                      top_logprobs=3, **router)),
    ]


def _alone(model, tokenizer, arrivals, **config) -> dict:
    out = {}
    for a in arrivals:
        run = drive(make_core(model, tokenizer, **config), [a])
        assert_blocks_all_free(run.core)
        out[a.name] = outcome(run.results[a.name])
    return out


def _staggered(arrivals):
    """Reverse order, one request every other step or so."""
    steps = [0, 1, 3, 4, 6]
    return [Arrival(a.name, a.prompt, a.params, step) for a, step in zip(reversed(arrivals), steps)]


SCENARIOS = {
    "together": lambda a: (a, {}),
    "staggered_reversed": lambda a: (_staggered(a), {}),
    "batch_of_2": lambda a: (a, dict(max_num_seqs=2)),
    "chunked_prefill": lambda a: (_staggered(a), dict(max_num_batched_tokens=4, kv_block_size=4)),
    "tiny_pool_preempts": lambda a: (a, dict(kv_cache_blocks=8, kv_block_size=4)),
    "chunked_tiny_pool": lambda a: (_staggered(a), dict(max_num_batched_tokens=5, kv_cache_blocks=8,
                                                        kv_block_size=4)),
}
CASES = [("qwen3", s) for s in SCENARIOS] + [(f, s) for f in ("qwen3_moe", "deepseek_v3")
                                             for s in ("together", "chunked_tiny_pool")]


@pytest.fixture(scope="module")
def alone_results(loaded):
    return {f: _alone(*loaded[f], requests(f != "qwen3"), deterministic=True) for f in loaded}


@pytest.mark.parametrize("family,scenario", CASES)
def test_deterministic_batching_is_bitwise_running_alone(loaded, alone_results, family, scenario):
    arrivals, config = SCENARIOS[scenario](requests(family != "qwen3"))
    run = drive(make_core(*loaded[family], deterministic=True, **config), arrivals)
    got = {name: outcome(g) for name, g in run.results.items()}
    assert got == alone_results[family]
    assert_blocks_all_free(run.core)
    n = {a.name: a.params.n for a in arrivals}
    for name, g in run.results.items():  # nothing lost: every sample ran to its end
        assert len(g.sequences) == n[name] and all(s.finish_reason in ("stop", "length") for s in g.sequences)
    if scenario == "together":
        assert run.max_batch == sum(a.params.n for a in arrivals)  # every sample in one step
    if scenario == "batch_of_2":
        assert run.max_batch == 2
    if "tiny_pool" in scenario:
        assert run.core.scheduler.num_preemptions > 0


def test_fast_mode_batching_matches_alone_within_tolerance(loaded):
    model, tokenizer = loaded["qwen3"]
    arrivals = [Arrival(a.name, a.prompt, SamplingParams(temperature=0, max_tokens=8, n=a.params.n))
                for a in requests(False)]
    alone = _alone(model, tokenizer, arrivals)
    for config in ({}, dict(kv_cache_blocks=8, kv_block_size=4)):
        run = drive(make_core(model, tokenizer, **config), arrivals)
        for name, g in run.results.items():
            (ref_seqs, _), seqs = alone[name], outcome(g)[0]
            for ref, got in zip(ref_seqs, seqs):
                assert got[0] == ref[0]
                torch.testing.assert_close(torch.tensor(got[1]), torch.tensor(ref[1]), atol=TOL, rtol=0)
        assert_blocks_all_free(run.core)


def test_samples_of_a_prompt_share_its_blocks(loaded):
    """n samples of one prompt hold one copy of its full blocks: the pool's use while they decode is the prompt's
    full blocks once, plus per sample its copy of the partial block and its own new blocks."""
    model, tokenizer = loaded["qwen3"]
    core = make_core(model, tokenizer, kv_block_size=4, kv_cache_blocks=64)
    prompt = _prompt(10, 7)  # blocks of 4, 4, 2
    handle_outputs = []
    core.add_request("r", prompt, SamplingParams(n=4, max_tokens=3, seed=0), stop_ids=set(),
                     sink=handle_outputs.append)
    core.step()  # the prefill, then the fork into 4 samples
    blocks = core.scheduler.blocks
    tables = [s.block_table for s in core.scheduler.running]
    assert len(tables) == 4 and all(t == tables[0] for t in tables)
    assert [blocks.refcount(b) for b in tables[0]] == [4, 4, 4] and blocks.num_free == 61
    core.step()  # every sample writes position 10: three copy the partial block, the last writes in place
    tables = [s.block_table for s in core.scheduler.running]
    assert {t[0] for t in tables} == {tables[0][0]} and {t[1] for t in tables} == {tables[0][1]}
    assert len({t[2] for t in tables}) == 4 and blocks.num_free == 64 - 2 - 4
    while core.has_work():
        core.step()
    assert_blocks_all_free(core)


@pytest.mark.parametrize("family", ["qwen3", "deepseek_v3"])
def test_decode_logprobs_are_bitwise_the_prefill_logprobs_of_the_same_text(loaded, family):
    """What the trainer computes: the completion's logprobs from one forward over prompt + completion. In
    deterministic mode a position decoded one token at a time and the same position in a prefill agree bitwise."""
    model, tokenizer = loaded[family]
    prompt = _prompt(7, 11)
    first = drive(make_core(model, tokenizer, deterministic=True), [
        Arrival("gen", prompt, SamplingParams(n=2, seed=1, max_tokens=9))]).results["gen"]
    for seq in first.sequences:
        again = drive(make_core(model, tokenizer, deterministic=True, max_num_batched_tokens=6), [
            Arrival("score", prompt + seq.tokens, SamplingParams(max_tokens=1, prompt_logprobs=True))])
        assert again.results["score"].prompt_logprobs[len(prompt) - 1:] == seq.logprobs


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe", "deepseek_v3"])
def test_deterministic_rollout_logprobs_are_bitwise_the_trainer_forward(loaded, family):
    """The trainer's forward over prompt + completion (no cache, under batch_invariant_mode) gives the rollout's
    logprobs bitwise: the contract RL training relies on (no importance-ratio drift from numerics)."""
    model, tokenizer = loaded[family]
    prompt = _prompt(6, 12)
    others = [Arrival(f"o{i}", _prompt(4 + i, 20 + i), SamplingParams(n=2, seed=i, max_tokens=5)) for i in range(2)]
    run = drive(make_core(model, tokenizer, deterministic=True), [
        Arrival("gen", prompt, SamplingParams(n=3, seed=2, max_tokens=8)), *others])
    sequences = run.results["gen"].sequences
    # The trainer's own function (services/trainer/engine/logprobs.py, what Training API Forward runs), on a
    # right-padded batch of all the completions at once.
    rows = [prompt + seq.tokens for seq in sequences]
    T = max(len(r) for r in rows)
    ids = torch.tensor([r + [0] * (T - len(r)) for r in rows])
    with torch.inference_mode():
        trainer = target_logprobs(model, ids[:, :-1], ids[:, 1:], deterministic=True)
    for i, seq in enumerate(sequences):
        assert trainer[i, len(prompt) - 1:len(prompt) - 1 + len(seq.tokens)].tolist() == seq.logprobs


def test_a_request_that_cannot_fit_the_pool_is_invalid(loaded):
    model, tokenizer = loaded["qwen3"]
    core = make_core(model, tokenizer, kv_cache_blocks=4, kv_block_size=4)  # 16 positions
    core.check(10, SamplingParams(max_tokens=7))  # 16 positions fed: fits
    with pytest.raises(InvalidArgument) as exc:
        core.check(10, SamplingParams(max_tokens=8))
    assert exc.value.violations[0].field == "params.max_tokens"
