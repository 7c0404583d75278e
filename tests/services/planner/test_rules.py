"""The Training Agent's rules (services/planner/rules.py) and run diagnosis (diagnose.py), on facts alone."""
from __future__ import annotations

import json
from dataclasses import dataclass, field

import pytest

from services.planner import rules
from services.planner.diagnose import diagnose
from trainyard.localstack import ROOT

TINY = rules.ModelFacts("tiny-qwen3", 918_912, 128, 2048, "Qwen3ForCausalLM")
TINY_MOE = rules.ModelFacts("tiny-qwen3-moe", 1_364_352, 128, 2048, "Qwen3MoeForCausalLM")
BIG = rules.ModelFacts("Qwen3-8B", 8_190_735_360, 4096, 40960, "Qwen3ForCausalLM")
CPU = rules.DeviceFacts("cpu", 16 * 2**30)
H200 = rules.DeviceFacts("cuda", 141 * 2**30)


def _facts(path) -> rules.DataFacts:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    fmt = "dpo" if "chosen" in rows[0] else "sft_chat" if "messages" in rows[0] else "sft_prompt_completion"
    return rules.DataFacts(fmt, len(rows), tuple(sorted({k for r in rows for k in r})),
                           max(len(json.dumps(r)) for r in rows), tuple(rows[:20]))


def test_sample_chat_data_gets_an_sft_plan_that_trains_long_enough():
    data = _facts(ROOT / "examples" / "data" / "sft_demo.jsonl")
    p = rules.propose("Answer questions about Trainyard like our support team", data, [TINY, TINY_MOE, BIG], CPU)
    assert (p.method, p.base_model) == ("sft", "tiny-qwen3")
    assert "smallest dense model" in p.why("base_model") and "CPUs" in p.why("base_model")
    s = p.settings
    assert s["lora_rank"] == 8 and s["lora_alpha"] == 32.0
    # 5e-4 x (2000/128)^0.84 = 5.0e-3: the rate the demo's tiny model learns its 18 rows at
    assert s["learning_rate"] == pytest.approx(5.0e-3, rel=0.02)
    eval_rows = round(data.num_rows * s["eval_fraction"])
    assert eval_rows == 2
    train_rows = data.num_rows - eval_rows
    # Not "1 epoch = 5 steps": enough passes to see ~1000 examples, capped at 50 epochs.
    assert s["max_steps"] == -(-50 * train_rows // s["batch_size"]) and s["max_steps"] >= 100
    assert any("overfitting" in w for w in p.warnings)
    assert s["warmup_steps"] >= 1 and s["eval_every"] >= 1 and s["max_seq_len"] in (64, 128, 256, 512)
    for c in p.choices:  # every choice has its reason
        assert c.why and len(c.why) > 10, c


def test_preference_pairs_get_dpo_with_a_smaller_learning_rate():
    data = _facts(ROOT / "examples" / "data" / "dpo_polite.jsonl")
    sft = rules.propose("be polite", _facts(ROOT / "examples" / "data" / "sft_demo.jsonl"), [TINY], CPU)
    p = rules.propose("Prefer polite answers", data, [TINY], CPU)
    assert p.method == "dpo" and "preference pairs" in p.why("method")
    assert p.settings["learning_rate"] == pytest.approx(sft.settings["learning_rate"] / 10, rel=0.05)
    assert p.settings["beta"] == 0.1


def test_prompts_with_numeric_answers_get_rft_and_an_evaluator_that_scores_them():
    rows = tuple({"prompt": f"What is {a} + {b}?", "answer": a + b} for a in range(5) for b in range(4))
    data = rules.DataFacts("rft", len(rows), ("answer", "prompt"), 40, rows)
    p = rules.propose("Solve arithmetic word problems correctly", data, [TINY], CPU)
    assert p.method == "rft" and "ground-truth" in p.why("method")
    assert p.settings["group_size"] == 8 and p.settings["loss"] == "grpo" and 20 <= p.settings["steps"] <= 200
    scope: dict = {}
    exec(compile(p.evaluator_source, "evaluator.py", "exec"), scope)  # plain Python, as the sandbox runs it
    reward = scope["reward_fn"]
    assert reward("2 + 3 = 5", {"answer": 5}) == 1.0
    assert reward("the answer is 1,000", {"answer": "1000"}) == 1.0
    assert reward("6", {"answer": 5}) == 0.0 and reward("no idea", {"answer": 5}) == 0.0
    assert "'answer' field holds numbers" in p.why("evaluator")


def test_text_answers_get_an_exact_or_contains_evaluator():
    rows = ({"prompt": "Capital of France?", "answer": "Paris"}, {"prompt": "Capital of Spain?", "answer": "Madrid"})
    data = rules.DataFacts("rft", 2, ("answer", "prompt"), 40, rows)
    exact = rules.propose("Answer capitals", data, [TINY], CPU)
    scope: dict = {}
    exec(exact.evaluator_source, scope)
    assert scope["reward_fn"]("  paris ", {"answer": "Paris"}) == 1.0
    assert scope["reward_fn"]("Paris, of course", {"answer": "Paris"}) == 0.5
    contains = rules.propose("Answers must mention the capital", data, [TINY], CPU)
    scope = {}
    exec(contains.evaluator_source, scope)
    assert scope["reward_fn"]("I think it is Paris.", {"answer": "Paris"}) == 1.0
    nothing = rules.DataFacts("rft", 2, ("prompt",), 20, ({"prompt": "a"}, {"prompt": "b"}))
    with pytest.raises(rules.PlanningError, match="expected answer"):
        rules.propose("x", nothing, [TINY], CPU)


def test_model_choice_follows_the_description_then_the_device():
    data = _facts(ROOT / "examples" / "data" / "sft_demo.jsonl")
    assert rules.propose("fine-tune Qwen3-8B on this", data, [TINY, BIG], CPU).base_model == "Qwen3-8B"
    gpu = rules.propose("support answers", data, [TINY, BIG], H200)
    assert gpu.base_model == "Qwen3-8B" and "largest dense model" in gpu.why("base_model")
    assert gpu.settings["learning_rate"] < 5e-4  # a wider model takes smaller steps
    with pytest.raises(rules.PlanningError, match="no model fits"):
        rules.propose("x", data, [BIG], rules.DeviceFacts("cuda", 8 * 2**30))
    with pytest.raises(rules.PlanningError, match="base model 'nope' is not available"):
        rules.propose("x", data, [TINY], CPU, base_model="nope")


def test_the_user_method_must_fit_the_data():
    data = _facts(ROOT / "examples" / "data" / "sft_demo.jsonl")
    with pytest.raises(rules.PlanningError, match="method 'dpo' cannot train on sft_chat rows"):
        rules.propose("x", data, [TINY], CPU, method="dpo")
    with pytest.raises(rules.PlanningError, match="at least 2 are needed"):
        rules.propose("x", rules.DataFacts("sft_chat", 1, ("messages",), 10), [TINY], CPU)
    hinted = rules.propose("prefer the better answer", data, [TINY], CPU)
    assert hinted.method == "sft" and "DPO needs chosen/rejected pairs" in hinted.why("method")


@dataclass
class P:
    step: int
    values: dict = field(default_factory=dict)


def test_diagnosis_names_overfitting_divergence_and_no_learning():
    # The run the issue describes: eval loss rose 7.2 -> 7.4 while the train loss fell to 0.07.
    overfit = [P(s, {"train/loss": 7.5 - s * 0.074}) for s in range(1, 101)]
    overfit += [P(10, {"eval/loss": 7.2}), P(50, {"eval/loss": 7.3}), P(100, {"eval/loss": 7.4})]
    d = diagnose(overfit)
    assert d.problems == ["overfitting"] and "step 10" in d.messages[0] and d.best_eval_step == 10
    flat = [P(s, {"train/loss": 3.0 + (s % 3) * 0.01}) for s in range(1, 41)]
    assert diagnose(flat).problems == ["not learning"]
    plateau = [P(s, {"train/loss": 2.0}) for s in range(1, 10)] + [P(2, {"eval/loss": 2.0}), P(9, {"eval/loss": 2.1})]
    assert "overfitting" not in diagnose(plateau).problems  # the held-out loss rose, but training did not fall
    assert diagnose([P(1, {"train/loss": 2.0}), P(2, {"train/loss": float("nan")})]).problems == ["diverging"]
    assert diagnose([P(1, {"train/loss": 2.0}), P(2, {"train/loss": 3.5})]).problems == ["diverging"]
    good = [P(s, {"train/loss": 3.0 / s}) for s in range(1, 41)] + [P(20, {"eval/loss": 2.0}), P(40, {"eval/loss": 1.9})]
    g = diagnose(good)
    assert g.problems == [] and g.final_eval_loss == 1.9 and g.final_train_loss == pytest.approx(0.075)
