"""Why shared prefixes made SmolLM2's update slower on a GPU (docs/results/gpu_check.md): the
same learner update timed on batches it has not seen and again on the same batch, under each
of torch's attention kernels, and one profiled update's busiest operations.

    python -m bench.layout_cuda [--config configs/smollm2-gpu.yaml] [--set k=v] [--rank 16]
                                [--batches 2] [--repeats 3] [--json FILE]

If a kernel pays a cost per attention shape (choosing or planning a kernel), an update on new
batches is slow and the same batch again is fast; a shared-prefix update runs a dozen or more
shapes a layer (one per batch of tree nodes), a padded one a single shape. Each kernel gets
its own batches, never seen by an earlier kernel, so no shape is cached for it beforehand.
Batches as in :mod:`bench.learner_step`. Runs on CPU too (slowly); meant for CUDA.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
from pathlib import Path

import torch

from bench.learner_step import ROOT, build_step, make_batches, timed_update
from bench.output import command_line, write_result

KERNELS = ("default", "math", "efficient", "cudnn")


def kernel_context(name: str):
    """torch's attention restricted to one kernel (``default``: torch's own choice)."""
    if name == "default":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = {"math": SDPBackend.MATH, "efficient": SDPBackend.EFFICIENT_ATTENTION,
               "cudnn": SDPBackend.CUDNN_ATTENTION}[name]
    return sdpa_kernel([backend])


def seen_and_unseen(step, batches: list, repeats: int) -> dict:
    """Per batch: the first update's seconds (shapes new to the kernel) and the repeats'."""
    first, again = [], []
    for groups in batches:
        first.append(timed_update(step, groups)[0])
        again.extend(timed_update(step, groups)[0] for _ in range(repeats - 1))
    return {"first_s": first, "again_s": again,
            "first_median_s": statistics.median(first),
            "again_median_s": statistics.median(again) if again else None}


def profiled(step, groups, rows: int = 15) -> dict:
    """One update under torch.profiler: the busiest operations on the device and on the host,
    and how many device kernels it launched."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + \
        ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        seconds = timed_update(step, groups)[0]
    averages = prof.key_averages()
    device = "self_device_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    kernels = [e for e in prof.events() if getattr(e, "device_type", None) is not None
               and str(e.device_type).endswith("CUDA")]
    return {"seconds": seconds, "device_kernels": len(kernels),
            "by_device_time": averages.table(sort_by=device, row_limit=rows),
            "by_host_time": averages.table(sort_by="self_cpu_time_total", row_limit=rows)}


def main(argv: list[str] | None = None) -> dict:
    from protocol.config import load_config

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default=str(ROOT / "configs" / "smollm2-gpu.yaml"))
    ap.add_argument("--set", dest="sets", action="append", default=[])
    ap.add_argument("--rank", type=int, default=16, help="LoRA rank (0: full fine-tuning)")
    ap.add_argument("--batches", type=int, default=2, help="unseen batches per kernel")
    ap.add_argument("--repeats", type=int, default=3, help="updates per batch")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    cfg = load_config(args.config, args.sets)
    need = (len(KERNELS) + 2) * args.batches + 1
    batches = make_batches(cfg, need, 0.3)
    chunks = [batches[i * args.batches:(i + 1) * args.batches] for i in range(need // args.batches)]
    step = build_step(cfg, args.rank)
    step.update(batches[-1], None, 0.0, False)  # load, allocate, first launches: not timed
    result = {"command": command_line("bench.layout_cuda", argv), "config": args.config,
              "sets": args.sets, "rank": args.rank, "batches_per_kernel": args.batches,
              "repeats": args.repeats, "device": cfg.learner.device,
              "torch": torch.__version__, "kernels": {}}
    step.layout = "padded"
    result["padded"] = seen_and_unseen(step, chunks[0], args.repeats)
    print(f"padded: {result['padded']}", flush=True)
    step.layout = "shared_prefix"
    for kernel, chunk in zip(KERNELS, chunks[1:]):
        try:
            with kernel_context(kernel):
                row = seen_and_unseen(step, chunk, args.repeats)
        except RuntimeError as exc:  # a kernel that cannot take a boolean mask or this dtype
            row = {"error": str(exc).splitlines()[0][:300]}
        result["kernels"][kernel] = row
        print(f"shared_prefix, {kernel}: {row}", flush=True)
    result["profile_shared_prefix_unseen"] = profiled(step, chunks[len(KERNELS) + 1][0])
    print(result["profile_shared_prefix_unseen"]["by_device_time"], flush=True)
    print(result["profile_shared_prefix_unseen"]["by_host_time"], flush=True)
    result["machine"] = f"{os.cpu_count()} cores"
    write_result(result, args.json)
    return result


if __name__ == "__main__":
    main()
