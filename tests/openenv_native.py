"""A tiny OpenEnv-native environment, written only with openenv-core's classes (not ours), for
tests/test_openenv.py: ``python tests/openenv_native.py PORT`` serves it at
http://127.0.0.1:PORT with ``create_app`` and uvicorn.

A counter to bring to a target: reset(seed) sets the target to ``seed % 4 + 2``; MCP tools
``add(n: int 1..3)``, ``show()``, ``paint(colour: red|blue)``, ``zero-out()`` and ``nap()`` (3 s
asleep); every tool call's reward is 1.0 once the counter equals the target (then
done), else 0.0.
"""

from __future__ import annotations

import sys
import time
from typing import Annotated, Literal

from fastmcp import FastMCP
from openenv.core.env_server import create_app
from openenv.core.env_server.mcp_environment import MCPEnvironment
from openenv.core.env_server.mcp_types import CallToolAction, CallToolObservation
from openenv.core.env_server.types import Observation, State
from pydantic import Field


def target_of(seed: int) -> int:
    return seed % 4 + 2


class Counter(MCPEnvironment):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self):
        mcp = FastMCP("counter")
        self.value, self.target, self.colour, self.steps = 0, 2, "red", 0

        @mcp.tool
        def add(n: Annotated[int, Field(ge=1, le=3, description="how much to add")]) -> str:
            """add n to the counter"""
            self.value += n
            return f"counter {self.value}"

        @mcp.tool
        def show() -> str:
            """show the counter and its target"""
            return f"counter {self.value} target {self.target}"

        @mcp.tool
        def paint(colour: Literal["red", "blue"]) -> str:
            """paint the counter"""
            self.colour = colour
            return f"painted {colour}"

        @mcp.tool(name="zero-out")  # an MCP name the action parser cannot take as it is
        def zero_out() -> str:
            """set the counter to 0"""
            self.value = 0
            return "counter 0"

        @mcp.tool
        def nap() -> str:
            """sleep 3 s (a call past a client's deadline)"""
            time.sleep(3.0)
            return "awake"

        super().__init__(mcp)

    def reset(self, seed=None, episode_id=None, **kwargs) -> Observation:
        self.value, self.target, self.steps = 0, target_of(seed or 0), 0
        return Observation(metadata={"target": self.target})

    async def step_async(self, action, timeout_s=None, **kwargs):
        observation = await super().step_async(action, timeout_s=timeout_s, **kwargs)
        if isinstance(action, CallToolAction):
            self.steps += 1
            observation.done = self.value == self.target
            observation.reward = 1.0 if observation.done else 0.0
        return observation

    def _step_impl(self, action, timeout_s=None, **kwargs) -> Observation:
        raise ValueError("only MCP tool calls here")

    @property
    def state(self) -> State:
        return State(step_count=self.steps, value=self.value)


if __name__ == "__main__":
    import uvicorn

    app = create_app(Counter, CallToolAction, CallToolObservation, env_name="counter",
                     max_concurrent_envs=8)
    uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")
