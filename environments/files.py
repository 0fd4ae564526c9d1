"""``files``: the built-in environment, a small seeded file system driven by shell-like tools.

A world is a tree of folders and short text files generated from ``Task.seed``. Every name,
content word and message comes from fixed word lists, so the whole env speaks a closed
vocabulary of a couple of hundred words that a word-level tokenizer can fit. Names are one path
component (``docs``, ``report.txt``, ``..`` or ``/``): no slashes inside words, so the
vocabulary stays small and multi-folder tasks need real multi-step plans.

State (``state()``): ``{"cwd": [folder, ...], "tree": {name: subtree-dict | content-str}}``.
Goal (``Task.goal``): ``{"all": [condition, ...]}`` with conditions
``{"file": path, "content": str?}``, ``{"folder": path}``, ``{"absent": path}``,
``{"cwd": path}``, paths being lists of names from the root, and ``{"response": text}`` (a
successful call this episode answered exactly ``text``: tasks answered by reading).
"""

from __future__ import annotations

import copy
import functools
import random
import zlib

from environments import files_language as language
from environments.base import (
    ArgSpec,
    Environment,
    GoalPart,
    ToolCall,
    ToolError,
    ToolSpec,
    check_split,
    register_env,
    verify_reference,
    world_split,
)
from protocol.messages import Task

__all__ = ["FilesEnv", "goal_holds", "make_world", "build_tasks", "verify_reference"]

FOLDER_NAMES = tuple(
    "docs src data logs music photos work games mail backup archive projects".split()
)
_STEMS = tuple("report draft plan todo ideas budget recipe poem letter list diary story".split())
FILE_NAMES = tuple(f"{s}.{e}" for s in _STEMS for e in ("txt", "md"))  # a file name has a dot
CONTENT_WORDS = tuple(
    "apple river cloud stone green blue tiger lemon storm paper light quiet north "
    "sugar glass winter forest coffee silver rocket".split()
)
UP, ROOT = "..", "/"
MAX_LIST = 30  # entries/words shown by ls, cat and grep before "..."
NUM_WORLDS = 50  # 30 train, 10 validation, 10 test worlds under hold-out by world
EXPLORE_WORLDS = 200  # the seeds whose training worlds explore visits (120 of them)
HOLDOUTS = ("world", "task")

TOOLS = (
    ToolSpec(
        "ls",
        "list the folder here or a named folder",
        (ArgSpec("folder", "str", "folder to list", required=False),),
    ),
    ToolSpec(
        "cd",
        "go into a folder , .. for the parent or / for the root",
        (ArgSpec("folder", "str", "folder to go to"),),
    ),
    ToolSpec("pwd", "show the current path"),
    ToolSpec(
        "cat",
        "show the words of a file",
        (
            ArgSpec("file", "str", "file to show"),
            ArgSpec("start", "int", "first word to show", required=False),
        ),
    ),
    ToolSpec(
        "mv",
        "move src into folder dst , or rename it to dst",
        (ArgSpec("src", "str", "file or folder here"), ArgSpec("dst", "str", "folder or new name")),
    ),
    ToolSpec(
        "cp",
        "copy file src into folder dst , or to new name dst",
        (ArgSpec("src", "str", "file here"), ArgSpec("dst", "str", "folder or new name")),
    ),
    ToolSpec(
        "rm", "remove a file or an empty folder", (ArgSpec("name", "str", "file or folder here"),)
    ),
    ToolSpec("mkdir", "create a new folder", (ArgSpec("name", "str", "new folder name"),)),
    ToolSpec("touch", "create an empty file", (ArgSpec("name", "str", "new file name"),)),
    ToolSpec(
        "grep",
        "list files that contain a word , here or in a folder",
        (
            ArgSpec("word", "str", "word to find"),
            ArgSpec("folder", "str", "folder to search", required=False),
        ),
    ),
)

# Words of queries and observations that no list above supplies.
_QUERY_WORDS = (
    "move into from root copy rename to delete every file in containing create folder "
    "and it go everything"
)
_OBS_WORDS = (
    "ok error : path contents ( empty ) no match moved renamed copied removed created touched "
    "into to folder file ... unknown tool bad syntax name argument action is not text too long "
    "characters usage such or a already exists not must be more start src and dst are the same"
)


# --- worlds -----------------------------------------------------------------------------------


def make_world(seed: int) -> dict:
    """The initial tree for ``seed``: 3-4 folders (1-2 with a subfolder), 2-3 top-level files.

    Every name is used once per world so that a query naming a file or folder is unambiguous.
    """
    rng = random.Random(seed)
    n_top, n_sub = rng.randint(3, 4), rng.randint(1, 2)
    folders = rng.sample(FOLDER_NAMES, n_top + n_sub)
    file_names = iter(rng.sample(FILE_NAMES, len(FILE_NAMES)))

    def fill(folder: dict, count: int):
        for _ in range(count):
            folder[next(file_names)] = " ".join(rng.sample(CONTENT_WORDS, rng.randint(3, 6)))

    tree: dict = {}
    fill(tree, rng.randint(2, 3))
    for name in folders[:n_top]:
        tree[name] = {}
        fill(tree[name], rng.randint(1, 3))
    for name in folders[n_top:]:
        parent = tree[rng.choice(folders[:n_top])]
        parent[name] = {}
        fill(parent[name], rng.randint(1, 2))
    return tree


def _node(tree: dict, path) -> dict | str | None:
    node = tree
    for name in path:
        if not isinstance(node, dict) or not isinstance(name, str) or name not in node:
            return None
        node = node[name]
    return node


def _files(folder: dict) -> list[str]:
    return sorted(n for n, v in folder.items() if isinstance(v, str))


def _folders(folder: dict) -> list[str]:
    return sorted(n for n, v in folder.items() if isinstance(v, dict))


# --- goals ------------------------------------------------------------------------------------


def goal_holds(state: dict, goal: dict, responses=()) -> bool:
    """Whether every condition of ``goal`` holds in ``state`` (and ``responses``, the answers of
    this episode's successful calls); a malformed goal never holds."""
    conds = goal.get("all") if isinstance(goal, dict) else None
    if not isinstance(conds, list) or not conds:
        return False
    return all(_condition_holds(state, c, responses) for c in conds)


def _condition_holds(state: dict, cond, responses=()) -> bool:
    if not isinstance(cond, dict) or len(cond) not in (1, 2):
        return False
    if "response" in cond:
        text = cond["response"]
        return len(cond) == 1 and isinstance(text, str) and text in responses
    # Goals may come from synthesized tasks: a path that is not a list of names never matches.
    if not all(isinstance(p, (list, tuple)) for k, p in cond.items() if k != "content"):
        return False
    tree = state.get("tree", {})
    if "file" in cond:
        node = _node(tree, cond["file"])
        return isinstance(node, str) and cond.get("content", node) == node
    if "folder" in cond:
        return isinstance(_node(tree, cond["folder"]), dict)
    if "absent" in cond:
        return _node(tree, cond["absent"]) is None
    if "cwd" in cond:
        return list(state.get("cwd", [])) == list(cond["cwd"])
    return False


def _diff_conditions(before, after, path: list) -> list[dict]:
    """Conditions that pin every path where ``after`` differs from ``before``."""
    if before == after:
        return []
    if isinstance(after, dict) and isinstance(before, dict):
        out = []
        for name in sorted(set(before) | set(after)):
            if name not in after:
                out.append({"absent": path + [name]})
            elif name not in before:
                out += _describe(after[name], path + [name])
            else:
                out += _diff_conditions(before[name], after[name], path + [name])
        return out
    return _describe(after, path)


def _describe(node, path: list) -> list[dict]:
    if isinstance(node, str):
        return [{"file": path, "content": node}]
    out = [{"folder": path}]
    for name in sorted(node):
        out += _describe(node[name], path + [name])
    return out


# --- the environment --------------------------------------------------------------------------


@register_env("files")
class FilesEnv(Environment):
    """A seeded file system with ``ls cd pwd cat mv cp rm mkdir touch grep``.

    ``num_worlds`` sets how many seeds the built-in tasks are drawn from; any integer seed is a
    valid world for synthetic tasks. ``explore_worlds`` declares the training worlds among the
    first that many seeds as ``train_worlds``, so that self-questioning also makes tasks in
    worlds no built-in task uses (0: only the built-in training tasks' worlds; the default
    200 gives the 120 the re-grounded examples of the default run go to).
    """

    # what a client of the served env may choose: tasks() builds every world up to num_worlds
    # (200 take 0.4 s once), so a larger one is the server's to set (--set env.options...)
    client_options = {"num_worlds": range(1, 201), "holdout": HOLDOUTS}

    def __init__(self, num_worlds: int = NUM_WORLDS, holdout: str = "world",
                 explore_worlds: int = EXPLORE_WORLDS):
        super().__init__()
        self.num_worlds = num_worlds
        self.holdout = holdout
        if explore_worlds:
            self.train_worlds = training_worlds(explore_worlds, num_worlds, holdout)
        self.tree: dict = {}
        self.cwd: list[str] = []

    # -- episode --

    def reset(self, task: Task) -> str:
        if task.env != self.name:
            raise ValueError(f"task {task.task_id!r} is for env {task.env!r}, not {self.name!r}")
        self.task = task
        self.tree = make_world(task.seed)
        self.cwd = []
        self.responses = []
        return f"path : {self._path_words()} contents : {self._listing(self.tree)}"

    def execute(self, call: ToolCall) -> str:
        return getattr(self, f"_tool_{call.tool}")(*call.args)

    def tools(self) -> list[ToolSpec]:
        return list(TOOLS)

    def state(self) -> dict:
        return {"cwd": list(self.cwd), "tree": copy.deepcopy(self.tree)}

    def evaluate(self, task: Task) -> float:
        return 1.0 if goal_holds(self.state(), task.goal, self.responses) else 0.0

    def goal_progress(self, task: Task) -> float:
        """The fraction of the goal's ``all`` conditions that hold; 0.0 for a malformed goal
        (as :func:`goal_holds` never holds one)."""
        conds = task.goal.get("all") if isinstance(task.goal, dict) else None
        if not isinstance(conds, list) or not conds:
            return 0.0
        state = self.state()
        return sum(_condition_holds(state, c, self.responses) for c in conds) / len(conds)

    def goal_from_states(self, before: dict, after: dict) -> dict:
        conds = _diff_conditions(before.get("tree", {}), after.get("tree", {}), [])
        if not conds and before.get("cwd") != after.get("cwd"):
            conds = [{"cwd": list(after.get("cwd", []))}]
        return {"all": conds}

    def describe_changes(self, before: dict, after: dict) -> list[GoalPart]:
        return language.describe_changes(before, after)

    def describe_response(self, action: str, observation: str, before: dict) -> GoalPart | None:
        return language.describe_response(action, observation, before, self.tools())

    def entities(self, state: dict) -> list[dict]:
        return language.entities(state)

    def tasks(self, split: str) -> list[Task]:
        check_split(split)
        return [t for t in _cached_tasks(self.num_worlds, self.holdout) if t.split == split]

    @classmethod
    def vocabulary(cls) -> list[str]:
        words = set(FOLDER_NAMES) | {f + "/" for f in FOLDER_NAMES} | set(FILE_NAMES)
        words |= set(CONTENT_WORDS) | {UP, ROOT} | {str(i) for i in range(10)}
        words |= set(_QUERY_WORDS.split()) | set(_OBS_WORDS.split())
        for tool in TOOLS:  # prompts may show the tool list and usages
            words |= set(tool.usage().split()) | set(tool.description.split())
            for arg in tool.args:
                words |= set(arg.description.split())
        return sorted(words)

    def candidate_actions(self) -> list[str]:
        """Every well-formed call on what is here; new names only among those unused anywhere."""
        here = self._here()
        files, folders = _files(here), _folders(here)
        ups = ([UP] + ([ROOT] if len(self.cwd) > 1 else [])) if self.cwd else []
        acts = ["ls", "pwd"] + [f"ls {d}" for d in folders + ups]
        acts += [f"cd {d}" for d in folders + ups]
        acts += [f"cat {f}" for f in files]
        acts += [f"grep {w}" for w in sorted({w for f in files for w in here[f].split()})]
        acts += [f"rm {n}" for n in files + folders]
        # New names are offered only where unused in the whole world: that keeps the list to a
        # few hundred and names unique, as in the built-in tasks (their queries rely on it).
        used = set(_all_names(self.tree))
        new_files = [n for n in FILE_NAMES if n not in used]
        new_folders = [n for n in FOLDER_NAMES if n not in used]
        acts += [f"mkdir {n}" for n in new_folders] + [f"touch {n}" for n in new_files]
        for f in files:
            for tool in ("mv", "cp"):
                acts += [f"{tool} {f} {d}" for d in folders + ups + new_files]
        for f in folders:
            acts += [f"mv {f} {d}" for d in [d for d in folders if d != f] + ups + new_folders]
        return acts

    # -- helpers --

    def _here(self) -> dict:
        return _node(self.tree, self.cwd)

    def _path_words(self, path=None) -> str:
        path = self.cwd if path is None else path
        return " ".join([ROOT] + list(path))

    @staticmethod
    def _listing(folder: dict) -> str:
        names = [f + "/" for f in _folders(folder)] + _files(folder)
        return _clip(names) or "( empty )"

    def _target_folder(self, name: str) -> list[str]:
        """The path a folder argument names: ``..``, ``/`` or a folder in the current one."""
        if name == UP:
            return self.cwd[:-1]
        if name == ROOT:
            return []
        kind = _check_name(name)
        node = self._here().get(name)
        if node is None:
            raise ToolError("no_such_folder", f"error : no such folder {name}")
        if kind != "folder":
            raise ToolError("not_a_folder", f"error : {name} is not a folder")
        return self.cwd + [name]

    def _entry(self, name: str, want: str | None = None):
        """The file or folder ``name`` in the current folder, optionally of kind ``want``."""
        kind = _check_name(name)
        if name not in self._here():
            raise ToolError("no_such_entry", f"error : no such {want or kind} {name}")
        node = self._here()[name]
        if want == "file" and not isinstance(node, str):
            raise ToolError("is_a_folder", f"error : {name} is a folder")
        return node

    # -- tools: each returns an observation or raises ToolError --

    def _tool_ls(self, folder: str | None = None) -> str:
        path = self.cwd if folder is None else self._target_folder(folder)
        return self._listing(_node(self.tree, path))

    def _tool_cd(self, folder: str) -> str:
        self.cwd = self._target_folder(folder)
        return f"ok path : {self._path_words()}"

    def _tool_pwd(self) -> str:
        return f"path : {self._path_words()}"

    def _tool_cat(self, file: str, start: int = 0) -> str:
        text = self._entry(file, "file")
        if start < 0:
            raise ToolError("bad_argument", "error : start must be 0 or more")
        return _clip(text.split()[start:]) or "( empty )"

    def _tool_mv(self, src: str, dst: str) -> str:
        node = self._entry(src)
        if dst == src:
            raise ToolError("same_name", "error : src and dst are the same")
        target = self._move_target(dst, node)
        if target is None:  # rename in place
            del self._here()[src]
            self._here()[dst] = node
            return f"ok renamed {src} to {dst}"
        folder = _node(self.tree, target)
        _check_free(folder, src)
        del self._here()[src]
        folder[src] = node
        return f"ok moved {src} into {_folder_word(target)}"

    def _tool_cp(self, src: str, dst: str) -> str:
        text = self._entry(src, "file")
        target = self._move_target(dst, text)
        if target is None:
            self._here()[dst] = text
            return f"ok copied {src} to {dst}"
        folder = _node(self.tree, target)
        _check_free(folder, src)
        folder[src] = text
        return f"ok copied {src} into {_folder_word(target)}"

    def _move_target(self, dst: str, node) -> list[str] | None:
        """The folder path ``dst`` names, or None when ``dst`` is a new name for ``node``."""
        if dst in (UP, ROOT) or isinstance(self._here().get(dst), dict):
            return self._target_folder(dst)
        kind = "file" if isinstance(node, str) else "folder"
        _check_free(self._here(), dst)
        if _check_name(dst) != kind:
            # Keeps names honest: files have an extension, folders never do.
            raise ToolError("bad_name", f"error : {dst} is not a {kind} name")
        return None

    def _tool_rm(self, name: str) -> str:
        node = self._entry(name)
        if isinstance(node, dict) and node:
            raise ToolError("not_empty", f"error : folder {name} is not empty")
        del self._here()[name]
        return f"ok removed {name}"

    def _tool_mkdir(self, name: str) -> str:
        if _check_name(name) != "folder":
            raise ToolError("bad_name", f"error : {name} is not a folder name")
        _check_free(self._here(), name)
        self._here()[name] = {}
        return f"ok created folder {name}"

    def _tool_touch(self, name: str) -> str:
        if _check_name(name) != "file":
            raise ToolError("bad_name", f"error : {name} is not a file name")
        node = self._here().get(name)
        if isinstance(node, dict):
            raise ToolError("is_a_folder", f"error : {name} is a folder")
        if node is None:
            self._here()[name] = ""
            return f"ok created file {name}"
        return f"ok touched {name}"

    def _tool_grep(self, word: str, folder: str | None = None) -> str:
        path = self.cwd if folder is None else self._target_folder(folder)
        node = _node(self.tree, path)
        hits = [f for f in _files(node) if word in node[f].split()]
        return _clip(hits) or "( no match )"


def _check_name(name: str) -> str:
    """``"file"`` or ``"folder"``; any other word is refused without being echoed back."""
    if name in FILE_NAMES:
        return "file"
    if name in FOLDER_NAMES:
        return "folder"
    raise ToolError("bad_name", "error : bad name")


def _check_free(folder: dict, name: str):
    if name in folder:
        raise ToolError("exists", f"error : {name} already exists")


def _folder_word(path: list[str]) -> str:
    return path[-1] if path else "root"


def _clip(words: list[str]) -> str:
    return " ".join(words if len(words) <= MAX_LIST else words[:MAX_LIST] + ["..."])


# --- built-in tasks ---------------------------------------------------------------------------


class _World:
    """Read-only view of a fresh world for the task templates, with a seeded rng."""

    def __init__(self, seed: int, rng: random.Random):
        self.seed, self.rng, self.tree = seed, rng, make_world(seed)
        self.used = set(_all_names(self.tree))

    def top_files(self) -> list[str]:
        return _files(self.tree)

    def top_folders(self) -> list[str]:
        return _folders(self.tree)

    def files_in(self, *path) -> list[str]:
        return _files(_node(self.tree, path))

    def subs_in(self, *path) -> list[str]:
        return _folders(_node(self.tree, path))

    def content(self, *path) -> str:
        return _node(self.tree, path)

    def pick(self, options):
        options = list(options)
        return self.rng.choice(options) if options else None

    def new_file(self) -> str:
        return self.rng.choice([n for n in FILE_NAMES if n not in self.used])

    def new_folder(self) -> str:
        return self.rng.choice([n for n in FOLDER_NAMES if n not in self.used])

    def folder_with(self, need_files: int = 1, need_subs: int = 0):
        """A top-level folder with enough files and subfolders, or None."""
        return self.pick(
            f
            for f in self.top_folders()
            if len(self.files_in(f)) >= need_files and len(self.subs_in(f)) >= need_subs
        )


def _all_names(tree: dict):
    for name, node in tree.items():
        yield name
        if isinstance(node, dict):
            yield from _all_names(node)


def _has(w: _World, *path) -> dict:
    return {"file": list(path), "content": w.content(*path)}


def _moved(w: _World, src: list, dst: list) -> list[dict]:
    return [{"absent": src}, {"file": dst, "content": w.content(*src)}]


# Each template returns (query, reference, goal conditions) for one world, or None when the
# world lacks what it needs. Goals are written by hand, independently of the reference, so that
# replaying the reference is a real check.


def _t_move_into(w):
    x, f = w.pick(w.top_files()), w.pick(w.top_folders())
    return f"move {x} into {f}", [f"mv {x} {f}"], _moved(w, [x], [f, x])


def _t_copy_into(w):
    x, f = w.pick(w.top_files()), w.pick(w.top_folders())
    return (
        f"copy {x} into {f}",
        [f"cp {x} {f}"],
        [_has(w, x), {"file": [f, x], "content": w.content(x)}],
    )


def _t_rename(w):
    x, z = w.pick(w.top_files()), w.new_file()
    return f"rename {x} to {z}", [f"mv {x} {z}"], _moved(w, [x], [z])


def _t_duplicate(w):
    x, z = w.pick(w.top_files()), w.new_file()
    return f"copy {x} to {z}", [f"cp {x} {z}"], [_has(w, x), {"file": [z], "content": w.content(x)}]


def _t_delete(w):
    x = w.pick(w.top_files())
    keep = [_has(w, o) for o in w.top_files() if o != x]
    return f"delete {x}", [f"rm {x}"], [{"absent": [x]}] + keep


def _t_touch(w):
    z = w.new_file()
    return f"create file {z} in root", [f"touch {z}"], [{"file": [z], "content": ""}]


def _t_go_top(w):
    f = w.pick(w.top_folders())
    return f"go to folder {f}", [f"cd {f}"], [{"cwd": [f]}]


def _t_move_out(w):
    f = w.folder_with()
    x = w.pick(w.files_in(f))
    return f"move {x} from {f} into root", [f"cd {f}", f"mv {x} .."], _moved(w, [f, x], [x])


def _t_move_down(w):
    f = w.folder_with(need_subs=1)
    if f is None:
        return None
    x, s = w.pick(w.files_in(f)), w.pick(w.subs_in(f))
    return f"move {x} from {f} into {s}", [f"cd {f}", f"mv {x} {s}"], _moved(w, [f, x], [f, s, x])


def _t_copy_out(w):
    f = w.folder_with()
    x = w.pick(w.files_in(f))
    return (
        f"copy {x} from {f} into root",
        [f"cd {f}", f"cp {x} .."],
        [_has(w, f, x), {"file": [x], "content": w.content(f, x)}],
    )


def _t_rename_in(w):
    f = w.folder_with()
    x, z = w.pick(w.files_in(f)), w.new_file()
    return f"rename {x} in {f} to {z}", [f"cd {f}", f"mv {x} {z}"], _moved(w, [f, x], [f, z])


def _t_delete_in(w):
    f = w.folder_with()
    x = w.pick(w.files_in(f))
    keep = [_has(w, f, o) for o in w.files_in(f) if o != x]
    return f"delete {x} from {f}", [f"cd {f}", f"rm {x}"], [{"absent": [f, x]}] + keep


def _t_mkdir_move(w):
    x, z = w.pick(w.top_files()), w.new_folder()
    return (
        f"create folder {z} and move {x} into it",
        [f"mkdir {z}", f"mv {x} {z}"],
        [{"folder": [z]}] + _moved(w, [x], [z, x]),
    )


def _t_mkdir_in(w):
    f, z = w.pick(w.top_folders()), w.new_folder()
    return f"create folder {z} in {f}", [f"cd {f}", f"mkdir {z}"], [{"folder": [f, z]}]


def _t_touch_in(w):
    f, z = w.pick(w.top_folders()), w.new_file()
    return f"create file {z} in {f}", [f"cd {f}", f"touch {z}"], [{"file": [f, z], "content": ""}]


def _t_go_sub(w):
    f = w.folder_with(need_files=0, need_subs=1)
    s = w.pick(w.subs_in(f))
    return f"go to folder {s} in {f}", [f"cd {f}", f"cd {s}"], [{"cwd": [f, s]}]


def _t_gather(w):
    x, y = sorted(w.rng.sample(w.top_files(), 2))
    f = w.pick(w.top_folders())
    return (
        f"move {x} and {y} into {f}",
        [f"mv {x} {f}", f"mv {y} {f}"],
        _moved(w, [x], [f, x]) + _moved(w, [y], [f, y]),
    )


def _t_backup(w):
    x, y = sorted(w.rng.sample(w.top_files(), 2))
    z = w.new_folder()
    goal = [{"folder": [z]}, _has(w, x), _has(w, y)]
    goal += [{"file": [z, x], "content": w.content(x)}, {"file": [z, y], "content": w.content(y)}]
    return (
        f"create folder {z} and copy {x} and {y} into it",
        [f"mkdir {z}", f"cp {x} {z}", f"cp {y} {z}"],
        goal,
    )


def _t_move_up_sub(w):
    f = w.pick(f for f in w.top_folders() if any(w.files_in(f, s) for s in w.subs_in(f)))
    if f is None:
        return None
    s = w.pick(s for s in w.subs_in(f) if w.files_in(f, s))
    x = w.pick(w.files_in(f, s))
    return (
        f"move {x} from {s} into {f}",
        [f"cd {f}", f"cd {s}", f"mv {x} .."],
        _moved(w, [f, s, x], [f, x]),
    )


def _t_mkdir_in_move(w):
    f = w.folder_with()
    x, z = w.pick(w.files_in(f)), w.new_folder()
    return (
        f"create folder {z} in {f} and move {x} into it",
        [f"cd {f}", f"mkdir {z}", f"mv {x} {z}"],
        [{"folder": [f, z]}] + _moved(w, [f, x], [f, z, x]),
    )


def _t_move_across(w):
    f = w.folder_with()
    g = w.pick(o for o in w.top_folders() if o != f)
    x = w.pick(w.files_in(f))
    ref = [f"cd {f}", f"mv {x} ..", "cd ..", f"mv {x} {g}"]
    return f"move {x} from {f} into {g}", ref, _moved(w, [f, x], [g, x])


def _t_copy_across(w):
    f = w.folder_with()
    g = w.pick(o for o in w.top_folders() if o != f)
    x = w.pick(w.files_in(f))
    ref = [f"cd {f}", f"cp {x} ..", "cd ..", f"mv {x} {g}"]
    return (
        f"copy {x} from {f} into {g}",
        ref,
        [_has(w, f, x), {"file": [g, x], "content": w.content(f, x)}, {"absent": [x]}],
    )


def _t_remove_folder(w):
    f = w.pick(f for f in w.top_folders() if not w.subs_in(f) and len(w.files_in(f)) <= 2)
    if f is None:
        return None
    ref = [f"cd {f}"] + [f"rm {x}" for x in w.files_in(f)] + ["cd ..", f"rm {f}"]
    return f"delete folder {f} and everything in it", ref, [{"absent": [f]}]


def _t_delete_word(w):
    """Delete the files of one folder that contain a word, keeping at least one other file."""
    options = []
    for path in [[]] + [[f] for f in w.top_folders()]:
        files = w.files_in(*path)
        for word in CONTENT_WORDS:
            hits = [x for x in files if word in w.content(*path, x).split()]
            if 0 < len(hits) < len(files):
                options.append((path, word, hits, [x for x in files if x not in hits]))
    if not options:
        return None
    path, word, hits, keep = w.pick(options)
    where = path[0] if path else "root"
    ref = [f"cd {p}" for p in path] + [f"rm {x}" for x in hits]
    goal = [{"absent": path + [x]} for x in hits] + [_has(w, *path, x) for x in keep]
    return f"delete every file in {where} containing {word}", ref, goal


# Ordered by reference length; the order fixes each template's rng stream, so append only.
TEMPLATES = {
    "move_into": _t_move_into,
    "copy_into": _t_copy_into,
    "rename": _t_rename,
    "duplicate": _t_duplicate,
    "delete": _t_delete,
    "touch": _t_touch,
    "go_top": _t_go_top,
    "move_out": _t_move_out,
    "move_down": _t_move_down,
    "copy_out": _t_copy_out,
    "rename_in": _t_rename_in,
    "delete_in": _t_delete_in,
    "mkdir_move": _t_mkdir_move,
    "mkdir_in": _t_mkdir_in,
    "touch_in": _t_touch_in,
    "go_sub": _t_go_sub,
    "gather": _t_gather,
    "backup": _t_backup,
    "move_up_sub": _t_move_up_sub,
    "mkdir_in_move": _t_mkdir_in_move,
    "move_across": _t_move_across,
    "copy_across": _t_copy_across,
    "remove_folder": _t_remove_folder,
    "delete_word": _t_delete_word,
}


def _split_of(seed: int, task_id: str, holdout: str) -> str:
    if holdout == "world":
        return world_split(seed)
    # "task": a stable sample of tasks, their worlds shared with training tasks (kept to show
    # what held-out tasks in seen worlds measure; decontamination matters most here)
    return world_split(zlib.crc32(task_id.encode()))


def training_worlds(up_to: int, num_worlds: int = NUM_WORLDS,
                    holdout: str = "world") -> tuple[int, ...]:
    """The seeds below ``up_to`` no held-out task can use: the training worlds of
    :func:`~environments.base.world_split` under hold-out by world; under hold-out by task,
    the worlds past the built-in tasks' ``num_worlds``."""
    if not isinstance(up_to, int) or up_to < 0:
        raise ValueError(f"explore_worlds must be a whole number of seeds >= 0, not {up_to!r}")
    if holdout == "world":
        return tuple(s for s in range(up_to) if world_split(s) == "train")
    return tuple(range(num_worlds, up_to))


@functools.lru_cache(maxsize=8)
def _cached_tasks(num_worlds: int, holdout: str) -> tuple[Task, ...]:
    return tuple(build_tasks(num_worlds, holdout))


def build_tasks(num_worlds: int = NUM_WORLDS, holdout: str = "world") -> list[Task]:
    """Every template over worlds ``0 .. num_worlds-1``, in a fixed order with stable ids.

    ``holdout="world"``: validation and test tasks live in worlds no training task uses
    (:func:`~environments.base.world_split` of the seed); ``holdout="task"``: the same shares
    of tasks, drawn by a stable hash of the id, in the worlds of the training tasks.
    """
    if holdout not in HOLDOUTS:
        raise ValueError(f"holdout must be one of {', '.join(HOLDOUTS)}, not {holdout!r}")
    tasks = []
    for seed in range(num_worlds):
        for index, (name, template) in enumerate(TEMPLATES.items()):
            # One rng per (world, template): adding a template never changes the others.
            made = template(_World(seed, random.Random(seed * 1000 + index)))
            if made is None:
                continue
            query, reference, conditions = made
            task_id = f"files/{seed:04d}/{name}"
            split = _split_of(seed, task_id, holdout)
            tasks.append(
                Task(
                    task_id=task_id,
                    env="files",
                    query=query,
                    seed=seed,
                    goal={"all": conditions},
                    reference=reference,
                    source="original",
                    split=split,
                    difficulty=float(len(reference)),
                    meta={"template": name},
                )
            )
    return tasks
