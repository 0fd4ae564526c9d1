"""Mirror ``<run dir>/metrics.jsonl`` into wandb from one process (the launcher).

Roles only append JSON lines, which is cheap and crash-safe; the launcher tails the file and
logs each record to one wandb run (offline by default, into the run directory, so nothing
leaves the machine until the user runs ``wandb sync``). Each role's records keep their own
step counter by being logged with a ``<role>/step`` metric as their x-axis.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)


class WandbMirror:
    def __init__(self, run_dir: Path, mode: str, config: dict, name: str, group: str = ""):
        self.run = None
        if mode == "disabled":
            return
        os.environ.setdefault("WANDB_SILENT", "true")
        try:
            import wandb

            self.run = wandb.init(project="autodidact", name=name, group=group or None,
                                  dir=str(run_dir), mode=mode, config=config,
                                  resume="allow", id=_run_id(run_dir))
            for role in ("actor", "learner", "replay", "judge"):
                wandb.define_metric(f"{role}/step")
                wandb.define_metric(f"{role}/*", step_metric=f"{role}/step")
        except Exception as exc:  # tracking must never take a training run down
            log.warning("wandb disabled: %s", exc)
            self.run = None

    def sync(self, records: list[dict]) -> None:
        """Log ``records`` (new lines of metrics.jsonl) to wandb."""
        if self.run is None:
            return
        for rec in records:
            role = rec.get("role", "run")
            values = {k: v for k, v in rec.items() if "/" in k and v is not None}
            values[f"{role}/step"] = rec.get("step", 0)
            self.run.log(values)

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None


def _run_id(run_dir: Path) -> str:
    """Stable per run directory, so a resumed run continues the same wandb run."""
    import hashlib

    return hashlib.sha1(str(Path(run_dir).resolve()).encode()).hexdigest()[:16]
