"""The environment profile: what exploration learned about an unknown environment.

Built from the declared tools and the explorations: entity types with the attributes and values
seen, the operations (tools) applied to each type, and every way a call was refused with an
example (the environment's preconditions). Saved as JSON next to the explorations and rendered
as a short "table of contents" for explorer and proposer prompts.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path

from environments.base import Environment, ToolSpec
from questioning.explorer import Exploration

MAX_VALUES = 12  # attribute values and examples kept per entity type


class ProfileBuilder:
    """Accumulates explorations into a profile; ``to_dict`` is the saved JSON."""

    def __init__(self, env: Environment):
        self.env = env
        self.tools: dict[str, ToolSpec] = {t.name: t for t in env.tools()}
        self.calls = {name: {"calls": 0, "ok": 0, "errors": {}} for name in self.tools}
        self.types: dict[str, dict] = {}
        self.explorations = self.steps = 0
        self.invalid: dict[str, dict] = {}

    def add(self, exploration: Exploration) -> None:
        self.explorations += 1
        state = exploration.initial_state
        for step in exploration.steps:
            by_name = self._entities(state)
            self._record_call(step, by_name)
            state = step.state
        self._entities(state)

    def _entities(self, state: dict) -> dict[str, list[str]]:
        """Types by name in ``state``, recording every entity's attributes along the way."""
        by_name: dict[str, list[str]] = defaultdict(list)
        for ent in self.env.entities(state):
            kind = self.types.setdefault(ent["type"], {"names": {}, "attributes": {},
                                                       "operations": {}, "errors": {}})
            _bounded_add(kind["names"], ent["name"])
            for attr, value in ent.get("attributes", {}).items():
                _bounded_add(kind["attributes"].setdefault(attr, {}), str(value))
            by_name[ent["name"]].append(ent["type"])
        return by_name

    def _record_call(self, step, by_name: dict[str, list[str]]) -> None:
        self.steps += 1
        if step.tool not in self.tools:
            _count_example(self.invalid, step.error or "invalid", step)
            return
        entry = self.calls[step.tool]
        entry["calls"] += 1
        if step.error is None:
            entry["ok"] += 1
        else:
            _count_example(entry["errors"], step.error, step)
        args = step.action.split()[1:]
        spec_args = self.tools[step.tool].args
        for arg_spec, value in zip(spec_args, args):
            # Without an entity hook, the argument's name stands in for the entity type.
            types = by_name.get(value.rstrip("/")) or ([] if by_name else [arg_spec.name])
            for kind in dict.fromkeys(types):
                info = self.types.setdefault(kind, {"names": {}, "attributes": {},
                                                    "operations": {}, "errors": {}})
                op = f"{step.tool}.{arg_spec.name}"
                if step.error is None:
                    info["operations"][op] = info["operations"].get(op, 0) + 1
                else:
                    _count_example(info["errors"], f"{op}:{step.error}", step)

    def to_dict(self) -> dict:
        tools = []
        for name, spec in self.tools.items():
            entry = self.calls[name]
            tools.append({**spec.to_dict(), "usage": spec.usage(), "calls": entry["calls"],
                          "ok": entry["ok"], "errors": entry["errors"]})
        entities = {
            kind: {"seen": len(info["names"]), "examples": list(info["names"])[:MAX_VALUES],
                   "attributes": {a: list(v)[:MAX_VALUES] for a, v in info["attributes"].items()},
                   "operations": dict(sorted(info["operations"].items())),
                   "errors": info["errors"]}
            for kind, info in sorted(self.types.items())}
        preconditions = [
            {"tool": name, "error": kind, "count": ex["count"], "action": ex["action"],
             "observation": ex["observation"]}
            for name, entry in self.calls.items() for kind, ex in entry["errors"].items()]
        return {"env": self.env.name, "explorations": self.explorations, "steps": self.steps,
                "tools": tools, "entities": entities, "preconditions": preconditions,
                "invalid_actions": self.invalid}


def _bounded_add(values: dict, value: str) -> None:
    if value in values or len(values) < 4 * MAX_VALUES:
        values[value] = values.get(value, 0) + 1


def _count_example(table: dict, kind: str, step) -> None:
    entry = table.setdefault(kind, {"count": 0, "action": step.action,
                                    "observation": step.observation})
    entry["count"] += 1


def build_profile(env: Environment, explorations: Iterable[Exploration]) -> dict:
    builder = ProfileBuilder(env)
    for exp in explorations:
        builder.add(exp)
    return builder.to_dict()


def render_toc(profile: dict, max_errors: int = 3) -> str:
    """The profile as a short text for prompts: entity types, then tools with how they fail."""
    lines = [f"Environment {profile['env']}: {len(profile['tools'])} tools, "
             f"{len(profile['entities'])} entity types ({profile['explorations']} explorations, "
             f"{profile['steps']} steps)", "Entities:"]
    for kind, info in profile["entities"].items():
        attrs = "; ".join(f"{a}: {', '.join(v[:5])}" for a, v in info["attributes"].items())
        ops = ", ".join(sorted({op.split(".")[0] for op in info["operations"]})) or "none seen"
        lines.append(f"- {kind} ({info['seen']} seen, e.g. {', '.join(info['examples'][:4])})"
                     + (f"; {attrs}" if attrs else "") + f"; operations: {ops}")
    lines.append("Tools:")
    for tool in profile["tools"]:
        errors = sorted(tool["errors"].items(), key=lambda kv: -kv[1]["count"])[:max_errors]
        fails = "; ".join(f"{k} (e.g. `{v['action']}` -> {v['observation']})" for k, v in errors)
        lines.append(f"- {tool['usage']}: {tool['description']} [{tool['ok']}/{tool['calls']} "
                     f"ok]" + (f"; fails: {fails}" if fails else ""))
    return "\n".join(lines)


def save_json(report: dict, path: Path) -> None:
    """Write ``report`` (the profile, the coverage) as JSON, atomically."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(report, indent=1, sort_keys=False))
    tmp.replace(path)
