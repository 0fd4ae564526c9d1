"""How much of its probability the policy keeps on the tokens the constrained sampler may emit
(issue 54: why RL lowers a good warm-start).

    .venv/bin/python -m bench.valid_mass RUN_DIR [--policies policy_init policy_final]
        [--tasks 40] [--json OUT]

The actors sample each action token from the policy restricted to the ids the env's call
constraint allows, and report the model's own log-prob over the whole vocabulary ("raw"), which
is what the learner recomputes and trains. The learner therefore trains the unrestricted policy:
pushing a sampled token down moves its mass to every other id, those the sampler never emits
among them, and nothing pushes it back. The share of the mass left on the allowed ids at a
sampled token is ``Z = exp(raw log-prob - constrained log-prob)`` (the constrained one
renormalised over the allowed ids, temperature 1). Per policy folder of the run, the same
validation tasks (the first ``--tasks`` of the run's validation split), one rollout each with
the same seed, are rolled out twice, once reporting each log-prob; the tokens are the same (the
check says so), and per sampled token ``Z`` is read off. Reported: the tokens, the mean and
median ``Z``, and the shares under 0.5 and 0.01.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import numpy as np

from bench.output import command_line, write_result

POLICIES = ("policy_init", "policy_final")  # the policy RL started from, and its last


def masses(run_dir: Path, policy: str, tasks: int, seed: int = 7) -> np.ndarray:
    """``Z`` at every sampled token of ``policy``'s rollouts (module docstring)."""
    from environments.base import env_maker
    from episodes.evaluate import select_tasks
    from episodes.rollout import rollout, rollout_settings, start_episodes
    from inference.backends.base import SamplingParams
    from inference.codecs import make_codec
    from inference.engines import make_backend
    from protocol.config import load_config

    cfg = load_config(run_dir / "config.yaml", [])
    chosen = select_tasks(cfg, "validation", tasks)
    settings = rollout_settings(cfg)
    logprobs = {}
    with make_backend(cfg, str(run_dir / policy)) as backend:
        codec = make_codec(backend.tokenizer, settings.tool_format)
        for mode in ("raw", "processed"):
            params = SamplingParams(temperature=1.0, max_new_tokens=settings.max_action_tokens,
                                    stop_token_ids=(codec.eoa_id,), seed=seed,
                                    logprobs_mode=mode)
            episodes = start_episodes(chosen, 1, env_maker(cfg.env), codec,
                                      settings=dataclasses.replace(settings, constrained=True))
            rollout(backend, episodes, codec, params, settings)
            logprobs[mode] = [(ep.tokens, [lp for lp, m in zip(ep.logprobs, ep.mask) if m])
                              for ep in episodes]
    raw, processed = logprobs["raw"], logprobs["processed"]
    if any(a[0] != b[0] for a, b in zip(raw, processed)):
        raise RuntimeError(f"{policy}: the two rollouts sampled different tokens")
    return np.exp(np.concatenate([np.subtract(a[1], b[1]) for a, b in zip(raw, processed)]))


def describe(z: np.ndarray) -> dict:
    return {"tokens": int(z.size), "mean": float(z.mean()), "median": float(np.median(z)),
            "share_below_0.5": float((z < 0.5).mean()),
            "share_below_0.01": float((z < 0.01).mean())}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--policies", nargs="+", default=list(POLICIES))
    ap.add_argument("--tasks", type=int, default=40)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    out = {"command": command_line("bench.valid_mass", argv), "run": str(args.run_dir),
           "tasks": args.tasks,
           "policies": {p: describe(masses(args.run_dir, p, args.tasks)) for p in args.policies}}
    write_result(out, args.json, echo=True)
    return out


if __name__ == "__main__":
    main()
