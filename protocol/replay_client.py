"""Client of the replay server, for actors (push groups), judges, the learner and the
experience role (reads what was stored).

Pushes are pipelined: :meth:`ReplayClient.push_group` returns at once and acks arrive through
:meth:`ReplayClient.poll_acks`. A push's message id is ``"group:" + group_id``, so the
transport's retries and an actor re-sending the same group are one and the same request to
the server, which stores it once. The other calls block until answered.
"""

from __future__ import annotations

import time

from protocol.config import RunConfig
from protocol.errors import RemoteError, ReplayDiskFull, TransportTimeout
from protocol.messages import (
    Ack,
    Batch,
    BatchRequest,
    Error,
    Group,
    GroupsSince,
    JudgePull,
    JudgeWork,
    LearnerHello,
    LedgerCommit,
    Stats,
    StatsRequest,
    StepLabels,
    StoredGroups,
)
from protocol.run_dir import role_token
from protocol.security import CurveKeys, curve_for
from protocol.transport import Channel, ZmqChannel

PUSH_PREFIX = "group:"
# How long a client waits before it sends again what replay refused with ``disk_full``.
DISK_FULL_BACKOFF_S = 5.0


class ReplayClient:
    def __init__(self, address: str | None = None, retry_after_s: float = 2.0,
                 timeout_s: float = 30.0, channel: Channel | None = None,
                 curve: CurveKeys | None = None, credential: str = ""):
        """``credential``: this role's token (``protocol.run_dir.role_token``), sent in every
        frame it sends over a socket it makes; a given ``channel`` carries its own."""
        if channel is None and address is None:
            raise ValueError("ReplayClient needs an address or a channel")
        self.channel = channel or ZmqChannel(address, retry_after_s=retry_after_s, curve=curve,
                                             credential=credential)
        self.timeout_s = timeout_s
        self.disk_full_backoff_s = DISK_FULL_BACKOFF_S
        self._acks: list[tuple[str, str]] = []
        self._replies: dict[str, object] = {}  # answers to blocking calls, by msg id

    @classmethod
    def for_run(cls, cfg: RunConfig, address: str | None = None, role: str | None = None,
                run_dir=None, **kw) -> ReplayClient:
        """A client of the run's replay server (``replay.address`` unless ``address``) acting
        as ``role`` (protocol.messages.REPLAY_ROLES; None: a reader). CURVE keys come from
        ``security.keys_dir`` (the role's own pair when the directory has one); the role's
        token from ``run_dir`` when it has one. A plaintext address off this machine is
        refused (ConfigError) unless ``security.allow_plaintext_remote``."""
        address = address or cfg.replay.address
        credential = role_token(run_dir, role) if role and run_dir is not None else ""
        return cls(address, curve=curve_for(cfg.security, address, role=role),
                   credential=credential, **kw)

    # --- actors ----------------------------------------------------------------------------

    def push_group(self, group: Group) -> str:
        """Send ``group`` without waiting; re-sent until acknowledged. Returns the msg id."""
        return self.channel.send(group, PUSH_PREFIX + group.group_id)

    def poll_acks(self, timeout_s: float = 0.0) -> list[tuple[str, str]]:
        """(group_id, status) for pushes answered since the last call: ``stored``,
        ``duplicate``, or ``error:<reason>`` (refused, e.g. ``error:store_full``; not retried;
        ``error:disk_full`` means nothing was stored: push it again later)."""
        self._collect(timeout_s)
        out, self._acks = self._acks, []
        return out

    def unacked(self) -> list[str]:
        """Group ids pushed and not answered yet."""
        n = len(PUSH_PREFIX)
        return [mid[n:] for mid in self.channel.pending if mid.startswith(PUSH_PREFIX)]

    # --- judges ----------------------------------------------------------------------------

    def pull_judge_work(self, judge_id: str, max_groups: int = 1,
                        lease_s: float = 60.0) -> list[Group]:
        work: JudgeWork = self._request(JudgePull(judge_id, max_groups, lease_s), JudgeWork)
        return work.groups

    def submit_labels(self, labels: StepLabels) -> str:
        """``stored``, or ``duplicate`` when the group was already judged."""
        return self._request(labels, Ack).status

    # --- learner ---------------------------------------------------------------------------

    def hello(self, learner_id: str, version: int, consumed: list[str] = ()) -> dict:
        return self._request(LearnerHello(learner_id, version, list(consumed)), Ack).info

    def request_batch(self, learner_id: str, num_groups: int, version: int,
                      max_staleness: int = 4, require_labels: bool = False,
                      label_deadline_s: float = 0.0, timeout_s: float = 0.0,
                      skip_uninformative: bool = False) -> Batch:
        """Up to ``num_groups`` groups; with ``require_labels`` only judged ones, plus unjudged
        ones stored more than ``label_deadline_s`` ago (when > 0). With ``timeout_s`` > 0 (at
        most ``MAX_BATCH_WAIT_S``) the server holds the request while it has nothing to serve
        and answers as soon as it has, or empty once ``timeout_s`` has passed; this call waits
        that much longer than its usual deadline. With ``skip_uninformative`` groups that carry
        no signal are set aside instead (``Batch.uninformative_skipped``)."""
        return self._request(BatchRequest(learner_id, num_groups, version, max_staleness,
                                          require_labels, label_deadline_s, timeout_s,
                                          skip_uninformative), Batch,
                             timeout_s=self.timeout_s + timeout_s)

    # --- readers (the experience role) -----------------------------------------------------

    def groups_since(self, since_seq: int, max_groups: int = 256) -> StoredGroups:
        """One page of the groups stored at ingest sequence ``since_seq`` or later, oldest
        first (evicted ones are gone); read-only. Go on from ``next_seq`` while ``more``."""
        return self._request(GroupsSince(since_seq, max_groups), StoredGroups)

    def commit_ledger(self, learner_id: str, group_ids: list[str], version: int = 0) -> dict:
        return self._request(LedgerCommit(learner_id, list(group_ids), version), Ack).info

    def stats(self) -> dict:
        reply: Stats = self._request(StatsRequest(), Stats)
        return reply.values

    def close(self) -> None:
        self.channel.close()

    # --- plumbing --------------------------------------------------------------------------

    def _request(self, msg, expect: type, timeout_s: float | None = None):
        # Not Channel.request: that drops replies to other ids, and push acks may arrive while
        # we wait here.
        msg_id = self.channel.send(msg)
        deadline = time.monotonic() + (timeout_s or self.timeout_s)
        while msg_id not in self._replies:
            left = deadline - time.monotonic()
            if left <= 0:
                self.channel.forget(msg_id)
                raise TransportTimeout(f"no answer to {type(msg).__name__} in time")
            self._collect(min(left, 0.1))
        reply = self._replies.pop(msg_id)
        if isinstance(reply, Error) and reply.reason == "disk_full":
            time.sleep(self.disk_full_backoff_s)
            raise ReplayDiskFull(f"replay: {reply.detail}")
        if isinstance(reply, Error):
            raise RemoteError(reply.reason, reply.detail)
        if not isinstance(reply, expect):  # a confused or hostile server
            raise RemoteError("unexpected_type", f"{type(msg).TYPE} answered with "
                              f"{type(reply).TYPE}, not {expect.TYPE}")
        return reply

    def _collect(self, timeout_s: float) -> None:
        for msg_id, reply in self.channel.poll(timeout_s):
            if msg_id.startswith(PUSH_PREFIX):
                self._acks.append((msg_id[len(PUSH_PREFIX):], _status(reply)))
            else:
                self._replies[msg_id] = reply


def _status(reply) -> str:
    if isinstance(reply, Ack):
        return reply.status
    if isinstance(reply, Error):
        return f"error:{reply.reason}"
    return f"error:unexpected {type(reply).__name__}"
