"""bench/heldout_curve.py: reading the updates to a held-out level off a learning curve."""

from __future__ import annotations

import pytest

from bench.heldout_curve import compare, show, updates_to_reach


def test_the_level_is_interpolated_between_evaluated_versions():
    points = {0: 0.40, 5: 0.50, 10: 0.60, 15: 0.55}
    assert updates_to_reach(points, 0.55) == pytest.approx(7.5)
    assert updates_to_reach(points, 0.40) == 0.0  # reached before any update
    assert updates_to_reach(points, 0.61) is None  # never reached


def test_a_curve_that_dips_is_credited_with_its_first_crossing():
    assert updates_to_reach({0: 0.5, 4: 0.3, 8: 0.7}, 0.6) == pytest.approx(7.0)
    assert updates_to_reach({0: 0.5, 4: 0.6, 8: 0.4}, 0.6) == pytest.approx(4.0)


# Two seeds whose warm-starts lie ten points apart, as the SmolLM2 seeds do.
SEEDS = {"grpo": {"seed 0": {0: 0.30, 5: 0.32, 15: 0.34}, "seed 1": {0: 0.40, 5: 0.41, 15: 0.44}},
         "ref": {"seed 0": {0: 0.30, 5: 0.34, 15: 0.35}, "seed 1": {0: 0.40, 5: 0.42, 15: 0.46}}}


def test_one_level_for_seeds_that_start_apart_is_never_reached_by_the_lower_one():
    result = compare(SEEDS, None)
    assert result["level"] == pytest.approx(0.39)
    assert result["updates_to_level"]["grpo"]["seed 0"] is None
    assert result["updates_to_level"]["ref"]["seed 1"] == 0.0  # reached before any update


def test_paired_by_seed_each_seed_has_its_own_level_and_ratio():
    result = compare(SEEDS, None, paired=True)
    assert result["level"] == {"seed 0": 0.34, "seed 1": 0.44}  # GRPO's final on each seed
    assert result["updates_to_level"]["grpo"] == {"seed 0": 15.0, "seed 1": 15.0}
    assert result["updates_to_level"]["ref"] == pytest.approx({"seed 0": 5.0, "seed 1": 10.0})
    assert result["ratio_to_first"]["ref"] == pytest.approx({"seed 0": 3.0, "seed 1": 1.5})
    assert "ref updates, paired: seed 0 3.00x, seed 1 1.50x (mean 2.25x)" in show(result)
    # the mean gain over versions 5 and 15: (2 + 4) / 2 and (1 + 4) / 2 points for GRPO
    assert result["mean_gain"]["grpo"] == pytest.approx({"seed 0": 0.03, "seed 1": 0.025})
    assert result["mean_gain"]["ref"] == pytest.approx({"seed 0": 0.045, "seed 1": 0.04})


def test_paired_a_seed_missing_from_a_group_is_left_out_of_every_group():
    curves = {"grpo": {**SEEDS["grpo"], "seed 2": {0: 0.5, 15: 0.6}}, "ref": SEEDS["ref"]}
    result = compare(curves, None, paired=True)
    assert result["left_out"] == ["seed 2"]
    assert all(set(cs) == {"seed 0", "seed 1"} for cs in result["curves"].values())
    assert "left out, not in every group: seed 2" in show(result)


def test_paired_with_a_gain_the_level_is_each_seeds_start_plus_the_gain():
    result = compare(SEEDS, None, paired=True, gain=0.02)
    assert result["level"] == pytest.approx({"seed 0": 0.32, "seed 1": 0.42})
    assert result["updates_to_level"]["grpo"] == pytest.approx({"seed 0": 5.0,
                                                                "seed 1": 5 + 10 / 3})
    assert result["updates_to_level"]["ref"] == pytest.approx({"seed 0": 2.5, "seed 1": 5.0})


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


def test_the_paired_plot_draws_the_change_since_each_seeds_start(tmp_path):
    from bench.heldout_curve import plot

    path = plot(compare(SEEDS, None, paired=True), tmp_path / "paired.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000
