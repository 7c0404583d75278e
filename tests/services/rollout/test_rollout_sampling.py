"""Sampling and KV-cached generation against a naive full-forward loop (services/rollout/sampling.py, engine.py).

Reference: the same model code run over the whole sequence without a cache; logprobs agree within 1e-5 (float32).
"""
import pytest
import torch

from services.common.errors import InvalidArgument
from services.rollout import sampling
from services.rollout.sampling import SamplingParams, SequenceBuilder

from rollout_reference import naive_greedy, naive_logprobs_TV

TOL = 1e-5


def run(engine, model_dir, prompt_ids, **kw):
    return engine.generate(str(model_dir), None, prompt_ids, SamplingParams(**kw))


def test_greedy_matches_naive_loop_without_cache(engine, tiny_model_dir, prompt_ids):
    base = engine.base(str(tiny_model_dir))
    (seq,) = run(engine, tiny_model_dir, prompt_ids, temperature=0, max_tokens=24)
    tokens, logprobs = naive_greedy(base.model, prompt_ids, 24, set(base.eos_ids))
    assert seq.tokens == tokens
    torch.testing.assert_close(torch.tensor(seq.logprobs), torch.tensor(logprobs), atol=TOL, rtol=0)
    assert seq.finish_reason == ("stop" if tokens[-1] in base.eos_ids else "length")


def test_sampled_logprobs_are_raw_log_softmax_of_naive_forward(engine, tiny_model_dir, prompt_ids):
    """Logprobs come from the untempered, unfiltered distribution, whatever temperature/top-k/top-p sampled."""
    base = engine.base(str(tiny_model_dir))
    seqs = run(engine, tiny_model_dir, prompt_ids, temperature=0.7, top_k=50, top_p=0.9, n=4, max_tokens=16, seed=3)
    for seq in seqs:
        lp_TV = naive_logprobs_TV(base.model, prompt_ids + seq.tokens)
        P = len(prompt_ids)
        expected = lp_TV[P - 1:-1].gather(1, torch.tensor(seq.tokens)[:, None]).squeeze(1)
        torch.testing.assert_close(torch.tensor(seq.logprobs), expected, atol=TOL, rtol=0)


def test_top_k_1_and_tiny_top_p_are_greedy(engine, tiny_model_dir, prompt_ids):
    (greedy,) = run(engine, tiny_model_dir, prompt_ids, temperature=0, max_tokens=20)
    for kw in (dict(top_k=1), dict(top_p=1e-6)):
        seqs = run(engine, tiny_model_dir, prompt_ids, temperature=1.5, n=3, max_tokens=20, **kw)
        assert all(s.tokens == greedy.tokens for s in seqs), kw


def test_same_seed_same_tokens_different_seed_different(engine, tiny_model_dir, prompt_ids):
    def tokens(seed):
        return [s.tokens for s in run(engine, tiny_model_dir, prompt_ids, n=4, max_tokens=32, seed=seed)]

    first = tokens(7)
    assert tokens(7) == first
    assert tokens(8) != first
    assert len({tuple(t) for t in first}) == 4  # the n rows draw independently
    assert tokens(None) != tokens(None)  # no seed: a fresh random one each time


def test_n_samples_share_one_prefill(engine, tiny_model_dir, prompt_ids, monkeypatch):
    model = engine.base(str(tiny_model_dir)).model
    shapes = []
    forward = model.forward

    def recording(input_ids_BT, *args, **kwargs):
        shapes.append(tuple(input_ids_BT.shape))
        return forward(input_ids_BT, *args, **kwargs)

    monkeypatch.setattr(model, "forward", recording)
    seqs = run(engine, tiny_model_dir, prompt_ids, n=6, max_tokens=5, seed=0)
    # The engine packs a step's tokens in one row: the prompt once, then one token per unfinished sample per step.
    assert shapes[0] == (1, len(prompt_ids))
    assert all(B == 1 and T <= 6 for B, T in shapes[1:])
    assert len(shapes) == 1 + max(len(s.tokens) for s in seqs) - 1
    assert sum(T for _, T in shapes) == len(prompt_ids) + sum(len(s.tokens) - 1 for s in seqs)


def test_stop_string_cuts_text_and_keeps_the_completing_token(engine, tiny_model_dir, prompt_ids):
    tokenizer = engine.base(str(tiny_model_dir)).tokenizer
    (full,) = run(engine, tiny_model_dir, prompt_ids, temperature=0, max_tokens=30)
    assert full.finish_reason == "length"
    stop = full.text[10:13]
    cut = full.text.index(stop)
    (seq,) = run(engine, tiny_model_dir, prompt_ids, temperature=0, max_tokens=30, stop=[stop, "never-there"])
    k = next(k for k in range(1, 31) if stop in tokenizer.decode(full.tokens[:k]))
    assert seq.finish_reason == "stop"
    assert seq.text == full.text[:cut]
    assert seq.tokens == full.tokens[:k] and seq.logprobs == full.logprobs[:k]


def test_stop_token_ids_and_eos(engine, tiny_model_dir, prompt_ids):
    base = engine.base(str(tiny_model_dir))
    (full,) = run(engine, tiny_model_dir, prompt_ids, temperature=0, max_tokens=30)
    stop_id = full.tokens[6]
    i = full.tokens.index(stop_id)  # its first occurrence
    (seq,) = run(engine, tiny_model_dir, prompt_ids, temperature=0, max_tokens=30, stop_token_ids=[stop_id])
    assert seq.finish_reason == "stop"
    assert seq.tokens == full.tokens[:i + 1]  # the stop token is returned ...
    assert seq.text == base.tokenizer.decode(full.tokens[:i])  # ... but is not part of the text
    # The model's own end-of-sequence ids stop it the same way.
    eos_ids = base.eos_ids
    base.eos_ids = (*eos_ids, stop_id)
    try:
        (eos,) = run(engine, tiny_model_dir, prompt_ids, temperature=0, max_tokens=30)
        # ignore_eos (Tinker's stop=[]): end-of-sequence ids do not stop it, stop_token_ids still do.
        (ignored,) = run(engine, tiny_model_dir, prompt_ids, temperature=0, max_tokens=30, ignore_eos=True)
        (still,) = run(engine, tiny_model_dir, prompt_ids, temperature=0, max_tokens=30, ignore_eos=True,
                       stop_token_ids=[stop_id])
    finally:
        base.eos_ids = eos_ids
    assert (eos.tokens, eos.text, eos.finish_reason) == (seq.tokens, seq.text, "stop")
    assert (ignored.tokens, ignored.finish_reason) == (full.tokens, "length")
    assert (still.tokens, still.finish_reason) == (seq.tokens, "stop")


def test_max_tokens_finishes_with_length(engine, tiny_model_dir, prompt_ids):
    seqs = run(engine, tiny_model_dir, prompt_ids, n=3, max_tokens=7, seed=1)
    for s in seqs:
        assert len(s.tokens) == len(s.logprobs) <= 7
        assert s.finish_reason == ("length" if len(s.tokens) == 7 and s.tokens[-1] not in (0, 2) else "stop")


@pytest.mark.parametrize("kw,field", [
    (dict(temperature=-0.1), "params.temperature"),
    (dict(temperature=10.5), "params.temperature"),
    (dict(temperature=float("nan")), "params.temperature"),
    (dict(top_p=0.0), "params.top_p"),
    (dict(top_p=1.01), "params.top_p"),
    (dict(top_k=-1), "params.top_k"),
    (dict(max_tokens=0), "params.max_tokens"),
    (dict(max_tokens=2048), "params.max_tokens"),  # context 2048 minus the prompt
    (dict(n=0), "params.n"),
    (dict(n=65), "params.n"),
    (dict(stop=[""]), "params.stop"),
])
def test_invalid_params_name_the_field(engine, tiny_model_dir, prompt_ids, kw, field):
    with pytest.raises(InvalidArgument) as exc:
        run(engine, tiny_model_dir, prompt_ids, **kw)
    assert exc.value.violations[0].field == field


@pytest.mark.parametrize("prompt", [[], [1024], [-1], list(range(10)) * 205])
def test_invalid_prompts(engine, tiny_model_dir, prompt):
    with pytest.raises(InvalidArgument) as exc:
        run(engine, tiny_model_dir, prompt, max_tokens=1)
    assert exc.value.violations[0].field == "prompt"


def test_filter_logits_top_k_and_nucleus():
    logits = torch.log(torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05]]))
    kept = lambda out: torch.isfinite(out[0]).nonzero().flatten().tolist()  # noqa: E731
    assert kept(sampling.filter_logits(logits, 2, 1.0)) == [0, 1]
    assert kept(sampling.filter_logits(logits, 0, 0.7)) == [0, 1]  # 0.5 + 0.2 reaches 0.7
    assert kept(sampling.filter_logits(logits, 0, 0.71)) == [0, 1, 2]
    assert kept(sampling.filter_logits(logits, 0, 1e-9)) == [0]  # always at least the top token
    assert kept(sampling.filter_logits(logits, 3, 0.9)) == [0, 1, 2]  # top-k first, then the nucleus of what is left


def test_incremental_text_holds_back_split_characters(engine, tiny_model_dir):
    tokenizer = engine.base(str(tiny_model_dir)).tokenizer
    text = "héllo wörld, the ünïcode ✓"
    ids = tokenizer(text)["input_ids"]
    builder = SequenceBuilder(tokenizer, SamplingParams(max_tokens=len(ids)), stop_ids=set())
    for t in ids:
        builder.append(t, 0.0)
        assert "\ufffd" not in builder.seq.text
    assert builder.seq.text == text and builder.seq.finish_reason == "length"
    # A stop string found across a split character.
    builder = SequenceBuilder(tokenizer, SamplingParams(max_tokens=100, stop=("ö",)), stop_ids=set())
    for t in ids:
        if builder.append(t, 0.0):
            break
    k = next(k for k in range(len(ids)) if "ö" in tokenizer.decode(ids[:k]))
    assert (builder.seq.text, builder.seq.tokens, builder.seq.finish_reason) == ("héllo w", ids[:k], "stop")


# ---- min-p, top-logprob alternatives, prompt logprobs, per-sample seeds -----------------------------------------


def naive_min_p(logits_V: torch.Tensor, min_p: float) -> set[int]:
    """The tokens min-p keeps, written out: p >= min_p * max p."""
    probs = torch.softmax(logits_V, dim=-1)
    return {i for i, p in enumerate(probs.tolist()) if p >= min_p * float(probs.max())}


def test_min_p_keeps_tokens_above_the_fraction_of_the_top_probability():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0)) * 3
    for min_p in (0.0, 0.05, 0.3, 1.0):
        out = sampling.filter_logits(logits, 0, 1.0, min_p)
        for row in range(3):
            assert set(torch.isfinite(out[row]).nonzero().flatten().tolist()) == naive_min_p(logits[row], min_p)


def test_per_row_filters_equal_one_row_at_a_time():
    logits = torch.randn(4, 64, generator=torch.Generator().manual_seed(1)) * 2
    top_k, top_p, min_p = [0, 5, 20, 1], [0.9, 1.0, 0.5, 0.3], [0.0, 0.1, 0.0, 0.2]
    batched = sampling.filter_logits(logits, top_k, top_p, min_p)
    for row in range(4):
        alone = sampling.filter_logits(logits[row:row + 1], top_k[row], top_p[row], min_p[row])
        assert torch.equal(batched[row:row + 1], alone)


def test_min_p_one_is_greedy(engine, tiny_model_dir, prompt_ids):
    (greedy,) = run(engine, tiny_model_dir, prompt_ids, temperature=0, max_tokens=12)
    seqs = run(engine, tiny_model_dir, prompt_ids, temperature=2.0, min_p=1.0, n=3, max_tokens=12)
    assert all(s.tokens == greedy.tokens for s in seqs)


def test_top_logprobs_and_prompt_logprobs_match_the_naive_forward(engine, tiny_model_dir, prompt_ids):
    base = engine.base(str(tiny_model_dir))
    handle = engine.submit(str(tiny_model_dir), None, prompt_ids,
                           SamplingParams(n=2, seed=4, max_tokens=10, top_logprobs=5, prompt_logprobs=True))
    result = handle.result()
    P = len(prompt_ids)
    lp_TV = naive_logprobs_TV(base.model, prompt_ids)
    expected_prompt = lp_TV[:-1].gather(1, torch.tensor(prompt_ids[1:])[:, None]).squeeze(1)
    assert len(result.prompt_logprobs) == P - 1
    torch.testing.assert_close(torch.tensor(result.prompt_logprobs), expected_prompt, atol=TOL, rtol=0)
    for seq in result.sequences:
        lp_TV = naive_logprobs_TV(base.model, prompt_ids + seq.tokens)[P - 1:-1]
        values, ids = lp_TV.topk(5, dim=-1)
        assert [[t for t, _ in alts] for alts in seq.top_logprobs] == ids.tolist()
        got = torch.tensor([[lp for _, lp in alts] for alts in seq.top_logprobs])
        torch.testing.assert_close(got, values, atol=TOL, rtol=0)


def test_a_sample_draws_the_same_whatever_n():
    """Sample i's generator depends on (seed, i) only, so asking for more samples does not change the first ones."""
    two = [g.initial_seed() for g in sampling.sample_generators(9, 2, "cpu")]
    five = [g.initial_seed() for g in sampling.sample_generators(9, 5, "cpu")]
    assert five[:2] == two and len(set(five)) == 5


@pytest.mark.parametrize("kw,field", [
    (dict(min_p=-0.1), "params.min_p"),
    (dict(min_p=1.5), "params.min_p"),
    (dict(top_logprobs=21), "params.top_logprobs"),
    (dict(top_logprobs=-1), "params.top_logprobs"),
    (dict(return_router_ids=True), "params.return_router_ids"),  # the dense tiny model has no router
])
def test_invalid_new_params_name_the_field(engine, tiny_model_dir, prompt_ids, kw, field):
    with pytest.raises(InvalidArgument) as exc:
        run(engine, tiny_model_dir, prompt_ids, **kw)
    assert exc.value.violations[0].field == field


def test_stream_holds_back_text_that_could_start_a_stop_string(engine, tiny_model_dir, prompt_ids):
    """Streamed text never has to be taken back: it is always a prefix of the final text."""
    (full,) = run(engine, tiny_model_dir, prompt_ids, temperature=0, max_tokens=30)
    stop = full.text[10:14]
    handle = engine.submit(str(tiny_model_dir), None, prompt_ids,
                           SamplingParams(temperature=0, max_tokens=30, stop=(stop,)))
    streamed = ""
    for out in handle:
        for d in out.sequences:
            streamed += d.text
    assert streamed == full.text[:full.text.index(stop)]


def test_ignore_eos_travels_from_the_request():
    """SampleRequest.params.ignore_eos (the SDK sets it for Tinker's SamplingParams(stop=[])) reaches the engine's
    parameters; unset it is off."""
    from services.rollout.servicer import sampling_params
    from trainyard import types
    from trainyard.v1 import rollout_pb2

    assert sampling_params(rollout_pb2.SamplingParams(ignore_eos=True)).ignore_eos
    assert not sampling_params(rollout_pb2.SamplingParams()).ignore_eos
    assert sampling_params(types.SamplingParams(stop=[]).to_proto()).ignore_eos
    assert not sampling_params(types.SamplingParams(stop=None).to_proto()).ignore_eos
    assert not sampling_params(types.SamplingParams(stop=["\n"]).to_proto()).ignore_eos
