"""The report: summary.csv, report.md and the PNGs, from real tiny runs and from synthetic run dirs."""

import csv
import json
from pathlib import Path

import pytest
from matplotlib.image import imread

from muloco.cli import main
from muloco.config import load_config
from muloco.run.trainer import Trainer
from muloco.tools.report import build_report
from muloco.tools.runs import pct_over

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = ROOT / "configs" / "quickstart.yaml"
PNG = b"\x89PNG\r\n\x1a\n"


def assert_png(path: Path) -> None:
    assert path.read_bytes()[:8] == PNG
    image = imread(path)
    assert image.shape[0] > 100 and image.shape[1] > 100 and image.std() > 0  # not blank


def test_report_from_two_real_runs(tmp_path, tiny):
    out = tmp_path / "runs"
    for name, method in (("muloco_w2", "diloco"), ("dp_w2", "dp")):
        cfg = load_config(QUICKSTART, [*tiny, f"run.name={name}", f"method={method}", "workers=2"])
        assert Trainer(cfg).run()["status"] == "completed"
    outputs = build_report(out)

    rows = list(csv.DictReader((out / "summary.csv").open()))
    by_run = {row["run"]: row for row in rows}
    assert set(by_run) == {"muloco_w2", "dp_w2"} and rows[0]["run"] == "dp_w2"  # DP first in its group
    assert "method" in rows[0] and "final_val_loss" in rows[0]  # the varied key, the summary fields
    mu, dp = by_run["muloco_w2"], by_run["dp_w2"]
    assert mu["dp_baseline"] == "dp_w2" and dp["pct_over_dp"] == ""
    expected = pct_over(float(mu["final_val_loss"]), float(dp["final_val_loss"]))
    assert float(mu["pct_over_dp"]) == pytest.approx(expected, abs=1e-4)

    report = (out / "report.md").read_text()
    assert "**muloco_w2**" in report and "## inner optimizer: muon" in report
    assert "![" in report and "loss_vs_tokens.png" in report
    assert "skipped `loss_vs_bits.png`" in report and "skipped `pct_over_dp_vs_workers.png`" in report
    assert set(outputs) == {"summary.csv", "report.md", "loss_vs_tokens.png"}
    assert_png(out / "loss_vs_tokens.png")


# --- synthetic run directories: every plot, baseline matching, no training ---------------------------------


def fake_run(root: Path, name: str, overrides: list[str], loss: float, tokens: int = 600_000) -> None:
    cfg = load_config(QUICKSTART, [f"run.name={name}", f"run.output_dir={root}", *overrides])
    run_dir = root / name
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text(cfg.to_yaml())
    scheme = cfg.compression.scheme
    summary = {
        "run_name": name,
        "method": cfg.method,
        "inner_optimizer": cfg.inner.optimizer,
        "workers": cfg.workers,
        "sync_every": cfg.sync.every if cfg.method == "diloco" else 1,
        "bits": 32 if scheme == "none" else cfg.compression.bits,
        "compression": scheme,
        "error_feedback": cfg.compression.error_feedback and scheme != "none",
        "final_val_loss": loss,
        "tokens_seen": tokens,
        "bytes_sent_per_worker": 1e6,
        "bytes_ddp_equivalent": 3e7,
        "wall_time_s": 60.0,
        "status": "completed",
    }
    (run_dir / "summary.json").write_text(json.dumps(summary))
    evals = [
        {"kind": "eval", "step": s, "tokens": s * 4096, "time_s": s, "val_loss": loss + 3 / (1 + s)}
        for s in (0, 30, 60)
    ]
    (run_dir / "metrics.jsonl").write_text("\n".join(json.dumps(e) for e in evals) + "\n")


def test_every_plot_from_a_synthetic_sweep(tmp_path):
    root = tmp_path / "sweep"
    for opt, base in (("adamw", 2.4), ("muon", 2.3)):
        for k in (1, 2, 4, 8):
            fake_run(root, f"dp_{opt}_w{k}", ["method=dp", f"inner.optimizer={opt}", f"workers={k}"], base)
            fake_run(root, f"{opt}_w{k}", [f"inner.optimizer={opt}", f"workers={k}"], base + 0.01 * k)
        for h in (30, 60):
            fake_run(root, f"{opt}_H{h}", [f"inner.optimizer={opt}", f"sync.every={h}"], base + h / 1000)
        for bits in (8, 2):
            for ef in ("false", "true"):
                over = [
                    f"inner.optimizer={opt}",
                    "compression.scheme=statistical",
                    f"compression.bits={bits}",
                ]
                fake_run(
                    root,
                    f"{opt}_{bits}bit_{ef}",
                    [*over, f"compression.error_feedback={ef}"],
                    base + 0.1 / bits,
                )
    outputs = build_report(root)
    for name in (
        "loss_vs_tokens.png",
        "pct_over_dp_vs_workers.png",
        "loss_vs_bits.png",
        "loss_vs_sync_every.png",
    ):
        assert name in outputs, (root / "report.md").read_text()
        assert_png(root / name)
    rows = {row["run"]: row for row in csv.DictReader((root / "summary.csv").open())}
    assert rows["muon_w8"]["dp_baseline"] == "dp_muon_w8"  # the same workers are preferred
    assert rows["adamw_H60"]["dp_baseline"] == "dp_adamw_w4"  # quickstart's K = 4
    assert float(rows["muon_w8"]["pct_over_dp"]) == pytest.approx(pct_over(2.38, 2.3), abs=1e-3)
    report = (root / "report.md").read_text()
    assert "**muon_w1**" in report and "**adamw_w1**" in report and "skipped" not in report


def test_report_cli_on_an_empty_directory_exits_2(tmp_path, capsys):
    assert main(["report", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no run directories" in err[0]
