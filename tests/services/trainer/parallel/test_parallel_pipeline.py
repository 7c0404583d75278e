"""Pipeline parallelism (services/trainer/engine/parallel/pipeline.py) on real gloo groups: the layer split, stages
that read only their own tensors, and a call's loss and gradients through every schedule against the named
reference, the single-process engine (forward_backward.LossCall on the whole model loaded by load_pretrained: same
weights, same datums, same loss, micro_batch_tokens = the pipeline's row) run in this test's process.

Tolerances (float32 on CPU, one thread): the loss (a float64 sum of float32 datum losses) within 1e-6 relative; the
logprobs within 1e-5 absolute (values of order -7); the gradient of every trainable parameter (full: every weight;
LoRA: every adapter tensor, with B drawn nonzero so that A's gradients are not zero) within 1e-5 of the reference's
largest entry of that parameter, max |g_pp - g_ref| <= 1e-5 * max |g_ref|. The pipeline's rows are padded to a fixed
length, so its matmuls have other shapes and round differently, and the tied embeddings' gradient is the sum of the
two stage copies' gradients, added in another order: float32 rounding (measured: gradients up to 1.4e-6 of their
largest entry, logprobs up to 1.4e-6, the loss up to 3.5e-7 relative).
"""
from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import save_file

from services.common.errors import InvalidArgument
from services.trainer.engine.forward_backward import Datum, LossRequest
from tests.services.trainer.parallel.ranks import run_ranks

pytestmark = pytest.mark.usefixtures("one_thread")

ROW = 16  # tokens per micro-batch row; the datums below pack into 4 rows: [5, 9], [7], [12, 4], [6, 3]
WIDE_ROW = 32  # 2 rows, [5, 9, 7], [12, 4, 6, 3]: 1f1b on pp 4 adds 2 empty rows
LENGTHS = (5, 9, 7, 12, 4, 6, 3)
LORA = dict(rank=4, alpha=8.0)
FAMILIES = ("qwen3", "qwen3_moe", "deepseek_v3")
LOSS_RTOL, LOGPROB_ATOL, GRAD_RTOL = 1e-6, 1e-5, 1e-5


def _datums(loss_fn: str = "cross_entropy", seed: int = 0) -> list[Datum]:
    """Fixed datums: cross_entropy with signed weights (a linear surrogate of any loss), or grpo (c = 1/G, a mask)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in LENGTHS:
        tokens, targets = torch.randint(3, 1000, (n,), generator=g), torch.randint(3, 1000, (n,), generator=g)
        if loss_fn == "cross_entropy":
            inputs = {"target_tokens": targets, "weights": torch.randn(n, generator=g)}
        else:
            inputs = {"target_tokens": targets, "logprobs": -7 + 0.1 * torch.randn(n, generator=g),
                      "advantages": torch.randn(n, generator=g), "mask": (torch.rand(n, generator=g) > 0.2).float()}
        out.append(Datum(tokens, inputs))
    return out


def _request(loss_fn: str, row: int = ROW) -> LossRequest:
    from services.trainer.engine import losses

    return LossRequest(loss_fn, losses.resolve_config(loss_fn, {}), row)


def _adapter(model) -> dict[str, torch.Tensor]:
    """Give every LoRA B a random value (it starts at zero, which would make A's gradients zero) and return the
    adapter's tensors by parameter name."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.copy_(0.05 * torch.randn(p.shape, generator=g))
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def _grad(p: torch.Tensor) -> torch.Tensor:
    return p.grad if p.grad is not None else torch.zeros_like(p)  # a parameter no datum reached


def _reference(model_dir, mode: str, loss_fn: str = "cross_entropy", calls: int = 1, row: int = ROW) -> dict:
    """The single-process engine's call (made `calls` times: gradients accumulate): loss, logprobs, metrics, and
    every trainable parameter's gradient by name (a tied weight under both of its names)."""
    from models import load_pretrained
    from models.lora import LoraConfig, apply_lora, set_trainable
    from services.trainer.engine.forward_backward import LossCall, run_call

    model = load_pretrained(model_dir).train()
    adapter = None
    if mode == "lora":
        params = apply_lora(model, LoraConfig(**LORA), seed=0)
        adapter = _adapter(model)
    else:
        params = set_trainable(model, "full")
    for _ in range(calls):
        call = LossCall(model, params, _request(loss_fn, row), backward=True, deterministic=False,
                        device=torch.device("cpu"), lock=contextlib.nullcontext)
        logprobs, metrics = run_call(call, _datums(loss_fn))
    grads = {n: _grad(p) for n, p in model.named_parameters(remove_duplicate=False) if p.requires_grad}
    return {"loss": metrics["loss:sum"], "logprobs": logprobs, "metrics": metrics, "grads": grads,
            "adapter": adapter}


def _pipeline_cases(model_dir: str, cases: list[tuple[str, str, str, int]], adapters: dict, row: int = ROW) -> dict:
    """On each rank of a pp group: for each (schedule, mode, loss_fn, calls), build the pipeline, make the call
    `calls` times (a Forward first when calls > 1), and return the loss, this rank's gradients by name, and (last
    stage) the logprobs and metrics."""
    from models.lora import LoraConfig, apply_lora, set_trainable
    from services.trainer.engine.parallel import ParallelDims, build_mesh
    from services.trainer.engine.parallel.pipeline import build_pipeline, pipeline_step

    mesh = build_mesh(ParallelDims(pp=dist.get_world_size(), dp_shard=1).resolved(dist.get_world_size()))
    out = {}
    for schedule, mode, loss_fn, calls in cases:
        pipe = build_pipeline(model_dir, mesh["pp"], schedule=schedule, row_tokens=row)
        for model in pipe.models:
            if mode == "lora":
                apply_lora(model, LoraConfig(**LORA), seed=0)
                with torch.no_grad():  # the reference's adapter values (a stage draws its own init otherwise)
                    for name, p in model.named_parameters():
                        if p.requires_grad:
                            p.copy_(adapters[name])
            else:
                set_trainable(model, "full")
        forward = None
        if calls > 1:  # a Forward: the same loss and logprobs, no gradients
            forward = pipeline_step(pipe, _datums(loss_fn), _request(loss_fn, row), backward=False)
            assert all(p.grad is None for _, p in pipe.named_parameters())
        for _ in range(calls):
            result = pipeline_step(pipe, _datums(loss_fn), _request(loss_fn, row))
        out[schedule, mode, loss_fn, calls] = {
            "loss": result.loss, "logprobs": result.logprobs, "metrics": result.metrics, "forward": forward,
            "layers": [m.layer_ids for m in pipe.models],
            "grads": {n: _grad(p) for n, p in pipe.named_parameters() if p.requires_grad}}
    return out


def _diffs(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> dict[str, tuple[float, float]]:
    """Per parameter: (max abs difference, that over the reference's max abs entry)."""
    out = {}
    for name, g in got.items():
        ref = want[name]
        diff = float((g - ref).abs().max())
        out[name] = (diff, diff / (float(ref.abs().max()) or 1.0))  # a zero gradient must come out (near) zero
    return out


def _check(results: list[dict], ref: dict, case: tuple) -> dict:
    """Every rank's loss equals the reference's; the gradients of all ranks together cover every trainable
    parameter once and each is within GRAD_RTOL; the last stage's logprobs and metrics match. Returns the worst
    differences (for the report)."""
    grads: dict[str, torch.Tensor] = {}
    for r in results:
        res = r[case]
        assert res["loss"] == pytest.approx(ref["loss"], rel=LOSS_RTOL), (case, res["loss"], ref["loss"])
        assert not grads.keys() & res["grads"].keys()
        grads.update(res["grads"])
    assert grads.keys() == ref["grads"].keys(), case
    diffs = _diffs(grads, ref["grads"])
    bad = {n: d for n, d in diffs.items() if d[1] > GRAD_RTOL}
    assert not bad, (case, bad)
    last = [r[case] for r in results if r[case]["logprobs"] is not None]
    assert len(last) == 1
    lp_diff = max(float((a - b).abs().max()) for a, b in zip(last[0]["logprobs"], ref["logprobs"], strict=True))
    if last[0]["forward"] is not None:
        assert last[0]["forward"].loss == pytest.approx(ref["loss"], rel=LOSS_RTOL)
        lp_diff = max(lp_diff, *(float((a - b).abs().max()) for a, b in zip(
            last[0]["forward"].logprobs, ref["logprobs"], strict=True)))
    assert lp_diff <= LOGPROB_ATOL, (case, lp_diff)
    assert last[0]["metrics"].keys() == ref["metrics"].keys()
    for k, v in ref["metrics"].items():
        assert last[0]["metrics"][k] == pytest.approx(v, rel=LOSS_RTOL), (case, k)
    worst = max(diffs.values(), key=lambda d: d[1])
    return {"loss_rel": abs(last[0]["loss"] - ref["loss"]) / abs(ref["loss"]), "grad_abs": max(d[0] for d in
            diffs.values()), "grad_rel": worst[1], "logprob_abs": lp_diff}


# -- splitting -------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("layers, stages, sizes", [
    (4, 4, [1, 1, 1, 1]), (4, 2, [2, 2]), (5, 2, [3, 2]), (6, 4, [1, 2, 2, 1]), (7, 4, [2, 2, 2, 1]),
    (8, 3, [3, 3, 2]), (61, 8, [7, 8, 8, 8, 8, 8, 7, 7]),
])
def test_layer_split_is_balanced_and_the_ends_take_fewer(layers, stages, sizes):
    from services.trainer.engine.parallel.pipeline import layer_split

    split = layer_split(layers, stages)
    assert [len(s) for s in split] == sizes
    assert [i for s in split for i in s] == list(range(layers))


def test_stage_placement_and_bad_settings():
    from services.trainer.engine.parallel.pipeline import (
        _micro_batches, _too_long, layer_split, min_microbatches, schedule_spec, stage_ranks,
    )

    assert stage_ranks(2, 4, "loop") == [0, 1, 0, 1]
    assert stage_ranks(3, 6, "v") == [0, 1, 2, 2, 1, 0]
    with pytest.raises(ValueError, match="5 pipeline stages need 1 to 4"):
        layer_split(4, 5)
    with pytest.raises(InvalidArgument) as exc:
        schedule_spec("zb")
    assert exc.value.violations[0].field == "pipeline.schedule"
    assert [len(mb) for mb in _micro_batches(_datums(), ROW)] == [2, 1, 2, 2]
    assert _too_long(_datums(), ROW) is None
    assert _too_long(_datums(), 11).violations[0].field == "data[3]"  # the fourth datum has 12 tokens
    assert [min_microbatches(s, 4, 2) for s in ("gpipe", "1f1b", "interleaved_1f1b", "zbv")] == [2, 4, 2, 2]
    assert min_microbatches("interleaved_1f1b", 2, 5) == 6  # 2 rounds of 3


def test_a_stage_reads_only_its_own_tensors(family_dirs, tmp_path):
    """A directory holding only the second of two stages' tensors (per-expert keys, as on disk) loads that stage,
    bit for bit the whole model's tensors; the whole model cannot load from it."""
    from safetensors import safe_open

    from models import load_pretrained
    from models.checkpoint import build_on_meta, load_weights
    from services.trainer.engine.parallel.pipeline import split_model

    src = family_dirs["qwen3_moe"]
    (_, stage), = split_model(build_on_meta(src), 1, 2, "1f1b")
    assert stage.layer_ids == [2, 3] and stage.model.embed_tokens is None
    with safe_open(src / "model.safetensors", framework="pt") as f:
        keep = {k: f.get_tensor(k) for k in f.keys()
                if k.startswith(("model.layers.2.", "model.layers.3.", "model.norm.", "model.embed_tokens."))}
    assert any(".mlp.experts.0.gate_proj." in k for k in keep)  # per-expert keys, fused on load
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((src / name).read_bytes())
    save_file(keep, str(tmp_path / "model.safetensors"))
    loaded = load_weights(stage, tmp_path)
    whole = load_pretrained(src).state_dict()
    state = loaded.state_dict()
    assert state.keys() == {k for k in whole if k.startswith(("model.layers.2.", "model.layers.3.", "model.norm.",
                                                              "lm_head."))}
    assert all(torch.equal(v, whole[k]) for k, v in state.items())  # lm_head.weight: the tied embeddings, read
    with pytest.raises(ValueError, match="missing keys"):
        load_pretrained(tmp_path)


@pytest.mark.parametrize("targets", [None, ("q_proj", "experts.down_proj")])
def test_a_fresh_stage_adapter_is_the_whole_models(family_dirs, targets):
    """apply_stage_lora: the four stages of an interleaved pp 2 together hold bit for bit the adapter apply_lora
    draws on the whole model with the same seed (also with explicit targets that layer 0, dense, does not have)."""
    from models import load_pretrained
    from models.checkpoint import build_on_meta, load_weights
    from models.lora import LoraConfig, apply_lora
    from services.trainer.engine.parallel.pipeline import apply_stage_lora, split_model

    src = family_dirs["qwen3_moe"]
    cfg = LoraConfig(**LORA, **({"target_modules": targets} if targets else {}))
    whole = load_pretrained(src)
    apply_lora(whole, cfg, seed=3)
    want = {n: p for n, p in whole.named_parameters() if p.requires_grad}
    meta, got = build_on_meta(src), {}
    for rank in range(2):
        stages = [load_weights(stage, src) for _, stage in split_model(meta, rank, 2, "interleaved_1f1b")]
        params = apply_stage_lora(stages, meta, cfg, seed=3)
        named = {n: p for m in stages for n, p in m.named_parameters() if p.requires_grad}
        assert sorted(map(id, params)) == sorted(map(id, named.values()))
        got.update(named)
    assert got.keys() == want.keys() and any(".experts." in n for n in got)
    assert all(torch.equal(got[n], want[n]) for n in want)
    assert any(".lora_A." in n and want[n].abs().max() > 0 for n in want)


# -- numerics --------------------------------------------------------------------------------------------------------
# (schedule, mode, loss, calls): each schedule, full and LoRA; grpo (c = 1/G) twice (gradients accumulate across
# calls, the engine's semantics until the optimizer step) after a Forward.
PP2 = [(s, m, "cross_entropy", 1) for s in ("gpipe", "1f1b", "interleaved_1f1b", "zbv") for m in ("full", "lora")]
PP2 += [("1f1b", "full", "grpo", 2)]


@pytest.mark.parametrize("family", FAMILIES)
def test_pp2_every_schedule_matches_the_single_process_engine(family_dirs, family):
    refs = {c: _reference(family_dirs[family], *c) for c in {c[1:] for c in PP2}}
    adapters = refs["lora", "cross_entropy", 1]["adapter"]
    results = run_ranks(_pipeline_cases, 2, str(family_dirs[family]), PP2, adapters)
    assert results[0]["gpipe", "full", "cross_entropy", 1]["layers"] == [[0, 1]]
    assert results[0]["zbv", "full", "cross_entropy", 1]["layers"] == [[0], [3]]  # V: rank 0 holds stages 0 and 3
    assert results[1]["interleaved_1f1b", "full", "cross_entropy", 1]["layers"] == [[1], [3]]
    for case in PP2:
        _check(results, refs[case[1:]], case)


@pytest.mark.parametrize("family", FAMILIES)
def test_pp4_matches_the_single_process_engine(family_dirs, family):
    """1f1b on 4 ranks with rows of WIDE_ROW tokens: the call's 2 rows and 2 empty ones (1f1b needs one per stage)."""
    cases = [("1f1b", "full", "cross_entropy", 1), ("1f1b", "lora", "cross_entropy", 1)]
    refs = {m: _reference(family_dirs[family], m, row=WIDE_ROW) for m in ("full", "lora")}
    results = run_ranks(_pipeline_cases, 4, str(family_dirs[family]), cases, refs["lora"]["adapter"], WIDE_ROW)
    assert [r[cases[0]]["layers"] for r in results] == [[[0]], [[1]], [[2]], [[3]]]
    for case in cases:
        _check(results, refs[case[1]], case)
