"""Self-navigating vs plain RL at the same budget, on the built-in environment.

    python -m bench.self_navigating [--updates 120] [--config configs/quick.yaml]
                                    [--out runs/bench-nav] [--reuse] [--set k=v ...]
                                    [--json F]

Runs `autodidact run -c CONFIG` twice from the same seed — experience off, then on —
and prints, from each run's replay store and summary:

* success of guided vs unguided rollouts in the same groups, over the first and last thirds of
  training (the self-navigating run only);
* success of *unguided* rollouts per window of 10 policy versions in both runs, and how many
  updates each needs to reach the plain run's final level (unguided rollouts only, so the
  self-navigating run is not credited for the advice in its prompts);
* held-out avg@k after warm-start and after RL (evaluation never injects experience) with 95%
  intervals, and nav − plain after RL with its paired interval and the label read off it.

With ``--json F`` the same numbers go to F with the command that wrote them
(:func:`bench.run_compare.arms_record`, and the same-group split).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from autodidact.experiments.arms import read_result
from autodidact.experiments.page import comparison_line, held_out_line
from bench.output import command_line, write_result
from bench.run_compare import (
    WINDOW,
    arguments,
    arms_record,
    final_level,
    rollouts,
    run,
    success_curve,
    updates_to_reach,
)


def same_group_split(rows, lo: int, hi: int) -> tuple[float, float, int]:
    groups: dict[str, list[tuple[bool, bool]]] = {}
    for version, guided, success, gid in rows:
        if lo <= version < hi:
            groups.setdefault(gid, []).append((guided, success))
    mixed = [g for g in groups.values() if any(x for x, _ in g) and not all(x for x, _ in g)]
    with_exp = [s for g in mixed for x, s in g if x]
    without = [s for g in mixed for x, s in g if not x]
    return (float(np.mean(with_exp)) if with_exp else float("nan"),
            float(np.mean(without)) if without else float("nan"), len(mixed))


def main(argv: list[str] | None = None) -> None:
    parser = arguments(__doc__, 120, "quick.yaml", "bench-nav")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    plain = run(args.out, "plain", args.config, args.updates,
                [*args.sets, "experience.enabled=false"], args.reuse)
    nav = run(args.out, "nav", args.config, args.updates, [*args.sets, "experience.enabled=true"],
              args.reuse)
    curves = {name: success_curve(rollouts(d)) for name, d in (("plain", plain), ("nav", nav))}
    level = final_level(curves["plain"], args.updates)
    print(f"\nunguided training success per {WINDOW} versions:")
    for name, curve in curves.items():
        print(f"  {name:5s} " + " ".join(f"{v}:{s:.2f}" for v, s in curve.items()))
    print(f"plain run's final level (last {2 * WINDOW} versions): {level:.3f}")
    for name, curve in curves.items():
        print(f"  {name:5s} reaches it at version {updates_to_reach(curve, level)}")
    nav_rows = rollouts(nav)
    third = args.updates // 3
    split = {}
    for label, lo, hi in (("first third", 0, third), ("last third", 2 * third, 10**9)):
        w, wo, n = same_group_split(nav_rows, lo, hi)
        split[label] = {"with_experience": w, "without": wo, "groups": n}
        print(f"nav, {label}: success with experience {w:.3f} vs without {wo:.3f} "
              f"in the same {n} groups")
    held = {name: read_result(name, 0, d) for name, d in (("plain", plain), ("nav", nav))}
    for name, result in held.items():
        print(f"{name:5s} held-out avg@k: {held_out_line(result)}")
    print(comparison_line(held["plain"], held["nav"]))
    if args.json:
        write_result({"command": command_line("bench.self_navigating", argv),
                      **arms_record(curves, level, held, "plain"),
                      "nav_same_groups": split}, args.json)


if __name__ == "__main__":
    main()
