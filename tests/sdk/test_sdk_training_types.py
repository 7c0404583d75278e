"""The Training API SDK without a server: types and their wire form, futures, client-side checks, and the
custom-loss weights (forward_backward_custom's math)."""
from __future__ import annotations

import asyncio
import concurrent.futures
import time

import numpy as np
import pytest
import torch

from trainyard import APIFuture, SamplingClient, ServiceClient, TrainingClient, types
from trainyard.config import ClientConfig
from trainyard.errors import TrainyardError
from trainyard.training import _custom_weights
from trainyard.v1 import rollout_pb2, trainer_pb2 as tpb


# ---- TensorData ---------------------------------------------------------------------------------------------------

def test_tensor_data_from_lists_numpy_torch_and_flat_data_with_shape():
    a = types.TensorData.from_list([[1, 2, 3], [4, 5, 6]])
    assert (a.dtype, a.shape, a.data) == ("int64", [2, 3], [1, 2, 3, 4, 5, 6])
    assert a.tolist() == [[1, 2, 3], [4, 5, 6]]
    b = types.TensorData(data=[1, 2, 3, 4, 5, 6], dtype="int64", shape=[2, 3])  # Tinker's constructor
    assert b == a
    f = types.TensorData.from_numpy(np.array([0.5, -1.25], dtype=np.float64))  # float64 -> float32
    assert f.dtype == "float32" and f.to_numpy().dtype == np.float32
    t = types.TensorData.from_torch(torch.tensor([[True, False]]))  # bool -> int64
    assert t.dtype == "int64" and t.to_torch().dtype == torch.int64 and t.tolist() == [[1, 0]]
    g = types.TensorData.from_torch(torch.tensor([1.5, 2.5], dtype=torch.bfloat16, requires_grad=True))
    assert g.dtype == "float32" and g.to_torch().tolist() == [1.5, 2.5]
    assert types.TensorData.from_list([1, 2], dtype="float32").dtype == "float32"
    assert types.TensorData.from_list([3.0, 4.0], dtype="int64").tolist() == [3, 4]  # whole floats to int64


def test_tensor_data_round_trips_the_wire_bitwise():
    values = np.random.default_rng(0).standard_normal((3, 5)).astype(np.float32)
    for td in (types.TensorData.from_numpy(values), types.TensorData.from_list([7, -1, 2**40])):
        msg = td.to_proto()
        back = types.TensorData.from_proto(msg)
        assert back == td and back.to_numpy().tobytes() == td.to_numpy().tobytes()
    msg = types.TensorData.from_numpy(values).to_proto()
    assert msg.dtype == tpb.TensorData.DTYPE_FLOAT32 and list(msg.shape) == [3, 5]
    assert msg.data == values.astype("<f4").tobytes()  # little-endian row-major, as trainer.proto says


def test_tensor_data_outputs_do_not_alias_its_values():
    td = types.TensorData.from_list([1.0, 2.0])
    td.to_numpy()[0] = 9.0
    td.to_torch()[1] = 9.0
    assert td.tolist() == [1.0, 2.0]


@pytest.mark.parametrize("values, kwargs, message", [
    ([[1, 2], [3]], {}, "rectangular"),
    (["a", "b"], {}, "numbers"),
    ([1, 2, 3], {"shape": [2, 2]}, "TensorData.shape"),
    ([1.5, 2.0], {"dtype": "int64"}, "whole numbers"),
    ([1, 2], {"dtype": "float16"}, "dtype"),
])
def test_tensor_data_rejects_bad_values(values, kwargs, message):
    with pytest.raises(ValueError, match=message):
        types.TensorData(values, **kwargs)


# ---- ModelInput and Datum -----------------------------------------------------------------------------------------

def test_model_input_chunks():
    mi = types.ModelInput.from_ints([5, 6, 7])
    assert mi.to_ints() == [5, 6, 7] and mi.length == 3 and mi.chunks[0].type == "encoded_text"
    longer = mi.append(types.EncodedTextChunk([8, 9])).append_int(10)
    # append_int adds a one-token chunk, as Tinker's does
    assert longer.to_ints() == [5, 6, 7, 8, 9, 10] and longer.length == 6 and len(longer.chunks) == 3
    assert mi.to_ints() == [5, 6, 7]  # immutable: append returns a new input
    assert types.ModelInput.empty().append_int(4).to_ints() == [4]
    assert types.ModelInput.from_ints(np.array([1, 2])).to_ints() == [1, 2]
    with pytest.raises(ValueError, match="integers"):
        types.ModelInput.from_ints([1.5])
    with pytest.raises(ValueError, match=r"\[0, 2147483647\]"):
        types.ModelInput.from_ints([-1])


def test_datum_coerces_loss_inputs_to_their_wire_dtypes():
    d = types.Datum(types.ModelInput.from_ints([1, 2, 3]), {
        "target_tokens": [2, 3, 4],  # list -> int64
        "weights": torch.tensor([1.0, 0.0, 1.0], dtype=torch.float64),  # -> float32
        "advantages": np.array([1, 1, 1]),  # ints given for a float input -> float32
    })
    assert {k: v.dtype for k, v in d.loss_fn_inputs.items()} == {
        "target_tokens": "int64", "weights": "float32", "advantages": "float32"}
    d.check("data[0]")
    msg = d.to_proto()
    assert list(msg.tokens) == [1, 2, 3] and set(msg.loss_fn_inputs) == {"target_tokens", "weights", "advantages"}
    back = types.Datum.from_proto(msg)
    assert back.model_input == d.model_input and back.loss_fn_inputs == d.loss_fn_inputs


def test_datum_checks_name_the_field():
    d = types.Datum(types.ModelInput.from_ints([1, 2, 3]), {"target_tokens": [2, 3]})
    with pytest.raises(ValueError, match=r"data\[4\]\.loss_fn_inputs\['target_tokens'\]: shape \[2\]"):
        d.check("data[4]")
    with pytest.raises(ValueError, match=r"data\[0\]\.model_input: is empty"):
        types.Datum(types.ModelInput.empty()).check("data[0]")
    with pytest.raises(ValueError, match=r"loss_fn_inputs\['target_tokens'\]: int64 values must be whole"):
        types.Datum(types.ModelInput.from_ints([1]), {"target_tokens": [0.5]})
    with pytest.raises(ValueError, match="Datum.model_input: must be a ModelInput"):
        types.Datum([1, 2, 3], {})


# ---- parameters ---------------------------------------------------------------------------------------------------

def test_sampling_params_wire_form():
    p = types.SamplingParams(max_tokens=12, seed=3, stop=["\n\n", "END"], temperature=0.7, top_k=-1, top_p=0.9)
    msg = p.to_proto(num_samples=4, prompt_logprobs=True)
    assert (msg.max_tokens, msg.seed, list(msg.stop), msg.top_k, msg.n, msg.prompt_logprobs) == (
        12, 3, ["\n\n", "END"], 0, 4, True)
    assert msg.temperature == pytest.approx(0.7) and msg.top_p == pytest.approx(0.9)
    ids = types.SamplingParams(stop=[7, 9], top_k=5).to_proto()
    assert list(ids.stop_token_ids) == [7, 9] and list(ids.stop) == [] and ids.top_k == 5
    assert list(types.SamplingParams(stop="###").to_proto().stop) == ["###"]
    unset = types.SamplingParams().to_proto()
    assert not unset.HasField("max_tokens") and not unset.HasField("seed")  # the rollout's defaults apply
    with pytest.raises(ValueError, match="sampling_params.top_k"):
        types.SamplingParams(top_k=-2).to_proto()
    with pytest.raises(ValueError, match="sampling_params.temperature"):
        types.SamplingParams(temperature=float("nan")).to_proto()


def test_adam_params_defaults_are_tinkers_and_all_travel():
    p = types.AdamParams()
    assert (p.learning_rate, p.beta1, p.beta2, p.eps, p.weight_decay, p.grad_clip_norm) == (
        1e-4, 0.9, 0.95, 1e-12, 0.0, 0.0)
    msg = types.AdamParams(learning_rate=3e-3).to_proto()
    assert all(msg.HasField(f) for f in ("learning_rate", "beta1", "beta2", "eps", "weight_decay", "grad_clip_norm"))
    assert msg.learning_rate == 3e-3
    with pytest.raises(ValueError, match="adam_params.learning_rate"):
        types.AdamParams(learning_rate=float("inf")).to_proto()


def test_loss_fn_config_must_be_numbers():
    assert types.check_loss_fn_config({"clip_low_threshold": 0.8}) == {"clip_low_threshold": 0.8}
    with pytest.raises(ValueError, match=r"loss_fn_config\['beta'\]"):
        types.check_loss_fn_config({"beta": "high"})


# ---- outputs ------------------------------------------------------------------------------------------------------

def test_outputs_from_the_wire():
    lp = types.TensorData.from_list([-0.5, -1.5])
    fb = types.ForwardBackwardOutput.from_proto(tpb.ForwardResponse(
        outputs=[tpb.DatumOutput(loss_fn_outputs={"logprobs": lp.to_proto()})], metrics={"loss:sum": 2.0}))
    assert fb.loss_fn_outputs[0]["logprobs"] == lp and fb.metrics == {"loss:sum": 2.0}
    resp = rollout_pb2.SampleResponse(prompt_tokens=[1, 2, 3], prompt_logprobs=[-1.0, -2.0], weight_version_id="wv",
                                      sequences=[rollout_pb2.SampledSequence(tokens=[4], logprobs=[-0.25],
                                                                             finish_reason="length", text="x")])
    out = types.SampleResponse.from_proto(resp, prompt_logprobs=True)
    assert out.prompt_logprobs == [None, -1.0, -2.0]  # one per prompt token, None for the first
    assert (out.sequences[0].tokens, out.sequences[0].logprobs, out.sequences[0].stop_reason) == ([4], [-0.25],
                                                                                                   "length")
    assert types.SampleResponse.from_proto(resp, prompt_logprobs=False).prompt_logprobs is None
    info = types.GetInfoResponse.from_proto(tpb.Session(id="sess_1", base_model="tiny", lora_rank=8, lora_alpha=32,
                                                        architecture="Qwen3ForCausalLM"))
    assert (info.model_id, info.is_lora, info.lora_rank, info.model_data.arch) == ("sess_1", True, 8,
                                                                                    "Qwen3ForCausalLM")


# ---- futures ------------------------------------------------------------------------------------------------------

def test_api_future_result_await_and_timeouts():
    pool = concurrent.futures.ThreadPoolExecutor(2)
    try:
        fut = APIFuture(pool.submit(lambda: (time.sleep(0.2), 42)[1]))
        with pytest.raises(TimeoutError):
            fut.result(timeout=0.01)
        assert fut.result() == 42 and fut.done()

        async def main():
            slow = APIFuture(pool.submit(time.sleep, 0.3))
            with pytest.raises(TimeoutError):
                await slow.result_async(timeout=0.01)
            assert await slow is None  # still completes: a timeout does not cancel the call
            return await APIFuture(pool.submit(lambda: "ok"))

        assert asyncio.run(main()) == "ok"
        failed = APIFuture.failed(TrainyardError("NOT_FOUND", "gone"))
        with pytest.raises(TrainyardError, match="gone"):
            failed.result()
        with pytest.raises(TrainyardError):
            asyncio.run(failed.result_async())
        seen = []
        APIFuture.completed(1).add_done_callback(lambda f: seen.append(f.result()))
        assert seen == [1]
    finally:
        pool.shutdown()


# ---- client-side checks (no server is reached: channels connect lazily) -------------------------------------------

@pytest.fixture()
def offline_client():
    with ServiceClient(base_url="127.0.0.1:9", api_key="k", rollout_url="127.0.0.1:9") as service:
        yield TrainingClient(service, tpb.Session(id="sess_offline", base_model="tiny", next_seq_id=1))


def test_bad_inputs_are_refused_before_sending_and_use_no_seq_id(offline_client):
    tc = offline_client
    good = types.Datum(types.ModelInput.from_ints([1, 2]), {"target_tokens": [2, 3]})
    bad = types.Datum(types.ModelInput.from_ints([1, 2]), {"target_tokens": [2, 3], "weights": [1.0]})
    with pytest.raises(ValueError, match=r"data\[1\]\.loss_fn_inputs\['weights'\]"):
        tc.forward_backward([good, bad], "cross_entropy")
    with pytest.raises(ValueError, match="data: at least one datum"):
        tc.forward([])
    with pytest.raises(ValueError, match="data: must be a list of Datum"):
        tc.forward(good)
    with pytest.raises(ValueError, match="loss_fn"):
        tc.forward_backward([good], None)
    with pytest.raises(ValueError, match=r"loss_fn_config\['x'\]"):
        tc.forward_backward([good], "cross_entropy", {"x": float("nan")})
    with pytest.raises(ValueError, match="target_tokens"):
        tc.forward_backward_custom([types.Datum(types.ModelInput.from_ints([1]), {"weights": [1.0]})],
                                   lambda d, lp: (lp[0].sum(), {}))
    with pytest.raises(ValueError, match="path: expected 'trainyard://state/"):
        tc.load_state("trainyard://weights/wv_1")
    with pytest.raises(ValueError, match=r"AdamParams\s+beta1"):  # pydantic refuses it when built, as Tinker's
        types.AdamParams(beta1=None)
    with pytest.raises(ValueError, match="adam_params.beta1"):
        tc.optim_step(types.AdamParams.model_construct(beta1=float("nan")))
    assert tc._next_seq_id == 1  # nothing was sent, so no seq_id was used
    with pytest.raises(ValueError, match="path: expected 'trainyard://weights/"):
        tc.service.create_sampling_client(model_path="trainyard://state/ckpt_1")
    with pytest.raises(ValueError, match="model_path, base_model"):
        tc.service.create_sampling_client()
    sampler = SamplingClient(tc.service, "tiny", "tiny")
    for kwargs, field in [({"topk_prompt_logprobs": 5}, "topk_prompt_logprobs"),
                          ({"prompt_alt_tokens_k": 2}, "prompt_alt_tokens_k"),
                          ({"prompt_logprobs_last_n": 1}, "needs include_prompt_logprobs"),
                          ({"prompt_logprobs_last_n": 2, "include_prompt_logprobs": True}, "between 1 and"),
                          ({"target_prompt_logprobs": types.TensorData.from_list([[1]])}, "target_prompt_logprobs")]:
        with pytest.raises(ValueError, match=field):
            sampler.sample(types.ModelInput.from_ints([1, 2]), 1, types.SamplingParams(), **kwargs)
    with pytest.raises(ValueError, match="train_mlp, train_attn, train_unembed"):
        tc.service.create_lora_training_client("tiny", train_mlp=False, train_attn=False, train_unembed=False)
    with pytest.raises(ValueError, match="optim_params, adam_params"):
        tc.optim_step(types.AdamParams(), adam_params=types.AdamParams())
    with pytest.raises(ValueError, match="weights_access_token"):
        tc.load_state("trainyard://state/ckpt_1", weights_access_token="t")
    assert tc._next_seq_id == 1


def test_an_unreachable_rollout_fails_when_the_sampling_client_is_made(offline_client):
    """The offline client's rollout_url points at a closed port: the create_sampling_client future fails, naming
    the setting, before any sample is sent."""
    future = offline_client.service.create_sampling_client(base_model="tiny")
    with pytest.raises(TrainyardError, match="rollout service at 127.0.0.1:9 does not answer.*rollout_url"):
        future.result(timeout=30)


def test_custom_loss_weights_are_the_negative_gradient():
    """weights = -dL/dlogprobs, so cross_entropy's -sum(w * lp) has L's gradient. Checked for a loss with a known
    gradient: L = -sum_i sum_t A_t * lp_t / T_i  ->  weights_t = A_t / T_i; [T, K] logprobs keep their shape; a datum
    the loss ignores gets zero weights."""
    data = [types.Datum(types.ModelInput.from_ints([1, 2, 3]), {"target_tokens": [2, 3, 4],
                                                                 "advantages": [1.0, -2.0, 0.5]}),
            types.Datum(types.ModelInput.from_ints([1, 2]), {"target_tokens": [[2, 5], [3, 6]]}),
            types.Datum(types.ModelInput.from_ints([9]), {"target_tokens": [4]})]
    out = types.ForwardBackwardOutput(loss_fn_output_type="TensorData", loss_fn_outputs=[
        {"logprobs": types.TensorData.from_list([-1.0, -2.0, -3.0])},
        {"logprobs": types.TensorData.from_list([[-0.5, -4.0], [-1.5, -2.5]])},
        {"logprobs": types.TensorData.from_list([-0.1])}], metrics={})

    def loss_fn(batch, logprobs):
        adv = batch[0].loss_fn_inputs["advantages"].to_torch()
        loss = -(adv * logprobs[0]).sum() / 3 + 2.0 * logprobs[1][:, 0].sum()
        return loss, {"custom:mean": torch.tensor(0.25)}

    weights, loss, metrics = _custom_weights(data, out, loss_fn)
    assert torch.allclose(weights[0], torch.tensor([1.0, -2.0, 0.5]) / 3)
    assert torch.equal(weights[1], torch.tensor([[-2.0, 0.0], [-2.0, 0.0]]))
    assert torch.equal(weights[2], torch.zeros(1))
    assert loss == pytest.approx(-(1.0 * -1 + -2 * -2 + 0.5 * -3) / 3 + 2 * (-0.5 - 1.5))
    assert metrics == {"custom:mean": 0.25}
    with pytest.raises(TypeError, match="scalar torch tensor"):
        _custom_weights(data, out, lambda d, lp: (1.0, {}))


def test_client_config_trainer_url(monkeypatch, tmp_path):
    monkeypatch.setenv("TRAINYARD_CLIENT_CONFIG", str(tmp_path / "client.json"))
    monkeypatch.delenv("TRAINYARD_TRAINER_URL", raising=False)
    assert ClientConfig.resolve().trainer_url == "127.0.0.1:50052"
    monkeypatch.setenv("TRAINYARD_TRAINER_URL", "trainer.example:7000")
    assert ClientConfig.resolve().trainer_url == "trainer.example:7000"
    assert ClientConfig.resolve(trainer_url="elsewhere:1").trainer_url == "elsewhere:1"
    ClientConfig(api_key="k", trainer_url="saved:2").save()
    monkeypatch.delenv("TRAINYARD_TRAINER_URL")
    assert ClientConfig.resolve().trainer_url == "saved:2"
    with ServiceClient(api_key="k") as service:
        assert service.config.trainer_url == "saved:2"


def test_service_client_takes_tinkers_parameters():
    """The address by keyword (Tinker's first parameter is user_metadata: an address given there is refused);
    unknown keywords are ignored with a FutureWarning and headers travel as metadata, as Tinker's."""
    with pytest.raises(ValueError, match="user_metadata: .*base_url="):
        ServiceClient("127.0.0.1:9")
    with pytest.warns(FutureWarning, match="ignores unsupported arguments: nonsense"):
        service = ServiceClient({"team": "a"}, "proj", base_url="127.0.0.1:9", api_key="k", rollout_url="127.0.0.1:9",
                                default_headers_overrides={"X-Run": "7"}, nonsense=1)
    with service:
        assert (service.user_metadata, service.project_id, service.config.trainer_url) == ({"team": "a"}, "proj",
                                                                                            "127.0.0.1:9")
        assert service.metadata == (("x-run", "7"), ("authorization", "Bearer k"))
