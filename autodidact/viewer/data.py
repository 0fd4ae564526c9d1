"""What each view of ``autodidact view`` shows, read from one run directory (read-only).

Every function returns a JSON-able dict or raises :class:`ViewError` with one line for the page.
Nothing here writes into the run directory; the run's Redis password, read to ask the live
run's Redis, never enters a reply (:func:`scrub` is applied by the server to every reply).
"""

from __future__ import annotations

import functools
import json
import math
import re
import threading
import time
import unicodedata
import urllib.parse
import zlib
from dataclasses import asdict
from functools import cached_property
from pathlib import Path

import numpy as np

from autodidact import diagnosis, report, status_cli, task_origins
from autodidact.task_mix import frontier_weight
from autodidact.viewer.groups import GroupIndex, ViewError, origin_of
from learner.advantages import composite_step_advantages, grpo_advantages
from protocol import codec
from protocol.config import RunConfig, load_config, url_password
from protocol.errors import SchemaError
from protocol.messages import Group, StepLabels
from protocol.run_dir import RunDir
from questioning.coverage import task_kinds
from replay.store import GroupRecord

MAX_PER_PAGE = 200
SECRETS_EVERY_S = 1.0  # a run without a password yet is looked at again this often
# A request brings the group index up to date for at most this long; the background indexer
# does the rest, so a big store's tasks-by-origin table fills in over a few refreshes.
REQUEST_INDEX_S = 0.5
# One for every run served: transformers' lazy module is not safe to import from two threads.
_TOKENIZER_LOCK = threading.Lock()


class RunView:
    """One run directory as the viewer reads it."""

    def __init__(self, path: Path, label: str):
        self.path, self.label = Path(path), label
        self.groups = GroupIndex(self.path, mask=lambda text: self.scrubber().text(text))
        self._tokenizer = None
        self._secrets: list[str] = []
        self._secrets_read_at = -math.inf

    def check(self) -> None:
        if not self.path.is_dir():
            raise ViewError(f"{self.path}: no such run directory; start `autodidact view` with "
                            "--run-dir pointing at one", 404)
        if not RunDir(self.path).config.exists():
            raise ViewError(f"{self.path}: no config.yaml yet; the run is being set up, look "
                            "again in a moment", 404)

    @cached_property
    def config(self) -> RunConfig:
        try:
            return load_config(RunDir(self.path).config)
        except Exception:  # a config this build cannot read: defaults, said in the notes
            return RunConfig()

    def secrets(self) -> list[str]:
        """The run's Redis password, however it is found. Read until found (at most every
        SECRETS_EVERY_S: the indexer asks for each group it summarizes), then kept: every
        reply is scrubbed with it, and a run's password does not change."""
        if not self._secrets and time.monotonic() - self._secrets_read_at > SECRETS_EVERY_S:
            self._secrets = self._read_secrets()
            self._secrets_read_at = time.monotonic()
        return self._secrets

    def scrubber(self) -> Scrubber:
        return Scrubber.of(tuple(self.secrets()))

    def _read_secrets(self) -> list[str]:
        cfg, _ = status_cli.read_config(self.path)
        url, _ = status_cli.redis_target(self.path, cfg)
        found = [url_password(url)] if url else []
        pw = RunDir(self.path).redis_password
        if pw.exists():
            found.append(pw.read_text().strip())
        return [s for s in found if s]

    # --- the run ------------------------------------------------------------------------------

    def overview(self) -> dict:
        self.check()
        snap = status_cli.collect(self.path, replay_timeout_s=0.5, groups=self.groups,
                                  origins_budget_s=REQUEST_INDEX_S)
        snap["label"] = self.label
        snap["summary"] = {s: _interval(self.summary().get(f"success_{s}"))
                           for s in ("base", "warm", "rl")}
        return snap

    def summary(self) -> dict:
        try:
            return json.loads(RunDir(self.path).summary.read_text())
        except (OSError, ValueError):
            return {}

    def curves(self) -> dict:
        """Every plot of ``autodidact report`` that has a series: first those of "Why RL moved
        or stalled" (``section`` "why"), then the rest; the likely cause (``diagnosis``), and
        the series the why plots lack with the reason (``missing``)."""
        self.check()
        run = report.Run.load(self.path, self.label)
        missing: list[str] = []
        per_env, _ = report.env_plots([run])  # an env mix: success per member env
        why = report.WHY_PLOTS[:1] + ([per_env] if per_env else []) + report.WHY_PLOTS[1:]
        plots = [_plot_json(run, plot, "why", missing) for plot in why] + \
            [_plot_json(run, plot, "run") for plot in report.PLOTS]
        final = report.headline(run)["updates"] or 0
        heldout = [{"stage": stage, "x": x, **_interval(run.summary.get(f"success_{stage}"))}
                   for stage, x in (("base", 0), ("warm", 0), ("rl", final))
                   if run.summary.get(f"success_{stage}")]
        found = diagnosis.run_diagnosis(self.path, run.records, run.summary)
        return {"label": self.label, "plots": [p for p in plots if p], "heldout": heldout,
                "diagnosis": found.to_json(), "missing": missing}

    # --- groups -------------------------------------------------------------------------------

    def group(self, group_id: str) -> dict:
        self.check()
        group, labels, rec = self._read_group(group_id)
        cfg = self.config.learner
        label_rows = labels.labels if labels else None
        # As the learner computed them: centred, and divided by the group's std unless
        # learner.advantage_std=none.
        outcome_adv = grpo_advantages([t.reward for t in group.trajectories],
                                      std=cfg.advantage_std)
        if label_rows is not None and cfg.advantage == "composite":
            alpha = cfg.alpha_at(max(rec.max_version, 0))
            step_adv = composite_step_advantages(label_rows, [t.reward for t in
                                                              group.trajectories], alpha,
                                                 std=cfg.advantage_std)
            how = f"composite (judge labels, alpha {alpha:.3g}, plus outcome)"
        else:
            step_adv = [np.full(len(t.steps), a) for t, a in zip(group.trajectories,
                                                                 outcome_adv)]
            how = "outcome only (GRPO)" + ("" if label_rows is not None else ": not judged")
        reasons = (labels.info.get("reasons") if labels else None) or []
        rollouts = [self._rollout(i, t, outcome_adv[i], step_adv[i],
                                  label_rows[i] if label_rows else None,
                                  reasons[i] if i < len(reasons) else None)
                    for i, t in enumerate(group.trajectories)]
        task = asdict(group.task)
        task["origin"], task["kinds"] = _origin(task), task_kinds(group.task)
        return {"group_id": group.group_id, "actor_id": group.actor_id,
                "created": group.created_at, "task": task,
                "record": {k: getattr(rec, k) for k in (
                    "seq", "judged", "delivered", "consumed", "set_aside", "outcome_equal",
                    "labels_equal", "min_version", "max_version")},
                "judge": {"name": labels.judge, "info": labels.info} if labels else None,
                "advantage": how, "rollouts": rollouts}

    def _read_group(self, group_id: str) -> tuple[Group, StepLabels | None, GroupRecord]:
        with self.groups.reading() as store, store.begin_read() as txn:
            raw_rec = txn.get(group_id.encode(), db=store.db["index"])
            body, labels = store.body(txn, group_id), store.labels(txn, group_id)
            body = None if body is None else bytes(body)
            labels = None if labels is None else bytes(labels)
        if raw_rec is None or body is None:
            raise ViewError(f"no group {group_id!r} in {self.path.name}: it was never stored "
                            "or has been evicted; the Groups list shows what is stored", 404)
        rec = GroupRecord.unpack(raw_rec)
        damaged = f"group {group_id} is damaged: %s; `autodidact replay check --run-dir " \
                  f"{self.path}` lists every damaged group"
        if rec.crc32 >= 0 and zlib.crc32(body) != rec.crc32:
            raise ViewError(damaged % "its body does not match its checksum", 422)
        try:
            group = codec.decode_body(Group.TYPE, body)
            step_labels = codec.decode_body(StepLabels.TYPE, labels) if labels else None
        except SchemaError as exc:
            raise ViewError(damaged % f"it does not decode ({exc})", 422) from None
        if step_labels and rec.labels_crc32 >= 0 and zlib.crc32(labels) != rec.labels_crc32:
            raise ViewError(damaged % "its labels do not match their checksum", 422)
        return group, step_labels, rec

    def _rollout(self, index, traj, outcome_adv, step_adv, labels, reasons) -> dict:
        turns = [{"index": j, "action": s.action, "thought": s.thought,
                  "observation": s.observation, "valid": s.valid, "info": s.info,
                  "label": None if labels is None or j >= len(labels) else int(labels[j]),
                  "reason": reasons[j] if reasons and j < len(reasons) else None,
                  "advantage": _finite(float(step_adv[j])) if j < len(step_adv) else None}
                 for j, s in enumerate(traj.steps)]
        lo, hi = (traj.experience_span + [0, 0])[:2]
        experience = None
        if traj.experience_ids or hi > lo:
            experience = {"ids": list(traj.experience_ids),
                          "text": self.decode(traj.tokens[lo:hi]) if hi > lo else "",
                          "stripped": self.config.experience.train_context == "discard"}
        return {"index": index, "traj_id": traj.traj_id, "reward": traj.reward,
                "success": traj.success, "advantage": _finite(float(outcome_adv)),
                "versions": list(traj.policy_versions()), "tokens": len(traj.tokens),
                "experience": experience, "info": traj.info, "turns": turns}

    # --- tokens -------------------------------------------------------------------------------

    def tokens(self, group_id: str, traj_index: int) -> dict:
        self.check()
        group, _, _ = self._read_group(group_id)
        if not 0 <= traj_index < len(group.trajectories):
            raise ViewError(f"group {group_id} has rollouts 0 to "
                            f"{len(group.trajectories) - 1}, not {traj_index}", 404)
        traj = group.trajectories[traj_index]
        from learner.token_log import read_token_log

        seen = read_token_log(self.path, group_id)
        learner = None
        if seen is not None and traj_index < len(seen["logprobs"]) and \
                len(seen["logprobs"][traj_index]) == len(traj.tokens):
            learner = seen["logprobs"][traj_index]
        # A secret in the rollout spreads over tokens, a part in each row: masked across them.
        texts = self.scrubber().pieces(self.token_texts(traj.tokens))
        rows = []
        for i, text in enumerate(texts):
            generated = bool(traj.action_mask[i])
            row = {"text": text, "generated": generated,
                   "logprob": _finite(float(traj.logprobs[i])) if generated else None,
                   "version": int(traj.versions[i]), "learner_logprob": None, "ratio": None}
            if learner is not None and generated and math.isfinite(float(learner[i])):
                row["learner_logprob"] = float(learner[i])
                row["ratio"] = _finite(math.exp(float(learner[i]) - float(traj.logprobs[i])))
            rows.append(row)
        lo, hi = (traj.experience_span + [0, 0])[:2]
        return {"group_id": group_id, "traj": traj_index, "prompt_len": traj.prompt_len,
                "experience_span": [lo, hi], "tokens": rows,
                "learner": {"seen": learner is not None,
                            "version": seen["version"] if seen else None,
                            "note": "" if learner is not None else
                            "the learner has not trained on this group, or its record was "
                            f"pruned (learner.token_log_groups keeps the newest "
                            f"{self.config.learner.token_log_groups})"}}

    def warm(self) -> None:
        from learner import token_log  # noqa: F401 (imported ahead of the first token view)

        _ = self.tokenizer

    def token_texts(self, ids) -> list[str]:
        tok = self.tokenizer
        if tok is None:
            return [f"<{int(i)}>" for i in ids]
        return [tok.decode([int(i)]) for i in ids]

    def decode(self, ids) -> str:
        tok = self.tokenizer
        return tok.decode([int(i) for i in ids]) if tok is not None else \
            " ".join(f"<{int(i)}>" for i in ids)

    @property
    def tokenizer(self):
        """The run's tokenizer: the warm-started policy's, else the base model's. Loaded under
        a lock: a request beside the warm-up thread would see transformers half imported."""
        with _TOKENIZER_LOCK:
            return self._load_tokenizer()

    def _load_tokenizer(self):
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            run = RunDir(self.path)
            for folder in (run.policy_init, run.path / "model", run.policy_final):
                if (folder / "tokenizer.json").exists() or \
                        (folder / "tokenizer_config.json").exists():
                    self._tokenizer = AutoTokenizer.from_pretrained(str(folder))
                    break
        return self._tokenizer

    # --- tasks --------------------------------------------------------------------------------

    def tasks(self, params) -> dict:
        self.check()
        origins = task_origins.run_origins(self.path, self.groups, budget_s=REQUEST_INDEX_S)
        outcomes, source = self._task_outcomes()
        floor = self.config.tasks.frontier_floor
        pool = self._task_pool()
        text, want = params.get("q", "").strip().lower(), params.get("source", "")
        rows = [t for t in pool if (not want or t["source"] == want)
                and (not text or text in f"{t['task_id']}\n{t['query']}".lower())]
        page, per_page = page_params(params)
        for t in rows[page * per_page:(page + 1) * per_page]:
            ok, n = outcomes.get(t["task_id"], (0, 0))
            t.update(successes=ok, trials=n, rate=ok / n if n else None,
                     frontier_weight=frontier_weight(ok, n, floor))
        return {"total": len(rows), "page": page, "per_page": per_page,
                "outcomes_from": source, "curriculum": self.config.tasks.curriculum,
                "tasks": rows[page * per_page:(page + 1) * per_page],
                "coverage": self._coverage(pool), "origins": origins}

    def _task_pool(self) -> list[dict]:
        from questioning.task_store import TaskStore, exists

        rows = []
        if exists(self.path):
            with TaskStore(self.path, readonly=True) as store:
                for task in store.all():
                    rows.append({"task_id": task.task_id, "source": task.source,
                                 "query": task.query, "kinds": task_kinds(task),
                                 "origin": _origin(asdict(task)), "steps": len(task.reference),
                                 "verified": bool(task.reference)})
        try:
            split = json.loads(RunDir(self.path).split.read_text())
        except (OSError, ValueError):
            split = {}
        queries = self.groups.task_queries()
        for task_id in split.get("train", []):
            rows.append({"task_id": task_id, "source": "original",
                         "query": queries.get(task_id, ""), "kinds": [],
                         "origin": "hand-written", "steps": None, "verified": True})
        return rows

    def _task_outcomes(self) -> tuple[dict, str]:
        cfg, _ = status_cli.read_config(self.path)
        url, prefix = status_cli.redis_target(self.path, cfg)
        if url:
            import redis

            from protocol.control import ControlPlane

            client = status_cli.quick_redis(url)
            try:
                return (ControlPlane(client, prefix).task_outcomes(),
                        "the feeder's counts (the run's Redis)")
            except (redis.RedisError, OSError):  # the run ended: count the stored groups
                pass
            finally:
                client.close()
        return self.groups.task_outcomes(), "the stored groups (the run's Redis is not up)"

    def _coverage(self, pool: list[dict]) -> dict:
        try:
            saved = json.loads(RunDir(self.path).coverage.read_text())
        except (OSError, ValueError):
            saved = {}
        kinds: dict[str, int] = {}
        synthetic = [t for t in pool if t["source"] == "synthetic"]
        for t in synthetic:
            for kind in t["kinds"]:
                kinds[kind] = kinds.get(kind, 0) + 1
        return {"synthetic_tasks": len(synthetic), "kinds": kinds,
                "tools": saved.get("tools", {}), "explore": saved}


def page_params(params, default: int = 50) -> tuple[int, int]:
    try:
        page, per_page = int(params.get("page", 0)), int(params.get("per_page", default))
    except ValueError:
        raise ViewError("page and per_page are whole numbers", 400) from None
    if page < 0 or not 1 <= per_page <= MAX_PER_PAGE:
        raise ViewError(f"page >= 0 and per_page from 1 to {MAX_PER_PAGE}", 400)
    return page, per_page


def _origin(task: dict) -> str:
    return origin_of(task)[0]


def _interval(result: dict | None) -> dict:
    result = result or {}
    return {"avg": result.get("avg"), "ci": result.get("avg_ci"), "best": result.get("best"),
            "best_ci": result.get("best_ci"), "tasks": result.get("tasks"),
            "split": result.get("split")}


def _finite(x):
    return x if isinstance(x, (int, float)) and math.isfinite(x) else None


MASK = "***"


class Scrubber:
    """Masks the run's secrets in whatever encoding a reply can carry them: raw, JSON- or
    Python-escaped (``\\"``, ``\\\\``, ``\\u00e9``, surrogate pairs, ``\\x``), escaped
    again, percent-encoded (either hex case, ``%25`` for an encoding encoded again, ``+`` for a
    space), as HTML character references, and any mix of these within one secret. Each
    secret is matched as itself, URL-decoded (a ``redis.url`` holds its password encoded) and
    in its Unicode normal forms.

    The server applies it to a reply's data before serialising (:meth:`data`) and to the
    serialised text (:meth:`text`); the token view masks a secret spread over several tokens
    (:meth:`pieces`)."""

    def __init__(self, secrets):
        forms = set()
        for secret in secrets:
            for s in (secret, urllib.parse.unquote(secret), urllib.parse.unquote_plus(secret)):
                forms.update(unicodedata.normalize(f, s) for f in ("NFC", "NFD", "NFKC"))
                forms.add(s)
        forms.discard("")
        # Every encoding starts with the character itself, a backslash, %, & or + (a space):
        # a look at the first character skips most positions (4x faster on a long reply).
        first = "".join(sorted({re.escape(f[0]) for f in forms} | {r"\\", "%", "&", r"\+"}))
        self.pattern = re.compile(f"(?=[{first}])(?:" + "|".join(
            "".join(_char_forms(ch) for ch in s) for s in sorted(forms, key=len, reverse=True))
            + ")") if forms else None

    @staticmethod
    @functools.lru_cache(maxsize=16)
    def of(secrets: tuple[str, ...]) -> Scrubber:
        """The scrubber of ``secrets``, compiled once."""
        return Scrubber(secrets)

    def text(self, text: str) -> str:
        return text if self.pattern is None else self.pattern.sub(MASK, text)

    def data(self, value):
        """``value`` (JSON-able: dicts, lists, strings, numbers) with every string masked."""
        if self.pattern is None:
            return value
        if isinstance(value, str):
            return self.text(value)
        if isinstance(value, dict):
            return {self.data(k) if isinstance(k, str) else k: self.data(v)
                    for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [self.data(v) for v in value]
        return value

    def pieces(self, pieces: list[str]) -> list[str]:
        """``pieces`` (a text cut into tokens) with every character of a secret that runs
        across them replaced by ``*``: each token's own text can hold only a part of it."""
        if self.pattern is None:
            return pieces
        joined = "".join(pieces)
        hidden = [m.span() for m in self.pattern.finditer(joined)]
        if not hidden:
            return pieces
        out, start = [], 0
        for piece in pieces:
            end = start + len(piece)
            chars = list(piece)
            for lo, hi in hidden:
                for i in range(max(lo, start), min(hi, end)):
                    chars[i - start] = "*"
            out.append("".join(chars))
            start = end
        return out


def _plot_json(run: report.Run, plot: report.Plot, section: str,
               missing: list[str] | None = None) -> dict | None:
    """``plot``'s panels with the lines ``run`` has (None when it has none); a line it lacks
    is named with its reason in ``missing``."""
    panels = []
    for panel in plot.panels:
        lines = []
        for line in panel.lines:
            xs, ys = run.series(line)
            if xs:
                lines.append({"metric": line.metric, "x_axis": line.x,
                              "x": xs, "y": [_finite(y) for y in ys]})
            elif missing is not None:
                missing.append(f"{line.metric}: {report.missing_reason(run, line)}")
        if lines:
            panels.append({"ylabel": panel.ylabel, "log_y": panel.log_y, "lines": lines})
    if not panels:
        return None
    return {"name": plot.name, "title": plot.title, "about": plot.about, "section": section,
            "panels": panels}


def scrub(text: str, secrets: list[str]) -> str:
    return Scrubber(secrets).text(text)


def _hex(n: int, width: int) -> str:
    return "".join(f"[{c}{c.upper()}]" if c.isalpha() else c for c in f"{n:0{width}x}")


_NAMED_ESCAPES = {"\n": "n", "\t": "t", "\r": "r", "\b": "b", "\f": "f", "\v": "v",
                  "\0": "0", "\a": "a"}
_HTML_NAMES = {"&": "amp", "<": "lt", ">": "gt", '"': "quot", "'": "apos"}


def _char_forms(ch: str) -> str:
    """A regular expression for ``ch`` in any one of the encodings :class:`Scrubber` names."""
    cp, esc = ord(ch), r"\\+"  # one backslash or more: an escape, or one escaped again
    units = [cp] if cp < 0x10000 else [0xD800 + ((cp - 0x10000) >> 10),
                                       0xDC00 + ((cp - 0x10000) & 0x3FF)]
    forms = [re.escape(ch), esc + re.escape(ch),  # \" \\ \' \/
             "".join(esc + "u" + _hex(u, 4) for u in units), esc + "U" + _hex(cp, 8),
             "".join("%(?:25)*" + _hex(b, 2) for b in ch.encode("utf-8", "surrogatepass")),
             f"&#0*{cp};", "&#[xX]0*" + _hex(cp, 1) + ";"]
    if cp < 0x100:
        forms.append(esc + "x" + _hex(cp, 2))
    if ch in _NAMED_ESCAPES:
        forms.append(esc + _NAMED_ESCAPES[ch])
    if ch in _HTML_NAMES:
        forms.append(f"&{_HTML_NAMES[ch]};")
    if ch == " ":
        forms.append(r"\+")
    return "(?:" + "|".join(forms) + ")"
