"""The experience pool: advice extracted from past rollouts, shared by every actor of a run.

Experiences live in Redis so that actors on any machine read and count the same pool, and
survive restarts through Redis's append-only file (the embedded server runs with it on and
saves on SIGTERM). The keys are :class:`protocol.control.ExperienceKeys` (listed with every
other key in :mod:`protocol.control`; ``P`` is the run prefix)::

    P:exp:log        list   append-only; one entry per experience, oldest first
    P:exp:ids        set    exp_ids in the log, so two writers never append the same id
    P:exp:uses       hash   exp_id -> rollouts it was injected into (HINCRBY)
    P:exp:successes  hash   exp_id -> of those, how many succeeded (HINCRBY)

A log entry is a msgpack map ``{"exp": Experience body, "w": when_to_use vector, "c": content
vector}``, the vectors raw little-endian float32 of unit length. Storing the vectors means a
reader never runs the embedding model over the whole pool, only over its queries. Counters are
separate hashes because many actors bump them concurrently and HINCRBY cannot race; the
``uses``/``successes`` stored in a body are always 0 and are filled from the hashes on read.

Each process keeps a local copy (experiences plus two embedding matrices) and refreshes it
incrementally: the log only grows, so a refresh reads just the entries past the copy's length.
Retrieval is one matrix product over that copy. Writes go through one Lua script that checks
the id set and ``max_pool`` and appends atomically, so concurrent writers cannot store an id
twice; near-duplicates (both texts at cosine >= ``dedup_similarity``) are caught against the
copy, refreshed just before, which is exact for one writer and close enough for several.

Redis is not the only copy: a pool opened with ``durable_path`` (the writers of a run use
``<run_dir>/experiences.log``) also appends every entry it adds to that file, and
:meth:`ExperiencePool.restore` puts back whatever a Redis that lost its data no longer holds.
Use counters are not in the file: after such a loss every experience starts untried again.

An entry that does not decode is skipped and counted in ``corrupt``; it never stops a reader.
A pool is not thread-safe: give each thread its own (they share the Redis data anyway).
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import msgpack
import numpy as np
import redis

from protocol.codec import decode_body, encode_body
from protocol.config import task_member
from protocol.control import ExperienceKeys, connect_redis
from protocol.messages import Experience, Task
from protocol.run_dir import RunDir

log = logging.getLogger(__name__)

ADD_OUTCOMES = ("added", "empty", "too_long", "invalid", "duplicate", "pool_full")
_READ_CHUNK = 1000  # log entries per LRANGE: bounds one reply's size when a new reader starts
_TIE_DECIMALS = 6  # similarities equal to this many decimals count as a tie


class TextEmbedder(Protocol):
    def encode(self, texts: Sequence[str]) -> np.ndarray: ...


# KEYS: log, ids. ARGV: max_pool, then exp_id, entry pairs.
# One code per pair: 1 appended, 0 id already stored, -1 pool full.
_APPEND = """
local size = redis.call('LLEN', KEYS[1])
local max = tonumber(ARGV[1])
local codes = {}
for i = 2, #ARGV, 2 do
  if redis.call('SISMEMBER', KEYS[2], ARGV[i]) == 1 then
    codes[#codes + 1] = 0
  elseif size >= max then
    codes[#codes + 1] = -1
  else
    redis.call('SADD', KEYS[2], ARGV[i])
    redis.call('RPUSH', KEYS[1], ARGV[i + 1])
    size = size + 1
    codes[#codes + 1] = 1
  end
end
return codes
"""


def experience_id(when_to_use: str, content: str) -> str:
    """Stable id of an experience: re-extracting the same advice gives the same id."""
    # Whitespace is normalised so that reformatting alone does not make a new experience.
    key = " ".join(when_to_use.split()) + "\x1f" + " ".join(content.split())
    return hashlib.sha1(key.encode()).hexdigest()[:16]


def utility(uses: int, successes: int) -> float:
    """Laplace-smoothed success rate: an untried experience sits at 0.5, between proven
    and failed ones, instead of at 0 or 1."""
    return (successes + 1) / (uses + 2)


def _pack_entry(exp: Experience, w: np.ndarray, c: np.ndarray) -> bytes:
    return msgpack.packb({"exp": encode_body(exp), "w": w.astype("<f4").tobytes(),
                          "c": c.astype("<f4").tobytes()}, use_bin_type=True)


def _unpack_entry(raw: bytes) -> tuple[Experience, np.ndarray, np.ndarray]:
    entry = msgpack.unpackb(raw, raw=False)
    exp = decode_body(Experience.TYPE, entry["exp"])
    w = np.frombuffer(entry["w"], dtype="<f4")
    c = np.frombuffer(entry["c"], dtype="<f4")
    if w.size == 0 or w.size != c.size:
        raise ValueError("embedding sizes differ")
    return exp, w, c


class _Rows:
    """A float32 matrix that grows by appending rows, in amortised O(new rows)."""

    def __init__(self):
        self._buf = np.zeros((0, 0), dtype=np.float32)
        self.n = 0

    @property
    def dim(self) -> int:
        return self._buf.shape[1]

    def view(self) -> np.ndarray:
        return self._buf[: self.n]

    def append(self, rows: np.ndarray) -> None:
        if self.n + len(rows) > len(self._buf):
            cap = max(64, 2 * (self.n + len(rows)))
            grown = np.zeros((cap, rows.shape[1]), dtype=np.float32)
            if self.n:
                grown[: self.n] = self._buf[: self.n]
            self._buf = grown
        self._buf[self.n : self.n + len(rows)] = rows
        self.n += len(rows)


class ExperiencePool:
    """The shared pool of one run; see the module docstring for the storage design.

    ``client`` must return bytes (redis-py's default, ``decode_responses=False``): log entries
    are binary. ``refresh_s`` bounds how stale :meth:`retrieve` may be; writes always refresh.
    """

    def __init__(self, client: redis.Redis, prefix: str, embedder: TextEmbedder, *,
                 dedup_similarity: float = 0.92, max_chars: int = 400, max_pool: int = 20000,
                 refresh_s: float = 2.0, durable_path: str | Path | None = None):
        self.r = client
        self.keys = ExperienceKeys(prefix)
        self.embedder = embedder
        self.dedup_similarity = dedup_similarity
        self.max_chars = max_chars
        self.max_pool = max_pool
        self.refresh_s = refresh_s
        self.corrupt = 0  # log entries skipped because they did not decode
        self.durable = DurableLog(durable_path) if durable_path else None
        self._append = client.register_script(_APPEND)
        self._reset()

    @classmethod
    def connect(cls, url: str, prefix: str, embedder: TextEmbedder, **kw) -> ExperiencePool:
        return cls(connect_redis(url), prefix, embedder, **kw)

    def close(self) -> None:
        self.r.close()

    # --- the local copy ---

    def _reset(self) -> None:
        self._read = 0  # log entries consumed, corrupt ones included
        self._exps: list[Experience] = []
        self._index: dict[str, int] = {}
        self._w = _Rows()
        self._c = _Rows()
        self._last_refresh = float("-inf")

    def refresh(self) -> int:
        """Read the log entries appended since the last refresh; returns how many were new."""
        self._last_refresh = time.monotonic()
        if self.r.llen(self.keys.log) < self._read:
            # The log shrank: someone cleared it, or Redis came back without its AOF.
            log.warning("experience log shorter than the local copy; reloading it")
            self._reset()
        before = len(self._exps)
        while True:
            raws = self.r.lrange(self.keys.log, self._read, self._read + _READ_CHUNK - 1)
            self._read += len(raws)
            self._ingest(raws)
            if len(raws) < _READ_CHUNK:
                return len(self._exps) - before

    def _maybe_refresh(self) -> None:
        if time.monotonic() - self._last_refresh >= self.refresh_s:
            self.refresh()

    def _ingest(self, raws: list[bytes]) -> None:
        exps, ws, cs = [], [], []
        for raw in raws:
            try:
                exp, w, c = _unpack_entry(raw)
            except Exception as exc:  # msgpack, codec and numpy raise unrelated types
                self._skip_corrupt(exc)
                continue
            dim = self._w.dim or (ws[0].size if ws else w.size)
            if w.size != dim:
                self._skip_corrupt(ValueError(f"{w.size}-dim embedding in a {dim}-dim pool"))
            elif exp.exp_id not in self._index:  # the append script keeps ids unique anyway
                self._index[exp.exp_id] = len(self._exps)
                exps.append(exp)
                ws.append(w)
                cs.append(c)
        if exps:
            self._exps += exps
            self._w.append(np.stack(ws))
            self._c.append(np.stack(cs))

    def _skip_corrupt(self, exc: Exception) -> None:
        self.corrupt += 1
        if self.corrupt == 1:  # once per pool: a bad entry stays in the log forever
            log.warning("skipping undecodable experience entry (%s: %s); further ones are "
                        "only counted", type(exc).__name__, exc)

    # --- writing ---

    def validate(self, exp: Experience) -> str | None:
        """Why ``exp`` cannot be stored ("empty", "too_long", "invalid"), or None."""
        if not exp.when_to_use.strip() or not exp.content.strip():
            return "empty"
        if len(exp.content) > self.max_chars:
            return "too_long"
        try:
            # Every reader decodes the entry: anything that would not round-trip stays out.
            decode_body(Experience.TYPE, encode_body(exp))
        except Exception:
            return "invalid"
        return None

    def add(self, exps: Sequence[Experience]) -> dict[str, int]:
        """Store the new, valid experiences; returns a count per outcome (ADD_OUTCOMES)."""
        counts = dict.fromkeys(ADD_OUTCOMES, 0)
        fresh = []
        for exp in map(_prepared, exps):
            reason = self.validate(exp)
            if reason:
                counts[reason] += 1
            else:
                fresh.append(exp)
        if not fresh:
            return counts
        self.refresh()  # dedup against what other writers stored meanwhile
        if len(self._exps) >= self.max_pool:  # the log only grows: nothing more can go in,
            counts["pool_full"] += len(fresh)  # so the lessons are not embedded to find out
            return counts
        vecs = self._embed([e.when_to_use for e in fresh] + [e.content for e in fresh])
        w, c = vecs[: len(fresh)], vecs[len(fresh) :]
        keep = self._novel(fresh, w, c)
        counts["duplicate"] += len(fresh) - len(keep)
        if keep:
            args = [self.max_pool]
            for i in keep:
                args += [fresh[i].exp_id, _pack_entry(fresh[i], w[i], c[i])]
            codes = self._append(keys=[self.keys.log, self.keys.ids], args=args)
            outcome = {1: "added", 0: "duplicate", -1: "pool_full"}
            for code in codes:
                counts[outcome[int(code)]] += 1
            if self.durable:
                entries = args[2::2]
                self.durable.append([e for e, code in zip(entries, codes) if int(code) == 1])
            self.refresh()  # so this writer sees its own additions at once
        return counts

    def _novel(self, fresh: list[Experience], w: np.ndarray, c: np.ndarray) -> list[int]:
        """Indices into ``fresh`` that duplicate neither the pool nor an earlier one of them."""
        ids = set(self._index)
        keep: list[int] = []
        for i, exp in enumerate(fresh):
            dup = (exp.exp_id in ids
                   or self._near(w[i], c[i], self._w.view(), self._c.view())
                   or self._near(w[i], c[i], w[keep], c[keep]))
            if not dup:
                keep.append(i)
                ids.add(exp.exp_id)
        return keep

    def _near(self, w: np.ndarray, c: np.ndarray, ws: np.ndarray, cs: np.ndarray) -> bool:
        # Both texts must match: the same situation with different advice is a new experience.
        if not len(ws):
            return False
        t = self.dedup_similarity
        return bool(np.any((ws @ w >= t) & (cs @ c >= t)))

    def _embed(self, texts: list[str]) -> np.ndarray:
        vecs = np.asarray(self.embedder.encode(texts), dtype=np.float32)
        if self._w.dim and vecs.shape[1] != self._w.dim:
            raise ValueError(f"the embedder gives {vecs.shape[1]}-dim vectors but the pool "
                             f"{self.keys.log} holds {self._w.dim}-dim ones: it was built with "
                             "another embedding model")
        return vecs

    def restore(self) -> int:
        """Put back the durable file's entries that Redis no longer holds (it lost its data);
        returns how many. A no-op when Redis has them all."""
        if not self.durable:
            return 0
        entries = self.durable.read()
        if not entries or self.size() >= len(entries):
            return 0
        args: list = [self.max_pool]
        for raw in entries:
            try:
                args += [_unpack_entry(raw)[0].exp_id, raw]
            except Exception as exc:  # a torn or foreign entry: skip it, keep the rest
                self._skip_corrupt(exc)
        codes = self._append(keys=[self.keys.log, self.keys.ids], args=args)
        restored = sum(int(c) == 1 for c in codes)
        if restored:
            log.warning("experience pool: restored %d entries from %s", restored,
                        self.durable.path)
        self.refresh()
        return restored

    # --- counters ---

    def record_use(self, exp_ids: Sequence[str], success: bool) -> None:
        """Count one rollout that had ``exp_ids`` injected (each id once)."""
        ids = list(dict.fromkeys(exp_ids))
        if not ids:
            return
        pipe = self.r.pipeline(transaction=True)  # all of a rollout's counts, or none
        for exp_id in ids:
            pipe.hincrby(self.keys.uses, exp_id, 1)
            if success:
                pipe.hincrby(self.keys.successes, exp_id, 1)
        pipe.execute()

    def _counts(self, exp_ids: list[str]) -> list[tuple[int, int]]:
        pipe = self.r.pipeline(transaction=False)
        pipe.hmget(self.keys.uses, exp_ids)
        pipe.hmget(self.keys.successes, exp_ids)
        uses, successes = pipe.execute()
        return [(int(u or 0), int(s or 0)) for u, s in zip(uses, successes)]

    def _filled(self, row: int, uses: int, successes: int) -> Experience:
        # A copy: callers may keep or change it without touching the local copy.
        return dataclasses.replace(self._exps[row], uses=uses, successes=successes)

    # --- reading ---

    def retrieve(self, query: str, top_k: int = 3, min_similarity: float = 0.5,
                 kind_order: Sequence[str] = (), env_tag: str = "") -> list[tuple[Experience,
                                                                              float]]:
        """Up to ``top_k`` (experience, cosine) whose when_to_use matches ``query``, best first;
        equal similarities go to the kind listed earlier in ``kind_order`` (unlisted kinds
        last), then the higher utility, then the older experience. With ``env_tag`` (an env
        mix's ``env:<member>``), an experience tagged with another member's is never
        returned (one drawn in no member's, from before the mix, may be)."""
        self._maybe_refresh()
        if not self._exps or top_k <= 0:
            return []
        sims = self._w.view() @ self._embed([query])[0]
        rows = np.flatnonzero(sims >= min_similarity)
        if env_tag:
            rows = rows[[_of_env(self._exps[i].tags, env_tag) for i in rows]] if rows.size \
                else rows
        if not rows.size:
            return []
        key = np.round(sims[rows], _TIE_DECIMALS)
        order = np.argsort(-key, kind="stable")
        rows, key = rows[order], key[order]
        # Counters are read for the top k and whatever ties the k-th, no more.
        n = int(np.sum(key >= key[min(top_k, len(rows)) - 1]))
        rows, key = rows[:n], key[:n]
        counts = self._counts([self._exps[i].exp_id for i in rows])
        rank = {kind: i for i, kind in enumerate(kind_order)}
        exps = [self._exps[i] for i in rows]
        ranked = sorted(range(n), key=lambda j: (-key[j], rank.get(exps[j].kind, len(rank)),
                                                 -utility(*counts[j]), exps[j].created_at,
                                                 rows[j]))
        return [(self._filled(rows[j], *counts[j]), float(sims[rows[j]]))
                for j in ranked[:top_k]]

    def get(self, exp_id: str) -> Experience | None:
        self.refresh()
        row = self._index.get(exp_id)
        if row is None:
            return None
        return self._filled(row, *self._counts([exp_id])[0])

    def all(self) -> list[Experience]:
        """Every stored experience, oldest first, with its counters."""
        self.refresh()
        pipe = self.r.pipeline(transaction=False)
        pipe.hgetall(self.keys.uses)
        pipe.hgetall(self.keys.successes)
        uses, successes = pipe.execute()
        uses, successes = _str_keys(uses), _str_keys(successes)
        return [self._filled(row, int(uses.get(e.exp_id, 0)), int(successes.get(e.exp_id, 0)))
                for row, e in enumerate(self._exps)]

    def size(self) -> int:
        """Entries in the log (corrupt ones included); needs no refresh."""
        return self.r.llen(self.keys.log)

    def stats(self) -> dict[str, int]:
        """For metrics: ``size``, ``corrupt`` and ``kind/<kind>`` counts."""
        self.refresh()
        out = {"size": self.size(), "corrupt": self.corrupt}
        kinds = Counter(e.kind for e in self._exps)
        out.update({f"kind/{k}": n for k, n in sorted(kinds.items())})
        return out


class DurableLog:
    """An append-only file of pool entries, each as one msgpack ``bin`` object.

    One ``write`` per batch on an ``O_APPEND`` descriptor; a writer killed mid-write leaves a
    torn last object, which :meth:`read` drops.
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)

    def append(self, entries: Sequence[bytes]) -> None:
        if not entries:
            return
        data = b"".join(msgpack.packb(e, use_bin_type=True) for e in entries)
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)

    def read(self) -> list[bytes]:
        if not self.path.exists():
            return []
        unpacker = msgpack.Unpacker(raw=False, max_buffer_size=1 << 30)
        unpacker.feed(self.path.read_bytes())
        out = []
        try:
            for item in unpacker:
                if isinstance(item, bytes):
                    out.append(item)
        except (msgpack.ExtraData, ValueError) as exc:
            log.warning("%s: stopped at an undecodable entry (%s)", self.path, exc)
        return out


ENV_TAG = "env:"  # a tag naming the env-mix member an experience was drawn in


def env_tag(task: Task) -> str:
    """``env:<member>`` for a task of an env mix (``Task.meta["env_member"]``), else ""."""
    member = task_member(task)
    return f"{ENV_TAG}{member}" if member else ""


def _of_env(tags: Sequence[str], env_tag: str) -> bool:
    """Whether an experience with ``tags`` may be shown in the env ``env_tag`` names."""
    prefix = env_tag.partition(":")[0] + ":"
    return all(t == env_tag or not t.startswith(prefix) for t in tags)


def _str_keys(counts: dict) -> dict[str, bytes]:
    return {k.decode() if isinstance(k, bytes) else k: v for k, v in counts.items()}


def _prepared(exp: Experience) -> Experience:
    """A copy ready to store: an id when it has none, a creation time, zero counters."""
    return dataclasses.replace(
        exp, exp_id=exp.exp_id or experience_id(exp.when_to_use, exp.content),
        created_at=exp.created_at or time.time(), uses=0, successes=0)


def open_pool(cfg, prefix: str | None = None, embedder=None,
              run_dir: str | Path | None = None) -> ExperiencePool:
    """The pool of a run (``RunConfig``): its Redis, its prefix (or ``prefix``), its settings.
    Writers pass ``run_dir`` so what they add is also kept in ``<run_dir>/experiences.log``."""
    from inference.embedder import Embedder

    xc = cfg.experience
    return ExperiencePool.connect(cfg.redis.url, prefix or cfg.redis.prefix,
                                  embedder or Embedder(xc.embedder_path),
                                  dedup_similarity=xc.dedup_similarity, max_chars=xc.max_chars,
                                  max_pool=xc.max_pool,
                                  durable_path=RunDir(run_dir).experiences if run_dir else None)
