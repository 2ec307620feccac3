"""Repeat tests N times with the CPU kept busy by burner processes, and report how often each passed.

    python experiments/reliability/repeat_under_load.py [--repeats 10] [--burners 2] [--test NODEID ...]

By default every hivemind slow test that runs a swarm (SWARM_TESTS), interleaved: repeat 1 of each test,
then repeat 2 of each, ... so that a slow phase of the machine hits every test alike. A burner is a process
spinning on one core for the whole experiment (on this 2-core machine, two burners take as much CPU as the
test gets). Prints a table (passes, seconds min-max, the failures' last lines) and writes
experiments/reliability/results/<name>.json (`--name`, default `swarm_tests` or the one test's name). A
failed run's pytest directory (its peers' logs and run directories) is kept under the temp directory and
named in the JSON (`kept`).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from burners import burners  # experiments/reliability/burners.py, beside this script

ROOT = Path(__file__).resolve().parents[2]
KEPT = Path(tempfile.gettempdir())  # failed runs' pytest directories stay here (printed and in the JSON)
SWARM_TESTS = [
    "tests/comm/test_hivemind_training.py::test_three_peers_average_every_sync_and_stay_equal",
    "tests/comm/test_hivemind_training.py::test_a_killed_peer_costs_the_others_at_most_a_timeout",
    "tests/comm/test_hivemind_training.py::test_a_late_joiner_catches_up_and_another_run_id_never_mixes",
    "tests/comm/hivemind/test_security.py::test_a_peer_whose_model_drifted_is_realigned_at_the_next_sync_or_by_the_final_agreement",
    "tests/comm/hivemind/test_security.py::test_an_insider_sending_malformed_payloads_at_every_sync_cannot_stop_the_others",
    "tests/comm/hivemind/test_security.py::test_a_slow_peer_falls_behind_catches_up_and_finishes_with_the_others",
    "tests/comm/hivemind/test_security.py::test_an_intruder_without_the_key_changes_nothing_and_is_named",
]


def run_once(test: str, timeout_s: float) -> dict:
    t0 = time.monotonic()
    # Each run in a directory of its own, kept when it fails: the peers' logs and run directories are the
    # evidence (pytest itself keeps only its last 3 base directories).
    basetemp = Path(tempfile.mkdtemp(prefix=f"repeat_{test.split('::')[-1][:40]}_", dir=KEPT))
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--basetemp={basetemp}", test]
    try:
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s)
        passed, lines = done.returncode == 0, done.stdout.strip().splitlines()
        # The summary line, and for a failure the assertion that failed.
        tail = lines[-1:] if passed else [x for x in lines if x.startswith("E ")][:3] + lines[-1:]
        if not passed and not tail:  # pytest itself failed (collection, an import): stderr says why
            tail = done.stderr.strip().splitlines()[-3:]
    except subprocess.TimeoutExpired:
        passed, tail = False, [f"timed out after {timeout_s:.0f} s"]
    if passed:
        shutil.rmtree(basetemp, ignore_errors=True)
    row = {"passed": passed, "seconds": round(time.monotonic() - t0, 1), "result": tail}
    return row if passed else {**row, "kept": str(basetemp)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--burners", type=int, default=2, help="busy processes beside the tests")
    parser.add_argument("--test", action="append", help="a pytest node id (repeatable); default: SWARM_TESTS")
    parser.add_argument("--timeout-s", type=float, default=600.0, help="per run of a test")
    parser.add_argument("--name", default=None, help="the results file's name")
    args = parser.parse_args()
    tests = args.test or SWARM_TESTS

    runs: dict[str, list[dict]] = {test: [] for test in tests}
    out = Path(__file__).with_name("results")
    out.mkdir(exist_ok=True)
    name = args.name or ("swarm_tests" if len(tests) > 1 else tests[0].split("::")[-1])

    def save(repeats_done: int) -> None:  # after every run: a stopped experiment keeps what it measured
        result = {"burners": args.burners, "repeats": repeats_done, "tests": runs}
        (out / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")

    with burners(args.burners):
        for i in range(args.repeats):
            for test in tests:
                row = run_once(test, args.timeout_s)
                runs[test].append({"repeat": i, **row})
                save(i + 1)
                verdict = "pass" if row["passed"] else "FAIL"
                print(
                    f"{i:>3}  {verdict:<5} {row['seconds']:>7.1f} s  {test.split('::')[-1]}  {row['result']}",
                    flush=True,
                )

    print(f"\n{args.repeats} repeats with {args.burners} burner(s)")
    print(f"{'test':<92} {'passed':>8} {'seconds (min-max)':>18}")
    for test, rows in runs.items():
        passes, seconds = sum(r["passed"] for r in rows), [r["seconds"] for r in rows]
        span = f"{min(seconds):.1f}-{max(seconds):.1f}"
        print(f"{test.split('::')[-1]:<92} {passes:>4}/{len(rows):<3} {span:>18}")
    save(args.repeats)
    return 0 if all(r["passed"] for rows in runs.values() for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
