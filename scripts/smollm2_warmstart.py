"""Warm-start SmolLM2-135M-Instruct on verified references of the built-in ``files`` env, the
step a real-model run takes before RL, alone (no Redis, no roles), so its effect can be measured
with ``autodidact eval``::

    .venv/bin/python -m scripts.smollm2_warmstart --steps 30 --out runs/smollm2-ws30
    .venv/bin/python -m autodidact.cli eval --model runs/smollm2-ws30 -k 1 --limit 40 \\
        --temperature 0 --set actor.constrained=false --set env.max_context=768 \\
        --set actor.max_action_tokens=32

Settings for a 49,152-token vocabulary on 2 CPU cores: batch 8, the chunked output head and
activation checkpointing (docs/smollm2.md); chat-template prompts with the env's tool
instructions.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from autodidact.resolve import resolve_config
from episodes.rollout import rollout_settings
from inference.models import model_folder
from learner.warmstart import warm_start

SETTINGS = ["experience.enabled=false", "env.max_context=768", "actor.max_action_tokens=32",
            "warmstart.batch_size=8", "warmstart.lr=2e-5", "warmstart.max_examples=200",
            "learner.logit_chunk_tokens=1024", "learner.gradient_checkpointing=true"]


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--out", required=True)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE")
    args = p.parse_args(argv)
    cfg = resolve_config(None, ["name=smollm2-ws", f"warmstart.steps={args.steps}",
                                *SETTINGS, *args.sets])
    t0 = time.monotonic()

    def progress(step: int, loss: float) -> None:
        print(f"step {step}/{args.steps} loss {loss:.3f} ({time.monotonic() - t0:.0f}s)",
              flush=True)

    info = warm_start(cfg, model_folder(args.model), Path(args.out), rollout_settings(cfg),
                      progress)
    print(info)
    return info


if __name__ == "__main__":
    main()
