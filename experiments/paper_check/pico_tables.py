"""The pico-regime study's tables (docs/results.md) from the finished sweeps under runs/sweeps/pico_*.

Run the sweeps first (each `muloco sweep configs/sweeps/<name>.yaml --jobs 2`, see docs/results.md), then

    python experiments/paper_check/pico_tables.py                # every table, markdown
    python experiments/paper_check/pico_tables.py --json out.json

Every comparison is at equal tokens, each method at its own tuned lr: a DiLoCo/MuLoCo row uses the lr
that was best at its K (pico_tune, pico_tune_workers; chosen on seed 0, the seed every lr ran), a DP
baseline the lr best for DP; the gap to DP vs K is `muloco report`'s tuned comparison (its gap: the mean
over the paired seeds of (loss / DP loss - 1) x 100); the other tables compare as their docstrings say.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

from muloco.run.metrics import read_jsonl
from muloco.tools import tuning as tuned_comparison
from muloco.tools.runs import RunRecord, load_runs, varied_keys
from muloco.tools.runs import own_lr as lr  # the run's inner optimizer's own lr
from muloco.tools.tuning import TuneSpec

ROOT = Path("runs/sweeps")
OPTIMIZERS = {"adamw": "DiLoCo (AdamW)", "muon": "MuLoCo (Muon)"}


def load(root: Path) -> dict[str, list[RunRecord]]:
    dirs = [*root.glob("pico_*"), root / "quickstart_retune"]
    return {d.name: [r for r in load_runs(d) if r.completed] for d in sorted(dirs) if d.is_dir()}


def select(runs: list[RunRecord], **where: Any) -> list[RunRecord]:
    """Runs whose flattened config has every key = value (dots written as __ in the keyword)."""
    return [r for r in runs if all(r.config.get(k.replace("__", ".")) == v for k, v in where.items())]


def best(runs: list[RunRecord]) -> RunRecord | None:
    return min(runs, key=lambda r: r.loss) if runs else None


def mean_loss(runs: list[RunRecord]) -> float | None:
    return statistics.mean(r.loss for r in runs) if runs else None


def gap(loss: float | None, dp: float | None) -> str:
    return "-" if loss is None or dp is None else f"{(loss / dp - 1) * 100:+.2f}%"


def fmt(x: float | None, digits: int = 4) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join([*lines, *("| " + " | ".join(map(str, row)) + " |" for row in rows)])


# --- the tables ------------------------------------------------------------------------------------


def tuning(sweeps: dict[str, list[RunRecord]]) -> str:
    """Final loss by inner lr (outer momentum 0.6), a row per optimizer and K; then the outer momenta."""
    runs = [r for name in ("pico_tune", "pico_tune_outer", "pico_tune_workers") for r in sweeps.get(name, [])]
    runs = [r for r in runs if r.config["run.seed"] == 0]
    parts = []
    for optimizer, label in OPTIMIZERS.items():
        mine = [r for r in runs if r.group == optimizer and (r.is_dp or r.config["outer.momentum"] == 0.6)]
        lrs = sorted({lr(r) for r in mine})
        rows = []
        for K in ("DP", 1, 4, 8):
            at = [r for r in mine if (r.is_dp if K == "DP" else not r.is_dp and r.config["workers"] == K)]
            if not at:
                continue
            winner = best(at)
            cells = []
            for value in lrs:
                hit = [r for r in at if lr(r) == value]
                text = fmt(hit[0].loss) if hit else ""
                cells.append(f"**{text}**" if hit and hit[0] is winner else text)
            rows.append([K if K == "DP" else f"K = {K}", *cells])
        parts.append(table([f"{label}: inner lr", *(f"{v:g}" for v in lrs)], rows))
    momenta = sorted({r.config["outer.momentum"] for r in runs if not r.is_dp and r.config["workers"] == 4})
    rows = []
    for optimizer, label in OPTIMIZERS.items():
        at = [r for r in runs if r.group == optimizer and not r.is_dp and r.config["workers"] == 4]
        tuned_lr = lr(best(at)) if at else None
        cells = []
        for m in momenta:
            hit = [r for r in at if r.config["outer.momentum"] == m and lr(r) == tuned_lr]
            cells.append(fmt(hit[0].loss) if hit else "")
        rows.append([f"{label}, K = 4, lr {tuned_lr:g}", *cells])
    parts.append(table(["outer momentum (outer lr 0.7)", *(f"{m:g}" for m in momenta)], rows))
    return "\n\n".join(parts)


# The study's tuning, as a sweep would declare it: each method's lrs (and K = 4's outer momenta) per K.
TUNED = TuneSpec(over=("inner.lr", "inner.adamw.lr", "outer.momentum"), per=("inner.optimizer", "workers"))


def workers(sweeps: dict[str, list[RunRecord]]) -> tuple[str, dict]:
    """Each method at its best per K against DP at its best, over paired seeds: `muloco report`'s tuned
    comparison (muloco/tools/tuning.py) over the tuning sweeps and the seed repeats together."""
    runs = [
        r
        for name in ("pico_tune", "pico_tune_outer", "pico_tune_workers", "pico_seeds")
        for r in sweeps.get(name, [])
    ]
    cells = tuned_comparison.tune(runs, varied_keys(runs), TUNED)
    comparisons = tuned_comparison.order(tuned_comparison.compare(cells), TUNED)
    rows, data = [], {}
    for c in comparisons:
        optimizer, K = c.cell.settings["inner.optimizer"], c.cell.settings["workers"]
        if optimizer not in OPTIMIZERS or c.dp is None or not c.seeds:
            continue
        run, dp = c.cell.by_seed[c.seeds[0]], c.dp.by_seed[c.seeds[0]]
        by_seed = {s: c.cell.by_seed[s].loss for s in c.seeds}
        rows.append(
            [
                OPTIMIZERS[optimizer],
                K,
                f"{lr(run):g}",
                run.config["outer.momentum"],
                fmt(c.loss),
                f"{fmt(c.dp_loss)} (lr {lr(dp):g})",
                f"{c.gap:+.2f}%",
                " / ".join(f"{g:+.2f}%" for g in c.gaps),
                len(c.seeds),
            ]
        )
        data[f"{optimizer}_k{K}"] = {"loss": c.loss, "dp": c.dp_loss, "seeds": by_seed}
    header = [
        "method",
        "K",
        "inner lr",
        "outer m",
        "final loss",
        "DP (tuned)",
        "gap",
        "gap per seed",
        "seeds",
    ]
    return table(header, rows), data


def paired(runs: list[RunRecord], axis: str, label: str, scale=lambda v: v) -> str:
    """For each value of `axis`: DiLoCo/MuLoCo vs the DP run of the same optimizer at that value."""
    rows = []
    for value in sorted({r.config[axis] for r in runs}):
        at = select(runs, **{axis.replace(".", "__"): value})
        row = [scale(value)]
        for optimizer in OPTIMIZERS:
            mine = [r for r in at if r.group == optimizer and not r.is_dp]
            dp = [r for r in at if r.group == optimizer and r.is_dp]
            outer = mine[0].summary.get("outer_steps") if mine else None
            row += [fmt(mean_loss(mine)), fmt(mean_loss(dp)), gap(mean_loss(mine), mean_loss(dp))]
        row.append(outer if outer is not None else "-")
        rows.append(row)
    header = [label, "DiLoCo", "DP AdamW", "gap", "MuLoCo", "DP Muon", "gap", "outer steps"]
    return table(header, rows)


def gap_points(
    runs: list[RunRecord], axis: str, x=lambda run: run.config
) -> dict[str, list[tuple[float, float]]]:
    """label -> [(x, gap %)] for a plot: each value of `axis`, DiLoCo/MuLoCo against its DP run there."""
    points: dict[str, list[tuple[float, float]]] = {}
    for value in sorted({r.config[axis] for r in runs}):
        at = select(runs, **{axis.replace(".", "__"): value})
        for optimizer, label in OPTIMIZERS.items():
            mine = [r for r in at if r.group == optimizer and not r.is_dp]
            dp = [r for r in at if r.group == optimizer and r.is_dp]
            if mine and dp:
                points.setdefault(label, []).append((x(mine[0]), (mean_loss(mine) / mean_loss(dp) - 1) * 100))
    return points


def plot_gaps(sweeps: dict[str, list[RunRecord]], workers_data: dict, directory: Path) -> list[Path]:
    from muloco.tools import plots

    directory.mkdir(parents=True, exist_ok=True)
    written = []
    outer = gap_points(
        sweeps.get("pico_outer_steps", []), "train.total_tokens", lambda r: r.summary["outer_steps"]
    )
    batch_runs = sweeps.get("pico_worker_batch", []) + [
        r for r in sweeps.get("pico_outer_steps", []) if r.config["train.total_tokens"] == 3072000
    ]
    batch = gap_points(batch_runs, "train.batch_tokens", lambda r: r.config["train.batch_tokens"] // 64 // 4)
    by_k: dict[str, list[tuple[float, float]]] = {}
    for key, row in workers_data.items():
        optimizer, k = key.split("_k")
        by_k.setdefault(OPTIMIZERS[optimizer], []).append((int(k), (row["loss"] / row["dp"] - 1) * 100))
    for name, series, xlabel in (
        ("pico_gap_vs_outer_steps.png", outer, "outer steps (K = 4, H = 15, 8 sequences per worker)"),
        ("pico_gap_vs_worker_batch.png", batch, "sequences per worker (K = 4, 3.1M tokens)"),
        ("pico_gap_vs_workers.png", by_k, "K (workers), each at its tuned lr"),
    ):
        if any(len(points) > 1 for points in series.values()):
            path = directory / name
            plots.series_plot(
                series,
                path,
                xlabel=xlabel,
                ylabel="% over own DP baseline (final val loss)",
                title="pico regime: gap to data-parallel training",
                log2_x=True,
                references={"DP": (0.0, "black")},
            )
            written.append(path)
    return written


def muon_settings(sweeps: dict[str, list[RunRecord]]) -> str:
    runs = sweeps.get("pico_muon_settings", []) + [
        r for r in sweeps.get("pico_tune", []) if r.group == "muon" and r.config["inner.lr"] == 0.02
    ]
    variants = {}
    for r in runs:
        c = r.config
        key = (
            c["inner.nesterov"],
            c["inner.ns_coefficients"],
            c["inner.weight_decay"],
            c.get("model.qkv", "fused"),
        )
        variants.setdefault(key, {})["dp" if r.is_dp else "k4"] = r.loss
    rows = []
    for (nesterov, coefficients, wd, qkv), losses in sorted(variants.items(), key=lambda kv: str(kv[0])):
        rows.append(
            [
                f"nesterov={str(nesterov).lower()}, ns={coefficients}, wd={wd:g}, qkv={qkv}",
                fmt(losses.get("k4")),
                fmt(losses.get("dp")),
                gap(losses.get("k4"), losses.get("dp")),
            ]
        )
    return table(["Muon settings", "MuLoCo K=4", "DP Muon", "gap"], rows)


def compression(sweeps: dict[str, list[RunRecord]]) -> str:
    fp32 = [
        r
        for name in ("pico_tune", "pico_seeds")
        for r in sweeps.get(name, [])
        if not r.is_dp
        and r.config["workers"] == 4
        and r.config["outer.momentum"] == 0.6
        and lr(r) == (0.003 if r.group == "adamw" else 0.02)
    ]
    runs = sweeps.get("pico_compression", []) + fp32
    rows = []
    for optimizer, label in OPTIMIZERS.items():
        mine = [r for r in runs if r.group == optimizer]
        base = {r.config["run.seed"]: r.loss for r in mine if r.config["compression.scheme"] == "none"}
        for scheme, bits, ef in (
            ("none", 32, False),
            ("statistical", 4, False),
            ("statistical", 2, False),
            ("statistical", 2, True),
        ):
            these = [
                r
                for r in mine
                if r.config["compression.scheme"] == scheme
                and (
                    scheme == "none"
                    or (r.config["compression.bits"] == bits and r.config["compression.error_feedback"] == ef)
                )
            ]
            by_seed = {r.config["run.seed"]: r.loss for r in these}
            diffs = [f"{(by_seed[s] / base[s] - 1) * 100:+.2f}%" for s in sorted(by_seed) if s in base]
            name = "fp32" if scheme == "none" else f"{bits}-bit{' + EF' if ef else ''}"
            rows.append(
                [label, name, " / ".join(fmt(by_seed[s]) for s in sorted(by_seed)), " / ".join(diffs)]
            )
    return table(["method", "pseudogradient", "final loss (seed 0 / 1)", "vs fp32 (seed 0 / 1)"], rows)


def quickstart(sweeps: dict[str, list[RunRecord]]) -> str:
    """The quickstart regime at K = 4: each method at several lrs against its DP baseline."""
    runs = sweeps.get("quickstart_retune", [])
    rows = []
    for optimizer, label in OPTIMIZERS.items():
        dp = best([r for r in runs if r.is_dp and r.group == optimizer])
        mine = sorted((r for r in runs if not r.is_dp and r.group == optimizer), key=lr)
        cells = [f"{lr(r):g}: {fmt(r.loss)} ({gap(r.loss, dp.loss if dp else None)})" for r in mine]
        rows.append(
            [label, f"{fmt(dp.loss) if dp else '-'} (lr {lr(dp):g})" if dp else "-", " · ".join(cells)]
        )
    return table(["method (K = 4)", "DP baseline", "inner lr: final loss (gap)"], rows)


def size(sweeps: dict[str, list[RunRecord]]) -> str:
    """The nano model at K = 4: every lr that ran, and the tuned gap (best run vs best DP run)."""
    runs = sweeps.get("pico_size", [])
    rows = []
    for optimizer, label in OPTIMIZERS.items():
        mine = [r for r in runs if r.group == optimizer and not r.is_dp]
        dp = [r for r in runs if r.group == optimizer and r.is_dp]
        if not mine or not dp:
            continue
        ran = " · ".join(f"{lr(r):g}: {fmt(r.loss)}" for r in sorted(mine, key=lr))
        dp_ran = " · ".join(f"{lr(r):g}: {fmt(r.loss)}" for r in sorted(dp, key=lr))
        rows.append([label, ran, dp_ran, gap(best(mine).loss, best(dp).loss)])
    return table(["method (nano, K = 4)", "K = 4, lr: loss", "DP, lr: loss", "gap (best vs best)"], rows)


ALIGNMENT_FIELDS = (
    "pseudograd_cosine",
    "cos_to_union",
    "mean_cos_to_union",
    "norm_retention",
    "top_sv_retention",
    "erank_workers",
    "erank_mean",
)


def alignment(sweeps: dict[str, list[RunRecord]]) -> str:
    rows = []
    for r in sorted(sweeps.get("pico_alignment", []), key=lambda r: (r.group, r.config["workers"])):
        syncs = [s for s in read_jsonl(r.path / "metrics.jsonl") if s.get("kind") == "sync"]
        later = syncs[len(syncs) // 2 :]  # the second half of the run: past the first rounds' transient
        values = [statistics.mean(s[f] for s in later if s.get(f) is not None) for f in ALIGNMENT_FIELDS]
        rows.append([r.group, r.config["workers"], *(f"{v:.3f}" for v in values), fmt(r.loss)])
    header = [
        "inner",
        "K",
        "pairwise cos",
        "cos to union",
        "mean's cos to union",
        "norm kept",
        "sigma_1 kept",
        "erank workers",
        "erank mean",
        "loss",
    ]
    return table(header, rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=ROOT)
    parser.add_argument("--json", type=Path, help="also write the numbers here")
    parser.add_argument("--plots", type=Path, help="write the gap plots (PNG) into this directory")
    args = parser.parse_args()
    sweeps = load(args.root)
    workers_table, workers_data = workers(sweeps)
    sections = {
        "Tuning (seed 0)": tuning(sweeps),
        "Gap to DP vs K (each at its tuned lr)": workers_table,
        "Gap vs outer steps (K = 4, H = 15)": paired(
            sweeps.get("pico_outer_steps", []), "train.total_tokens", "tokens", lambda v: f"{v / 1e6:g}M"
        ),
        "Gap vs per-worker batch at 3.1M tokens (K = 4)": paired(
            sweeps.get("pico_worker_batch", [])
            + [r for r in sweeps.get("pico_outer_steps", []) if r.config["train.total_tokens"] == 3072000],
            "train.batch_tokens",
            "sequences per worker",
            lambda v: v // 64 // 4,
        ),
        "K = 1 vs DP across global batch (3.1M tokens)": paired(
            sweeps.get("pico_k1_batch", []), "train.batch_tokens", "global sequences", lambda v: v // 64
        ),
        "Muon settings (K = 4 and DP, lr 0.02)": muon_settings(sweeps),
        "Compression (K = 4, H = 15, 100 outer steps)": compression(sweeps),
        "A larger model (nano, K = 4, 100 outer steps)": size(sweeps),
        "Quickstart regime (nano, 10 outer steps), K = 4 at several lrs": quickstart(sweeps),
        "Alignment (mean over the second half of the syncs, 30 outer steps)": alignment(sweeps),
    }
    for title, text in sections.items():
        print(f"### {title}\n\n{text}\n")
    if args.plots:
        for path in plot_gaps(sweeps, workers_data, args.plots):
            print(f"wrote {path}")
    if args.json:
        args.json.write_text(json.dumps({"tables": sections, "workers": workers_data}, indent=1))


if __name__ == "__main__":
    main()
