"""Environments as services, with real processes: ``autodidact env serve`` in a subprocess on a
free port, its workers, and clients over real ZeroMQ sockets.

* Parity: every method of the interface, a seeded random walk, an explore run and a seeded
  rollout of a tiny policy give exactly the same results in process and served.
* One resolution point: ``env_class`` / ``env_maker`` / ``task_env_class`` of an EnvConfig with
  an address make sessions on the server; a server of another env is refused by name.
* Bad frames to the env socket: each answered with one refusal (and one log line), counted,
  and the server keeps serving. (Hostile clients with good frames: test_env_service_hostile.)
* Faults (``tests/env_faulty.py``): a call past the deadline, a worker that exits mid-episode,
  an answer that does not decode; each raises EnvFailed with its reason (and the worker's last
  output where the server has it), the server restarts dead workers with back-off and a fresh
  env works afterwards.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import os
import random
import re
import threading
import time
from pathlib import Path

import msgpack
import numpy as np
import pytest
import zmq
from helpers_procs import wait_for
from helpers_replay import damage, mutate_tree
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from autodidact.env_serve import EnvServerProcess
from environments import ActionError, FilesEnv, ToolCall, ToolError, env_class, env_maker
from environments.base import call_each, task_env_class
from environments.call_formats import rewrite
from environments.remote import EnvLink, RemoteEnv
from protocol import codec
from protocol import env_wire as wire
from protocol.config import TOOL_FORMATS, EnvConfig, load_config
from protocol.errors import REJECT_REASONS, ConfigError, EnvFailed, SchemaError
from protocol.messages import SPLITS, Error, StatsRequest, Task
from protocol.transport import free_tcp_port

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module", autouse=True)
def env_tokens(tmp_path_factory):
    """The env servers' and their clients' tokens in a directory of this module's (not
    ~/.autodidact/env_tokens): the servers started below inherit it."""
    before = os.environ.get(wire.TOKENS_ENV)
    os.environ[wire.TOKENS_ENV] = str(tmp_path_factory.mktemp("env_tokens") / "tokens")
    try:
        yield Path(os.environ[wire.TOKENS_ENV])
    finally:
        if before is None:
            os.environ.pop(wire.TOKENS_ENV, None)
        else:
            os.environ[wire.TOKENS_ENV] = before


def client_token() -> str:
    """The token this machine's clients present (the servers here make it at their start)."""
    token = wire.read_token(wire.client_token_file())
    assert token, "no client.token: start a server first"
    return token


class EnvServer(EnvServerProcess):
    """``autodidact env serve SPEC`` logging to ``log``; the test envs importable by it."""

    def __init__(self, spec: str, log: Path, *options: str, workers: int = 2):
        super().__init__(spec, *options, workers=workers, log=log, pythonpath=str(HERE))

    def config(self, name: str, timeout_s: float = 20.0) -> EnvConfig:
        return EnvConfig(name=name, address=self.address, call_timeout_s=timeout_s)


@pytest.fixture(scope="module")
def files_server(tmp_path_factory):
    server = EnvServer("files", tmp_path_factory.mktemp("envserve") / "serve.log").start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def served_files(files_server) -> EnvConfig:
    """The files env served, its class asked once (the hello waits for the workers)."""
    cfg = files_server.config("files")
    try:
        env_class(cfg)
    except EnvFailed:
        pytest.fail(f"env server did not answer:\n{files_server.text()[-3000:]}")
    return cfg


# --- parity --------------------------------------------------------------------------------------

MALFORMED = ["", "rm", "frobnicate x", "cd 'unclosed", "mv a b c d e f", "ls " + "x" * 300]


def _outcome(call):
    """A call's value, or what it raised (its type and the fields the interface defines)."""
    try:
        return ("value", call())
    except (ActionError, ToolError) as exc:
        return (type(exc).__name__, exc.kind, exc.observation, getattr(exc, "tool", None))
    except Exception as exc:
        return (type(exc).__name__, str(exc))


def transcript(env, tasks: list[Task], seed: int) -> list:
    """Everything ``env`` answers along a seeded walk: every method of the interface."""
    rng = random.Random(seed)
    out: list = [("class", env.name, env.vocabulary(), env.query_in_prompt, env.default_limits)]
    out += [("tasks", split, env.tasks(split)) for split in SPLITS]
    for task in tasks:
        out.append(("reset", env.reset(task), list(env.responses)))
        out += [("tools", env.tools()), ("example", env.example_action())]
        out += [("instructions", fmt, listed, env.instructions(fmt, listed))
                for fmt in TOOL_FORMATS for listed in (True, False)]
        out += [("grammar", fmt, env.call_grammar(fmt)) for fmt in TOOL_FORMATS]
        start = env.state()
        for _ in range(6):
            choices = env.candidate_actions()
            action, fmt = rng.choice(choices + MALFORMED), rng.choice(TOOL_FORMATS)
            before = env.state()
            obs, done, info = env.step(rewrite(action, env.tools(), fmt), fmt)
            after = env.state()
            out.append(("step", choices, action, obs, done, info, after, list(env.responses),
                        env.evaluate(task), env.goal_progress(task),
                        env.describe_event(action, obs, before, after),
                        env.describe_response(action, obs, before),
                        env.canonical_action(action)))
        end = env.state()
        parts = env.describe_changes(start, end)
        out.append(("changes", parts, _outcome(functools.partial(env.goal_from_states, start,
                                                                 end)),
                    env.entities(end), env.goal_of([c for p in parts for c in p.conditions]),
                    env.query_of([p.text for p in parts if p.text])))
        out.append(("refused", _outcome(lambda: env.execute(ToolCall("rm", ("nosuch.md",))))))
    out.append(("bad split", _outcome(lambda: env.tasks("bogus"))))
    return out


def test_every_method_answers_as_in_process(served_files):
    local, served = FilesEnv(), env_maker(served_files)()
    assert isinstance(served, RemoteEnv) and not isinstance(local, RemoteEnv)
    tasks = local.tasks("train")[:3] + local.tasks("validation")[:1] + local.tasks("test")[:1]
    expected = transcript(local, tasks, seed=11)
    got = transcript(served, tasks, seed=11)
    assert len(got) == len(expected)
    for want, have in zip(expected, got):
        assert have == want
    assert [g[1][0] for g in got if g[0] == "refused"] == ["ToolError"] * len(tasks)
    assert got[-1][1][0] == "ValueError"


def test_calls_of_many_sessions_sent_together_answer_as_one_by_one(served_files):
    """call_each, what a rollout asks of all its episodes each turn, in order and the same."""
    tasks = FilesEnv().tasks("train")[:6]
    local = [FilesEnv() for _ in tasks]
    served = [env_maker(served_files)() for _ in tasks]
    both = (local, served)
    resets = [call_each(envs, "reset", [(t,) for t in tasks]) for envs in both]
    assert resets[1] == resets[0] == [env.reset(t) for env, t in zip(local, tasks)]
    for turn in range(4):
        choices = [call_each(envs, "candidate_actions") for envs in both]
        assert choices[1] == choices[0]
        actions = [(c[turn % len(c)],) for c in choices[0]]
        steps = [call_each(envs, "step", actions) for envs in both]
        assert steps[1] == steps[0]
    assert call_each(served, "state") == [env.state() for env in local]
    assert [env.responses for env in served] == [env.responses for env in local]
    scores = [call_each(envs, "evaluate", [(t,) for t in tasks]) for envs in both]
    assert scores[1] == scores[0]


def test_shop_answers_as_in_process(tmp_path):
    """The other built-in: ids to invent, event goals, and a refusal of a type of its own
    (an unknown tool: AttributeError), all as in process."""
    from environments import ShopEnv

    server = EnvServer("shop", tmp_path / "serve.log", workers=1).start()
    try:
        served = env_maker(server.config("shop"))()
        local = ShopEnv()
        tasks = local.tasks("validation")[:2] + local.tasks("test")[:2]
        assert transcript(served, tasks, seed=5) == transcript(local, tasks, seed=5)
    finally:
        server.stop()


def test_step_before_reset_and_a_closed_session(served_files):
    env = env_maker(served_files)()
    with pytest.raises(RuntimeError, match="reset"):
        env.step("ls")
    env.close()
    with pytest.raises(EnvFailed) as info:
        env.reset(FilesEnv().tasks("train")[0])
    assert info.value.reason == "no_session"


def test_explore_makes_the_same_tasks(served_files, tmp_path):
    from questioning.factory import TaskFactory, read_explorations
    from questioning.task_store import TaskStore

    sets = ["explore.seeds=2", "explore.explorations_per_seed=2", "explore.proposer=schema",
            "explore.breadth_steps=12", "explore.depth_steps=8"]
    runs = {}
    for how, extra in (("local", []), ("served", [f"env.address={served_files.address}"])):
        cfg = load_config(None, sets + extra)
        with TaskStore(tmp_path / how) as store:
            summary = TaskFactory(cfg, tmp_path / how, store, say=lambda _: None).run(rounds=1)
            tasks = store.all()
        summary.pop("seconds", None)
        explorations = [e.to_dict() for e in read_explorations(tmp_path / how)]
        for e in explorations:
            e.pop("seconds")  # wall time
        runs[how] = (summary, explorations, tasks)
    assert runs["local"][2], "explore made no tasks: nothing was compared"
    assert runs["served"] == runs["local"]


def test_a_seeded_rollout_is_the_same(served_files, files_policy_path):
    from transformers import AutoTokenizer

    from episodes.rollout import RolloutSettings, rollout, start_episodes
    from inference.backends import SamplingParams, TransformersBackend
    from inference.codecs import make_codec

    codec_ = make_codec(AutoTokenizer.from_pretrained(files_policy_path))
    tasks = FilesEnv().tasks("train")[:3]
    settings = RolloutSettings(max_turns=4)
    results = []
    with TransformersBackend(files_policy_path, version=0) as backend:
        for make in (FilesEnv, env_maker(served_files)):
            episodes = start_episodes(tasks, 2, make, codec_)
            params = SamplingParams(temperature=1.0, max_new_tokens=16,
                                    stop_token_ids=(codec_.eoa_id,), seed=5)
            rollout(backend, episodes, codec_, params, settings)
            results.append([_comparable(ep.to_trajectory()) for ep in episodes])
    assert results[0] == results[1]
    assert sum(len(t["steps"]) for t in results[0]) > 0


def _comparable(traj) -> dict:
    fields = dataclasses.asdict(traj)
    fields.pop("traj_id")  # random per episode
    fields.get("info", {}).pop("seconds", None)
    return {k: v.tolist() if isinstance(v, np.ndarray) else v for k, v in fields.items()}


# --- one resolution point ------------------------------------------------------------------------


def test_every_maker_of_a_run_env_gets_the_served_one(served_files):
    cls = env_class(served_files)
    assert issubclass(cls, RemoteEnv) and cls.name == "files"
    assert env_class(served_files) is cls  # one hello per process and server
    assert cls.vocabulary() == FilesEnv.vocabulary()  # a classmethod, answered by the hello
    task = FilesEnv().tasks("train")[0]
    assert task_env_class(task, served_files) is cls  # tasks verify, experience replays
    other = Task("t", "shop", "q", 0)
    assert task_env_class(other, served_files).name == "shop"  # another env's task: by name
    with pytest.raises(ConfigError, match="serves 'files'"):
        env_class(dataclasses.replace(served_files, name="shop"))


def test_config_refuses_a_plaintext_env_server_off_this_machine():
    off = "env.address=tcp://10.1.2.3:5560"
    with pytest.raises(ConfigError, match="env.keys_dir"):
        load_config(None, [off])
    load_config(None, [off, "security.allow_plaintext_remote=true"])
    load_config(None, [off, "env.keys_dir=/keys"])
    with pytest.raises(ConfigError, match="env.address"):
        load_config(None, ["env.address=http://127.0.0.1:80"])


def test_a_curve_server_serves_a_client_with_keys_and_no_plaintext_one(keys_dir, tmp_path):
    server = EnvServer("files", tmp_path / "serve.log", "--keys-dir", str(keys_dir),
                       workers=1).start()
    try:
        cfg = dataclasses.replace(server.config("files"), keys_dir=str(keys_dir))
        try:
            env = env_maker(cfg)()
        except EnvFailed:
            pytest.fail(f"env server did not answer:\n{server.text()[-3000:]}")
        task = FilesEnv().tasks("train")[0]
        assert env.reset(task) == FilesEnv().reset(task)
        with pytest.raises(EnvFailed) as info:  # no keys: the handshake never completes
            EnvLink(server.address, 1.0).hello()
        assert info.value.reason == "timeout"
        assert "CURVE" in server.text()
    finally:
        server.stop()


# --- bad frames ----------------------------------------------------------------------------------


def _bad_frames() -> list[tuple[bytes, str]]:
    token = client_token()  # each frame is the client's: what it refuses is the frame
    good = codec.encode(wire.EnvHello(wire.ENV_WIRE_VERSION), "x", token)
    rng = random.Random(3)
    frames = [
        (b"", "not_msgpack"), (b"\xc1\xff", "not_msgpack"), (good[: len(good) // 2], "not_msgpack"),
        (msgpack.packb([1, 2, 3]), "bad_envelope"),
        (codec.pack_frame("no_such_type", "x", b"\x80", credential=token), "unknown_type"),
        (codec.pack_frame("env_hello", "x", b"\x80", version=codec.SCHEMA_VERSION + 1,
                          credential=token), "future_version"),
        (codec.pack_frame("env_step", "x", msgpack.packb({"session": "s"}), credential=token),
         "missing_field"),
        (codec.pack_frame("env_step", "x", msgpack.packb({"session": "", "action": "ls"}),
                          credential=token), "invalid"),
        (codec.pack_frame("env_hello", "x", msgpack.packb({"version": "1"}), credential=token),
         "wrong_type"),
        (codec.encode(StatsRequest(), "x", token), "unexpected_type"),  # a replay request
        (codec.encode(wire.EnvHello(wire.ENV_WIRE_VERSION), "x"), "unauthorized"),  # no token
    ]
    for _ in range(20):  # random bytes and flipped bytes of a good frame
        flipped = bytearray(good)
        flipped[rng.randrange(len(flipped))] ^= 1 << rng.randrange(8)
        frames.append((bytes(flipped), ""))
        frames.append((rng.randbytes(rng.randrange(1, 64)), ""))
    return frames


def test_bad_frames_are_refused_one_line_each_and_the_server_keeps_serving(
        files_server, served_files):
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(files_server.address)
    refused, lines = 0, files_server.text().count("rejected frame")
    try:
        for frame, reason in _bad_frames():
            sock.send(frame)
            assert sock.poll(5000), f"no answer to a bad frame {frame[:40]!r}"
            env, reply = codec.decode(sock.recv())
            if type(reply).__name__ == "Error":
                refused += 1
                assert not reason or reply.reason == reason, (frame[:60], reply)
            else:  # a flipped bit the schema cannot tell (a character of the id): served
                assert not reason
    finally:
        sock.close(0)
    assert refused >= 10
    wait_for(lambda: files_server.text().count("rejected frame") >= lines + refused, 5,
             "log lines")
    assert files_server.text().count("rejected frame") == lines + refused  # one per refusal
    env = env_maker(served_files)()  # still serving
    assert env.reset(FilesEnv().tasks("train")[0]).startswith("path :")


def test_a_close_queue_emptied_by_another_thread_fails_no_call(served_files):
    """Every thread's calls take the sessions waiting to be closed from one queue (a judge
    replays from a pool of threads). Here another thread empties it between a look at its
    length and the take: the call still goes out and is answered."""
    cls = env_class(served_files)

    class EmptiedWhileLookedAt(collections.deque):
        def __len__(self):
            n = super().__len__()
            self.clear()  # the other thread's take
            return n

    cls._link._to_close = EmptiedWhileLookedAt(["gone-1", "gone-2"])
    try:
        env = cls()
        assert env.reset(FilesEnv().tasks("train")[0]).startswith("path :")
    finally:
        cls._link._to_close = collections.deque()


def test_a_batch_with_a_request_that_does_not_decode_is_refused_whole(files_server,
                                                                       served_files):
    env = env_maker(served_files)()
    env.reset(FilesEnv().tasks("train")[0])
    good = codec.encode(wire.EnvStep(env.session, "cd docs"), "good")
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(files_server.address)
    try:
        sock.send(codec.encode(wire.EnvBatch([good, b"\x93garbage"]), "batch", client_token()))
        assert sock.poll(5000), "no answer"
        envelope, reply = codec.decode(sock.recv())
        assert envelope.msg_id == "batch" and isinstance(reply, Error)
        assert "request 1 of the batch" in reply.detail
        assert not sock.poll(300)  # nothing else: the good request was not run either
    finally:
        sock.close(0)
    assert "games/" in env.step("ls")[0]  # still at the root, and still served


def test_a_sessions_calls_wait_behind_its_open_for_a_worker(tmp_path):
    """A batch of an open and its session's first call while no worker is up: both wait, and
    once one is, both go to it, the open first; a second open of the same session is refused."""
    from autodidact.env_serve import EnvBroker, ServeSettings

    broker = EnvBroker(ServeSettings("files", f"tcp://127.0.0.1:{free_tcp_port()}",
                                     tokens_dir=str(tmp_path / "tokens")))
    token = wire.read_token(tmp_path / "tokens" / "client.token")
    try:
        opening = codec.encode(wire.EnvOpen(wire.ENV_WIRE_VERSION, "s1", {}), "open")
        reset = codec.encode(wire.EnvReset("s1", TASK), "reset")
        broker._from_client(broker.front._decode(
            [b"client", codec.encode(wire.EnvBatch([opening, reset]), "batch", token)]))
        assert [i.msg_id for _, i, _ in broker.waiting] == ["open", "reset"]
        worker = broker.workers[0]
        worker.identity, worker.proc = b"w0.0", type("Proc", (), {"pid": 0})()
        broker._ready(worker)  # (no process: what is sent to w0.0 goes nowhere)
        worker.proc = None
        assert not broker.waiting and broker.route["s1"] is worker
        assert [p.incoming.msg_id for p in worker.inflight.values()] == ["open", "reset"]
        again = broker.front._decode([b"client", codec.encode(
            wire.EnvOpen(wire.ENV_WIRE_VERSION, "s1", {}), "again", token)])
        broker._from_client(again)
        assert broker.failures["session_taken"] == 1
    finally:
        broker.close()

TASK = Task("files/x", "files", "move ideas.md into music", 3, {"all": [{"path": "a"}]},
            ["mv ideas.md music"])
S = "w0.0-" + "ab" * 12
# One valid message of every env wire type: the starting points of the mutations below.
ENV_SAMPLES = {m.TYPE: codec.encode_body(m) for m in [
    wire.EnvHello(1), wire.EnvOpen(1, S, {"num_worlds": 3}), wire.EnvClose(S),
    wire.EnvReset(S, TASK), wire.EnvTools(S), wire.EnvStep(S, "ls docs", "pythonic"),
    wire.EnvExecute(S, "mv", ["a", 3, True]), wire.EnvState(S), wire.EnvEvaluate(S, TASK),
    wire.EnvGoalProgress(S, TASK), wire.EnvCandidateActions(S),
    wire.EnvInstructions(S, "hermes", False), wire.EnvCallGrammar(S, "json"),
    wire.EnvExampleAction(S), wire.EnvCanonicalAction(S, "ls"), wire.EnvTasks(S, "train"),
    wire.EnvGoalFromStates(S, {"a": 1}, {"a": 2}), wire.EnvDescribeChanges(S, {}, {"b": [1]}),
    wire.EnvDescribeEvent(S, "rm x", "ok", {}, {}), wire.EnvDescribeResponse(S, "ls", "x", {}),
    wire.EnvEntities(S, {"tree": {}}), wire.EnvGoalOf(S, [{"path": "a"}]),
    wire.EnvQueryOf(S, ["a", "b"]),
    wire.EnvBatch([codec.encode(wire.EnvStep(S, "ls"), "i1"), codec.encode(wire.EnvState(S),
                                                                           "i2")]),
    wire.EnvServed(1, "files", ["a"], True, {"max_turns": 3}, [1], 1 << 20, {"n": "1 to 9"}),
    wire.EnvOpened(S), wire.EnvStatsRequest(),
    wire.EnvStats({"unauthorized": 2}, {"not_yours": 1}, 3, 1, 0, 2),
    wire.EnvValue({"x": [1, 2.5, None]}, ["ok"]), wire.EnvStepped("ok", False, {"valid": True}),
    wire.EnvToolList([wire.WireTool("mv", "move", [wire.WireArg("n", "int", bounds=[1, 9])])]),
    wire.EnvTaskList([TASK]), wire.EnvParts([wire.WirePart([{"p": 1}], "make a", ["a"])]),
    wire.EnvRaised("ToolError", "x", "kind", "error : x"),
    wire.EnvFailure("worker_died", "gone", ["line"]),
]}
REQUEST_TAGS = sorted(m.TYPE for m in wire.REQUESTS)
WRONG = st.one_of(st.none(), st.booleans(), st.integers(-2**63, 2**64 - 1),
                  st.floats(allow_nan=True), st.text(max_size=70), st.binary(max_size=8),
                  st.lists(st.integers(-2, 2), max_size=3),
                  st.dictionaries(st.text(max_size=3), st.integers(-2**63, 2**63 - 1),
                                  max_size=2),  # what msgpack can pack
                  st.builds(msgpack.ExtType, st.integers(0, 3), st.binary(max_size=8)))
FUZZ = settings(max_examples=150, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture,
                                       HealthCheck.too_slow])


def _mutated(tag: str, data, credential: str = "") -> bytes:
    """A frame of ``tag`` with its body mutated, damaged, or under another type's tag."""
    how = data.draw(st.sampled_from(["mutate", "damage", "retag"]))
    if how == "damage":
        frame = codec.pack_frame(tag, "id", ENV_SAMPLES[tag], credential=credential)
        return damage(frame, data.draw(st.sampled_from(["truncate", "flip"])), data, 4)
    tree = msgpack.unpackb(ENV_SAMPLES[tag], raw=False)
    if how == "mutate":
        for _ in range(data.draw(st.integers(1, 3))):
            mutate_tree(tree, data, WRONG)
    else:
        tag = data.draw(st.sampled_from(sorted(ENV_SAMPLES)))
    return codec.pack_frame(tag, "id", msgpack.packb(tree, use_bin_type=True),
                            credential=credential)


@given(st.sampled_from(sorted(ENV_SAMPLES)), st.data())
@FUZZ
def test_env_messages_decode_or_refuse_with_a_schema_error(tag, data):
    """Mutated requests and replies of every env type: a validated message or SchemaError."""
    try:
        env, msg = codec.decode(_mutated(tag, data))
    except SchemaError as exc:
        assert exc.reason in REJECT_REASONS
    else:
        codec.decode(codec.encode(msg, env.msg_id))


@given(st.sampled_from(REQUEST_TAGS), st.data())
@FUZZ
def test_the_server_answers_every_mutated_request(files_server, served_files, tag, data):
    """Sent to the live env socket: every frame gets an answer (a refusal, an EnvFailure or a
    served reply) and the server goes on."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(files_server.address)
    try:
        sock.send(_mutated(tag, data, client_token()))  # a client's: past the token check
        assert sock.poll(5000), "no answer"
        codec.decode(sock.recv())
    finally:
        sock.close(0)
    assert files_server.proc.poll() is None


@contextlib.contextmanager
def rogue_server(answer):
    """A ROUTER at a loopback address that answers the first frame it gets with
    ``answer(frame)``, the bytes sent back, from a thread; yields its address."""
    rogue = zmq.Context.instance().socket(zmq.ROUTER)
    rogue.setsockopt(zmq.LINGER, 0)
    port = rogue.bind_to_random_port("tcp://127.0.0.1")

    def serve_one():
        if rogue.poll(10_000):
            route, frame = rogue.recv_multipart()
            rogue.send_multipart([route, answer(frame)])

    thread = threading.Thread(target=serve_one, daemon=True)
    thread.start()
    try:
        yield f"tcp://127.0.0.1:{port}"
    finally:
        thread.join(10)
        rogue.close(0)


def test_a_reply_that_does_not_decode_fails_the_call_at_once():
    """A rogue server answering garbage: the client raises bad_reply, not a timeout."""
    with rogue_server(lambda frame: b"\x93garbage") as address:
        t0 = time.monotonic()
        with pytest.raises(EnvFailed) as info:
            EnvLink(address, 10.0).hello()
        assert info.value.reason == "bad_reply" and time.monotonic() - t0 < 5


def test_a_batch_refused_whole_fails_each_of_its_calls_at_once():
    """A server refusing a batch (one Error under the batch's id): every call in it fails as
    refused, none waits out the deadline."""
    def refuse(frame):
        envelope, batch = codec.decode(frame)
        assert isinstance(batch, wire.EnvBatch) and len(batch.frames) == 3
        return codec.encode(Error("invalid", "no"), envelope.msg_id)

    with rogue_server(refuse) as address:
        t0 = time.monotonic()
        failed = EnvLink(address, 10.0).call_many(
            [wire.EnvState(S), wire.EnvState(S), wire.EnvTools(S)])
        assert time.monotonic() - t0 < 5
        assert [f.reason for f in failed] == ["refused"] * 3
        assert all("refused a batch: invalid" in f.detail for f in failed)


# --- faults --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def faulty_server(tmp_path_factory):
    server = EnvServer("env_faulty:faulty", tmp_path_factory.mktemp("faulty") / "serve.log",
                       "--call-timeout-s", "3").start()
    try:
        cfg = server.config("env_faulty:faulty", timeout_s=1.5)
        try:
            env_class(dataclasses.replace(cfg, call_timeout_s=20.0))  # waits for the workers
        except EnvFailed:
            pytest.fail(f"env server did not answer:\n{server.text()[-3000:]}")
        yield server, cfg
    finally:
        server.stop()


def _fresh(cfg: EnvConfig, timeout_s: float = 20.0):
    """A new session once the server has one to give (a worker may be restarting)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            env = env_maker(dataclasses.replace(cfg, call_timeout_s=timeout_s))()
            env.reset(env.tasks("train")[0])
            return env
        except EnvFailed:
            if time.monotonic() > deadline:
                raise


def test_replays_of_a_run_env_task_go_to_the_served_env(faulty_server):
    """``faulty`` is not importable in this process: replays that reach it were served."""
    from environments.base import verify_task
    from navigating.extraction import _replaying_in, _run, make_extractor

    _, cfg = faulty_server
    task = Task("faulty/train/0", "faulty", "say ok", 0, {}, ["ok"])
    with pytest.raises(KeyError):
        env_class("faulty")
    assert verify_task(task_env_class(task, cfg), task) == (True, "ok")  # tasks verify
    assert _run(task, ["ok"]) is None  # rule extraction without the run's env: by name
    with _replaying_in(cfg):  # what ExperienceExtractor(env=cfg.env) does around its rules
        replay = _run(task, ["ok", "refuse"])
    assert replay.ok == [True, False] and replay.states[-1] == {"calls": ["ok", "refuse"]}
    run = load_config(None, [f"env.name={cfg.name}", f"env.address={cfg.address}"])
    assert make_extractor(run).env == run.env


def test_the_interfaces_refusals_cross_as_their_types(faulty_server):
    _, cfg = faulty_server
    env = _fresh(cfg)
    assert env.step("refuse") == ("error : refused", False,
                                  {"valid": True, "tool": "refuse", "error": "refused"})
    with pytest.raises(ToolError) as refused:
        env.execute(ToolCall("refuse"))
    assert (refused.value.kind, refused.value.observation) == ("refused", "error : refused")
    with pytest.raises(ActionError) as misparsed:
        env.execute(ToolCall("misparse", ("x",)))
    assert (misparsed.value.kind, misparsed.value.tool) == ("custom", "misparse")
    with pytest.raises(NotImplementedError):  # a hook it lacks
        env.goal_from_states({}, {})


def test_a_call_past_the_deadline_times_out_and_the_worker_is_replaced(faulty_server):
    server, cfg = faulty_server
    env = env_maker(cfg)()  # the run's deadline: 1.5 s
    env.reset(env.tasks("train")[0])
    t0 = time.monotonic()
    with pytest.raises(EnvFailed) as info:
        env.step("hang")
    assert info.value.reason == "timeout" and 1.4 < time.monotonic() - t0 < 4
    with pytest.raises(EnvFailed, match="failed before"):  # the instance is done for
        env.state()
    wait_for(lambda: "ran past --call-timeout-s 3 s" in server.text(), 10, "the kill")
    assert _fresh(cfg).step("ok")[0] == "ok"


def test_a_worker_that_exits_mid_episode(faulty_server):
    server, cfg = faulty_server
    victim = _fresh(cfg)
    bystander = _fresh(cfg)
    while bystander.worker.split(".")[0] == victim.worker.split(".")[0]:
        bystander = _fresh(cfg)  # a session on the other worker
    starts = server.text().count(" up (pid")
    with pytest.raises(EnvFailed) as info:
        victim.step("crash")
    assert info.value.reason == "worker_died"
    assert any("crashing on purpose" in line for line in info.value.stderr), info.value.stderr
    assert "exited with code 3" in info.value.detail
    assert bystander.step("ok")[0] == "ok"  # the other worker's session goes on
    wait_for(lambda: server.text().count(" up (pid") > starts, 10, "the restarted worker")
    # The same worker dying again soon after its start waits twice as long before the next.
    worker = victim.worker.split(".")[0]  # "w<index>"
    again = _fresh(cfg)
    while again.worker.split(".")[0] != worker:
        again = _fresh(cfg)
    with pytest.raises(EnvFailed):
        again.step("crash")
    wait_for(lambda: len(_backoffs(server, worker)) >= 2, 5, "the second restart line")
    first, second = _backoffs(server, worker)[-2:]
    assert second == 2 * first
    assert _fresh(cfg).step("ok")[0] == "ok"


def _backoffs(server: EnvServer, worker: str) -> list[float]:
    """The back-offs the server announced for worker ``w<index>``, in order."""
    pattern = re.compile(rf"env worker {worker[1:]} \(pid .* restarting it in ([0-9.]+) s")
    return [float(m.group(1)) for m in pattern.finditer(server.text())]


def test_an_answer_that_does_not_decode_fails_that_call_only(faulty_server):
    _, cfg = faulty_server
    env = _fresh(cfg)
    env.step("garble")
    with pytest.raises(EnvFailed) as info:
        env.state()  # {1: ...}: msgpack packs it, the codec refuses a non-text key
    assert info.value.reason == "bad_reply" and "does not decode" in info.value.detail
    assert _fresh(cfg).step("ok")[0] == "ok"  # the worker lives on


def test_explore_goes_on_past_an_exploration_the_env_failed(faulty_server):
    """World 7 crashes its worker at the first step: that exploration is skipped and counted,
    the ones around it run to their end on fresh instances."""
    from questioning.explorer import Explorer, ExploreSettings

    _, cfg = faulty_server
    explorer = Explorer(env_maker(dataclasses.replace(cfg, call_timeout_s=20.0,
                                                      options={"only_ok": True})),
                        ExploreSettings(breadth_steps=2, depth_steps=0), seed=3)
    seeds = [Task(f"explore/{s}", "faulty", "", s) for s in (0, 7, 1)]
    first = explorer.env
    explored = [explorer.explore(seed, 0) for seed in seeds]
    assert explored[1] is None
    assert explorer.counts["env_failed/worker_died"] == 1
    assert [len(exp.steps) for exp in (explored[0], explored[2])] == [2, 2]
    assert explorer.env is not first  # the failed instance was replaced


def test_the_warm_start_skips_a_reference_the_env_failed(faulty_server, files_codec):
    """The references of worlds 0 and 1 become examples; world 7's crashes its worker and is
    skipped, not the end of the warm-start; three failed one after another end it."""
    from episodes.rollout import RolloutSettings
    from learner.warmstart import reference_groups

    _, cfg = faulty_server
    run_cfg = dataclasses.replace(load_config(None),
                                  env=dataclasses.replace(cfg, call_timeout_s=20.0))
    tasks = [Task(f"faulty/train/{s}", "faulty", "say ok", s, {"ok": True}, ["ok"])
             for s in (0, 7, 1)]
    groups = reference_groups(run_cfg, files_codec, RolloutSettings(max_turns=3), tasks)
    assert sorted(g.task.seed for g in groups) == [0, 1]
    garbled = Task("faulty/train/8", "faulty", "say ok", 8, {"ok": True}, ["ok"])
    with pytest.raises(EnvFailed) as info:  # three failed in a row: the service is gone
        reference_groups(run_cfg, files_codec, RolloutSettings(max_turns=3), [garbled] * 3)
    assert info.value.reason == "bad_reply"

def test_answered_calls_of_a_batch_are_not_held_behind_a_slow_one(faulty_server):
    """Two sessions on two workers, one step each in one batch: the one that answers at once
    reaches the client at once, while the other hangs until the server kills its worker."""
    _, cfg = faulty_server
    fast, slow = _fresh(cfg), _fresh(cfg)
    while slow.worker.split(".")[0] == fast.worker.split(".")[0]:
        slow = _fresh(cfg)
    link = type(fast)._link
    link.timings.clear()
    answers = call_each([fast, slow], "step", [("ok",), ("hang",)])
    assert answers[0][0] == "ok"
    assert isinstance(answers[1], EnvFailed) and answers[1].reason == "worker_died"
    answered, failed = sorted(seconds for what, seconds in link.timings if what == "EnvStep")
    assert answered < 1.0 < 2.5 < failed  # not held until the other's worker was killed (3 s)

def test_a_failed_call_among_many_fails_only_its_session(faulty_server):
    _, cfg = faulty_server
    envs = [_fresh(cfg) for _ in range(4)]
    answers = call_each(envs, "step", [("ok",), ("garble",), ("ok",), ("ok",)])
    assert [a[0] for i, a in enumerate(answers) if i != 1] == ["ok"] * 3
    failed = call_each(envs, "state")
    assert isinstance(failed[1], EnvFailed) and failed[1].reason == "bad_reply"
    assert not any(isinstance(a, EnvFailed) for i, a in enumerate(failed) if i != 1)
    again = call_each(envs, "step", [("ok",)] * 4)  # the failed one stays failed, alone
    assert isinstance(again[1], EnvFailed) and "failed before" in again[1].detail
    assert [a[0] for i, a in enumerate(again) if i != 1] == ["ok"] * 3


def test_a_rollout_goes_on_past_an_episode_the_env_failed(faulty_server, files_policy_path):
    """Two tasks' episodes run to their end while a third task's fail at their first step."""
    from transformers import AutoTokenizer

    from episodes.rollout import RolloutSettings, rollout, start_episodes
    from inference.backends import SamplingParams, TransformersBackend
    from inference.codecs import make_codec

    _, cfg = faulty_server
    codec_ = make_codec(AutoTokenizer.from_pretrained(files_policy_path))
    tasks = [Task(f"faulty/train/{s}", "faulty", "say ok", s, {}, ["ok"]) for s in (0, 8, 1)]
    episodes = start_episodes(tasks, 2, env_maker(cfg), codec_)
    with TransformersBackend(files_policy_path, version=0) as backend:
        rollout(backend, episodes, codec_, SamplingParams(max_new_tokens=8, seed=1),
                RolloutSettings(max_turns=2, constrained=False))
    reasons = [ep.failure.reason if ep.failure else None for ep in episodes]
    assert reasons == [None, None, "bad_reply", "bad_reply", None, None]
    assert all(len(ep.steps) == 2 for ep in episodes if ep.failure is None)


def test_held_out_records_count_the_episodes_the_env_failed(faulty_server, files_policy_path):
    from transformers import AutoTokenizer

    from episodes.evaluate import evaluate
    from episodes.rollout import RolloutSettings

    _, cfg = faulty_server
    tasks = [Task(f"faulty/test/{s}", "faulty", "say ok", s, {}, ["ok"]) for s in (0, 8)]
    result = evaluate(None, tasks, env_maker(cfg), RolloutSettings(max_turns=2), k=2,
                      policy="ground-truth",
                      tokenizer=AutoTokenizer.from_pretrained(files_policy_path))
    assert [r["env_failed"] for r in result["per_task"]] == [0, 2]
    assert [r["avg"] for r in result["per_task"]] == [1.0, 0.0]


def test_status_says_what_an_actor_waits_on():
    from autodidact.status_cli import _roles

    now = time.time()
    beats = [{"role": "actor", "id": "actor-0", "t": now, "waiting": "env_failed",
              "env_failed": {"worker_died": 3, "timeout": 1}},
             {"role": "actor", "id": "actor-1", "t": now, "waiting": True}]
    rows, _ = _roles([], {}, beats, {}, {}, now, 10.0)
    assert [r["waiting"] for r in rows] == ["env_failed (timeout 1, worker_died 3)", None]


@pytest.mark.timeout(120)
def test_the_actor_drops_what_the_env_failed_and_the_ledger_stays_exact(
        faulty_server, tmp_path, redis_url, control, files_policy_path):
    from autodidact.wiring import build_actor
    from protocol.config import ReplayConfig, RunConfig
    from protocol.replay_client import ReplayClient
    from protocol.role import serve
    from replay.server import ReplayServer

    _, env_cfg = faulty_server
    replay = ReplayServer(tmp_path / "replay", ReplayConfig(), "tcp://127.0.0.1:*")
    threads = [threading.Thread(target=serve, args=(replay,), daemon=True)]
    threads[0].start()
    cfg = RunConfig()
    cfg.model.path, cfg.replay.address = files_policy_path, replay.address
    cfg.redis.url, cfg.redis.prefix = redis_url, control.keys.prefix
    cfg.experience.enabled = False
    cfg.env = dataclasses.replace(env_cfg, max_turns=2)
    cfg.actor.group_size, cfg.actor.groups_in_flight, cfg.actor.constrained = 2, 3, False
    control.init_admission(0, 0)
    control.push_tasks([Task(f"faulty/train/{s}", "faulty", "say ok", s, {}, ["ok"])
                        for s in (0, 8, 1)])  # world 8 garbles its first step's answer
    (tmp_path / "run").mkdir()
    reader = ReplayClient(replay.address, retry_after_s=0.5, timeout_s=10)
    actor = build_actor(cfg, tmp_path / "run", control, ReplayClient(
        replay.address, retry_after_s=0.5, timeout_s=10), "actor-0")
    stop = threading.Event()
    threads.append(threading.Thread(target=serve, args=(actor, stop), daemon=True))
    threads[1].start()
    try:
        wait_for(lambda: control.counters().get("actor/accepted") == 2, 60, "two groups stored")
        wait_for(lambda: control.claimed("actor-0") == 0, 10, "every claim settled")
    finally:
        stop.set()
        threads[1].join(30)
        stored = reader.groups_since(0).groups
        reader.close()
        replay.request_stop()
        threads[0].join(10)
    counters = control.counters()
    assert sorted(g.task.seed for g in stored) == [0, 1]  # no group of world 8 reached replay
    assert counters["actor/env_failed/bad_reply"] == 2 and counters["actor/dropped_env_failed"] == 1
    assert control.admission()["admitted"] == 2  # the dropped group's slot was given back
    assert actor.env_failed == {"bad_reply": 2}


def test_an_actor_waiting_on_a_long_env_call_keeps_its_heartbeat(
        faulty_server, tmp_path, redis_url, control, files_policy_path):
    """World 9's first step hangs until the 1.5 s deadline: 2.5 heartbeat lifetimes."""
    from autodidact.wiring import build_actor
    from protocol.config import RunConfig
    from protocol.replay_client import ReplayClient

    _, env_cfg = faulty_server
    control.heartbeat_ttl_s = 0.6  # refreshed every 0.2 s: a loaded machine may delay a beat
    cfg = RunConfig()
    cfg.model.path, cfg.replay.address = files_policy_path, "tcp://127.0.0.1:9"  # never pushed
    cfg.redis.url, cfg.redis.prefix = redis_url, control.keys.prefix
    cfg.experience.enabled = False
    cfg.env = dataclasses.replace(env_cfg, max_turns=1)
    cfg.actor.group_size, cfg.actor.groups_in_flight, cfg.actor.constrained = 1, 1, False
    (tmp_path / "run").mkdir()
    actor = build_actor(cfg, tmp_path / "run", control, ReplayClient(
        cfg.replay.address, retry_after_s=0.5, timeout_s=1), "actor-0")
    seen, rolled = [], threading.Event()

    def watch():  # what `autodidact status` reads, every 50 ms
        while not rolled.wait(0.05):
            seen.append(any(h["id"] == "actor-0" for h in control.alive()))

    watcher = threading.Thread(target=watch, daemon=True)
    try:
        watcher.start()
        t0 = time.monotonic()
        actor.roll([Task("faulty/train/9", "faulty", "say ok", 9, {}, ["ok"])])
        waited = time.monotonic() - t0
    finally:
        rolled.set()
        watcher.join(5)
        actor.close()
    assert waited > 1.4 and actor.env_failed == {"timeout": 1}
    # Alive from its first beat (0.2 s in) to the end of the wait; without the beating thread
    # the key would not exist at all (nothing heartbeats before a rollout here).
    assert len(seen) > 10 and True in seen and all(seen[seen.index(True):]), seen


def test_a_batch_fails_at_once_when_no_env_can_be_made(files_policy_path):
    """No server at the address: the first open waits out its deadline, the others do not."""
    from transformers import AutoTokenizer

    from episodes.rollout import start_episodes
    from inference.codecs import make_codec

    cfg = EnvConfig(address=f"tcp://127.0.0.1:{free_tcp_port()}", call_timeout_s=0.5)
    link = EnvLink(cfg.address, cfg.call_timeout_s)

    class Unreachable(RemoteEnv):  # the class of a server that answered once and went away
        name, _link = "files", link

    codec_ = make_codec(AutoTokenizer.from_pretrained(files_policy_path))
    t0 = time.monotonic()
    episodes = start_episodes(FilesEnv().tasks("train")[:3], 2, Unreachable, codec_)
    assert time.monotonic() - t0 < 2
    assert [ep.failure.reason for ep in episodes] == ["timeout"] * 6
    assert all(ep.done and not ep.tokens for ep in episodes)  # failed at the open + reset
