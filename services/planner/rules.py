"""The Training Agent's rules: from a task description, facts about the data and the models, a proposed job.

Every choice is a Choice(setting, value, why), so the plan a person approves says why each value is what it is, and
every rule is here, in plain code, to be read. Nothing in this module talks to a service: agent.py gathers the facts
(the dataset's rows and format, the scheduler's PlanJob, the models, measured throughput) and calls propose().

The rules, in short:
- method: the data decides (preference pairs -> DPO, prompts with ground truth and no answers -> RFT with a drafted
  evaluator, conversations or prompt/completion -> SFT); the description can only pick between what the data allows.
- base model: the one the description names, else the largest that fits the device's memory on GPUs / the smallest
  on CPUs (where time, not memory, is the limit).
- LoRA rank from the number of rows (small data needs little capacity), alpha 32 whatever the rank (so the learning
  rate does not depend on the rank), a learning rate from the model's hidden size (a wider model takes smaller
  steps; DPO a tenth, RL a half of SFT's).
- steps: enough passes to see 1000 examples (at least 3 epochs, at most 50), so a small data set is learned, not
  sampled five times; a held-out split for evaluation sized to the data (at least 2 rows, at most 500).
- max_seq_len: the longest row's tokens rounded up to a power of two, within the model's context.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

# Rows of the data set the rules look at (format, fields, lengths); the plan's numbers come from PlanJob over all.
SAMPLE_ROWS = 100  # PreviewDataset's most
TARGET_EXAMPLES = 1000
MIN_EPOCHS, MAX_EPOCHS = 3, 50
LR_AT_2000, LR_EXPONENT, LR_MIN, LR_MAX = 5e-4, 0.84, 1e-5, 5e-3
LORA_ALPHA = 32.0
GROUND_TRUTH_FIELDS = ("answer", "solution", "expected", "target", "label", "reference", "ground_truth", "output")


@dataclass(frozen=True)
class Choice:
    setting: str
    value: Any
    why: str


@dataclass(frozen=True)
class ModelFacts:
    name: str
    num_parameters: int
    hidden_size: int
    max_position_embeddings: int
    architecture: str = ""


@dataclass(frozen=True)
class DataFacts:
    format: str  # sft_chat | sft_prompt_completion | dpo | rft
    num_rows: int
    fields: tuple[str, ...]  # top-level keys seen in the sampled rows
    longest_row_chars: int
    rows: tuple[dict, ...] = ()  # a sample, for drafting the evaluator


@dataclass(frozen=True)
class DeviceFacts:
    kind: str  # "cpu" | "cuda"
    memory_bytes: int  # free memory of one device


@dataclass
class Proposal:
    method: str
    base_model: str
    settings: dict[str, Any]
    choices: list[Choice]
    evaluator_source: str = ""  # RFT: the drafted reward function, for the user to read, test and edit
    warnings: list[str] = field(default_factory=list)

    def why(self, setting: str) -> str:
        return next(c.why for c in self.choices if c.setting == setting)


class PlanningError(ValueError):
    """The facts allow no plan (no model fits, an empty data set...); the message says what to change."""


def propose(description: str, data: DataFacts, models: list[ModelFacts], device: DeviceFacts, *,
            base_model: str | None = None, method: str | None = None) -> Proposal:
    """A proposed job; base_model / method, when the user set them, are kept (and checked against the data)."""
    if data.num_rows < 2:
        raise PlanningError(f"the data set has {data.num_rows} row(s): at least 2 are needed (one to train on, one "
                            "to hold out)")
    choices: list[Choice] = []
    warnings: list[str] = []
    m, why = choose_method(description, data, method)
    choices.append(Choice("method", m, why))
    model, why = choose_model(description, models, device, base_model)
    choices.append(Choice("base_model", model.name, why))

    settings: dict[str, Any] = {}

    def put(setting: str, value: Any, why: str) -> None:
        settings[setting] = value
        choices.append(Choice(setting, value, why))

    rank = 8 if data.num_rows < 500 else 16 if data.num_rows < 5000 else 32
    put("lora_rank", rank, f"{data.num_rows} rows: rank {rank} (8 under 500 rows, 16 under 5,000, else 32); a small "
        "data set needs little adapter capacity, and a smaller adapter trains and serves faster")
    put("lora_alpha", LORA_ALPHA, "32 whatever the rank, so the effective step size does not change with the rank "
        "and the learning rate below carries over")
    base_lr = min(LR_MAX, max(LR_MIN, LR_AT_2000 * (2000 / model.hidden_size) ** LR_EXPONENT))
    scale, scale_why = {"sft": (1.0, ""), "dpo": (0.1, "; DPO takes a tenth of that (it diverges at SFT's step "
                                                       "size)"),
                        "rft": (0.5, "; RL takes half of that (noisier gradients)")}[m]
    lr = float(f"{base_lr * scale:.2g}")
    put("learning_rate", lr, f"LoRA rule {LR_AT_2000:g} x (2000 / hidden size {model.hidden_size}) ^ {LR_EXPONENT} = "
        f"{base_lr:.2g}, within [{LR_MIN:g}, {LR_MAX:g}]{scale_why}")

    if m == "rft":
        _rft_settings(data, put)
        source, why = draft_evaluator(description, data)
        choices.append(Choice("evaluator", "drafted", why))
        return Proposal(m, model.name, settings, choices, evaluator_source=source, warnings=warnings)

    eval_fraction, eval_rows = _held_out(data.num_rows)
    put("eval_fraction", eval_fraction, f"{eval_rows} of {data.num_rows} rows held out to measure generalization "
        "(at least 2, about 10% of small data sets, at most 500 rows)")
    train_rows = max(1, data.num_rows - eval_rows)
    batch = 4 if train_rows < 64 else 8 if train_rows < 1000 else 16
    put("batch_size", batch, f"{train_rows} training rows: {batch} rows per step (4 under 64 rows, 8 under 1,000, "
        "else 16)")
    epochs = min(MAX_EPOCHS, max(MIN_EPOCHS, math.ceil(TARGET_EXAMPLES / train_rows)))
    steps = max(1, math.ceil(epochs * train_rows / batch))
    put("max_steps", steps, f"{epochs} epoch(s) over {train_rows} rows at {batch} per step: enough passes to see "
        f"about {TARGET_EXAMPLES:,} examples (at least {MIN_EPOCHS} epochs, at most {MAX_EPOCHS})")
    if epochs >= 20:
        warnings.append(f"{train_rows} training rows are few: the plan runs {epochs} epochs, so watch the held-out "
                        "loss for overfitting (more rows would generalize better)")
    put("warmup_steps", max(1, steps // 20), "5% of the steps, so the first updates of a fresh adapter are small")
    put("lr_scheduler", "cosine", "cosine decay to the end of training")
    put("eval_every", max(1, steps // 10), "ten held-out evaluations over the run (for the overfitting check)")
    put("checkpoint_every", max(1, steps // 5), "five checkpoints over the run, to deploy an earlier one if later "
        "ones overfit")
    seq = max_seq_len(data, model)
    put("max_seq_len", seq, f"the longest sampled row is about {_tokens(data.longest_row_chars)} tokens: rounded up to "
        f"a power of two, within the model's context of {model.max_position_embeddings}")
    if m == "dpo":
        put("beta", 0.1, "the usual DPO strength: how far the policy may move from the base model")
    put("seed", 0, "fixed, so the run and its held-out split can be repeated")
    return Proposal(m, model.name, settings, choices, warnings=warnings)


def choose_method(description: str, data: DataFacts, wanted: str | None) -> tuple[str, str]:
    allowed = {"dpo": ("dpo",), "rft": ("rft",), "sft_chat": ("sft",), "sft_prompt_completion": ("sft",)}
    if data.format not in allowed:
        raise PlanningError(f"unknown data format {data.format!r}")
    options = allowed[data.format]
    if wanted:
        if wanted not in options:
            raise PlanningError(f"method {wanted!r} cannot train on {data.format} rows (it needs "
                                f"{_needs(wanted)}); this data set allows {', '.join(options)}")
        return wanted, f"you chose {wanted}; the {data.format} rows allow it"
    m = options[0]
    reasons = {
        "dpo": "the rows are preference pairs (prompt, chosen, rejected): DPO learns to prefer the chosen answers",
        "rft": "the rows hold prompts and ground-truth fields but no answers to imitate: reinforcement fine-tuning "
               "samples answers and rewards them with an evaluator checking the ground truth",
        "sft": "the rows hold the answers to imitate (conversations or prompt/completion pairs): supervised "
               "fine-tuning",
    }
    hint = ""
    text = description.lower()
    if m == "sft" and re.search(r"\b(prefer|preference|rank|better answer)", text):
        hint = " (the description speaks of preferences, but DPO needs chosen/rejected pairs, which these rows lack)"
    if m == "sft" and re.search(r"\b(reward|verif|correct answer|grade)", text):
        hint = (" (the description speaks of rewards, but these rows already hold answers; RL would need rows "
                "with a prompt and a ground-truth field)")
    return m, reasons[m] + hint


def _needs(method: str) -> str:
    return {"dpo": "prompt/chosen/rejected rows", "rft": "prompt rows with ground-truth fields",
            "sft": "conversations or prompt/completion rows"}.get(method, "another format")


def choose_model(description: str, models: list[ModelFacts], device: DeviceFacts,
                 wanted: str | None) -> tuple[ModelFacts, str]:
    if not models:
        raise PlanningError("no base model is available to this account: import one (trainyard models import)")
    by_name = {m.name: m for m in models}
    if wanted:
        if wanted not in by_name:
            raise PlanningError(f"base model {wanted!r} is not available; available: {', '.join(sorted(by_name))}")
        return by_name[wanted], "you chose it"
    text = description.lower()
    named = [m for m in models if m.name.lower() in text]
    if named:
        pick = max(named, key=lambda m: len(m.name))
        return pick, f"the description names {pick.name}"
    fitting = [m for m in models if lora_memory_bytes(m) <= 0.8 * device.memory_bytes] or []
    if not fitting:
        smallest = min(models, key=lambda m: m.num_parameters)
        raise PlanningError(f"no model fits one device's {device.memory_bytes / 2**30:.1f} GiB for LoRA training "
                            f"(the smallest, {smallest.name}, needs about "
                            f"{lora_memory_bytes(smallest) / 2**30:.1f} GiB)")
    dense = [m for m in fitting if "moe" not in m.architecture.lower() and "deepseek" not in m.architecture.lower()]
    pool = dense or fitting
    if device.kind == "cpu":
        pick = min(pool, key=lambda m: m.num_parameters)
        return pick, (f"the smallest {'dense ' if dense else ''}model available ({pick.num_parameters:,} parameters): "
                      "training runs on CPUs, where time is the limit")
    pick = max(pool, key=lambda m: m.num_parameters)
    return pick, (f"the largest {'dense ' if dense else ''}model whose LoRA training fits 80% of one device's "
                  f"{device.memory_bytes / 2**30:.0f} GiB ({pick.num_parameters:,} parameters)")


def lora_memory_bytes(model: ModelFacts) -> int:
    """A first guess before PlanJob's exact estimate: bf16 weights plus a third for activations and the adapter."""
    return int(model.num_parameters * 2 * 4 / 3)


def max_seq_len(data: DataFacts, model: ModelFacts) -> int:
    need = max(64, _tokens(data.longest_row_chars))
    return min(model.max_position_embeddings or 2048, 1 << math.ceil(math.log2(need)))


def _tokens(chars: int) -> int:
    """About 4 characters per token (English text, BPE tokenizers): used before the tokenizer has counted."""
    return math.ceil(chars / 4) + 16


def _held_out(rows: int) -> tuple[float, int]:
    eval_rows = min(500, max(2, round(rows * 0.1)))
    eval_rows = min(eval_rows, rows - 1)
    return round(eval_rows / rows, 4), eval_rows


def _rft_settings(data: DataFacts, put) -> None:
    group = 8
    prompts = 8 if data.num_rows >= 8 else data.num_rows
    steps = min(200, max(20, math.ceil(2 * data.num_rows / prompts)))
    put("prompts_per_step", prompts, "8 prompts per step (all of them when there are fewer)")
    put("group_size", group, "8 samples per prompt: the group whose rewards are compared (GRPO's advantage)")
    put("steps", steps, f"about two passes over {data.num_rows} prompts (at least 20 steps, at most 200)")
    put("loss", "grpo", "GRPO: group-relative advantages, no value model")
    put("max_tokens", 128, "answers of up to 128 tokens")
    put("checkpoint_every", max(1, steps // 5), "five checkpoints over the run")


def draft_evaluator(description: str, data: DataFacts) -> tuple[str, str]:
    """A reward function for the user to read, test on rows and edit: it compares the completion with the rows'
    ground-truth field, numerically when that field holds numbers."""
    truth = next((f for f in GROUND_TRUTH_FIELDS if f in data.fields), None)
    if truth is None:
        extra = [f for f in data.fields if f not in ("prompt", "messages")]
        if not extra:
            raise PlanningError("RFT needs a field with the expected answer (e.g. 'answer') next to each prompt; "
                                "these rows have none, so no evaluator can be drafted")
        truth = extra[0]
    values = [r.get(truth) for r in data.rows if truth in r]
    numeric = bool(values) and all(_is_number(v) for v in values)
    contains = bool(re.search(r"\b(contain|mention|include)", description.lower()))
    if numeric:
        body = f'''    """1.0 when the last number in the completion equals row["{truth}"] (within 1e-6), else 0.0."""
    numbers = re.findall(r"-?\\d+(?:\\.\\d+)?", completion.replace(",", ""))
    if not numbers:
        return 0.0
    return 1.0 if abs(float(numbers[-1]) - float(row["{truth}"])) <= 1e-6 else 0.0
'''
        why = f"the rows' {truth!r} field holds numbers: reward 1 when the completion's last number equals it"
    elif contains:
        body = f'''    """1.0 when the completion contains row["{truth}"] (case-insensitive), else 0.0."""
    return 1.0 if str(row["{truth}"]).strip().lower() in completion.lower() else 0.0
'''
        why = (f"the description asks for answers that contain something: reward 1 when the completion contains "
               f"the rows' {truth!r} field")
    else:
        body = f'''    """1.0 when the completion, trimmed and case-folded, equals row["{truth}"]; 0.5 when it starts with it."""
    got = " ".join(completion.split()).lower()
    want = " ".join(str(row["{truth}"]).split()).lower()
    if got == want:
        return 1.0
    return 0.5 if got.startswith(want) else 0.0
'''
        why = f"reward 1 for an answer equal to the rows' {truth!r} field (0.5 when it only starts with it)"
    source = ("import re\n\n\n" if numeric else "") + \
        f"def reward_fn(completion: str, row: dict) -> float:\n{body}"
    return source, why + "; read it, test it on rows and edit it before approving"


def _is_number(value: Any) -> bool:
    if isinstance(value, bool):
        return False
    if isinstance(value, (int, float)):
        return True
    try:
        float(str(value).replace(",", ""))
        return True
    except ValueError:
        return False
