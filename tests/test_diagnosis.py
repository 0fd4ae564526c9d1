"""The likely cause of what RL did (autodidact/diagnosis.py) on planted metric series: one run
per cause, each built so that only its own rule holds, and the edges of the rules."""

from __future__ import annotations

import json

import pytest

from autodidact import diagnosis
from autodidact.diagnosis import (
    DRIFT_KL_INITIAL,
    MIN_UPDATES,
    RISE,
    VALIDATION_GAIN,
    Validation,
    diagnose,
    informative_share,
    run_validation,
)


def planted(n: int = 40, success=(0.5, 0.5), informative: float = 0.8,
            kl_behaviour=(0.002, 0.002), kl_initial=(0.0, 0.005), grad=(2.0, 2.0),
            reward=None, every: int = 10) -> list[dict]:
    """``n`` updates of 16 trained groups each whose series go linearly from the first pair
    value to the second: actor success (one record per policy version), batch reward (the
    success unless given), KL to behaviour, KL to the initial policy (every ``every``
    updates), grad norm; ``informative`` of the groups seen carry signal."""
    def at(pair, i):
        return pair[0] + (pair[1] - pair[0]) * i / (n - 1)

    # Every trained group informative, and as many set aside as make the share.
    skipped = 16 / informative - 16
    records = []
    for i in range(n):
        records.append({"role": "actor", "id": "actor-0", "actor/version": i,
                        "actor/success_rate": at(success, i)})
        rec = {"role": "learner", "step": i + 1, "learner/updates": i + 1,
               "learner/version": i + 1, "learner/reward": at(reward or success, i),
               "learner/groups": 16, "learner/degenerate_groups": 0,
               "learner/uninformative_groups": skipped,
               "learner/kl_behaviour": at(kl_behaviour, i), "learner/grad_norm": at(grad, i),
               "learner/entropy": 1.0}
        if i % every == 0 or i == n - 1:
            rec["learner/kl_initial"] = at(kl_initial, i)
        records.append(rec)
    return records


FLAT_VALIDATION = Validation(0.50, 0.51, -0.02, 0.04)
RISEN_VALIDATION = Validation(0.50, 0.60, 0.05, 0.15)


def test_the_planted_series_say_what_they_were_built_to():
    rows = diagnosis.updates(planted(informative=0.25))
    shares = {informative_share(r) for r in rows}
    assert len(shares) == 1 and shares.pop() == pytest.approx(0.25)


def test_no_signal_most_groups_uninformative():
    found = diagnose(planted(informative=0.2, kl_behaviour=(0.001, 0.01), grad=(2, 6)),
                     FLAT_VALIDATION)
    assert found.cause == "no signal", found.line
    assert "20% of groups informative" in found.reason
    assert found.numbers["informative share"] == pytest.approx(0.2)
    # the same run with most groups informative is not
    assert diagnose(planted(informative=0.7), FLAT_VALIDATION).cause != "no signal"


@pytest.mark.parametrize("moved", [
    {"kl_behaviour": (0.001, 0.01)},
    {"kl_initial": (0.0, 0.1)},
    {"grad": (2.0, 6.0)},
], ids=["kl_behaviour", "kl_initial", "grad_norm"])
def test_drift_without_reward(moved):
    found = diagnose(planted(**moved), FLAT_VALIDATION)
    assert found.cause == "drift without reward", found.line
    assert "rose" in found.reason and "training success 50% → 50%" in found.reason


def test_drift_needs_the_rise_to_clear_its_thresholds():
    # KL to behaviour that doubles but stays under the float-noise floor; KL to the initial
    # policy that grows by less than DRIFT_KL_INITIAL; a grad norm up 20%: no drift.
    found = diagnose(planted(kl_behaviour=(1e-4, 4e-4), kl_initial=(0.0, DRIFT_KL_INITIAL / 2),
                             grad=(2.0, 2.4)), FLAT_VALIDATION)
    assert found.cause == "stalled, cause unclear", found.line


def test_overfitting_training_success_rises_validation_does_not():
    found = diagnose(planted(success=(0.4, 0.7)), FLAT_VALIDATION)
    assert found.cause == "overfitting the training tasks", found.line
    assert "training success" in found.reason and "validation 50.0% → 51.0%" in found.reason


def test_learning_training_success_and_validation_rise():
    found = diagnose(planted(success=(0.4, 0.7)), RISEN_VALIDATION)
    assert found.cause == "learning", found.line
    assert "+10.0 points (95% +5.0 to +15.0)" in found.reason


def test_learning_on_validation_alone_and_on_training_tasks_alone():
    # validation rose, training success flat (at its ceiling): learning, and said so
    flat = diagnose(planted(success=(0.95, 0.95), informative=0.1), RISEN_VALIDATION)
    assert flat.cause == "learning" and "stayed flat" in flat.reason, flat.line
    # no validation after RL yet: learning, on the training tasks alone
    early = diagnose(planted(success=(0.4, 0.7)), Validation(0.5, None))
    assert early.cause == "learning" and "training tasks alone" in early.reason, early.line
    assert diagnose(planted(success=(0.4, 0.7))).cause == "learning"


def test_a_rise_under_the_threshold_is_no_rise():
    # first vs last quarter means of a linear series differ by 3/4 of its span
    just_under = RISE * 0.9 / 0.75
    found = diagnose(planted(success=(0.5, 0.5 + just_under)), FLAT_VALIDATION)
    assert found.cause == "stalled, cause unclear", found.line
    over = diagnose(planted(success=(0.5, 0.5 + 2 * RISE / 0.75)), FLAT_VALIDATION)
    assert over.cause == "overfitting the training tasks", over.line


def test_the_batch_reward_stands_in_for_actor_success():
    records = [r for r in planted(success=(0.5, 0.5), reward=(0.2, 0.6))
               if r["role"] == "learner"]
    found = diagnose(records, FLAT_VALIDATION)
    assert found.cause == "overfitting the training tasks", found.line
    assert found.reason.startswith("batch reward 25% → 55%")


def test_too_early_and_a_learner_that_never_filled_a_batch():
    found = diagnose(planted(n=MIN_UPDATES - 1))
    assert found.cause == "too early to tell" and f"{MIN_UPDATES - 1} learner" in found.reason
    replay = [{"role": "replay", "replay/groups": 40, "replay/set_aside": 40}]
    found = diagnose(replay)
    assert found.cause == "no signal" and "set aside 40 groups" in found.reason, found.line
    assert diagnose([]).cause == "too early to tell"


def test_validation_without_an_interval_needs_a_clear_gain():
    assert Validation(0.5, 0.5 + VALIDATION_GAIN).rose()
    assert not Validation(0.5, 0.5 + VALIDATION_GAIN / 2).rose()
    assert not Validation(0.5, 0.9, -0.01, 0.5).rose()  # the interval holds 0
    assert not Validation(0.5, None).rose()


def test_a_resumed_learner_counts_each_update_once():
    records = planted(n=8, informative=0.2)
    again = [dict(r) for r in records if r["role"] == "learner" and r["step"] > 4]
    for r in again:
        r["learner/degenerate_groups"] = 16  # the redone updates: the ones that count
        r["learner/uninformative_groups"] = 0.0
    found = diagnose(records + again)
    assert found.numbers["updates"] == 8
    # 4 updates of 16 informative out of 80, then the 4 redone: 0 out of 16
    assert found.numbers["informative groups"] == [4 * 16, 4 * 80 + 4 * 16]


def test_the_line_and_its_json_are_strict(tmp_path):
    records = planted(informative=0.2)
    records[-1]["learner/kl_behaviour"] = float("nan")
    found = diagnose(records, FLAT_VALIDATION)
    assert found.line == f"{found.cause}: {found.reason}" and "\n" not in found.line
    json.dumps(found.to_json(), allow_nan=False)  # the viewer refuses NaN


def test_run_validation_pairs_the_per_task_records(tmp_path):
    warm = {f"t{i}": [1.0 if i < 10 else 0.0] * 4 for i in range(40)}
    rl = {f"t{i}": [1.0 if i < 30 else 0.0] * 4 for i in range(40)}
    (tmp_path / "eval").mkdir()
    for stage, rows in (("warm", warm), ("rl", rl)):
        (tmp_path / "eval" / f"heldout-validation-{stage}.jsonl").write_text("".join(
            json.dumps({"task_id": t, "rewards": r}) + "\n" for t, r in rows.items()))
    summary = {"eval_split": "validation", "success_warm": {"avg": 0.25},
               "success_rl": {"avg": 0.75}}
    found = run_validation(tmp_path, summary)
    assert (found.warm, found.rl) == (0.25, 0.75) and 0 < found.low < 0.5 < found.high
    assert found.rose()
    (tmp_path / "eval" / "heldout-validation-rl.jsonl").unlink()
    alone = run_validation(tmp_path, summary)
    assert alone.low is None and alone.rose()  # +50 points, no interval
    assert run_validation(tmp_path, {}) is None


# --- the validation probe (eval.probe_every) ----------------------------------------------------


def probed(records: list[dict], success=(0.5, 0.5), every: int = 4,
           versions: range | None = None) -> list[dict]:
    """``records`` with a validation probe every ``every`` versions over ``versions`` (those of
    the actors' records by default), its success going linearly from the first value to the
    second, as actor-0 logs it (role eval, eval/version)."""
    seen = sorted({r["actor/version"] for r in records if r["role"] == "actor"})
    versions = [v for v in (versions or range(seen[0], seen[-1] + 1)) if v % every == 0]
    span = max(versions[-1] - versions[0], 1)
    return records + [{"role": "eval", "id": "actor-0", "step": v, "eval/version": v,
                       "eval/probe_tasks": 32, "eval/probe_success":
                       success[0] + (success[1] - success[0]) * (v - versions[0]) / span}
                      for v in versions]


def test_training_success_rising_while_the_probe_stays_flat_is_overfitting():
    # no validation after RL (a run still going): before the probe this said "learning"
    found = diagnose(probed(planted(success=(0.4, 0.7)), success=(0.3, 0.31)))
    assert found.cause == "overfitting the training tasks", found.line
    assert "validation probe did not rise by 5 points over the same quarters" in found.reason
    assert "validation probe 30% → 31% (same quarters)" in found.reason
    falling = diagnose(probed(planted(success=(0.4, 0.7)), success=(0.4, 0.2)),
                       Validation(0.5, None))
    assert falling.cause == "overfitting the training tasks", falling.line


def test_the_probe_rising_with_training_success_is_learning():
    found = diagnose(probed(planted(success=(0.4, 0.7)), success=(0.3, 0.5)))
    assert found.cause == "learning" and "probe rose with it" in found.reason, found.line
    assert "training tasks alone" not in found.reason


def test_the_end_point_still_decides_overfitting_beside_a_rising_probe():
    # validation after RL has the interval: a probe that rose does not overrule it ...
    found = diagnose(probed(planted(success=(0.4, 0.7)), success=(0.3, 0.5)), FLAT_VALIDATION)
    assert found.cause == "overfitting the training tasks", found.line
    assert "validation after RL does not beat" in found.reason
    assert "probe did not rise" not in found.reason
    # ... both are named when both stayed behind; and a risen end point is learning
    both = diagnose(probed(planted(success=(0.4, 0.7)), success=(0.3, 0.3)), FLAT_VALIDATION)
    assert "does not beat after warm-start and the validation probe" in both.reason, both.line
    risen = diagnose(probed(planted(success=(0.4, 0.7)), success=(0.3, 0.3)),
                     RISEN_VALIDATION)
    assert risen.cause == "learning", risen.line


def test_the_probe_is_read_over_training_success_quarters_or_not_at_all():
    records = planted(n=40, success=(0.4, 0.7))  # versions 0..39: quarters 0-9 and 30-39
    # high only between the quarters: the same in both, so flat
    middle = probed(records, success=(0.3, 0.3))
    for r in middle:
        if r["role"] == "eval" and 10 <= r["eval/version"] < 30:
            r["eval/probe_success"] = 0.9
    found = diagnose(middle)
    assert found.numbers["validation probe"] == pytest.approx((0.3, 0.3)), found.line
    assert found.cause == "overfitting the training tasks", found.line
    # probes in the first quarter alone say nothing of the last: not read
    early = diagnose(probed(records, success=(0.3, 0.3), versions=range(0, 10)))
    assert early.numbers["validation probe"] is None
    assert early.cause == "learning" and "training tasks alone" in early.reason, early.line


def test_a_version_probed_twice_counts_once_at_its_mean():
    records = [{"role": "eval", "eval/version": 4, "eval/probe_success": 0.25},
               {"role": "eval", "eval/version": 4, "eval/probe_success": 0.75},
               {"role": "eval", "eval/version": 0, "eval/probe_success": 0.1},
               {"role": "eval", "step": 0, "eval/success_avg": 0.9},  # a stage evaluation
               {"role": "actor", "actor/version": 8, "eval/probe_success": 1.0}]
    assert diagnosis.probe_success(records) == [(0, 0.1), (4, 0.5)]
