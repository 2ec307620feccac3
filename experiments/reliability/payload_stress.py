"""A loaded swarm with many small syncs: how many downloads arrive with bytes that do not match their token
(and what those bytes are), and whether every peer ends with the same model (issue 37).

    python experiments/reliability/payload_stress.py [--peers 4] [--syncs 150] [--burners 2]
        [--testbed-mbit 100 [--testbed-delay-ms 50]] [--repeats 1]

N hivemind peers of a tiny model sync after every inner step (one sync = N x (N - 1) downloads), on
loopback (`muloco launch`) or, with --testbed-mbit, one peer per host of the namespace testbed (links of
that rate and, with --testbed-delay-ms, that one-way delay through the hub's delay line; needs root).
Burner processes keep the CPU busy throughout. MULOCO_PAYLOAD_DUMP is on
(muloco/comm/hivemind/mismatch.py): every served payload and every mismatched download is kept and
classified (truncated, reordered, another payload, bytes flipped, ...). Downloads cut short that the
transfer layer detects by the messages' count and sizes (and asks for again) are counted apart ("cut
short"). Prints a table and writes experiments/reliability/results/payload_stress-<loopback|testbed>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from burners import burners  # experiments/reliability/burners.py, beside this script

from muloco.comm.hivemind import mismatch

ROOT = Path(__file__).resolve().parents[2]
CONFIG = str(ROOT / "configs/quickstart.yaml")
SYNC_LINE = re.compile(r"hivemind sync fragment=\d+ step=\d+ group=(\d+)")


def overrides(peers: int, syncs: int, out: Path) -> list[str]:
    batch = 128 * peers
    return [
        "model.preset=nano",
        "model.d_model=32",
        "model.n_layers=2",
        "model.n_heads=2",
        "model.seq_len=32",
        f"workers={peers}",
        f"train.batch_tokens={batch}",
        f"train.total_tokens={batch * syncs}",
        "train.warmup_steps=2",
        f"train.eval_every={10**9}",
        "train.eval_tokens=512",
        "sync.every=1",  # a sync after every inner step: as many downloads as the run can make
        "logging.progress=off",
        f"backend.hivemind.target_group_size={peers}",
        "backend.hivemind.averaging_timeout=15",
        f"run.output_dir={out / 'runs'}",
        "run.name=stress",
    ]


def run_loopback(args, out: Path, env: dict[str, str]) -> tuple[list[int | None], str]:
    cmd = [sys.executable, "-m", "muloco", "launch", "--nproc", str(args.peers), "--backend", "hivemind"]
    cmd += [CONFIG, *overrides(args.peers, args.syncs, out)]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.timeout_s)
    return [done.returncode], done.stderr


def run_testbed(args, out: Path, env: dict[str, str]) -> tuple[list[int | None], str]:
    from muloco.testbed.network import Testbed
    from muloco.testbed.train import train_on_testbed

    os.environ.update(env)  # the testbed's processes inherit this process's environment
    with Testbed(args.peers, args.testbed_mbit, delay_ms=args.testbed_delay_ms) as testbed:
        run = train_on_testbed(
            testbed,
            CONFIG,
            overrides(args.peers, args.syncs, out),
            out / "logs",
            backend="hivemind",
            timeout_s=args.timeout_s,
        )
    return run.returncodes, "".join(Path(log).read_text() for log in run.logs)


def classify_dumps(dump: Path) -> Counter:
    served = {p.stem: mismatch.decode(p.read_bytes()) for p in (dump / "served").glob("*.bin")}
    kinds: Counter = Counter()
    for path in sorted((dump / "received").glob("*.bin")):
        token = path.stem.split("-")[-2]
        others = {t: payload for t, payload in served.items() if t != token}
        kinds[mismatch.classify(mismatch.decode(path.read_bytes()), served.get(token), others)] += 1
    return kinds


def one_run(args, repeat: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="muloco-stress-") as tmp:
        out = Path(tmp)
        env = {**os.environ, mismatch.DUMP_ENV: str(out / "dump"), "OMP_NUM_THREADS": "1"}
        t0 = time.monotonic()
        codes, log = (run_testbed if args.testbed_mbit else run_loopback)(args, out, env)
        seconds = time.monotonic() - t0
        downloads = sum(int(g) - 1 for g in SYNC_LINE.findall(log))
        summaries = [
            json.loads(p.read_text()) for p in sorted((out / "runs").glob("stress-peer*/summary.json"))
        ]
        excluded: Counter = Counter()
        for s in summaries:
            excluded.update(s.get("contributions_excluded", {}))
        return {
            "repeat": repeat,
            "returncodes": codes,
            "seconds": round(seconds, 1),
            "peers_completed": sum(s["status"] == "completed" for s in summaries),
            "downloads": downloads,
            "cut_short_downloads": log.count("arrived cut short ("),  # detected and asked again
            "mismatched_downloads": log.count("do not match its token"),
            "mismatch_kinds": dict(classify_dumps(out / "dump")),
            "contributions_excluded": dict(excluded),
            "final_digests": len({s.get("final_state_digest") for s in summaries}),
            "realigned_at_end": sum(bool(s.get("realigned_at_end")) for s in summaries),
        }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--syncs", type=int, default=150)
    parser.add_argument("--burners", type=int, default=2)
    parser.add_argument("--testbed-mbit", type=float, default=None, help="one peer per testbed host")
    parser.add_argument("--testbed-delay-ms", type=float, default=0.0, help="one-way delay between hosts")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--timeout-s", type=float, default=1200.0)
    args = parser.parse_args()

    with burners(args.burners):
        rows = [one_run(args, i) for i in range(args.repeats)]

    mode = f"testbed {args.testbed_mbit:g} Mbit/s" if args.testbed_mbit else "loopback"
    if args.testbed_mbit and args.testbed_delay_ms:
        mode += f", {args.testbed_delay_ms:g} ms one way"
    print(f"{args.peers} peers, {args.syncs} syncs, {args.burners} burners, {mode}")
    print(
        f"{'run':>3} {'ok':>4} {'s':>7} {'downloads':>9} {'cut short':>9} {'mismatched':>10} {'kinds':<30} "
        f"{'digests':>7} excluded"
    )
    for r in rows:
        ok = "yes" if r["peers_completed"] == args.peers and all(c == 0 for c in r["returncodes"]) else "NO"
        kinds = json.dumps(r["mismatch_kinds"]) if r["mismatch_kinds"] else "-"
        print(
            f"{r['repeat']:>3} {ok:>4} {r['seconds']:>7.1f} {r['downloads']:>9} "
            f"{r['cut_short_downloads']:>9} "
            f"{r['mismatched_downloads']:>10} {kinds:<30} {r['final_digests']:>7} "
            f"{r['contributions_excluded']}"
        )
    out = Path(__file__).with_name("results")
    out.mkdir(exist_ok=True)
    name = "testbed" if args.testbed_mbit else "loopback"
    if args.testbed_mbit and args.testbed_delay_ms:
        name += f"-delay{args.testbed_delay_ms:g}ms"
    result = {"peers": args.peers, "syncs": args.syncs, "burners": args.burners, "mode": mode, "runs": rows}
    (out / f"payload_stress-{name}.json").write_text(json.dumps(result, indent=2) + "\n")
    good = all(r["final_digests"] == 1 and r["peers_completed"] == args.peers for r in rows)
    return 0 if good else 1


if __name__ == "__main__":
    sys.exit(main())
