"""``autodidact ablation``: the command; the arms and their runs are in
``autodidact/experiments/arms.py``, the table, plot, doc and json it writes in
``autodidact/experiments/page.py``.
"""

from __future__ import annotations

from pathlib import Path

import click

from autodidact.cli_common import invoked_as, parse_seeds
from autodidact.experiments.arms import (
    ARMS,
    DEFAULT_BUDGET,
    LLM_JUDGE_ARM,
    NOT_RUN,
    QUICK_BUDGET,
    REFERENCE,
    Budget,
    K,
    Plan,
    Records,
    Result,
    controlled_keys,
    run_all,
)
from autodidact.experiments.page import (
    overlay,
    rewrite_from_json,
    summarize,
    table,
    write_outputs,
)


def check_sets(sets: list[str]) -> None:
    taken = sorted({s.split("=", 1)[0].strip() for s in sets} & controlled_keys())
    if taken:
        raise click.BadParameter(f"the ablation sets {', '.join(taken)} itself (they define "
                                 "the arms, the score or the seeds)", param_hint="--set")


def parse_arms(text: str | None, llm_judge: str | None = None) -> list[str]:
    known = [*ARMS, LLM_JUDGE_ARM] if llm_judge else list(ARMS)
    if not text:
        return known
    arms = [a.strip() for a in text.split(",") if a.strip()]
    unknown = [a for a in arms if a not in known]
    if unknown:
        hint = f" ({LLM_JUDGE_ARM} needs --llm-judge MODEL)" if LLM_JUDGE_ARM in unknown else ""
        raise click.BadParameter(f"unknown arm(s) {', '.join(unknown)}; choose from "
                                 f"{', '.join(known)}{hint}")
    return arms


@click.command("ablation")
@click.option("-c", "--config", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              default=None, help="Config every run starts from (default: embedded defaults).")
@click.option("--set", "sets", multiple=True, metavar="KEY=VALUE",
              help="Override one config value in every run (repeatable).")
@click.option("--seeds", default=None, metavar="0,1,2",
              help="Seeds, one run per arm each (default 0,1,2; --quick: 0).")
@click.option("--arms", default=None, metavar="A,B",
              help=f"Arms to run (default all: {', '.join(ARMS)}).")
@click.option("--nav-set", "nav_sets", multiple=True, metavar="KEY=VALUE",
              help="Override one config value in the arms that navigate only (repeatable): "
                   "e.g. experience.min_similarity=0.5 where tasks rarely repeat.")
@click.option("--llm-judge", default=None, metavar="MODEL",
              help=f"Add the arm {LLM_JUDGE_ARM}: +attributing with MODEL (a local folder or "
                   "packaged name) served by vllm serve as the step judge.")
@click.option("--k", "k", type=click.IntRange(min=1), default=K, show_default=True,
              help="Episodes per held-out task: the table's avg@k and best@k.")
@click.option("--updates", type=int, default=None,
              help=f"RL updates per run (default {DEFAULT_BUDGET.updates}; --quick "
                   f"{QUICK_BUDGET.updates}).")
@click.option("--quick", is_flag=True,
              help="A smaller budget and one seed: within 10 minutes on 2 cores.")
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Where the runs go (default runs/ablation, --quick runs/ablation-quick).")
@click.option("--doc", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Markdown file the table goes into, with the plot beside it (default "
                   "docs/results/ablation.md; --quick: OUT/ablation.md).")
@click.option("--curve-versions", default="", metavar="5,10",
              help="Also evaluate these weight versions of the --curve-arms runs on the held-out "
                   "tasks (needs weights.keep >= --updates): a learning curve per run, recorded "
                   "in the doc's json for python -m bench.heldout_curve --ablation.")
@click.option("--curve-arms", default=None, metavar="A,B",
              help=f"Arms whose runs get --curve-versions (default {REFERENCE} and the "
                   "attributing arms: attribution's data efficiency).")
@click.option("--fresh", is_flag=True, help="Run again even where a finished run exists.")
@click.option("--no-run", "no_run", is_flag=True,
              help="Run nothing: write the table from the runs finished so far.")
@click.option("--from-json", "from_json", is_flag=True,
              help="Run and read nothing but the doc's json: write the doc's table, plot and "
                   "json again from the cells it records (the runs may be gone), e.g. after "
                   "the table's reading changed. Only --doc (or --quick/--out) applies.")
def ablation(config, sets, seeds, arms, nav_sets, llm_judge, k, updates, quick, out, doc,
             curve_versions, curve_arms, fresh, no_run, from_json):
    """Run the ablation table (zero-shot, +questioning, +navigating, +attributing, full) on
    held-out original tasks, and write it with a plot into docs/results/ablation.md.

    \b
    autodidact ablation                 3 seeds x 4 trained arms (about an hour on 2 cores)
    autodidact ablation --quick         1 seed, small budget (under 10 minutes)
    autodidact ablation --seeds 0,1,2,3,4 --updates 200 --out runs/abl-long
    autodidact ablation --from-json --doc docs/results/ablation_smollm2.md   rewrite, run nothing

    Finished cells are recorded in the doc's json (committed beside the doc), so the same
    command on a fresh checkout goes on where the last one stopped.
    """
    command = invoked_as("ablation")
    if from_json:
        rewrite(doc or default_doc(out, quick), command.strip())
        return
    budget = QUICK_BUDGET if quick else DEFAULT_BUDGET
    if updates is not None:
        if updates < 1:
            raise click.BadParameter("must be at least 1", param_hint="--updates")
        budget = Budget(updates, budget.sets)
    seed_list = parse_seeds(seeds or ("0" if quick else "0,1,2"))
    arm_list = parse_arms(arms, llm_judge)
    check_sets([*sets, *nav_sets])
    out = out or default_out(quick)
    doc = doc or default_doc(out, quick)
    attributing = [a for a in arm_list if "attributing" in a]
    plan = Plan(out, config, budget, list(sets), k, llm_judge, tuple(nav_sets), fresh,
                Records(doc.with_suffix(".json")), parse_versions(curve_versions),
                tuple(parse_arms(curve_arms, llm_judge) if curve_arms
                      else [REFERENCE, *attributing]))

    def publish(results: list[Result]) -> Path:
        return write_outputs(results, plan, doc, command.strip())

    results = run_all(arm_list, seed_list, plan, may_run=not no_run, publish=publish)
    click.echo("\n" + table(summarize(results, k), k))
    plot_path = publish(results)
    overlay(results, out)
    click.echo(f"table and plot written to {doc} and {plot_path}")
    if any(r.error and r.error != NOT_RUN for r in results):
        raise SystemExit(1)


def default_out(quick: bool) -> Path:
    return Path("runs") / ("ablation-quick" if quick else "ablation")


def default_doc(out: Path | None, quick: bool) -> Path:
    if quick:
        return (out or default_out(quick)) / "ablation.md"
    return Path("docs") / "results" / "ablation.md"


def rewrite(doc: Path, command: str) -> None:
    """``--from-json``: the doc's table, plot and json again from its json's cells."""
    if not doc.with_suffix(".json").exists():
        raise click.ClickException(f"{doc.with_suffix('.json')} does not exist: --from-json "
                                   "writes a doc again from the json an ablation wrote")
    plot_path, text = rewrite_from_json(doc, command)
    click.echo(text)
    click.echo(f"table and plot written again to {doc} and {plot_path} from "
               f"{doc.with_suffix('.json')}")


def parse_versions(text: str) -> tuple[int, ...]:
    try:
        versions = tuple(sorted({int(v) for v in text.split(",") if v.strip()}))
    except ValueError:
        raise click.BadParameter(f"expected comma-separated integers, got {text!r}",
                                 param_hint="--curve-versions") from None
    if any(v < 1 for v in versions):
        raise click.BadParameter("versions start at 1 (0 is the warm-start, always on the "
                                 "curve)", param_hint="--curve-versions")
    return versions
