"""How the ``files`` env names its own changes: the words hindsight task synthesis uses.

An exploration leaves a state difference (files moved, copied, created, removed; folders made
or deleted; a new working folder). :func:`describe_changes` splits that difference into parts,
each with the goal conditions that pin it and a phrase in the env's closed vocabulary that reads
like the built-in task queries ("move report.txt from docs into work"), so tasks an agent writes
for itself train the same skills the env's own tasks test. :func:`describe_response` does the
same for read-only calls (a task answered by reading: the goal is the observation).
"""

from __future__ import annotations

from collections.abc import Sequence

from environments.base import ActionError, GoalPart, ToolSpec, parse_action

ROOT_WORD = "root"


def describe_changes(before: dict, after: dict) -> list[GoalPart]:
    """One part per change from ``before`` to ``after`` (see the module docstring)."""
    diff = _Diff(before.get("tree", {}), after.get("tree", {}))
    parts = diff.folder_moves() + diff.folder_removals() + diff.folder_creations()
    parts += diff.file_changes()
    if list(before.get("cwd", [])) != list(after.get("cwd", [])):
        cwd = list(after.get("cwd", []))
        parts.append(GoalPart(({"cwd": cwd},), _go_text(cwd), tuple(cwd)))
    return parts


def describe_response(action: str, observation: str, before: dict,
                      tools: Sequence[ToolSpec]) -> GoalPart | None:
    """A part asking for the answer of a successful ``ls``, ``cat``, ``grep`` or ``pwd``."""
    try:
        call = parse_action(action, tools)
    except ActionError:
        return None
    cwd = list(before.get("cwd", []))
    here = _where(cwd)
    args = call.args
    cond = ({"response": observation},)
    if call.tool == "cat" and args[1:] in ((), (0,)):
        text = f"show the words of {args[0]}" + (f" in {here}" if cwd else "")
        return GoalPart(cond, text, (args[0], here))
    if call.tool == "ls":
        folder = _named_folder(cwd, args[0] if args else None)
        return GoalPart(cond, f"list the folder {folder}", (folder,))
    if call.tool == "grep":
        folder = _named_folder(cwd, args[1] if len(args) > 1 else None)
        return GoalPart(cond, f"list files that contain {args[0]} in {folder}",
                        (args[0], folder))
    if call.tool == "pwd":
        text = "show the current path" if not cwd else f"{_go_text(cwd)} and show the current path"
        return GoalPart(cond, text, tuple(cwd))
    return None


def entities(state: dict) -> list[dict]:
    """Files, folders and content words of ``state``, with attributes a profile can show."""
    out, words = [], set()
    files, folders = _flatten(state.get("tree", {}))
    for path in sorted(folders):
        inside = [p for p in list(files) + list(folders) if p[:-1] == path]
        out.append({"type": "folder", "name": path[-1],
                    "attributes": {"parent": _where(path[:-1]), "entries": str(len(inside))}})
    for path, content in sorted(files.items()):
        words.update(content.split())
        out.append({"type": "file", "name": path[-1],
                    "attributes": {"folder": _where(path[:-1]),
                                   "extension": path[-1].rsplit(".", 1)[-1],
                                   "words": str(len(content.split()))}})
    out += [{"type": "word", "name": w, "attributes": {}} for w in sorted(words)]
    return out


# --- the difference of two trees ----------------------------------------------------------------


def _flatten(tree: dict, path: tuple = ()) -> tuple[dict, set]:
    """({file path: content}, {folder path}) for every node under ``tree``."""
    files, folders = {}, set()
    for name, node in tree.items():
        here = path + (name,)
        if isinstance(node, dict):
            folders.add(here)
            sub_files, sub_folders = _flatten(node, here)
            files.update(sub_files)
            folders |= sub_folders
        else:
            files[here] = node
    return files, folders


def _under(path: tuple, root: tuple) -> bool:
    return path[:len(root)] == root


def _shallow_first(path: tuple) -> tuple:
    """Parents before children, then by name: sets of paths iterate in a per-process hash
    order, and ties broken by it made the parts (and the tasks) differ from run to run."""
    return len(path), path


def _where(path) -> str:
    return path[-1] if path else ROOT_WORD


def _go_text(cwd: list) -> str:
    if not cwd:
        return f"go to {ROOT_WORD}"
    return f"go to folder {cwd[-1]}" + (f" in {cwd[-2]}" if len(cwd) > 1 else "")


def _named_folder(cwd: list, arg: str | None) -> str:
    if arg is None:
        return _where(cwd)
    if arg == "..":
        return _where(cwd[:-1])
    return ROOT_WORD if arg == "/" else arg


class _Diff:
    """Files and folders removed from / added to a tree; each change consumes what it explains."""

    def __init__(self, before: dict, after: dict):
        self.before_tree, self.after_tree = before, after
        self.bf, bd = _flatten(before)
        self.af, ad = _flatten(after)
        self.removed_dirs, self.added_dirs = bd - ad, ad - bd
        self.removed = {p for p in self.bf if p not in self.af}
        self.added = {p for p in self.af if p not in self.bf}
        self.relocated: dict[tuple, tuple] = {}  # removed path -> where its folder moved

    def _subtree(self, tree: dict, path: tuple):
        node = tree
        for name in path:
            node = node[name]
        return node

    def _consume_under(self, removed_root: tuple | None, added_root: tuple | None) -> None:
        if removed_root is not None:
            self.removed = {p for p in self.removed if not _under(p, removed_root)}
            self.removed_dirs = {p for p in self.removed_dirs if not _under(p, removed_root)}
        if added_root is not None:
            self.added = {p for p in self.added if not _under(p, added_root)}
            self.added_dirs = {p for p in self.added_dirs if not _under(p, added_root)}

    def folder_moves(self) -> list[GoalPart]:
        """A removed folder and an added one with the same name (or the same parent and the same
        contents: a rename) are one move; what moved along unchanged is part of it."""
        parts = []
        for r in sorted(self.removed_dirs, key=_shallow_first):
            if r not in self.removed_dirs:
                continue
            node = self._subtree(self.before_tree, r)
            match = [q for q in sorted(self.added_dirs, key=_shallow_first)
                     if q[-1] == r[-1] or (q[:-1] == r[:-1]
                                           and self._subtree(self.after_tree, q) == node)]
            if not match:
                continue
            q = match[0]
            conds = [{"absent": list(r)}, {"folder": list(q)}]
            for p in sorted(d for d in self.bf if _under(d, r)):
                moved = q + p[len(r):]
                if self.af.get(moved) == self.bf[p] and moved in self.added and p in self.removed:
                    conds.append({"file": list(moved), "content": self.bf[p]})
                    self.removed.discard(p)
                    self.added.discard(moved)
                elif p in self.removed:  # gone from the moved folder: deleted at its new place
                    self.relocated[p] = moved
            for d in sorted(d for d in self.removed_dirs if _under(d, r)):
                if q + d[len(r):] in self.added_dirs:
                    self.removed_dirs.discard(d)
                    self.added_dirs.discard(q + d[len(r):])
            parts.append(GoalPart(tuple(conds), _relocation_text("move", r, q),
                                  (r[-1], q[-1], _where(q[:-1]))))
        return parts

    def folder_removals(self) -> list[GoalPart]:
        parts = []
        for r in sorted(self.removed_dirs, key=_shallow_first):
            if r not in self.removed_dirs:
                continue
            had = any(_under(p, r) and p != r for p in list(self.bf))
            text = f"delete folder {r[-1]}" + (f" from {r[-2]}" if len(r) > 1 else "")
            text += " and everything in it" if had else ""
            parts.append(GoalPart(({"absent": list(r)},), text, (r[-1],)))
            self._consume_under(r, None)
        return parts

    def folder_creations(self) -> list[GoalPart]:
        parts = []
        for q in sorted(self.added_dirs, key=_shallow_first):
            text = f"create folder {q[-1]} in {_where(q[:-1])}"
            parts.append(GoalPart(({"folder": list(q)},), text, (q[-1], _where(q[:-1]))))
        self.added_dirs = set()
        return parts

    def file_changes(self) -> list[GoalPart]:
        parts = []
        for q in sorted(self.added):
            content = self.af[q]
            src = self._best_source(q, [r for r in sorted(self.removed) if self.bf[r] == content])
            if src is not None:
                self.removed.discard(src)
                conds = ({"absent": list(src)}, {"file": list(q), "content": content})
                parts.append(GoalPart(conds, _relocation_text("move", src, q),
                                      _names(src, q)))
                continue
            kept = [p for p in sorted(self.bf)
                    if p in self.af and self.af[p] == self.bf[p] == content]
            src = self._best_source(q, kept)
            if src is not None and content:
                conds = ({"file": list(src), "content": content},
                         {"file": list(q), "content": content})
                parts.append(GoalPart(conds, _relocation_text("copy", src, q), _names(src, q)))
                continue
            cond = ({"file": list(q), "content": content},)
            text = f"create file {q[-1]} in {_where(q[:-1])}" if content == "" else None
            parts.append(GoalPart(cond, text, (q[-1], _where(q[:-1]))))
        for p in sorted(p for p in self.bf if p in self.af and self.af[p] != self.bf[p]):
            # Rewritten in place (removed and made again): no words say that plainly.
            parts.append(GoalPart(({"file": list(p), "content": self.af[p]},), None, (p[-1],)))
        for p, r in sorted((p, self.relocated.get(p, p)) for p in self.removed):
            text = f"delete {r[-1]}" + (f" from {r[-2]}" if len(r) > 1 else "")
            # Deleted from a folder that then moved: gone from where it was too, or the goal
            # would hold at the start (nothing was ever at the folder's new place).
            conds = ({"absent": list(r)},) if r == p else ({"absent": list(p)},
                                                           {"absent": list(r)})
            parts.append(GoalPart(conds, text, (r[-1], _where(r[:-1]))))
        return parts

    @staticmethod
    def _best_source(target: tuple, options: list[tuple]) -> tuple | None:
        """Prefer a source with the target's name, then one in the target's folder."""
        for good in (lambda p: p[-1] == target[-1], lambda p: p[:-1] == target[:-1],
                     lambda p: True):
            for p in options:
                if good(p):
                    return p
        return None


def _names(src: tuple, dst: tuple) -> tuple[str, ...]:
    return tuple(dict.fromkeys([src[-1], _where(src[:-1]), dst[-1], _where(dst[:-1])]))


def _relocation_text(verb: str, src: tuple, dst: tuple) -> str | None:
    """The words of a move/copy/rename, in the phrasing of the built-in task queries; None when
    the words would be ambiguous (two different folders with the same name)."""
    x, z = src[-1], dst[-1]
    src_dir, dst_dir = src[:-1], dst[:-1]
    if src_dir != dst_dir and _where(src_dir) == _where(dst_dir):
        return None
    if src_dir == dst_dir:  # same folder, new name
        where = f" in {src_dir[-1]}" if src_dir else ""
        return f"rename {x}{where} to {z}" if verb == "move" else f"{verb} {x}{where} to {z}"
    origin = f" from {_where(src_dir)}" if src_dir else ""
    text = f"{verb} {x}{origin} into {_where(dst_dir)}"
    return text if x == z else f"{text} and rename it to {z}"
