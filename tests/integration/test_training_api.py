"""The Training API SDK (trainyard.ServiceClient / TrainingClient / SamplingClient) against the real trainer,
weight-sync and rollout processes: SFT and RL losses, pipelining, custom losses, states, sampling saved weights,
isolation between accounts.

Tolerances, and why:
- Logprobs of the same fp32 weights computed by the trainer's forward and by the rollout's engine (same model code,
  different batching and a KV cache) agree within 1e-4 (as in test_weight_hot_load.py).
- forward_backward_custom's surrogate gives the built-in loss's gradient up to float rounding. Adam's first step with
  its usual eps is lr * sign(grad), blind to the gradient's size, so these comparisons step with eps = 1 (then the
  step is about lr * grad, smooth in the gradient): logprobs after the step agree within 1e-4 while the step itself
  moves them by more than 1e-2.
- A state saved and loaded holds the same bits: training on from it matches the original exactly (1e-6 leaves room
  for nothing but reordering).
"""
from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest
import torch

from trainyard import SamplingClient, ServiceClient, TrainingClient, TrainyardError, types
from trainyard.v1 import trainer_pb2 as tpb

pytestmark = pytest.mark.integration
BASE = "tiny-qwen3"
PROMPT = [5, 17, 33, 60, 71, 88]
SEQS = [[5, 17, 33, 60, 71, 88, 2], [7, 8, 9, 10, 11, 12, 13, 2], [40, 41, 42, 43, 2]]
EVAL = [[9, 30, 31, 32, 33, 34, 35, 36, 2]]
SMOOTH_ADAM = types.AdamParams(learning_rate=0.5, eps=1.0)
SAME_LOGPROBS = 1e-4


def datum(tokens: list[int], prompt_len: int = 1) -> types.Datum:
    """Next-token prediction on tokens; the first prompt_len - 1 targets (the prompt) weigh 0."""
    n = len(tokens) - 1
    return types.Datum(types.ModelInput.from_ints(tokens[:-1]), {
        "target_tokens": tokens[1:], "weights": [0.0] * (prompt_len - 1) + [1.0] * (n - prompt_len + 1)})


def sft_data() -> list[types.Datum]:
    return [datum(s) for s in SEQS]


def logprobs(tc: TrainingClient, seqs: list[list[int]]) -> np.ndarray:
    out = tc.forward([datum(s) for s in seqs]).result()
    return np.concatenate([o["logprobs"].to_numpy() for o in out.loss_fn_outputs])


@pytest.fixture()
def service(stack, api_key):
    with ServiceClient(base_url=stack.url("trainer"), api_key=api_key, rollout_url=stack.url("rollout")) as s:
        yield s


@pytest.fixture()
def other_service(stack, other_api_key):
    with ServiceClient(base_url=stack.url("trainer"), api_key=other_api_key, rollout_url=stack.url("rollout")) as s:
        yield s


def test_sft_loop_lowers_the_loss(service, monkeypatch, tmp_path):
    monkeypatch.setenv("TRAINYARD_CACHE_DIR", str(tmp_path))
    tc = service.create_lora_training_client(BASE, rank=8, seed=0).result()
    info = tc.get_info()
    assert (info.is_lora, info.lora_rank, info.lora_alpha, info.model_name, info.next_seq_id) == (
        True, 8, 32.0, BASE, 1)
    assert info.num_trainable_parameters > 0 and info.vocab_size > 100
    tokenizer = tc.get_tokenizer()
    ids = tokenizer.encode("The quick brown fox jumps over the lazy dog.", add_special_tokens=False)
    assert "quick brown fox" in tokenizer.decode(ids)
    assert list((tmp_path / "tokenizers").glob("*/tokenizer.json"))  # fetched into the cache directory
    data = sft_data() + [datum(ids)]
    losses = []
    for step in range(8):
        fb = tc.forward_backward(data, "cross_entropy")
        opt = tc.optim_step(types.AdamParams(learning_rate=1e-2))  # on its way before fb's result is back
        losses.append(fb.result().metrics["loss:mean"])
        assert opt.result().step == step + 1
    print(f"SFT loss by step: {', '.join(f'{x:.3f}' for x in losses)}")
    assert losses[-1] < 0.7 * losses[0]
    info = tc.get_info()
    assert (info.next_seq_id, info.optim_steps) == (17, 8)
    tc.close()
    with pytest.raises(TrainyardError, match="closed"):
        tc.forward(data).result()


def test_calls_are_pipelined_and_run_in_order(service):
    tc = service.create_lora_training_client(BASE, rank=8, seed=1).result()
    data = sft_data()
    futures = []
    # A learning rate at which every step lowers the loss (the adapter includes the unembedding, Tinker's default),
    # so the losses show that each pass saw the step before it.
    adam = types.AdamParams(learning_rate=3e-3)
    for _ in range(4):  # nothing waits for a result until everything is submitted
        futures += [tc.forward_backward(data, "cross_entropy"), tc.optim_step(adam)]
    final = tc.forward(data)
    saved = tc.save_weights_for_sampler("pipelined")
    time.sleep(0.5)
    assert all(f.future().running() or f.done() for f in futures[:4])  # several calls are in flight at once
    results = [f.result(timeout=300) for f in futures]
    assert [r.step for r in results[1::2]] == [1, 2, 3, 4]
    losses = [r.metrics["loss:sum"] for r in results[0::2]] + [final.result().metrics["loss:sum"]]
    assert all(a > b for a, b in zip(losses, losses[1:])), losses  # each pass saw the step before it
    assert saved.result().path.startswith("trainyard://weights/")
    assert tc.get_info().next_seq_id == 11

    async def async_step():
        fb = await tc.forward_backward_async(data, "cross_entropy")
        opt = await tc.optim_step_async(types.AdamParams(learning_rate=1e-2))
        return (await fb).metrics["loss:sum"], (await opt).step

    loss, step = asyncio.run(async_step())
    assert step == 5 and loss == pytest.approx(losses[-1], rel=1e-6)  # the same weights as the last forward


def twins(service: ServiceClient, seed: int) -> tuple[TrainingClient, TrainingClient]:
    """Two sessions with the same initial adapter."""
    return (service.create_lora_training_client(BASE, rank=8, seed=seed).result(),
            service.create_lora_training_client(BASE, rank=8, seed=seed).result())


def check_same_step(a: TrainingClient, b: TrainingClient, before: np.ndarray) -> None:
    oa, ob = a.optim_step(SMOOTH_ADAM).result(), b.optim_step(SMOOTH_ADAM).result()
    if "grad_norm" in oa.metrics:
        assert ob.metrics["grad_norm"] == pytest.approx(oa.metrics["grad_norm"], rel=1e-4)
    after_a, after_b = logprobs(a, EVAL), logprobs(b, EVAL)
    moved, apart = np.abs(after_a - before).max(), np.abs(after_a - after_b).max()
    print(f"one step moved held-out logprobs by up to {moved:.3g}; built-in vs custom differ by {apart:.3g}")
    assert moved > 1e-2 and apart <= SAME_LOGPROBS


def test_custom_cross_entropy_gives_the_builtin_gradient(service):
    a, b = twins(service, seed=3)
    before = logprobs(a, EVAL)
    data = [datum(s, prompt_len=3) for s in SEQS]

    def nll(batch, lps):
        loss = sum(-(d.loss_fn_inputs["weights"].to_torch() * lp).sum() for d, lp in zip(batch, lps))
        return loss, {"nll:sum": float(loss.detach())}

    builtin, custom = a.forward_backward(data, "cross_entropy"), b.forward_backward_custom(data, nll)
    ra, rb = builtin.result(), custom.result()
    assert rb.metrics["loss"] == pytest.approx(ra.metrics["loss:sum"], rel=1e-5)
    assert rb.metrics["nll:sum"] == rb.metrics["loss"] and "loss:sum" not in rb.metrics
    for oa, ob in zip(ra.loss_fn_outputs, rb.loss_fn_outputs):
        assert np.abs(oa["logprobs"].to_numpy() - ob["logprobs"].to_numpy()).max() <= 1e-6
    check_same_step(a, b, before)
    assert b.get_info().next_seq_id == 1 + 2 + 1 + 1  # the custom call took two seq_ids, optim_step and forward one


def test_custom_ppo_gives_the_builtin_gradient(service):
    a, b = twins(service, seed=4)
    before = logprobs(a, EVAL)
    rng = np.random.default_rng(0)
    sampled = a.forward([datum(s) for s in SEQS]).result()  # the "sampling" logprobs q: the current ones, perturbed
    data = []
    for s, out in zip(SEQS, sampled.loss_fn_outputs):
        q = out["logprobs"].to_numpy() + rng.uniform(-0.3, 0.3, len(s) - 1).astype(np.float32)
        data.append(types.Datum(types.ModelInput.from_ints(s[:-1]), {
            "target_tokens": s[1:], "logprobs": q, "advantages": rng.choice([-1.0, 1.0], len(s) - 1)}))
    lo, hi = 0.9, 1.1

    def ppo(batch, lps):
        loss, clipped_tokens = 0.0, 0.0
        for d, lp in zip(batch, lps):
            q, adv = (d.loss_fn_inputs[k].to_torch().double() for k in ("logprobs", "advantages"))
            r = torch.exp(lp.double() - q)
            clipped = ((r > hi) & (adv > 0)) | ((r < lo) & (adv < 0))
            loss = loss - torch.where(clipped, r.clamp(lo, hi) * adv, r * adv).sum()
            clipped_tokens += float(clipped.sum())
        return loss, {"clipped:sum": clipped_tokens}

    config = {"clip_low_threshold": lo, "clip_high_threshold": hi}
    ra = a.forward_backward(data, "ppo", config).result()
    rb = b.forward_backward_custom(data, ppo).result()
    assert ra.metrics["clip_fraction:mean"] > 0 and rb.metrics["clipped:sum"] > 0  # the clip matters here
    assert rb.metrics["loss"] == pytest.approx(ra.metrics["loss:sum"], rel=1e-5)
    check_same_step(a, b, before)


def test_custom_loss_failure_leaves_the_session_usable(service):
    tc = service.create_lora_training_client(BASE, rank=8, seed=5).result()

    def broken(batch, lps):
        raise ZeroDivisionError("user bug")

    with pytest.raises(ZeroDivisionError, match="user bug"):
        tc.forward_backward_custom(sft_data(), broken).result()
    assert tc.forward_backward(sft_data(), "cross_entropy").result().metrics["loss:sum"] > 0  # not kept waiting
    info = tc.get_info()
    assert info.next_seq_id == 4 and info.error == ""


def test_forward_backward_stream_equals_forward_backward(service):
    a, b = twins(service, seed=6)
    data = [datum(s) for s in SEQS + EVAL]

    def lazily():
        for d in data:
            time.sleep(0.05)  # datums become available one by one
            yield d

    ra = a.forward_backward(data, "cross_entropy", micro_batch_tokens=12).result()
    rb = b.forward_backward_stream(lazily(), "cross_entropy", micro_batch_tokens=12).result()
    assert ra.metrics == rb.metrics
    assert all(x["logprobs"] == y["logprobs"] for x, y in zip(ra.loss_fn_outputs, rb.loss_fn_outputs))
    a.optim_step(types.AdamParams(learning_rate=1e-2))
    b.optim_step(types.AdamParams(learning_rate=1e-2))
    assert np.array_equal(logprobs(a, EVAL), logprobs(b, EVAL))

    def breaks():
        yield data[0]
        raise OSError("the data source went away")

    with pytest.raises(OSError, match="went away"):
        b.forward_backward_stream(breaks(), "cross_entropy").result()
    with pytest.raises(TrainyardError, match="forward_backward_stream") as exc:
        b.optim_step(types.AdamParams()).result()
    assert exc.value.code == "FAILED_PRECONDITION"


def test_bad_inputs_are_named_and_leave_the_session_usable(service):
    tc = service.create_lora_training_client(BASE, rank=8, seed=7).result()
    data = sft_data()
    vocab = tc.get_info().vocab_size
    cases = [
        (tc.forward_backward(data, "no_such_loss"), "loss_fn"),
        (tc.forward_backward([types.Datum(types.ModelInput.from_ints([1, 2]), {"target_tokens": [3, vocab]})],
                             "cross_entropy"), "data[0].loss_fn_inputs['target_tokens']"),
        (tc.forward_backward(data, "cross_entropy", {"clip_low_threshold": 0.5}),
         "loss_fn_config['clip_low_threshold']"),
        (tc.forward_backward([data[0], types.Datum(types.ModelInput.from_ints([1, 2]), {
            "target_tokens": [3, 4], "advantages": [1.0, 1.0]})], "cross_entropy"),
         "data[1].loss_fn_inputs['advantages']"),
        (tc.forward_backward([types.Datum(types.ModelInput.from_ints([1, 2]), {"target_tokens": [3, 4]})], "ppo"),
         "data[0].loss_fn_inputs['logprobs']"),
        (tc.optim_step(types.AdamParams(learning_rate=2.0)), "adam.learning_rate"),
    ]
    for fut, field in cases:
        err = fut.exception(timeout=120)
        assert isinstance(err, TrainyardError) and err.code == "INVALID_ARGUMENT", err
        assert err.field == field, (err.field, str(err))
    fb = tc.forward_backward(data, "cross_entropy")  # the session goes on
    assert tc.optim_step(types.AdamParams(learning_rate=1e-2)).result().step == 1
    assert fb.result().metrics["loss:sum"] > 0
    assert tc.get_info().error == ""
    with pytest.raises(TrainyardError) as exc:
        service.create_lora_training_client("no-such-model").result()
    assert (exc.value.code, exc.value.field) == ("INVALID_ARGUMENT", "base_model")
    sampler = service.create_sampling_client(base_model=BASE).result()
    err = sampler.sample(types.ModelInput.from_ints(PROMPT), 1, types.SamplingParams(temperature=50.0)).exception()
    assert (err.code, err.field) == ("INVALID_ARGUMENT", "params.temperature")


def test_a_failed_call_stops_later_calls_naming_it(service):
    tc = service.create_lora_training_client(BASE, rank=8, seed=8).result()
    tc.forward_backward(sft_data(), "cross_entropy").result()
    TrainingClient(service, tpb.Session(id=tc.model_id)).close()  # the session goes away under tc
    with pytest.raises(TrainyardError) as first:
        tc.optim_step(types.AdamParams()).result()
    assert first.value.code == "FAILED_PRECONDITION"
    with pytest.raises(TrainyardError, match=r"optim_step, seq_id 2") as later:
        tc.forward(sft_data()).result()
    assert later.value.code == "FAILED_PRECONDITION" and "not sent" in later.value.message


def test_sessions_states_and_weights_are_invisible_to_another_account(service, other_service):
    tc = service.create_lora_training_client(BASE, rank=8, seed=9).result()
    saved = tc.save_weights_for_sampler("mine").result()
    state = tc.save_state("mine").result()
    intruder = TrainingClient(other_service, tpb.Session(id=tc.model_id))
    with pytest.raises(TrainyardError) as exc:
        intruder.get_info()
    assert exc.value.code == "NOT_FOUND"
    assert intruder.forward(sft_data()).exception().code == "NOT_FOUND"
    with pytest.raises(TrainyardError) as exc:
        other_service.create_training_client_from_state(state.path).result()
    assert exc.value.code == "NOT_FOUND"
    prompt, params = types.ModelInput.from_ints(PROMPT), types.SamplingParams(max_tokens=2)
    err = other_service.create_sampling_client(model_path=saved.path).result().sample(prompt, 1, params).exception()
    assert err.code == "NOT_FOUND" and saved.version_id in err.message
    err = service.create_sampling_client(model_path="trainyard://weights/wv_unknown").result().sample(prompt, 1,
                                                                                            params).exception()
    assert err.code == "NOT_FOUND"
    assert service.create_sampling_client(model_path=saved.path).result().sample(prompt, 1, params).result().sequences
    assert tc.forward(sft_data()).result().metrics["loss:sum"] > 0  # the owner's session is untouched


def check_sampler_serves(tc: TrainingClient, sampler: SamplingClient, base: SamplingClient,
                         version_id: str) -> list[float]:
    """Greedy samples of the saved version: their logprobs are the trainer's on the sampled tokens, and not the
    base model's; compute_logprobs and prompt logprobs agree with the trainer too."""
    out = sampler.sample(types.ModelInput.from_ints(PROMPT), 1, types.SamplingParams(max_tokens=8, temperature=0.0),
                         include_prompt_logprobs=True).result()
    assert out.weight_version_id == version_id
    seq = out.sequences[0]
    full = PROMPT + seq.tokens
    trainer = logprobs(tc, [full])
    assert np.abs(np.array(seq.logprobs) - trainer[len(PROMPT) - 1:]).max() <= SAME_LOGPROBS
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(PROMPT)
    assert np.abs(np.array(out.prompt_logprobs[1:]) - trainer[:len(PROMPT) - 1]).max() <= SAME_LOGPROBS
    scored = sampler.compute_logprobs(types.ModelInput.from_ints(full)).result()
    assert scored[0] is None and np.abs(np.array(scored[1:]) - trainer).max() <= SAME_LOGPROBS
    base_scored = np.array(base.compute_logprobs(types.ModelInput.from_ints(full)).result()[1:])
    print(f"rollout vs trainer logprobs: {np.abs(np.array(scored[1:]) - trainer).max():.3g}; "
          f"saved vs base model: {np.abs(base_scored - trainer).max():.3g}")
    assert np.abs(base_scored - trainer).max() > 0.1  # the new weights, not the base model's
    return seq.logprobs


def test_saved_weights_are_sampled_exactly_at_their_version(service):
    tc = service.create_lora_training_client(BASE, rank=8, seed=10).result()
    target = [datum(PROMPT + [100, 101, 102, 103, 2], prompt_len=len(PROMPT))]
    for _ in range(6):
        tc.forward_backward(target, "cross_entropy")
        tc.optim_step(types.AdamParams(learning_rate=2e-2))
    v1 = tc.save_weights_and_get_sampling_client("v1").result()
    base = service.create_sampling_client(base_model=BASE).result()
    version_1 = v1.model_path.removeprefix("trainyard://weights/")
    first = check_sampler_serves(tc, v1, base, version_1)
    for _ in range(2):
        tc.forward_backward(target, "cross_entropy")
        tc.optim_step(types.AdamParams(learning_rate=2e-2))
    v2 = tc.save_weights_and_get_sampling_client("v2").result()
    check_sampler_serves(tc, v2, base, v2.model_path.removeprefix("trainyard://weights/"))
    again = v1.sample(types.ModelInput.from_ints(PROMPT), 1,
                      types.SamplingParams(max_tokens=8, temperature=0.0)).result()
    assert again.weight_version_id == version_1  # v1 stays v1 after newer versions exist
    assert np.abs(np.array(again.sequences[0].logprobs) - first).max() <= 1e-5
    fresh = service.create_sampling_client(model_path=v1.model_path).result()  # the path alone is enough
    assert fresh.sample(types.ModelInput.from_ints(PROMPT), 1, types.SamplingParams(
        max_tokens=8, temperature=0.0)).result().sequences[0].tokens == again.sequences[0].tokens


def test_save_state_and_resume_with_the_optimizer(service):
    tc = service.create_lora_training_client(BASE, rank=8, seed=11).result()
    data, adam = sft_data(), types.AdamParams(learning_rate=1e-2)
    for _ in range(2):
        tc.forward_backward(data, "cross_entropy")
        tc.optim_step(adam)
    state = tc.save_state("after-2").result()
    assert state.path.startswith("trainyard://state/")
    resumed = service.create_training_client_from_state_with_optimizer(state.path).result()
    weights_only = service.create_training_client_from_state(state.path).result()
    assert resumed.get_info().lora_rank == 8 and resumed.model_id != tc.model_id
    assert np.array_equal(logprobs(resumed, EVAL), logprobs(tc, EVAL))  # the same weights, bit for bit
    for c in (tc, resumed, weights_only):
        c.forward_backward(data, "cross_entropy")
        c.optim_step(adam)
    after = logprobs(tc, EVAL)
    same, other = np.abs(logprobs(resumed, EVAL) - after).max(), np.abs(logprobs(weights_only, EVAL) - after).max()
    print(f"after one more step: resumed with the optimizer {same:.3g}, without {other:.3g} from the original")
    assert same <= 1e-6  # the same step: Adam's moments came along
    assert other > 1e-4  # fresh moments take another step
    weights_only.load_state_with_optimizer(state.path)  # back to the saved point, optimizer included
    weights_only.forward_backward(data, "cross_entropy")
    weights_only.optim_step(adam)
    assert np.abs(logprobs(weights_only, EVAL) - after).max() <= 1e-6


def test_full_parameter_session_trains_and_samples(service):
    tc = service.create_training_client(BASE, seed=0).result()
    info = tc.get_info()
    assert not info.is_lora and info.lora_rank is None
    target = [datum(PROMPT + [100, 101, 102, 103, 2], prompt_len=len(PROMPT))]
    losses = []
    for _ in range(3):
        fb = tc.forward_backward(target, "cross_entropy")
        tc.optim_step(types.AdamParams(learning_rate=1e-3))
        losses.append(fb.result().metrics["loss:sum"])
    assert losses[-1] < losses[0]
    sampler = tc.save_weights_and_get_sampling_client("full").result()
    check_sampler_serves(tc, sampler, service.create_sampling_client(base_model=BASE).result(),
                         sampler.model_path.removeprefix("trainyard://weights/"))


def test_interleaved_sessions_in_the_trainer_process_match_each_alone(service, other_service):
    """Three LoRA sessions on one base in the real trainer (two accounts, different ranks, seeds, losses and Adam
    settings) driven call by call in turn end with bitwise the logprobs each gets when it runs alone."""
    settings = [(service, 4, 11, types.AdamParams(learning_rate=1e-2)),
                (other_service, 8, 12, types.AdamParams(learning_rate=3e-2, weight_decay=0.1)),
                (service, 16, 13, types.AdamParams(learning_rate=2e-2, beta2=0.99))]
    data = [sft_data(), sft_data()[:2], [datum(s, prompt_len=3) for s in SEQS]]

    def start(i: int) -> TrainingClient:
        svc, rank, seed, _ = settings[i]
        return svc.create_lora_training_client(BASE, rank=rank, seed=seed).result()

    def step(i: int, tc: TrainingClient) -> None:
        tc.forward_backward(data[i], "cross_entropy").result()
        tc.optim_step(settings[i][3]).result()

    alone = []
    for i in range(3):
        tc = start(i)
        for _ in range(3):
            step(i, tc)
        alone.append(logprobs(tc, EVAL + SEQS))
        tc.close()
    clients = [start(i) for i in range(3)]
    for _ in range(3):
        for i, tc in enumerate(clients):
            step(i, tc)
    for i, tc in enumerate(clients):
        np.testing.assert_array_equal(logprobs(tc, EVAL + SEQS), alone[i])
        tc.close()
    assert not np.array_equal(alone[0], alone[1])  # the sessions really differ
