"""Peak memory and seconds per learner step at a real vocabulary: the whole-logits forward
against the chunked output head (``learner.logit_chunk_tokens``; everywhere, or only at the
generated tokens the loss reads) and activation checkpointing
(``learner.gradient_checkpointing``), measured in one run on the same batch.

    .venv/bin/python -m bench.learner_memory [--model smollm2-135m] [--batch 8] [--length 512]
                                             [--steps 3] [--chunk 1024] [--lora-rank 16]
                                             [--variants A,B] [--out FILE.json]

The last variant trains only a LoRA adapter (``learner.lora_rank``) on the learner's default
targets: its AdamW state is the adapter's, not the model's.

Each variant runs in a fresh process (peak resident memory is per process): it loads the model,
takes ``--steps`` optimizer steps (AdamW, the warm-start's masked mean log-likelihood of the
generated tokens, ``--action-fraction`` of the positions, on the same random token batch; the
learner's step has the same shape) and reports the process's
peak RSS and the median seconds of the steps after the first. Ratios are against the first
variant (whole logits), measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# name -> (logit_chunk_tokens is used, gradient_checkpointing, head at actions only, LoRA)
VARIANTS = {
    "whole logits": (False, False, False, False),
    "chunked head": (True, False, False, False),
    "chunked head at actions": (True, False, True, False),
    "chunked head + checkpointing": (True, True, False, False),
    "chunked head at actions + checkpointing": (True, True, True, False),
    # learner.lora_rank > 0: the same step training only an adapter (--lora-rank)
    "chunked head at actions + checkpointing + LoRA": (True, True, True, True),
}


def one_variant(args) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from inference import lora
    from inference.models import model_folder
    from learner.logprobs import prepare_for_training, token_logprobs
    from protocol.config import LearnerConfig
    from protocol.weights import AdapterMeta

    torch.set_num_threads(args.threads)
    chunked, checkpointing, at_actions, adapter = VARIANTS[args.variant]
    chunk = args.chunk if chunked else 0
    model = AutoModelForCausalLM.from_pretrained(model_folder(args.model)).train()
    if adapter:
        targets = ",".join(LearnerConfig().lora_targets)
        lora.attach(model, AdapterMeta(args.lora_rank, 2.0 * args.lora_rank, targets, "", ""))
    prepare_for_training(model, chunk, checkpointing)
    vocab = model.get_output_embeddings().weight.shape[0]
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (args.batch, args.length), generator=gen)
    mask = torch.ones_like(ids)
    # Generated tokens as in a multi-turn rollout: a few short spans after a long prompt.
    actions = torch.zeros_like(ids)
    span = max(1, int(args.length * args.action_fraction / 3))
    for start in (args.length // 2, 2 * args.length // 3, args.length - span):
        actions[:, start:start + span] = 1
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-5)
    seconds, losses = [], []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        logp = token_logprobs(model, ids, mask, chunk, actions if at_actions else None)
        loss = -(logp * actions).sum() / actions.sum()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        seconds.append(time.perf_counter() - t0)
        losses.append(float(loss))
    return {"variant": args.variant, "chunk_tokens": chunk, "checkpointing": checkpointing,
            "head_at_actions_only": at_actions, "action_fraction": args.action_fraction,
            "lora_rank": args.lora_rank if adapter else 0,
            "trainable_params": sum(p.numel() for p in trainable),
            "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
            "step_s": statistics.median(seconds[1:] or seconds), "first_step_s": seconds[0],
            "first_loss": losses[0], "vocab": vocab}


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--length", type=int, default=512)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--chunk", type=int, default=1024)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--lora-rank", type=int, default=16, help="rank of the LoRA variant")
    p.add_argument("--action-fraction", type=float, default=0.1,
                   help="share of positions that are generated tokens (the loss's)")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--variant", help=argparse.SUPPRESS)  # the child's
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if args.variant:
        print(json.dumps(one_variant(args)))
        return []
    rows = []
    for name in args.variants.split(","):
        child = [sys.executable, "-m", "bench.learner_memory", "--variant", name,
                 *[f"--{k}={getattr(args, k)}" for k in ("model", "batch", "length", "steps",
                                                          "chunk", "threads")],
                 f"--lora-rank={args.lora_rank}",
                 f"--action-fraction={args.action_fraction}"]
        out = subprocess.run(child, cwd=ROOT, capture_output=True, text=True, check=True)
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
        print(f"{name:30s} peak {rows[-1]['peak_rss_gib']:.2f} GiB  "
              f"step {rows[-1]['step_s']:.1f} s", flush=True)
    base = rows[0]
    for r in rows:
        r["memory_ratio"] = r["peak_rss_gib"] / base["peak_rss_gib"]
        r["time_ratio"] = r["step_s"] / base["step_s"]
    print(f"\n{args.model}, batch {args.batch} x {args.length} tokens "
          f"({args.action_fraction:.0%} generated), AdamW fp32, {args.threads} threads\n")
    print("| variant | peak RSS (GiB) | × whole | s / step | × whole |")
    print("|---|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['variant']} | {r['peak_rss_gib']:.2f} | {r['memory_ratio']:.2f} | "
              f"{r['step_s']:.1f} | {r['time_ratio']:.2f} |")
    # The variants compute the same loss: a different one means a variant is wrong.
    for r in rows[1:]:
        assert abs(r["first_loss"] - base["first_loss"]) < 1e-3, (r, base)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))
    return rows


if __name__ == "__main__":
    main()
