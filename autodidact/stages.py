"""The stages of a run around its training, each a function of ``(cfg, run_dir, ...)`` that
returns what it made (and says what it does through ``say``, a rich console line by default).

``autodidact run`` (``launcher.py``) composes them, and so does the single-process run::

    prepare_model        the base model (autodidact/base_model.py): model.path, or the
                         tiny model made from the env
    write_split          split.json: which env tasks train, which are validation and test
    before_training      explore_stage -> experience_stage -> held_out_eval (base)
                         -> warm_start_stage -> held_out_eval (warm-start)
    resumed_policy       on --resume: the policy the run started RL from
    up_to_training       the above in order: what RL starts from (model, split, stages)
    after_training       the learner's last record; final_policy (the newest published
                         weights as a model folder), then held_out_eval once more, and with
                         eval.final_test, final_test_eval: base, warm-start and RL on test

Held-out evaluations during a run are on the validation split: settings are chosen there, and
the test split is looked at only when asked (each look is a line of ``eval/test_looks.jsonl``).

None of them assigns to ``cfg``: the launcher makes the config with the model they return.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console

from autodidact.base_model import prepare_model
from autodidact.resolve import check_context, with_model
from autodidact.task_mix import rl_synthetic_share, synthetic_share, warmstart_tasks
from metrics.intervals import format_rate
from metrics.jsonl import MetricsWriter, read_metrics
from protocol.config import RunConfig, task_member
from protocol.control import ControlPlane
from protocol.errors import ConfigError
from protocol.messages import SPLITS, Task
from protocol.run_dir import RunDir

console = Console(stderr=True, soft_wrap=True)
Say = Callable[[str], None]


def show(message: str) -> None:
    """The default ``say``: a line on stderr (rich markup, as the launcher's own lines; no
    highlighting of the numbers in it)."""
    console.print(message, highlight=False)


class StartRefused(RuntimeError):
    """A run that cannot start as configured; its message (one line) says what to change."""


class NoSyntheticTasks(StartRefused):
    """The task mixture asks for synthetic tasks and none exist, or some of those there are
    repeat a held-out task (a pool made before decontamination, or under another split)."""


def write_split(run_dir: Path, env) -> Path:
    """``split.json``: which of the env's own tasks train and which are held out, by id, so a
    later run or evaluation can show it used the same split."""
    path = RunDir(run_dir).split
    split = {"env": env.name, **{s: [t.task_id for t in env.tasks(s)] for s in SPLITS}}
    path.write_text(json.dumps(split, indent=1))
    return path


# --- before training --------------------------------------------------------------------------


def explore_stage(cfg: RunConfig, run_dir: Path, control: ControlPlane, policy_path: str,
                  share: float, say: Say = show) -> dict | None:
    """Explore before training when the config asks for it (``explore.stage``, or ``auto``
    with synthetic tasks in the mixture and fewer than ``explore.min_tasks`` stored); returns
    the explore summary, None when it did not run. The pool in Redis mirrors the durable task
    store either way (a fresh Redis gets the stored tasks back)."""
    from autodidact.recovery import restore_synthetic
    from questioning.factory import run_explore

    restore_synthetic(run_dir, control)
    stored = control.synthetic_len()
    stage = cfg.explore.stage
    wanted = stage in ("before", "alongside") or (
        stage == "auto" and share > 0 and stored < cfg.explore.min_tasks)
    if not wanted:
        return None
    say(f"  explore: {stored} synthetic tasks stored; exploring "
        f"({cfg.explore.rounds or 1} round(s))")
    return run_explore(cfg, run_dir, cfg.explore.rounds or 1, policy_path=policy_path,
                       say=lambda m: say(f"  {m}"))


def refuse_contaminated(cfg: RunConfig, run_dir: Path, synthetic: list[Task]) -> None:
    """Raise :class:`NoSyntheticTasks` when a synthetic task repeats a validation or test
    task in its world: synthesis refuses those, but a pool stored before decontamination,
    or under another split, can still hold some, and training on them would score the run
    on what it trained on."""
    from environments.base import env_maker
    from questioning.decontamination import HeldOutIndex

    overlaps = HeldOutIndex.of_env(env_maker(cfg.env)()).overlaps(synthetic)
    if overlaps:
        task, first = overlaps[0]
        raise NoSyntheticTasks(
            f"{len(overlaps)} of {len(synthetic)} synthetic tasks in {run_dir} repeat a "
            f"held-out task (first: {task.task_id} ~ {first.heldout_id}, {first.split}: "
            f"{first.why}); list them with `autodidact tasks check-contamination --run-dir "
            f"{run_dir}` and explore into a fresh run directory")


def experience_stage(cfg: RunConfig, run_dir: Path, say: Say = show) -> dict | None:
    """Seed the experience pool from the explore stage's trajectories (when there are);
    returns the pool size and the extraction counts, None when seeding is off."""
    if not (cfg.experience.enabled and cfg.experience.init_from_explorations):
        return None
    from navigating.extraction import make_extractor, seed_from_explorations
    from navigating.pool import open_pool

    pool = open_pool(cfg, run_dir=run_dir)
    try:
        counts = seed_from_explorations(pool, run_dir, make_extractor(cfg, run_dir))
        size = pool.size()
    finally:
        pool.close()
    say(f"  experience pool: {size} experiences ({counts.get('added', 0)} from explorations)")
    return {"pool_size": size, **counts}


def warm_start_stage(cfg: RunConfig, run_dir: Path, base_path: str,
                     tasks: list[Task] | None = None, say: Say = show) -> str:
    """Supervised steps on verified references of ``tasks`` (None: the env's training
    tasks) into ``policy_init/``; returns the policy RL starts from (``base_path`` with
    ``warmstart.steps=0``; an existing ``policy_init/`` is reused)."""
    from episodes.rollout import rollout_settings
    from learner.warmstart import warm_start

    out = RunDir(run_dir).policy_init
    if cfg.warmstart.steps == 0:
        return base_path
    if (out / "config.json").exists():
        say(f"  warm-start: reusing {out}")
        return str(out)

    def progress(step, loss):
        say(f"  warm-start step {step}/{cfg.warmstart.steps}  loss {loss:.3f}")

    info = warm_start(cfg, base_path, out, rollout_settings(cfg), progress, tasks)
    RunDir(run_dir).warmstart_tasks.write_text(json.dumps(info["task_ids"]))
    per_env = info.get("per_env")  # an env mix: how many of each member's
    say(f"  warm-start: {info['examples']} verified references"
        + (f" ({', '.join(f'{env} {n}' for env, n in per_env.items())})" if per_env else "")
        + f", {info['steps']} steps in {info['seconds']:.0f}s")
    return str(out)


def before_training(cfg: RunConfig, run_dir: Path, control: ControlPlane, base_path: str,
                    original: list[Task], share: float, rl_share: float,
                    say: Say = show) -> tuple[str, dict]:
    """Everything between the base model and RL, in order: explore, seed the experience pool,
    evaluate the base model, warm-start on references of the task mixture, evaluate again
    (the evaluations unless ``eval.before_rl`` is false).

    ``share`` is the warm-start's self-made share, ``rl_share`` RL's. Returns the policy RL
    starts from and the summary entries ``synthetic_share``, ``rl_synthetic_share``,
    ``explore``, ``tasks`` (how many hand-written and self-made), ``experience_init``,
    ``success_base``, ``success_warm``. Raises :class:`NoSyntheticTasks` when the mixture
    needs synthetic tasks and none exist.
    """
    summary: dict = {"synthetic_share": share, "rl_synthetic_share": rl_share,
                     "eval_split": "validation"}
    needed = max(share, rl_share)
    summary["explore"] = explore_stage(cfg, run_dir, control, base_path, needed, say)
    synthetic = control.synthetic_since(0)
    if needed > 0 and not synthetic and cfg.tasks.synthetic_share < 0 and original:
        say("  tasks.synthetic_share auto: explore re-grounded none of the env's training "
            "tasks; training on them alone")
        share = rl_share = needed = 0.0
        summary.update(synthetic_share=share, rl_synthetic_share=rl_share)
    if needed > 0 and not synthetic:
        raise NoSyntheticTasks("tasks.synthetic_share > 0 but there are no synthetic tasks: "
                               "run `autodidact explore` or set explore.stage")
    if needed > 0:
        refuse_contaminated(cfg, run_dir, synthetic)
    summary["tasks"] = {"hand_written": len(original), "self_made": len(synthetic)}
    say(f"  training tasks: {len(original)} hand-written, {len(synthetic)} self-made; "
        f"self-made share {share:g}" + (f" (in RL {rl_share:g})" if rl_share != share else "")
        + (" (tasks.synthetic_share auto)" if cfg.tasks.synthetic_share < 0 and original
           else ""))
    summary["experience_init"] = experience_stage(cfg, run_dir, say)
    before_rl = cfg.eval.before_rl
    summary["success_base"] = held_out_eval(cfg, run_dir, base_path, "base", 0,
                                            say) if before_rl else None
    policy = warm_start_stage(cfg, run_dir, base_path,
                              warmstart_tasks(cfg, original, synthetic, share), say)
    summary["success_warm"] = held_out_eval(cfg, run_dir, policy, "warm", 0,
                                            say) if before_rl else None
    return policy, summary


@dataclass(frozen=True)
class Training:
    """What RL starts from, as :func:`up_to_training` leaves it."""

    cfg: RunConfig  # the config the roles read: model.path is the policy RL starts from
    original: list[Task]  # the env's own training tasks
    share: float  # the share of synthetic tasks among RL's draws
    base: str  # the base model's folder (the final test evaluation measures it too)


def up_to_training(cfg: RunConfig, run_dir: Path, control: ControlPlane, summary: dict,
                   resume: bool, say: Say = show) -> Training:
    """The base model, split.json and, unless a resumed run did them already, the stages
    before training (:func:`before_training`, their entries added to ``summary`` and written
    to summary.json). Raises :class:`NoSyntheticTasks` as ``before_training`` does, and
    :class:`StartRefused` first where ``env.max_context`` cannot hold an episode past its
    first call (:func:`autodidact.resolve.check_context`), or where ``eval.probe_every`` asks
    to probe an env without validation tasks."""
    from environments.base import env_class, env_maker

    if cfg.env.mix:
        check_mix(cfg)
    elif not cfg.model.path and not env_class(cfg.env).vocabulary():
        say(f"  [yellow]env {cfg.env.name} has an open vocabulary: the tiny word-level model "
            f"reads its words as [UNK]; set model.path to a real model[/]")
    base = prepare_model(cfg, run_dir)
    env = env_maker(cfg.env)()
    write_split(run_dir, env)
    original = env.tasks("train")
    if cfg.eval.probe_every and not env.tasks("validation"):
        raise StartRefused(f"eval.probe_every={cfg.eval.probe_every}: env {env.name} has no "
                           f"validation tasks to probe; set eval.probe_every=0")
    for task in first_of_each_env(original or env.tasks("validation")):
        try:  # a context too short for one call: refused now, not truncated in every episode
            check_context(cfg, base, task)
        except ConfigError as exc:
            raise StartRefused(str(exc)) from None
    share = synthetic_share(cfg, original, env.has_state)
    rl_share = rl_synthetic_share(cfg, share)
    if resume and "success_warm" in summary:
        policy = resumed_policy(cfg, run_dir, base)
    else:
        policy, entries = before_training(cfg, run_dir, control, base, original, share,
                                          rl_share, say)
        summary.update(entries)
        RunDir(run_dir).summary.write_text(json.dumps(summary, indent=2))
    # What the stages settled on (auto falls back to hand-written tasks when explore made none)
    rl_share = summary.get("rl_synthetic_share", rl_share)
    return Training(with_model(cfg, policy), original, rl_share, base)


def first_of_each_env(tasks: list[Task]) -> list[Task]:
    """The first of ``tasks`` of each member env of a mix (``Task.meta["env_member"]``); of a
    run of one env, the first task."""
    firsts: dict[str, Task] = {}
    for task in tasks:
        firsts.setdefault(task_member(task), task)
    return list(firsts.values())


def check_mix(cfg: RunConfig) -> None:
    """Raise :class:`StartRefused`, in one line naming the field, where an env mix
    (``env.mix``) cannot train as configured: a member with an open vocabulary under the tiny
    word-level model, a member without training tasks (a mix trains on each env's own tasks),
    or self-made tasks asked for (explore over a mix is not supported yet)."""
    from environments.base import env_class

    cls = env_class(cfg.env)
    for i, member in enumerate(cfg.env.mix):
        mid = member.member_id()
        if not cfg.model.path and mid in cls.open_vocabulary_members():
            raise StartRefused(f"env.mix[{i}] ({mid}): an open vocabulary, which the tiny "
                               f"word-level model cannot read; set model.path to a real model")
    env = cls()
    counts = {mid: 0 for mid, _, _ in cfg.env.members()}
    for task in env.tasks("train"):
        counts[task_member(task)] += 1
    for i, (mid, n) in enumerate(counts.items()):
        if not n:
            raise StartRefused(f"env.mix[{i}] ({mid}): no training tasks of its own, and a mix "
                               f"trains on each env's own tasks (explore over a mix is not "
                               f"supported yet)")
    if cfg.tasks.synthetic_share > 0 or cfg.tasks.rl_synthetic_share > 0:
        raise StartRefused("tasks.synthetic_share: self-made tasks over an env mix are not "
                           "supported yet (explore makes one env's); set "
                           "tasks.synthetic_share=0 and tasks.rl_synthetic_share=-1")
    if cfg.explore.stage in ("before", "alongside"):
        raise StartRefused(f"explore.stage={cfg.explore.stage}: explore over an env mix is "
                           f"not supported yet; set explore.stage=auto")


def after_training(cfg: RunConfig, run_dir: Path, learner_finished: bool, base: str,
                   say: Say = show) -> dict:
    """Summary entries once the roles have stopped: the learner's last record and, when it
    finished and published, validation success of the final weights (``success_rl``); with
    ``eval.final_test``, test success of the base, warm-start and final policies (``test``).
    ``looked_at_test`` says whether this run has ever been evaluated on test."""
    rows = [r for r in read_metrics(run_dir, "learner") if "learner/loss" in r]
    out: dict = {"learner": rows[-1] if rows else {}}
    final = final_policy(run_dir, cfg.model.path)
    if learner_finished and final is not None:
        out["success_rl"] = held_out_eval(cfg, run_dir, final, "rl",
                                          out["learner"].get("learner/updates", 0), say)
        if cfg.eval.final_test:
            out["test"] = final_test_eval(cfg, run_dir, {"base": base, "warm": cfg.model.path,
                                                         "rl": final}, say)
    out["looked_at_test"] = test_looks(run_dir) > 0
    return out


def resumed_policy(cfg: RunConfig, run_dir: Path, base_path: str) -> str:
    """The policy a resumed run started RL from (its stages before training are not run
    again): ``policy_init/`` when it warm-started, else the base model."""
    return str(RunDir(run_dir).policy_init) if cfg.warmstart.steps else base_path


# --- evaluation and export ----------------------------------------------------------------------


STAGE_LABELS = {"base": "base", "warm": "after warm-start", "rl": "after RL"}


def heldout_result(split: str, found: dict) -> dict:
    """What summary.json keeps of one held-out evaluation of ``split`` (``found``, as
    :func:`episodes.evaluate.evaluate_model` or :func:`~episodes.evaluate.summarize`
    returns it): avg@k, best@k, tasks[, greedy], their 95% intervals and, over an env mix,
    ``envs`` and ``mean_over_envs`` (:func:`episodes.evaluate.per_env`)."""
    from episodes.evaluate import per_env, success_intervals

    records = found["per_task"]
    return {"split": split, **{key: found[key] for key in ("avg", "best", "tasks", "greedy")
                               if key in found}, **success_intervals(records),
            **per_env(records)}


def held_out_eval(cfg: RunConfig, run_dir: Path, model_path: str, stage: str, updates: int,
                  say: Say = show, split: str = "validation") -> dict | None:
    """avg@k and best@k (sampled, ``eval.temperature``) with 95% intervals, and greedy
    success, of ``model_path`` on ``eval.num_tasks`` tasks of ``split``
    (:func:`episodes.evaluate.evaluate_model`); ``stage`` is ``base``, ``warm`` or ``rl``.
    The per-task records go to ``eval/heldout-<split>-<stage>.jsonl`` (paired comparisons
    read them); a validation result is also logged as ``eval/...`` at learner update
    ``updates``, so reports put it on the update and wall-time axes. Returns ``{"avg",
    "avg_ci", "best", "best_ci", "tasks", "split"[, "greedy"]}``, with under ``env.mix``
    ``"envs"`` (each member env's avg@k and best@k with intervals) and ``"mean_over_envs"``
    (:func:`episodes.evaluate.per_env`); None with ``eval.num_tasks=0``."""
    if cfg.eval.num_tasks == 0:
        return None
    from episodes.evaluate import evaluate_model

    e = cfg.eval
    found = evaluate_model(cfg, model_path, split, k=e.k, temperature=e.temperature,
                           limit=e.num_tasks, greedy=e.greedy)
    records = found["per_task"]
    write_records(RunDir(run_dir).heldout_records(split, stage), records)
    result = heldout_result(split, found)
    greedy_text = f", greedy {result['greedy']:.1%}" if "greedy" in result else ""
    say(f"  {split} success {STAGE_LABELS.get(stage, stage)}: "
        f"[bold]avg@{e.k} {format_rate(result['avg'], result['avg_ci'])}[/] "
        f"(best@{e.k} {result['best']:.1%}{greedy_text}; {result['tasks']} tasks)")
    for env, one in result.get("envs", {}).items():  # an env mix: each member env's
        say(f"    {env}: avg@{e.k} {format_rate(one['avg'], one['avg_ci'])} "
            f"(best@{e.k} {one['best']:.1%}; {one['tasks']} tasks)")
    if "mean_over_envs" in result:
        say(f"    mean over envs: avg@{e.k} {result['mean_over_envs']['avg']:.1%}")
    if split == "validation":
        writer = MetricsWriter(run_dir, "eval")
        writer.log({"success_avg": result["avg"], "success_best": result["best"],
                    "success_greedy": result.get("greedy"), "tasks": result["tasks"],
                    **{f"eval/env/{env}/success_avg": one["avg"]
                       for env, one in result.get("envs", {}).items()}},
                   step=updates)
        writer.close()
    return result


def write_records(path: Path, records: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in records))
    tmp.replace(path)


def final_test_eval(cfg: RunConfig, run_dir: Path, policies: dict[str, str],
                    say: Say = show, who: str = "autodidact run --final-test") -> dict:
    """The run's one look at the test split: each of ``policies`` (stage -> model folder;
    a stage whose folder repeats an earlier one's is measured once, its records copied)
    evaluated as :func:`held_out_eval` does on validation, the look recorded in
    ``eval/test_looks.jsonl`` as made by ``who``."""
    say("  final test evaluation (the test split is looked at once, now)")
    out: dict = {}
    seen: dict[str, str] = {}
    rd = RunDir(run_dir)
    for stage, model in policies.items():
        if model in seen:  # the same policy (a run without warm-start): its records stand in
            out[stage] = out[seen[model]]
            shutil.copyfile(rd.heldout_records("test", seen[model]),
                            rd.heldout_records("test", stage))
            continue
        seen[model] = stage
        out[stage] = held_out_eval(cfg, run_dir, model, stage, 0, say, split="test")
        record_test_look(run_dir, who, model, stage)
    return out


def final_test_later(cfg: RunConfig, run_dir: Path, say: Say = show) -> dict:
    """The one look at test of a finished run made without ``--final-test``, taken now with
    the run's own ``cfg``: its base, warm-start and final policies as ``--final-test`` would
    have evaluated them, into summary.json (``test``, ``looked_at_test``). Raises ValueError
    for a run that is not finished, has looked at test before, or whose base model is a named
    one (not kept in the run directory)."""
    from autodidact.tracking import read_summary

    rd = RunDir(run_dir)
    summary = read_summary(run_dir)
    if "success_rl" not in summary or not (rd.policy_final / "config.json").exists():
        raise ValueError(f"{run_dir}: not a finished run (no success_rl in summary.json, or "
                         "no policy_final/): finish it first")
    if looks := test_looks(run_dir):
        raise ValueError(f"{run_dir}: looked at test {looks} time(s) already "
                         f"({rd.test_looks}); one look is all a run gets")
    if not (rd.model / "config.json").exists():
        raise ValueError(f"{run_dir}: its base model is a named one, not kept in the run "
                         "directory: evaluate it with `autodidact eval --split test --model "
                         "NAME`, and the run's policies with --model")
    policies = {"base": str(rd.model), "warm": resumed_policy(cfg, run_dir, str(rd.model)),
                "rl": str(rd.policy_final)}
    summary["test"] = final_test_eval(cfg, run_dir, policies, say,
                                      who="autodidact eval --final-test")
    summary["looked_at_test"] = True
    rd.summary.write_text(json.dumps(summary, indent=2))
    return summary["test"]


def record_test_look(run_dir: Path, who: str, model: str, stage: str = "") -> None:
    """One line in ``eval/test_looks.jsonl``: a result on the test split was seen."""
    path = RunDir(run_dir).test_looks
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        f.write(json.dumps({"time": time.time(), "who": who, "model": model,
                            "stage": stage}) + "\n")


def test_looks(run_dir: Path) -> int:
    """How many times this run's policies were evaluated on the test split."""
    path = RunDir(run_dir).test_looks
    return len(path.read_text().splitlines()) if path.exists() else 0


def final_policy(run_dir: Path, init: str) -> str | None:
    """Save the newest published weights over the model ``init`` as a loadable model folder,
    ``policy_final/`` (a LoRA version merged into its base); returns its path, None when
    nothing was published."""
    files = RunDir(run_dir).published_weights()
    if not files:
        return None
    return str(save_published(init, files[-1], RunDir(run_dir).policy_final))


def save_published(init: str, weights: Path, out: Path) -> Path:
    """:func:`save_policy` for one published weights file: the whole model's tensors, or a
    LoRA adapter (known by its metadata) merged into ``init``."""
    from safetensors.torch import load

    from protocol.weights import AdapterMeta, file_metadata

    data = weights.read_bytes()  # read once: the metadata and the tensors
    adapter = AdapterMeta.from_metadata(file_metadata(data))
    return save_policy(init, load(data), adapter, out)


def save_policy(init: str, state: dict, adapter, out: Path) -> Path:
    """Write the model ``init`` with ``state`` loaded (the whole model's tensors, or with
    ``adapter`` an ``AdapterMeta``, a LoRA adapter merged into it) as a plain Hugging Face
    folder at ``out``, tokenizer included: it loads in ``transformers`` with nothing of ours."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from inference import lora

    model = AutoModelForCausalLM.from_pretrained(init)
    if adapter is None:
        model.load_state_dict(state)
    else:
        if adapter.base_sha256 != lora.base_digest(init):
            raise ValueError(f"the adapter was trained on base {adapter.base_id} (sha256 "
                             f"{adapter.base_sha256[:12]}), not on {init}")
        lora.merge_into(model, state, adapter)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(init).save_pretrained(out)
    return out
