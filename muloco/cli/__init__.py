"""The `muloco` command line (docs/design.md contract).

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

parser.py: the arguments; commands.py: the commands; plan.py: `muloco plan`. The top layer: nothing in
muloco imports the CLI (the preloaded server runs `python -m muloco` by module path; docs/design.md).
"""

from __future__ import annotations

import logging
import sys

from muloco.cli.commands import (
    cmd_config,
    cmd_data,
    cmd_eval,
    cmd_export,
    cmd_launch,
    cmd_report,
    cmd_sample,
    cmd_swarm_key,
    cmd_sweep,
    cmd_train,
)
from muloco.cli.parser import build_parser
from muloco.cli.plan import cmd_plan
from muloco.errors import TrainingError, UserError


def _setup_logging() -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
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
