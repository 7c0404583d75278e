"""Job methods declared once (trainyard/methods/): the declaration against its proto message, bounds, unknown and
unset settings, the SDK's keywords and the CLI flags derived from it. Client-side only: no server, no torch."""
from __future__ import annotations

import dataclasses
import math

import pytest
from click.testing import CliRunner

from trainyard.client import job_spec
from trainyard.errors import FieldError, TrainyardError
from trainyard.methods import LORA_DEFAULTS, METHODS
from trainyard.methods import proto as method_proto
from trainyard.methods.spec import check_value, declared, resolve
from trainyard.v1 import scheduler_pb2 as pb

SFT = METHODS["sft"]


@pytest.mark.parametrize("name", list(METHODS))
def test_each_declaration_matches_its_proto_message(name):
    m = METHODS[name]
    config_type = type(getattr(pb.JobSpec(), m.config))
    assert method_proto.check_declaration(m.settings, config_type) == []
    assert m.proto in pb.JobMethod.values() and set(m.dataset_formats) <= {
        pb.DatasetFormat.Name(v).removeprefix("DATASET_FORMAT_").lower() for v in pb.DatasetFormat.values()}
    flags = [flag for f in m.fields() for flag in (f.setting.flag, *f.setting.aliases)]
    assert len(flags) == len(set(flags)), "two settings share a flag"


def test_one_set_of_lora_defaults():
    """Rank 32, alpha 32 whatever the rank, no dropout, the default target menu (an empty list)."""
    assert (LORA_DEFAULTS.lora_rank, LORA_DEFAULTS.lora_alpha, LORA_DEFAULTS.lora_dropout) == (32, 32.0, 0.0)
    assert LORA_DEFAULTS.target_modules == ()
    settings, problems = resolve(SFT.settings, {"lora_rank": 8}, prefix=SFT.prefix)
    assert problems == [] and (settings.lora_rank, settings.lora_alpha) == (8, 32.0)


def _outside(f) -> list:
    """Values just outside each declared bound."""
    s = f.setting
    values = [s.ge - 1 if f.type is int else math.nextafter(s.ge, -math.inf)] if s.ge is not None else []
    values += [s.gt] if s.gt is not None else []
    values += [s.le + 1 if f.type is int else math.nextafter(s.le, math.inf)] if s.le is not None else []
    values += [s.lt] if s.lt is not None else []
    return values


@pytest.mark.parametrize("f", [f for f in declared(SFT.settings) if _outside(f)], ids=lambda f: f.name)
def test_every_bound_is_checked_and_names_the_request_field(f):
    for value in _outside(f):
        settings, problems = resolve(SFT.settings, {f.name: value}, prefix=SFT.prefix)
        assert [p.field for p in problems] == [SFT.prefix + f.setting.proto], value
        assert getattr(settings, f.name) == f.default  # a value that does not fit keeps the default
    for value in (f.setting.ge, f.setting.le):
        if value is not None:
            assert check_value(f, f.type(value))[1] == ""


def test_types_choices_and_names_are_checked():
    bad = {"lora_rank": 2.5, "learning_rate": float("nan"), "lr_scheduler": "step", "target_modules": ["q proj"],
           "epochs": True}
    _, problems = resolve(SFT.settings, bad, prefix=SFT.prefix)
    reasons = {p.field: p.reason for p in problems}
    assert reasons == {
        "spec.sft.lora.rank": "must be a whole number, got 2.5",
        "spec.sft.learning_rate": "must be a finite number, got nan",
        "spec.sft.lr_scheduler": "must be one of cosine, linear, constant, got 'step'",
        "spec.sft.lora.target_modules": "not module names: ['q proj']",
        "spec.sft.epochs": "must be a whole number, got True",
    }


def test_unknown_settings_are_named():
    _, problems = resolve(SFT.settings, {"learning_rat": 1e-3}, prefix=SFT.prefix)
    assert problems[0].field == "spec.sft.learning_rat" and "known: lora_rank" in problems[0].reason
    with pytest.raises(ValueError, match=r"unknown sft setting\(s\) \['learning_rat'\]; known: lora_rank, "):
        job_spec("sft", "m", "ds", learning_rat=1e-3)
    with pytest.raises(ValueError, match="unknown job method 'dpoo'; known: sft"):
        job_spec("dpoo", "m", "ds")
    with pytest.raises(ValueError, match="lr_scheduler must be one of cosine, linear, constant"):
        job_spec("sft", "m", "ds", lr_scheduler="step")


def test_unset_and_explicit_values_stay_apart():
    """Unset takes the declared default; an explicit value, even 0 or a default's twin, is sent and checked."""
    spec = job_spec("sft", "m", "ds")
    assert spec.WhichOneof("config") == "sft" and method_proto.read(SFT.settings, spec.sft) == {}
    spec = job_spec("sft", "m", "ds", lora_rank=0, max_steps=0, learning_rate=None, target_modules=[])
    assert spec.sft.lora.HasField("rank") and spec.sft.HasField("max_steps") and not spec.sft.HasField("learning_rate")
    assert method_proto.read(SFT.settings, spec.sft) == {"lora_rank": 0, "max_steps": 0}
    _, problems = resolve(SFT.settings, method_proto.read(SFT.settings, spec.sft), prefix=SFT.prefix)
    assert [p.field for p in problems] == ["spec.sft.lora.rank", "spec.sft.max_steps"]


def test_max_steps_is_derived_when_unset_and_at_least_one_when_set():
    """Unset: epochs x steps per epoch (the default None); an explicit 0 is a mistake, not "derive it"."""
    settings, problems = resolve(SFT.settings, {}, prefix=SFT.prefix)
    assert problems == [] and settings.max_steps is None
    _, problems = resolve(SFT.settings, {"max_steps": 0}, prefix=SFT.prefix)
    assert [(p.field, p.reason) for p in problems] == [("spec.sft.max_steps", "must be between 1 and 10000000, got 0")]
    f = next(f for f in declared(SFT.settings) if f.name == "max_steps")
    assert f.type is int and f.describe() == "Optimizer steps to run; unset: epochs x steps per epoch (1..10000000 steps)"
    assert method_proto.write(SFT.settings, {"max_steps": None}, pb.SftConfig()).HasField("max_steps") is False


def test_settings_round_trip_through_the_proto():
    every = dataclasses.replace(SFT.settings(), lora_rank=8, lora_alpha=4.0, target_modules=("q_proj", "v_proj"),
                                lr_scheduler="linear", max_steps=7, seed=3, eval_fraction=0.25)
    values = {f.name: getattr(every, f.name) for f in declared(SFT.settings)}
    msg = method_proto.write(SFT.settings, values, pb.SftConfig())
    assert msg.lr_scheduler == pb.LR_SCHEDULER_LINEAR and list(msg.lora.target_modules) == ["q_proj", "v_proj"]
    back, problems = resolve(SFT.settings, method_proto.read(SFT.settings, msg), prefix=SFT.prefix)
    assert problems == [] and back == every
    # An enum value the declaration does not know is reported on its field, not silently the default.
    _, problems = resolve(SFT.settings, method_proto.read(SFT.settings, pb.SftConfig(lr_scheduler=99)),
                          prefix=SFT.prefix)
    assert [p.field for p in problems] == ["spec.sft.lr_scheduler"]


# -- the CLI's flags -------------------------------------------------------------------------------------------------
class FakeClient:
    """Stands in for trainyard.Client: records create_job / plan_job calls, or fails like the server would."""

    def __init__(self, error: TrainyardError | None = None):
        self.calls: list[tuple] = []
        self.error = error

    def create_job(self, method, base_model, dataset_id, display_name="", **settings):
        self.calls.append(("create", method, base_model, dataset_id, settings))
        if self.error:
            raise self.error
        return pb.Job(id="job_1")


def _run(monkeypatch, fake, *args):
    from trainyard.cli import main

    monkeypatch.setattr(main, "client", lambda ctx: fake)
    return CliRunner().invoke(main.cli, ["jobs", *args])


def test_cli_flags_come_from_the_declaration(monkeypatch):
    from trainyard.cli.main import jobs_create

    options = {p.name: p for p in jobs_create.params}
    for f in declared(SFT.settings):
        opt = options[f.name]
        assert opt.opts[0] == f.setting.flag and tuple(opt.opts[1:]) == f.setting.aliases
        assert opt.default is None and f.setting.help in opt.help
        assert (f"default {f.default:g}" if isinstance(f.default, float) else "") in opt.help
    assert "(default 32; 1..1024)" in options["lora_rank"].help
    fake = FakeClient()
    # The flag names scripts already use keep working, long forms too.
    result = _run(monkeypatch, fake, "create", "--model", "tiny", "--dataset", "ds_1", "--lr", "5e-3", "--rank", "8",
                  "--alpha", "16", "--grad-accum", "2", "--target", "q_proj", "--target", "v_proj",
                  "--lr-scheduler", "linear", "--max-steps", "6", "--learning-rate", "6e-3")
    assert result.exit_code == 0, result.output
    assert fake.calls == [("create", "sft", "tiny", "ds_1", {
        "lora_rank": 8, "lora_alpha": 16.0, "target_modules": ("q_proj", "v_proj"), "learning_rate": 6e-3,
        "max_steps": 6, "gradient_accumulation_steps": 2, "lr_scheduler": "linear"})]
    result = _run(monkeypatch, fake, "create", "--model", "tiny", "--dataset", "ds_1", "--lr-scheduler", "step")
    assert result.exit_code == 2 and "'step' is not one of 'cosine', 'linear', 'constant'" in result.output


def test_cli_errors_name_the_flag(monkeypatch):
    error = TrainyardError("INVALID_ARGUMENT", "2 problems", [
        FieldError("spec.sft.learning_rate", "must be > 0 and < 1, got -1"),
        FieldError("spec.sft.lora.rank", "must be between 1 and 1024, got 0"),
        FieldError("spec.base_model", "unknown base model 'nope'")])
    result = _run(monkeypatch, FakeClient(error), "create", "--model", "nope", "--dataset", "ds_1", "--lr", "-1",
                  "--rank", "0")
    assert result.exit_code == 1
    assert "--lr (spec.sft.learning_rate): must be > 0 and < 1, got -1" in result.output
    assert "--rank (spec.sft.lora.rank): must be between 1 and 1024" in result.output
    assert "--model (spec.base_model): unknown base model" in result.output


def test_cli_plan_prints_the_plan_and_the_resolved_settings(monkeypatch):
    spec = job_spec("sft", "tiny", "ds_1", lora_rank=8)
    method_proto.write(SFT.settings, {f.name: f.default for f in declared(SFT.settings)} | {"lora_rank": 8}, spec.sft)
    plan = pb.JobPlan(spec=spec, dataset_rows=20, train_rows=18, eval_rows=2, total_steps=27, steps_per_epoch=9,
                      epochs=3.0, checkpoints=1, trainable_parameters=311296, base_parameters=918912,
                      memory=pb.MemoryEstimate(device="cpu", weights_dtype="float32", total_bytes=20 * 2**20),
                      warnings=["only 3 optimizer steps"])

    class Planning(FakeClient):
        def plan_job(self, method, base_model, dataset_id, **settings):
            self.calls.append(("plan", method, base_model, dataset_id, settings))
            return plan

    fake = Planning()
    result = _run(monkeypatch, fake, "plan", "--model", "tiny", "--dataset", "ds_1", "--rank", "8")
    assert result.exit_code == 0, result.output
    assert fake.calls == [("plan", "sft", "tiny", "ds_1", {"lora_rank": 8})]
    out = " ".join(result.output.split())
    assert "rows 20: 18 train, 2 eval, 0 skipped" in out and "steps 27 (9 per epoch, 3.00 epochs)" in out
    assert "--rank 8 --alpha 32 (default)" in out and "warning only 3 optimizer steps" in out
    assert "about 20.0 MB" in out
    result = _run(monkeypatch, fake, "create", "--model", "tiny", "--dataset", "ds_1", "--plan")
    out = " ".join(result.output.split())
    assert result.exit_code == 0 and "rows 20: 18 train" in out and out.endswith("job job_1 queued")
