"""The README is a short front door and the docs hold the rest: the README begins with the two commands `.ci/run`
runs, stays at most 250 lines and links every docs page from its table; every relative link in the README and the
docs points to a file that exists, and to a heading that exists where it names one (GitHub's anchors)."""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
MAX_README_LINES = 250

#: the README's two commands, byte for byte: the first sets up and runs the main job, the second the tests
COMMANDS = """```bash
# set up and run the main job on the built-in default model: compress it for an H100 serving decode-heavy traffic
pip install torch==2.13.0 && pip install -e . && puzzlekit compress --quick --target h100 --scenario decode-heavy --speedup 1.5 -o runs/quick-h100

# set up and run the tests
pip install torch==2.13.0 && pip install -e '.[test,tensorrt-rtx,tables]' && python -m pytest -q -m "not slow"
```"""

_FENCE = re.compile(r"^(```|~~~)")
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
_CODE_SPAN = re.compile(r"`[^`\n]*`")


def prose_lines(text: str) -> list[str]:
    """The lines outside fenced code blocks (a `#` there is a shell comment, a link there is code)."""
    out, fenced = [], False
    for line in text.splitlines():
        if _FENCE.match(line.lstrip()):
            fenced = not fenced
            continue
        if not fenced:
            out.append(line)
    return out


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped (hyphens and underscores kept), spaces to
    hyphens; links and code spans count by their text."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip()).lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(text: str) -> set[str]:
    """Every heading anchor of a Markdown page, with GitHub's -1, -2, ... for repeated headings."""
    seen: dict[str, int] = {}
    out = set()
    for line in prose_lines(text):
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        base = slug(m.group(1))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def links(text: str) -> list[str]:
    """The targets of the Markdown links in a page's prose (not in code blocks or code spans)."""
    return [m.group(1) for line in prose_lines(text) for m in _LINK.finditer(_CODE_SPAN.sub("", line))]


def broken_links(page: Path) -> list[str]:
    """Each relative link of `page` whose file, or whose heading anchor, does not exist."""
    problems = []
    for target in links(page.read_text()):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:, ...
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            problems.append(f"{page.name}: {target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest.read_text()):
            problems.append(f"{page.name}: {target}: no heading with that anchor in {dest.name}")
    return problems


def table_links(text: str) -> set[str]:
    """The targets linked from the rows of a page's tables."""
    return {t for line in prose_lines(text) if line.lstrip().startswith("|") for t in links(line)}


def doc_pages() -> list[Path]:
    return sorted(DOCS.glob("*.md"))


# -- the README ------------------------------------------------------------------------------------------------
def test_the_readme_is_short():
    lines = README.read_text().splitlines()
    assert len(lines) <= MAX_README_LINES, f"README.md has {len(lines)} lines; move the detail to docs/"


def test_the_readme_begins_with_its_two_commands():
    """A title, one paragraph, then the two commands exactly as they stand."""
    text = README.read_text()
    head, sep, _ = text.partition("\n\n```")
    assert sep, "README.md has no code block"
    title, _, intro = head.partition("\n\n")
    assert title == "# puzzlekit"
    assert intro and "\n\n" not in intro and not intro.startswith("#"), "one paragraph between the title and the commands"
    assert text[len(head) + 2:].startswith(COMMANDS + "\n"), "the README's first code block is not the two commands"


def test_ci_reads_the_same_two_commands():
    """`.ci/run`'s own reader (its `readme_command`) finds both commands in the README as written here."""
    script = (ROOT / ".ci" / "run").read_text()
    reader = next(line for line in script.splitlines() if line.startswith("readme_command()"))
    commands = [line for line in COMMANDS.splitlines()[1:-1] if line and not line.startswith("#")]
    for marker, expected in zip(("set up and run the main job", "set up and run the tests"), commands):
        out = subprocess.run(["bash", "-c", f'{reader}\nreadme_command "$1"', "_", marker], cwd=ROOT,
                             capture_output=True, text=True, check=True).stdout.strip()
        assert out == expected


def test_every_docs_page_is_in_the_readmes_table():
    linked = {(ROOT / t.partition("#")[0]).resolve() for t in table_links(README.read_text())}
    missing = [p.name for p in doc_pages() if p.resolve() not in linked]
    assert doc_pages(), "no docs pages found"
    assert not missing, f"docs pages the README's table does not link: {missing}"


@pytest.mark.parametrize("page", [README, *doc_pages()], ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    assert not broken_links(page), "\n".join(broken_links(page))


# -- the checks themselves -------------------------------------------------------------------------------------
def test_slugs_follow_github():
    assert slug("GPUs: `--device` and `--dtype`") == "gpus---device-and---dtype"
    assert slug("Nemotron-3-Super's counts at small widths: what each stage costs") == \
        "nemotron-3-supers-counts-at-small-widths-what-each-stage-costs"
    assert slug("Iterative Puzzle (`passes/puzzle/rounds.py`)") == "iterative-puzzle-passespuzzleroundspy"
    assert anchors("# A\n## B\n```\n# not a heading\n```\n## B\n") == {"a", "b", "b-1"}


def test_the_checks_fail_on_a_missing_page_or_heading(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "here.md").write_text("# Here\n\n## A section\n")
    page = tmp_path / "README.md"
    page.write_text("| page | what |\n|---|---|\n| [here](docs/here.md) | yes |\n| [gone](docs/gone.md) | no |\n\n"
                    "[good](docs/here.md#a-section), [bad](docs/here.md#no-such-section), [self](#nothing)\n"
                    "`[in code](docs/also-gone.md)`\n```\n[in a block](docs/also-gone.md)\n```\n")
    assert broken_links(page) == ["README.md: docs/gone.md: no such file",
                                  "README.md: docs/here.md#no-such-section: no heading with that anchor in here.md",
                                  "README.md: #nothing: no heading with that anchor in README.md"]
    assert table_links(page.read_text()) == {"docs/here.md", "docs/gone.md"}
