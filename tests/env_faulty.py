"""A plugin env whose tools misbehave on purpose, served by tests/test_env_service.py as
``env_faulty:faulty`` (tests/ on PYTHONPATH): a call that never returns, a worker that exits
mid-episode, an answer the wire cannot carry, and the interface's own refusals."""

from __future__ import annotations

import os
import sys
import time

from environments import (
    ActionError,
    ArgSpec,
    Environment,
    ToolCall,
    ToolError,
    ToolSpec,
    register_env,
)
from protocol.messages import Task

TOOLS = (ToolSpec("ok", "answer ok"), ToolSpec("hang", "never return"),
         ToolSpec("crash", "end the worker process"), ToolSpec("garble", "make state() unreadable"),
         ToolSpec("refuse", "refuse the call (ToolError)"),
         ToolSpec("misparse", "raise ActionError", (ArgSpec("word"),)))
# Tasks in these worlds misbehave at their first step, whatever the action (a policy that
# writes anything meets them): the tool of that name runs first.
FAULT_SEEDS = {7: "crash", 8: "garble", 9: "hang"}


@register_env("faulty")
class Faulty(Environment):
    client_options = {"only_ok": (False, True)}  # a served client may choose it

    def __init__(self, hang_s: float = 60.0, only_ok: bool = False):
        super().__init__()
        self.hang_s = hang_s
        self.only_ok = only_ok  # offer the ok tool alone (what an explorer samples from)
        self.calls: list[str] = []
        self.garbled = False

    def tools(self):
        return list(TOOLS[:1] if self.only_ok else TOOLS)

    def reset(self, task):
        self.task, self.responses, self.calls, self.garbled = task, [], [], False
        return "ready"

    def step(self, action_text):
        fault = FAULT_SEEDS.get(self.task.seed) if self.task is not None else None
        if fault == "garble":  # an info map the codec refuses (an int key)
            return "ok", False, {1: "garbled"}
        if fault is not None:
            self.execute(ToolCall(fault))
        return super().step(action_text)

    def execute(self, call):
        self.calls.append(call.tool)
        if call.tool == "hang":
            time.sleep(self.hang_s)
        elif call.tool == "crash":
            print(f"faulty: crashing on purpose after {len(self.calls)} calls", file=sys.stderr,
                  flush=True)
            os._exit(3)
        elif call.tool == "garble":
            self.garbled = True  # a map with an int key: msgpack packs it, the codec refuses it
        elif call.tool == "refuse":
            raise ToolError("refused", "error : refused")
        elif call.tool == "misparse":
            raise ActionError("custom", "error : custom", tool="misparse")
        return "ok"

    def state(self):
        return {1: "garbled"} if self.garbled else {"calls": list(self.calls)}

    def evaluate(self, task):
        return float(self.calls[-1:] == ["ok"])

    def tasks(self, split):
        return [Task(f"faulty/{split}/{i}", "faulty", "say ok", i, {"ok": True}, ["ok"],
                     split=split) for i in range(2)]

    def candidate_actions(self):
        return [t.name for t in TOOLS if not t.args]

    @classmethod
    def vocabulary(cls):
        return []
