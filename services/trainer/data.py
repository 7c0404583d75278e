"""Training data of the managed methods: JSONL rows -> token ids + loss masks, the train/eval split, and seeded
micro-batches. SFT's examples are one sequence each; DPO's (PreferencePair) are two, the chosen and the rejected
response to one prompt, whose micro-batches pack chosen_0, rejected_0, chosen_1, rejected_1, ... (collate_pairs).

Shapes: a micro-batch is one row (B = 1) of N tokens: its examples back to back, padding-free (models' Packing: each
example attends only to itself, positions restart at 0); inputs are an example's tokens 0..n-2, targets 1..n-1.

Which examples an optimizer step sees is a pure function of (seed, step): epoch e visits the train split in the
order of the (e+1)-th permutation drawn from a torch.Generator seeded with the seed, and each step takes the next
batch_size * gradient_accumulation_steps examples of it (the last step of an epoch takes what is left). So a resumed
run needs only the step to continue exactly where an uninterrupted run would be.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import PreTrainedTokenizerBase

from kernels import Packing
from models.chat import SftExample, tokenize_preference_response, tokenize_sft_example

IGNORE_INDEX = -100  # target id of positions that carry no loss (prompt tokens, padding)


def read_jsonl(source: Path | bytes) -> list[dict]:
    """The rows of an already validated JSONL dataset (a file, or its bytes; blank lines are skipped)."""
    if isinstance(source, bytes):
        return [json.loads(line) for line in source.decode("utf-8-sig").splitlines() if line.strip()]
    with open(source, encoding="utf-8-sig") as f:
        return [json.loads(line) for line in f if line.strip()]


def num_targets(example: SftExample) -> int:
    # Token 0 has no preceding token to predict it from, so its mask bit never counts.
    return sum(example.loss_mask[1:])


def tokenize_rows(
    tokenizer: PreTrainedTokenizerBase, rows: list[dict], max_seq_len: int
) -> tuple[list[SftExample], int]:
    """Tokenize every row; returns the examples that keep at least one target token after truncation to
    max_seq_len, and how many rows were dropped for having none."""
    kept: list[SftExample] = []
    for i, row in enumerate(rows):
        try:
            example = tokenize_sft_example(tokenizer, row, max_seq_len)
        except ValueError as e:
            raise ValueError(f"dataset row {i + 1}: {e}") from None
        if num_targets(example) > 0:
            kept.append(example)
    return kept, len(rows) - len(kept)


def split_train_eval(
    examples: list[SftExample], eval_fraction: float, seed: int
) -> tuple[list[SftExample], list[SftExample]]:
    """Seeded random split; at least one eval example when eval_fraction > 0 and there are two or more examples,
    and always at least one train example. Both splits keep the file order."""
    n = len(examples)
    n_eval = 0 if eval_fraction <= 0 or n < 2 else min(n - 1, max(1, round(n * eval_fraction)))
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    eval_idx = set(perm[:n_eval])
    train = [ex for i, ex in enumerate(examples) if i not in eval_idx]
    held_out = [ex for i, ex in enumerate(examples) if i in eval_idx]
    return train, held_out


@dataclass
class SftData:
    train: list[SftExample]
    eval: list[SftExample]
    num_rows: int
    skipped: int  # rows with no target token left after truncation to max_seq_len


def load_sft_data(
    path: Path, tokenizer: PreTrainedTokenizerBase, *, max_seq_len: int, eval_fraction: float, seed: int
) -> SftData:
    rows = read_jsonl(path)
    if not rows:
        raise ValueError(f"The dataset {path.name} has no rows")
    examples, skipped = tokenize_rows(tokenizer, rows, max_seq_len)
    if not examples:
        raise ValueError(
            f"None of the {len(rows)} dataset rows has an assistant/completion token within max_seq_len="
            f"{max_seq_len} tokens, so there is nothing to train on; raise max_seq_len or shorten the prompts"
        )
    train, held_out = split_train_eval(examples, eval_fraction, seed)
    return SftData(train=train, eval=held_out, num_rows=len(rows), skipped=skipped)


@dataclass
class MicroBatch:
    input_ids_BT: torch.Tensor  # [1, N]: the examples back to back (padding-free), see packing
    targets_BT: torch.Tensor  # the next token where it is a target, else IGNORE_INDEX (also at each example's end)
    num_targets: int
    packing: Packing  # where each example starts: attention stays inside it, positions restart at 0


def collate(examples: list[SftExample]) -> MicroBatch:
    """The examples packed into one row, no padding: example i's inputs are its tokens 0..n-2 and its targets tokens
    1..n-1 (IGNORE_INDEX where the loss mask is 0), so no target crosses into the next example."""
    inputs, targets, lengths = [], [], []
    for ex in examples:
        inputs += ex.input_ids[:-1]
        targets += [tok if m else IGNORE_INDEX for tok, m in zip(ex.input_ids[1:], ex.loss_mask[1:])]
        lengths.append(len(ex.input_ids) - 1)
    return MicroBatch(torch.tensor([inputs]), torch.tensor([targets]), sum(num_targets(ex) for ex in examples),
                      Packing.from_lengths(lengths))


def batches(examples: list, batch_size: int, collate=collate) -> list[MicroBatch]:
    """Consecutive micro-batches of batch_size (the last may be smaller), e.g. for evaluation."""
    return [collate(examples[i : i + batch_size]) for i in range(0, len(examples), batch_size)]


class StepSampler:
    """The micro-batches of each optimizer step, from the step number alone (see the module docstring). train: SFT
    examples (collate) or preference pairs (collate_pairs)."""

    def __init__(self, train: list, *, batch_size: int, grad_accum: int, seed: int, collate=collate):
        assert train, "the train split is never empty"
        self.train, self.batch_size, self.seed, self.collate = train, batch_size, seed, collate
        self.examples_per_step = batch_size * grad_accum
        self.steps_per_epoch = math.ceil(len(train) / self.examples_per_step)
        self._epoch, self._order = -1, []

    def _epoch_order(self, epoch: int) -> list[int]:
        if epoch != self._epoch:
            generator = torch.Generator().manual_seed(self.seed)
            for _ in range(epoch + 1):
                order = torch.randperm(len(self.train), generator=generator)
            self._epoch, self._order = epoch, order.tolist()
        return self._order

    def step_batches(self, step: int) -> list[MicroBatch]:
        epoch, k = divmod(step, self.steps_per_epoch)
        idx = self._epoch_order(epoch)[k * self.examples_per_step : (k + 1) * self.examples_per_step]
        return batches([self.train[i] for i in idx], self.batch_size, self.collate)


# -- preference pairs (DPO) --------------------------------------------------------------------------------------
@dataclass
class PreferencePair:
    chosen: SftExample  # the prompt + the chosen response; loss mask on the response's tokens
    rejected: SftExample


def tokenize_pairs(tokenizer: PreTrainedTokenizerBase, rows: list[dict],
                   max_seq_len: int) -> tuple[list[PreferencePair], int]:
    """Tokenize every {"prompt", "chosen", "rejected"} row; returns the pairs whose two responses both keep at least
    one target token after truncation to max_seq_len, and how many rows were dropped for lacking one."""
    kept: list[PreferencePair] = []
    for i, row in enumerate(rows):
        try:
            pair = PreferencePair(*(tokenize_preference_response(tokenizer, row["prompt"], row[key], max_seq_len)
                                    for key in ("chosen", "rejected")))
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"dataset row {i + 1}: {e}") from None
        if num_targets(pair.chosen) > 0 and num_targets(pair.rejected) > 0:
            kept.append(pair)
    return kept, len(rows) - len(kept)


@dataclass
class PreferenceData:
    train: list[PreferencePair]
    eval: list[PreferencePair]
    num_rows: int
    skipped: int  # rows with a response that keeps no target token within max_seq_len


def load_preference_data(path: Path, tokenizer: PreTrainedTokenizerBase, *, max_seq_len: int, eval_fraction: float,
                         seed: int) -> PreferenceData:
    rows = read_jsonl(path)
    if not rows:
        raise ValueError(f"The dataset {path.name} has no rows")
    pairs, skipped = tokenize_pairs(tokenizer, rows, max_seq_len)
    if not pairs:
        raise ValueError(
            f"None of the {len(rows)} dataset rows keeps a token of both responses within max_seq_len={max_seq_len} "
            "tokens, so there is nothing to train on; raise max_seq_len or shorten the prompts"
        )
    train, held_out = split_train_eval(pairs, eval_fraction, seed)
    return PreferenceData(train=train, eval=held_out, num_rows=len(rows), skipped=skipped)


def collate_pairs(pairs: list[PreferencePair]) -> MicroBatch:
    """The pairs' sequences packed into one row (collate): chosen_0, rejected_0, chosen_1, rejected_1, ..., so
    sequence 2i is pair i's chosen response and 2i + 1 its rejected one."""
    return collate([ex for pair in pairs for ex in (pair.chosen, pair.rejected)])
