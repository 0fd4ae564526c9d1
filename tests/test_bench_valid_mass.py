"""bench.valid_mass: the mass a policy keeps on the ids the constrained sampler may emit."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
from conftest import QUICK

from bench.valid_mass import describe, masses

pytestmark = pytest.mark.slow


def test_the_share_on_allowed_ids_is_read_off_the_two_log_probs(quick_warm_start, tmp_path):
    run_dir = quick_warm_start(tmp_path)
    shutil.copy(QUICK, run_dir / "config.yaml")
    z = masses(run_dir, "policy_init", tasks=4)
    assert z.size >= 4 and np.all(z > 0) and np.all(z <= 1 + 1e-5)


def test_describe_counts_the_shares_below_each_bound():
    d = describe(np.array([1.0, 0.9, 0.3, 0.005]))
    assert d["tokens"] == 4 and d["share_below_0.5"] == 0.5 and d["share_below_0.01"] == 0.25
    assert d["median"] == pytest.approx(0.6) and d["mean"] == pytest.approx(0.55125)
