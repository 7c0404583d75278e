"""LoRA adapters in the engine: switching per request, equality with base for a zero adapter, LRU eviction."""
import pytest
import torch

from models import load_pretrained
from models.lora import load_peft_adapter
from services.common.errors import FailedPrecondition, NotFound
from services.rollout.engine import Engine
from services.rollout.sampling import SamplingParams

from rollout_reference import SMALL_POOL_MB, naive_greedy

GREEDY = SamplingParams(temperature=0, max_tokens=16)


@pytest.fixture
def fresh_engine():
    engine = Engine(max_loaded_adapters=2, kv_cache_mb=SMALL_POOL_MB)
    yield engine
    engine.close()


def greedy(engine, model_dir, adapter, prompt_ids):
    (seq,) = engine.generate(str(model_dir), adapter, prompt_ids, GREEDY)
    return seq


def test_adapter_changes_outputs_and_switching_back_restores_base(engine, tiny_model_dir, adapter_dirs, prompt_ids):
    engine.load_adapter("dep_a", str(tiny_model_dir), adapter_dirs["a"])
    base1 = greedy(engine, tiny_model_dir, None, prompt_ids)
    with_a = greedy(engine, tiny_model_dir, "dep_a", prompt_ids)
    base2 = greedy(engine, tiny_model_dir, None, prompt_ids)
    assert with_a.logprobs != base1.logprobs
    assert (base2.tokens, base2.logprobs) == (base1.tokens, base1.logprobs)


def test_zero_adapter_equals_base(engine, tiny_model_dir, adapter_dirs, prompt_ids):
    engine.load_adapter("dep_zero", str(tiny_model_dir), adapter_dirs["zero"])
    params = SamplingParams(n=3, max_tokens=16, seed=11)
    base = engine.generate(str(tiny_model_dir), None, prompt_ids, params)
    zero = engine.generate(str(tiny_model_dir), "dep_zero", prompt_ids, params)
    assert [(s.tokens, s.logprobs) for s in zero] == [(s.tokens, s.logprobs) for s in base]


def test_adapter_matches_naive_reference_model(engine, tiny_model_dir, adapter_dirs, prompt_ids):
    """Cached decoding with the adapter == a separately loaded model + adapter run without a cache."""
    engine.load_adapter("dep_b", str(tiny_model_dir), adapter_dirs["b"])
    seq = greedy(engine, tiny_model_dir, "dep_b", prompt_ids)
    reference = load_pretrained(tiny_model_dir)
    load_peft_adapter(reference, adapter_dirs["b"])
    eos_ids = set(engine.base(str(tiny_model_dir)).eos_ids)
    tokens, logprobs = naive_greedy(reference, prompt_ids, GREEDY.max_tokens, eos_ids)
    assert seq.tokens == tokens
    torch.testing.assert_close(torch.tensor(seq.logprobs), torch.tensor(logprobs), atol=1e-5, rtol=0)


def test_lru_eviction_and_reload_on_use(fresh_engine, tiny_model_dir, adapter_dirs, prompt_ids):
    model_dir = str(tiny_model_dir)
    fresh_engine.load_adapter("a", model_dir, adapter_dirs["a"])
    expected_a = greedy(fresh_engine, model_dir, "a", prompt_ids)
    fresh_engine.load_adapter("b", model_dir, adapter_dirs["b"])
    fresh_engine.load_adapter("c", model_dir, adapter_dirs["c"])
    assert fresh_engine.loaded_adapters() == ["b", "c"]  # "a" was least recently used
    # An evicted adapter is still known: using it loads it again (and evicts the now least recent "b").
    again = greedy(fresh_engine, model_dir, "a", prompt_ids)
    assert (again.tokens, again.logprobs) == (expected_a.tokens, expected_a.logprobs)
    assert fresh_engine.loaded_adapters() == ["c", "a"]
    # Using an adapter makes it the most recent.
    greedy(fresh_engine, model_dir, "c", prompt_ids)
    fresh_engine.load_adapter("b", model_dir, adapter_dirs["b"])
    assert fresh_engine.loaded_adapters() == ["c", "b"]


def test_unload_forgets_the_adapter(fresh_engine, tiny_model_dir, adapter_dirs, prompt_ids):
    model_dir = str(tiny_model_dir)
    fresh_engine.load_adapter("a", model_dir, adapter_dirs["a"])
    assert fresh_engine.unload_adapter("a") is True
    assert fresh_engine.unload_adapter("a") is False
    assert fresh_engine.loaded_adapters() == []
    with pytest.raises(NotFound):
        greedy(fresh_engine, model_dir, "a", prompt_ids)


def test_lazy_adapter_loads_on_first_use(fresh_engine, tiny_model_dir, adapter_dirs, prompt_ids):
    model_dir = str(tiny_model_dir)
    fresh_engine.load_adapter("a", model_dir, adapter_dirs["a"], eager=False)
    assert fresh_engine.loaded_adapters() == []
    greedy(fresh_engine, model_dir, "a", prompt_ids)
    assert fresh_engine.loaded_adapters() == ["a"]


def test_adapter_that_does_not_fit_is_refused(fresh_engine, tiny_model_dir, tmp_path):
    (tmp_path / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 4, "lora_alpha": 8, '
                                                  '"target_modules": ["no_such_proj"]}')
    (tmp_path / "adapter_model.safetensors").write_bytes(b"")
    with pytest.raises(FailedPrecondition, match="cannot load adapter 'bad'"):
        fresh_engine.load_adapter("bad", str(tiny_model_dir), tmp_path)
    assert fresh_engine.loaded_adapters() == []
