"""The `muloco` command line (DESIGN.md contract).

    muloco train CONFIG [KEY=VALUE ...]     one run
    muloco launch --nproc N CONFIG [...]    N local processes (torch.distributed, gloo/nccl)
    muloco config CONFIG [KEY=VALUE ...]    print the resolved, validated config
    muloco sweep SWEEP.yaml [--jobs J]      a grid of runs, resumable; writes summary.csv, report.md, plots
    muloco report DIR                       tables and plots from finished run directories

Bad input exits with code 2 and one line naming the field or file and the fix; never a traceback.
"""

from __future__ import annotations

import argparse
import logging
import sys

from muloco.errors import UserError


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
    launch.add_argument("--backend", choices=["torch"], default="torch", help="backend of the processes")
    launch.add_argument("config", metavar="CONFIG", help="YAML config file")
    launch.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotted overrides")
    sweep = sub.add_parser("sweep", help="run a grid of runs from a sweep file (resumable), then report")
    sweep.add_argument("sweep_file", metavar="SWEEP.yaml", help="sweep file (docs/sweeps.md)")
    sweep.add_argument("--jobs", type=int, default=1, help="runs at once; CPU threads are divided among them")
    sweep.add_argument(
        "--dry-run", action="store_true", help="list the runs and their overrides, run nothing"
    )
    report = sub.add_parser("report", help="summary.csv, report.md and plots from the run dirs under DIR")
    report.add_argument("directory", metavar="DIR", help="a sweep directory, or any directory of run dirs")
    return parser


def _setup_logging() -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)


def cmd_config(args: argparse.Namespace) -> int:
    from muloco.config import load_config

    cfg = load_config(args.config, args.overrides)
    print(cfg.to_yaml(), end="")
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    from muloco.config import load_config
    from muloco.trainer import EXIT_INTERRUPTED, Trainer

    cfg = load_config(args.config, args.overrides)
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
    if summary["status"] == "interrupted":
        return EXIT_INTERRUPTED.get(trainer.stop_signal, 130)
    return 0


def cmd_launch(args: argparse.Namespace) -> int:
    from muloco.config import load_config
    from muloco.launch import launch

    load_config(args.config, args.overrides)  # fail here, once, rather than in every rank
    return launch(args.nproc, args.config, args.overrides, args.backend)


def cmd_sweep(args: argparse.Namespace) -> int:
    from muloco.sweep import sweep_main

    return sweep_main(args.sweep_file, jobs=args.jobs, dry_run=args.dry_run)


def cmd_report(args: argparse.Namespace) -> int:
    from muloco.report import build_report

    outputs = build_report(args.directory)
    for path in outputs.values():
        print(path)
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
    }
    try:
        return commands[args.command](args)
    except UserError as exc:
        print(f"muloco: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("muloco: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `muloco config ... | head`: the reader left, nothing to report
        sys.stderr.close()
        return 0


if __name__ == "__main__":
    sys.exit(main())
