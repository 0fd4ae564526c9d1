"""The GPU half of the checkpoint RNG tests, for a lent GPU machine that has torch with CUDA
but maybe not pytest: ``python scripts/gpu_check_rng.py`` runs the CUDA round trip of
``tests/test_checkpoint.py`` (each GPU's generator saved by a checkpoint and restored by a
resume) and the key check, with pytest when it is there and without it otherwise."""

import sys
import tempfile
import types
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
TESTS = ("test_the_rng_states_include_the_gpus_and_none_on_a_cpu_run",
         "test_cuda_draws_come_back_after_a_checkpoint_round_trip")


def pytest_stand_in() -> types.ModuleType:
    """Enough of pytest for the module to import: its marks as no-op decorators."""
    class Marks:
        def __getattr__(self, name):
            return lambda *args, **kwargs: (lambda test: test)

    stand_in = types.ModuleType("pytest")
    stand_in.mark = Marks()
    return stand_in


def main() -> int:
    if not torch.cuda.is_available():
        print("no CUDA here: nothing to check")
        return 1
    print(f"torch {torch.__version__}, {torch.cuda.device_count()} x "
          f"{torch.cuda.get_device_name(0)}")
    try:
        import pytest  # noqa: F401
    except ImportError:
        sys.modules["pytest"] = pytest_stand_in()
    import test_checkpoint

    for name in TESTS:
        with tempfile.TemporaryDirectory() as tmp:
            getattr(test_checkpoint, name)(Path(tmp))
        print(f"passed {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
