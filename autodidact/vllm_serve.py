"""``vllm serve`` as a child process: an OpenAI-compatible endpoint on a local model folder,
for the LLM judge, the task proposer and the experience extractor (``llm.url``).

The server runs under the engine's interpreter (``.venv-vllm``, see autodidact.engine_env), in
its own session, with the parent-death signal set, so it goes when its parent goes, however
that ends; :meth:`VLLMServer.stop` takes down its whole process group (the API server and its
engine-core process).
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

from autodidact.supervisor import parent_death_preexec, stop_process_group


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class VLLMServer:
    """``with VLLMServer(folder, python) as server: OpenAIChat(server.url, server.name)``.

    On CPU (``cpu=True``) the engine gets the settings actors use there: eager, float32, a
    ``kv_cache_gib`` KV cache, ``threads`` OpenMP threads on the first cores.
    """

    def __init__(self, model_path: str | os.PathLike, python: str | os.PathLike,
                 log_path: str | os.PathLike, name: str = "policy", cpu: bool = True,
                 max_model_len: int = 2048, kv_cache_gib: int = 1, threads: int = 2,
                 start_timeout_s: float = 300.0):
        self.model_path, self.python, self.name = str(model_path), str(python), name
        self.log_path = Path(log_path)
        self.cpu, self.max_model_len = cpu, max_model_len
        self.kv_cache_gib, self.threads = kv_cache_gib, max(1, threads)
        self.start_timeout_s = start_timeout_s
        self.port = free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def argv(self) -> list[str]:
        argv = [self.python, "-m", "vllm.entrypoints.openai.api_server",
                "--model", self.model_path, "--served-model-name", self.name,
                "--host", "127.0.0.1", "--port", str(self.port),
                "--max-model-len", str(self.max_model_len), "--disable-log-stats"]
        if self.cpu:
            argv += ["--dtype", "float32", "--enforce-eager"]
        return argv

    def env(self) -> dict[str, str]:
        from inference.engines import cpu_engine_env

        # Its own log file takes vLLM's lines: the launcher's library_logs_to turned vLLM's
        # logging off in its own process, not for the server's.
        env = {**os.environ, "VLLM_CONFIGURE_LOGGING": "1"}
        if self.cpu:  # the API server runs its engine in a process of its own, as it should
            env.update(cpu_engine_env(self.kv_cache_gib, self.threads))
        return env

    def start(self) -> VLLMServer:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")
        try:
            self.proc = subprocess.Popen(self.argv(), env=self.env(), stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True,
                                         preexec_fn=parent_death_preexec())
        finally:
            log.close()
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited with {self.proc.returncode} before it "
                                   f"answered; see {self.log_path}")
            try:
                with urllib.request.urlopen(f"{self.url}/models", timeout=2) as resp:
                    if resp.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(1.0)
        raise TimeoutError(f"vllm serve did not answer within {self.start_timeout_s:.0f}s; "
                           f"see {self.log_path}")

    def stop(self, grace_s: float = 20.0) -> None:
        """SIGTERM to the server's process group, SIGKILL after ``grace_s``."""
        proc, self.proc = self.proc, None
        if proc is not None:  # the engine-core child may outlive its parent: the group goes
            stop_process_group(proc, grace_s)

    def __enter__(self) -> VLLMServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


@contextlib.contextmanager
def served_judge(cfg, run_dir: Path):
    """``cfg`` as the RL phase's roles should read it: with ``judge.serve`` set (and judges to
    run), ``vllm serve`` on that model for as long as the block lasts, and ``judge.url``,
    ``judge.model`` and ``judge.backend=endpoint`` pointing at it; else ``cfg`` unchanged.

    The server's output goes to the run's ``logs/vllm-serve-judge.log``; it is stopped when
    the block ends, and dies with this process however that ends."""
    if not (cfg.judge.serve and cfg.judge.workers):
        yield cfg
        return
    import torch

    from autodidact.engine_env import vllm_python
    from inference.models import model_folder
    from protocol.config import with_values
    from protocol.run_dir import RunDir

    python = vllm_python()
    if python is None:
        raise RuntimeError("judge.serve needs vLLM: run bash scripts/setup.sh (it makes "
                           ".venv-vllm), or give judge.url instead")
    server = VLLMServer(model_folder(cfg.judge.serve), python,
                        RunDir(run_dir).log("vllm-serve-judge"),
                        name=Path(cfg.judge.serve).name, cpu=not torch.cuda.is_available(),
                        max_model_len=4096, threads=cfg.actor.torch_threads or 1)
    with server:
        yield with_values(cfg, {"judge.url": server.url, "judge.model": server.name,
                                "judge.backend": "endpoint"})
