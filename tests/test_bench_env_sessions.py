"""bench/env_sessions.py: many episodes open at once on a real env server, each call timed."""

from __future__ import annotations

import json

import pytest

from bench.env_sessions import main
from protocol import env_wire as wire


@pytest.mark.timeout(120)
def test_every_session_stays_open_and_every_call_is_timed(tmp_path, monkeypatch):
    monkeypatch.setenv(wire.TOKENS_ENV, str(tmp_path / "tokens"))  # the server's and ours
    out = tmp_path / "sessions.json"
    result = main(["--sessions", "24", "--workers", "2", "--steps", "2", "--threads", "4",
                   "--json", str(out)])
    assert json.loads(out.read_text()) == result
    # What the server held with every episode stepped, by its own count: all 24 at once, none
    # evicted, no call failed; and none once the bench closed them.
    assert result["server"] == {"sessions_open": 24, "evicted": 0, "calls_failed": {},
                                "sessions_open_after_close": 0}
    for where in ("served", "in_process"):
        reset, step = result[where]["reset"], result[where]["step"]
        assert (reset["calls"], step["calls"]) == (24, 48)
        assert 0 < step["p50_ms"] <= step["p99_ms"] <= step["max_ms"]
    # a round trip through the broker and a worker costs more than a call in this process
    assert result["served"]["step"]["p50_ms"] > result["in_process"]["step"]["p50_ms"]
    assert result["server_resident_mib"]["all_open"] > 0
    assert result["command"] == ("python -m bench.env_sessions --sessions 24 --workers 2 "
                                 f"--steps 2 --threads 4 --json {out}")
    # The server and its workers are stopped by the bench: a survivor fails the session
    # (tests/conftest.py).
