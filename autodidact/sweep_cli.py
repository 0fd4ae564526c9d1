"""``autodidact sweep``: the command; the grid, its runs, the pairing and the choice are in
``autodidact/experiments/sweep.py``."""

from __future__ import annotations

from pathlib import Path

import click

from autodidact.cli_common import invoked_as, parse_seeds
from autodidact.experiments import sweep as sw
from protocol.config import read_yaml


@click.command("sweep")
@click.option("-c", "--config", required=True,
              type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="Config every arm starts from.")
@click.option("--grid", "grid", multiple=True, required=True, metavar="KEY=V1,V2",
              help="A config key and the values to try (repeatable): the arms are every "
                   "combination of the grids' values.")
@click.option("--seeds", default="0,1,2", show_default=True, metavar="0,1,2",
              help="Seeds, one run per arm each.")
@click.option("--set", "sets", multiple=True, metavar="KEY=VALUE",
              help="Override one config value in every arm (repeatable).")
@click.option("--name", default=None,
              help="The sweep's name: its runs go to ROOT/NAME/<arm>-s<seed> (default: "
                   "<config name>-sweep).")
@click.option("--root", type=click.Path(file_okay=False, path_type=Path), default=Path("runs"),
              show_default=True, help="Where the sweep's folder of runs goes.")
@click.option("--baseline", default=None, metavar="KEY=V,...",
              help="The arm every other is paired against (default: each grid key's first "
                   "value; keys left out take their first value too).")
@click.option("--stage", type=click.Choice(["rl", "warm"]), default="rl", show_default=True,
              help="Which validation evaluation is compared: after RL, or after the "
                   "warm-start.")
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Write the result as json here (with the command that made it).")
@click.option("--table", "table_path", type=click.Path(dir_okay=False, path_type=Path),
              default=None, help="Write the markdown table here.")
@click.option("--no-run", "no_run", is_flag=True,
              help="Run nothing: read the runs finished so far.")
def sweep(config, grid, seeds, sets, name, root, baseline, stage, out, table_path, no_run):
    """Run a grid of settings over seeds, pair each arm against the baseline per task on
    validation, and name the choice; the test split is never looked at.

    \b
    autodidact sweep -c configs/default.yaml --grid learner.lr=3e-5,1e-4 \\
        --grid learner.kl_coef=0,0.1 --seeds 0,1,2 --out sweep.json --table sweep.md

    Runs go one at a time; a run that finished with the same command is reused, so a sweep
    cut off goes on where it stopped. The choice: the arm whose paired 95% interval against
    the baseline lies above 0 with the largest mean gain, else the baseline. It ends with the
    `# Chosen on validation:` line to paste into the config.
    """
    parsed = sw.parse_grid(grid)
    plan = sw.Sweep(config, list(sets), parsed, sw.parse_baseline(baseline, parsed),
                    parse_seeds(seeds), name or default_name(config), root, stage)
    if refused := sw.problems(config, plan.sets, parsed, stage):
        raise click.UsageError("the sweep is refused, nothing was run:\n" + "\n".join(refused))
    k = sw.checked(config, plan.sets)[0].eval.k  # eval.* is never gridded: one k for all
    arms = sw.grid_arms(parsed)
    click.echo(f"sweep {plan.name}: {len(arms)} arms x {len(plan.seeds)} seed(s) into "
               f"{(root / plan.name).resolve()}, baseline {sw.arm_text(plan.baseline)}")
    results = sw.run_all(plan, may_run=not no_run)
    if looked := sw.runs_that_looked(results):
        raise click.ClickException(
            "runs looked at the test split, so this sweep chooses nothing: "
            + "; ".join(f"{d} ({n} look(s) in eval/test_looks.jsonl)" for d, n in looked.items()))
    found = sw.outcome(plan, results, invoked_as("sweep"), k, out)
    sw.write(found, out, table_path)
    click.echo("\n" + sw.markdown(found))
    failed = [r for r in results if r.error and r.error != sw.NOT_RUN]
    if failed:
        raise click.ClickException(f"{len(failed)} run(s) failed: " + "; ".join(
            f"{r.arm} seed {r.seed}: {r.error}" for r in failed))


def default_name(config: Path) -> str:
    return f"{read_yaml(config).get('name') or config.stem}-sweep"
