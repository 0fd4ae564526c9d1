"""bench/judge_labels.py: what an LLM judge said, read back from the replies a run logged."""

from __future__ import annotations

import json

import numpy as np
import pytest

from bench.judge_labels import agreement, label_stats, replies
from judge.step_judges import build_judge_messages
from metrics.jsonl import MetricsWriter
from protocol.messages import Step, Task, Trajectory
from protocol.run_dir import RunDir


def _row(t, steps, reward, reply):
    empty = np.zeros(0, np.int32)
    traj = Trajectory("r", empty, empty.astype(np.float32), empty, empty.astype(np.uint8),
                      steps=[Step(f"a{i}", f"o{i}", 0, 1) for i in range(steps)],
                      reward=reward, success=reward > 0)
    asked = build_judge_messages(Task("t", "files", "find the file", 0), traj)[-1]["content"]
    return {"t": t, "asked": asked, "reply": reply, "error": None, "seconds": 0.1}


def test_labels_are_counted_by_position_and_outcome_from_the_real_request_text(tmp_path):
    log = RunDir(tmp_path).llm_replies("judge-0")
    log.parent.mkdir(parents=True)
    rows = [_row(2, 2, 1.0, "Step 1: GOOD\nStep 2: BAD"),
            _row(1, 3, 0.0, "Step 1: GOOD\nStep 2: BAD\nStep 3: GOOD"),
            _row(3, 1, 0.0, "no labels here"),  # does not parse
            {"t": 4, "asked": "Summarise the lesson", "reply": "x", "error": None}]
    log.write_text("".join(json.dumps(r) + "\n" for r in rows))
    read = replies(tmp_path)
    assert [r["t"] for r in read] == [1, 2, 3, 4]  # oldest first
    stats = label_stats(read)
    assert (stats["replies"], stats["unparsed"], stats["unreadable"]) == (4, 1, 1)
    assert stats["labelled_trajectories"] == 2 and stats["steps"] == 5
    assert stats["good_by_position"] == {1: 1.0, 2: 0.0, 3: 1.0}
    assert stats["steps_by_position"] == {1: 2, 2: 2, 3: 1}
    assert stats["good_by_outcome"] == {"failure": pytest.approx(2 / 3), "success": 0.5}
    assert stats["good_first_step_by_outcome"] == {"failure": 1.0, "success": 1.0}


def test_agreement_is_weighted_by_each_windows_steps(tmp_path):
    metrics = MetricsWriter(tmp_path, "judge")
    metrics.log({"agreement": 0.5, "steps": 30.0})
    metrics.log({"agreement": 1.0, "steps": 10.0})
    metrics.log({"groups": 1.0})  # a window without the cross-check
    assert agreement(tmp_path) == pytest.approx(0.625)
    assert agreement(tmp_path / "none") is None
