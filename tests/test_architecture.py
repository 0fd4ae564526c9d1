"""The package graph runs one way: a test built from the source, every import counted.

Layers, bottom to top (``docs/architecture.md`` draws them)::

    autodidact                                           application: CLI, launcher, supervisor
    actor  experience  judge  learner  replay            roles: never import each other
    navigating                                           self-navigating (experience pool, ...)
    questioning                                          self-questioning (explorer, tasks, ...)
    episodes                                             rollouts, rewards, held-out evaluation
    environments  inference  metrics                     shared capabilities, independent
    protocol                                             every contract between processes

A package may import its own modules and packages of a strictly lower layer. Imports inside
functions count as much as top-level ones: hiding an import in a function does not remove the
dependency, it only delays the crash. Besides the layer order, no two modules may import each
other through any chain (a cycle), wherever the imports sit.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

LAYERS: list[set[str]] = [
    {"protocol"},
    {"environments", "inference", "metrics"},
    {"episodes"},
    {"questioning"},
    {"navigating"},
    {"actor", "experience", "judge", "learner", "replay"},
    {"autodidact"},
]
RANK = {pkg: i for i, layer in enumerate(LAYERS) for pkg in layer}


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def imported_modules(tree: ast.AST, module: str, is_package: bool,
                     modules: set[str]) -> list[tuple[str, int]]:
    """The project modules ``module`` imports, anywhere in its body, with the line that does it.
    ``from a import b`` is an edge to ``a.b`` when that is a module, else to ``a``."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[:len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                found.append((sub if sub in modules else target, node.lineno))
    return [(target, line) for target, line in found if target in modules]


def import_graph(root: Path) -> tuple[dict[str, set[str]], dict[tuple[str, str], str]]:
    """Module -> modules it imports (project modules only), and where each edge is written."""
    files = {module_name(p, root): p for pkg in RANK for p in (root / pkg).rglob("*.py")}
    graph: dict[str, set[str]] = {m: set() for m in files}
    where: dict[tuple[str, str], str] = {}
    for module, path in files.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        for target, line in imported_modules(tree, module, path.name == "__init__.py",
                                             set(files)):
            if target != module:
                graph[module].add(target)
                where.setdefault((module, target), f"{path.relative_to(root)}:{line}")
    return graph, where


def layer_violations(graph, where) -> list[str]:
    bad = []
    for src, targets in graph.items():
        for dst in targets:
            a, b = src.split(".")[0], dst.split(".")[0]
            if a != b and not RANK[b] < RANK[a]:
                bad.append(f"{where[src, dst]}: {src} imports {dst} ({a} may import only "
                           f"layers below it)")
    return sorted(bad)


def cycles(graph) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, on_stack, stack, found, counter = {}, {}, set(), [], [], [0]

    def visit(start):
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter[0]
        counter[0] += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter[0]
                    counter[0] += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return found


def test_every_top_level_package_has_a_layer():
    packages = {p.name for p in ROOT.iterdir() if (p / "__init__.py").exists()}
    assert packages - {"tests", "bench", "scripts"} == set(RANK)


def test_imports_run_one_way():
    graph, where = import_graph(ROOT)
    assert layer_violations(graph, where) == []


def test_no_import_cycles():
    graph, _ = import_graph(ROOT)
    assert cycles(graph) == []


def test_no_file_edits_the_import_path():
    """bench/ and scripts/ run as modules from the repository root (``python -m bench.x``), so
    no file needs to put the repository on ``sys.path`` itself."""
    edits = []
    tops = [p for p in ROOT.iterdir() if p.is_dir() and not p.name.startswith(".")]  # no .venv
    for path in [p for top in tops for p in top.rglob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if (isinstance(node, ast.Attribute) and node.attr in ("insert", "append", "extend")
                    and ast.unparse(node.value) == "sys.path"):
                edits.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert edits == []


# --- the checks themselves can fail -------------------------------------------------------------


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    for pkg in RANK:
        (tmp_path / pkg).mkdir(exist_ok=True)
        (tmp_path / pkg / "__init__.py").touch()
    return tmp_path


@pytest.mark.parametrize("src, text", [
    ("actor/a.py", "from judge.b import x\n"),                  # role -> role
    ("actor/a.py", "def f():\n    import judge.b\n"),           # hidden in a function
    ("protocol/a.py", "from environments import b\n"),          # protocol reaches up
    ("learner/a.py", "import autodidact.b\n"),                   # role -> application
    ("inference/a.py", "from environments.b import x\n"),        # same layer, across
])
def test_a_cross_layer_import_is_caught(tmp_path, src, text):
    root = _tree(tmp_path, {src: text, "judge/b.py": "", "environments/b.py": "",
                            "autodidact/b.py": ""})
    graph, where = import_graph(root)
    bad = layer_violations(graph, where)
    assert len(bad) == 1 and bad[0].startswith(f"{src}:")


def test_a_cycle_hidden_in_functions_is_caught(tmp_path):
    root = _tree(tmp_path, {
        "autodidact/a.py": "def f():\n    from autodidact import b\n",
        "autodidact/b.py": "def g():\n    from . import c\n",
        "autodidact/c.py": "import autodidact.a\n",
    })
    graph, _ = import_graph(root)
    assert cycles(graph) == [["autodidact.a", "autodidact.b", "autodidact.c"]]
