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
   bench_transport.py measures that. A sync's local cost is a sum over its tensors, so a model that does
   not fit K times in memory (1B) is measured in runs of at most 300M parameters whose times are added.
   One torch thread: seconds per GB of fp32 pseudogradient, per core.

    python experiments/benchmarks/bench_sync_cost.py --pico --old b8fa73f --repeats 3
    python experiments/benchmarks/bench_sync_cost.py --profile     # where a pico sync's time goes
    python experiments/benchmarks/bench_sync_cost.py --sizes 125M,1B --repeats 3   # ~25 min
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
SIZE_CODECS = ("fp32", "4-bit", "2-bit")  # the headline's codecs, for the sizes not in --all-codecs
CHUNK_PARAMS = 300_000_000  # at most ~1.2 GB of fp32 pseudogradient in memory at a time (x ~6 in a sync)
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


# The parts of a sync event the profile reports (cumulative time per sync): (label, file, function)
PARTS = [
    ("the sync event (engine.round)", "sync/engine.py", "_round"),
    ("encode (reduce-scatter parts, error feedback)", "sync/scatter.py", "encode"),
    ("encode (all-gather message, error feedback)", "sync/codec.py", "encode"),
    ("part owners' means (decode K, re-quantize)", "sync/scatter.py", "average"),
    ("decode the K means", "sync/scatter.py", "decode_means"),
    ("decode and average (all-gather)", "sync/codec.py", "decode_mean"),
    ("outer step", "sync/fragments.py", "outer_step"),
    ("merge into the replicas", "sync/engine.py", "_merge"),
]


def profile_child(overrides: list[str]) -> dict:
    """One pico run under cProfile: ms per sync in each of PARTS (cProfile slows Python-heavy code more
    than torch's kernels, so these are shares to compare, not the benchmark's times)."""
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    profiler.enable()
    timed = pico_child(overrides)
    profiler.disable()
    stats = pstats.Stats(profiler).stats  # {(file, line, function): (cc, nc, tottime, cumtime, callers)}
    syncs = timed["rounds"] + SKIP_ROUNDS
    parts = {}
    for label, path, function in PARTS:
        cum = sum(v[3] for k, v in stats.items() if k[0].endswith(path) and k[2] == function)
        if cum:
            parts[label] = round(1e3 * cum / syncs, 2)
    compute = sum(
        v[3] for k, v in stats.items() if k[0].endswith("run/inner_steps.py") and k[2] == "run_until"
    )
    return {"ms_per_sync": parts, "compute_ms_per_round": round(1e3 * compute / syncs, 1), "syncs": syncs}


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


def sizes(args, saved: dict) -> None:
    """Fills saved["sizes"], written to --out after each size (a long run keeps what it measured)."""
    import torch

    from muloco.allocator import keep_freed_memory

    torch.set_num_threads(1)
    kept = args.allocator == "keep" and keep_freed_memory()  # as `muloco train` runs (muloco/allocator.py)
    results = saved.setdefault("sizes", {}).setdefault("results" if not kept else "results_kept_memory", {})
    saved["sizes"].update({"workers": args.workers, "repeats": args.repeats, "threads": 1})
    for size in args.sizes.split(","):
        params = gpt_shapes(*SIZES[size])
        numel = sum(torch.Size(s).numel() for _, s in params)
        gb = 4 * numel / 1e9
        codecs = CODECS if size in args.all_codecs.split(",") else {k: CODECS[k] for k in SIZE_CODECS}
        chunks = chunked(params, CHUNK_PARAMS)
        print(f"\n{size}: {numel / 1e6:.0f}M parameters, {gb:.2f} GB fp32, {len(params)} tensors, "
              f"{len(chunks)} chunk(s)", flush=True)  # fmt: skip
        cases = [(t, c) for t in args.transports.split(",") for c in codecs]
        times = {case: [0.0] * args.repeats for case in cases}
        for seed, chunk in enumerate(chunks):
            names, shapes = [n for n, _ in chunk], [s for _, s in chunk]
            delta = synthetic(shapes, seed)
            for rep in range(args.repeats):
                for transport, codec in cases:  # interleaved within each repetition
                    times[(transport, codec)][rep] += one_sync(transport, CODECS[codec], names, shapes, delta,
                                                               args.workers)  # fmt: skip
            del delta
        for (transport, codec), ts in times.items():
            key = f"{size} {transport} {codec}"
            results[key] = {
                "params": numel, "gb_fp32": gb, "chunks": len(chunks), "s_median": statistics.median(ts),
                "s_per_gb": statistics.median(ts) / gb, "s_min": min(ts), "s_max": max(ts),
            }  # fmt: skip
            r = results[key]
            print(f"{key:<34} {r['s_median']:>7.2f} s  {r['s_per_gb']:>6.2f} s/GB "
                  f"({r['s_min']:.2f}-{r['s_max']:.2f} s)", flush=True)  # fmt: skip
        write(args.out, saved)


def chunked(params: list, limit: int) -> list[list]:
    """The parameters in runs of at most `limit` elements (a tensor larger than it alone): one sync's local
    cost is a sum over its tensors, so a model that does not fit K times in memory is measured a run at a
    time and the times added."""
    chunks, current, size = [], [], 0
    for name, shape in params:
        n = 1
        for d in shape:
            n *= d
        if current and size + n > limit:
            chunks.append(current)
            current, size = [], 0
        current.append((name, shape))
        size += n
    return [*chunks, current] if current else chunks


def write(out: Path, saved: dict) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(saved, indent=1) + "\n")


def git_head() -> str:
    """HEAD's short hash, with a + where the working tree differs from it."""
    dirty = _git("status", "--porcelain", "--untracked-files=no")
    return _git("rev-parse", "--short", "HEAD") + ("+" if dirty else "")


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout.strip()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pico", action="store_true")
    ap.add_argument("--pico-child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--profile", action="store_true", help="one pico run under cProfile: a sync's parts")
    ap.add_argument("--old", help="a git revision to run beside this tree (--pico)")
    ap.add_argument("--overrides", nargs="*", default=[], help="config overrides for the pico runs")
    ap.add_argument("--sizes", default="", help="comma-separated of 125M,1B")
    ap.add_argument("--transports", default="all_gather,reduce_scatter")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--allocator", choices=("system", "keep"), default="keep",
                    help="--sizes: glibc's defaults, or freed memory kept (as `muloco train`)")  # fmt: skip
    ap.add_argument(
        "--all-codecs", default="125M", help="sizes measured with every codec (others: fp32, 4-bit, 2-bit)"
    )
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    if args.pico_child:
        print(json.dumps(pico_child(args.overrides)))
        return
    if args.profile:
        profiled = profile_child(args.overrides)
        for label, ms in profiled["ms_per_sync"].items():
            print(f"{label:<48} {ms:>8.2f} ms a sync")
        print(f"{'compute of a round (K replicas)':<48} {profiled['compute_ms_per_round']:>8.1f} ms")
    saved = json.loads(args.out.read_text()) if args.out.exists() else {}
    saved["setup"] = {"torch_threads": 1, "machine": platform.machine(), "cpu_count": os.cpu_count(),
                      "python": platform.python_version(), "head": git_head()}  # fmt: skip
    if args.pico:
        saved["pico"] = pico(args)
    if args.profile:
        saved["pico_profile"] = {"overrides": [*PICO, *args.overrides], **profiled}
    if args.sizes:
        sizes(args, saved)
    write(args.out, saved)
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
