"""Bytes and seconds of one weight version, full model against LoRA adapters, measured in one run.

    .venv/bin/python -m bench.lora_sync [--models tiny,smollm2-135m] [--ranks 8,16,64]
                                        [--repeats 3] [--out FILE.json]

For each model and each arm (full weights, LoRA rank r on the learner's default targets) it
times, through the real weight channel and a real Redis (the embedded redis-server):

* **publish**: ``WeightPublisher.publish(..., wait=True)``: snapshot, safetensors, fsync'd
  write, announcement (what the learner pays per version, less the part it overlaps);
* **load from the file**: ``WeightSubscriber.follow`` into a ``TransformersBackend``: read,
  verify every chunk digest, deserialize, apply (whole weights copied in place; an adapter
  merged into the targeted weights, or copied into adapter layers);
* **load over ZeroMQ**: the same through the learner's ``WeightServer`` and a ``WeightClient``;
* **generation** after the load: seconds for a fixed batch (merged weights cost what the base
  costs; adapter layers add their low-rank matmuls to every token).

Medians over ``--repeats`` versions; ratios are the full arm's over each LoRA arm's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from autodidact.embedded_redis import EmbeddedRedis
from inference import lora
from inference.backends.base import SamplingParams
from inference.backends.hf import TransformersBackend
from inference.models import model_folder
from inference.tiny_model import make_tiny_model
from protocol.config import LearnerConfig
from protocol.control import ControlPlane
from protocol.weights import (
    AdapterMeta,
    WeightClient,
    WeightPublisher,
    WeightServer,
    WeightSubscriber,
)

TINY_WORDS = [f"w{i}" for i in range(400)]


def model_path(name: str, scratch: Path) -> str:
    if name == "tiny":  # the default run's shape: a small word-level Llama
        return str(make_tiny_model(scratch / "tiny", TINY_WORDS))
    return model_folder(name)


def learner_side(path: str, rank: int):
    """(trained tensors, AdapterMeta or None): the full state, or a rank-``rank`` adapter with
    B moved off zero, as after some training."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path)
    if not rank:
        return model.state_dict(), None
    meta = AdapterMeta(rank, 2.0 * rank, ",".join(LearnerConfig().lora_targets), path,
                       lora.base_digest(path))
    lora.attach(model, meta, init_seed=0)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("lora_B"):
                p.copy_(torch.randn(p.shape, generator=gen) * 1e-3)
    return lora.adapter_state(model.state_dict()), meta


def generation_s(backend, vocab: int) -> float:
    gen = torch.Generator().manual_seed(2)
    prompts = torch.randint(4, vocab, (8, 64), generator=gen).tolist()
    t0 = time.perf_counter()
    backend.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=24, seed=0,
                                             ignore_eos=True))
    return time.perf_counter() - t0


def measure(control: ControlPlane, run_dir: Path, path: str, rank: int, mode: str,
            repeats: int) -> dict:
    state, meta = learner_side(path, rank)
    server = WeightServer("tcp://127.0.0.1:*")
    publisher = WeightPublisher(run_dir, control, keep=2, server=server)
    client = WeightClient(server.address, timeout_s=60)
    local = TransformersBackend(path, adapter_mode=mode)
    remote = TransformersBackend(path, adapter_mode=mode)
    files, zmq = WeightSubscriber(control, "bench-file"), WeightSubscriber(control, "bench-zmq",
                                                                          source=client)
    publish, load_file, load_zmq, nbytes = [], [], [], 0
    if meta is not None:  # hashing the base is once per process (cached), not per version
        assert local.base_sha256 == remote.base_sha256 == meta.base_sha256
    try:
        for version in range(1, repeats + 1):
            t0 = time.perf_counter()
            publisher.publish(state, version, wait=True, adapter=meta)
            publish.append(time.perf_counter() - t0)
            nbytes = publisher.last_publish_bytes
            t0 = time.perf_counter()
            assert files.follow(local) == version
            load_file.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            assert zmq.follow(remote) == version
            load_zmq.append(time.perf_counter() - t0)
    finally:
        client.close()
        publisher.close()
        remote.close()
    try:  # with the weight server's and client's threads gone: they would share the cores
        vocab = local.model.get_input_embeddings().num_embeddings
        gen_s = statistics.median(generation_s(local, vocab) for _ in range(3))
    finally:
        local.close()
    return {"rank": rank, "apply": mode if rank else "whole", "bytes": nbytes,
            "publish_s": statistics.median(publish), "load_file_s": statistics.median(load_file),
            "load_zmq_s": statistics.median(load_zmq), "generate_s": gen_s}


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default="tiny,smollm2-135m")
    p.add_argument("--ranks", default="8,16,64")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = []
    with tempfile.TemporaryDirectory() as scratch, EmbeddedRedis(Path(scratch)) as url:
        control = ControlPlane.connect(url, "bench:lora")
        for name in args.models.split(","):
            path = model_path(name, Path(scratch))
            arms = [(0, "merge")] + [(int(r), mode) for r in args.ranks.split(",")
                                     for mode in ("merge", "layers")]
            for rank, mode in arms:
                run_dir = Path(tempfile.mkdtemp(dir=scratch))
                row = {"model": name, **measure(control, run_dir, path, rank, mode,
                                                args.repeats)}
                rows.append(row)
                print(f"{name:13s} {('full' if not rank else f'r{rank} {mode}'):12s} "
                      f"{row['bytes'] / 2**20:8.2f} MiB  publish {row['publish_s']:.3f}s  "
                      f"load {row['load_file_s']:.3f}s (zmq {row['load_zmq_s']:.3f}s)  "
                      f"generate {row['generate_s']:.2f}s", flush=True)
    report(rows)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))
    return rows


def report(rows: list[dict]) -> None:
    print("\n| model | arm | MiB | × fewer bytes | publish s | × | load s (file) | × | "
          "load s (ZeroMQ) | × | generate s |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        full = next(f for f in rows if f["model"] == r["model"] and f["rank"] == 0)
        arm = "full" if not r["rank"] else f"LoRA r{r['rank']} ({r['apply']})"
        print(f"| {r['model']} | {arm} | {r['bytes'] / 2**20:.2f} | "
              f"{full['bytes'] / r['bytes']:.0f} | {r['publish_s']:.3f} | "
              f"{full['publish_s'] / r['publish_s']:.1f} | {r['load_file_s']:.3f} | "
              f"{full['load_file_s'] / r['load_file_s']:.1f} | {r['load_zmq_s']:.3f} | "
              f"{full['load_zmq_s'] / r['load_zmq_s']:.1f} | {r['generate_s']:.2f} |")


if __name__ == "__main__":
    main()
