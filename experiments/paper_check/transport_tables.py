"""all_gather vs reduce_scatter (sync.transport): final val loss per method, K, bits and error feedback, from
the sweeps pico_transport, pico_transport_owner_ef and pico_transport_mean_bits (docs/results.md,
"Transports"), and the quickstart check of the 400x target (quickstart_transport).

    muloco sweep configs/sweeps/pico_transport.yaml --jobs 2
    muloco sweep configs/sweeps/pico_transport_owner_ef.yaml --jobs 2
    muloco sweep configs/sweeps/pico_transport_mean_bits.yaml --jobs 2
    muloco sweep configs/sweeps/pico_transport_4bit_means8.yaml --jobs 2
    muloco sweep configs/sweeps/quickstart_transport.yaml --jobs 2
    python experiments/paper_check/transport_tables.py [--root runs/sweeps] [--json out.json]

The numbers of docs/results.md, "Transports", are in transport_results.json (written with --json).

"vs all_gather" is (reduce_scatter loss / all_gather loss - 1) x 100 for the same seed, then the mean over
seeds (each seed's pair shares data order and initialization, so the pair differs only in the transport).
The reduce_scatter column is the second stage at the same bits with the part owners' error feedback on
(pico_transport's runs with EF, pico_transport_owner_ef's without); "owners' EF off" is pico_transport's
runs without EF, whose owners had none; "wider means" re-quantizes the means at 4 bits for 2-bit messages
(pico_transport_mean_bits' runs with EF, pico_transport_owner_ef's without) and at 8 bits for 4-bit ones
(pico_transport_4bit_means8), the owners' EF on.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from muloco.tools.runs import RunRecord, load_runs

OPTIMIZERS = {"adamw": "DiLoCo (AdamW)", "muon": "MuLoCo (Muon)"}


def completed(directory: Path) -> list[RunRecord]:
    return [r for r in load_runs(directory) if r.completed] if directory.is_dir() else []


def pick(runs: list[RunRecord], **where) -> list[RunRecord]:
    return [r for r in runs if all(r.config.get(k.replace("__", ".")) == v for k, v in where.items())]


def by_seed(runs: list[RunRecord]) -> dict[int, float]:
    return {r.config["run.seed"]: r.loss for r in runs}


def pct(a: dict[int, float], b: dict[int, float]) -> list[float]:
    """Same-seed (a / b - 1) x 100 for the seeds both have."""
    return [100 * (a[s] / b[s] - 1) for s in sorted(a.keys() & b.keys())]


def fmt_losses(losses: dict[int, float]) -> str:
    return " / ".join(f"{losses[s]:.4f}" for s in sorted(losses)) or "-"


def fmt_pct(values: list[float]) -> str:
    if not values:
        return "-"
    return f"{statistics.mean(values):+.2f}% ({' / '.join(f'{v:+.2f}' for v in values)})"


def transport_table(
    main: list[RunRecord], owner_ef: list[RunRecord], wide: list[RunRecord], wide8: list[RunRecord]
) -> tuple[str, list[dict]]:
    lines = [
        "| method | K | bits | EF | all_gather (seed 0 / 1) | reduce_scatter (seed 0 / 1) | vs all_gather "
        "| owners' EF off | vs all_gather | wider means (2 -> 4, 4 -> 8 bits) | vs all_gather |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    rows = []
    for optimizer, label in OPTIMIZERS.items():
        for K in (4, 8):
            for bits in (8, 4, 2):
                for ef in (False, True):
                    cell = dict(inner__optimizer=optimizer, workers=K, compression__error_feedback=ef)
                    same = dict(**cell, compression__bits=bits)
                    gather = by_seed(pick(main, **same, sync__transport="all_gather"))
                    scatter_main = by_seed(pick(main, **same, sync__transport="reduce_scatter"))
                    scatter = (
                        scatter_main if ef else by_seed(pick(owner_ef, **same, compression__mean_bits=bits))
                    )
                    owner_off = {} if ef else scatter_main
                    wider = {}  # a wider second stage, owners' EF on: 4-bit means at 2 bits, 8-bit at 4
                    if bits == 2:
                        wider = by_seed(
                            pick(wide, **same) if ef else pick(owner_ef, **same, compression__mean_bits=4)
                        )
                    elif bits == 4:
                        wider = by_seed(pick(wide8, **same))
                    if not gather:
                        continue
                    rows.append(
                        {
                            "method": optimizer,
                            "K": K,
                            "bits": bits,
                            "error_feedback": ef,
                            "all_gather": gather,
                            "reduce_scatter": scatter,
                            "reduce_scatter_vs_all_gather_pct": pct(scatter, gather),
                            "owners_ef_off": owner_off,
                            "owners_ef_off_vs_all_gather_pct": pct(owner_off, gather),
                            "wider": wider,
                            "wider_vs_all_gather_pct": pct(wider, gather),
                        }
                    )
                    optional = [(owner_off, pct(owner_off, gather)), (wider, pct(wider, gather))]
                    extra = " | ".join(f"{fmt_losses(v)} | {fmt_pct(p)}" if v else " | " for v, p in optional)
                    lines.append(
                        f"| {label} | {K} | {bits} | {'yes' if ef else 'no'} | {fmt_losses(gather)} | "
                        f"{fmt_losses(scatter)} | {fmt_pct(pct(scatter, gather))} | {extra} |"
                    )
    return "\n".join(lines), rows


def summary_table(rows: list[dict]) -> str:
    """The mean same-seed difference per bits and second stage, over methods, K and EF."""
    lines = [
        "| bits | second stage | pairs | mean vs all_gather | best / worst cell (mean of its seeds) |",
        "|---|---|---|---|---|",
    ]
    stages = (
        ("reduce_scatter_vs_all_gather_pct", "same bits, owners' EF (the default at 8 bits)"),
        ("owners_ef_off_vs_all_gather_pct", "same bits, owners' EF off (no-EF cells)"),
        ("wider_vs_all_gather_pct", "twice the bits, owners' EF (the default at 2 and 4 bits)"),
    )
    for bits in (8, 4, 2):
        for key, stage in stages:
            cells = [r[key] for r in rows if r["bits"] == bits and r[key]]
            if not cells:
                continue
            pairs = [v for c in cells for v in c]
            means = [statistics.mean(c) for c in cells]
            lines.append(
                f"| {bits} | {stage} | {len(pairs)} | {statistics.mean(pairs):+.2f}% | "
                f"{min(means):+.2f}% / {max(means):+.2f}% |"
            )
    return "\n".join(lines)


def quickstart_table(runs: list[RunRecord]) -> tuple[str, list[dict]]:
    """MuLoCo at H = 30: fp32 vs 2-bit over both transports; bytes against DDP at equal tokens."""
    lines = [
        "| run | transport | owners' means | final loss (seed 0 / 1) | vs fp32 | MB sent per worker "
        "| DDP MB at equal tokens | x fewer than DDP |",
        "|---|---|---|---|---|---|---|---|",
    ]
    fp32 = by_seed(pick(runs, compression__scheme="none"))
    cases = (
        ("fp32", dict(compression__scheme="none")),
        ("2-bit", dict(compression__scheme="statistical", sync__transport="all_gather")),
        (
            "2-bit",
            dict(
                compression__scheme="statistical", sync__transport="reduce_scatter", compression__mean_bits=2
            ),
        ),
        (
            "2-bit",
            dict(
                compression__scheme="statistical", sync__transport="reduce_scatter", compression__mean_bits=4
            ),
        ),
    )
    rows = []
    for name, where in cases:
        chosen = pick(runs, **where)
        if not chosen:
            continue
        losses = by_seed(chosen)
        sent = statistics.mean(r.summary["bytes_sent_per_worker"] for r in chosen) / 1e6
        ddp = statistics.mean(r.summary["bytes_ddp_equivalent"] for r in chosen) / 1e6
        transport = chosen[0].summary["transport"]
        means = f"{where['compression__mean_bits']}-bit" if "compression__mean_bits" in where else "-"
        versus = pct(losses, fp32) if name != "fp32" else []
        rows.append(
            {
                "run": name,
                "transport": transport,
                "mean_bits": where.get("compression__mean_bits"),
                "losses": losses,
                "vs_fp32_pct": versus,
                "mb_sent": sent,
                "ddp_mb": ddp,
            }
        )
        lines.append(
            f"| MuLoCo {name} | {transport} | {means} | {fmt_losses(losses)} | {fmt_pct(versus)} | "
            f"{sent:.2f} | {ddp:.1f} | {ddp / sent:.0f} |"
        )
    return "\n".join(lines), rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", type=Path, default=Path("runs/sweeps"))
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    main_runs = completed(args.root / "pico_transport")
    owner_runs = completed(args.root / "pico_transport_owner_ef")
    wide_runs = completed(args.root / "pico_transport_mean_bits")
    wide8_runs = completed(args.root / "pico_transport_4bit_means8")
    table, rows = transport_table(main_runs, owner_runs, wide_runs, wide8_runs)
    counts = f"{len(main_runs)} + {len(owner_runs)} + {len(wide_runs)} + {len(wide8_runs)} runs"
    print(f"## pico: all_gather vs reduce_scatter ({counts})\n\n{table}\n")
    print(f"## by bits\n\n{summary_table(rows)}\n")
    quick, quick_rows = quickstart_table(completed(args.root / "quickstart_transport"))
    print(f"## quickstart, MuLoCo H = 30\n\n{quick}")
    if args.json:
        args.json.write_text(json.dumps({"pico": rows, "quickstart": quick_rows}, indent=1, default=str))


if __name__ == "__main__":
    main()
