"""The Training API examples (examples/*.py) keep running: each with a few steps, two against the test stack (their
main(), in this process, with TRAINYARD_TRAINER_URL set) and one as a user runs it, `python examples/sft_loop.py`,
starting its own embedded stack (SQLite, local processes). They check what each prints, not how well it learns
(the full runs and their numbers are in examples/results/README.md), except that a few steps must already move the
SFT loss and the DPO margin the right way.
"""
from __future__ import annotations

import csv
import importlib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.fixture()
def example(stack, api_key, monkeypatch, tmp_path, capsys):
    """main() of an example module, run against the test stack; returns (exit code, what it printed)."""
    monkeypatch.setenv("TRAINYARD_TRAINER_URL", stack.url("trainer"))
    monkeypatch.setenv("TRAINYARD_ROLLOUT_URL", stack.url("rollout"))
    monkeypatch.setenv("TRAINYARD_API_KEY", api_key)
    monkeypatch.setenv("TRAINYARD_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.syspath_prepend(str(EXAMPLES))

    def run(name: str, *argv: str) -> tuple[int, str]:
        module = importlib.import_module(name)
        code = module.main(list(argv))
        return code, capsys.readouterr().out
    return run


def numbers(pattern: str, text: str) -> list[float]:
    return [float(x) for x in re.findall(pattern, text)]


def test_grpo_arithmetic(example, tmp_path):
    curve = tmp_path / "curve.csv"
    code, out = example("grpo_arithmetic", "--steps", "3", "--warmup-steps", "3", "--prompts", "8",
                        "--group-size", "4", "--out", str(curve))
    assert code == 0, out
    assert len(numbers(r"warm-up \d+/3: loss ([\d.]+)", out)) == 3
    rewards = numbers(r"step +\d+  mean reward ([\d.]+)", out)
    assert len(rewards) == 3 and all(0.0 <= r <= 1.0 for r in rewards), out
    assert "greedy accuracy on the 50 GRPO problems before GRPO" in out and "after GRPO" in out
    with open(curve) as f:
        rows = list(csv.DictReader(f))
    assert [int(r["step"]) for r in rows] == [0, 1, 2]
    assert [float(r["mean_reward"]) for r in rows] == pytest.approx(rewards, abs=1e-3)


def test_grpo_reward_fn():
    sys.path.insert(0, str(EXAMPLES))
    try:
        from grpo_arithmetic import problems, reward_fn
    finally:
        sys.path.remove(str(EXAMPLES))
    row = {"prompt": "3+4=", "answer": 7}
    assert [reward_fn(c, row) for c in ("7", " 7 apples", "17", "x7y8", "seven", "", "8 7")] == [
        1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.0]
    warmup, rl = problems(0)
    assert len(warmup) == len(rl) == 50 and not {r["prompt"] for r in warmup} & {r["prompt"] for r in rl}


def test_dpo_loop(example):
    code, out = example("dpo_loop", "--steps", "3")
    assert code == 0, out
    margins = numbers(r"step +\d+  dpo loss [\d.]+  margin ([+-][\d.]+)", out)
    losses = numbers(r"step +\d+  dpo loss ([\d.]+)", out)
    assert len(margins) == 3 and margins[0] == 0.0 and losses[0] == pytest.approx(0.6931, abs=1e-4)  # policy = ref
    assert margins[-1] > margins[0] and losses[-1] < losses[0], out
    assert "held-out pairs" in out


def test_sft_loop_as_a_script_with_its_own_stack(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINYARD_")}
    env |= {"TRAINYARD_CACHE_DIR": str(tmp_path / "cache"), "TRAINYARD_TORCH_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(EXAMPLES / "sft_loop.py"), "--steps", "4", "--work-dir",
                           str(tmp_path / "stack")], env=env, cwd=tmp_path, capture_output=True, text=True,
                          timeout=300)
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    assert "embedded stack up" in out
    losses = numbers(r"step +\d+  loss ([\d.]+)", out)
    assert len(losses) == 4 and losses[-1] < losses[0], out
    assert "trained weights published for sampling as trainyard://weights/" in out
    assert len(re.findall(r"^  A: ", out, flags=re.M)) == 5
