"""Parity: one seeded loop run (i) through Trainyard's native gRPC (TrainerService stubs and protobuf messages written
here), (ii) through the drop-in SDK (`import trainyard as tinker`) and (iii) through the unmodified `tinker` package
against the gateway gives the same adapter and the same losses.

The loop: a LoRA session with a fixed seed, three cross_entropy forward_backward + optim_step on fixed data, one
importance_sampling forward_backward + optim_step on fixed sampled-like data (tokens, sampler logprobs, advantages),
then save_state; the checkpoint is downloaded (trainyard.Client.download_checkpoint, checked against its manifest)
and its adapter's tensors compared.

Exactness: bitwise. All three paths send the same bytes to the same trainer (every float of the data is exact in
float32, so no client rounds it differently), which runs the same engine with one torch thread on the same base
weights, so every loss, every logprob and every adapter tensor is compared with np.array_equal and Python's ==, no
tolerance.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

import trainyard as tinker
from services.gateway import paths
from trainyard import Client
from trainyard.training import STATE_PREFIX
from trainyard.v1 import trainer_pb2 as tpb, trainer_pb2_grpc

pytestmark = pytest.mark.integration
BASE = "tiny-qwen3"
SEED, RANK, LR = 20260, 8, 1e-2
SFT_STEPS = 3
# Next-token prediction on each sequence; the first target of the first sequence weighs 0 (a prompt token).
SFT_SEQS = [[5, 17, 33, 60, 71, 88, 2], [7, 8, 9, 10, 11, 12, 13, 2], [40, 41, 42, 43, 2]]
# Sampled-like data: a prompt, then "sampled" tokens with the sampler's logprobs and the group's advantages (every
# value a float32 exactly, so every client sends the same bits).
IS_PROMPT = [5, 17, 33]
IS_SAMPLES = [([60, 71, 88, 2], [-2.5, -1.25, -3.0, -0.5], 0.75),
              ([61, 61, 90, 2], [-1.75, -2.0, -4.5, -1.0], -0.75)]


def sft_rows() -> list[tuple[list[int], list[int], list[float]]]:
    """(input tokens, target tokens, weights) per datum."""
    rows = []
    for i, seq in enumerate(SFT_SEQS):
        weights = [1.0] * (len(seq) - 1)
        if i == 0:
            weights[0] = 0.0
        rows.append((seq[:-1], seq[1:], weights))
    return rows


def is_rows() -> list[tuple[list[int], list[int], list[float], list[float]]]:
    """(input tokens, target tokens, sampler logprobs, advantages) per datum, the prompt's positions weighing 0."""
    rows = []
    n_prompt = len(IS_PROMPT) - 1
    for tokens, logprobs, advantage in IS_SAMPLES:
        full = IS_PROMPT + tokens
        rows.append((full[:-1], full[1:], [0.0] * n_prompt + logprobs, [0.0] * n_prompt + [advantage] * len(tokens)))
    return rows


@dataclass
class Run:
    """What one path of the loop gave: per forward_backward its metrics and its per-datum logprobs, and the id of
    the checkpoint save_weights_for_sampler stored."""

    metrics: list[dict[str, float]] = field(default_factory=list)
    logprobs: list[list[np.ndarray]] = field(default_factory=list)
    checkpoint_id: str = ""


# -- (i) native gRPC ------------------------------------------------------------------------------------------------
def _tensor(values: list, dtype: type) -> tpb.TensorData:
    """The wire form, written out here: little-endian values in row-major order."""
    array = np.asarray(values, dtype=np.dtype(dtype).newbyteorder("<"))
    wire = tpb.TensorData.DTYPE_FLOAT32 if array.dtype.kind == "f" else tpb.TensorData.DTYPE_INT64
    return tpb.TensorData(dtype=wire, shape=list(array.shape), data=array.tobytes())


def native_loop(stack, api_key: str) -> Run:
    import grpc

    run = Run()
    metadata = (("authorization", f"Bearer {api_key}"),)
    with grpc.insecure_channel(stack.url("trainer")) as channel:
        stub = trainer_pb2_grpc.TrainerServiceStub(channel)
        session = stub.CreateSession(tpb.CreateSessionRequest(
            base_model=BASE, seed=SEED, lora=tpb.SessionLora(rank=RANK, alpha=32.0, train_attn=True, train_mlp=True,
                                                             train_unembed=False)), metadata=metadata)
        seq_id = session.next_seq_id

        def ordered(method: str, request):
            nonlocal seq_id
            request.session_id, request.seq_id = session.id, seq_id
            seq_id += 1
            return getattr(stub, method)(request, metadata=metadata)

        def step(loss_fn: str, data: list[tpb.Datum]) -> None:
            out = ordered("ForwardBackward", tpb.ForwardBackwardRequest(data=data, loss_fn=loss_fn))
            run.metrics.append(dict(out.metrics))
            run.logprobs.append([np.frombuffer(o.loss_fn_outputs["logprobs"].data, dtype="<f4")
                                 for o in out.outputs])
            ordered("OptimStep", tpb.OptimStepRequest(adam=tpb.AdamParams(learning_rate=LR)))

        sft = [tpb.Datum(tokens=x, loss_fn_inputs={"target_tokens": _tensor(y, np.int64),
                                                   "weights": _tensor(w, np.float32)}) for x, y, w in sft_rows()]
        for _ in range(SFT_STEPS):
            step("cross_entropy", sft)
        step("importance_sampling", [
            tpb.Datum(tokens=x, loss_fn_inputs={"target_tokens": _tensor(y, np.int64),
                                                "logprobs": _tensor(lp, np.float32),
                                                "advantages": _tensor(adv, np.float32)})
            for x, y, lp, adv in is_rows()])
        run.checkpoint_id = ordered("SaveState", tpb.SaveStateRequest(name="parity-native")).checkpoint_id
        stub.CloseSession(tpb.CloseSessionRequest(id=session.id), metadata=metadata)
    return run


# -- (ii) import trainyard as tinker ----------------------------------------------------------------------------------
def tinker_style_loop(sdk, service_client, name: str) -> tuple[Run, str]:
    """The loop as Tinker code writes it; sdk is the module in use (trainyard or tinker). Returns the run and the
    path of the state it saved."""
    run = Run()
    training_client = service_client.create_lora_training_client(base_model=BASE, rank=RANK, seed=SEED,
                                                                  train_unembed=False).result()

    def step(loss_fn: str, data: list) -> None:
        fwd_bwd = training_client.forward_backward(data, loss_fn=loss_fn)
        optim = training_client.optim_step(sdk.AdamParams(learning_rate=LR, beta1=0.9, beta2=0.95, eps=1e-12))
        out = fwd_bwd.result()
        optim.result()
        run.metrics.append(dict(out.metrics))
        run.logprobs.append([o["logprobs"].to_numpy().astype("<f4") for o in out.loss_fn_outputs])

    sft = [sdk.Datum(model_input=sdk.ModelInput.from_ints(x),
                        loss_fn_inputs={"target_tokens": y, "weights": w}) for x, y, w in sft_rows()]
    for _ in range(SFT_STEPS):
        step("cross_entropy", sft)
    step("importance_sampling", [
        sdk.Datum(model_input=sdk.ModelInput.from_ints(x),
                     loss_fn_inputs={"target_tokens": y, "logprobs": lp, "advantages": adv})
        for x, y, lp, adv in is_rows()])
    return run, training_client.save_state(name=name).result().path


def dropin_loop(stack, api_key: str) -> Run:
    with tinker.ServiceClient(base_url=stack.url("trainer"), api_key=api_key,
                              rollout_url=stack.url("rollout")) as service_client:
        run, path = tinker_style_loop(tinker, service_client, "parity-dropin")
    run.checkpoint_id = state_checkpoint_id(path)
    return run


def state_checkpoint_id(trainyard_path: str) -> str:
    """"trainyard://state/<checkpoint id>" -> the id."""
    assert trainyard_path.startswith(STATE_PREFIX), trainyard_path
    return trainyard_path[len(STATE_PREFIX):]


# -- (iii) the tinker package through the gateway ------------------------------------------------------------------
def gateway_loop(stack, api_key: str) -> Run:
    import tinker as real_tinker

    service_client = real_tinker.ServiceClient(base_url=f"http://{stack.url('gateway')}", api_key="tml-" + api_key)
    run, path = tinker_style_loop(real_tinker, service_client, "parity-gateway")
    run.checkpoint_id = state_checkpoint_id(paths.to_trainyard(path, "weights"))
    return run


# -- comparing ----------------------------------------------------------------------------------------------------
def adapter(stack, api_key: str, checkpoint_id: str, dest: Path) -> dict[str, np.ndarray]:
    with Client(url=stack.url("scheduler"), api_key=api_key) as c:
        c.download_checkpoint(checkpoint_id, dest)
    (weights,) = dest.glob("*.safetensors")
    return load_file(weights)


def assert_same(a: Run, b: Run, tensors_a: dict[str, np.ndarray], tensors_b: dict[str, np.ndarray]) -> None:
    assert len(a.metrics) == len(b.metrics) == SFT_STEPS + 1
    for i, (ma, mb) in enumerate(zip(a.metrics, b.metrics)):
        assert ma["loss:mean"] == mb["loss:mean"], (i, ma, mb)
        assert ma["loss:sum"] == mb["loss:sum"], (i, ma, mb)
    for i, (la, lb) in enumerate(zip(a.logprobs, b.logprobs)):
        assert len(la) == len(lb) and all(np.array_equal(x, y) for x, y in zip(la, lb)), i
    assert sorted(tensors_a) == sorted(tensors_b)
    different = [k for k in tensors_a if not np.array_equal(tensors_a[k], tensors_b[k])]
    assert not different, f"adapter tensors differ: {different[:5]} (max |diff| " \
        f"{max(float(np.abs(tensors_a[k] - tensors_b[k]).max()) for k in different)})"


def check_the_loop_trained(run: Run, tensors: dict[str, np.ndarray]) -> None:
    """The comparison means something: the supervised loss fell and the adapter moved off its initialization
    (LoRA's B matrices start at zero)."""
    losses = [m["loss:mean"] for m in run.metrics[:SFT_STEPS]]
    assert losses[-1] < losses[0], losses
    b_matrices = [k for k in tensors if "lora_B" in k]
    assert b_matrices and all(np.abs(tensors[k]).max() > 0 for k in b_matrices)


@pytest.fixture(scope="module")
def native(stack, api_key, tmp_path_factory) -> tuple[Run, dict[str, np.ndarray]]:
    run = native_loop(stack, api_key)
    tensors = adapter(stack, api_key, run.checkpoint_id, tmp_path_factory.mktemp("native"))
    check_the_loop_trained(run, tensors)
    return run, tensors


def test_dropin_sdk_gives_the_native_adapter_bitwise(native, stack, api_key, tmp_path):
    run, tensors = native
    dropin = dropin_loop(stack, api_key)
    assert_same(run, dropin, tensors, adapter(stack, api_key, dropin.checkpoint_id, tmp_path))


def test_tinker_package_through_the_gateway_gives_the_native_adapter_bitwise(native, stack, api_key, tmp_path):
    run, tensors = native
    gateway = gateway_loop(stack, api_key)
    assert_same(run, gateway, tensors, adapter(stack, api_key, gateway.checkpoint_id, tmp_path))
