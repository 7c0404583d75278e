"""LR schedule values (services/trainer/schedule.py): warmup, then cosine / linear / constant over the rest."""

import math

import pytest

from services.trainer.schedule import learning_rate, lr_multiplier


def multipliers(kind: str, warmup: int, total: int) -> list[float]:
    return [lr_multiplier(s, kind=kind, warmup_steps=warmup, total_steps=total) for s in range(total)]


def test_warmup_is_linear_and_reaches_the_peak_on_its_last_step():
    assert multipliers("constant", 4, 6) == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]


def test_linear_decays_towards_zero_after_warmup():
    assert multipliers("linear", 2, 6) == [0.5, 1.0, 1.0, 0.75, 0.5, 0.25]
    assert multipliers("linear", 0, 4) == [1.0, 0.75, 0.5, 0.25]


def test_cosine_follows_half_a_cosine_after_warmup():
    got = multipliers("cosine", 2, 6)
    expected = [0.5, 1.0] + [0.5 * (1 + math.cos(math.pi * p)) for p in (0.0, 0.25, 0.5, 0.75)]
    assert got == expected
    assert got[4] == 0.5
    assert got[3] == pytest.approx((2 + math.sqrt(2)) / 4, abs=1e-15)


def test_constant_without_warmup_is_flat():
    assert multipliers("constant", 0, 3) == [1.0, 1.0, 1.0]


def test_learning_rate_scales_the_peak():
    assert learning_rate(0, peak_lr=1e-3, kind="linear", warmup_steps=4, total_steps=10) == 1e-3 * 0.25


def test_unknown_schedule_names_the_choices():
    with pytest.raises(ValueError, match="lr_scheduler must be one of cosine, linear, constant"):
        lr_multiplier(0, kind="step", warmup_steps=0, total_steps=1)
