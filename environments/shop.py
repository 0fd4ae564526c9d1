"""``shop``: a small stateful order service, the second built-in environment.

Its shape is unlike ``files``: there is no tree to walk but ids the agent must *invent* (a new
order needs an order id nobody has used), quantities well above 3, and reversible operations
(a reservation can be cancelled, putting its stock back). A world (from ``Task.seed``) has 3-4
items with stock 2-9 and 0-2 open orders. It speaks a closed vocabulary, so the word-level tiny
policy can fit it.

State (``state()``): ``{"stock": {item: n}, "orders": {id: [item, qty, status]}}`` with status
``reserved`` or ``shipped``; a cancelled order is gone. Goal (``Task.goal``): ``{"all":
[condition, ...]}`` with conditions ``{"stock": [item, n]}``, ``{"order": [id, item, qty,
status]}``, ``{"no_order": id}``, ``{"event": action}`` (that successful call happened this
episode; several event conditions must happen in their order) and ``{"response": text}`` (a
read-only call answered exactly ``text``).

The held-out tasks are hand-written templates, some of which only events can state ("reserve 3
pipe for order o7 and cancel it" leaves the shop as it was).
"""

from __future__ import annotations

import functools
import random
import zlib

from environments.base import (
    ArgSpec,
    Environment,
    GoalPart,
    ToolCall,
    ToolError,
    ToolSpec,
    check_split,
    register_env,
    world_split,
)
from protocol.messages import Task

ITEMS = tuple("pipe valve bolt hose pump gear nut washer".split())
ORDER_IDS = tuple(f"o{i}" for i in range(1, 13))
MAX_QTY = 20
NUM_WORLDS = 50  # 30 train, 10 validation, 10 test worlds (environments.base.world_split)

TOOLS = (
    ToolSpec("stock", "show the stock of every item or of one item",
             (ArgSpec("item", "str", "item to show", required=False, choices=ITEMS),)),
    ToolSpec("orders", "list the orders"),
    ToolSpec("reserve", "hold qty of an item for a new order",
             (ArgSpec("order", "str", "new order id", kind="id"),
              ArgSpec("item", "str", "item to hold", choices=ITEMS),
              ArgSpec("qty", "int", "how many", bounds=(1, 9)))),
    ToolSpec("cancel", "cancel a reserved order and put its stock back",
             (ArgSpec("order", "str", "order id"),)),
    ToolSpec("ship", "ship a reserved order", (ArgSpec("order", "str", "order id"),)),
    ToolSpec("restock", "add qty to the stock of an item",
             (ArgSpec("item", "str", "item to add to", choices=ITEMS),
              ArgSpec("qty", "int", "how many", bounds=(1, 9)))),
)
_WORDS = (
    "ok error : stock orders reserved shipped cancelled restocked for order item no such "
    "already exists only left is not a number too many of and it then show the every make "
    "to empty unknown tool bad syntax name argument action text long characters usage more "
    "must be than id ( ) ... reserve cancel ship restock qty new"
)


def make_world(seed: int) -> dict:
    """The initial state for ``seed``."""
    rng = random.Random(seed)
    items = rng.sample(ITEMS, rng.randint(3, 4))
    stock = {item: rng.randint(2, 9) for item in sorted(items)}
    orders = {}
    for order in rng.sample(ORDER_IDS, rng.randint(0, 2)):
        item = rng.choice(items)
        orders[order] = [item, rng.randint(1, 3), rng.choice(("reserved", "shipped"))]
    return {"stock": stock, "orders": orders}


def _condition_holds(state: dict, cond: dict, responses) -> bool:
    if "stock" in cond:
        item, n = cond["stock"]
        return state["stock"].get(item) == n
    if "order" in cond:
        order, *rest = cond["order"]
        return state["orders"].get(order) == rest
    if "no_order" in cond:
        return cond["no_order"] not in state["orders"]
    if "response" in cond:
        return cond["response"] in responses
    return False


def _events_happened(wanted: list[str], events: list[str]) -> bool:
    """``wanted`` is a subsequence of ``events`` (in order, gaps allowed)."""
    it = iter(events)
    return all(any(e == w for e in it) for w in wanted)


@register_env("shop")
class ShopEnv(Environment):
    """See the module docstring."""

    default_limits = {"max_turns": 6, "max_context": 512, "max_action_tokens": 8}

    def __init__(self, num_worlds: int = NUM_WORLDS):
        super().__init__()
        self.num_worlds = num_worlds
        self.stock: dict = {}
        self.orders: dict = {}
        self.events: list[str] = []  # successful state-changing calls this episode

    def reset(self, task: Task) -> str:
        self.task = task
        world = make_world(task.seed)
        self.stock, self.orders = world["stock"], world["orders"]
        self.responses, self.events = [], []
        return self._tool_stock()

    def tools(self) -> list[ToolSpec]:
        return list(TOOLS)

    def execute(self, call: ToolCall) -> str:
        obs = getattr(self, f"_tool_{call.tool}")(*call.args)
        if call.tool in ("reserve", "cancel", "ship", "restock"):
            self.events.append(call.text())
        return obs

    def state(self) -> dict:
        return {"stock": dict(self.stock), "orders": {k: list(v) for k, v in
                                                      sorted(self.orders.items())}}

    def evaluate(self, task: Task) -> float:
        return float(self.goal_progress(task) >= 1.0)

    def goal_progress(self, task: Task) -> float:
        conds = task.goal.get("all", []) if isinstance(task.goal, dict) else []
        if not conds:
            return 0.0
        state = self.state()
        wanted = [c["event"] for c in conds if "event" in c]
        held = sum(_condition_holds(state, c, self.responses) for c in conds
                   if "event" not in c)
        # Events count as one part: all of them happened in order, or none did.
        held += len(wanted) * _events_happened(wanted, self.events)
        return held / len(conds)

    # --- tools --------------------------------------------------------------------------------

    def _tool_stock(self, item: str | None = None) -> str:
        if item is not None:
            if item not in self.stock:
                raise ToolError("no_item", f"error : no such item {item}")
            return f"stock : {item} {self.stock[item]}"
        return "stock : " + " ".join(f"{k} {v}" for k, v in self.stock.items())

    def _tool_orders(self) -> str:
        if not self.orders:
            return "orders : empty"
        return "orders : " + " ".join(f"{k} {v[0]} {v[1]} {v[2]}"
                                      for k, v in sorted(self.orders.items()))

    def _tool_reserve(self, order: str, item: str, qty: int) -> str:
        if order not in ORDER_IDS:
            raise ToolError("bad_id", f"error : {order} is not a order id")
        if order in self.orders:
            raise ToolError("exists", f"error : order {order} already exists")
        if item not in self.stock:
            raise ToolError("no_item", f"error : no such item {item}")
        if qty < 1 or qty > MAX_QTY:
            raise ToolError("bad_qty", "error : qty must be more than 0")
        if self.stock[item] < qty:
            raise ToolError("short", f"error : only {self.stock[item]} {item} left")
        self.stock[item] -= qty
        self.orders[order] = [item, qty, "reserved"]
        return f"ok : reserved {qty} {item} for order {order}"

    def _reserved(self, order: str) -> list:
        entry = self.orders.get(order)
        if entry is None:
            raise ToolError("no_order", f"error : no such order {order}")
        if entry[2] != "reserved":
            raise ToolError("shipped", f"error : order {order} is not reserved")
        return entry

    def _tool_cancel(self, order: str) -> str:
        item, qty, _ = self._reserved(order)
        self.stock[item] += qty
        del self.orders[order]
        return f"ok : cancelled order {order}"

    def _tool_ship(self, order: str) -> str:
        self._reserved(order)[2] = "shipped"
        return f"ok : shipped order {order}"

    def _tool_restock(self, item: str, qty: int) -> str:
        if item not in self.stock:
            raise ToolError("no_item", f"error : no such item {item}")
        if qty < 1 or self.stock[item] + qty > MAX_QTY:
            raise ToolError("bad_qty", f"error : too many {item}")
        self.stock[item] += qty
        return f"ok : restocked {item} {self.stock[item]}"

    # --- self-questioning hooks ---------------------------------------------------------------

    def goal_from_states(self, before: dict, after: dict) -> dict:
        return self.goal_of([c for p in self.describe_changes(before, after)
                             for c in p.conditions])

    def describe_changes(self, before: dict, after: dict) -> list[GoalPart]:
        parts = []
        moved = dict.fromkeys(after["stock"], 0)  # stock the order changes account for
        for order, entry in after["orders"].items():
            old = before["orders"].get(order)
            if old == entry:
                continue
            item, qty, status = entry
            if old is None:
                moved[item] -= qty
                text = f"reserve {qty} {item} for order {order}"
                if status == "shipped":
                    text += f" and then ship order {order}"
            else:
                text = f"ship order {order}"
            parts.append(GoalPart(({"order": [order, *entry]},), text, (order, item)))
        for order, (item, qty, _status) in before["orders"].items():
            if order not in after["orders"]:
                moved[item] += qty
                parts.append(GoalPart(({"no_order": order},), f"cancel order {order}",
                                      (order,)))
        for item, n in after["stock"].items():
            if n != before["stock"][item] + moved[item]:
                parts.append(GoalPart(({"stock": [item, n]},), f"make the stock of {item} {n}",
                                      (item,)))
        return parts

    def describe_event(self, action: str, observation: str, before: dict,
                       after: dict) -> GoalPart | None:
        words = action.split()
        if not words or words[0] not in ("reserve", "cancel", "ship", "restock"):
            return None
        if words[0] == "reserve":
            text = f"reserve {words[3]} {words[2]} for order {words[1]}"
        elif words[0] == "restock":
            text = f"restock {words[2]} {words[1]}"
        else:
            text = f"{words[0]} order {words[1]}"
        return GoalPart(({"event": action},), text, tuple(words[1:2]))

    def describe_response(self, action: str, observation: str, before: dict) -> GoalPart | None:
        words = action.split()
        if words[:1] == ["stock"] and len(words) == 2:
            return GoalPart(({"response": observation},), f"show the stock of {words[1]}",
                            (words[1],))
        if words == ["orders"]:
            return GoalPart(({"response": observation},), "show the orders")
        return None

    def query_of(self, texts) -> str:
        return " and then ".join(texts)

    def entities(self, state: dict) -> list[dict]:
        out = [{"type": "item", "name": k, "attributes": {"stock": v}}
               for k, v in state["stock"].items()]
        out += [{"type": "order", "name": k, "attributes": {"item": v[0], "qty": v[1],
                                                            "status": v[2]}}
                for k, v in state["orders"].items()]
        return out

    def tasks(self, split: str) -> list[Task]:
        check_split(split)
        return [t for t in _cached_tasks(self.num_worlds) if t.split == split]

    def candidate_actions(self) -> list[str]:
        free = [o for o in ORDER_IDS if o not in self.orders]
        reserved = [o for o, v in self.orders.items() if v[2] == "reserved"]
        out = ["stock", "orders"] + [f"stock {i}" for i in self.stock]
        out += [f"reserve {o} {i} {q}" for o in free for i in self.stock
                for q in range(1, self.stock[i] + 1)]
        out += [f"{verb} {o}" for o in reserved for verb in ("cancel", "ship")]
        out += [f"restock {i} {q}" for i in self.stock for q in range(1, 10)
                if self.stock[i] + q <= MAX_QTY]
        return out

    @classmethod
    def vocabulary(cls) -> list[str]:
        words = {t.name for t in TOOLS} | set(ITEMS) | set(ORDER_IDS) | set(_WORDS.split())
        words |= {str(n) for n in range(MAX_QTY + 1)}
        return sorted(words)


# --- the env's own tasks (hand-written templates) ------------------------------------------------


def _pick(rng, options):
    options = list(options)
    return rng.choice(options) if options else None


def _new_id(rng, world):
    return rng.choice([o for o in ORDER_IDS if o not in world["orders"]])


def _t_reserve(rng, w):
    item = rng.choice(list(w["stock"]))
    order, qty = _new_id(rng, w), rng.randint(1, w["stock"][item])
    return (f"reserve {qty} {item} for order {order}", [f"reserve {order} {item} {qty}"],
            [{"order": [order, item, qty, "reserved"]}])


def _t_reserve_ship(rng, w):
    item = rng.choice(list(w["stock"]))
    order, qty = _new_id(rng, w), rng.randint(1, w["stock"][item])
    return (f"reserve {qty} {item} for order {order} and then ship order {order}",
            [f"reserve {order} {item} {qty}", f"ship {order}"],
            [{"order": [order, item, qty, "shipped"]}])


def _t_cancel(rng, w):
    order = _pick(rng, [o for o, v in w["orders"].items() if v[2] == "reserved"])
    if order is None:
        return None
    return f"cancel order {order}", [f"cancel {order}"], [{"no_order": order}]


def _t_ship(rng, w):
    order = _pick(rng, [o for o, v in w["orders"].items() if v[2] == "reserved"])
    if order is None:
        return None
    item, qty, _ = w["orders"][order]
    return f"ship order {order}", [f"ship {order}"], [{"order": [order, item, qty, "shipped"]}]


def _t_restock(rng, w):
    item = rng.choice(list(w["stock"]))
    n = w["stock"][item] + rng.randint(4, 9)
    return (f"make the stock of {item} {n}", [f"restock {item} {n - w['stock'][item]}"],
            [{"stock": [item, n]}])


def _t_reserve_more_than_stock(rng, w):
    """More than the shop holds: restock first (a quantity above 3 in both calls)."""
    item = rng.choice(list(w["stock"]))
    order, qty = _new_id(rng, w), w["stock"][item] + rng.randint(1, 5)
    add = qty - w["stock"][item]
    return (f"reserve {qty} {item} for order {order}",
            [f"restock {item} {add}", f"reserve {order} {item} {qty}"],
            [{"order": [order, item, qty, "reserved"]}])


def _t_reserve_cancel(rng, w):
    """Leaves the shop as it was: only events can say it."""
    item = rng.choice(list(w["stock"]))
    order, qty = _new_id(rng, w), rng.randint(1, w["stock"][item])
    reserve = f"reserve {order} {item} {qty}"
    return (f"reserve {qty} {item} for order {order} and then cancel order {order}",
            [reserve, f"cancel {order}"],
            [{"event": reserve}, {"event": f"cancel {order}"}])


def _t_show_stock(rng, w):
    item = rng.choice(list(w["stock"]))
    return (f"show the stock of {item}", [f"stock {item}"],
            [{"response": f"stock : {item} {w['stock'][item]}"}])


TEMPLATES = {
    "reserve": _t_reserve,
    "reserve_ship": _t_reserve_ship,
    "cancel": _t_cancel,
    "ship": _t_ship,
    "restock": _t_restock,
    "reserve_more": _t_reserve_more_than_stock,
    "reserve_cancel": _t_reserve_cancel,
    "show_stock": _t_show_stock,
}


@functools.lru_cache(maxsize=4)
def _cached_tasks(num_worlds: int) -> tuple[Task, ...]:
    return tuple(build_tasks(num_worlds))


def build_tasks(num_worlds: int = NUM_WORLDS) -> list[Task]:
    """Every template over worlds ``0 .. num_worlds-1``; whole worlds are held out for
    validation and test (:func:`~environments.base.world_split`)."""
    tasks = []
    for seed in range(num_worlds):
        world = make_world(seed)
        for name, template in TEMPLATES.items():
            rng = random.Random(zlib.crc32(f"{seed}/{name}".encode()))
            made = template(rng, world)
            if made is None:
                continue
            query, reference, conditions = made
            tasks.append(Task(
                task_id=f"shop/{seed:04d}/{name}", env="shop", query=query, seed=seed,
                goal={"all": conditions}, reference=reference, source="original",
                split=world_split(seed),
                difficulty=float(len(reference)), meta={"template": name, "category": name}))
    return tasks
