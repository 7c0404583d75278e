"""Block accounting and scheduling, without a model (services/rollout/kv_blocks.py, scheduler.py)."""
import pytest

from services.rollout.kv_blocks import BlockAllocator
from services.rollout.batch_scheduler import Request, BatchScheduler, BatchSchedulerConfig, Status


def test_fork_shares_blocks_and_copy_on_write_copies_only_the_partial_last_block():
    blocks = BlockAllocator(num_blocks=8, block_size=4)
    prompt: list[int] = []
    assert blocks.append(prompt, 0, 10) is None  # 10 tokens: blocks of 4, 4, 2
    assert len(prompt) == 3 and blocks.num_free == 5
    samples = [prompt, blocks.fork(prompt), blocks.fork(prompt)]
    assert [blocks.refcount(b) for b in prompt] == [3, 3, 3]
    # The first sample to write position 10 gets a private copy of the partial block; full blocks stay shared.
    copy = blocks.append(samples[1], 10, 1)
    assert copy == (prompt[2], samples[1][2]) and samples[1][:2] == prompt[:2]
    assert blocks.refcount(prompt[2]) == 2 and blocks.refcount(samples[1][2]) == 1
    assert blocks.append(samples[2], 10, 1) is not None
    # The last holder writes in place: no copy.
    assert blocks.append(samples[0], 10, 1) is None and blocks.refcount(prompt[2]) == 1
    # Crossing into a new block needs a fresh one, never a copy.
    assert blocks.append(samples[0], 11, 3) is None and len(samples[0]) == 4
    for table in samples:
        blocks.free(table)
    assert blocks.num_free == 8 and all(blocks.refcount(b) == 0 for b in range(8))


def test_can_append_counts_the_copy():
    blocks = BlockAllocator(num_blocks=3, block_size=4)
    prompt: list[int] = []
    blocks.append(prompt, 0, 6)  # 2 blocks, the second partial
    other = blocks.fork(prompt)
    assert blocks.can_append(other, 6, 2)  # one copy, no new block: fits the one free block
    assert not blocks.can_append(other, 6, 3)  # a copy and a new block: two needed
    blocks.append(other, 6, 2)
    assert blocks.num_free == 0
    assert blocks.can_append(prompt, 6, 2)  # its partial block is its own again: no copy, no new block
    assert not blocks.can_append(prompt, 6, 3)  # position 8 needs a new block


def _req(name, prompt_len, n=1, max_tokens=4):
    return Request(name, list(range(3, 3 + prompt_len)), n, max_tokens)


def _run_to_completion(s: BatchScheduler, tokens_per_sample: int):
    """Drive the scheduler as the engine core would, sampling token 7 every time; returns each step's output."""
    outputs = []
    while s.has_work():
        out = s.schedule()
        assert out.scheduled, "no progress"
        outputs.append(out)
        for item in out.scheduled:
            seq = item.seq
            s.advance(item)
            if not item.samples:
                continue
            if seq.is_prompt:
                new = s.fork(seq, [7] * seq.request.n)
            else:
                seq.token_ids.append(7)
                new = [seq]
            for sample in new:
                if sample.num_tokens - sample.request.num_prompt >= tokens_per_sample:
                    s.finish(sample)
    return outputs


def test_preemption_frees_blocks_requeues_first_and_everything_finishes():
    s = BatchScheduler(BatchSchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, num_blocks=6, block_size=4))
    for i in range(3):
        s.add(_req(f"r{i}", prompt_len=5, n=2, max_tokens=6))
    outputs = _run_to_completion(s, tokens_per_sample=6)
    assert s.num_preemptions > 0
    preempted = [seq for out in outputs for seq in out.preempted]
    assert all(seq.request.request_id != "r0" for seq in preempted)  # the oldest request is never the victim
    assert s.blocks.num_free == 6 and not s.waiting and not s.running


def test_chunked_prefill_respects_the_token_budget_and_batch_size():
    s = BatchScheduler(BatchSchedulerConfig(max_num_seqs=3, max_num_batched_tokens=5, num_blocks=64, block_size=4))
    s.add(_req("long", prompt_len=12, n=2))
    s.add(_req("short", prompt_len=2, n=1))
    outputs = _run_to_completion(s, tokens_per_sample=3)
    assert all(out.num_tokens <= 5 and len(out.scheduled) <= 3 for out in outputs)
    first = outputs[0].scheduled
    assert [(x.seq.request.request_id, x.num_new, x.samples) for x in first] == [("long", 5, False)]
    # "short" waits while "long" has two samples running and the batch limit is 3: 2 + 1 fits, so it joins.
    assert any(x.seq.request.request_id == "short" for out in outputs[:4] for x in out.scheduled)
    assert s.blocks.num_free == 64


def test_a_request_larger_than_the_pool_is_refused_at_add():
    s = BatchScheduler(BatchSchedulerConfig(num_blocks=2, block_size=4))
    with pytest.raises(AssertionError):
        s.add(_req("big", prompt_len=8, max_tokens=2))  # 9 positions > 8 slots; EngineCore.check says so first


def test_finish_of_a_waiting_sequence_removes_it():
    s = BatchScheduler(BatchSchedulerConfig())
    seq = s.add(_req("r", prompt_len=3))
    s.finish(seq)
    assert seq.status is Status.FINISHED and not s.has_work()
