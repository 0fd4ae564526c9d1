"""The run directory: every file and folder a run keeps there, named once.

Every process of a run finds its files through this module (``RunDir(path).summary``, ...),
never by spelling a name itself, so the layout below is the whole contract::

    <run dir>/
        config.yaml                 the resolved config the roles read (mode 0600: redis.url
                                    carries the password; its last line is its digest, see
                                    protocol.config.dump_resolved); node-<name>.yaml on a
                                    worker node
        summary.json                held-out success before/after warm-start and after RL,
                                    restarts, the learner's last record (autodidact run)
        pids.json                   pid of every supervised role; pids-<node>.json per node
        launcher.lock, learner.lock held (flock) by the run's one launcher and one learner;
                                    each holds its pid
        learner.token, actor.token, the secret each role's replay requests carry (its
        judge.token                 frames' credential): only the learner may take batches,
                                    commit the ledger and say hello, only actors push,
                                    only judges lease and label; mode 0600
        metrics.jsonl               every role's metrics records, appended
        split.json                  the env's task ids that train and those held out
        logs/<role>.log             each role's stdout and stderr
        logs/libraries.log          the launcher's library lines (engine start-up, warnings)
        model/                      the tiny base model (when model.path is empty)
        policy_init/                the warm-started policy (a Hugging Face model folder),
                                    with warmstart_tasks.json: the ids of its examples' tasks
        policy_final/               the newest published weights over the run's model
        weights/v000042.safetensors published policy versions (the newest weights.keep)
        checkpoints/latest.pt       the learner's checkpoint (weights, optimizer, ledger);
                                    previous.pt the one before it, digests.json the sha256
                                    of each (learner/checkpoint.py)
        learner_tokens/<group>.npz  the learner's log-prob of each token of the newest
                                    trained groups (learner.token_log_groups; format below)
        replay.lmdb/                the replay store (written by the replay server only)
        replay.sock                 the replay server's default ipc address
        replay.addr                 the address the replay server bound (while it runs)
        tasks.lmdb/                 the synthesized tasks (the explorer writes)
        explore/explorations.jsonl  every exploration: actions, observations, states
        explore/profile.json        the environment profile built from them
        explore/coverage.json       per tool: successful calls, share of stored tasks using it;
                                    per argument: values tried; the gaps (autodidact explore)
        experiences.log             the experience pool's durable copy (append-only)
        llm/<caller>.jsonl          every request to the LLM endpoint and its raw reply (the
                                    judge, the extractor, the proposer; autodidact llm-check)
        acks/<actor>.pending/       an actor's outbox: groups not yet acknowledged,
        acks/<actor>.tasks            the tasks it holds, and
        acks/<actor>.log              the acknowledged group ids
        redis/                      the embedded Redis: redis.sock, password (0600),
                                    redis.pid, redis.log, remote_url, its AOF and snapshot
        wandb/                      the offline wandb run; wandb/mirrored counts mirrored records
        eval/<env>-<split>-<policy>-k<k>.jsonl   autodidact eval: one line per task,
                                    and .summary.json beside it
        eval/test_looks.jsonl       one line each time the run's policies were evaluated on
                                    the test split (run --final-test, eval --split test)
        eval/heldout-<split>-<stage>.jsonl  a run's own held-out evaluations (stage base,
                                    warm or rl; split validation, or test when asked), one
                                    line per task: what paired intervals are read from
        report/                     autodidact report's plots, report.md, series.json
        ablation-argv.json          the command an ablation arm ran (autodidact ablation)

A token log file ``learner_tokens/<group id>.npz`` (numpy's npz, written by the learner alone,
atomically; ``learner.token_log.read_token_log`` reads it without torch) holds ``version``, an
int array of one element: the learner's policy version when the update that trained the group
began (the published weights it started from; exactly those with publish_every 1, up to
publish_every - 1 updates past them otherwise); and per trajectory ``i`` of the group
(``Group.trajectories`` order) ``logprobs_<i>``, float32, as long as the trajectory's
``tokens`` and aligned with them: the log-prob the learner gave that token under the policy it
started that update from (its proximal log-probs), NaN where it scored none (prompt and
observation tokens, an experience span stripped before training, tokens cut by the batch's
length limit). A group id's characters other than letters, digits and ``_.+-`` are written
``_`` in the file name. With several learner processes, only rank 0's groups are kept.

Each LMDB store has one writer, and a run directory one launcher and one learner:
:func:`single_writer_lock` takes an ``flock`` on a file and writes the holder's pid into it.
The kernel drops the lock when the holder dies, even by SIGKILL, so a crashed holder never
leaves a stale lock behind. Each LMDB store is opened only after :func:`check_lmdb_store` has
compared its data file with the file's own meta pages.
"""

from __future__ import annotations

import fcntl
import os
import re
import struct
from pathlib import Path

CONFIG = "config.yaml"
SUMMARY = "summary.json"
PIDS = "pids.json"
LAUNCHER_LOCK = "launcher.lock"
LEARNER_LOCK = "learner.lock"
TOKEN_SUFFIX = ".token"
METRICS = "metrics.jsonl"
SPLIT = "split.json"
LOGS = "logs"
MODEL = "model"
POLICY_INIT = "policy_init"
POLICY_FINAL = "policy_final"
WEIGHTS = "weights"
CHECKPOINTS = "checkpoints"
CHECKPOINT = "latest.pt"  # under checkpoints/
PREVIOUS_CHECKPOINT = "previous.pt"
CHECKPOINT_DIGESTS = "digests.json"
LEARNER_TOKENS = "learner_tokens"
REPLAY_STORE = "replay.lmdb"
REPLAY_ADDR = "replay.addr"
TASK_STORE = "tasks.lmdb"
EXPLORE = "explore"
EXPLORATIONS = "explorations.jsonl"  # under explore/
PROFILE = "profile.json"  # under explore/
COVERAGE = "coverage.json"  # under explore/
EXPERIENCES = "experiences.log"
LLM_REPLIES = "llm"
ACKS = "acks"
REDIS = "redis"
REDIS_SOCKET = "redis.sock"  # under redis/, and so on
REDIS_PASSWORD = "password"
REDIS_PID = "redis.pid"
REDIS_LOG = "redis.log"
REDIS_REMOTE_URL = "remote_url"
WANDB = "wandb"
EVAL = "eval"
# A run's own held-out evaluations, in the order they happen: summary.json's
# success_<stage> and eval/heldout-<split>-<stage>.jsonl
HELD_OUT_STAGES = ("base", "warm", "rl")
REPORT = "report"
ABLATION_ARGV = "ablation-argv.json"


class RunDir:
    """The paths of one run directory (nothing is created or read here)."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)

    def __repr__(self) -> str:
        return f"RunDir({str(self.path)!r})"

    # --- the launcher's files -------------------------------------------------------------

    @property
    def config(self) -> Path:
        return self.path / CONFIG

    def node_config(self, node: str) -> Path:
        """A worker node's resolved config (the run dir may be shared between nodes)."""
        return self.path / f"node-{node}.yaml"

    @property
    def summary(self) -> Path:
        return self.path / SUMMARY

    @property
    def pids(self) -> Path:
        return self.path / PIDS

    @property
    def launcher_lock(self) -> Path:
        return self.path / LAUNCHER_LOCK

    @property
    def learner_lock(self) -> Path:
        return self.path / LEARNER_LOCK

    def role_token(self, role: str) -> Path:
        return self.path / f"{role}{TOKEN_SUFFIX}"

    def node_pids(self, node: str) -> Path:
        return self.path / f"pids-{node}.json"

    @property
    def metrics(self) -> Path:
        return self.path / METRICS

    @property
    def split(self) -> Path:
        return self.path / SPLIT

    @property
    def logs(self) -> Path:
        return self.path / LOGS

    def log(self, role: str) -> Path:
        return self.logs / f"{role}.log"

    # --- models and weights ---------------------------------------------------------------

    @property
    def model(self) -> Path:
        return self.path / MODEL

    @property
    def policy_init(self) -> Path:
        return self.path / POLICY_INIT

    @property
    def warmstart_tasks(self) -> Path:
        """The task ids of the warm-start's examples, kept with the policy they made."""
        return self.path / POLICY_INIT / "warmstart_tasks.json"

    @property
    def policy_final(self) -> Path:
        return self.path / POLICY_FINAL

    @property
    def weights(self) -> Path:
        return self.path / WEIGHTS

    def weights_file(self, version: int) -> Path:
        return self.weights / f"v{version:06d}.safetensors"

    def published_weights(self) -> list[Path]:
        """The complete published weight files, oldest version first."""
        return sorted(self.weights.glob("v*.safetensors"))

    @property
    def checkpoints(self) -> Path:
        return self.path / CHECKPOINTS

    @property
    def checkpoint(self) -> Path:
        return self.checkpoints / CHECKPOINT

    @property
    def previous_checkpoint(self) -> Path:
        return self.checkpoints / PREVIOUS_CHECKPOINT

    @property
    def checkpoint_digests(self) -> Path:
        return self.checkpoints / CHECKPOINT_DIGESTS

    @property
    def learner_tokens(self) -> Path:
        return self.path / LEARNER_TOKENS

    def learner_tokens_file(self, group_id: str) -> Path:
        """The learner's per-token log-probs of one trained group (format above)."""
        return self.learner_tokens / f"{_file_safe(group_id)}.npz"

    # --- stores ---------------------------------------------------------------------------

    @property
    def replay_store(self) -> Path:
        return self.path / REPLAY_STORE

    @property
    def replay_addr(self) -> Path:
        return self.path / REPLAY_ADDR

    @property
    def task_store(self) -> Path:
        return self.path / TASK_STORE

    @property
    def explore(self) -> Path:
        return self.path / EXPLORE

    @property
    def explorations(self) -> Path:
        return self.explore / EXPLORATIONS

    @property
    def profile(self) -> Path:
        return self.explore / PROFILE

    @property
    def coverage(self) -> Path:
        return self.explore / COVERAGE

    @property
    def experiences(self) -> Path:
        return self.path / EXPERIENCES

    @property
    def acks(self) -> Path:
        return self.path / ACKS

    def llm_replies(self, caller: str) -> Path:
        """Requests to the LLM endpoint and their raw replies, for one caller (``judge-0``)."""
        return self.path / LLM_REPLIES / f"{caller}.jsonl"

    # --- services and outputs -------------------------------------------------------------

    @property
    def redis(self) -> Path:
        return self.path / REDIS

    @property
    def redis_socket(self) -> Path:
        return self.redis / REDIS_SOCKET

    @property
    def redis_password(self) -> Path:
        return self.redis / REDIS_PASSWORD

    @property
    def redis_pid(self) -> Path:
        return self.redis / REDIS_PID

    @property
    def redis_log(self) -> Path:
        return self.redis / REDIS_LOG

    @property
    def redis_remote_url(self) -> Path:
        return self.redis / REDIS_REMOTE_URL

    @property
    def wandb(self) -> Path:
        return self.path / WANDB

    @property
    def wandb_cursor(self) -> Path:
        return self.wandb / "mirrored"

    @property
    def eval(self) -> Path:
        return self.path / EVAL

    def eval_results(self, env: str, split: str, policy: str, k: int) -> Path:
        """A plugin env's ``pkg.module:name`` becomes ``pkg.module_name``: no colon in a file
        name (Windows and some shells refuse or misread it)."""
        parts = (_file_safe(p) for p in (env, split, policy))
        return self.eval / ("-".join(parts) + f"-k{k}.jsonl")

    def heldout_records(self, split: str, stage: str) -> Path:
        """Per-task records of the run's own evaluation of ``stage`` ("base", "warm",
        "rl") on ``split`` ("validation", or "test" when the run was asked to look)."""
        return self.eval / f"heldout-{split}-{stage}.jsonl"

    @property
    def test_looks(self) -> Path:
        """Every evaluation on the test split made for this run: who, when, which model."""
        return self.eval / "test_looks.jsonl"

    @property
    def report(self) -> Path:
        return self.path / REPORT

    @property
    def ablation_argv(self) -> Path:
        return self.path / ABLATION_ARGV


def _file_safe(word: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.+-]", "_", word)


def role_token(run_dir: Path, role: str, create: bool = False) -> str:
    """The run's token for ``role`` (one of protocol.messages.REPLAY_ROLES; "" when the run
    has none; with ``create``, made once, mode 0600). A replay server started on a run
    directory that has one serves that role's requests (protocol.messages.REPLAY_SENDER) only
    to frames that carry it, when its socket has no CURVE keys to tell roles apart."""
    path = RunDir(run_dir).role_token(role)
    if create and not path.exists():
        make_token_file(path)
    return path.read_text().strip() if path.exists() else ""


def make_token_file(path: Path) -> None:
    """A new random token at ``path``, mode 0600, never replacing one (another process may
    make it meanwhile: its token stands)."""
    import secrets

    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(24))


def single_writer_lock(store_dir: Path, lock_name: str, busy_message: str) -> int:
    """Take the lock ``store_dir/lock_name`` (creating the directory), write this process's
    pid into it and return its fd, which holds the lock until closed; raise
    RuntimeError(``busy_message``, with ``{pid}`` replaced by the holder's) if another process
    has it."""
    store_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(store_dir / lock_name, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise RuntimeError(busy_message.replace("{pid}", holder)) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


class StoreDamaged(OSError):
    """The store's data file is not what its own header says it is; mapping it could SIGBUS."""


# LMDB's data file starts with two meta pages (64-bit layout: a 16-byte page header, then the
# meta: magic, version, address, map size, the two sub-db records, last page, txn id). The page
# size is kept in the free-list record's pad field.
_LMDB_META = struct.Struct("<16xIIQQI44x48xQQ")
_LMDB_MAGIC = 0xBEEFC0DE


def check_lmdb_store(store_dir: Path) -> None:
    """Refuse an LMDB store whose data file is shorter than its newest meta page says, or has
    no meta page, before it is mapped: reading past the end of a mapping is a SIGBUS, not an
    error. Every LMDB store of a run (replay, tasks) is opened after this check."""
    data_file = Path(store_dir) / "data.mdb"
    size = data_file.stat().st_size if data_file.exists() else 0
    if size == 0:
        return  # a new store: LMDB writes the meta pages
    with data_file.open("rb") as f:
        head = f.read(_LMDB_META.size).ljust(_LMDB_META.size, b"\0")
        magic, _, _, _, page_size, _, _ = _LMDB_META.unpack(head)
        if magic != _LMDB_MAGIC or not 512 <= page_size <= 65536:
            raise StoreDamaged(f"{data_file}: not an LMDB data file (no meta page); move it "
                               "away to start an empty store, or restore it from a copy")
        f.seek(page_size)
        second = f.read(_LMDB_META.size).ljust(_LMDB_META.size, b"\0")
    metas = [_LMDB_META.unpack(head), _LMDB_META.unpack(second)]
    last_page, _ = max(((m[5], m[6]) for m in metas if m[0] == _LMDB_MAGIC),
                       key=lambda m: m[1])
    needed = (last_page + 1) * page_size
    if size < needed:
        raise StoreDamaged(f"{data_file}: {size} bytes, but its header says {needed} (it was "
                           "cut short); restore it from a copy, or move it away to start an "
                           "empty store (its groups are then lost)")
