"""bench.run_timing's drift summary: each metric averaged over quarters of a run's updates."""

from __future__ import annotations

import pytest

from bench.run_timing import by_quarter


def test_quarters_average_the_updates_in_order_and_skip_those_without_the_metric():
    steps = [{"learner/kl_behaviour": float(i)} for i in range(8)]
    steps.insert(3, {"learner/loss": 1.0})  # an update that did not log it
    assert by_quarter(steps, "learner/kl_behaviour") == pytest.approx([0.5, 2.5, 4.5, 6.5])


def test_uneven_updates_still_give_four_quarters_covering_every_update():
    steps = [{"r": float(v)} for v in (1, 2, 3, 4, 5)]
    assert by_quarter(steps, "r") == pytest.approx([1.0, 2.0, 3.0, 4.5])  # the last takes two


def test_fewer_than_four_updates_have_no_quarters():
    assert by_quarter([{"r": 1.0}] * 3, "r") is None
    assert by_quarter([{"other": 1.0}] * 8, "r") is None
