"""What checking a checkpoint's integrity costs: the `small` preset's checkpoint (the model, a Muon momentum
per parameter, the engine's global copy and outer momentum: 4 x 10.9M fp32 values, ~175 MB), saved and
loaded as a run does. Plain: load_checkpoint (CRC-32 of every zip record checked, then torch.load) against
torch.load alone; save_checkpoint (atomic: fsync, rename), and torch.save with its CRC-32s (on by default)
against torch.save with them turned off. Sharded (DCP): save_sharded, and the SHA-256 digests it writes and
checks (`_write_digests`, `verify_digests`) on their own. Interleaved repeats; median and spread.

    python experiments/benchmarks/bench_checkpoint_integrity.py --reps 5

Prints a table and writes experiments/benchmarks/results/bench_checkpoint_integrity.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
import warnings
from pathlib import Path

import torch

from muloco.checkpoint import plain, sharded
from muloco.comm.local import LocalBackend
from muloco.config import load_config
from muloco.models import build_model

OUT = Path(__file__).parent / "results" / "bench_checkpoint_integrity.json"


def run_like_state(preset: str) -> dict:
    torch.manual_seed(0)
    model = build_model(load_config(None, [f"model.preset={preset}"]).model, 256)
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    like = [torch.randn_like(p) for p in model.parameters()]
    return {
        "replicas": [{"model": weights, "optimizer": {"momentum": like}}],
        "engine": {"outer": {"params": [t.clone() for t in like], "momentum": [t.clone() for t in like]}},
        "progress": {"steps": 1200},
    }


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def torch_save(state: dict, directory: Path, crc: bool) -> None:
    torch.serialization.set_crc32_options(crc)
    try:
        torch.save(state, directory / "raw.pt")
    finally:
        torch.serialization.set_crc32_options(True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--preset", default="small")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")  # DCP without torch.distributed warns that it runs alone
    state = run_like_state(args.preset)
    seconds: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        path = plain.save_checkpoint(state, directory, 1, keep=1)
        size = path.stat().st_size
        step_dir = sharded.save_sharded(
            state, directory / "sharded", 1, 1, LocalBackend(), "replica0", True, {}
        )
        for _ in range(args.reps):  # interleaved: each measurement once per repeat
            for name, fn in (
                ("plain save (with CRC-32)", lambda: plain.save_checkpoint(state, directory, 1, keep=1)),
                ("torch.save, CRC-32 on", lambda: torch_save(state, directory, True)),
                ("torch.save, CRC-32 off", lambda: torch_save(state, directory, False)),
                ("plain load (CRC-32 checked)", lambda: plain.load_checkpoint(path)),
                ("plain load, torch.load alone", lambda: torch.load(path, weights_only=True)),
                ("plain CRC-32 check alone", lambda: plain.verify_archive(path)),
                (
                    "sharded save (with digests)",
                    lambda: sharded.save_sharded(
                        state, directory / "sharded", 1, 1, LocalBackend(), "replica0", True, {}
                    ),
                ),
                ("sharded SHA-256 write alone", lambda: sharded._write_digests(step_dir)),
                ("sharded SHA-256 check alone", lambda: sharded.verify_digests(step_dir)),
                ("sharded load", lambda: sharded.load_sharded(step_dir, "replica0", None)),
            ):
                seconds.setdefault(name, []).append(timed(fn))
    rows = [
        {"what": name, "median_s": statistics.median(v), "min_s": min(v), "max_s": max(v)}
        for name, v in seconds.items()
    ]
    print(f"checkpoint of the {args.preset} preset: {size / 1e6:.0f} MB; {args.reps} interleaved repeats")
    print(f"{'what':32} {'median s':>9} {'min':>7} {'max':>7}")
    for r in rows:
        print(f"{r['what']:32} {r['median_s']:9.3f} {r['min_s']:7.3f} {r['max_s']:7.3f}")
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(
        json.dumps({"preset": args.preset, "bytes": size, "reps": args.reps, "rows": rows}, indent=2)
    )
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
