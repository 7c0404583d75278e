"""Multi-LoRA: requests for different adapters and for the base model in the same forward passes.

Per-row adapters (models.lora.per_row_adapters) on the dense model and on Qwen3-MoE, whose adapters include the
routed experts (ExpertsLoRA). References: the same request alone on the engine (deterministic mode: bitwise), and a
separately loaded model with only that adapter active, run without cache or batching (fast mode: 1e-5). Engine
level: the adapter capacity is an LRU that never evicts an adapter a running request uses, and an unloaded adapter
keeps serving its running requests.
"""
import json
import shutil
import threading
import time

import pytest
import torch

from models import load_pretrained, save_pretrained
from models.llama import CausalLM, ModelArgs
from models.lora import (
    LoraConfig, adapter_names, apply_lora, load_peft_adapter, save_peft_adapter, set_active_adapter,
)
from models.moe import Experts
from models.tiny import _init_weights
from models.tokenizer import load_tokenizer
from services.common.errors import NotFound
from services.rollout.engine import Engine
from services.rollout.sampling import SamplingParams

from rollout_reference import SMALL_POOL_MB, Arrival, drive, make_core, naive_greedy, outcome, write_adapter

TOL = 1e-5
FAMILIES = ("qwen3", "qwen3_moe")


@pytest.fixture(scope="module")
def adapters(family_dirs, tmp_path_factory):
    root = tmp_path_factory.mktemp("multi_lora")
    return {f: {name: write_adapter(family_dirs[f], root / f / name, seed=seed, b_scale=0.5)
                for name, seed in (("a", 11), ("b", 12))} for f in FAMILIES}


@pytest.fixture(scope="module")
def served(family_dirs, adapters):
    """Per family: one model holding both adapters (as the engine serves them), and its tokenizer."""
    out = {}
    for f in FAMILIES:
        model = load_pretrained(family_dirs[f])
        for name, path in adapters[f].items():
            load_peft_adapter(model, path, name)
        set_active_adapter(model, None)
        out[f] = (model, load_tokenizer(family_dirs[f]))
    assert any(isinstance(m, Experts) and m.lora is not None for m in out["qwen3_moe"][0].modules())
    return out


def _arrivals(params: SamplingParams) -> list[Arrival]:
    prompts = [[5, 17, 99, 3, 250], [7, 7, 300, 12], [400, 2, 9, 81, 33, 18], [5, 17, 99, 3, 250]]
    adapters = [None, "a", "b", "a"]
    return [Arrival(f"r{i}", p, params, adapter=a) for i, (p, a) in enumerate(zip(prompts, adapters))]


@pytest.mark.parametrize("family", FAMILIES)
def test_mixed_adapters_in_one_batch_are_bitwise_single_adapter_runs(served, family):
    model, tokenizer = served[family]
    arrivals = _arrivals(SamplingParams(n=2, temperature=0.8, seed=5, max_tokens=6, top_logprobs=2))
    run = drive(make_core(model, tokenizer, deterministic=True), arrivals)
    assert run.max_batch == 8  # all four requests (two samples each) in the same steps
    for a in arrivals:
        alone = drive(make_core(model, tokenizer, deterministic=True), [a]).results[a.name]
        assert outcome(run.results[a.name]) == outcome(alone), a
    # Not vacuous: the same prompt with adapter "a" and with the base model differ.
    assert run.results["r3"].sequences[0].logprobs != run.results["r0"].sequences[0].logprobs


@pytest.mark.parametrize("family", FAMILIES)
def test_mixed_adapters_match_a_model_with_only_that_adapter(served, family_dirs, adapters, family):
    model, tokenizer = served[family]
    arrivals = _arrivals(SamplingParams(temperature=0, max_tokens=6))
    run = drive(make_core(model, tokenizer), arrivals)
    for a in arrivals:
        reference = load_pretrained(family_dirs[family])
        if a.adapter is not None:
            load_peft_adapter(reference, adapters[family][a.adapter])
        tokens, logprobs = naive_greedy(reference, a.prompt, 6, stop_ids=set())
        (seq,) = run.results[a.name].sequences
        assert seq.tokens == tokens, a
        torch.testing.assert_close(torch.tensor(seq.logprobs), torch.tensor(logprobs), atol=TOL, rtol=0)


@pytest.fixture
def small_engine():
    engine = Engine(max_loaded_adapters=1, kv_cache_mb=SMALL_POOL_MB)
    yield engine
    engine.close()


LONG = SamplingParams(temperature=0, max_tokens=1500)


def test_an_adapter_in_use_is_never_evicted(small_engine, tiny_model_dir, adapter_dirs, prompt_ids):
    model_dir = str(tiny_model_dir)
    small_engine.load_adapter("a", model_dir, adapter_dirs["a"])
    handle = small_engine.submit(model_dir, "a", prompt_ids, LONG)
    next(iter(handle))  # running
    loader = threading.Thread(target=small_engine.load_adapter, args=("b", model_dir, adapter_dirs["b"]))
    loader.start()
    time.sleep(0.3)
    assert loader.is_alive() and small_engine.loaded_adapters() == ["a"]  # capacity 1, "a" is in use: b waits
    handle.cancel()  # the request ends, "a" is free to go
    loader.join(timeout=30)
    assert not loader.is_alive() and small_engine.loaded_adapters() == ["b"]
    assert small_engine.base(model_dir).core.scheduler.blocks.num_free == (
        small_engine.base(model_dir).core.scheduler.blocks.num_blocks)


def test_unloading_an_adapter_in_use_lets_its_requests_finish(small_engine, tiny_model_dir, adapter_dirs,
                                                              prompt_ids):
    model_dir = str(tiny_model_dir)
    params = SamplingParams(temperature=0, max_tokens=40)
    small_engine.load_adapter("v1", model_dir, adapter_dirs["a"])
    (expected,) = small_engine.generate(model_dir, "v1", prompt_ids, params)
    handle = small_engine.submit(model_dir, "v1", prompt_ids, params)
    outputs = iter(handle)
    first = next(outputs)
    assert small_engine.unload_adapter("v1") is True
    assert small_engine.loaded_adapters() == []  # forgotten for everyone new ...
    with pytest.raises(NotFound):
        small_engine.submit(model_dir, "v1", prompt_ids, params)
    tokens = first.sequences[0].tokens + [t for out in outputs for d in out.sequences for t in d.tokens]
    assert tokens == expected.tokens  # ... while the running request finishes on its weights
    model = small_engine.base(model_dir).model
    assert adapter_names(model) == []  # and then they are freed
    # A new version under a new id loads into the freed capacity.
    small_engine.load_adapter("v2", model_dir, adapter_dirs["b"])
    assert small_engine.loaded_adapters() == ["v2"]


def test_threads_submitting_to_one_engine_get_their_alone_results(tiny_model_dir, adapter_dirs, prompt_ids):
    """The engine loop batches concurrent callers; deterministic mode makes each result its alone result."""
    engine = Engine(max_loaded_adapters=2, kv_cache_mb=SMALL_POOL_MB, deterministic=True)
    model_dir = str(tiny_model_dir)
    engine.load_adapter("a", model_dir, adapter_dirs["a"])
    engine.load_adapter("b", model_dir, adapter_dirs["b"])
    jobs = [(None, 1), ("a", 2), ("b", 3), ("a", 4), (None, 5)]
    params = {seed: SamplingParams(n=2, seed=seed, max_tokens=12) for _, seed in jobs}
    alone = {seed: engine.generate(model_dir, adapter, prompt_ids, params[seed]) for adapter, seed in jobs}
    results: dict[int, list] = {}
    barrier = threading.Barrier(len(jobs))

    def call(adapter, seed):
        barrier.wait()
        results[seed] = engine.generate(model_dir, adapter, prompt_ids, params[seed])

    threads = [threading.Thread(target=call, args=job) for job in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    engine.close()
    assert {seed: [(s.tokens, s.logprobs) for s in r] for seed, r in results.items()} == {
        seed: [(s.tokens, s.logprobs) for s in r] for seed, r in alone.items()}


@pytest.mark.parametrize("tied", [False, True])
def test_an_adapter_on_the_unembedding_applies_per_row(tiny_model_dir, tmp_path, tied):
    """lm_head runs on the rows that need logits only, so it gets its own per-row adapter map; tied to the input
    embeddings (as the small Qwen3 models' is), the adapter runs next to the shared weight, which stays as it was."""
    untied = tmp_path / "untied"
    shutil.copytree(tiny_model_dir, untied)
    config = json.loads((untied / "config.json").read_text())
    config["tie_word_embeddings"] = tied
    model = CausalLM(ModelArgs.from_hf_config(config))
    _init_weights(model, seed=3)
    save_pretrained(model, untied)
    cfg = LoraConfig(rank=4, alpha=8.0, target_modules=("q_proj", "lm_head"))
    params = apply_lora(model, cfg, "default", seed=1)
    with torch.no_grad():
        for lora_B in params[1::2]:
            lora_B.normal_(0, 0.5, generator=torch.Generator().manual_seed(2))
    save_peft_adapter(model, cfg, tmp_path / "head", str(untied))

    served = load_pretrained(untied)
    load_peft_adapter(served, tmp_path / "head", "head")
    set_active_adapter(served, None)
    prompt = [5, 17, 99, 3, 250]
    arrivals = [Arrival("base", prompt, SamplingParams(temperature=0, max_tokens=5)),
                Arrival("head", prompt, SamplingParams(temperature=0, max_tokens=5, prompt_logprobs=True),
                        adapter="head")]
    run = drive(make_core(served, load_tokenizer(untied)), arrivals)
    for a in arrivals:
        reference = load_pretrained(untied)
        if a.adapter:
            load_peft_adapter(reference, tmp_path / "head")
        tokens, logprobs = naive_greedy(reference, prompt, 5, stop_ids=set())
        (seq,) = run.results[a.name].sequences
        assert seq.tokens == tokens, a.name
        torch.testing.assert_close(torch.tensor(seq.logprobs), torch.tensor(logprobs), atol=TOL, rtol=0)
