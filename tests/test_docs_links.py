"""Every relative link of README.md, docs/ and experiments/ leads somewhere: its file exists and its anchor is
one of that file's headings (as GitHub renders them), so that moving a section from a guide to a record
(issue 60) cannot leave a reader at a dead link."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)


def markdown_files() -> list[Path]:
    return sorted({ROOT / "README.md", *ROOT.glob("docs/**/*.md"), *ROOT.glob("experiments/**/*.md")})


def anchors(path: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation but - and _ dropped, spaces as -; repeats -1, -2."""
    seen: dict[str, int] = {}
    out = set()
    for line in FENCE.sub("", path.read_text()).splitlines():
        m = re.match(r"#{1,6}\s+(.*)", line)
        if not m:
            continue
        slug = re.sub(r"[^\w\- ]", "", m[1].strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def test_every_relative_link_resolves_to_a_file_and_heading():
    dead = []
    for path in markdown_files():
        text = FENCE.sub("", path.read_text())
        for target in LINK.findall(text):
            if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
                continue
            file, _, anchor = target.partition("#")
            dest = (path.parent / file).resolve() if file else path
            where = f"{path.relative_to(ROOT)}: ({target})"
            if not dest.exists():
                dead.append(f"{where}: no file {file}")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                dead.append(f"{where}: no heading #{anchor} in {dest.relative_to(ROOT)}")
    assert not dead, "\n".join(dead)
