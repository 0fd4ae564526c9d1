"""Coverage-guided fuzzing (atheris / libFuzzer) of the wire codec and the replay server's
decode and dispatch path.

    .venv/bin/python -m scripts.fuzz_atheris --runs 20000          # about a minute on 2 cores
    .venv/bin/python -m scripts.fuzz_atheris --runs 0 -- -max_total_time=600   # libFuzzer args

Each input is used three ways: as a whole frame; as the body of a frame whose type tag it picks
(every registered type); and as a mutation (truncate, flip, splice) of a valid frame of each
type the server serves. Every frame goes through ``codec.decode`` (which may only raise
SchemaError), then through a real in-process :class:`replay.server.ReplayServer` (LMDB in a
temporary directory): ``RouterServer._decode`` then ``ReplayServer.handle``, exactly what the
serving loop runs. A crash is any other exception, a handler crash counted as
``errors/internal`` or ``errors/store``, or a reply that is not a message. libFuzzer writes the
input that crashed to ``crash-<sha1>`` in the working directory; replay one with
``python -m scripts.fuzz_atheris crash-<sha1>``.

atheris is in the ``dev`` extra on Linux x86-64 with CPython >= 3.11 (it ships wheels there);
elsewhere ``pip install atheris`` needs clang with libFuzzer.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import sys
import tempfile
from pathlib import Path

try:
    import atheris
except ImportError:  # pragma: no cover - only where the dev extra could not install it
    sys.exit("atheris is not installed: pip install atheris (Linux x86-64 wheels for "
             "CPython 3.11+; elsewhere it needs clang with libFuzzer)")

with atheris.instrument_imports(include=["protocol", "replay"]):
    from protocol import codec
    from protocol.config import ReplayConfig
    from protocol.errors import SchemaError
    from replay.server import ReplayServer

from tests.helpers_replay import base_frames, make_group  # not instrumented

TAGS = sorted(codec.registered_types())
STORED = [make_group(i, f"stored-{i}") for i in range(3)]
BASE = base_frames(STORED)


class Target:
    def __init__(self, run_dir: str):
        cfg = ReplayConfig(map_size=1 << 30, max_frame_bytes=1 << 20)
        self.server = ReplayServer(run_dir, cfg, address="tcp://127.0.0.1:*")
        self.frames = 0
        replies = self.server.handle([self._incoming(codec.encode(g, "seed")) for g in STORED])
        assert all(type(r).__name__ == "Ack" for _, r in replies), replies

    def _incoming(self, frame: bytes):
        return self.server.rpc._decode([b"fuzz-route", frame])

    def frame(self, frame: bytes) -> None:
        self.frames += 1
        try:
            codec.decode(frame, self.server.cfg.max_frame_bytes)
        except SchemaError:
            pass
        replies = self.server.handle([self._incoming(frame)])
        for _, reply in replies:
            if not hasattr(type(reply), "TYPE"):
                raise AssertionError(f"reply {reply!r} is not a message")
            codec.encode(reply, "r")  # every reply must go out on the wire
        bad = {k: v for k, v in self.server.counters.items()
               if k in ("errors/internal", "errors/store") and v}
        if bad:
            raise AssertionError(f"server handler crashed on this frame: {bad}")

    def one_input(self, data: bytes) -> None:
        how, data = (data[0] % 4, data[1:]) if data else (0, b"")
        if how == 0:  # the seeds: a 0 byte, then a valid frame
            self.frame(data)
            return
        fdp = atheris.FuzzedDataProvider(data)
        if how == 1:
            tag = TAGS[fdp.ConsumeIntInRange(0, len(TAGS) - 1)]
            self.frame(codec.pack_frame(tag, "fz", fdp.ConsumeBytes(fdp.remaining_bytes())))
            return
        base = bytearray(BASE[fdp.ConsumeIntInRange(0, len(BASE) - 1)])
        if how == 2:  # flip bytes in place
            for _ in range(fdp.ConsumeIntInRange(1, 8)):
                if not base:
                    break
                base[fdp.ConsumeIntInRange(0, len(base) - 1)] ^= fdp.ConsumeIntInRange(1, 255)
            self.frame(bytes(base))
            return
        cut = fdp.ConsumeIntInRange(0, len(base))  # splice: a prefix, then the fuzzer's bytes
        self.frame(bytes(base[:cut]) + fdp.ConsumeBytes(fdp.remaining_bytes()))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=10_000,
                        help="inputs to try (0 = until stopped or -max_total_time)")
    parser.add_argument("inputs", nargs="*", help="crash files to replay, or libFuzzer args "
                        "after --")
    args, rest = parser.parse_known_args(argv)
    logging.basicConfig(level=logging.CRITICAL)  # every refusal logs a warning: keep quiet
    # libFuzzer ends the process with exit(): nothing after Fuzz() runs, so the work folder
    # is per process id and the ones of finished runs are removed at the next start.
    base = Path(tempfile.gettempdir()) / "autodidact-fuzz-atheris"
    for old in base.glob("*") if base.exists() else ():
        if old.name.isdigit() and not _alive(int(old.name)):
            shutil.rmtree(old, ignore_errors=True)
    work = base / str(os.getpid())
    target = Target(str(work / "run"))
    corpus = work / "corpus"
    corpus.mkdir(parents=True)
    for i, frame in enumerate(BASE):  # seeds: one valid frame of each type served
        (corpus / f"seed-{i}").write_bytes(b"\x00" + frame)
    crash_files = [a for a in args.inputs if os.path.isfile(a)]
    lib_args = [a for a in args.inputs if a not in crash_files] + rest
    if crash_files:
        lib_args = crash_files + lib_args
    else:
        lib_args = ([f"-runs={args.runs}"] if args.runs else []) + ["-max_len=65536",
                                                                    str(corpus), *lib_args]
    atheris.Setup([sys.argv[0], *lib_args], target.one_input)
    atheris.Fuzz()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


if __name__ == "__main__":
    main()
