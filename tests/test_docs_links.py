"""The README and the manual under docs/ stay walkable: every relative link and image points at
a file that exists, every #anchor at a heading of its page, every docs page is reachable from
the README, and the README stays a front page with the two commands it promises."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# A page whose name starts with "_" is a draft, not yet part of the manual.
PAGES = [REPO / "README.md",
         *sorted(p for p in (REPO / "docs").glob("*.md") if not p.name.startswith("_"))]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def prose(text: str) -> str:
    """The text outside code: fenced blocks, indented blocks and inline code spans go, since
    ``a[i](x)`` in code is no link."""
    out, fenced = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if fenced or line.startswith("    "):
            continue
        out.append(re.sub(r"`[^`]*`", "", line))
    return "\n".join(out)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def heading_anchors(page: Path) -> set[str]:
    """Anchors from the raw headings (inline code included, as GitHub renders them)."""
    seen: dict[str, int] = {}
    found = set()
    fenced = False
    for line in page.read_text(encoding="utf-8").splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        m = None if fenced else re.match(r"#{1,6} (.+)", line)
        if m:
            s = slug(m.group(1))
            n = seen.get(s, 0)
            seen[s] = n + 1
            found.add(s if n == 0 else f"{s}-{n}")
    return found


def links(page: Path) -> list[str]:
    return LINK.findall(prose(page.read_text(encoding="utf-8")))


def test_slug_is_githubs() -> None:
    assert slug("Faster CPU convolutions: the `onednn` extra (Linux x86-64)") == (
        "faster-cpu-convolutions-the-onednn-extra-linux-x86-64")
    assert slug('Hybrid: "one weird trick"') == "hybrid-one-weird-trick"
    assert slug("The layer builder and `LayerBuild`") == "the-layer-builder-and-layerbuild"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_link_resolves(page: Path) -> None:
    bad = []
    for target in links(page):
        if re.match(r"[a-z]+:", target):  # https:, mailto: — not checked offline
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            bad.append(f"{target}: no file {dest.relative_to(REPO)}")
        elif anchor and anchor not in heading_anchors(dest):
            bad.append(f"{target}: no heading #{anchor} in {dest.relative_to(REPO)}")
    assert not bad, f"{page.relative_to(REPO)}: broken links:\n" + "\n".join(bad)


def test_every_docs_page_is_reachable_from_the_readme() -> None:
    reached, todo = set(), [REPO / "README.md"]
    while todo:
        page = todo.pop()
        if page in reached or page.suffix != ".md" or not page.exists():
            continue
        reached.add(page)
        todo += [(page.parent / t.partition("#")[0]).resolve() for t in links(page)
                 if not re.match(r"[a-z]+:", t) and t.partition("#")[0]]
    missing = sorted(str(p.relative_to(REPO)) for p in PAGES if p not in reached)
    assert not missing, f"docs pages no link leads to: {missing}"


def test_readme_is_a_front_page_with_the_two_commands() -> None:
    lines = (REPO / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines; the manual is docs/"
    assert "    pip install . && purine-caffe demo" in lines
    assert '    pip install ".[test]" && python -m pytest -q' in lines
