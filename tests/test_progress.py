"""The run's live progress line (autodidact/progress.py), on a real Redis: its rate counts the
groups this launcher's run added, not those a resumed run's earlier processes stored."""

from __future__ import annotations

import re

from autodidact.progress import Progress
from autodidact.supervisor import Supervisor


def shown(capsys) -> tuple[int, float]:
    line = capsys.readouterr().err
    groups, rate = re.search(r"groups\s+(\d+) \(([\d.]+)/s", line).groups()
    return int(groups), float(rate)


def test_after_a_resume_the_rate_counts_only_groups_added_since(tmp_path, control, capsys):
    control.incr("actor/accepted", 4766)  # stored before the resume
    progress = Progress(tmp_path)
    progress.begin(control)  # the launcher starts supervising, at 0 s
    control.incr("actor/accepted", 20)
    with Supervisor() as roles:
        progress.show(control, roles, elapsed_s=10.0)
        assert shown(capsys) == (4786, 2.0)  # not 4786 / 10 s = 478.6/s
        control.incr("actor/accepted", 30)
        progress.show(control, roles, elapsed_s=20.0)
        assert shown(capsys) == (4816, 2.5)


def test_without_a_first_count_the_rate_begins_at_the_first_line(tmp_path, control, capsys):
    control.incr("actor/accepted", 500)  # Redis was away when supervising began
    progress = Progress(tmp_path)
    with Supervisor() as roles:
        progress.show(control, roles, elapsed_s=10.0)
        assert shown(capsys) == (500, 0.0)
        control.incr("actor/accepted", 40)
        progress.show(control, roles, elapsed_s=20.0)
        assert shown(capsys) == (540, 4.0)


def test_a_failed_run_quotes_each_roles_reason(capsys):
    from autodidact.progress import print_summary

    print_summary({"failed_roles": ["learner", "judge-0"], "failure_reasons": {
        "learner": "exit code 78: learner: no good checkpoint in ck/ [a]; move ck/ away"}})
    said = capsys.readouterr().err
    assert ("run failed: learner failed for good (exit code 78: learner: no good checkpoint in "
            "ck/ [a]; move ck/ away; its log: logs/learner.log)") in said
    assert "run failed: judge-0 failed for good (no reason in its log; its log: " \
           "logs/judge-0.log)" in said
