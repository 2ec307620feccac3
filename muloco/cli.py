"""The `muloco` command line (DESIGN.md contract).

    muloco train CONFIG [KEY=VALUE ...]     one run
    muloco launch --nproc N CONFIG [...]    N local processes (torch.distributed, gloo/nccl)
    muloco config CONFIG [KEY=VALUE ...]    print the resolved, validated config
    muloco sweep SWEEP.yaml [--jobs J]      a grid of runs, resumable; writes summary.csv, report.md, plots
    muloco report DIR                       tables and plots from finished run directories
    muloco plan --params 150M ...           projected time per outer step on a WAN link (DDP vs DiLoCo ...)
    muloco data prepare INPUT... --out DIR  token files (byte or BPE) for data.source: tokens
    muloco sample RUN_DIR [--prompt TEXT]   text from the newest checkpoint of a run
    muloco export RUN_DIR OUT               the run's model as a Hugging Face directory
    muloco eval PATH [--data DIR]           loss, perplexity, bits per byte of a run or an HF model directory

Bad input exits with code 2 and one line naming the field or file and the fix; never a traceback.
"""

from __future__ import annotations

import argparse
import logging
import sys

from muloco.errors import TrainingError, UserError


def _parser() -> argparse.ArgumentParser:
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
    latency = "one-way latency (ms): a collective takes the longer of its bytes and its round trips"
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


def _setup_logging() -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)


def cmd_config(args: argparse.Namespace) -> int:
    from muloco.optim.check import load_run_config

    cfg = load_run_config(args.config, args.overrides)
    print(cfg.to_yaml(), end="")
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    from muloco.optim.check import load_run_config
    from muloco.run.trainer import EXIT_INTERRUPTED, Trainer

    cfg = load_run_config(args.config, args.overrides)
    trainer = Trainer(cfg)
    summary = trainer.run()
    logging.getLogger("muloco").info(
        "done status=%s final_val_loss=%.4f tokens=%d wall_time_s=%.1f run_dir=%s",
        summary["status"],
        summary["final_val_loss"],
        summary["tokens_seen"],
        summary["wall_time_s"],
        trainer.run_dir,
    )
    if summary["status"] == "completed" and trainer.is_main:
        prompt = " --prompt 'def '" if cfg.data.source == "builtin" else ""  # the built-in corpus is Python
        logging.getLogger("muloco").info("sample from it: muloco sample %s%s", trainer.run_dir, prompt)
    if summary["status"] == "interrupted":
        return EXIT_INTERRUPTED.get(trainer.stop.signal, 130)
    return 0


def cmd_launch(args: argparse.Namespace) -> int:
    from muloco.net.launch import launch
    from muloco.optim.check import load_run_config

    cfg = load_run_config(args.config, args.overrides)  # fail here, once, rather than in every rank
    return launch(
        args.nproc,
        args.config,
        args.overrides,
        args.backend,
        cfg.run.name,
        cfg.backend.torchft,
        cfg.ranks_per_worker,
    )


def cmd_sweep(args: argparse.Namespace) -> int:
    from muloco.sweep import sweep_main

    return sweep_main(args.sweep_file, jobs=args.jobs, dry_run=args.dry_run)


def cmd_report(args: argparse.Namespace) -> int:
    from muloco.tools.report import build_report
    from muloco.tools.tuning import TuneSpec

    over = tuple(k for k in (args.tune_over or "").split(",") if k)
    per = tuple(k for k in args.tune_per.split(",") if k)
    if per and not over:
        raise UserError("report: --tune-per needs --tune-over (the keys that were tuned, e.g. inner.lr)")
    outputs = build_report(args.directory, TuneSpec(over, per) if over else None)
    for path in outputs.values():
        print(path)
    return 0


def cmd_data(args: argparse.Namespace) -> int:
    from muloco.data.prepare import prepare

    meta = prepare(
        args.inputs,
        args.out,
        args.tokenizer,
        text_field=args.field,
        column=args.column,
        val_fraction=args.val_fraction,
        force=args.force,
    )
    counts = meta["counts"]
    logging.getLogger("muloco").info(
        "prepared out=%s tokenizer=%s vocab_size=%d documents=%d train_tokens=%d val_tokens=%d",
        args.out,
        meta["tokenizer"],
        meta["vocab_size"],
        counts["documents"],
        counts["train_tokens"],
        counts["val_tokens"],
    )
    return 0


def cmd_sample(args: argparse.Namespace) -> int:
    from muloco.tools.sample import sample_run

    for text in sample_run(
        args.run_dir,
        prompt=args.prompt,
        tokens=args.tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        seed=args.seed,
        samples=args.samples,
    ):
        print(text)
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from muloco.tools.export import export_run

    out = export_run(args.run_dir, args.out, step=args.step, dtype=args.dtype, force=args.force)
    logging.getLogger("muloco").info(
        "exported out=%s: AutoModelForCausalLM.from_pretrained(%r), AutoTokenizer.from_pretrained(%r)",
        out,
        str(out),
        str(out),
    )
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    import json

    from muloco.tools.eval_model import evaluate_path

    result = evaluate_path(
        args.path,
        data=args.data,
        tokens=args.tokens,
        step=args.step,
        seq_len=args.seq_len,
        device=args.device,
        out=args.out,
    )
    bpb = result["bits_per_byte"]
    logging.getLogger("muloco").info(
        "eval loss=%.4f perplexity=%.3f bits_per_byte=%s tokens=%d data=%s",
        result["loss"],
        result["perplexity"],
        "n/a" if bpb is None else f"{bpb:.4f}",
        result["tokens"],
        result["data"],
    )
    print(json.dumps(result, indent=2))
    return 0


def cmd_swarm_key(args: argparse.Namespace) -> int:
    from muloco.comm.hivemind.auth import write_key

    write_key(args.file)
    print(f"wrote {args.file} (mode 0600): copy it to every peer and set backend.hivemind.auth.key_file")
    return 0


def _plan_params(text: str) -> float:
    from muloco.config import MODEL_PRESETS, load_config
    from muloco.models import build_model
    from muloco.net.wan import parse_count

    if text in MODEL_PRESETS:
        cfg = load_config(None, [f"model.preset={text}"])
        return float(sum(p.numel() for p in build_model(cfg.model, 256).parameters()))
    try:
        return parse_count(text)
    except ValueError:
        raise UserError(
            f"--params: {text!r} is neither a count (150M, 1.3B) nor a preset ({', '.join(MODEL_PRESETS)})"
        ) from None


PLAN_DEFAULTS = {
    "workers": 4,
    "sync_every": 30,
    "bits": 4,
    "fragments": 3,
    "overlap": 2,
    "tokens_per_step": 16384,
}


def _plan_settings(args: argparse.Namespace) -> tuple[float, argparse.Namespace]:
    """The model size and settings to project: each flag as given, else the config's run (its model, K,
    H, bits when it compresses, streaming P and tau, a worker's tokens per step), else the default."""
    from pathlib import Path

    from muloco.optim.check import load_run_config

    from_config: dict = {}
    params = _plan_params(args.params) if args.params is not None else None
    if args.config is not None and "=" in args.config and not Path(args.config).exists():
        raise UserError(f"KEY=VALUE overrides ({args.config}) need a CONFIG before them")
    if args.config is not None:
        cfg = load_run_config(args.config, args.overrides)
        params = params or _config_params(cfg)
        from_config = {
            "workers": cfg.workers,
            "sync_every": cfg.sync.every,
            "fragments": cfg.sync.fragments,
            "overlap": cfg.sync.overlap,
            "tokens_per_step": cfg.worker_batch_tokens,
        }
        if cfg.compression.scheme in ("linear", "statistical"):
            from_config["bits"] = cfg.compression.bits
    elif args.overrides:
        raise UserError(f"KEY=VALUE overrides ({args.overrides[0]}) need a CONFIG before them")
    for name, default in PLAN_DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, from_config.get(name, default))
    return params or _plan_params("150M"), args


def _config_params(cfg) -> float:
    """The parameter count of a config's model (built on the meta device: no memory, no init)."""
    from pathlib import Path

    import torch

    from muloco.data.sources import read_token_meta
    from muloco.models import build_model

    vocab = cfg.data.vocab_size
    if vocab is None and cfg.data.source == "tokens":
        vocab = (read_token_meta(Path(cfg.data.path).expanduser()) or {}).get("vocab_size")
    with torch.device("meta"):
        model = build_model(cfg.model, vocab or 256)  # byte-level sources: 256 ids
    return float(sum(p.numel() for p in model.parameters()))


def cmd_plan(args: argparse.Namespace) -> int:
    import json

    from muloco.config.bits import QUANT_BITS, one_of
    from muloco.net.wan import Link, estimate_step_seconds, format_plan, plan, plan_as_dict

    params, args = _plan_settings(args)
    for name in ("workers", "sync_every", "fragments"):
        if getattr(args, name) < 1:
            raise UserError(f"--{name.replace('_', '-')} must be >= 1")
    if args.bits not in QUANT_BITS:
        raise UserError(f"--bits must be {one_of(QUANT_BITS)}, got {args.bits}")
    if args.overlap < 0 or args.overlap * args.fragments >= args.sync_every:
        raise UserError("--overlap must be >= 0 and below --sync-every / --fragments")
    if any(b <= 0 for b in args.bandwidth_mbps) or args.latency_ms < 0 or args.tflops <= 0:
        raise UserError("--bandwidth-mbps and --tflops must be > 0, --latency-ms >= 0")
    step = args.step_time_s
    if step is None:
        step = estimate_step_seconds(params, args.tokens_per_step, args.tflops)
    elif step <= 0:
        raise UserError("--step-time-s must be > 0")
    results = []
    for bandwidth in args.bandwidth_mbps:
        link = Link(bandwidth, args.latency_ms)
        rows = plan(
            params, args.workers, args.sync_every, step, link, args.bits, args.fragments, args.overlap
        )
        results.append((bandwidth, rows))
    if args.json:
        print(json.dumps([{"bandwidth_mbps": b, "rows": plan_as_dict(r)} for b, r in results], indent=2))
        return 0
    if args.config is not None:
        print(f"the run of {' '.join([args.config, *args.overrides])}")
    print(
        f"params={params / 1e6:.1f}M workers={args.workers} H={args.sync_every} step_time={step:.3f}s "
        f"latency={args.latency_ms}ms (time per outer step = H inner steps)"
    )
    for bandwidth, rows in results:
        print(f"\nlink {bandwidth:g} Mbit/s\n{format_plan(rows)}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    _setup_logging()
    commands = {
        "train": cmd_train,
        "config": cmd_config,
        "launch": cmd_launch,
        "sweep": cmd_sweep,
        "report": cmd_report,
        "plan": cmd_plan,
        "data": cmd_data,
        "sample": cmd_sample,
        "export": cmd_export,
        "eval": cmd_eval,
        "swarm-key": cmd_swarm_key,
    }
    try:
        return commands[args.command](args)
    except UserError as exc:
        print(f"muloco: error: {exc}", file=sys.stderr)
        return 2
    except TrainingError as exc:
        print(f"muloco: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("muloco: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `muloco config ... | head`: the reader left, nothing to report
        sys.stderr.close()
        return 0


if __name__ == "__main__":
    sys.exit(main())
