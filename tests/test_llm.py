"""LLM client, JSON extraction and grader, over real HTTP against a scripted chat server."""

from __future__ import annotations

import json
import socket
import sys

import pytest
from llm_stub import ScriptedChatServer

from episodes.grader import LLMGrader
from inference.llm import LLMError, OpenAIChat, extract_json

MESSAGES = [{"role": "user", "content": "hi"}]


def chat(url, **kw):
    kw.setdefault("backoff_s", 0.01)
    return OpenAIChat(url, "test-model", api_key_env="AUTODIDACT_TEST_KEY", **kw)


def closed_port() -> int:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    return port


# --- OpenAIChat ---------------------------------------------------------------------------


def test_completion_and_request_body(monkeypatch):
    monkeypatch.delenv("AUTODIDACT_TEST_KEY", raising=False)
    with ScriptedChatServer(["hello there"]) as srv:
        client = chat(srv.url)
        assert client.complete(MESSAGES, temperature=0.2, max_tokens=7) == "hello there"
    body = srv.requests[0]
    assert body["model"] == "test-model"
    assert body["messages"] == MESSAGES
    assert body["temperature"] == 0.2
    assert body["max_tokens"] == 7
    assert client.stats["requests"] == 1


def test_url_with_full_path_accepted():
    with ScriptedChatServer(["ok"]) as srv:
        assert chat(srv.url + "/chat/completions").complete(MESSAGES) == "ok"


def test_api_key_header_only_when_env_set(monkeypatch):
    monkeypatch.delenv("AUTODIDACT_TEST_KEY", raising=False)
    with ScriptedChatServer(["a", "b"]) as srv:
        client = chat(srv.url)
        client.complete(MESSAGES)
        monkeypatch.setenv("AUTODIDACT_TEST_KEY", "sk-secret")
        client.complete(MESSAGES)
    assert srv.headers == [None, "Bearer sk-secret"]


def test_retry_after_500_then_success():
    with ScriptedChatServer([{"status": 500}, "recovered"]) as srv:
        client = chat(srv.url, max_retries=2)
        assert client.complete(MESSAGES) == "recovered"
    assert client.stats["retries"] == 1
    assert client.stats["errors_http"] == 1
    assert client.stats["requests"] == 2


def test_retry_after_429():
    with ScriptedChatServer([{"status": 429}, "ok"]) as srv:
        assert chat(srv.url).complete(MESSAGES) == "ok"


def test_no_retry_on_400():
    with ScriptedChatServer([{"status": 400}], default="never sent") as srv:
        client = chat(srv.url, max_retries=3)
        with pytest.raises(LLMError) as info:
            client.complete(MESSAGES)
    assert info.value.kind == "http"
    assert info.value.status == 400
    assert len(srv.requests) == 1
    assert client.stats.get("retries", 0) == 0


def test_retries_exhausted_raises():
    with ScriptedChatServer([]) as srv:
        client = chat(srv.url, max_retries=2)
        with pytest.raises(LLMError) as info:
            client.complete(MESSAGES)
    assert info.value.kind == "http"
    assert len(srv.requests) == 3
    assert client.stats["retries"] == 2


def test_timeout():
    with ScriptedChatServer([{"delay": 1.0, "content": "late"}]) as srv:
        client = chat(srv.url, timeout_s=0.2, max_retries=0)
        with pytest.raises(LLMError) as info:
            client.complete(MESSAGES)
    assert info.value.kind == "timeout"
    assert client.stats["errors_timeout"] == 1


def test_connection_refused():
    client = chat(f"http://127.0.0.1:{closed_port()}/v1", max_retries=1)
    with pytest.raises(LLMError) as info:
        client.complete(MESSAGES)
    assert info.value.kind == "connection"
    assert client.stats["errors_connection"] == 2


@pytest.mark.parametrize(
    "raw",
    [
        "not json at all",
        json.dumps({"choices": []}),
        json.dumps({"choices": [{"message": {"content": None}}]}),
    ],
)
def test_malformed_body(raw):
    with ScriptedChatServer([{"raw": raw}]) as srv:
        with pytest.raises(LLMError) as info:
            chat(srv.url, max_retries=0).complete(MESSAGES)
    assert info.value.kind == "bad_response"


def test_api_key_never_logged(monkeypatch, caplog):
    monkeypatch.setenv("AUTODIDACT_TEST_KEY", "sk-do-not-log")
    with ScriptedChatServer([{"status": 401}]) as srv:
        with pytest.raises(LLMError):
            chat(srv.url).complete(MESSAGES)
    assert caplog.records, "a failure is logged"
    assert "sk-do-not-log" not in caplog.text


# --- extract_json -------------------------------------------------------------------------


def test_extract_json_fenced():
    assert extract_json('```json\n{"score": 0.5}\n```') == {"score": 0.5}


def test_extract_json_prose_wrapped():
    text = 'Sure! Here you go: [1, 2, 3]. Hope that [helps].'
    assert extract_json(text) == [1, 2, 3]


def test_extract_json_skips_bad_candidates():
    text = 'I think {this is not json} but {"a": {"b": [1, {"c": null}]}} is'
    assert extract_json(text) == {"a": {"b": [1, {"c": None}]}}


@pytest.mark.parametrize("garbage", ["", "no json here", "{not: json", "[1, 2"])
def test_extract_json_garbage(garbage):
    with pytest.raises(ValueError):
        extract_json(garbage)


def test_extract_json_never_executes():
    # Evaluating this text would register a module; parsing it must leave sys.modules alone.
    payload = "__import__('sys').modules.__setitem__('pwned_marker', 1)"
    with pytest.raises(ValueError):
        extract_json(payload)
    assert extract_json(json.dumps({"cmd": payload})) == {"cmd": payload}
    assert "pwned_marker" not in sys.modules


# --- LLMGrader ----------------------------------------------------------------------------


def grade(replies, actions=("look", "take key"), **kw):
    with ScriptedChatServer(replies) as srv:
        grader = LLMGrader(chat(srv.url, max_retries=0), **kw)
        result = grader.grade(
            "open the door", ["take key", "open door"], list(actions), ["a room", "got key"]
        )
    return result, grader, srv


def test_grader_good_reply_and_prompt():
    reply = 'Verdict:\n```json\n{"relevant": true, "score": 0.6, "reason": "has key"}\n```'
    result, grader, srv = grade([reply])
    assert (result.score, result.relevant, result.capped) == (0.6, True, False)
    assert result.reason == "has key"
    body = srv.requests[0]
    assert body["temperature"] == 0.0
    assert [m["role"] for m in body["messages"]] == ["system", "user"]
    user = body["messages"][1]["content"]
    for part in ("open the door", "open door", "1. action: look", "observation: got key"):
        assert part in user


def test_grader_irrelevant_scores_zero():
    result, _, _ = grade(['{"relevant": false, "score": 0.9, "reason": "off task"}'])
    assert result.score == 0.0 and result.relevant is False


@pytest.mark.parametrize("raw,expected", [(1.7, 1.0), (-0.4, 0.0)])
def test_grader_clamps_score(raw, expected):
    result, _, _ = grade([json.dumps({"relevant": True, "score": raw, "reason": "x"})])
    assert result.score == expected


@pytest.mark.parametrize(
    "reply",
    [
        "I would give it a 7/10",
        '{"relevant": true, "reason": "no score"}',
        '{"relevant": "yes", "score": 0.5, "reason": "x"}',
        '{"relevant": true, "score": "high", "reason": "x"}',
        '[0.5]',
    ],
)
def test_grader_malformed_reply(reply):
    result, grader, _ = grade([reply])
    assert result.score == 0.0 and result.relevant is False
    assert "malformed" in result.reason
    assert grader.stats["malformed"] == 1


def test_grader_repetition_cap():
    reply = '{"relevant": true, "score": 0.9, "reason": "looks busy"}'
    result, grader, _ = grade([reply], actions=["look", "take key"] + ["take key"] * 3)
    assert result.capped is True
    assert result.score == pytest.approx(0.3)
    assert grader.stats["capped"] == 1


def test_grader_no_cap_at_limit():
    reply = '{"relevant": true, "score": 0.9, "reason": "ok"}'
    result, _, _ = grade([reply], actions=["take key"] * 3)
    assert result.capped is False and result.score == 0.9


def test_grader_survives_llm_error():
    result, grader, _ = grade([{"status": 500}])
    assert result.score == 0.0 and result.relevant is False
    assert "llm error" in result.reason
    assert grader.stats["llm_errors"] == 1
