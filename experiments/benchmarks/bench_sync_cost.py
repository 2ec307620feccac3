"""The local cost of one sync: at pico against the compute of a round, and at 125M / 1B parameters in
seconds per GB of fp32 pseudogradient, through each codec and transport (issue 59, part 3).

1. pico (`--pico`): the pico regime (K = 4 replicas simulated in one process, H = 15, one torch thread) with
   MuLoCo 4-bit (statistical, row-wise, error feedback; sync.transport auto = reduce-scatter) or any
   --overrides. Each round's inner steps (all K replicas) and its sync event (engine.round: encode, the
   local backend's collectives, decode, average, the outer step) are timed apart; the table gives the
   median sync / compute per round. With --old REV, that git revision runs the same, interleaved (a
   worktree first on PYTHONPATH), so the cut is measured side by side.
2. sizes (`--sizes`): one worker's share of one sync of a model of 125M or 1B parameters (the GPT
   presets' shapes, synthetic Gaussian pseudogradients with 0.1% outliers x20) at K = 4, through the codec
   code the engine runs. All-gather: encode its message (error feedback), decode the K messages and
   average them. Reduce-scatter: encode its K parts, average its own part from K contributions and
   re-quantize the mean (owner error feedback), decode the K means. The other workers' messages are copies
   of its own (decoding costs the same); the collective itself (bytes over a link) is not in it:
   bench_transport.py measures that. Reported in seconds per GB of fp32 pseudogradient.

    python experiments/benchmarks/bench_sync_cost.py --pico --old b8fa73f --repeats 3
    python experiments/benchmarks/bench_sync_cost.py --sizes 125M,1B --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OUT = Path(__file__).parent / "results" / "bench_sync_cost.json"
PICO = [
    "compression.scheme=statistical",
    "compression.bits=4",
    "compression.granularity=row",
    "compression.error_feedback=true",
    "inner.lr=0.01",
    "train.total_tokens=614400",  # 300 steps: 20 rounds of H = 15
    "train.eval_every=0",
    "train.threads=1",
    "logging.progress=off",
    "checkpoint.every=0",
]
SKIP_ROUNDS = 2  # the first rounds warm up (allocations, first-call costs)
CODECS = {
    "fp32": {"scheme": "none"},
    "bf16": {"scheme": "bf16"},
    "8-bit": {"scheme": "statistical", "bits": 8},
    "4-bit": {"scheme": "statistical", "bits": 4},
    "2-bit": {"scheme": "statistical", "bits": 2},
    "4-bit linear": {"scheme": "linear", "bits": 4},
}
# GPT shapes (d_model, layers) over a 50,304-token vocabulary, the embedding tied to the head: GPT-2 small
# (124M) and a 1B model of the same form (18 x 12 x 2048**2 + 50,304 x 2048 = 1.009B).
SIZES = {"125M": (768, 12), "1B": (2048, 18)}
VOCAB = 50304


def gpt_shapes(d_model: int, layers: int) -> list[tuple[str, tuple[int, ...]]]:
    """The parameters a sync carries for a GPT of this size: (name, shape), embedding first."""
    out = [("embedding", (VOCAB, d_model))]
    for i in range(layers):
        out += [
            (f"h{i}.norm1", (d_model,)),
            (f"h{i}.qkv", (3 * d_model, d_model)),
            (f"h{i}.proj", (d_model, d_model)),
            (f"h{i}.norm2", (d_model,)),
            (f"h{i}.fc", (4 * d_model, d_model)),
            (f"h{i}.fc_out", (d_model, 4 * d_model)),
        ]
    return [*out, ("norm_f", (d_model,))]


def pico_child(overrides: list[str]) -> dict:
    """One pico run (this process's muloco, whichever is first on the path): per-round times."""
    from muloco.optim.check import load_run_config
    from muloco.run.trainer import Trainer

    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_run_config(
            str(ROOT / "configs" / "pico.yaml"), [*PICO, f"run.output_dir={tmp}", *overrides]
        )
        trainer = Trainer(cfg)
        compute, sync = [], []
        run_until, engine_round = trainer.inner.run_until, trainer.engine.round

        def timed_run_until(end):
            t = time.perf_counter()
            run_until(end)
            compute.append(time.perf_counter() - t)

        def timed_round(*args, **kwargs):
            t = time.perf_counter()
            out = list(engine_round(*args, **kwargs))
            sync.append(time.perf_counter() - t)
            return out

        trainer.inner.run_until, trainer.engine.round = timed_run_until, timed_round
        trainer.run()
    compute, sync = compute[SKIP_ROUNDS:], sync[SKIP_ROUNDS:]
    return {
        "compute_s": statistics.median(compute),
        "sync_s": statistics.median(sync),
        "sync_over_compute": statistics.median(s / c for s, c in zip(sync, compute, strict=True)),
        "rounds": len(sync),
    }


def run_pico(revision: str | None, overrides: list[str], worktree: Path | None) -> dict:
    env = dict(os.environ, PYTHONPATH=str(worktree or ROOT))
    cmd = [sys.executable, __file__, "--pico-child", "--overrides", *overrides]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900, cwd=worktree or ROOT)
    if done.returncode != 0:
        sys.exit(f"bench_sync_cost: the pico run of {revision or 'HEAD'} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def pico(args) -> dict:
    revisions = {"new": None}
    trees = {}
    if args.old:
        tmp = Path(tempfile.mkdtemp(prefix="bench_sync_cost_"))
        trees["old"] = tmp / "old"
        subprocess.run(["git", "worktree", "add", "--detach", str(trees["old"]), args.old], cwd=ROOT,
                       check=True, capture_output=True)  # fmt: skip
        revisions = {"old": args.old, "new": None}
    runs: dict[str, list[dict]] = {k: [] for k in revisions}
    try:
        for rep in range(args.repeats):
            for key, rev in revisions.items():
                r = run_pico(rev, args.overrides, trees.get(key))
                runs[key].append(r)
                share = 100 * r["sync_over_compute"]
                print(f"rep {rep} {key}: compute {r['compute_s'] * 1e3:.0f} ms/round, sync "
                      f"{r['sync_s'] * 1e3:.1f} ms ({share:.1f}%)", flush=True)  # fmt: skip
    finally:
        for tree in trees.values():
            subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT, capture_output=True)
    table = {}
    for key, rs in runs.items():
        table[key] = {
            "revision": revisions[key] or git_head(),
            **{
                f: {
                    "median": statistics.median(r[f] for r in rs),
                    "min": min(r[f] for r in rs),
                    "max": max(r[f] for r in rs),
                }  # fmt: skip
                for f in ("compute_s", "sync_s", "sync_over_compute")
            },
            "runs": rs,
        }
    print(f"\n{'revision':<12} {'compute/round':>14} {'sync':>10} {'sync/compute (min-max)':>26}")
    for t in table.values():
        s, compute_ms, sync_ms = (
            t["sync_over_compute"],
            t["compute_s"]["median"] * 1e3,
            t["sync_s"]["median"] * 1e3,
        )
        print(f"{t['revision'][:10]:<12} {compute_ms:>11.0f} ms {sync_ms:>7.1f} ms "
              f"{100 * s['median']:>10.1f}% ({100 * s['min']:.1f}-{100 * s['max']:.1f}%)")  # fmt: skip
    return {"overrides": [*PICO, *args.overrides], "repeats": args.repeats, "table": table}


def synthetic(shapes: list[tuple[int, ...]], seed: int):
    import torch

    g = torch.Generator().manual_seed(seed)
    out = []
    for shape in shapes:
        x = torch.randn(shape, generator=g).mul_(1e-3)
        x.view(-1)[torch.randint(x.numel(), (max(1, x.numel() // 1000),), generator=g)] *= 20
        out.append(x)
    return out


def one_sync(transport: str, codec_cfg: dict, names, shapes, delta, workers: int) -> float:
    """Seconds of one worker's local share of one sync (see the module docstring)."""
    import torch

    from muloco.compress import ErrorFeedback, get_compressor
    from muloco.sync.codec import PseudogradientCodec, pack
    from muloco.sync.scatter import PartitionedCodec

    opts = {k: v for k, v in codec_cfg.items() if k != "scheme"}
    comp = get_compressor(codec_cfg["scheme"], **({"granularity": "row", **opts} if opts else {}))
    codec = PseudogradientCodec(names, [comp] * len(names))
    ef = ErrorFeedback() if codec_cfg["scheme"] not in ("none", "bf16") else None
    like = [torch.empty(s) for s in shapes]
    if transport == "all_gather":
        t = time.perf_counter()
        message = codec.encode(delta, ef)
        values, _ = codec.decode_mean([pack([message])] * workers, workers, like)  # a blob per process
        return time.perf_counter() - t
    parted = PartitionedCodec(codec, [torch.Size(s) for s in shapes], workers, [comp] * len(names))
    owner_ef = ErrorFeedback() if ef is not None else None
    message = parted.encode(delta, ef)  # untimed: the K means this worker will decode
    parts = parted.split(message)
    means = [parted.average(j, [parts[j]] * workers, None, like) for j in range(workers)]
    t = time.perf_counter()
    parts = parted.split(parted.encode(delta, ef))
    parted.average(0, [parts[0]] * workers, owner_ef, like)
    parted.decode_means(means, like)
    return time.perf_counter() - t


def sizes(args) -> dict:
    import torch

    torch.set_num_threads(1)
    results = {}
    for size in args.sizes.split(","):
        names, shapes = zip(*gpt_shapes(*SIZES[size]), strict=True)
        names, shapes = list(names), list(shapes)
        numel = sum(torch.Size(s).numel() for s in shapes)
        delta = synthetic(shapes, seed=0)
        gb = 4 * numel / 1e9
        print(f"\n{size}: {numel / 1e6:.0f}M parameters, {gb:.2f} GB fp32, {len(shapes)} tensors", flush=True)
        for transport in args.transports.split(","):
            for codec in CODECS:
                times = []
                for _ in range(args.repeats):
                    times.append(one_sync(transport, CODECS[codec], names, shapes, delta, args.workers))
                key = f"{size} {transport} {codec}"
                results[key] = {
                    "params": numel, "gb_fp32": gb, "s_median": statistics.median(times),
                    "s_per_gb": statistics.median(times) / gb, "s_min": min(times), "s_max": max(times),
                }  # fmt: skip
                r = results[key]
                print(f"{key:<34} {r['s_median']:>7.2f} s  {r['s_per_gb']:>6.2f} s/GB "
                      f"({r['s_min']:.2f}-{r['s_max']:.2f} s)", flush=True)  # fmt: skip
        del delta
    return {"workers": args.workers, "repeats": args.repeats, "threads": 1, "results": results}


def git_head() -> str:
    """HEAD's short hash, with a + where the working tree differs from it."""
    run = lambda *cmd: subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True).stdout.strip()  # noqa: E731
    dirty = run("git", "status", "--porcelain", "--untracked-files=no")
    return run("git", "rev-parse", "--short", "HEAD") + ("+" if dirty else "")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pico", action="store_true")
    ap.add_argument("--pico-child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--old", help="a git revision to run beside this tree (--pico)")
    ap.add_argument("--overrides", nargs="*", default=[], help="config overrides for the pico runs")
    ap.add_argument("--sizes", default="", help="comma-separated of 125M,1B")
    ap.add_argument("--transports", default="all_gather,reduce_scatter")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    if args.pico_child:
        print(json.dumps(pico_child(args.overrides)))
        return
    saved = json.loads(args.out.read_text()) if args.out.exists() else {}
    saved["setup"] = {"torch_threads": 1, "machine": platform.machine(), "cpu_count": os.cpu_count(),
                      "python": platform.python_version(), "head": git_head()}  # fmt: skip
    if args.pico:
        saved["pico"] = pico(args)
    if args.sizes:
        saved["sizes"] = sizes(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(saved, indent=1) + "\n")
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
