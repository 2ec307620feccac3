"""Which optimizers a user can name train under muloco, and resume bit for bit (issue 38).

For every torch.optim class and every pytorch-optimizer catalogue name: the config check (refused with
its one line, or accepted), then a tiny MuLoCo-layout run (K = 2 workers, 4 outer steps of H = 3, state
kept across syncs, a checkpoint every outer step), then a resume from the first checkpoint, compared
bitwise with the uninterrupted run. Not a quality comparison: one lr (inner.lr) for all, no tuning.

    python experiments/optimizers/catalogue_survey.py                   # every name (~10 min on 2 cores)
    python experiments/optimizers/catalogue_survey.py --names lion soap  # some
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import tempfile
import time
from pathlib import Path

import torch

from muloco.checkpoint.plain import list_checkpoints
from muloco.errors import UserError
from muloco.optim.catalogue import torch_optim_names
from muloco.optim.check import load_run_config as load_config
from muloco.run.trainer import Trainer

TINY = [
    "model.preset=nano",
    "model.d_model=32",
    "model.n_layers=2",
    "model.n_heads=2",
    "model.seq_len=32",
    "train.batch_tokens=512",
    "train.total_tokens=6144",
    "train.eval_every=4",
    "train.eval_tokens=512",
    "train.warmup_steps=2",
    "train.threads=1",
    "logging.progress=off",
    "sync.every=3",
    "workers=2",
    "checkpoint.every=1",
    "checkpoint.keep=10",
]


def survey(name: str, lr: float, scratch: Path) -> dict:
    overrides = [*TINY, f"inner.optimizer={name}", f"inner.lr={lr}", f"run.output_dir={scratch / 'full'}"]
    try:
        cfg = load_config(None, overrides)
    except (UserError, ValueError) as exc:
        return {"name": name, "outcome": "refused", "reason": str(exc).splitlines()[-1][:300]}
    started = time.perf_counter()
    try:
        full = Trainer(cfg)
        summary = full.run()
        resumed_dir = scratch / "resumed"
        shutil.copytree(full.run_dir, resumed_dir / full.cfg.run.name)
        for path in list_checkpoints(resumed_dir / full.cfg.run.name / "checkpoints")[1:]:
            path.unlink()
        resumed = Trainer(load_config(None, [*overrides, f"run.output_dir={resumed_dir}"]))
        resumed.run()
    except Exception as exc:  # a third-party class failing mid-run is what the survey is for
        return {"name": name, "outcome": "failed", "reason": f"{type(exc).__name__}: {exc}"[:300]}
    pairs = zip(full.replicas[0].model.parameters(), resumed.replicas[0].model.parameters(), strict=True)
    bitwise = all(torch.equal(a.detach(), b.detach()) for a, b in pairs)
    return {
        "name": name,
        "outcome": "trains, resumes bitwise" if bitwise else "trains, resume differs",
        "final_val_loss": summary["final_val_loss"],
        "seconds": round(time.perf_counter() - started, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--names", nargs="*", help="optimizer names (default: every one)")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "catalogue_survey.json"))
    args = parser.parse_args()
    logging.disable(logging.WARNING)
    names = args.names
    if not names:
        import pytorch_optimizer

        names = [*torch_optim_names(), *pytorch_optimizer.get_supported_optimizers()]
    rows = []
    for name in names:
        with tempfile.TemporaryDirectory() as scratch:
            rows.append(survey(name, args.lr, Path(scratch)))
        row = rows[-1]
        loss = f"{row['final_val_loss']:.4f}" if "final_val_loss" in row else ""
        print(f"{name:22s} {row['outcome']:26s} {loss:8s} {row.get('reason', '')[:90]}", flush=True)
    counts: dict[str, int] = {}
    for row in rows:
        counts[row["outcome"]] = counts.get(row["outcome"], 0) + 1
    print("\n| outcome | optimizers |\n|---|---|")
    for outcome, n in sorted(counts.items()):
        print(f"| {outcome} | {n} |")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    versions = {"torch": torch.__version__}
    try:
        import pytorch_optimizer

        versions["pytorch_optimizer"] = pytorch_optimizer.__version__
    except (ImportError, AttributeError):
        pass
    out.write_text(
        json.dumps({"lr": args.lr, "versions": versions, "counts": counts, "rows": rows}, indent=1)
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
