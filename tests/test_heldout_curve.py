"""bench/heldout_curve.py: reading the updates to a held-out level off a learning curve."""

from __future__ import annotations

import pytest

from bench.heldout_curve import updates_to_reach


def test_the_level_is_interpolated_between_evaluated_versions():
    points = {0: 0.40, 5: 0.50, 10: 0.60, 15: 0.55}
    assert updates_to_reach(points, 0.55) == pytest.approx(7.5)
    assert updates_to_reach(points, 0.40) == 0.0  # reached before any update
    assert updates_to_reach(points, 0.61) is None  # never reached


def test_a_curve_that_dips_is_credited_with_its_first_crossing():
    assert updates_to_reach({0: 0.5, 4: 0.3, 8: 0.7}, 0.6) == pytest.approx(7.0)
    assert updates_to_reach({0: 0.5, 4: 0.6, 8: 0.4}, 0.6) == pytest.approx(4.0)


def test_a_curve_is_the_runs_own_points_and_the_kept_evaluations(tmp_path):
    import json

    from autodidact.heldout import curve

    (tmp_path / "summary.json").write_text(json.dumps({
        "success_warm": {"avg": 0.3}, "success_rl": {"avg": 0.5},
        "learner": {"learner/version": 15}}))
    (tmp_path / "heldout_curve.json").write_text(json.dumps({"5": 0.4}))
    # version 5 is read from the cache (nothing is evaluated); 20 is past the run's last
    assert curve(tmp_path, [5, 20]) == {0: 0.3, 5: 0.4, 15: 0.5}


def test_the_plot_draws_every_group_even_when_its_runs_kept_different_versions(tmp_path):
    from bench.heldout_curve import plot

    result = {"level": 0.45, "curves": {
        "grpo": {"a": {0: 0.3, 8: 0.4, 15: 0.45}, "b": {0: 0.32, 15: 0.44}},
        "composite": {"c": {0: 0.3, 8: 0.5, 15: 0.5}}}}
    path = plot(result, tmp_path / "curve.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000
