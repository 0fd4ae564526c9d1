"""``autodidact llm-check``: how usable an OpenAI-compatible endpoint is as the step judge, the
task proposer and the experience extractor, measured on the run's env.

Each role's own prompt and parser, on inputs built from the env's training tasks: trajectories
that succeed, stop one step short, or take a detour (judge; a group of them per task for the
extractor), and schema-sampled explorations (proposer). Every request's raw reply is kept in
``<run-dir>/llm/check-<role>.jsonl`` and every request ends in exactly one outcome:

    usable     the role's parser accepted the reply and it yielded something (labels for every
               step, at least one experience, at least one task verified in the env)
    refusal    the model declined in words ("I'm sorry, I cannot ...")
    malformed  anything else it answered: not the asked-for format, or nothing usable in it
    error      no reply (transport, HTTP, timeout)

``--serve MODEL`` starts ``vllm serve`` on a local folder or named model (in the engine's
virtualenv) for the duration of the check, instead of ``--url``.
"""

from __future__ import annotations

import json
import random
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import click
import numpy as np

from autodidact.cli_common import config_option, load_run, set_option
from autodidact.resolve import Flags
from environments.base import Environment, env_maker
from inference.llm import LLMError, OpenAIChat, is_refusal
from protocol.config import RunConfig
from protocol.messages import Group, Step, Task, Trajectory
from protocol.run_dir import RunDir

OUTCOMES = ("usable", "refusal", "malformed", "error")
ROLES = ("judge", "extractor", "proposer")


def played(task: Task, actions: Sequence[str], make_env: Callable[[], Environment],
           traj_id: str) -> Trajectory:
    """A trajectory of ``actions`` stepped in a fresh env (text only: no tokens)."""
    env = make_env()
    env.reset(task)
    steps = []
    for action in actions:
        obs, done, info = env.step(action)
        steps.append(Step(action=action, observation=obs, start=0, end=0,
                          valid=bool(info.get("valid", False))))
        if done:
            break
    reward = float(env.evaluate(task))
    empty = np.zeros(0, np.int32)
    return Trajectory(traj_id=traj_id, tokens=empty, logprobs=empty.astype(np.float32),
                      versions=empty, action_mask=empty.astype(np.uint8), steps=steps,
                      reward=reward, success=reward >= 1.0)


def attempts(task: Task, make_env: Callable[[], Environment]) -> list[Trajectory]:
    """Four attempts at ``task``: the reference, one step short, a detour first, a wrong start."""
    ref = list(task.reference)
    plans = {"reference": ref, "short": ref[:-1] or ["pwd"], "detour": ["pwd", *ref],
             "wrong": ["ls", "pwd"]}
    return [played(task, plan, make_env, f"{task.task_id}/{name}")
            for name, plan in plans.items()]


def classify(reply: str | None, usable: bool) -> str:
    if reply is None:
        return "error"
    if usable:
        return "usable"
    return "refusal" if is_refusal(reply) else "malformed"


class Check:
    """One role's requests against the endpoint: ``ask(item) -> (reply, usable, extra)``."""

    def __init__(self, role: str, chat: OpenAIChat):
        self.role, self.chat = role, chat
        self.outcomes: Counter = Counter()
        self.extra: Counter = Counter()
        self.seconds: list[float] = []

    def run(self, items: list, ask: Callable, concurrency: int) -> None:
        def one(item):
            t0 = time.monotonic()
            try:
                reply, usable, extra = ask(item)
            except LLMError:
                reply, usable, extra = None, False, {}
            return classify(reply, usable), extra, time.monotonic() - t0

        with ThreadPoolExecutor(max(1, concurrency)) as pool:
            for outcome, extra, seconds in pool.map(one, items):
                self.outcomes[outcome] += 1
                self.extra.update(extra)
                self.seconds.append(seconds)

    def summary(self) -> dict:
        n = sum(self.outcomes.values())
        return {"requests": n, **{k: self.outcomes.get(k, 0) for k in OUTCOMES},
                "usable_rate": self.outcomes.get("usable", 0) / n if n else 0.0,
                "median_s": float(np.median(self.seconds)) if self.seconds else 0.0,
                **dict(self.extra)}


def judge_check(chat: OpenAIChat, cfg: RunConfig, trajectories: list[tuple[Task, Trajectory]],
                concurrency: int, max_tokens: int = 256) -> Check:
    from judge.step_judges import (
        ReferenceJudge,
        agreement,
        build_judge_messages,
        judgement_format,
        parse_judgement,
    )

    reference = ReferenceJudge(env_maker(cfg.env))

    def ask(item):
        task, traj = item
        reply = chat.complete(build_judge_messages(task, traj, cfg.judge.max_chars),
                              temperature=cfg.judge.temperature, max_tokens=max_tokens,
                              reply_format=judgement_format(len(traj.steps)))
        labels, how = parse_judgement(reply, len(traj.steps))
        if labels is None:
            return reply, False, {}
        agree = agreement(labels, reference.judge(task, traj).labels)
        return reply, True, {f"parsed_{how}": 1, "steps": len(labels),
                             "steps_agreeing_with_reference": round(agree * len(labels))}

    check = Check("judge", chat)
    check.run(trajectories, ask, concurrency)
    return check


def extractor_check(chat: OpenAIChat, groups: list[Group], concurrency: int,
                    max_tokens: int = 384) -> Check:
    from navigating.extraction import (
        LLMExtractor,
        _reply_items,
        build_messages,
        experiences_format,
    )

    extractor = LLMExtractor(chat)

    def ask(group):
        reply = chat.complete(build_messages(group, extractor.max_per_group),
                              temperature=extractor.temperature, max_tokens=max_tokens,
                              reply_format=experiences_format(extractor.max_per_group))
        try:
            items = _reply_items(reply)
        except ValueError:
            return reply, False, {}
        made = extractor._experiences(items, group, 0)
        return reply, bool(made), {"experiences": len(made)}

    check = Check("extractor", chat)
    check.run(groups, ask, concurrency)
    return check


def proposer_check(chat: OpenAIChat, cfg: RunConfig, explorations: list,
                   concurrency: int, max_tokens: int = 384) -> Check:
    from questioning.factory import preferences
    from questioning.synthesis import LLMSynthesizer, tasks_format

    def ask(exp):
        synth = LLMSynthesizer(chat, env_maker(cfg.env), preferences(cfg))  # one env per call
        reply = chat.complete(synth.messages(exp, []), temperature=cfg.llm.temperature,
                              max_tokens=max_tokens,
                              reply_format=tasks_format(synth.tasks_per_reply))
        items = synth._items(reply)  # [] when the reply holds no task list
        tasks = [t for t in (synth._task(exp, item) for item in items) if t is not None]
        return reply, bool(tasks), {"tasks_proposed": len(items), "tasks_verified": len(tasks)}

    check = Check("proposer", chat)
    check.run(explorations, ask, concurrency)
    return check


def inputs(cfg: RunConfig, n: int, seed: int) -> tuple[list, list, list]:
    """(task, trajectory) pairs for the judge, groups for the extractor, explorations for the
    proposer: ``n`` of each, from the env's training tasks."""
    from questioning.explorer import Explorer, ExploreSettings, seed_tasks

    make_env = env_maker(cfg.env)
    env = make_env()
    train = env.tasks("train")
    tasks = random.Random(seed).sample(train, min(n, len(train)))
    groups = [Group(group_id=f"check/{i}", task=t, trajectories=attempts(t, make_env))
              for i, t in enumerate(tasks)]
    pairs = [(g.task, g.trajectories[i % 4]) for i, g in enumerate(groups)]
    # Short explorations: the proposer's prompt lists every step, and a small model's context
    # is short (a 50-step exploration is ~2,000 tokens of prompt).
    explorer = Explorer(make_env, ExploreSettings(breadth_steps=8, depth_steps=4), seed)
    seeds = seed_tasks(env)
    explorations = [exp for i in range(n)
                    if (exp := explorer.explore(seeds[i % len(seeds)], i)) is not None]
    return pairs, groups, explorations


def check_endpoint(cfg: RunConfig, run_dir: Path, url: str, model: str, n: int = 8,
                   concurrency: int = 4, roles: Sequence[str] = ROLES,
                   max_tokens: int | None = None) -> dict:
    """Run the checks, write ``<run-dir>/llm/check-summary.json`` and return it.
    ``max_tokens`` caps every reply (default: each role's own, 256-384)."""
    rd = RunDir(run_dir)
    pairs, groups, explorations = inputs(cfg, n, cfg.seed)

    def chat(role: str) -> OpenAIChat:
        return OpenAIChat(url, model, cfg.llm.api_key_env, cfg.llm.timeout_s,
                          cfg.llm.max_retries, reply_log=rd.llm_replies(f"check-{role}"),
                          structured=cfg.llm.structured_outputs)

    cap = {"max_tokens": max_tokens} if max_tokens else {}
    checks = {
        "judge": lambda: judge_check(chat("judge"), cfg, pairs, concurrency, **cap),
        "extractor": lambda: extractor_check(chat("extractor"), groups, concurrency, **cap),
        "proposer": lambda: proposer_check(chat("proposer"), cfg, explorations, concurrency,
                                           **cap),
    }
    t0 = time.monotonic()
    summary = {"url": url, "model": model, "env": cfg.env.name, "per_role": n,
               "structured_outputs": cfg.llm.structured_outputs,
               "roles": {role: checks[role]().summary() for role in roles}}
    summary["seconds"] = round(time.monotonic() - t0, 1)
    path = rd.llm_replies("check-summary").with_suffix(".json")
    path.write_text(json.dumps(summary, indent=1))
    return summary


def render(summary: dict) -> str:
    lines = [f"{summary['model']} at {summary['url']} on {summary['env']} "
             f"({summary['per_role']} requests per role, {summary['seconds']} s)",
             f"{'role':10s} {'usable':>7s} {'refusal':>8s} {'malformed':>10s} {'error':>6s}"
             f" {'usable %':>9s} {'median s':>9s}"]
    for role, s in summary["roles"].items():
        lines.append(f"{role:10s} {s['usable']:7d} {s['refusal']:8d} {s['malformed']:10d} "
                     f"{s['error']:6d} {100 * s['usable_rate']:8.1f}% {s['median_s']:9.1f}")
    return "\n".join(lines)


@click.command("llm-check")
@config_option
@set_option()
@click.option("--run-dir", type=click.Path(file_okay=False),
              help="Where the replies and the summary go (default runs/<name>).")
@click.option("--url", default=None, help="OpenAI-compatible endpoint (default llm.url).")
@click.option("--model", "model_name", default=None, help="Model name (default llm.model).")
@click.option("--serve", default=None, metavar="MODEL",
              help="Start `vllm serve` on this local folder or named model (smollm2-135m) "
                   "for the check, in vLLM's virtualenv, instead of --url.")
@click.option("-n", "n", type=int, default=8, show_default=True, help="Requests per role.")
@click.option("--concurrency", type=int, default=4, show_default=True)
@click.option("--roles", default=",".join(ROLES), show_default=True)
def llm_check(config, sets, run_dir, url, model_name, serve, n, concurrency, roles):
    """How usable an LLM endpoint's replies are as judge, proposer and experience extractor.

    \b
    autodidact llm-check --serve smollm2-135m -n 16     vllm serve on the named model
    autodidact llm-check --url http://host:8000/v1 --model Qwen2.5-7B-Instruct
    """
    cfg, path = load_run(config, sets, run_dir, Flags())
    path.mkdir(parents=True, exist_ok=True)
    wanted = [r.strip() for r in roles.split(",") if r.strip()]
    unknown = sorted(set(wanted) - set(ROLES))
    if unknown or n < 1:
        raise click.UsageError(f"--roles takes {', '.join(ROLES)} and -n >= 1")
    if serve:
        summary = _with_server(cfg, path, serve, n, concurrency, wanted)
    else:
        url, model_name = url or cfg.llm.url, model_name or cfg.llm.model
        if not url or not model_name:
            raise click.UsageError("give --url and --model (or llm.url, llm.model), or --serve")
        summary = check_endpoint(cfg, path, url, model_name, n, concurrency, wanted)
    click.echo(render(summary))
    click.echo(f"raw replies: {RunDir(path).llm_replies('check-judge').parent}/check-*.jsonl")


def _with_server(cfg: RunConfig, path: Path, model: str, n: int, concurrency: int,
                 roles: list[str]) -> dict:
    from autodidact.engine_env import vllm_python
    from autodidact.vllm_serve import VLLMServer
    from inference.models import model_folder

    python = vllm_python()
    if python is None:
        raise click.ClickException("--serve needs vLLM: run bash scripts/setup.sh (it makes "
                                   ".venv-vllm) or give --url")
    import torch

    server = VLLMServer(model_folder(model), python, RunDir(path).log("vllm-serve"),
                        name=Path(model).name, cpu=not torch.cuda.is_available(),
                        max_model_len=4096, threads=cfg.actor.torch_threads or 1)
    with server:
        return check_endpoint(cfg, path, server.url, server.name, n, concurrency, roles)
