"""SFT data preparation (services/trainer/data.py): tokenizing, skipping, splitting, ordering and collating."""

import pytest
import torch
from trainer_helpers import PAIRS, chat_row, write_jsonl

from models.chat import SftExample
from models.tokenizer import load_tokenizer
from services.trainer.data import (
    IGNORE_INDEX,
    StepSampler,
    collate,
    load_sft_data,
    split_train_eval,
    tokenize_rows,
)


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return load_tokenizer(tiny_model_dir)


def fake_examples(n: int) -> list[SftExample]:
    return [SftExample(input_ids=[i, i + 1, i + 2], loss_mask=[0, 1, 1]) for i in range(n)]


def test_split_sizes_follow_eval_fraction():
    ex = fake_examples(20)
    assert [len(s) for s in split_train_eval(ex, 0.0, seed=0)] == [20, 0]
    assert [len(s) for s in split_train_eval(ex, 0.1, seed=0)] == [18, 2]
    assert [len(s) for s in split_train_eval(fake_examples(2), 0.01, seed=0)] == [1, 1]  # at least one eval
    assert [len(s) for s in split_train_eval(fake_examples(1), 0.4, seed=0)] == [1, 0]  # never an empty train


def test_split_is_seeded_and_disjoint():
    ex = fake_examples(30)
    train, held_out = split_train_eval(ex, 0.2, seed=3)
    train2, held_out2 = split_train_eval(ex, 0.2, seed=3)
    _, held_out_other = split_train_eval(ex, 0.2, seed=4)
    assert train == train2 and held_out == held_out2
    assert held_out != held_out_other
    assert sorted(e.input_ids[0] for e in train + held_out) == list(range(30))


def test_every_epoch_visits_each_example_once_in_a_fresh_order():
    train = fake_examples(10)
    sampler = StepSampler(train, batch_size=2, grad_accum=2, seed=0)
    assert sampler.steps_per_epoch == 3  # 4 + 4 + 2 examples

    def epoch_ids(epoch: int) -> list[int]:
        ids = []
        for step in range(epoch * 3, epoch * 3 + 3):
            for mb in sampler.step_batches(step):
                starts = mb.packing.cu_seqlens[:-1].long()
                ids += mb.input_ids_BT[0, starts].tolist()
        return ids

    first, second = epoch_ids(0), epoch_ids(1)
    assert sorted(first) == sorted(second) == list(range(10))
    assert first != second
    assert [len(sampler.step_batches(s)) for s in range(3)] == [2, 2, 1]
    # The order depends on the step alone: a new sampler (a resumed run) yields the same batches.
    again = StepSampler(train, batch_size=2, grad_accum=2, seed=0)
    for step in (4, 1, 5):
        assert all(torch.equal(a.input_ids_BT, b.input_ids_BT)
                   for a, b in zip(again.step_batches(step), sampler.step_batches(step)))


def test_collate_shifts_targets_and_packs_without_padding():
    mb = collate([
        SftExample(input_ids=[5, 6, 7, 8], loss_mask=[0, 0, 1, 1]),
        SftExample(input_ids=[9, 10], loss_mask=[1, 1]),  # token 0 is never a target: nothing predicts it
    ])
    assert mb.input_ids_BT.tolist() == [[5, 6, 7, 9]]
    assert mb.targets_BT.tolist() == [[IGNORE_INDEX, 7, 8, 10]]
    assert mb.packing.lengths == (3, 1) and mb.num_targets == 3


def test_chat_rows_train_only_the_assistant_reply(tokenizer):
    (example,), skipped = tokenize_rows(tokenizer, [chat_row(1, 2)], max_seq_len=256)
    assert skipped == 0
    targets = [t for t, m in zip(example.input_ids, example.loss_mask) if m]
    assert tokenizer.decode(targets) == "The answer is 3.<|im_end|>"


def test_rows_without_targets_after_truncation_are_skipped(tokenizer, tmp_path):
    long_prompt = {"prompt": "The quick brown fox jumps over the lazy dog. " * 20, "completion": "Yes."}
    path = write_jsonl(tmp_path / "d.jsonl", [chat_row(a, b) for a, b in PAIRS] + [long_prompt])
    data = load_sft_data(path, tokenizer, max_seq_len=64, eval_fraction=0.2, seed=0)
    assert (data.num_rows, data.skipped, len(data.train), len(data.eval)) == (11, 1, 8, 2)


def test_no_trainable_rows_is_a_clear_error(tokenizer, tmp_path):
    row = {"prompt": "The quick brown fox jumps over the lazy dog. " * 20, "completion": "Yes."}
    path = write_jsonl(tmp_path / "d.jsonl", [row, row])
    with pytest.raises(ValueError, match=r"None of the 2 dataset rows .* max_seq_len=32 .* raise max_seq_len"):
        load_sft_data(path, tokenizer, max_seq_len=32, eval_fraction=0.1, seed=0)


def test_a_malformed_row_names_its_line(tokenizer, tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [chat_row(1, 2), {"text": "no format"}])
    with pytest.raises(ValueError, match="dataset row 2: SFT rows need either 'messages'"):
        load_sft_data(path, tokenizer, max_seq_len=64, eval_fraction=0.0, seed=0)
