"""Every figure README.md and the guides quote comes from a committed JSON (scripts/docs_figures.py, issue
60): the repository's docs pass the check, and a figure changed by hand, a source gone, an unknown name or
an unmarked measured-looking number in a guide each fail it, naming the file and line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import docs_figures  # noqa: E402
from figures import Figure  # noqa: E402


def test_the_repositorys_docs_quote_every_figure_as_its_source_gives_it():
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts/docs_figures.py"), "--check"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-4000:]


@pytest.fixture
def repo(tmp_path):
    """A repository of one guide quoting one figure of one committed JSON."""
    (tmp_path / "results").mkdir()
    (tmp_path / "results/bench.json").write_text(
        json.dumps({"rows": [{"speedup": 0.0523}, {"speedup": 0.06}]})
    )
    (tmp_path / "docs").mkdir()
    (tmp_path / "README.md").write_text(
        "MuLoCo takes <!-- fig bench.speedup -->0.052x<!-- /fig --> DDP's time on 4 workers.\n"
        "```bash\nmuloco train configs/quickstart.yaml   # 0.5 s\n```\n"
    )
    figures = {"bench.speedup": Figure("results/bench.json", lambda d: f"{d['rows'][0]['speedup']:.3f}x")}
    return tmp_path, figures


def test_a_quoted_figure_equal_to_its_source_passes(repo):
    root, figures = repo
    assert docs_figures.check(root, figures) == []


def test_a_figure_changed_by_hand_fails_with_its_file_line_and_the_fix(repo):
    root, figures = repo
    readme = root / "README.md"
    readme.write_text(readme.read_text().replace("0.052x", "0.045x"))
    (problem,) = docs_figures.check(root, figures)
    assert problem.where == "README.md:1"
    assert "reads '0.045x'" in problem.what and "gives '0.052x'" in problem.what and "--write" in problem.what
    assert docs_figures.write(root, figures) == 1  # --write puts the source's back
    assert docs_figures.check(root, figures) == []


def test_a_missing_source_and_an_unknown_name_fail(repo):
    root, figures = repo
    (root / "results/bench.json").unlink()
    (problem,) = docs_figures.check(root, figures)
    assert "results/bench.json is missing" in problem.what
    readme = root / "README.md"
    readme.write_text(readme.read_text().replace("bench.speedup", "bench.speed"))
    whats = [p.what for p in docs_figures.check(root, figures)]
    assert any("unknown figure 'bench.speed'" in w for w in whats)
    assert any("bench.speedup is quoted nowhere" in w for w in whats)


def test_a_figure_of_several_runs_gets_each_and_fails_naming_the_one_missing(repo):
    root, figures = repo
    (root / "results/later.json").write_text(json.dumps({"rows": [{"speedup": 0.048}]}))
    best = Figure(
        ("results/bench.json", "results/later.json"),
        lambda runs: f"{min(r['rows'][0]['speedup'] for r in runs):.3f}x",
    )
    figures = {"bench.speedup": best}
    (root / "README.md").write_text("MuLoCo takes <!-- fig bench.speedup -->0.048x<!-- /fig --> DDP's.\n")
    assert docs_figures.check(root, figures) == []
    (root / "results/later.json").unlink()
    (problem,) = docs_figures.check(root, figures)
    assert "results/later.json is missing" in problem.what


def test_an_unmarked_measured_looking_number_in_a_guide_fails_unless_exempt(repo):
    root, figures = repo
    guide = root / "docs/wan.md"
    guide.write_text(
        "# WAN\n\nA sync takes 37.5% of the time at 4.2 Mbit/s, 2 x 3 workers (arXiv 2502.12996, "
        "127.0.0.1, `sync.overlap=15`, [link](records/wan-2026-12-04.md)).\n"
    )
    problems = docs_figures.check(root, figures)
    assert [(p.where, p.what.split(" looks")[0]) for p in problems] == [
        ("docs/wan.md:3", "'37.5%'"),
        ("docs/wan.md:3", "'4.2 Mbit/s'"),
    ]
    (root / "docs/figures_exempt").mkdir()
    (root / "docs/figures_exempt/wan.txt").write_text("docs/wan.md: 4.2 Mbit/s  # a unit, for the example\n")
    (problem,) = docs_figures.check(root, figures)
    assert "'37.5%'" in problem.what
    # A record holds dated measurements: not scanned.
    (root / "docs/records").mkdir()
    guide.rename(root / "docs/records/wan.md")
    assert docs_figures.check(root, figures) == []
