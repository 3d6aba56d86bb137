"""The README and docs/ as a reader follows them: every relative link opens a file of this
repository, and the README's setup section holds exactly the two commands it promises."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
SETUP_HEADING = "## Two commands"
SETUP_COMMANDS = ["make demo", "make test"]

FENCE = re.compile(r"^```.*?^```", re.S | re.M)
INLINE_CODE = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
COMMIT = re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b")


def pages() -> list[Path]:
    return [README, *sorted((ROOT / "docs").rglob("*.md"))]


def relative_links(page: Path) -> list[str]:
    """Link targets outside code, without their #anchor; web and mail links left out."""
    text = INLINE_CODE.sub("", FENCE.sub("", page.read_text()))
    targets = [m.group(1).split("#", 1)[0] for m in LINK.finditer(text)]
    return [t for t in targets if t and not re.match(r"[a-z][a-z0-9+.-]*:", t)]


def broken_links(page: Path) -> list[str]:
    broken = []
    for target in relative_links(page):
        path = (page.parent / target).resolve()
        if not path.is_file() or ROOT not in path.parents:
            broken.append(f"{page.relative_to(ROOT)}: {target}")
    return broken


def section(text: str, heading: str) -> str:
    """The text under `heading`, up to the next heading of the same level."""
    start = text.index(heading + "\n")
    rest = text[start + len(heading) + 1:]
    end = re.search(r"^## ", rest, re.M)
    return rest[:end.start()] if end else rest


def setup_commands(text: str) -> list[str]:
    """The commands in the setup section's code blocks, comments dropped."""
    blocks = re.findall(r"^```[a-z]*\n(.*?)^```", section(text, SETUP_HEADING), re.S | re.M)
    lines = (line.split("#", 1)[0].strip() for block in blocks for line in block.splitlines())
    return [line for line in lines if line]


def test_every_relative_link_opens_a_file_of_the_repository():
    assert len(pages()) > 5
    broken = [b for page in pages() for b in broken_links(page)]
    assert not broken, "links to no file of this repository:\n" + "\n".join(broken)


def test_the_readme_links_the_design_and_the_results_inside_the_repository():
    linked = {(README.parent / t).resolve() for t in relative_links(README)}
    assert ROOT / "docs" / "architecture.md" in linked
    results = ROOT / "docs" / "results"
    unlinked = set(results.glob("*.md")) - linked
    assert not unlinked, f"results pages without a row in the README's table: {sorted(unlinked)}"


def test_the_readme_sets_up_with_exactly_two_commands():
    assert setup_commands(README.read_text()) == SETUP_COMMANDS


def test_the_readme_is_a_front_page():
    text = README.read_text()
    # 200 lines of prose and tables, and the one screenshot issue 54 asks the README to show
    # (node_exporter's /metrics, 25 lines): anything else dated belongs in docs/results/.
    assert len(text.splitlines()) <= 225, "dated results belong in docs/results/"
    assert not COMMIT.findall(text), "no commit hashes in the README"
