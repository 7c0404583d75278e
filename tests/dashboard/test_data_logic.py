"""The data pages' logic without services: the agent's plan as the Describe-and-plan page shows and edits it (built
by the agent's own rules on facts, priced by hand), the Train page's notes and error placement, token statistics in
words."""
from __future__ import annotations

import pytest

from dashboard import logic, logic_plan
from services.planner import rules
from services.planner.agent import AgentPlan, Estimate, Throughput
from trainyard.errors import FieldError
from trainyard.methods import METHODS
from trainyard.methods.spec import format_value
from trainyard.v1 import scheduler_pb2 as pb

TINY = rules.ModelFacts("tiny-qwen3", 918_912, 128, 2048, "Qwen3ForCausalLM")
CPU = rules.DeviceFacts("cpu", 16 * 2**30)


def _plan(fmt: str = "sft_chat", rows=(), throughput: Throughput | None = None) -> AgentPlan:
    rows = rows or tuple({"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": "a"}]}
                         for i in range(20))
    data = rules.DataFacts(fmt, len(rows), tuple(sorted({k for r in rows for k in r})), 80, tuple(rows))
    proposal = rules.propose("Answer questions", data, [TINY], CPU)
    seconds = 30.0 if throughput else None
    return AgentPlan("Answer questions", "ds_1", proposal,
                     Estimate(proposal.settings.get("max_steps", 0), 18, 2, 48_510, 20_000, 26 * 2**20, "cpu", seconds,
                              None, throughput))


def test_the_plan_shows_every_choice_with_its_reason_by_its_declared_label():
    plan = _plan()
    frame = logic_plan.choices_frame(plan)
    sft = {f.name: f.setting.label for f in METHODS["sft"].fields()}
    assert list(frame["setting"]) == [sft[c.setting] for c in plan.proposal.choices
                                      if c.setting not in ("method", "base_model")]
    assert all(frame["why"].str.len() > 0)
    assert logic_plan.headline(plan)[0].startswith("**Method: Supervised fine-tuning (LoRA)** — the rows hold")
    metrics = dict(logic_plan.estimate_metrics(plan))
    assert metrics["Time"] == "not measured yet" and metrics["Cost"] == "no price set"
    assert metrics["Rows (train / held out)"] == "18 / 2" and metrics["Memory"] == "26.0 MiB (cpu)"
    assert "Measure the speed" in logic_plan.estimate_note(plan)
    measured = _plan(throughput=Throughput(1500.0, 2.0, "job job_1 (x)"))
    assert dict(logic_plan.estimate_metrics(measured))["Time"] == "30 s"
    assert "1,500 target tokens/s measured on job job\\_1 (x)" in logic_plan.estimate_note(measured)
    # A price without a measured speed has no cost yet: it says what is missing, not that no price was set.
    assert dict(logic_plan.estimate_metrics(plan, price=2.0))["Cost"] == "needs the time"
    pairs = _plan(throughput=Throughput(3.5, 2.0, "job job_2 (y)", "pairs"))
    assert "3.50 pairs/s measured on job job\\_2 (y)" in logic_plan.estimate_note(pairs)


def test_rft_plans_show_prompts_and_say_when_their_time_shows():
    rows = tuple({"prompt": f"What is {a}+{a}?", "answer": 2 * a} for a in range(8))
    plan = _plan("rft", rows)
    metrics = dict(logic_plan.estimate_metrics(plan))
    assert metrics["Rows"] == "18 prompts" and metrics["Prompt tokens"] == "48,510" and "Memory" in metrics
    assert "same prompts per step, group size and max tokens" in logic_plan.estimate_note(plan)


def test_edits_are_read_back_by_their_declared_types_and_bounds():
    plan = _plan()
    texts = {name: format_value(plan.settings[name]) for name in logic_plan.editable(plan)}
    assert logic_plan.read_edits(plan, texts) == ({}, [])  # nothing changed
    changed, problems = logic_plan.read_edits(plan, {**texts, "max_steps": " 7 ", "learning_rate": "0.002",
                                                     "lr_scheduler": "linear"})
    assert changed == {"max_steps": 7, "learning_rate": 0.002, "lr_scheduler": "linear"} and not problems
    changed, problems = logic_plan.read_edits(plan, {**texts, "max_steps": "seven", "learning_rate": "2",
                                                     "lr_scheduler": "step", "lora_rank": "1.5"})
    assert changed == {}
    assert sorted(problems) == [("LR schedule", "must be one of cosine, linear, constant, got 'step'"),
                                ("Learning rate", "must be > 0 and < 1, got 2"),
                                ("LoRA rank", "not a whole number: '1.5'"),
                                ("Max steps", "not a whole number: 'seven'")]


def test_rft_plans_edit_everything_but_the_evaluator_which_is_edited_as_source():
    rows = tuple({"prompt": f"What is {a}+{a}?", "answer": 2 * a} for a in range(8))
    plan = _plan("rft", rows)
    assert plan.method == "rft" and "evaluator" not in logic_plan.editable(plan)
    assert "def reward_fn" in plan.proposal.evaluator_source
    assert rules.truth_field(("answer", "prompt")) == "answer" and rules.truth_field(("prompt", "x")) == "x"
    with pytest.raises(rules.PlanningError, match="expected answer"):
        rules.truth_field(("prompt",))


def test_train_page_names_other_formats_and_places_each_error_once():
    ds = [pb.Dataset(id=f"ds_{i}", name=n, format=f) for i, (n, f) in enumerate(
        (("chat", pb.DATASET_FORMAT_SFT_CHAT), ("prefs", pb.DATASET_FORMAT_DPO), ("sums", pb.DATASET_FORMAT_RFT)))]
    note = logic.other_formats_note(ds, METHODS["sft"])
    assert note == ("Not listed for this method: 1 dpo dataset (prefs): choose Direct preference optimization (LoRA or "
                    "full-parameter); 1 rft dataset (sums): choose Reinforcement fine-tuning (LoRA or "
                    "full-parameter).")
    assert logic.other_formats_note(ds[1:2], METHODS["dpo"]) == ""
    sft = METHODS["sft"]
    violations = [FieldError("spec.sft.learning_rate", "must be > 0"), FieldError("spec.sft.lora.rank", "too big"),
                  FieldError("spec.priority", "out of range")]
    placed, rest = logic.place_violations(violations, sft, {"learning_rate": None, "lora_rank": None})
    assert placed == {"learning_rate": ["must be > 0"], "lora_rank": ["too big"]}
    assert [v.field for v in rest] == ["spec.priority"]


def test_token_statistics_in_words():
    stats = pb.TokenStats(base_model="tiny-qwen3", rows=20, mean_tokens=41.25, p95_tokens=60, max_tokens=64,
                          max_seq_len=48, over_max_seq_len=3, counted="every token")
    summary, fit = logic.token_stats_lines(stats)
    assert "**20** rows" in summary and "**41.2** tokens on average" in summary and "**60**" in summary
    assert fit.startswith("**3** rows (15%) are longer than max_seq_len = 48")
    fits = logic.token_stats_lines(pb.TokenStats(rows=2, max_seq_len=2048))[1]
    assert fits == "Every row fits in max_seq_len = 2,048 tokens."
