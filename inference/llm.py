"""LLM chat clients for the task proposer and the judges, plus JSON extraction from replies.

Only the standard library is used, so any OpenAI-compatible endpoint (``vllm serve``, a hosted
API) works without an SDK. Model output is only ever parsed as JSON, never evaluated.
"""

from __future__ import annotations

import http.client
import json
import logging
import os
import socket
import threading
import time
import urllib.error
import urllib.request
from abc import ABC, abstractmethod
from dataclasses import dataclass

log = logging.getLogger(__name__)

ERROR_KINDS = ("timeout", "connection", "http", "bad_response")


class LLMError(Exception):
    """A chat request that failed; ``kind`` is one of ERROR_KINDS, ``status`` the HTTP code."""

    def __init__(self, kind: str, message: str, status: int | None = None):
        if kind not in ERROR_KINDS:
            raise ValueError(f"unknown LLMError kind {kind!r}")
        super().__init__(f"{kind}: {message}")
        self.kind = kind
        self.status = status


@dataclass(frozen=True)
class ReplyFormat:
    """What a caller's parser accepts, for an endpoint that can enforce it while decoding
    (``llm.structured_outputs``): a JSON schema or a regular expression."""

    name: str
    json_schema: dict | None = None
    regex: str | None = None


STRUCTURED_MODES = ("none", "vllm", "openai")


class ChatModel(ABC):
    """A chat model: OpenAI-style messages in, the assistant's text out."""

    def __init__(self) -> None:
        self.stats: dict[str, int] = {}

    def _count(self, key: str, n: int = 1) -> None:
        self.stats[key] = self.stats.get(key, 0) + n

    def close(self) -> None:  # noqa: B027 - optional hook: a remote endpoint holds nothing
        """Release what the model holds (an engine)."""

    @abstractmethod
    def complete(
        self, messages: list[dict], temperature: float = 0.7, max_tokens: int = 512,
        reply_format: ReplyFormat | None = None,
    ) -> str:
        """Return the assistant's reply to ``messages``; raise LLMError on failure.
        ``reply_format`` is a request an endpoint may enforce; callers parse either way."""


class OpenAIChat(ChatModel):
    """Client for an OpenAI-compatible ``/chat/completions`` endpoint, with bounded retries."""

    def __init__(
        self,
        url: str,
        model: str,
        api_key_env: str = "OPENAI_API_KEY",
        timeout_s: float = 60.0,
        max_retries: int = 2,
        backoff_s: float = 0.5,
        reply_log: str | os.PathLike | None = None,
        structured: str = "none",
    ):
        super().__init__()
        self.endpoint = _endpoint(url)
        self.model = model
        self.api_key_env = api_key_env
        self.timeout_s = timeout_s
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self.replies = ReplyLog(reply_log) if reply_log else None
        if structured not in STRUCTURED_MODES:
            raise ValueError(f"structured must be one of {STRUCTURED_MODES}, got {structured!r}")
        self.structured = structured

    @classmethod
    def from_config(cls, llm, reply_log: str | os.PathLike | None = None) -> "OpenAIChat":
        """The client for a run's ``llm`` section (protocol.config.LLMConfig); with
        ``reply_log``, every request and its raw reply are appended there (JSONL)."""
        return cls(llm.url, llm.model, llm.api_key_env, llm.timeout_s, llm.max_retries,
                   reply_log=reply_log, structured=llm.structured_outputs)

    def complete(
        self, messages: list[dict], temperature: float = 0.7, max_tokens: int = 512,
        reply_format: ReplyFormat | None = None,
    ) -> str:
        body = {
            "model": self.model,
            "messages": messages,
            "temperature": temperature,
            "max_tokens": max_tokens,
            **format_fields(reply_format, self.structured),
        }
        data = json.dumps(body).encode()
        for attempt in range(self.max_retries + 1):
            self._count("requests")
            t0 = time.monotonic()
            try:
                reply = _parse_reply(self._post(data))
                if self.replies is not None:
                    self.replies.add(messages, reply, None, time.monotonic() - t0)
                return reply
            except LLMError as err:
                if self.replies is not None:
                    self.replies.add(messages, None, str(err), time.monotonic() - t0)
                self._count(f"errors_{err.kind}")
                log.warning(
                    "chat request to %s failed (attempt %d/%d): %s",
                    self.endpoint, attempt + 1, self.max_retries + 1, err,
                )
                if not _retryable(err) or attempt == self.max_retries:
                    raise
            self._count("retries")
            time.sleep(self.backoff_s * (2**attempt))
        raise AssertionError("unreachable")

    def _headers(self) -> dict[str, str]:
        headers = {"Content-Type": "application/json"}
        # Read at call time so a key rotated in the environment is picked up without a restart.
        key = os.environ.get(self.api_key_env)
        if key:
            headers["Authorization"] = f"Bearer {key}"
        return headers

    def _post(self, data: bytes) -> bytes:
        req = urllib.request.Request(self.endpoint, data=data, headers=self._headers())
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                return resp.read()
        except urllib.error.HTTPError as e:
            detail = _snippet(e.read())
            raise LLMError("http", f"HTTP {e.code}: {detail}", status=e.code) from e
        except urllib.error.URLError as e:
            # urlopen wraps connect-phase failures, timeouts included, in URLError.
            if isinstance(e.reason, (socket.timeout, TimeoutError)):
                raise LLMError("timeout", f"no reply within {self.timeout_s}s") from e
            raise LLMError("connection", str(e.reason)) from e
        except (socket.timeout, TimeoutError) as e:
            raise LLMError("timeout", f"no reply within {self.timeout_s}s") from e
        except (OSError, http.client.HTTPException) as e:
            raise LLMError("connection", repr(e)) from e


def format_fields(reply_format: ReplyFormat | None, mode: str) -> dict:
    """Request fields that ask the endpoint to enforce ``reply_format``: vLLM's own
    ``structured_outputs`` (a JSON schema or a regex), or OpenAI's ``response_format`` (JSON
    schemas only; a regex is not sent there)."""
    if reply_format is None or mode == "none":
        return {}
    if mode == "vllm":
        if reply_format.json_schema is not None:
            return {"structured_outputs": {"json": reply_format.json_schema}}
        return {"structured_outputs": {"regex": reply_format.regex}} if reply_format.regex \
            else {}
    if reply_format.json_schema is None:
        return {}
    return {"response_format": {"type": "json_schema", "json_schema": {
        "name": reply_format.name, "schema": reply_format.json_schema}}}


class ReplyLog:
    """Appends one JSON line per request: the last message asked, the raw reply (or the
    error) and the latency, so what a model actually answered can be read after the run.
    Thread-safe (a lock per log); a line that cannot be written is logged, never raised."""

    def __init__(self, path: str | os.PathLike, max_chars: int = 4000):
        self.path, self.max_chars = os.fspath(path), max_chars
        self._lock = threading.Lock()
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)

    def add(self, messages: list[dict], reply: str | None, error: str | None,
            seconds: float) -> None:
        asked = clip_text(messages[-1].get("content", "") if messages else "", self.max_chars)
        line = json.dumps({"t": time.time(), "asked": asked, "reply": reply, "error": error,
                           "seconds": round(seconds, 3)}, ensure_ascii=False)
        try:
            with self._lock, open(self.path, "a", encoding="utf-8") as f:
                f.write(line + "\n")
        except OSError as exc:
            log.warning("cannot append to the LLM reply log %s: %s", self.path, exc)


REFUSAL_MARKERS = ("i cannot", "i can't", "i can not", "i'm sorry", "i am sorry", "i'm unable",
                   "i am unable", "i'm not able", "i am not able", "as an ai", "i won't",
                   "i will not", "unable to help", "cannot assist", "can't assist")


def is_refusal(reply: str) -> bool:
    """Whether a reply declines the request in words ("I'm sorry, I cannot ...") rather than
    failing to follow its format; callers count the two apart."""
    head = " ".join(str(reply).lower().replace("\u2019", "'").split())[:300]
    return any(marker in head for marker in REFUSAL_MARKERS)


def _endpoint(url: str) -> str:
    url = url.rstrip("/")
    if url.endswith("/chat/completions"):
        return url
    return f"{url}/chat/completions"


def _retryable(err: LLMError) -> bool:
    if err.kind in ("timeout", "connection"):
        return True
    # Overload and server faults are transient; other 4xx mean the request itself is wrong.
    status = err.status or 0
    return err.kind == "http" and (status == 429 or status >= 500)


def _parse_reply(raw: bytes) -> str:
    try:
        payload = json.loads(raw)
        content = payload["choices"][0]["message"]["content"]
    except (ValueError, KeyError, IndexError, TypeError) as e:
        raise LLMError("bad_response", f"no choices[0].message.content in {_snippet(raw)}") from e
    if not isinstance(content, str):
        raise LLMError("bad_response", f"content is {type(content).__name__}, not str")
    return content


def _snippet(raw: bytes, limit: int = 200) -> str:
    return clip_text(raw.decode("utf-8", errors="replace"), limit)


def clip_text(text: str, limit: int) -> str:
    """``text`` cut to ``limit`` characters, with ``...`` marking a cut."""
    text = str(text)
    return text if len(text) <= limit else text[:limit] + "..."


def extract_json(text: str):
    """Return the first JSON object or array in ``text``, ignoring code fences and prose.

    Each '{' or '[' is tried in turn as a start, so stray brackets in prose before the real
    payload do not hide it. Raises ValueError when no candidate parses.
    """
    decoder = json.JSONDecoder()
    starts = [i for i, ch in enumerate(text) if ch in "{["]
    if not starts:
        raise ValueError("no '{' or '[' in reply")
    for i in starts:
        try:
            value, _ = decoder.raw_decode(text, i)
        except ValueError:
            continue
        return value
    raise ValueError(f"none of {len(starts)} JSON candidates parsed")
