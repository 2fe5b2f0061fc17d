"""The paired difference `eval --mtp` reports: its arithmetic on hand-worked counts."""
from __future__ import annotations

import math

import pytest

from mixq.eval.mtp import paired_difference


def test_paired_difference_on_hand_worked_counts():
    # 100 positions: 3 where only the candidate agrees (+1), 5 where only the reference does (-1), 92 ties (0)
    # mean = -2/100; variance = 8/100 - 0.02^2 = 0.0796; SE = sqrt(0.0796 / 100)
    delta, se = paired_difference(3, 5, 100)
    assert delta == pytest.approx(-0.02) and se == pytest.approx(math.sqrt(0.0796) / 10)


def test_no_discordant_position_gives_no_error():
    assert paired_difference(0, 0, 4080) == (0.0, 0.0)
    assert paired_difference(0, 0, 0) == (0.0, 0.0)


def test_all_positions_lost():
    assert paired_difference(0, 10, 10) == (-1.0, 0.0)
