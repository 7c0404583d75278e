"""Helpers shared by the trainer tests: small chat and preference datasets and a recorder of a managed run's events
(SFT's run_sft, or any run with its events: DPO's run_dpo)."""

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file

from services.trainer.sft import Checkpoint, Finished, Log, Metrics, SftCheckpoint, Started, run_sft


PAIRS = [(1, 2), (3, 4), (5, 6), (7, 8), (2, 9), (4, 4), (6, 1), (8, 3), (9, 9), (5, 2)]


def chat_row(a: int, b: int) -> dict:
    return {
        "messages": [
            {"role": "user", "content": f"What is {a} plus {b}?"},
            {"role": "assistant", "content": f"The answer is {a + b}."},
        ]
    }


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


class RecordingRun:
    """Runs run_sft and keeps every event; checkpoints are copied (the run deletes its own after the event). Its stop
    flag counts the checks and turns true after a given step's metrics or at a given check."""

    def __init__(self, save_dir: Path, *, stop_after_step: int | None = None, stop_at_call: int | None = None,
                 runner=run_sft):
        self.save_dir, self.runner = save_dir, runner
        self.stop_after_step, self.stop_at_call = stop_after_step, stop_at_call
        self.stop_calls = 0
        self.total_steps: int | None = None
        self.info: dict = {}
        self.logs: list[tuple[str, str]] = []
        self.metrics: dict[int, dict[str, float]] = {}
        self.checkpoints: list[tuple[SftCheckpoint, bool, dict]] = []

    def is_set(self) -> bool:
        self.stop_calls += 1
        after_step = self.stop_after_step is not None and max(self.metrics, default=0) >= self.stop_after_step
        return after_step or self.stop_calls == self.stop_at_call

    def run(self, model_dir, dataset, hp, **kwargs) -> Finished:
        """runner(model_dir, dataset, hp, stop=self, **kwargs), every event recorded; its Finished event."""
        for event in self.runner(model_dir, dataset, hp, stop=self, **kwargs):
            match event:
                case Started(total_steps, info):
                    self.total_steps, self.info = total_steps, info
                case Log(message, level):
                    self.logs.append((level, message))
                case Metrics(step, metrics):
                    assert step not in self.metrics, f"metrics reported twice for step {step}"
                    self.metrics[step] = dict(metrics)
                case Checkpoint(ckpt, final, metrics):
                    dest = self.save_dir / f"step-{ckpt.step}{'-final' if final else ''}"
                    shutil.copytree(ckpt.root, dest)
                    self.checkpoints.append((SftCheckpoint(ckpt.step, dest), final, dict(metrics)))
                case Finished():
                    return event
        raise AssertionError("the run ended without Finished")

    def losses(self, key: str = "train/loss") -> dict[int, float]:
        return {step: m[key] for step, m in self.metrics.items() if key in m}

    def final_adapter(self) -> dict[str, torch.Tensor]:
        return self.final_weights("adapter_model.safetensors")

    def final_weights(self, name: str) -> dict[str, torch.Tensor]:
        """The tensors of the final checkpoint's weights/<name> (the adapter's, or a full model's file)."""
        ckpt, final, _ = self.checkpoints[-1]
        assert final
        return load_file(str(ckpt.weights_dir / name))


def preference_row(a: int, b: int) -> dict:
    """A prompt with a correct, polite answer (chosen) and a fixed refusal (rejected)."""
    return {"prompt": f"What is {a} plus {b}?", "chosen": f"The answer is {a + b}.",
            "rejected": "I will not tell you."}
