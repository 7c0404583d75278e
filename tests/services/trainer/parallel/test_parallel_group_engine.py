"""The trainer group's engine path (services/trainer/group.py) on real gloo groups, without the gRPC front: rank 0's
EngineGroup / GroupEngine / GroupCall drive every rank's EngineHost through the controller, as SessionManager does
on a trainer group, for layouts the service tests (tests/services/trainer/test_trainer_group.py, dp_shard 2 under
torchrun) do not start: a pipeline (pp 2, and pp 2 x dp_shard 2), and calls with fewer datums than data-parallel
ranks.

Reference: the single-process TrainingEngine on the same model directory, datums, loss and AdamW settings, in the
test's own process. Checked: the call's logprobs (every datum's, in order), its loss metric, the gradient norm of the
step, and the PEFT adapter written by save_weights after the step (rank 0's export, gathered from the shards and
stages). Tolerances (float32 on the CPU; sums in another order, the pipeline's padded rows): loss and norm relative
1e-6; logprobs 1e-5 absolute; adapter weights 5e-7 + 1e-6 |w| (AdamW eps 1e-4 amplifies a gradient's rounding by
lr / eps = 10, test_parallel_pp_engine.py's reasoning).
"""
from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

from services.trainer.engine import TrainingEngine
from services.trainer.engine.forward_backward import run_call
from services.trainer.engine.parallel import ParallelDims
from services.trainer.engine.parallel.controller import Controller, serve
from services.trainer.group import EngineGroup, EngineHost
from tests.services.trainer.parallel.ranks import run_ranks
from tests.services.trainer.parallel.test_parallel_fsdp import LORA, REQ, SETTINGS, _datums

_LOSS_RTOL, _LOGPROB_ATOL, _WEIGHT_ATOL, _WEIGHT_RTOL = 1e-6, 1e-5, 5e-7, 1e-6


def _drive(model_dir: str, dims: dict, n_datums: int, out_dir: str) -> dict | None:
    host = EngineHost(ParallelDims(**dims), SETTINGS, torch.device("cpu"))
    if dist.get_rank() != 0:
        serve(host)
        return None
    group = EngineGroup(Controller(host), host)
    engine = group.create("s1", model_dir, lora=LORA, seed=3)
    datums = _datums(engine.model.args.vocab_size, n=n_datums)
    call = engine.loss_call(REQ, backward=True, deterministic=False, lock=contextlib.nullcontext)
    logprobs, metrics = run_call(call, datums)
    norm = engine.step(SETTINGS)
    engine.save_weights(Path(out_dir), base_model="tiny")
    engine.release()
    group.stop()
    return {"logprobs": logprobs, "metrics": metrics, "norm": norm}


def _reference(model_dir, n_datums: int, out_dir) -> dict:
    engine = TrainingEngine.load(model_dir, lora=LORA, seed=3, optimizer=SETTINGS, device="cpu")
    datums = _datums(engine.model.args.vocab_size, n=n_datums)
    call = engine.loss_call(REQ, backward=True, deterministic=False, lock=contextlib.nullcontext)
    logprobs, metrics = run_call(call, datums)
    norm = float(engine.step(SETTINGS))
    engine.save_weights(out_dir, base_model="tiny")
    return {"logprobs": logprobs, "metrics": metrics, "norm": norm}


_CASES = [  # (family, world, dims, datums)
    ("qwen3", 2, {"pp": 2, "dp_shard": 1}, 7),
    ("qwen3_moe", 4, {"pp": 2, "dp_shard": 2}, 7),
    ("qwen3", 4, {"dp_shard": 4}, 2),  # two of the four data-parallel ranks have no datum
    ("qwen3", 4, {"pp": 2, "dp_shard": 2}, 1),  # one datum: the second pipeline runs empty rows only
]


@pytest.mark.parametrize("family, world, dims, n_datums", _CASES,
                         ids=[f"{f}-{'x'.join(f'{k}{v}' for k, v in d.items())}-{n}datums" for f, _, d, n in _CASES])
def test_the_group_engine_matches_the_single_process_engine(family_dirs, tmp_path, family, world, dims, n_datums):
    model_dir = family_dirs[family]
    got = run_ranks(_drive, world, str(model_dir), dims, n_datums, str(tmp_path / "group"))[0]
    want = _reference(model_dir, n_datums, tmp_path / "single")
    assert len(got["logprobs"]) == len(want["logprobs"]) == n_datums
    for g, w in zip(got["logprobs"], want["logprobs"]):
        assert float((g - w).abs().max()) <= _LOGPROB_ATOL
    assert got["metrics"].keys() == want["metrics"].keys()
    assert got["metrics"]["loss:sum"] == pytest.approx(want["metrics"]["loss:sum"], rel=_LOSS_RTOL)
    assert got["norm"] == pytest.approx(want["norm"], rel=_LOSS_RTOL)
    g_adapter = load_file(tmp_path / "group" / "adapter_model.safetensors")
    w_adapter = load_file(tmp_path / "single" / "adapter_model.safetensors")
    assert g_adapter.keys() == w_adapter.keys()
    for key in w_adapter:
        torch.testing.assert_close(g_adapter[key], w_adapter[key], rtol=_WEIGHT_RTOL, atol=_WEIGHT_ATOL)
