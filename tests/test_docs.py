"""The documentation's shape: a short README, links that resolve, and every result file cited.

Pure file checks, no imports of the package: the README is the front door and stays short;
every relative link in README.md and docs/**/*.md must reach a file (and, for a link into a
markdown page, a heading of it), so moving a page cannot leave dead links behind; measured
results (json, png) live in docs/results/ and each is cited by some page, so none is an orphan
nobody reads and no page quotes a number whose file was dropped.
"""

from __future__ import annotations

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


def test_every_result_file_is_cited_by_a_page():
    text = "\n".join(p.read_text(encoding="utf-8") for p in pages())
    files = sorted(p for p in RESULTS.iterdir() if p.suffix in (".json", ".png"))
    assert files, "docs/results/ holds no results"
    uncited = [p.name for p in files if p.name not in text]
    assert not uncited, f"result files no page cites: {uncited}"


def test_no_result_file_is_left_directly_in_docs():
    stray = sorted(p.name for p in DOCS.iterdir() if p.suffix in (".json", ".png"))
    assert not stray, f"move these into docs/results/: {stray}"
