"""Repeat a test N times with the CPU kept busy by a burner process, and report how often it passed.

    python experiments/reliability/repeat_under_load.py [--repeats 10] [--burners 1] [--test NODEID]

The default test is the swarm kill test: 3 hivemind peers, one SIGKILLed at outer step 2 of 8, the two
survivors must finish every step with bitwise equal global parameters. A burner is a process spinning on
one core for the whole experiment (on this 2-core machine, one burner takes half of it away). Prints a
table and writes experiments/reliability/results/<test name>.json.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_TEST = "tests/comm/test_hivemind_training.py::test_a_killed_peer_costs_the_others_at_most_a_timeout"


def burn() -> None:
    while True:
        pass


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--burners", type=int, default=1, help="busy processes beside the test")
    parser.add_argument("--test", default=DEFAULT_TEST, help="a pytest node id")
    parser.add_argument("--timeout-s", type=float, default=600.0, help="per repeat")
    args = parser.parse_args()

    burners = [multiprocessing.Process(target=burn, daemon=True) for _ in range(args.burners)]
    for b in burners:
        b.start()
    rows = []
    try:
        for i in range(args.repeats):
            t0 = time.monotonic()
            command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", args.test]
            try:
                done = subprocess.run(
                    command, cwd=ROOT, capture_output=True, text=True, timeout=args.timeout_s
                )
                passed, tail = done.returncode == 0, done.stdout.strip().splitlines()[-1:]
            except subprocess.TimeoutExpired:
                passed, tail = False, [f"timed out after {args.timeout_s:.0f} s"]
            rows.append(
                {"repeat": i, "passed": passed, "seconds": round(time.monotonic() - t0, 1), "result": tail}
            )
            print(
                f"{i:>6}  {'pass' if passed else 'FAIL':<6}  {rows[-1]['seconds']:>7.1f} s  {tail}",
                flush=True,
            )
    finally:
        for b in burners:
            b.terminate()
            b.join(timeout=5)
    passes = sum(r["passed"] for r in rows)
    print(f"\n{passes}/{len(rows)} passed with {args.burners} burner(s): {args.test}")
    out = Path(__file__).with_name("results")
    out.mkdir(exist_ok=True)
    name = args.test.split("::")[-1]
    result = {
        "test": args.test,
        "burners": args.burners,
        "passed": passes,
        "repeats": len(rows),
        "runs": rows,
    }
    (out / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")
    return 0 if passes == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
