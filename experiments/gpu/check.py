"""The GPU check behind experiments/gpu/check.sh: every step runs with its own time limit and a failed
step does not stop the others (a lent GPU's minutes are scarce), then one markdown summary is written.

Steps (full; --smoke runs each on the CPU at a tiny size, so the script is tested and cannot rot):
1. environment: GPU, driver-visible memory, torch, CUDA, cuDNN, CPU count;
2. `pytest -m cuda` (tests/cuda/);
3. one Muon step vs torch.optim.Muon on the matrices of a d_model 1024 / 12-layer GPT (bf16 NS);
4. forward/backward of K = 8 replicas one after another vs one vmap call vs DP's union batch;
5. simulated K = 1/4/8/16 vs DP tokens/s for the `small` preset, sequential vs batched, and K = 8 with
   offload (peak memory next to K = 1);
6. the same at >= 100M parameters (d_model 1024, 12 layers: 151M): DP, K = 1, K = 8 batched/sequential,
   K = 8 with offload.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "experiments" / "benchmarks"


def environment() -> dict:
    import torch

    facts = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "cpus": os.cpu_count(),
        "gpus": [],
    }
    for i in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(i)
        facts["gpus"].append(
            {
                "name": props.name,
                "memory_gib": round(props.total_memory / 2**30, 1),
                "capability": props.major,
            }
        )
    return facts


def steps(smoke: bool, out: Path) -> list[tuple[str, list[str], int]]:
    """(name, command, time limit in s) per step."""
    py = sys.executable
    # -n 0: one process (pyproject's -n auto would start a worker per core, each importing torch, for one GPU)
    pytest = [
        py,
        "-m",
        "pytest",
        "-m",
        "cuda",
        "-q",
        "-n",
        "0",
        "-p",
        "no:cacheprovider",
        str(ROOT / "tests" / "cuda"),
    ]
    if smoke:
        sim = ["--device", "cpu", "--in-process", "--steps", "3", "--repeats", "1", "--seqs", "1"]
        return [
            ("pytest -m cuda", pytest, 120),
            (
                "Muon step vs torch.optim.Muon",
                [py, str(BENCH / "bench_muon.py"), "--device", "cpu", "--d-model", "64", "--n-layers", "2"]
                + ["--steps", "2", "--warmup", "1", "--out", str(out / "bench_muon.json")],
                120,
            ),
            (
                "forward/backward: loop vs vmap vs DP",
                [
                    py,
                    str(BENCH / "bench_batched_forward.py"),
                    "--device",
                    "cpu",
                    "--preset",
                    "pico",
                    "--k",
                    "2",
                ]
                + [
                    "--seqs",
                    "1",
                    "--rounds",
                    "1",
                    "--steps",
                    "1",
                    "--out",
                    str(out / "bench_batched_forward.json"),
                ],
                60,
            ),
            (
                "simulated workers vs DP (pico)",
                [py, str(BENCH / "bench_simulation.py"), *sim, "--preset", "pico", "--workers", "1", "2"]
                + ["--out", str(out / "bench_simulation_small.json")],
                120,
            ),
        ]
    sim = ["--device", "cuda", "--in-process", "--seqs", "4", "--inner", "muon"]
    return [
        ("pytest -m cuda", pytest, 240),
        (
            "Muon step vs torch.optim.Muon (d1024/L12, bf16)",
            [py, str(BENCH / "bench_muon.py"), "--device", "cuda", "--d-model", "1024", "--n-layers", "12"]
            + ["--out", str(out / "bench_muon.json")],
            90,
        ),
        (
            "forward/backward: loop vs vmap vs DP (small, K=8)",
            [py, str(BENCH / "bench_batched_forward.py"), "--device", "cuda", "--preset", "small", "--k", "8"]
            + ["--out", str(out / "bench_batched_forward.json")],
            60,
        ),
        (
            "simulated workers vs DP (small, 10.8M)",
            [
                py,
                str(BENCH / "bench_simulation.py"),
                *sim,
                "--preset",
                "small",
                "--workers",
                "1",
                "4",
                "8",
                "16",
            ]
            + ["--steps", "20", "--repeats", "3", "--out", str(out / "bench_simulation_small.json")],
            180,
        ),
        (
            "simulated workers vs DP (d1024/L12, 151M)",
            [py, str(BENCH / "bench_simulation.py"), *sim, "--preset", "base", "--workers", "1", "8"]
            + ["--model", "d_model=1024", "n_heads=16", "--steps", "8", "--repeats", "3"]
            + ["--out", str(out / "bench_simulation_151m.json")],
            150,
        ),
    ]


def run_step(name: str, command: list[str], limit_s: int) -> dict:
    print(f"\n=== {name} (limit {limit_s} s)", flush=True)
    t0 = time.monotonic()
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=limit_s, cwd=ROOT)
        rc, output = done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired as exc:
        rc = "timeout"
        output = (exc.stdout or b"").decode(errors="replace") + (exc.stderr or b"").decode(errors="replace")
    seconds = round(time.monotonic() - t0, 1)
    tail = "\n".join(line for line in output.splitlines() if not line.startswith("  done "))[-6000:]
    print(tail, flush=True)
    print(f"=== {name}: rc={rc} in {seconds} s", flush=True)
    return {"step": name, "command": " ".join(command), "rc": rc, "seconds": seconds, "output": tail}


def summary_markdown(env: dict, results: list[dict], smoke: bool) -> str:
    gpus = ", ".join(f"{g['name']} ({g['memory_gib']} GiB)" for g in env["gpus"]) or "none"
    lines = [
        f"# GPU check{' (smoke, CPU)' if smoke else ''}",
        "",
        f"GPU: {gpus}; torch {env['torch']}, CUDA {env['cuda']}, cuDNN {env['cudnn']}, "
        f"{env['cpus']} CPUs, Python {env['python']}.",
        "",
        "| step | rc | seconds |",
        "|---|---|---:|",
        *(f"| {r['step']} | {r['rc']} | {r['seconds']} |" for r in results),
    ]
    for r in results:
        lines += ["", f"## {r['step']}", "", f"`{r['command']}`", "", "```", r["output"].strip(), "```"]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="the same steps on the CPU, tiny (< 1 min)")
    parser.add_argument("--out", type=Path, default=None, help="default: $OUT or experiments/gpu/results")
    args = parser.parse_args()
    out = args.out or Path(os.environ.get("OUT") or ROOT / "experiments" / "gpu" / "results")
    out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    env = environment()
    print(json.dumps(env, indent=2), flush=True)
    if not args.smoke and not env["gpus"]:
        print(
            "check.sh: no CUDA device here; run it on the GPU machine, or --smoke on a CPU", file=sys.stderr
        )
        return 2
    results = [run_step(*step) for step in steps(args.smoke, out)]
    total = round(time.monotonic() - started, 1)
    report = {"smoke": args.smoke, "environment": env, "steps": results, "total_s": total}
    (out / "check.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "check.md").write_text(summary_markdown(env, results, args.smoke))
    failed = [r["step"] for r in results if r["rc"] != 0]
    print(f"\ncheck: {len(results) - len(failed)}/{len(results)} steps passed in {total} s; results in {out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
