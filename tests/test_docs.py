"""The documentation's shape: a short README, links that resolve, and every result file cited.

Pure file checks, no imports of the package: the README is the front door and stays short;
every relative link in README.md and docs/**/*.md must reach a file (and, for a link into a
markdown page, a heading of it), so moving a page cannot leave dead links behind; measured
results (json, png) live in docs/results/ and each is linked from some page, so none is an
orphan nobody reads and no page quotes a number whose file was dropped.

The project's rule for numbers ("every number in the README or docs has a json under
docs/results/ and the command that wrote it") is held here as far as files can show it: every
docs/results/ path a page names exists; every result json carries the command that wrote it
(or is listed below with the reason it cannot) and has a row with its command in the results
index; a paragraph that says a measurement kept no json links the CHANGELOG entry holding it.
Whether a number on a page matches its json is left to review.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
RESULTS = DOCS / "results"
README_MAX_LINES = 300

# [text](target) and ![alt](target); the target ends at whitespace or the closing parenthesis
# (a title after a space is allowed and ignored).
LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
FENCE = re.compile(r"^\s*(```|~~~)")


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]


def outside_fences(text: str) -> list[str]:
    """The lines outside fenced code blocks (a ``# comment`` in a shell block is no heading)."""
    kept, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
        elif not fenced:
            kept.append(line)
    return kept


def prose(text: str) -> str:
    """The text outside code blocks and inline code spans, where links are links."""
    return "\n".join(re.sub(r"`[^`]*`", "", line) for line in outside_fences(text))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"`", "", heading.strip().lower())
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)  # a link in a heading keeps its text
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    found: set[str] = set()
    counts: dict[str, int] = {}
    for line in outside_fences(page.read_text(encoding="utf-8")):
        m = re.match(r"^(#{1,6})\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        base = slug(m.group(2))
        n = counts.get(base, 0)
        counts[base] = n + 1
        found.add(base if n == 0 else f"{base}-{n}")
    return found


def relative_links(page: Path) -> list[str]:
    return [t for t in LINK.findall(prose(page.read_text(encoding="utf-8")))
            if not re.match(r"^[a-z][a-z0-9+.-]*:", t)]  # http:, https:, mailto: ...


def test_readme_is_short():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines (at most {README_MAX_LINES})"


def test_readme_starts_with_the_two_commands():
    head = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()[:8]
    assert any(line.startswith("bash scripts/run.sh") for line in head)
    assert any(line.startswith("bash scripts/test.sh") for line in head)


@pytest.mark.parametrize("page", pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page: Path):
    broken = []
    for target in relative_links(page):
        path_part, _, anchor = target.partition("#")
        dest = (page.parent / unquote(path_part)).resolve() if path_part else page
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading '#{anchor}' in {dest.relative_to(ROOT)}")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)


def linked_files() -> set[Path]:
    """Every file some page's relative link reaches."""
    found = set()
    for page in pages():
        for target in relative_links(page):
            path_part = target.partition("#")[0]
            if path_part:
                found.add((page.parent / unquote(path_part)).resolve())
    return found


def test_every_result_file_is_linked_from_a_page():
    files = sorted(p for p in RESULTS.iterdir() if p.suffix in (".json", ".png"))
    assert files, "docs/results/ holds no results"
    linked = linked_files()
    unlinked = [p.name for p in files if p.resolve() not in linked]
    assert not unlinked, ("result files no page links to (README, docs/, "
                          f"docs/results/README.md): {unlinked}")


# A docs/results/ path as a page names it anywhere: in a link, a command, a code span.
RESULT_PATH = re.compile(r"(?<![\w/.-])(?:docs/)?results/([\w.-]+\.(?:json|png|md))\b")


def test_every_results_path_a_page_names_exists():
    missing = []
    for page in pages():
        for name in RESULT_PATH.findall(page.read_text(encoding="utf-8")):
            if not (RESULTS / name).exists():
                missing.append(f"{page.relative_to(ROOT)}: results/{name}")
    assert not missing, f"pages name result files that do not exist: {missing}"


# Result jsons whose own data cannot say the command that wrote it, and why. The command of each
# is still on a page and in the results index (test_every_result_json_has_a_command_in_the_index).
NO_OWN_COMMAND = {
    "async_vs_sync_smollm2_transformers.json":
        "the vLLM run's command with transformers actors and 8 updates (docs/benchmarks.md); "
        "its exact flags were not recorded",
    "async_vs_sync_smollm2_transformers_split.json":
        "the same with --async-set learner.torch_threads=1; its exact flags were not recorded",
    "smollm2_runs.json":
        "three runs of bench.run_timing merged into one list; the launcher logs' paths were not "
        "recorded",
    "smollm2_seeds.json":
        "bench.run_seeds records its config and sets, not its command line",
    "attribution_smollm2.json":
        "bench.heldout_curve does not record its command line (in full on docs/attributing.md)",
}


def names_a_command(value) -> bool:
    if isinstance(value, str):
        return bool(value.strip())
    if isinstance(value, dict):
        return bool(value) and all(names_a_command(v) for v in value.values())
    if isinstance(value, list):
        return bool(value) and all(names_a_command(v) for v in value)
    return False


def own_command(entry) -> bool:
    """A dict that says how it was made: "command", "commands" or "command_<which>"."""
    return isinstance(entry, dict) and any(
        (key in ("command", "commands") or key.startswith("command_")) and names_a_command(value)
        for key, value in entry.items())


def carries_command(data) -> bool:
    """The shapes the result jsons use: a command at the top; under "made" (what `autodidact
    ablation` records of its run); or in every entry of a list, or of a dict of runs."""
    if own_command(data) or (isinstance(data, dict) and own_command(data.get("made"))):
        return True
    entries = data if isinstance(data, list) else \
        list(data.values()) if isinstance(data, dict) else []
    return bool(entries) and all(own_command(e) for e in entries)


def test_carries_command_can_fail():
    assert carries_command({"command": "python -m bench.x", "rows": []})
    assert carries_command({"commands": {"a": "x", "b": "y"}})
    assert carries_command({"command_lora": "x", "runs": []})
    assert carries_command({"made": {"command": "autodidact ablation", "date": "d"}})
    assert carries_command([{"command": "x", "v": 1}, {"command": "x", "v": 2}])
    assert carries_command({"run-a": {"command": "x"}, "run-b": {"command": "y"}})
    assert not carries_command({"minutes": 6.0, "lost": 0})
    assert not carries_command({"command": "", "rows": []})
    assert not carries_command({"commands": {"a": "x", "b": ""}})
    assert not carries_command([{"command": "x"}, {"v": 2}])
    assert not carries_command({"run-a": {"command": "x"}, "minutes": 6.0})
    assert not carries_command([])


def result_jsons() -> list[Path]:
    return sorted(RESULTS.glob("*.json"))


@pytest.mark.parametrize("path", result_jsons(), ids=lambda p: p.name)
def test_every_result_json_carries_its_command(path: Path):
    data = json.loads(path.read_text(encoding="utf-8"))
    if path.name in NO_OWN_COMMAND:
        assert not carries_command(data), (
            f"{path.name} now carries its command: drop it from NO_OWN_COMMAND")
    else:
        assert carries_command(data), (
            f"{path.name} does not say the command that wrote it: add a \"command\" key (at the "
            "top, or in every entry) or, if it cannot be told exactly, list it in "
            "NO_OWN_COMMAND with the reason")


def test_no_own_command_lists_only_result_files():
    stray = sorted(set(NO_OWN_COMMAND) - {p.name for p in result_jsons()})
    assert not stray, f"NO_OWN_COMMAND names files that are not in docs/results/: {stray}"


def index_commands(text: str, page: Path) -> dict[str, str]:
    """The results index's table: each linked json's command cell."""
    found: dict[str, str] = {}
    header: list[str] | None = None
    for line in outside_fences(text):
        if not line.lstrip().startswith("|"):
            header = None
            continue
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip().strip("|"))]
        if header is None:
            header = [c.lower() for c in cells]
            continue
        if all(set(c) <= set("-: ") for c in cells) or "command that wrote it" not in header:
            continue
        command = cells[header.index("command that wrote it")]
        for target in LINK.findall(cells[0]):
            path = (page.parent / unquote(target.partition("#")[0])).resolve()
            if path.suffix == ".json":
                found[path.name] = command
    return found


def test_index_commands_can_fail():
    table = ("| file | what it holds | command that wrote it | read on |\n|---|---|---|---|\n"
             "| [a.json](a.json), [a.png](a.png) | x | `python -m bench.a` | p |\n"
             "| [b.json](b.json) | y | — | p |\n")
    assert index_commands(table, RESULTS / "README.md") == {"a.json": "`python -m bench.a`",
                                                            "b.json": "—"}


def test_every_result_json_has_a_command_in_the_index():
    index = RESULTS / "README.md"
    commands = index_commands(index.read_text(encoding="utf-8"), index)
    lacking = [p.name for p in result_jsons()
               if commands.get(p.name, "").strip("`—- ") == ""]
    assert not lacking, (f"result jsons without a row and its command in "
                         f"docs/results/README.md: {lacking}")


# "kept no json", "without a json", "the json was not kept", "were not kept as json", ...
NO_JSON = re.compile(r"\bno json\b|without (?:a|its|their) (?:json|data)|json (?:was )?not kept"
                     r"|not kept as json|kept no json", re.IGNORECASE)


# Paragraphs that say so without the link, and why they may: (page, a phrase of the paragraph).
NO_JSON_WITHOUT_CHANGELOG = {
    ("docs/results/ablation.md", "1.19×"):
        "the page is written by `autodidact ablation`; the line points to "
        "attributing.md#what-was-measured, which links the CHANGELOG entry",
}


def paragraphs_without_changelog() -> list[tuple[str, str]]:
    bare = []
    for page in pages():
        text = "\n".join(outside_fences(page.read_text(encoding="utf-8")))
        for paragraph in re.split(r"\n\s*\n", text):
            flat = " ".join(paragraph.split())
            if NO_JSON.search(flat) and "CHANGELOG.md#" not in flat:
                bare.append((str(page.relative_to(ROOT)), flat))
    return bare


def test_a_measurement_without_a_json_points_to_the_changelog():
    bare = paragraphs_without_changelog()
    excused = {key for key in NO_JSON_WITHOUT_CHANGELOG
               if any(page == key[0] and key[1] in flat for page, flat in bare)}
    stale = sorted(set(NO_JSON_WITHOUT_CHANGELOG) - excused)
    assert not stale, f"drop these from NO_JSON_WITHOUT_CHANGELOG, they no longer apply: {stale}"
    left = [f"{page}: {flat[:100]}..." for page, flat in bare
            if not any(page == p and phrase in flat for p, phrase in excused)]
    assert not left, ("a page says a measurement kept no json without linking the CHANGELOG "
                      f"entry that holds its numbers: {left}")


def test_no_json_check_can_fail():
    assert NO_JSON.search("the run that measured it kept no json")
    assert NO_JSON.search("Those measurements kept no json; their numbers")
    assert NO_JSON.search("were not kept as json")
    assert NO_JSON.search("measured once without a json")
    assert not NO_JSON.search("its json and the command that wrote it")


def test_no_result_file_is_left_directly_in_docs():
    stray = sorted(p.name for p in DOCS.iterdir() if p.suffix in (".json", ".png"))
    assert not stray, f"move these into docs/results/: {stray}"
