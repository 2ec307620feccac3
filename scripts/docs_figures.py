"""Every figure README.md and the guides quote from a measurement, rendered from a committed JSON (issue 60).

A quoted figure sits between markers that name it, `<!-- fig NAME -->0.052x<!-- /fig -->` (invisible once
rendered), and scripts/figures/ says which committed JSON it comes from and how (a median over repeats, a
ratio, a format: one module per topic). A guide's other numbers that look measured (a decimal, or a number
with a unit of time, size, rate or a ratio) must be exempt in EXEMPT_FILES (defaults, arithmetic, units) or
be a marked figure.
Records (docs/records/) hold dated measurements beside their commands and JSON and are not checked.

    python scripts/docs_figures.py --check   # CI: exit 1 on a figure that differs from its source, a
                                             # source missing, an unknown name or an unmarked figure
    python scripts/docs_figures.py --write   # rewrite every marker's text from its source
    python scripts/docs_figures.py --list    # every figure: its value and its source
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))  # so that scripts/figures/ imports as `figures`
MARKER = re.compile(r"<!-- fig (?P<name>[\w.:-]+) -->(?P<text>.*?)<!-- /fig -->", re.S)
# The guides a user reads for how: their measured-looking numbers must be marked (or exempt).
GUIDES = ("README.md", "docs/*.md")
# Every file whose markers are checked: the guides, the records and the experiments' READMEs.
MARKED = (*GUIDES, "docs/records/*.md", "experiments/**/README.md", "experiments/**/RESULTS.md")
EXEMPT_FILES = "docs/figures_exempt/*.txt"  # one per topic
# A number that looks measured: a decimal, a ratio (0.5x), a share (37.5%) or a quantity of time, size or
# rate. Integers alone (4 workers, H = 15) are settings, not measurements; "2 x 3" is arithmetic; an arXiv
# id, an address or a version is none of these.
UNIT = r"(?:%|s|ms|us|min|h|seconds?|minutes?|hours?|B|KB|MB|GB|TB|KiB|MiB|GiB|[KMG]?bit/s|[KMG]B/s|tokens/s)"
MEASURED = re.compile(rf"(?<![\w.\-/:])\d[\d,]*(?:\.\d+)?(?:x|\s?{UNIT})?(?![\w/]|\.\d)")
NOT_MEASURED = re.compile(r"\d{4}\.\d{4,5}|\d+")  # an arXiv id; a plain integer
# Generated from the code, not measured (scripts/gen_config_docs.py).
GENERATED = ("docs/configuration.md",)

from figures import Figure, FigureError, all_figures  # noqa: E402

FIGURES = all_figures()


# -- the check ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Problem:
    where: str  # file:line
    what: str

    def __str__(self) -> str:
        return f"{self.where}: {self.what}"


def files(root: Path, patterns: Iterable[str]) -> list[Path]:
    return sorted({p for pattern in patterns for p in root.glob(pattern) if p.is_file()})


def check_markers(root: Path, figures: dict[str, Figure], paths: list[Path]) -> tuple[list[Problem], set]:
    """Every marker in `paths` against its figure; the names used."""
    problems, used = [], set()
    for path in paths:
        text = path.read_text()
        for m in MARKER.finditer(text):
            where = f"{path.relative_to(root)}:{text.count(chr(10), 0, m.start()) + 1}"
            name, quoted = m["name"], m["text"]
            used.add(name)
            if name not in figures:
                problems.append(Problem(where, f"unknown figure {name!r} (scripts/docs_figures.py FIGURES)"))
                continue
            try:
                expected = figures[name].value(root)
            except (FigureError, KeyError, ValueError, ZeroDivisionError) as exc:
                problems.append(Problem(where, f"figure {name}: {exc}"))
                continue
            if quoted != expected:
                problems.append(
                    Problem(
                        where,
                        f"figure {name} reads {quoted!r}, its source "
                        f"{', '.join(figures[name].sources)} gives "
                        f"{expected!r} (python scripts/docs_figures.py --write)",
                    )
                )
    return problems, used


def prose_lines(text: str) -> Iterable[tuple[int, str]]:
    """(line number, text) of a markdown file's prose: fenced code, inline code, marked figures, link
    targets and HTML comments left out."""
    text = MARKER.sub(lambda m: "\n" * m[0].count("\n"), text)
    fenced = False
    for number, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith(("```", "~~~")):
            fenced = not fenced
            continue
        if fenced or line.startswith("    "):
            continue
        line = re.sub(r"`[^`]*`", "", line)
        line = re.sub(r"\]\([^)]*\)", "]", line)
        line = re.sub(r"<!--.*?-->", "", line)
        yield number, line


def exemptions(root: Path) -> dict[str, set[str]]:
    """EXEMPT_FILES: `path: text` per line, each text a number as written that the file may quote unmarked
    (a default, arithmetic, a unit), with a # comment saying which."""
    exempt: dict[str, set[str]] = {}
    for path in sorted(root.glob(EXEMPT_FILES)):
        for line in path.read_text().splitlines():
            line = line.split("#", 1)[0].strip()
            if line:
                file, _, number = line.partition(": ")
                exempt.setdefault(file, set()).add(number.strip())
    return exempt


def check_unmarked(root: Path, paths: list[Path]) -> list[Problem]:
    """A guide's measured-looking numbers that are neither marked figures nor exempt."""
    exempt, problems = exemptions(root), []
    for path in paths:
        rel = str(path.relative_to(root))
        allowed = exempt.get(rel, set())
        for number, line in prose_lines(path.read_text()):
            for m in MEASURED.finditer(line):
                if NOT_MEASURED.fullmatch(m[0].replace(",", "")) is None and m[0] not in allowed:
                    problems.append(
                        Problem(
                            f"{rel}:{number}",
                            f"{m[0]!r} looks measured: mark it as a figure, move it to a record, or "
                            f"exempt it in {EXEMPT_FILES}",
                        )
                    )
    return problems


def check(root: Path = ROOT, figures: dict[str, Figure] = FIGURES) -> list[Problem]:
    problems, used = check_markers(root, figures, files(root, MARKED))
    problems += [
        Problem("scripts/docs_figures.py", f"figure {n} is quoted nowhere") for n in figures if n not in used
    ]
    guides = [p for p in files(root, GUIDES) if str(p.relative_to(root)) not in GENERATED]
    return problems + check_unmarked(root, guides)


def write(root: Path = ROOT, figures: dict[str, Figure] = FIGURES) -> int:
    """Every marker's text rewritten from its source; the number changed."""
    changed = 0
    for path in files(root, MARKED):
        text = path.read_text()

        def render(m: re.Match) -> str:
            nonlocal changed
            value = figures[m["name"]].value(root) if m["name"] in figures else m["text"]
            changed += value != m["text"]
            return f"<!-- fig {m['name']} -->{value}<!-- /fig -->"

        new = MARKER.sub(render, text)
        if new != text:
            path.write_text(new)
    return changed


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--check", action="store_true")
    mode.add_argument("--write", action="store_true")
    mode.add_argument("--list", action="store_true")
    args = ap.parse_args()
    if args.list:
        for name, fig in FIGURES.items():
            try:
                value = fig.value(ROOT)
            except (FigureError, KeyError, ValueError) as exc:
                value = f"(error: {exc})"
            print(f"{name:40} {value:>16}  {', '.join(fig.sources)}")
        return 0
    if args.write:
        print(f"docs_figures: {write()} figure(s) rewritten")
        return 0
    problems = check()
    for problem in problems:
        print(problem, file=sys.stderr)
    if problems:
        print(f"docs_figures: {len(problems)} problem(s)", file=sys.stderr)
        return 1
    print("docs_figures: every quoted figure matches its source")
    return 0


if __name__ == "__main__":
    sys.exit(main())
