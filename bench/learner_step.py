"""Seconds per learner update on configs/smollm2.yaml batches: today's padded rows against
packed rows and shared prefixes (``learner.layout``), on the same batches in one run.

    python -m bench.learner_step [--config configs/smollm2.yaml] [--arms lora16,full]
                                 [--layouts padded,packed,shared_prefix] [--repeats 5]
                                 [--threads 2] [--set k=v] [--json FILE] [--note TEXT]

**Batches.** ``learner.batch_groups`` groups of ``actor.group_size`` rollouts of the config's
env (SmolLM2 on ``files``: 2 × 8), laid out as the actors lay them out: the model's chat
template with the env's tool instructions as the system message, the task and the first
observation (about 260 tokens, the same for the whole group), then each rollout's turns:
its reply and the env's real answer, up to ``env.max_turns`` and ``env.max_context``. The
replies are scripted, not generated (no model runs to make them): each turn the task's next
reference action with probability ``--reference-share``, else an action of another task's
reference (a wrong move, answered by the env as it would be). Rewards are the env's check of
the end state, and only groups with mixed outcomes are kept (replay sets the others aside).
Behaviour log-probs are -1 per generated token. Batch ``r`` is the same for every layout.

**Steps.** Per arm (``lora16``: a rank-16 adapter on the learner's default targets, the
config's ``learner.lr``; ``full``: full fine-tuning), one real :class:`learner.step.
PolicyStep` with the config's learner section (``micro_batch_tokens``, ``logit_chunk_tokens``,
``gradient_checkpointing``, AdamW in float32 on CPU), its layout switched between updates.
First every layout takes one update from the same saved state on batch 0 (their losses must
agree: the same step, up to float rounding), which also warms up; then ``--repeats`` rounds,
each timing one ``PolicyStep.update`` (batching, forward, backward, optimizer step) per
layout on that round's batch, the layouts' order rotating from round to round. Reported per
arm and layout: median and min seconds per update, tokens trained per second (the batch's
real tokens over the median), the tokens the model ran per update (padded: rows × longest
row of each micro-batch; packed: the packed sequences) and the ratio of padded's median
seconds to each layout's.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from bench.output import command_line, write_result

ROOT = Path(__file__).resolve().parents[1]
ARMS = {"lora16": 16, "full": 0}


def make_batches(cfg, count: int, reference_share: float, seed: int = 0) -> list[list]:
    """``count`` batches of ``learner.batch_groups`` groups (module docstring)."""
    from transformers import AutoTokenizer

    from environments.base import env_maker
    from episodes.rollout import apply_action, rollout_settings, start_episodes, to_groups
    from inference.codecs import make_codec
    from inference.models import model_folder

    tokenizer = AutoTokenizer.from_pretrained(model_folder(cfg.model.path))
    codec = make_codec(tokenizer, cfg.actor.tool_format)
    settings = replace(rollout_settings(cfg), constrained=False)
    make_env = env_maker(cfg.env)
    tasks = [t for t in make_env().tasks("train") if t.reference]
    wrong = [a for t in tasks for a in t.reference]
    rng = np.random.default_rng(seed)
    batches = []
    for _ in range(count):
        groups = []
        while len(groups) < cfg.learner.batch_groups:
            task = tasks[int(rng.integers(len(tasks)))]
            episodes = start_episodes([task], cfg.actor.group_size, make_env, codec,
                                      settings=settings)
            for ep in episodes:
                script = list(task.reference)
                while not ep.done:
                    take = script and rng.random() < reference_share
                    action = script.pop(0) if take else str(rng.choice(wrong))
                    ids = codec.action(action)
                    apply_action(ep, codec, ids, [-1.0] * len(ids), 0, settings)
                ep.reward = float(ep.env.evaluate(task))
            if len({ep.reward for ep in episodes}) > 1:
                groups += to_groups(episodes, cfg.actor.group_size, "bench", 0.0)
        batches.append(groups)
    return batches


def batch_shape(batches: list[list]) -> dict:
    trajs = [t for groups in batches for g in groups for t in g.trajectories]
    lengths = np.array([len(t.tokens) for t in trajs])
    prompts = np.array([t.prompt_len for t in trajs])
    return {"rollouts_per_batch": len(trajs) // len(batches),
            "prompt_tokens_mean": float(prompts.mean()),
            "rollout_tokens_mean": float(lengths.mean()),
            "rollout_tokens_min": int(lengths.min()), "rollout_tokens_max": int(lengths.max()),
            "generated_tokens_mean": float(np.mean([t.action_mask.sum() for t in trajs])),
            "turns_mean": float(np.mean([len(t.steps) for t in trajs]))}


def model_tokens(step, groups) -> tuple[int, int]:
    """(tokens the model runs in one update of ``step`` on ``groups``, micro-batches)."""
    from learner.batching import build_batch
    from learner.packing import pack_rows

    batch, _ = build_batch(groups, step.pad_id, experience=step.settings.experience_context)
    lengths = batch.lengths()
    parts = step._micro_batches(torch.arange(len(batch.input_ids)), lengths, batch)
    total = 0
    for part in parts:
        if step.layout == "padded":
            total += len(part) * int(lengths[part].max())
        else:
            total += pack_rows(batch.input_ids[part].numpy(), lengths[part].numpy(),
                               share=step.layout == "shared_prefix").tokens
    return total, len(parts)


def timed_update(step, groups) -> tuple[float, dict, dict]:
    """(seconds, metrics, stats) of one ``step.update``; on CUDA an update returns with
    kernels still queued, so the clock stops once they have run."""
    t0 = time.perf_counter()
    metrics, stats = step.update(groups, None, 0.0, False)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - t0, metrics, stats


def build_step(cfg, rank: int):
    """The config's learner step with a rank-``rank`` adapter (0: full fine-tuning), its
    layout switchable between updates (``step.layout``)."""
    from autodidact.resolve import learner_settings
    from inference.models import model_folder
    from learner.step import PolicyStep

    cfg = copy.deepcopy(cfg)
    cfg.model.path = model_folder(cfg.model.path)
    cfg.learner.lora_rank = rank
    # Built packed, so the model has the attention that reads a layout; a padded update runs
    # the model without one, which is transformers' own sdpa (tests/test_packed_learner.py).
    cfg.learner.layout = "shared_prefix"
    return PolicyStep(learner_settings(cfg))


def run_arm(cfg, rank: int, layouts: list[str], batches: list[list], say) -> dict:
    step = build_step(cfg, rank)
    out = {layout: {"seconds": []} for layout in layouts}
    start = copy.deepcopy(step.state())
    for layout in layouts:  # the same update from the same state: the check, and a warm-up
        step.load_state(copy.deepcopy(start), Path("bench-start"))
        step.layout = layout
        seconds, metrics, _ = timed_update(step, batches[0])
        out[layout].update(first_update_s=seconds, first_loss=metrics["loss"],
                           first_grad_norm=metrics["grad_norm"])
        say(f"  {layout:14s} first update {out[layout]['first_update_s']:.1f} s, "
            f"loss {metrics['loss']:.6f}")
    del start
    for r, groups in enumerate(batches[1:]):
        for layout in layouts[r % len(layouts):] + layouts[:r % len(layouts)]:
            step.layout = layout
            seconds, _, stats = timed_update(step, groups)
            out[layout]["seconds"].append(seconds)
            ran, parts = model_tokens(step, groups)
            out[layout].setdefault("tokens", []).append(stats["tokens"])
            out[layout].setdefault("model_tokens", []).append(ran)
            out[layout].setdefault("micro_batches", []).append(parts)
            say(f"  round {r + 1} {layout:14s} {out[layout]['seconds'][-1]:.1f} s "
                f"({ran} tokens through the model in {parts} micro-batches)")
    base = out.get("padded")
    for row in out.values():
        seconds = row["seconds"]
        row.update(median_s=statistics.median(seconds), min_s=min(seconds),
                   tokens_per_update=statistics.mean(row["tokens"]),
                   model_tokens_per_update=statistics.mean(row["model_tokens"]),
                   micro_batches_per_update=statistics.mean(row["micro_batches"]))
        row["trained_tokens_per_s"] = row["tokens_per_update"] / row["median_s"]
        if base is not None:
            row["speedup_median"] = statistics.median(base["seconds"]) / row["median_s"]
            row["speedup_min"] = min(base["seconds"]) / row["min_s"]
            row["first_loss_rel_diff"] = abs(row["first_loss"] - base["first_loss"]) / \
                max(abs(base["first_loss"]), 1e-12)
    return out


def main(argv: list[str] | None = None) -> dict:
    from protocol.config import load_config

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default=str(ROOT / "configs" / "smollm2.yaml"))
    ap.add_argument("--arms", default=",".join(ARMS), help=f"of {list(ARMS)}")
    ap.add_argument("--layouts", default="padded,packed,shared_prefix")
    ap.add_argument("--repeats", type=int, default=5, help="timed rounds per arm")
    ap.add_argument("--threads", type=int, default=2, help="torch threads (the config's 2)")
    ap.add_argument("--reference-share", type=float, default=0.3,
                    help="chance that a turn plays the task's next reference action")
    ap.add_argument("--set", dest="sets", action="append", default=[],
                    help="config overrides, e.g. model.path=/tmp/smollm2 (the GPU check)")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--note", default="", help="the conditions it ran in (what else ran)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    cfg = load_config(args.config, args.sets)
    layouts = args.layouts.split(",")
    batches = make_batches(cfg, args.repeats + 1, args.reference_share)
    shape = batch_shape(batches)
    print(f"{shape['rollouts_per_batch']} rollouts a batch, prompt "
          f"{shape['prompt_tokens_mean']:.0f} tokens, rollouts "
          f"{shape['rollout_tokens_mean']:.0f} tokens on average", flush=True)
    arms = {}
    for arm in args.arms.split(","):
        print(f"{arm}:", flush=True)
        arms[arm] = run_arm(cfg, ARMS[arm], layouts, batches,
                            lambda line: print(line, flush=True))
    print("\n| arm | layout | median s / update | min s | tokens through the model | "
          "trained tokens / s | × padded (median) |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for arm, rows in arms.items():
        for layout, r in rows.items():
            print(f"| {arm} | {layout} | {r['median_s']:.1f} | {r['min_s']:.1f} | "
                  f"{r['model_tokens_per_update']:.0f} | {r['trained_tokens_per_s']:.0f} | "
                  f"{r.get('speedup_median', float('nan')):.2f} |")
    learner = cfg.learner
    result = {
        "command": command_line("bench.learner_step", argv),
        "config": str(Path(args.config).resolve().relative_to(ROOT))
        if Path(args.config).resolve().is_relative_to(ROOT) else args.config,
        "model": cfg.model.path, "threads": args.threads, "repeats": args.repeats,
        "device": cfg.learner.device, "sets": args.sets,
        "learner": {"batch_groups": learner.batch_groups, "group_size": cfg.actor.group_size,
                    "micro_batch_tokens": learner.micro_batch_tokens,
                    "logit_chunk_tokens": learner.logit_chunk_tokens,
                    "gradient_checkpointing": learner.gradient_checkpointing,
                    "loss_aggregation": learner.loss_aggregation, "lr": learner.lr},
        "batches": {**shape, "count": len(batches), "reference_share": args.reference_share,
                    "source": "real files-env prompts (SmolLM2 chat template, tool "
                              "instructions) and env observations; replies scripted, not "
                              "generated; behaviour log-probs -1; rewards from the env's "
                              "check, mixed-outcome groups only"},
        "arms": arms,
        "machine": f"{os.cpu_count()} cores, {torch.__version__}",
        "load_average_1m": os.getloadavg()[0], "note": args.note,
    }
    write_result(result, args.json)
    return result


if __name__ == "__main__":
    main()
