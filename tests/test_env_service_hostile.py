"""Hostile clients of a real ``autodidact env serve`` process, each refused in one line and
counted (the server's ``EnvStats`` reply and its log), while an honest client's episode, made
the way a run makes one (``env_maker`` of an EnvConfig, its token read from its file), runs
alongside and finishes unharmed:

* no token, or a wrong one: ``unauthorized``;
* a stolen session id (another client with a token of its own): ``not_yours``, for a step, a
  close, a state, a batch of them, and an open under that id (``session_taken``);
* a session flood: the flooder's own least recently used sessions close past its quota, never
  another client's; a client with none to close is answered ``full``;
* hostile options (an unbounded ``num_worlds``, a ``url``, a value of the wrong type, an option
  the server fixed): ``options``, naming the field;
* an oversized frame: ``oversize``; an honest batch larger than the limit is split to fit.

Nothing here waits on a short deadline: every call may take a minute.
"""

from __future__ import annotations

import contextlib
import os

import pytest
import zmq
from click.testing import CliRunner
from helpers_procs import wait_for

from autodidact.env_serve import EnvServerProcess, client_options
from environments import FilesEnv, env_maker
from environments.remote import EnvLink
from protocol import codec
from protocol import env_wire as wire
from protocol.config import EnvConfig
from protocol.errors import EnvFailed
from protocol.messages import Error
from protocol.transport import new_id

CALL_S = 60.0  # every call's deadline: generous, so a loaded machine fails nothing here
MAX_SESSIONS = 4  # one worker's, and so the server's
PER_CLIENT = 3
FRAME = 64 * 1024  # --max-frame-bytes, the smallest it takes
CLIENTS = ("honest", "thief", "flooder", "latecomer")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """One worker holding 4 sessions, 3 a client, frames up to 64 KiB, num_worlds fixed at
    60; a token for each of CLIENTS; the honest client's token file the one a run reads."""
    root = tmp_path_factory.mktemp("hostile")
    tokens = root / "tokens"
    for name in CLIENTS:
        wire.make_token(tokens / f"{name}.token")
    saved = {k: os.environ.get(k) for k in (wire.TOKENS_ENV, wire.TOKEN_FILE_ENV)}
    os.environ[wire.TOKENS_ENV] = str(tokens)
    os.environ[wire.TOKEN_FILE_ENV] = str(tokens / "honest.token")
    proc = EnvServerProcess(
        "files", "--max-sessions", str(MAX_SESSIONS), "--max-sessions-per-client",
        str(PER_CLIENT), "--max-frame-bytes", str(FRAME), "--set", "env.options.num_worlds=60",
        workers=1, log=root / "serve.log").start()
    try:
        proc.tokens = {name: wire.read_token(tokens / f"{name}.token") for name in CLIENTS}
        proc.cfg = EnvConfig(name="files", address=proc.address, call_timeout_s=CALL_S)
        try:
            env_maker(proc.cfg)  # the hello: waits for the worker
        except EnvFailed:
            pytest.fail(f"env server did not answer:\n{proc.text()[-3000:]}")
        yield proc
    finally:
        proc.stop()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def link(server, name: str) -> EnvLink:
    """A client speaking the wire itself with ``name``'s token."""
    made = EnvLink(server.address, CALL_S, token=server.tokens[name])
    made.hello()
    return made


def stats(server) -> wire.EnvStats:
    return link(server, "honest").stats()


def open_session(client: EnvLink, options: dict | None = None) -> str:
    session = new_id()
    reply = client.call(wire.EnvOpen(wire.ENV_WIRE_VERSION, session, options or {}))
    assert isinstance(reply, wire.EnvOpened), reply
    return session


def refused(call) -> EnvFailed:
    with pytest.raises(EnvFailed) as info:
        call()
    return info.value


@contextlib.contextmanager
def honest_episode(server):
    """The honest client's episode, as a run makes and plays it: opened, reset, one step in;
    the body runs beside it; then its remaining steps, and it must have solved its task."""
    task = next(t for t in FilesEnv().tasks("train") if len(t.reference) >= 2)
    env = env_maker(server.cfg)()
    env.reset(task)
    env.step(task.reference[0])
    local = FilesEnv()
    local.reset(task)
    local.step(task.reference[0])
    assert env.state() == local.state()
    try:
        yield env
        assert env.state() == local.state(), "another client changed the honest episode"
        for action in task.reference[1:]:
            env.step(action)
        assert env.evaluate(task) == 1.0
    finally:
        type(env)._link.call(wire.EnvClose(env.session))


def log_lines(server, text: str) -> int:
    return server.text().count(text)


# --- no token ------------------------------------------------------------------------------------


def test_a_frame_without_a_token_is_refused(server):
    before, lines = stats(server), log_lines(server, "rejected frame")
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(server.address)
    try:
        with honest_episode(server) as env:
            for credential in ("", "0" * 48, server.tokens["thief"][:-1]):
                for msg in (wire.EnvHello(wire.ENV_WIRE_VERSION), wire.EnvState(env.session),
                            wire.EnvClose(env.session), wire.EnvStatsRequest()):
                    sock.send(codec.encode(msg, "x", credential))
                    assert sock.poll(int(CALL_S * 1000)), "no answer"
                    _, reply = codec.decode(sock.recv())
                    assert isinstance(reply, Error) and reply.reason == "unauthorized", reply
                    assert "token" in reply.detail and "\n" not in reply.detail
            # the project's own client without a token says what it lacks
            failed = refused(lambda: EnvLink(server.address, CALL_S, token="").hello())
            assert failed.reason == "refused" and "presented no token" in failed.detail
    finally:
        sock.close(0)
    after = stats(server)
    assert after.rejected["unauthorized"] - before.rejected.get("unauthorized", 0) == 13
    wait_for(lambda: log_lines(server, "rejected frame") == lines + 13, what="13 log lines")


# --- a stolen session id -------------------------------------------------------------------------


def test_a_stolen_session_id_is_refused(server):
    thief = link(server, "thief")
    before, lines = stats(server), log_lines(server, "is another client's")
    with honest_episode(server) as env:
        stolen = env.session
        for request in (wire.EnvStep(stolen, "rm games"), wire.EnvClose(stolen),
                        wire.EnvState(stolen), wire.EnvReset(stolen, FilesEnv().tasks("test")[0])):
            failed = refused(lambda r=request: thief.call(r))
            assert failed.reason == "not_yours" and "another client" in failed.detail
        batch = thief.call_many([wire.EnvStep(stolen, "rm games"), wire.EnvClose(stolen)])
        assert [f.reason for f in batch] == ["not_yours"] * 2
        taken = refused(lambda: thief.call(wire.EnvOpen(wire.ENV_WIRE_VERSION, stolen, {})))
        assert taken.reason == "session_taken"
    after = stats(server)
    assert after.failures["not_yours"] - before.failures.get("not_yours", 0) == 6
    wait_for(lambda: log_lines(server, "is another client's") == lines + 6, what="6 log lines")
    assert after.yours == 0  # the honest episode closed; the thief never held it


# --- a session flood -----------------------------------------------------------------------------


def test_a_session_flood_closes_only_the_flooders_own_sessions(server):
    flooder, latecomer = link(server, "flooder"), link(server, "latecomer")
    before = stats(server)
    with honest_episode(server) as env:
        flood = [open_session(flooder) for _ in range(PER_CLIENT + 3)]
        assert flooder.stats().yours == PER_CLIENT  # its quota: its oldest closed for its newest
        for session in flood[:3]:
            assert refused(lambda s=session: flooder.call(wire.EnvState(s))).reason == \
                "no_session"
        for session in flood[3:]:
            assert isinstance(flooder.call(wire.EnvState(session)), wire.EnvValue)
        # The worker is full (the honest session and the flooder's 3): a client holding none
        # to close is refused, in one line.
        lines = log_lines(server, "every worker holds")
        full = refused(lambda: open_session(latecomer))
        assert full.reason == "full" and "--max-sessions" in full.detail
        wait_for(lambda: log_lines(server, "every worker holds") == lines + 1, what="a line")
        # The flooder closes one and the latecomer takes its room; the flooder, under its
        # quota but with every worker full, then closes its own oldest, not the latecomer's.
        flooder.call(wire.EnvClose(flood.pop()))
        late = open_session(latecomer)
        flood.append(open_session(flooder))
        assert refused(lambda: flooder.call(wire.EnvState(flood[3]))).reason == "no_session"
        assert isinstance(latecomer.call(wire.EnvState(late)), wire.EnvValue)
        assert isinstance(env.state(), dict)  # the honest session is still there
    after = stats(server)
    assert after.evicted - before.evicted == 4  # 3 past its quota, 1 on the full worker
    assert after.failures["full"] - before.failures.get("full", 0) == 1
    assert log_lines(server, "closing its least recently used") >= 4
    flooder.call_many([wire.EnvClose(s) for s in flood])  # closing what is gone: no error
    latecomer.call(wire.EnvClose(late))
    assert flooder.stats().yours == latecomer.stats().yours == 0


# --- hostile options -----------------------------------------------------------------------------


HOSTILE_OPTIONS = [
    ({"num_worlds": 10**8}, "env.options.num_worlds"),  # fixed by the server at 60
    ({"url": "http://169.254.169.254/latest"}, "env.options.url"),  # never a client's
    ({"holdout": "everything"}, "env.options.holdout"),  # not among its choices
    ({"holdout": True}, "env.options.holdout"),  # nor of their type
    ({"tree": {"a": "b"}}, "env.options.tree"),  # not a constructor option at all
]


def test_hostile_options_are_refused_naming_the_field(server):
    thief = link(server, "thief")
    before, lines = stats(server), log_lines(server, "refused an open")
    with honest_episode(server):
        for options, field in HOSTILE_OPTIONS:
            failed = refused(lambda o=options: open_session(thief, o))
            assert failed.reason == "options" and failed.detail.startswith(field), failed
            assert "\n" not in failed.detail
        # what the env declares, within bounds, and the server's own value: served
        thief.call(wire.EnvClose(open_session(thief, {"holdout": "task", "num_worlds": 60})))
    after = stats(server)
    assert after.failures["options"] - before.failures.get("options", 0) == len(HOSTILE_OPTIONS)
    wait_for(lambda: log_lines(server, "refused an open") == lines + len(HOSTILE_OPTIONS),
             what="a line each")
    # a run's env.options that the server does not allow fail its env at once, saying why
    failed = refused(lambda: env_maker(EnvConfig(
        name="files", address=server.address, call_timeout_s=CALL_S,
        options={"num_worlds": 10}))())
    assert failed.reason == "options" and "fixes it to 60" in failed.detail


def test_what_a_client_may_choose_is_declared_by_the_env():
    from environments.openenv_adapter import OpenEnvEnv

    assert OpenEnvEnv.client_options == {}  # the url a server fetches is never a client's
    options, why = client_options(OpenEnvEnv, {"url": "http://127.0.0.1:8000"},
                                  {"url": "http://169.254.169.254/"})
    assert options is None and why.startswith("env.options.url: this server fixes it")
    options, why = client_options(OpenEnvEnv, {"url": "http://127.0.0.1:8000"}, {"seeds": 3})
    assert options is None and "may set: none" in why
    assert client_options(FilesEnv, {}, {"num_worlds": 200}) == ({"num_worlds": 200}, "")
    assert client_options(FilesEnv, {}, {"num_worlds": 201})[0] is None
    assert client_options(FilesEnv, {}, {"num_worlds": 20.0})[0] is None


def test_the_server_refuses_options_its_env_does_not_take():
    from autodidact.env_serve import env

    result = CliRunner().invoke(env, ["serve", "files", "--address", "tcp://127.0.0.1:9",
                                      "--set", "env.options.nope=1"])
    assert result.exit_code == 2 and "takes no such options" in result.output
    result = CliRunner().invoke(env, ["serve", "files", "--address", "tcp://127.0.0.1:9",
                                      "--set", "num_worlds=1"])
    assert result.exit_code == 2 and "env.options.NAME=VALUE" in result.output


# --- an oversized frame --------------------------------------------------------------------------


def test_an_oversized_frame_is_refused_and_honest_batches_fit(server):
    thief = link(server, "thief")
    assert thief.max_frame_bytes == FRAME  # the hello says the limit
    before, lines = stats(server), log_lines(server, "rejected frame")
    with honest_episode(server) as env:
        session = open_session(thief)
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(server.address)
        try:  # a frame past the limit, token and all: refused unread
            sock.send(codec.encode(wire.EnvStep(session, "ls " + "x" * FRAME), "big",
                                   server.tokens["thief"]))
            assert sock.poll(int(CALL_S * 1000)), "no answer"
            _, reply = codec.decode(sock.recv())
            assert isinstance(reply, Error) and reply.reason == "oversize", reply
        finally:
            sock.close(0)
        # the project's client does not send what the hello said the server would refuse
        failed = refused(lambda: thief.call(wire.EnvStep(session, "ls " + "x" * FRAME)))
        assert failed.reason == "refused" and "over the frame limit" in failed.detail
        assert isinstance(thief.call(wire.EnvState(session)), wire.EnvValue)  # served on
        # an honest batch four times the limit goes out in frames that fit
        honest = type(env)._link
        texts = honest.call_many([wire.EnvCanonicalAction(env.session, "ls " + "y" * 2000)
                                  for _ in range(128)])
        assert all(isinstance(t, wire.EnvValue) for t in texts)
        thief.call(wire.EnvClose(session))
    after = stats(server)
    assert after.rejected["oversize"] - before.rejected.get("oversize", 0) == 1
    wait_for(lambda: log_lines(server, "rejected frame") == lines + 1, what="one line")


def test_the_server_outlived_every_hostile_client(server):
    assert server.proc.poll() is None
    final = stats(server)
    assert final.sessions == 0 and final.clients == len(CLIENTS)


def test_tokens_others_could_read_or_add_stop_the_server_at_start(tmp_path):
    from autodidact.env_serve import load_tokens
    from protocol.errors import ConfigError

    tokens, made = load_tokens(tmp_path / "tokens")  # none yet: client.token made, 0600
    assert made and list(tokens) == ["client"] and len(tokens["client"]) == 48
    assert (tmp_path / "tokens" / "client.token").stat().st_mode & 0o777 == 0o600
    assert load_tokens(tmp_path / "tokens") == (tokens, False)  # never made again
    (tmp_path / "tokens" / "client.token").chmod(0o644)
    with pytest.raises(ConfigError, match="chmod 600"):
        load_tokens(tmp_path / "tokens")
    (tmp_path / "tokens" / "client.token").chmod(0o600)
    (tmp_path / "tokens").chmod(0o777)
    with pytest.raises(ConfigError, match="chmod 700"):
        load_tokens(tmp_path / "tokens")
