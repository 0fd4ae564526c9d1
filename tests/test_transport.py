"""ZeroMQ transport over real sockets: retries keep their id, bad frames never kill a server."""

import subprocess
import sys
import threading
import time

import pytest
import zmq

from protocol.errors import RemoteError, TransportTimeout
from protocol.messages import Ack, StatsRequest, Task
from protocol.transport import LoopbackChannel, RouterServer, ZmqChannel, free_tcp_port


class EchoServer:
    """Answers every valid frame with an Ack naming how often it saw that msg id."""

    def __init__(self, address):
        self.server = RouterServer(address, max_frame_bytes=1 << 16)
        self.address = self.server.bound_address
        self.seen: dict[str, int] = {}
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        while not self.stop.is_set():
            for inc in self.server.poll(20):
                if inc.error:
                    self.server.reject(inc, inc.error)
                    continue
                self.seen[inc.msg_id] = self.seen.get(inc.msg_id, 0) + 1
                self.server.reply(inc, Ack(info={"times": self.seen[inc.msg_id]}))
        self.server.close()

    def close(self):
        self.stop.set()
        self.thread.join(5)


@pytest.fixture
def echo():
    srv = EchoServer("tcp://127.0.0.1:*")
    yield srv
    srv.close()


def test_request_reply(echo):
    ch = ZmqChannel(echo.address)
    reply = ch.request(StatsRequest(), timeout_s=5, msg_id="abc")
    assert isinstance(reply, Ack) and reply.info == {"times": 1}
    assert ch.pending == {}
    ch.close()


def test_bad_frames_get_reasons_and_server_keeps_serving(echo):
    raw = zmq.Context.instance().socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(echo.address)
    for junk in (b"", b"\x00\x01garbage", b"x" * 70_000):
        raw.send(junk)
    replies = [raw.recv() for _ in range(3) if raw.poll(3000)]
    raw.close()
    assert len(replies) == 3
    rejected = echo.server.counters.rejected
    assert rejected["not_msgpack"] == 2 and rejected["oversize"] == 1
    ch = ZmqChannel(echo.address)
    assert isinstance(ch.request(StatsRequest(), timeout_s=5), Ack)
    ch.close()


def test_client_retries_with_the_same_id_until_server_appears():
    port = _free_port()
    address = f"tcp://127.0.0.1:{port}"
    ch = ZmqChannel(address, retry_after_s=0.1)
    msg_id = ch.send(Task("t", "files", "q", 1))
    for _ in range(4):  # several retries go nowhere
        assert ch.poll(0.1) == []
    srv = EchoServer(address)
    try:
        got = []
        deadline = time.monotonic() + 5
        while not got and time.monotonic() < deadline:
            got = ch.poll(0.1)
        assert got and got[0][0] == msg_id
        assert ch.resends >= 1 and ch.pending == {}
        assert set(srv.seen) == {msg_id}  # every retry carried the same id
    finally:
        ch.close()
        srv.close()


def test_request_times_out_cleanly():
    ch = ZmqChannel(f"tcp://127.0.0.1:{_free_port()}", retry_after_s=0.05)
    with pytest.raises(TransportTimeout):
        ch.request(StatsRequest(), timeout_s=0.3)
    assert ch.pending == {}
    ch.close()


def test_error_reply_raises_remote_error():
    from protocol.messages import Error

    ch = LoopbackChannel(lambda inc: Error("invalid", "nope"))
    with pytest.raises(RemoteError) as info:
        ch.request(StatsRequest())
    assert info.value.reason == "invalid"
    assert len(ch.sent) == 1 and len(ch.received) == 1


def test_loopback_records_frames():
    ch = LoopbackChannel(lambda inc: Ack(info={"type": inc.msg.TYPE}))
    assert ch.request(Task("t", "files", "q", 1)).info == {"type": "task"}
    assert ch.sent[0].startswith(b"\x96")  # a 6-element msgpack array: the v5 envelope


def test_exit_with_unsent_messages_does_not_hang():
    code = (
        "from protocol.transport import ZmqChannel\n"
        "from protocol.messages import StatsRequest\n"
        "ch = ZmqChannel('tcp://127.0.0.1:%d')\n"
        "for _ in range(100): ch.send(StatsRequest())\n"
        "ch.close()\n" % _free_port()
    )
    t0 = time.monotonic()
    subprocess.run([sys.executable, "-c", code], check=True, timeout=20)
    assert time.monotonic() - t0 < 10


def _free_port():
    return free_tcp_port()


def test_request_keeps_answers_to_pipelined_sends(echo):
    ch = ZmqChannel(echo.address)
    ids = {ch.send(Task("t", "files", "q", i)) for i in range(5)}
    time.sleep(0.2)  # their answers are waiting on the socket when the request reads it
    assert isinstance(ch.request(StatsRequest(), timeout_s=5), Ack)
    got = set()
    deadline = time.monotonic() + 5
    while got != ids and time.monotonic() < deadline:
        got |= {rid for rid, _ in ch.poll(0.1)}
    assert got == ids and ch.pending == {}
    ch.close()
