"""The learner on several processes (issue 9): 2 ranks over gloo on CPU, started by torchrun.

- DDP: both ranks hold bit-identical parameters after several updates;
- two ranks on halves of a batch take the step one process takes on the whole batch (loss,
  gradient norm, parameters), for both loss aggregations, with unequal rows and tokens per
  rank, degenerate groups, a row without generated tokens, and gradient accumulation
  (DDP ``no_sync``, a rank with fewer rows than micro-batches);
- accumulation on one process equals the unsplit step;
- FSDP2 (``fully_shard``) does the same, writes checkpoints in the one-process format, and a
  sharded learner resumed from one continues exactly as the learner that wrote it;
- end to end: ``autodidact learner`` under torchrun against a real replay server and Redis:
  each rank draws its share under its own id, rank 0 alone says hello, commits the ledger
  (all ids once), publishes and checkpoints.

Run as a script (``torchrun ... tests/test_ddp.py MODE ...``) this file is also the worker
the tests start.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch

from inference.tiny_model import make_tiny_model
from metrics.jsonl import read_metrics
from protocol.config import RunConfig
from protocol.messages import Group, Task, Trajectory

ROOT = Path(__file__).resolve().parents[1]

WORDS = [f"w{i}" for i in range(60)]
VOCAB = 4 + len(WORDS)
UPDATES = 2
# name -> learner settings; each is run on 2 ranks and compared with 1 rank on the whole batch.
SCENARIOS = {
    "ddp-token": {"loss_aggregation": "token-mean"},
    "ddp-seq": {"loss_aggregation": "seq-mean-token-mean"},
    # 3 micro-batches: rank 1 has 2 rows in the second update, so one of its is blank.
    "ddp-seq-acc3": {"loss_aggregation": "seq-mean-token-mean", "accumulation": 3},
    # Token-budget micro-batches: the ranks need different numbers of them (blank ones pad).
    "ddp-token-mbt": {"loss_aggregation": "token-mean", "micro_batch_tokens": 70},
    "fsdp-token-acc2-kl": {"parallel": "fsdp", "loss_aggregation": "token-mean",
                           "accumulation": 2, "kl_coef": 0.1},
    # LoRA: only the adapter trains (and the KL reference is the base, adapters off).
    "ddp-lora-kl": {"loss_aggregation": "seq-mean-token-mean", "lora_rank": 4,
                    "lora_alpha": 8.0, "kl_coef": 0.1},
    "fsdp-lora-acc2": {"parallel": "fsdp", "loss_aggregation": "token-mean", "accumulation": 2,
                       "lora_rank": 4, "lora_alpha": 8.0, "lora_targets": ["q_proj", "v_proj"]},
    # Packed rows, shared prefixes once (learner.layout), against one padded rank: packed
    # token budgets (blank micro-batches pad the rank that needs fewer), and FSDP with LoRA.
    "ddp-shared-prefix-mbt": {"layout": "shared_prefix", "loss_aggregation": "token-mean",
                              "micro_batch_tokens": 70},
    "fsdp-packed-lora-acc2": {"layout": "packed", "parallel": "fsdp", "accumulation": 2,
                              "lora_rank": 4, "lora_alpha": 8.0},
}


# --- shared by the tests and the worker ----------------------------------------------------------


def tiny_model(folder: Path) -> str:
    return str(make_tiny_model(folder, WORDS, hidden=32, layers=2, heads=2, kv_heads=1,
                               intermediate=64, max_positions=128))


def trajectory(rng, name: str, length: int, generated: bool = True) -> Trajectory:
    prompt = max(1, length // 3)
    mask = np.zeros(length, np.uint8)
    if generated:
        mask[prompt:] = rng.integers(0, 2, length - prompt)
        mask[-1] = 1
    return Trajectory(
        traj_id=name, tokens=rng.integers(4, VOCAB, length).astype(np.int32),
        logprobs=(-rng.random(length) * mask).astype(np.float32),
        versions=np.where(mask == 1, 0, -1).astype(np.int32), action_mask=mask,
        prompt_len=prompt, reward=float(rng.random()))


def group(seed: int, lengths: list[int], silent: int | None = None) -> Group:
    """A group of ``len(lengths)`` trajectories; trajectory ``silent`` generated nothing."""
    rng = np.random.default_rng(seed)
    trajs = [trajectory(rng, f"t{i}", n, generated=i != silent) for i, n in enumerate(lengths)]
    task = Task(task_id=f"task{seed}", env="files", query="q", seed=seed)
    return Group(group_id=f"g{seed}", task=task, trajectories=trajs, actor_id="test",
                 created_at=1.0e9 + seed)


def shares(update: int) -> list[list[Group]]:
    """Update ``update``'s groups, as rank 0's and rank 1's shares: unequal rows and tokens,
    one-trajectory (degenerate) groups, a row without generated tokens."""
    if update == 0:
        return [[group(1, [30, 26, 22]), group(2, [18, 12], silent=1)],
                [group(3, [9]), group(4, [8, 10])]]
    return [[group(5, [20, 24, 16]), group(6, [14, 28, 10])], [group(7, [11]), group(8, [7])]]


def learner_config(model: str, **learner_sets) -> RunConfig:
    cfg = RunConfig()
    cfg.model.path = model
    cfg.judge.workers = 0  # outcome advantages: no labels to wait for
    cfg.learner.warmup_updates = 1
    cfg.learner.lr = 1e-3
    cfg.learner.kl_coef = 0.0  # no KL penalty (the default's 0.1) but where a test names one
    for name, value in learner_sets.items():
        setattr(cfg.learner, name, value)
    return cfg


def state_of(learner) -> dict[str, torch.Tensor]:
    """The full parameters (rank 0 only under FSDP; every rank's own copy otherwise)."""
    from torch.distributed.fsdp import FSDPModule

    model = learner.step.model
    if isinstance(model, FSDPModule):
        return learner.ranks.model_state(model)
    return {k: v.detach().clone() for k, v in learner.ranks.unwrap(model).state_dict().items()}


def update_rows(run_dir: Path) -> list[dict]:
    return [r for r in read_metrics(run_dir, "learner") if "learner/loss" in r]


# --- the worker (a torchrun rank) ----------------------------------------------------------------


def run_scenarios(out: Path, model: str, redis_url: str) -> None:
    """Each scenario on this rank's shares; saves the parameters per rank (rank 0's metrics
    land in ``out/<scenario>``)."""
    from autodidact.wiring import build_learner
    from learner.distributed import Ranks
    from protocol.control import ControlPlane

    ranks = Ranks.from_env().start(torch.device("cpu"))
    control = ControlPlane.connect(redis_url, f"ddp:{uuid.uuid4().hex[:8]}")
    for name, sets in SCENARIOS.items():
        (out / name).mkdir(exist_ok=True)
        learner = build_learner(learner_config(model, **sets), out / name, control, None,
                                ranks=ranks)
        for u in range(UPDATES):
            learner.update(shares(u)[ranks.rank], 0.0)
        state = state_of(learner)
        if sets.get("parallel") == "fsdp":
            state = check_fsdp_resume(learner, out / name, model, sets, ranks, control) or state
        torch.save({"state": state, "ledger": learner.consumed}, out / name / f"r{ranks.rank}.pt")
        learner.close()
    ranks.close()


def check_fsdp_resume(learner, run_dir: Path, model: str, sets: dict, ranks, control):
    """Checkpoint; a new sharded learner resumes from it; both take one more update on the
    same groups; rank 0 saves both results (the test compares them)."""
    from autodidact.wiring import build_learner

    learner._uncommitted = []  # no replay server to commit to here
    learner.checkpoint()
    ranks.barrier()  # rank 0 has written it
    resumed = build_learner(learner_config(model, **sets), run_dir, control, None, ranks=ranks)
    assert resumed.resume()
    for each in (learner, resumed):
        each.update(shares(0)[ranks.rank], 0.0)
    after, again = state_of(learner), state_of(resumed)
    resumed.close()
    if ranks.is_main:
        torch.save({"after": after, "resumed": again}, run_dir / "resume.pt")
    return None


def spy_and_run_cli(spy_dir: Path, argv: list[str]) -> None:
    """``autodidact <argv>``, recording who called what that only rank 0 may call."""
    from autodidact import cli
    from protocol.replay_client import ReplayClient
    from protocol.weights import WeightPublisher

    calls: dict[str, list] = {"publisher": [], "publish": [], "save": [], "hello": [],
                              "commit": [], "batch": []}

    def spy(cls, name, record):
        original = getattr(cls, name)

        def wrapper(*args, **kwargs):
            result = original(*args, **kwargs)
            calls[record[0]].append(record[1](args, result))
            return result

        setattr(cls, name, wrapper)

    spy(WeightPublisher, "__init__", ("publisher", lambda a, r: str(a[1])))
    spy(WeightPublisher, "publish", ("publish", lambda a, r: a[2]))
    spy(ReplayClient, "hello", ("hello", lambda a, r: [a[1], a[2], list(a[3])]))
    spy(ReplayClient, "commit_ledger", ("commit", lambda a, r: [a[1], list(a[2])]))
    spy(ReplayClient, "request_batch",
        ("batch", lambda a, r: [a[1], [g.group_id for g in r.groups]]))
    original_save = torch.save

    def save(obj, f, *args, **kwargs):
        calls["save"].append(str(f))
        return original_save(obj, f, *args, **kwargs)

    torch.save = save
    rank = os.environ.get("RANK", "0")
    (spy_dir / f"pid.r{rank}").write_text(str(os.getpid()))
    try:
        cli.main(argv, standalone_mode=False)
    finally:
        (spy_dir / f"calls.r{rank}.json").write_text(json.dumps(calls))


if __name__ == "__main__":
    mode, first, *rest = sys.argv[1:]
    if mode == "scenarios":
        run_scenarios(Path(first), *rest)
    elif mode == "cli":
        spy_and_run_cli(Path(first), rest)
    sys.exit(0)


# --- the tests -----------------------------------------------------------------------------------


def start_torchrun(log: Path, *args: str) -> subprocess.Popen:
    """``torchrun --nproc-per-node 2`` on this file, on a free port of its own."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           "2", str(Path(__file__).resolve()), *args]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1",
           "OMP_NUM_THREADS": "1"}
    with open(log, "ab") as out:  # a session of its own: see finish
        return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)


def finish(proc: subprocess.Popen, log: Path, timeout: int = 200) -> None:
    """Wait for torchrun; on failure kill its whole process group, ranks included (killing
    the agent alone would leave them running)."""
    try:
        proc.wait(timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, log.read_text(errors="replace")[-8000:]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return tiny_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory, model, redis_url) -> Path:
    """Every scenario run once on 2 ranks; the folder with their results."""
    out = tmp_path_factory.mktemp("ddp")
    log = out / "torchrun.log"
    finish(start_torchrun(log, "scenarios", str(out), model, redis_url), log)
    return out


def one_rank(model, run_dir: Path, control, **sets):
    """The reference: one process, the whole batch of each update."""
    from autodidact.wiring import build_learner

    torch.manual_seed(0)
    learner = build_learner(learner_config(model, **sets), run_dir, control, None)
    for u in range(UPDATES):
        learner.update([g for share in shares(u) for g in share], 0.0)
    learner.close()  # its publisher thread announces in Redis, whose client the fixture closes
    return learner


def rank_result(out: Path, scenario: str, rank: int) -> dict:
    return torch.load(out / scenario / f"r{rank}.pt", weights_only=True)


def assert_states_close(got: dict, want: dict, atol: float = 1e-5) -> None:
    assert got.keys() == want.keys()
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=0, atol=atol, msg=key)


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("scenario", ["ddp-token", "ddp-seq", "ddp-seq-acc3", "ddp-lora-kl"])
def test_ddp_ranks_hold_identical_parameters(two_ranks, scenario):
    r0, r1 = rank_result(two_ranks, scenario, 0), rank_result(two_ranks, scenario, 1)
    assert r0["state"].keys() == r1["state"].keys()
    assert all(torch.equal(r0["state"][k], r1["state"][k]) for k in r0["state"])
    # Both ranks keep the same ledger: every rank's ids of every update, in rank order.
    ids = [g.group_id for u in range(UPDATES) for share in shares(u) for g in share]
    assert r0["ledger"] == r1["ledger"] == ids


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_two_ranks_step_as_one_rank_on_the_whole_batch(two_ranks, scenario, model, tmp_path,
                                                       control):
    sets = SCENARIOS[scenario]
    alone = one_rank(model, tmp_path, control,
                     **{k: v for k, v in sets.items()
                        if k not in ("parallel", "accumulation", "micro_batch_tokens",
                                     "layout")})
    got = update_rows(two_ranks / scenario)[:UPDATES]
    want = update_rows(tmp_path)
    assert len(got) == len(want) == UPDATES
    for g, w in zip(got, want):
        # entropy and kl_initial (learner/step.py) are summed over ranks' tokens, as the loss
        kl = ("kl_initial",) if "learner/kl_initial" in w else ()
        for name in ("loss", "pg_loss", "grad_norm", "tokens", "groups", "entropy") + kl:
            assert g[f"learner/{name}"] == pytest.approx(w[f"learner/{name}"], rel=1e-5,
                                                         abs=1e-7), name
    assert_states_close(rank_result(two_ranks, scenario, 0)["state"],
                        alone.ranks.unwrap(alone.step.model).state_dict())
    # The ranks' shares really differ, so the scaling had something to do.
    for u in range(UPDATES):
        rows = [sum(len(g.trajectories) for g in share) for share in shares(u)]
        assert rows[0] != rows[1]


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("scenario", ["fsdp-token-acc2-kl", "fsdp-lora-acc2"])
def test_fsdp_checkpoint_is_single_process_format_and_resumes(two_ranks, model, tmp_path,
                                                              control, scenario):
    from autodidact.wiring import build_learner
    from learner.learner import load_checkpoint

    run_dir = two_ranks / scenario
    ckpt = load_checkpoint(run_dir / "checkpoints" / "latest.pt")
    assert ckpt["updates"] == UPDATES
    assert all(isinstance(k, int) for k in ckpt["optimizer"]["state"])
    # A one-process learner takes the sharded run's checkpoint as its own.
    sets = {k: v for k, v in SCENARIOS[scenario].items() if k not in ("parallel", "accumulation")}
    single = build_learner(learner_config(model, **sets), run_dir, control, None)
    assert single.resume()
    single.close()
    lora = single.step.adapter is not None
    assert lora == (scenario == "fsdp-lora-acc2")
    # With LoRA the checkpoint holds the adapter alone, and the optimizer only its state.
    assert_states_close(single.ranks.model_state(single.step.model, trainable_only=lora),
                        ckpt["model"], atol=0)
    assert len(ckpt["optimizer"]["state"]) == len(ckpt["model"]) if lora else True
    # The resumed sharded learner continued exactly as the one that wrote the checkpoint.
    resumed = torch.load(run_dir / "resume.pt", weights_only=True)
    assert_states_close(resumed["resumed"], resumed["after"], atol=1e-6)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean"])
def test_accumulation_equals_the_unsplit_step(model, tmp_path, control, aggregation):
    whole = one_rank(model, tmp_path / "one", control, loss_aggregation=aggregation)
    split = one_rank(model, tmp_path / "three", control, loss_aggregation=aggregation,
                     accumulation=3)
    assert_states_close(split.step.model.state_dict(), whole.step.model.state_dict())
    for a, b in zip(update_rows(tmp_path / "three"), update_rows(tmp_path / "one")):
        assert a["learner/loss"] == pytest.approx(b["learner/loss"], rel=1e-5)


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("aggregation", "kl_coef"), [
    ("token-mean", 0.0), ("seq-mean-token-mean", 0.0), ("token-mean", 0.1)])
def test_token_budget_micro_batches_equal_the_unsplit_step(model, tmp_path, control,
                                                           aggregation, kl_coef, monkeypatch):
    """Rows packed by length into micro-batches of at most 60 padded tokens, each trimmed to
    its longest row: more backward passes, the same step. The reference's forward (the KL
    penalty's, and ``kl_initial``'s on the diagnosed updates) keeps to the budget too."""
    import learner.step as step_module

    whole = one_rank(model, tmp_path / "one", control, loss_aggregation=aggregation,
                     diagnostics_every=1, kl_coef=kl_coef)
    shapes = []
    scored = step_module.token_logprobs

    def recording(model, input_ids, *args):
        shapes.append(tuple(input_ids.shape))
        return scored(model, input_ids, *args)

    monkeypatch.setattr(step_module, "token_logprobs", recording)
    packed = one_rank(model, tmp_path / "packed", control, loss_aggregation=aggregation,
                      micro_batch_tokens=60, diagnostics_every=1, kl_coef=kl_coef)
    assert len(shapes) > 4 * UPDATES  # several micro-batches per update, reference's too...
    assert all(rows * width <= 60 or rows == 1 for rows, width in shapes)  # ...within budget
    assert len({width for _, width in shapes}) > 1  # each trimmed to its own longest row
    assert_states_close(packed.step.model.state_dict(), whole.step.model.state_dict())
    for a, b in zip(update_rows(tmp_path / "packed"), update_rows(tmp_path / "one")):
        # the loss holds the KL penalty: the reference scored in parts is the whole one's
        assert a["learner/loss"] == pytest.approx(b["learner/loss"], rel=1e-5)
        if not kl_coef:  # kl_initial is summed over tokens across micro-batches (kl_ref is
            # a loss metric, a mean of the micro-batches' means like the clip fractions)
            assert a["learner/kl_initial"] == pytest.approx(b["learner/kl_initial"], rel=1e-4)


@pytest.mark.timeout(120)
def test_bf16_autocast_trains_in_float32_parameters(model, tmp_path, control):
    fp32 = one_rank(model, tmp_path / "fp32", control)
    bf16 = one_rank(model, tmp_path / "bf16", control, autocast="bf16")
    assert bf16.step.autocast == torch.bfloat16 and fp32.step.autocast is None  # auto: CPU none
    assert all(p.dtype == torch.float32 for p in bf16.step.model.parameters())
    rows = update_rows(tmp_path / "bf16")
    assert all(np.isfinite(r["learner/loss"]) for r in rows)
    moved = [not torch.equal(a, b) for a, b in zip(bf16.step.model.parameters(),
                                                    fp32.step.model.parameters())]
    assert any(moved)  # the forward really ran in bfloat16


@pytest.mark.parametrize(("setting", "device", "vllm_dtype", "want"), [
    ("auto", "cuda", "bfloat16", torch.bfloat16),  # behind bf16 samplers: match them
    ("auto", "cuda", "float32", None),  # behind fp32 samplers: on-policy weights stay 1
    ("auto", "cpu", "bfloat16", None),
    ("bf16", "cpu", "float32", torch.bfloat16),
    ("none", "cuda", "bfloat16", None)])
def test_auto_autocast_follows_the_actors_precision(setting, device, vllm_dtype, want):
    from learner.step import autocast_dtype

    cfg = RunConfig()
    cfg.actor.backend, cfg.actor.vllm_dtype = "vllm", vllm_dtype
    assert autocast_dtype(setting, torch.device(device),
                          cfg.actor.samples_in_low_precision) == want
    cfg.actor.backend = "transformers"  # samples in float32 whatever vllm_dtype says
    assert not cfg.actor.samples_in_low_precision


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_learner_under_torchrun_draws_shares_and_rank_0_alone_commits(tmp_path, redis_url,
                                                                       model):
    """12 groups for up to 10 updates of 4: after 3 both ranks wait for more; SIGTERM to
    rank 1 alone must stop rank 0 too (or it would wait for groups, then in a collective)."""
    from helpers_replay import ServerProc, push_all

    from autodidact.roles import write_resolved_config
    from protocol.config import load_config
    from protocol.control import ControlPlane
    from protocol.replay_client import ReplayClient
    from replay.store import LAST_BATCH, Store

    run_dir, spy_dir = tmp_path / "run", tmp_path / "spy"
    spy_dir.mkdir()
    server = ServerProc(run_dir).start()
    client = ReplayClient(server.address, retry_after_s=0.5, timeout_s=10)
    prefix = f"ddp:{uuid.uuid4().hex[:8]}"
    # skip_uninformative off: the one-trajectory (degenerate) groups are part of what is tested.
    cfg = load_config(None, ["learner.batch_groups=4", "learner.nproc=2", "learner.kl_coef=0",
                             "learner.skip_uninformative=false",
                             "learner.checkpoint_every=2", "learner.max_staleness=100",
                             "judge.workers=0", "experience.enabled=false"])
    cfg.redis.url, cfg.redis.prefix = redis_url, prefix
    cfg.replay.address, cfg.model.path = server.address, model
    config = write_resolved_config(cfg, run_dir)
    pushed = [group(100 + i, [12 + i, 9, 14][: 1 + i % 3]) for i in range(12)]
    log = tmp_path / "torchrun.log"
    try:
        assert set(push_all(client, pushed).values()) == {"stored"}
        proc = start_torchrun(log, "cli", str(spy_dir), "learner", "--run-dir", str(run_dir),
                              "-c", str(config), "--max-updates", "10")
        deadline = time.monotonic() + 150
        while len([r for r in read_metrics(run_dir, "learner") if "learner/loss" in r]) < 3:
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-5000:]
            time.sleep(0.1)
        os.kill(int((spy_dir / "pid.r1").read_text()), signal.SIGTERM)
        finish(proc, log, timeout=60)
        stats = client.stats()
    finally:
        client.close()
        server.stop()
    r0, r1 = (json.loads((spy_dir / f"calls.r{r}.json").read_text()) for r in (0, 1))
    ids = [g.group_id for g in pushed]

    # Each rank drew its share, 2 groups per update, under its own id; together all of them.
    drawn = [[g for who, got in calls["batch"] for g in got] for calls in (r0, r1)]
    assert {who for who, _ in r0["batch"]} == {"learner"}
    assert {who for who, _ in r1["batch"]} == {"learner.r1"}
    assert len(drawn[0]) == len(drawn[1]) == 6 and sorted(drawn[0] + drawn[1]) == sorted(ids)
    # Rank 0 alone said hello, committed, published (every version once) and checkpointed.
    assert [h[0] for h in r0["hello"]] == ["learner"] and r1["hello"] == []
    committed = [g for _, got in r0["commit"] for g in got]
    assert {who for who, _ in r0["commit"]} == {"learner"} and r1["commit"] == []
    assert sorted(committed) == sorted(ids)  # all ids, none twice
    assert r0["publish"] == [0, 1, 2, 3] and r1["publish"] == []
    assert len(r0["publisher"]) == 1 and r1["publisher"] == []
    assert r0["save"] and r1["save"] == []

    ckpt = torch.load(run_dir / "checkpoints" / "latest.pt", weights_only=True)
    assert (ckpt["updates"], ckpt["version"]) == (3, 3)
    ledger = ckpt["consumed"]
    assert ledger == committed and len(set(ledger)) == 12
    for u in range(3):  # each update: rank 0's share, then rank 1's
        assert set(ledger[4 * u:4 * u + 2]) <= set(drawn[0])
        assert set(ledger[4 * u + 2:4 * u + 4]) <= set(drawn[1])
    store = Store(run_dir, readonly=True)
    try:
        with store.env.begin() as txn:
            index = store.load_index(txn)
            last_r1 = store.get_meta(txn, LAST_BATCH + "learner.r1")
    finally:
        store.close()
    assert all(index[g].consumed for g in ids) and stats["deliverable"] == 0
    assert set(last_r1[1]) <= set(drawn[1])  # replay kept rank 1's retry memory apart

    control = ControlPlane.connect(redis_url, prefix)
    assert int(control.r.get(control.keys.version)) == 3
    control.r.close()
    assert sorted(p.name for p in (run_dir / "weights").glob("v*")) == \
        [f"v{v:06d}.safetensors" for v in (1, 2, 3)]  # weights.keep = 3
    rows = read_metrics(run_dir, "learner")
    assert {r["id"] for r in rows} == {"learner"}
    assert [r["learner/groups"] for r in rows if "learner/loss" in r] == [4, 4, 4]
    assert rows[-1]["learner/done"] == 1  # rank 0 stopped cleanly, final checkpoint written
