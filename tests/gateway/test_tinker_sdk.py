"""The unmodified `tinker` SDK (0.38) against the gateway over the real trainer, weight-sync and rollout processes on
the tiny model: a supervised loop, a GRPO-style RL loop with a custom loss, and a batch split into several
forward_backward requests.

Tolerances, and why:
- A state reloaded with its optimizer holds the same bits: the step taken again matches within 1e-6.
- The trainer's logprobs of sampled tokens and the rollout's (same fp32 weights, different batching and a KV cache)
  agree within 1e-4, as in tests/integration/test_tinker_dropin.py.
- A batch in chunks accumulates the same gradient in another order of float32 sums: losses and logprobs after the
  step agree within 1e-5.
"""
from __future__ import annotations

import httpx
import numpy as np
import pytest
import tinker
import torch

pytestmark = pytest.mark.integration
BASE = "tiny-qwen3"
SEQS = [[5, 17, 33, 60, 71, 88, 2], [7, 8, 9, 10, 11, 12, 13, 2], [40, 41, 42, 43, 2]]
PROMPTS = [[5, 17, 33], [40, 41, 42, 43]]
SAME_BITS = 1e-6
SAME_LOGPROBS = 1e-4
CHUNK_ORDER = 1e-5


def sft_datum(tokens: list[int]) -> tinker.Datum:
    n = len(tokens) - 1
    return tinker.Datum(model_input=tinker.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs={
        "target_tokens": tinker.TensorData(data=tokens[1:], dtype="int64", shape=[n]),
        "weights": tinker.TensorData(data=[1.0] * n, dtype="float32", shape=[n])})


def mean_nll(result: tinker.ForwardBackwardOutput, batch: list[tinker.Datum]) -> float:
    logprobs = np.concatenate([o["logprobs"].to_numpy() for o in result.loss_fn_outputs])
    weights = np.concatenate([d.loss_fn_inputs["weights"].to_numpy() for d in batch])
    return float(-(logprobs * weights).sum() / weights.sum())


def lora(service: tinker.ServiceClient, seed: int) -> tinker.TrainingClient:
    # train_unembed=False: the tiny model ties its output layer to the embeddings, which the trainer refuses to adapt.
    return service.create_lora_training_client(BASE, rank=8, seed=seed, train_unembed=False).result()


@pytest.mark.filterwarnings("ignore:DEPRECATED.*load_state:FutureWarning")  # Tinker 0.38 deprecates load_state
def test_supervised_loop_state_round_trip_and_sampling(stack, tinker_service):
    tc = lora(tinker_service, seed=0)
    assert tc.get_info().model_data.model_name == BASE
    batch = [sft_datum(s) for s in SEQS]
    losses = []
    for _ in range(4):
        fb = tc.forward_backward(batch, "cross_entropy")
        opt = tc.optim_step(tinker.AdamParams(learning_rate=1e-2))
        losses.append(mean_nll(fb.result(), batch))
        opt.result()
    assert losses[-1] < losses[0], losses

    state = tc.save_state("mid").result()
    assert state.path.startswith(f"tinker://{tc.model_id}/weights/")
    resumed = tinker_service.create_training_client_from_state_with_optimizer(state.path).result()
    runs = []
    # The same step from the state three times: going on, in a new model restored from it with its optimizer, and
    # again after loading it back with its optimizer.
    for client in (tc, resumed, tc):
        client.forward_backward(batch, "cross_entropy")
        client.optim_step(tinker.AdamParams(learning_rate=1e-2))
        runs.append(mean_nll(client.forward(batch, "cross_entropy").result(), batch))
        tc.load_state_with_optimizer(state.path).result()
    assert max(runs) - min(runs) <= SAME_BITS, runs
    saved_by_resumed = resumed.save_state("resumed").result()
    assert saved_by_resumed.path.startswith("tinker://") and ":train:" not in saved_by_resumed.path  # a trainer session
    assert tc.load_state(state.path).result().path == state.path

    saved = tc.save_weights_for_sampler("final").result()
    assert saved.path.startswith(f"tinker://{tc.model_id}/sampler_weights/")
    sampler = tinker_service.create_sampling_client(model_path=saved.path).result()
    assert sampler.get_base_model() == BASE
    prompt = tinker.ModelInput.from_ints(PROMPTS[0])
    out = sampler.sample(prompt, 2, tinker.SamplingParams(max_tokens=12, stop=[], seed=3)).result()
    assert [(len(s.tokens), s.stop_reason) for s in out.sequences] == [(12, "length")] * 2
    assert len({s.sequence_id for s in out.sequences}) == 2
    topk = sampler.sample(prompt, 1, tinker.SamplingParams(max_tokens=3, temperature=0.0, stop=[]),
                          include_prompt_logprobs=True, topk_sample_logprobs=2).result()
    (seq,) = topk.sequences
    assert [len(t) for t in seq.topk_logprobs] == [2, 2, 2] and seq.topk_logprobs[0][0][0] == seq.tokens[0]
    assert topk.prompt_logprobs[0] is None and len(topk.prompt_logprobs) == len(PROMPTS[0])
    # The SDK learned of each sample's end from the sampling session's retrieve_futures long poll (client config).
    scraped = httpx.get(f"http://{stack.address('gateway', 9100)}/metrics", timeout=10).text
    assert 'trainyard_gateway_requests_total{route="/api/v1/retrieve_futures",status="200"}' in scraped
    base = tinker_service.create_sampling_client(base_model=BASE).result()
    assert len(base.sample(prompt, 3, tinker.SamplingParams(max_tokens=2, stop=[])).result().sequences) == 3
    with pytest.raises(tinker.BadRequestError, match="topk_prompt_logprobs"):
        sampler.sample(prompt, 1, tinker.SamplingParams(max_tokens=2), include_prompt_logprobs=True,
                       topk_prompt_logprobs=2).result()


def test_a_batch_in_chunks_gives_the_result_of_one_request(stack, small_gateway, tinker_key):
    """The small gateway tells the SDK to send at most 2 datums per forward_backward request: 5 datums go as 3
    requests (sent concurrently, run in seq_id order), and the SDK combines their results."""
    batch = [sft_datum(s) for s in SEQS + SEQS[:2]]
    results = []
    for url in (stack.gateway_url(), small_gateway):
        service = tinker.ServiceClient(base_url=url, api_key=tinker_key)
        tc = lora(service, seed=5)
        assert tc.holder.get_client_config().fwdbwd_max_chunk_len == (2 if url == small_gateway else 1024)
        fb = tc.forward_backward(batch, "cross_entropy").result()
        tc.optim_step(tinker.AdamParams(learning_rate=1e-2)).result()
        after = tc.forward(batch, "cross_entropy").result()
        results.append((fb, after))
        service.close("success").result()
    (one, one_after), (chunked, chunked_after) = results
    assert len(chunked.loss_fn_outputs) == len(batch)
    np.testing.assert_allclose(chunked.metrics["loss:sum"], one.metrics["loss:sum"], rtol=CHUNK_ORDER)
    for a, b in zip(one_after.loss_fn_outputs, chunked_after.loss_fn_outputs):
        np.testing.assert_allclose(a["logprobs"].to_numpy(), b["logprobs"].to_numpy(), atol=CHUNK_ORDER)


def test_rl_loop_with_importance_sampling_and_a_custom_loss(tinker_service):
    tc = lora(tinker_service, seed=1)
    rewards_per_step = []
    for step in range(2):
        sampler = tc.save_weights_and_get_sampling_client().result()
        params = tinker.SamplingParams(max_tokens=6, temperature=1.0, seed=step)
        results = [sampler.sample(tinker.ModelInput.from_ints(p), 4, params) for p in PROMPTS]
        data, expected, rewards = [], [], []
        for prompt, result in zip(PROMPTS, (r.result() for r in results)):
            assert len(result.sequences) == 4
            group = [float(np.mean([t % 2 == 0 for t in s.tokens])) for s in result.sequences]
            rewards += group
            for seq, reward in zip(result.sequences, group):
                tokens, n_prompt = prompt + seq.tokens, len(prompt) - 1
                n = len(tokens) - 1
                data.append(tinker.Datum(model_input=tinker.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs={
                    "target_tokens": tinker.TensorData(data=tokens[1:], dtype="int64", shape=[n]),
                    "logprobs": tinker.TensorData(data=[0.0] * n_prompt + seq.logprobs, dtype="float32", shape=[n]),
                    "advantages": tinker.TensorData(data=[0.0] * n_prompt + [reward - float(np.mean(group))]
                                                    * len(seq.tokens), dtype="float32", shape=[n])}))
                expected.append((n_prompt, seq.logprobs))
        out = tc.forward_backward(data, "importance_sampling").result()
        for (n_prompt, logprobs), o in zip(expected, out.loss_fn_outputs):
            np.testing.assert_allclose(o["logprobs"].to_numpy()[n_prompt:], logprobs, atol=SAME_LOGPROBS)

        def neg_mean_logprob(batch, logprobs_list):
            loss = -torch.cat(logprobs_list).mean()
            return loss, {"custom_nll": float(loss.detach())}

        custom = tc.forward_backward_custom(data, neg_mean_logprob).result()
        assert "custom_nll" in custom.metrics
        tc.optim_step(tinker.AdamParams(learning_rate=1e-2)).result()
        rewards_per_step.append(float(np.mean(rewards)))
    assert len(rewards_per_step) == 2 and all(0.0 <= r <= 1.0 for r in rewards_per_step)


def test_a_training_client_goes_on_across_a_gateway_restart(stack, tinker_key):
    """The gateway's state is in memory: after a restart it attaches to the model's trainer session on its next
    request (resume_training_client) and takes the client session up, so the same SDK objects go on."""
    service = tinker.ServiceClient(base_url=stack.gateway_url(), api_key=tinker_key)
    tc = lora(service, seed=7)
    batch = [sft_datum(s) for s in SEQS]
    before = mean_nll(tc.forward_backward(batch, "cross_entropy").result(), batch)
    tc.optim_step(tinker.AdamParams(learning_rate=1e-2)).result()
    stack.stop("gateway")
    stack.start("gateway")
    stack.wait_ready("gateway")
    after = mean_nll(tc.forward_backward(batch, "cross_entropy").result(), batch)
    tc.optim_step(tinker.AdamParams(learning_rate=1e-2)).result()
    assert after < before, (before, after)
    sampler = tc.save_weights_and_get_sampling_client().result()
    out = sampler.sample(tinker.ModelInput.from_ints(PROMPTS[0]), 1, tinker.SamplingParams(max_tokens=4, stop=[]))
    assert len(out.result().sequences[0].tokens) == 4
    service.close("success").result()
