"""Loops written the way Tinker users write them, run with `import trainyard as tinker` against the real trainer,
weight-sync and rollout processes on the tiny model: a supervised loop (futures, save_state and resume, sampling the
saved weights) and a GRPO-style asynchronous RL loop (sample -> advantages -> importance_sampling -> optim_step).

Tolerances, and why:
- The trainer's logprobs of sampled tokens and the rollout's (same fp32 weights, same model code, different batching
  and a KV cache) agree within 1e-4, as in test_training_api.py.
- A state saved and restored with its optimizer holds the same bits: the next step matches within 1e-6.
"""
from __future__ import annotations

import asyncio

import numpy as np
import pytest

import trainyard as tinker

pytestmark = pytest.mark.integration
BASE = "tiny-qwen3"
SEQS = [[5, 17, 33, 60, 71, 88, 2], [7, 8, 9, 10, 11, 12, 13, 2], [40, 41, 42, 43, 2]]
PROMPTS = [[5, 17, 33], [40, 41, 42, 43]]
SAME_LOGPROBS = 1e-4


@pytest.fixture()
def service_client(stack, api_key):
    client = tinker.ServiceClient(base_url=stack.url("trainer"), api_key=api_key, rollout_url=stack.url("rollout"),
                                  url=stack.url("scheduler"))
    yield client
    client.close()


def sft_datum(tokens: list[int]) -> tinker.Datum:
    return tinker.Datum(model_input=tinker.ModelInput.from_ints(tokens[:-1]),
                        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)})


def mean_nll(result: tinker.ForwardBackwardOutput, batch: list[tinker.Datum]) -> float:
    """As tinker-cookbook computes it: -sum(logprobs * weights) / sum(weights) over the batch."""
    logprobs = np.concatenate([o["logprobs"].tolist() for o in result.loss_fn_outputs])
    weights = np.concatenate([d.loss_fn_inputs["weights"].tolist() for d in batch])
    return float(-(logprobs * weights).sum() / weights.sum())


def test_tinker_style_supervised_loop(service_client):
    training_client = service_client.create_lora_training_client(base_model=BASE, rank=8, seed=0).result()
    assert isinstance(training_client, tinker.TrainingClient)
    batch = [sft_datum(s) for s in SEQS]
    losses = []
    for _ in range(4):
        fwd_bwd_future = training_client.forward_backward(batch, loss_fn="cross_entropy")
        optim_future = training_client.optim_step(tinker.AdamParams(learning_rate=1e-2))
        losses.append(mean_nll(fwd_bwd_future.result(), batch))
        assert optim_future.result().metrics is not None
    assert losses[-1] < losses[0], losses

    state = training_client.save_state(name="sft-mid").result()
    resumed = service_client.create_training_client_from_state_with_optimizer(state.path).result()
    step = [c.forward_backward(batch, "cross_entropy") for c in (training_client, resumed)]
    for c in (training_client, resumed):
        c.optim_step(optim_params=tinker.AdamParams(learning_rate=1e-2)).result()
    a, b = (mean_nll(f.result(), batch) for f in step)
    assert abs(a - b) <= 1e-6, (a, b)

    sampling_client = training_client.save_weights_and_get_sampling_client(name="sft-final").result()
    prompt = tinker.ModelInput.from_ints(PROMPTS[0])
    # stop=[] turns off end-of-sequence stopping, as Tinker's: every sample runs to max_tokens.
    response = sampling_client.sample(prompt=prompt, num_samples=2,
                                      sampling_params=tinker.SamplingParams(max_tokens=12, stop=[], seed=3)).result()
    assert [(len(s.tokens), s.stop_reason) for s in response.sequences] == [(12, "length")] * 2
    assert len({s.sequence_id for s in response.sequences}) == 2
    with_topk = sampling_client.sample(prompt, 1, tinker.SamplingParams(max_tokens=3, temperature=0.0),
                                       include_prompt_logprobs=True, topk_sample_logprobs=2).result()
    (seq,) = with_topk.sequences
    assert [len(t) for t in seq.topk_logprobs] == [2, 2, 2] and seq.topk_logprobs[0][0][0] == seq.tokens[0]
    assert with_topk.prompt_logprobs[0] is None and len(with_topk.prompt_logprobs) == len(PROMPTS[0])
    assert sampling_client.get_tokenizer() is training_client.get_tokenizer()


def test_tinker_style_grpo_loop(service_client):
    """Group-relative advantages over samples of the current weights, then importance_sampling with the sampler's
    logprobs: the trainer's logprobs of the sampled tokens are the sampler's (same weights), so the loss is the
    on-policy policy gradient."""

    async def main() -> list[float]:
        training_client = await service_client.create_lora_training_client(BASE, rank=8, seed=1)
        rewards_per_step = []
        for step in range(2):
            sampling_client = await training_client.save_weights_and_get_sampling_client_async(name=f"grpo-{step}")
            params = tinker.SamplingParams(max_tokens=6, temperature=1.0, seed=step)
            results = await asyncio.gather(*[
                sampling_client.sample_async(prompt=tinker.ModelInput.from_ints(p), num_samples=4,
                                             sampling_params=params) for p in PROMPTS])
            data, sampled_logprobs, rewards = [], [], []
            for prompt, result in zip(PROMPTS, results):
                group = [float(np.mean([t % 2 == 0 for t in s.tokens])) for s in result.sequences]  # even tokens
                rewards += group
                for seq, reward in zip(result.sequences, group):
                    tokens = prompt + seq.tokens
                    n_prompt = len(prompt) - 1
                    data.append(tinker.Datum(
                        model_input=tinker.ModelInput.from_ints(tokens[:-1]),
                        loss_fn_inputs={"target_tokens": tokens[1:],
                                        "logprobs": [0.0] * n_prompt + seq.logprobs,
                                        "advantages": [0.0] * n_prompt + [reward - np.mean(group)] * len(seq.tokens)}))
                    sampled_logprobs.append((n_prompt, seq.logprobs))
            fwd_bwd = await training_client.forward_backward_async(data, loss_fn="importance_sampling")
            optim = await training_client.optim_step_async(tinker.AdamParams(learning_rate=1e-2))
            out = await fwd_bwd
            await optim
            for (n_prompt, expected), o in zip(sampled_logprobs, out.loss_fn_outputs):
                np.testing.assert_allclose(o["logprobs"].to_numpy()[n_prompt:], expected, atol=SAME_LOGPROBS)
            rewards_per_step.append(float(np.mean(rewards)))
        return rewards_per_step

    rewards = asyncio.run(main())
    assert len(rewards) == 2 and all(0.0 <= r <= 1.0 for r in rewards)


def test_sampling_clients_of_an_rl_loop_are_ephemeral(stack, api_key, client, service_client):
    """Ten save_weights_and_get_sampling_client calls, as an RL loop makes them: no checkpoint is written, the
    session's lineage keeps at most the weight-sync service's max_ephemeral_versions_per_lineage (4) versions, each
    sampler samples the newest weights (its logprobs are the trainer's after that step, not the step before), an
    evicted one is refused naming it, and closing the session deletes them all."""
    import grpc

    from services.common.channels import auth_metadata
    from trainyard.v1 import weightsync_pb2 as wpb, weightsync_pb2_grpc

    training_client = service_client.create_lora_training_client(BASE, rank=8, seed=4).result()
    session_id = training_client.model_id
    batch = [sft_datum(s) for s in SEQS]
    probe = SEQS[0]
    samplers, previous = [], None
    for _ in range(10):
        training_client.forward_backward(batch, "cross_entropy")
        training_client.optim_step(tinker.AdamParams(learning_rate=1e-2))
        sampler = training_client.save_weights_and_get_sampling_client().result()
        trained = training_client.forward([sft_datum(probe)], "cross_entropy").result()
        sampled = sampler.compute_logprobs(tinker.ModelInput.from_ints(probe)).result()[1:]
        np.testing.assert_allclose(sampled, trained.loss_fn_outputs[0]["logprobs"].tolist(), atol=SAME_LOGPROBS)
        if previous is not None:  # the newest weights, not the previous sampler's
            assert np.abs(np.array(sampled) - np.array(previous)).max() > 100 * SAME_LOGPROBS
        samplers.append(sampler)
        previous = sampled

    assert [c for c in client.list_checkpoints() if c.session_id == session_id] == []
    with grpc.insecure_channel(stack.url("weightsync")) as ch:
        weightsync, md = weightsync_pb2_grpc.WeightSyncServiceStub(ch), auth_metadata(api_key)
        versions = weightsync.ListVersions(wpb.ListVersionsRequest(lineage=session_id), metadata=md).versions
        assert [v.version for v in versions] == [7, 8, 9, 10] and all(v.ephemeral for v in versions)
        evicted = samplers[0].model_path.removeprefix("trainyard://weights/")
        with pytest.raises(tinker.UnprocessableEntityError, match=f"ephemeral weight version '{evicted}'.*replaced"):
            samplers[0].sample(tinker.ModelInput.from_ints(PROMPTS[0]), 1, tinker.SamplingParams(max_tokens=2)).result()
        training_client.close()
        assert weightsync.ListVersions(wpb.ListVersionsRequest(lineage=session_id), metadata=md).versions == []
    with pytest.raises(tinker.UnprocessableEntityError, match="replaced"):
        samplers[-1].sample(tinker.ModelInput.from_ints(PROMPTS[0]), 1, tinker.SamplingParams(max_tokens=2)).result()


def test_the_trainers_address_is_enough(stack, api_key, monkeypatch, tmp_path):
    """ServiceClient(base_url=<trainer>) alone, as Tinker's: the rollout and scheduler addresses come from the trainer
    (GetEndpoints; the stack's ports are not the defaults, so nothing else could find them). An explicit address
    still wins over the trainer's."""
    for var in ("TRAINYARD_URL", "TRAINYARD_ROLLOUT_URL", "TRAINYARD_TRAINER_URL"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("TRAINYARD_CLIENT_CONFIG", str(tmp_path / "no-login.json"))
    with tinker.ServiceClient(base_url=stack.url("trainer"), api_key=api_key) as service:
        assert BASE in [m.model_name for m in service.get_server_capabilities().supported_models]
        training_client = service.create_lora_training_client(BASE, rank=4, seed=5).result()
        training_client.forward_backward([sft_datum(s) for s in SEQS], "cross_entropy")
        training_client.optim_step(tinker.AdamParams(learning_rate=1e-2)).result()
        sampler = training_client.save_weights_and_get_sampling_client().result()
        out = sampler.sample(tinker.ModelInput.from_ints(PROMPTS[0]), 2,
                             tinker.SamplingParams(max_tokens=4, stop=[], seed=1)).result()
        assert [len(s.tokens) for s in out.sequences] == [4, 4]
        assert (service.config.rollout_url, service.config.url) == (stack.url("rollout"), stack.url("scheduler"))
        training_client.close()
    with tinker.ServiceClient(base_url=stack.url("trainer"), api_key=api_key,
                              rollout_url="127.0.0.1:1") as service:
        with pytest.raises(tinker.APIConnectionError, match="127.0.0.1:1.*rollout_url"):
            service.create_sampling_client(base_model=BASE).result()
    monkeypatch.setenv("TRAINYARD_URL", "127.0.0.1:2")  # the environment wins too
    with tinker.ServiceClient(base_url=stack.url("trainer"), api_key=api_key) as service:
        assert service.rollout is not None  # asks the trainer
        assert (service.config.rollout_url, service.config.url) == (stack.url("rollout"), "127.0.0.1:2")


def test_unsupported_tinker_options_are_refused_naming_them(service_client):
    training_client = service_client.create_lora_training_client(BASE, rank=4, seed=2).result()
    with pytest.raises(ValueError, match="weights_access_token"):
        service_client.create_training_client_from_state("trainyard://state/x", weights_access_token="t")
    with pytest.raises(ValueError, match="kind"):
        training_client.save_weights_and_get_sampling_client(kind="inflight")
    with pytest.raises(ValueError, match="user_metadata"):
        training_client.save_weights_for_sampler("kept", user_metadata={"step": 1})
    caps = service_client.get_server_capabilities()
    assert BASE in [m.model_name for m in caps.supported_models]
