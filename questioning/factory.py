"""The explore role: explore seeds, build the profile, synthesize and store verified tasks.

Run alone (``autodidact explore``) or by ``autodidact run`` as a stage before training and,
with ``explore.stage=alongside``, as a role that keeps adding tasks while training runs.
Everything lands in the run directory: ``explore/explorations.jsonl`` (every action,
observation and state snapshot), ``explore/profile.json`` and ``tasks.lmdb``; with Redis, the
survivors are also added to the run's synthetic task pool.
"""

from __future__ import annotations

import json
import logging
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from environments.base import env_class, env_maker, verify_task
from protocol.config import RunConfig
from protocol.messages import Task
from protocol.run_dir import RunDir
from questioning.coverage import coverage, read_refused, task_kinds, tools_used
from questioning.coverage import render as render_coverage
from questioning.decontamination import CONTAMINATED, HeldOutIndex
from questioning.explorer import (
    UNLOCK,
    Exploration,
    Explorer,
    ExploreSettings,
    LLMProposer,
    seed_tasks,
)
from questioning.probes import PROBE_MAKES
from questioning.profile import ProfileBuilder, build_profile, render_toc, save_json
from questioning.regrounding import ExampleRegrounder
from questioning.synthesis import (
    HindsightSynthesizer,
    LLMSynthesizer,
    Preferences,
    TaskDeduper,
    llm_solves,
)

log = logging.getLogger(__name__)

GIVE_UP_AFTER = 20  # probes of one kind that made no task of it: that kind is not run again
PROBE_SHARE_MAX = 0.5  # of the explorations of one explore run
# A failing tool used by this share of the stored tasks that the median tool is used by gets
# no more unlock probes: the probes balance tools, not maximize one.
UNLOCKED_SHARE = 0.5


def explorations_path(run_dir: Path) -> Path:
    return RunDir(run_dir).explorations


def profile_path(run_dir: Path) -> Path:
    return RunDir(run_dir).profile


def append_exploration(run_dir: Path, exp: Exploration) -> None:
    path = explorations_path(run_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("ab+") as f:
        # A line a crash cut short must not swallow the next record.
        f.seek(0, 2)
        cut = f.tell() > 0 and (f.seek(-1, 2), f.read(1))[1] != b"\n"
        f.write((b"\n" if cut else b"") + json.dumps(exp.to_dict()).encode() + b"\n")


def read_explorations(run_dir: Path) -> list[Exploration]:
    path = explorations_path(run_dir)
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(Exploration.from_dict(json.loads(line)))
        except (ValueError, TypeError):  # a line cut short by a crash: skip, keep the rest
            log.warning("skipping a damaged line of %s", path)
    return out


def preferences(cfg: RunConfig) -> Preferences:
    e = cfg.explore
    return Preferences(min_steps=e.min_steps, max_steps=e.max_steps or cfg.env.max_turns,
                       max_entities=e.max_entities, max_parts=e.max_parts,
                       difficulty=e.difficulty, style=e.style)


def explore_settings(cfg: RunConfig) -> ExploreSettings:
    e = cfg.explore
    return ExploreSettings(e.breadth_steps, e.depth_steps, e.breadth_temperature,
                           e.depth_temperature, e.context_observations, e.probe_steps)


def make_chat(cfg: RunConfig, policy_path: str | None, run_dir: Path | None = None):
    """The proposer's chat model per ``explore.proposer``, or None for schema sampling only."""
    choice = cfg.explore.proposer
    if choice == "auto":
        choice = "llm" if cfg.llm.url else ("policy" if policy_path else "schema")
    if choice == "llm":
        if not cfg.llm.url:
            raise ValueError("explore.proposer=llm needs llm.url (an OpenAI-compatible endpoint)")
        from inference.llm import OpenAIChat

        replies = RunDir(run_dir).llm_replies("proposer") if run_dir is not None else None
        chat = OpenAIChat.from_config(cfg.llm, reply_log=replies)
        chat.name = f"llm:{cfg.llm.model}"
        return chat
    if choice == "policy":
        if not policy_path:
            raise ValueError("explore.proposer=policy needs a model (model.path)")
        from inference.engines import make_backend
        from inference.policy_chat import PolicyChat

        backend = make_backend(cfg, policy_path)  # the engine actor.backend names
        if run_dir is not None:
            _load_trained_policy(backend, run_dir)
        return PolicyChat(backend, max_context=cfg.model.max_positions, seed=cfg.seed)
    return None


def _load_trained_policy(backend, run_dir: Path) -> None:
    """The policy as trained so far: the run's newest published version (a whole model, or
    an adapter over this base) when there is one, so a proposer started mid-run asks with the
    current policy, not the initial one."""
    from protocol.weights import apply_update, newest_published

    update = newest_published(run_dir)
    if update is None:
        return
    if update.adapter is not None and update.adapter.base_sha256 != backend.base_sha256:
        log.warning("proposer: v%d is an adapter for another base (%s); asking with the base",
                    update.version, update.adapter.base_id)
        return
    apply_update(backend, update)
    log.info("proposer: the policy at version %d%s", update.version,
             " (LoRA adapter)" if update.adapter else "")


class TaskFactory:
    """Explores seeds and turns every exploration into verified, de-duplicated tasks.

    ::

        for each round, seed, and exploration of that seed:
            exploration = explorer.explore(seed)                 -> explorations.jsonl
            profile.add(exploration)
            candidates = hindsight(exploration) + llm(exploration, tasks of this seed)
            keep, best first: verified in a fresh env, within the preferences, no held-out
            task in disguise (decontamination.py), not a duplicate
            store.put_many(keep); redis synthetic pool += keep
            explorer favours tools few stored tasks use, gaps above all (coverage)
        save profile.json and coverage.json; log explore/... metrics
    """

    def __init__(self, cfg: RunConfig, run_dir: Path, store, chat=None, control=None,
                 metrics=None, say: Callable[[str], None] = print):
        self.cfg, self.run_dir, self.store = cfg, Path(run_dir), store
        self.control, self.metrics, self.say = control, metrics, say
        self.make_env = env_maker(cfg.env)
        self.env_cls, self.env_options = env_class(cfg.env), dict(cfg.env.options)
        self.prefs = preferences(cfg)
        self.chat = chat
        self.counts: Counter = Counter()
        self.dedup = TaskDeduper(cfg.explore.dedup_jaccard)
        self.by_seed: dict[int, list[Task]] = {}
        self.tool_uses: Counter = Counter()  # stored tasks using each tool (coverage)
        self.kinds: Counter = Counter()  # stored tasks by kind of goal (coverage)
        self.probes_run: Counter = Counter()  # goal-directed explorations by probe
        self.probes_made: Counter = Counter()  # tasks of its kind each probe made
        for task in store.all():
            self.dedup.add(task)
            self._index(task)
        past = read_explorations(self.run_dir)
        self.profile = ProfileBuilder(self.make_env())
        self.heldout = HeldOutIndex.of_env(self.profile.env)
        self.refused_before = Counter(read_refused(self.run_dir) or {})
        self.next_index: Counter = Counter()
        for exp in past:
            self.profile.add(exp)
            self.next_index[exp.seed] += 1
        e = cfg.explore
        llm = None
        if chat is not None:
            llm = LLMProposer(chat, self.profile.env.tools(), getattr(chat, "name", "llm"),
                              e.probe_calls, e.min_valid_fraction, self.toc)
        self.explorer = Explorer(self.make_env, explore_settings(cfg), seed=cfg.seed + len(past),
                                 llm=llm)
        self.hindsight = HindsightSynthesizer(self.make_env, self.prefs,
                                              e.candidates_per_exploration, seed=cfg.seed)
        self.regrounder = (ExampleRegrounder(self.make_env, self.profile.env.tasks("train"),
                                             e.from_examples, seed=cfg.seed)
                           if e.from_examples else None)
        regrounding = self.regrounder is not None and bool(self.regrounder.examples)
        self.uses_hindsight = e.hindsight == "always" or (e.hindsight == "auto" and not regrounding)
        if not self.uses_hindsight and not regrounding:
            raise ValueError(f"explore.hindsight=never and env {cfg.env.name!r} has no training "
                             "task to re-ground (explore.from_examples): explore would make "
                             "no task; set explore.hindsight=auto")
        self.llm_synth = (LLMSynthesizer(chat, self.make_env, self.prefs, self.toc,
                                         cfg.llm.temperature) if chat is not None else None)
        self.seeds = seed_tasks(self.profile.env, e.seeds)

    def toc(self) -> str:
        return render_toc(self.profile.to_dict())

    def _index(self, task: Task) -> None:
        """Count a stored task in (the deduper already holds it)."""
        self.by_seed.setdefault(task.seed, []).append(task)
        self.tool_uses.update(tools_used(task))
        self.kinds.update(task_kinds(task))

    def run(self, rounds: int, stop: Callable[[], bool] = lambda: False) -> dict:
        """Explore ``rounds`` times over the seeds (0 = until ``stop`` or ``max_tasks``)."""
        t0, done_rounds = time.monotonic(), 0
        if self.chat is not None and self.cfg.explore.proposer != "llm" and not self.cfg.llm.url:
            self._probe_policy()  # the chat is the policy being trained
        self.say(f"explore: {len(self.seeds)} seeds x {self.cfg.explore.explorations_per_seed}"
                 f" explorations, {self.store.count()} tasks stored, proposer "
                 f"{getattr(self.chat, 'name', 'schema sampling')}")
        while not self._finished(rounds, done_rounds, stop):
            for i, seed in enumerate(self.seeds):
                if self._finished(rounds, done_rounds, stop):
                    break
                for _ in range(self.cfg.explore.explorations_per_seed):
                    self.explore_once(seed, self._probe_kind())
                if (i + 1) % 10 == 0 or i + 1 == len(self.seeds):
                    self._progress(t0, done_rounds, i + 1)
            done_rounds += 1
        save_json(self.profile.to_dict(), profile_path(self.run_dir))
        save_json({**self.coverage(), "refused": self.refused()}, RunDir(self.run_dir).coverage)
        return self.summary(time.monotonic() - t0)

    def coverage(self) -> dict:
        """The coverage report over every stored task (questioning/coverage.py)."""
        sampler = self.explorer.sampler
        stored = sum(map(len, self.by_seed.values()))
        tries = {tool: calls for tool, (_, calls) in sampler.effects.items()}
        return coverage(self.profile.env.tools(), sampler.tool_ok, sampler.drafter.tried,
                        self.tool_uses, stored, self.kinds, tries)

    def refused(self) -> dict[str, int]:
        """Candidates refused by reason, over every explore of this run directory (the
        explore report keeps them: a resumed explore adds to what the last one counted)."""
        now = Counter({k.removeprefix("rejected_"): v for k, v in self.counts.items()
                       if k.startswith("rejected_")})
        return dict(sorted((self.refused_before + now).items()))

    def _probe_policy(self) -> None:
        """Ask the policy for ``explore.probe_calls`` actions on the first seed before any
        exploration. A policy that cannot write valid calls (an untrained one) cannot write
        JSON tasks either: both proposers are skipped, which saves nearly all of the time it
        would spend having every reply refused."""
        llm = self.explorer.llm
        llm.quiet = True
        first = self.profile.env.reset(self.seeds[0]) if self.seeds else ""
        for _ in range(self.cfg.explore.probe_calls):
            if not llm.enabled:
                break
            llm.propose("breadth", self.cfg.explore.breadth_temperature, [first])
        llm.quiet = False
        if llm.enabled:
            return
        self.llm_synth, self.chat, self.explorer.llm = None, None, None
        self.counts["proposer_skipped"] = 1
        log.warning("explore: the policy wrote %d of %d valid calls in the probe; exploring "
                    "with schema sampling and hindsight tasks only (set llm.url or "
                    "--proposer-url for an LLM proposer)", llm.valid, llm.valid + llm.invalid)

    def _finished(self, rounds: int, done_rounds: int, stop) -> bool:
        full = self.cfg.explore.max_tasks and self.store.count() >= self.cfg.explore.max_tasks
        return bool(stop() or full or (rounds and done_rounds >= rounds))

    def _probe_kind(self) -> str | None:
        """What the next exploration goes after, when probes are not half the explorations
        already (random walks make most tasks, and the gaps' tools): a tool that keeps
        failing (``unlock:<tool>``, with ``explore.unlock_probes``), else the probe that makes
        the kind of task the store holds the smallest share of, when that share is below
        ``explore.kind_target``; None (a random walk) otherwise.
        A probe that made no task of its kind in ``GIVE_UP_AFTER`` tries is not run again:
        the env cannot make that kind (no ``describe_event``, say); nor is an unlock probe
        whose tool never worked in ``GIVE_UP_AFTER`` of them."""
        probes = sum(self.probes_run.values())
        if probes >= PROBE_SHARE_MAX * (self.counts["explorations"] + 1):
            return None
        return self._unlock_target() or self._kind_probe()

    def _unlock_target(self) -> str | None:
        if not self.cfg.explore.unlock_probes:
            return None
        used = sorted(n for n in self.tool_uses.values() if n)
        enough = UNLOCKED_SHARE * used[len(used) // 2] if used else 1
        for tool in self.explorer.failing_tools():
            probe = UNLOCK + tool
            if self.tool_uses[tool] >= enough:
                continue  # as many stored tasks use it as use a typical tool: enough
            if self.probes_made[probe] or self.probes_run[probe] < GIVE_UP_AFTER:
                return probe
        return None

    def _kind_probe(self) -> str | None:
        target = self.cfg.explore.kind_target
        stored = sum(len(tasks) for tasks in self.by_seed.values())
        if target <= 0:
            return None
        shares = {probe: self.kinds[kind] / max(stored, 1) for probe, kind in PROBE_MAKES.items()
                  if self.probes_made[probe] or self.probes_run[probe] < GIVE_UP_AFTER}
        lacking = {probe: share for probe, share in shares.items() if share < target}
        if not lacking:
            return None
        low = min(lacking.values())
        return self.explorer.rng.choice(sorted(p for p, v in lacking.items() if v == low))

    def explore_once(self, seed: Task, probe: str | None = None) -> list[Task]:
        index = self.next_index[seed.seed]
        self.next_index[seed.seed] += 1
        exp = self.explorer.explore(seed, index, probe)
        if probe is not None:
            self.probes_run[probe] += 1
        if exp is None:  # a served env failed it (counted): the next goes on afresh
            return []
        append_exploration(self.run_dir, exp)
        self.profile.add(exp)
        candidates = self.hindsight.propose(exp) if self.uses_hindsight else []
        if self.regrounder is not None:
            candidates += self.regrounder.propose(seed)
        if self.llm_synth is not None and self._llm_useful():
            candidates += self.llm_synth.propose(exp, self.by_seed.get(exp.seed, []))
        kept = self.keep(candidates)
        if probe is not None:
            self.probes_made[probe] += sum(self._made_by(probe, t) for t in kept)
        if kept:
            self.store.put_many(kept)
            if self.control is not None:
                self.control.add_synthetic(kept)
        self.counts["explorations"] += 1
        self.counts["candidates"] += len(candidates)
        self.counts["tasks"] += len(kept)
        self.explorer.sampler.task_share = {
            name: v["task_share"] for name, v in self.coverage()["tools"].items()}
        return kept

    @staticmethod
    def _made_by(probe: str, task: Task) -> bool:
        """Whether ``task`` is what ``probe`` set out to make: a task of its kind, or for
        ``unlock:<tool>`` one whose reference calls the tool."""
        if probe.startswith(UNLOCK):
            return probe.removeprefix(UNLOCK) in tools_used(task)
        return PROBE_MAKES[probe] in task_kinds(task)

    def _llm_useful(self) -> bool:
        """Stop asking a proposer whose first replies all failed (an untrained policy)."""
        s = self.llm_synth.stats
        asked = sum(v for k, v in s.items() if k.startswith("rejected_")) + s["proposed"]
        return s["proposed"] > 0 or asked < self.cfg.explore.probe_calls

    def keep(self, candidates: list[Task]) -> list[Task]:
        """Verified, preferred, new: best confidence (then fewest steps) first."""
        kept = []
        for task in sorted(candidates, key=lambda t: (-t.meta.get("confidence", 0),
                                                      len(t.reference))):
            ok, reason = verify_task(self.env_cls, task, **self.env_options)
            if not ok:
                self.counts[f"rejected_{reason}"] += 1
                continue
            if not self.prefs.accepts(task):
                self.counts["rejected_preferences"] += 1
                continue
            if self._contaminated(task):
                self.counts[f"rejected_{CONTAMINATED}"] += 1
                continue
            if task.meta.get("method") == "llm" and self.cfg.explore.llm_verify and not \
                    llm_solves(self.chat, self.make_env, task, self.toc(), self.cfg.env.max_turns):
                self.counts["rejected_llm_unsolved"] += 1
                continue
            # The deduper holds every stored task (same id = same seed, goal and query).
            if not self.dedup.add(task):
                self.counts["rejected_duplicate"] += 1
                continue
            self._index(task)
            # What env.name said: "pkg.module:name" lets any command import a plugin's module
            # from the task alone (Task.env holds the registered "name").
            task.meta["env_spec"] = self.cfg.env.name
            kept.append(task)
        return kept

    def _contaminated(self, task: Task) -> bool:
        """Whether ``task`` is a held-out task in disguise (questioning/decontamination.py)."""
        found = self.heldout.find(task)
        if found is not None:
            log.debug("refused %s (%r): %s of held-out %s", task.task_id, task.query,
                      found.why, found.heldout_id)
        return found is not None

    def summary(self, seconds: float) -> dict:
        stats = {**self.counts, **self.explorer.counts}
        for source in (self.hindsight.stats, getattr(self.llm_synth, "stats", {})):
            stats.update({f"synth_{k}": v for k, v in source.items()})
        stats.update({f"examples_{k}": v for k, v in getattr(self.regrounder, "stats", {}).items()})
        return {"seconds": seconds, "tasks_stored": self.store.count(), **stats,
                "refused": self.refused(), "coverage": self.coverage()}

    def _progress(self, t0: float, done_rounds: int, seeds_done: int) -> None:
        elapsed = time.monotonic() - t0
        stored = self.store.count()
        rejects = {k[9:]: v for k, v in self.counts.items() if k.startswith("rejected_")}
        self.say(f"  [{elapsed:5.1f}s] round {done_rounds + 1} seed {seeds_done}/"
                 f"{len(self.seeds)}: {self.counts['explorations']} explorations, "
                 f"+{self.counts['tasks']} tasks ({self.counts['tasks'] / max(elapsed, 1e-9):.0f}"
                 f"/s), {stored} stored; rejected {rejects or 'none'}")
        if self.metrics is not None:
            self.metrics.log({"explorations": self.counts["explorations"],
                              "tasks": self.counts["tasks"], "tasks_stored": stored,
                              "tasks_per_s": self.counts["tasks"] / max(elapsed, 1e-9),
                              "llm_invalid": self.explorer.counts["llm_invalid"],
                              **{f"rejected_{k}": v for k, v in rejects.items()}})


def run_explore(cfg: RunConfig, run_dir: Path, rounds: int | None = None,
                policy_path: str | None = None, say: Callable[[str], None] = print,
                stop: Callable[[], bool] = lambda: False) -> dict:
    """Open the task store (as its one writer), explore, and return the summary. ValueError
    for an env mix (``env.mix``): explore makes one env's tasks."""
    from metrics.jsonl import MetricsWriter

    if cfg.env.mix:
        raise ValueError("env.mix: explore over an env mix is not supported yet; explore each "
                         "env in a run of its own (--set env.mix=[])")
    from questioning.task_store import TaskStore

    control = None
    if cfg.redis.url:
        from protocol.control import ControlPlane

        control = ControlPlane.connect(cfg.redis.url, cfg.redis.prefix, cfg.redis.heartbeat_ttl_s)
    chat = make_chat(cfg, policy_path, run_dir)
    metrics = MetricsWriter(run_dir, "explore")
    try:
        with TaskStore(run_dir) as store:
            factory = TaskFactory(cfg, run_dir, store, chat, control, metrics, say)
            summary = factory.run(cfg.explore.rounds if rounds is None else rounds, stop)
    finally:
        metrics.close()
        if hasattr(getattr(chat, "backend", None), "close"):
            chat.backend.close()
    say(f"explore: {summary['tasks_stored']} tasks stored (+{summary.get('tasks', 0)} in "
        f"{summary['seconds']:.1f}s); profile in {profile_path(run_dir)}")
    refused = ", ".join(f"{reason} {n}" for reason, n in summary["refused"].items())
    say(render_coverage(summary["coverage"]) + f"\n  candidates refused: {refused or 'none'}"
        f"\n  (in {RunDir(run_dir).coverage})")
    return summary


def profile_only(cfg: RunConfig, run_dir: Path) -> dict:
    """The profile from the stored explorations, exploring one round first if there are none."""
    explorations = read_explorations(run_dir)
    env = env_maker(cfg.env)()
    if not explorations:
        explorer = Explorer(env_maker(cfg.env), explore_settings(cfg), seed=cfg.seed)
        for seed in seed_tasks(env, cfg.explore.seeds):
            for index in range(cfg.explore.explorations_per_seed):
                exp = explorer.explore(seed, index)
                if exp is not None:
                    explorations.append(exp)
                    append_exploration(run_dir, exp)
    profile = build_profile(env, explorations)
    save_json(profile, profile_path(run_dir))
    return profile
