"""The `muloco` command line's arguments: one sub-parser per command (docs/design.md contract)."""

from __future__ import annotations

import argparse


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="muloco", description="DiLoCo / MuLoCo low-communication training")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, help_text in (
        ("train", "run one training job"),
        ("config", "print the resolved, validated config"),
    ):
        cmd = sub.add_parser(name, help=help_text)
        cmd.add_argument("config", metavar="CONFIG", help="YAML config file")
        cmd.add_argument(
            "overrides", nargs="*", metavar="KEY=VALUE", help="dotted overrides, e.g. inner.lr=0.01"
        )
    launch = sub.add_parser("launch", help="start N local processes of `muloco train` (torch.distributed)")
    launch.add_argument("--nproc", type=int, required=True, help="number of processes")
    launch.add_argument(
        "--backend",
        choices=["torch", "hivemind", "torchft"],
        default="torch",
        help="backend of the processes",
    )
    launch.add_argument("config", metavar="CONFIG", help="YAML config file")
    launch.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotted overrides")
    sweep = sub.add_parser("sweep", help="run a grid of runs from a sweep file (resumable), then report")
    sweep.add_argument("sweep_file", metavar="SWEEP.yaml", help="sweep file (docs/sweeps.md)")
    sweep.add_argument("--jobs", type=int, default=1, help="runs at once; CPU threads are divided among them")
    sweep.add_argument(
        "--dry-run", action="store_true", help="list the runs and their overrides, run nothing"
    )
    plan = sub.add_parser(
        "plan",
        help="project time per outer step and network wait on a link: DDP, DiLoCo, MuLoCo, streaming "
        "(of a config's run, or of the flags' model and settings)",
    )
    plan.add_argument("config", nargs="?", metavar="CONFIG", help="a run's YAML config (optional)")
    plan.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotted overrides of CONFIG")
    # Unset flags take the config's value, or the default named in their help without a config.
    plan.add_argument("--params", help="model size: a count (150M, 1.3B) or a preset name (default 150M)")
    plan.add_argument("--workers", type=int, help="K, DiLoCo workers (default 4)")
    plan.add_argument("--sync-every", type=int, help="H, inner steps per outer step (default 30)")
    plan.add_argument("--bits", type=int, help="bits of the compressed MuLoCo rows (default 4)")
    plan.add_argument("--fragments", type=int, help="streaming P (default 3)")
    plan.add_argument("--overlap", type=int, help="streaming tau, inner steps (default 2)")
    plan.add_argument(
        "--bandwidth-mbps", type=float, nargs="+", default=[100.0, 1000.0], help="link bandwidths (Mbit/s)"
    )
    latency = "one-way latency (ms): a round trip per gloo segment, a one-way delay per NCCL ring step"
    plan.add_argument("--latency-ms", type=float, default=0.0, help=latency)
    plan.add_argument("--step-time-s", type=float, help="one worker's inner-step compute time (s)")
    plan.add_argument(
        "--tokens-per-step",
        type=int,
        help="tokens per worker step, to estimate the step time (default 16384)",
    )
    plan.add_argument(
        "--tflops", type=float, default=100.0, help="sustained TFLOP/s, to estimate the step time"
    )
    plan.add_argument(
        "--transport",
        choices=["gloo", "nccl"],
        help="whose collectives to model: gloo (CPU runs: a round trip per 1 MiB segment) or nccl (CUDA "
        "runs, over TCP sockets: the link kept full). Default: what the run would use (the config's "
        "backend.torch.dist_backend, else its device: cuda -> nccl); without a config, nccl when this "
        "machine has CUDA, else gloo",
    )
    plan.add_argument("--json", action="store_true", help="print JSON instead of tables")
    data = sub.add_parser("data", help="prepare token files for data.source: tokens")
    data_sub = data.add_subparsers(dest="data_command", required=True, metavar="SUBCOMMAND")
    prepare = data_sub.add_parser(
        "prepare", help="tokenize text, JSONL or Parquet files into train.bin, val.bin and meta.json"
    )
    prepare.add_argument("inputs", nargs="+", metavar="INPUT", help="files, directories or globs")
    prepare.add_argument("--out", required=True, help="output directory (created; must be new or empty)")
    prepare.add_argument(
        "--tokenizer", default="byte", help="byte | bpe:VOCAB (trained on the inputs) | PATH/tokenizer.json"
    )
    prepare.add_argument("--field", default="text", help="JSONL: the field holding the text")
    prepare.add_argument("--column", default="text", help="Parquet: the column holding the text")
    prepare.add_argument("--val-fraction", type=float, default=0.05, help="share of documents held out")
    prepare.add_argument("--force", action="store_true", help="replace a non-empty --out")
    sample = sub.add_parser("sample", help="generate text from the newest checkpoint of a run")
    sample.add_argument("run_dir", metavar="RUN_DIR", help="a run directory (holds config.yaml)")
    sample.add_argument("--prompt", default="", help="text to continue (default: start of a document)")
    sample.add_argument("--tokens", type=int, default=200, help="tokens to generate")
    sample.add_argument("--temperature", type=float, default=0.8, help="softmax temperature; 0 = greedy")
    sample.add_argument("--top-k", type=int, default=50, help="sample among the k likeliest tokens; 0 = all")
    sample.add_argument("--seed", type=int, default=0, help="sampling seed")
    sample.add_argument("--samples", type=int, default=1, help="independent samples to print")
    export = sub.add_parser("export", help="write a run's model as a Hugging Face directory (docs/models.md)")
    export.add_argument("run_dir", metavar="RUN_DIR", help="a run directory (holds config.yaml)")
    export.add_argument(
        "out", metavar="OUT", help="the directory to write (new or empty; --force to replace)"
    )
    export.add_argument("--step", type=int, help="the checkpoint of this inner step (default: the newest)")
    export.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32", help="weights' dtype")
    export.add_argument("--force", action="store_true", help="replace a non-empty OUT")
    evaluate = sub.add_parser(
        "eval", help="loss, perplexity and bits per byte of a run or a Hugging Face model directory"
    )
    evaluate.add_argument("path", metavar="PATH", help="a run directory, or a Hugging Face model directory")
    evaluate.add_argument("--data", help="prepared token files (default: the run's own val split)")
    evaluate.add_argument("--tokens", type=int, help="val tokens (default: the run's train.eval_tokens)")
    evaluate.add_argument("--step", type=int, help="a run's checkpoint of this inner step (default: newest)")
    evaluate.add_argument("--seq-len", type=int, help="an HF directory's context (default: its config's)")
    evaluate.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto", help="where to run")
    evaluate.add_argument("--out", help="the JSON file to write (default for a run: RUN_DIR/eval/...)")
    key = sub.add_parser(
        "swarm-key", help="write a new random key for backend.hivemind.auth.key_file (mode 0600)"
    )
    key.add_argument("file", metavar="FILE", help="where to write it (must not exist)")
    report = sub.add_parser("report", help="summary.csv, report.md and plots from the run dirs under DIR")
    report.add_argument("directory", metavar="DIR", help="a sweep directory, or any directory of run dirs")
    report.add_argument(
        "--tune-over",
        metavar="KEYS",
        help="comma-separated config keys that were tuned (e.g. inner.lr): adds the tuned comparison "
        "(default: the sweep's tune: recorded in DIR/sweep.json)",
    )
    report.add_argument(
        "--tune-per", metavar="KEYS", default="", help="comma-separated keys each with its own best, e.g. "
        "inner.optimizer,workers (with --tune-over)",
    )  # fmt: skip
    return parser
