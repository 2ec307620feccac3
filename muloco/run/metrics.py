"""Metrics: metrics.jsonl always, a progress bar on a terminal (plain key=value lines otherwise), wandb
when enabled.

Each JSONL record has at least `kind` (train | eval | sync), `step` (inner step), `tokens` (tokens seen by
all replicas) and `time_s` (docs/design.md contract).
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
from pathlib import Path
from typing import Any

from muloco.models import describe_model

log = logging.getLogger("muloco")


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.0f}" if abs(value) >= 1000 else f"{value:.4g}"
    return str(value)


def format_duration(seconds: float) -> str:
    seconds = max(0, int(seconds))
    return (
        f"{seconds // 3600}h{seconds // 60 % 60:02d}m"
        if seconds >= 3600
        else f"{seconds // 60}m{seconds % 60:02d}s"
    )


def read_jsonl(path: Path) -> list[dict]:
    """Records of a metrics.jsonl file; a torn last line (a crash mid-write) is skipped."""
    records = []
    if not path.exists():
        return records
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def timed_record(
    kind: str,
    step: int,
    tokens: int,
    total_steps: int,
    elapsed: float,
    bytes_sent: float,
    **values: Any,
) -> dict[str, Any]:
    """One metrics.jsonl record at inner step `step` after the workers trained `tokens` (docs/design.md's
    contract: kind, step, tokens, time_s; train and sync records also bytes_sent, tokens_per_s, eta_s)."""
    record = {"kind": kind, "step": step, "tokens": tokens, "time_s": round(elapsed, 3), **values}
    if kind != "eval":
        record["bytes_sent"] = bytes_sent
        record["tokens_per_s"] = round(tokens / elapsed, 1) if elapsed > 0 else None
        done = step / total_steps
        record["eta_s"] = round(elapsed * (1 - done) / done, 1) if done > 0 else None
    return record


class MetricsLogger:
    def __init__(
        self,
        path: Path,
        total_steps: int,
        progress: str = "auto",
        wandb_run: Any = None,
        resume_step: int | None = None,
        enabled: bool = True,
    ) -> None:
        self.path = path
        self.total_steps = total_steps
        self.wandb_run = wandb_run
        self.enabled = enabled  # False on ranks other than 0 in multi-process runs
        if enabled and resume_step is not None:
            # Drop what the interrupted run logged after its last checkpoint, so the file reads as one run.
            kept = [r for r in read_jsonl(path) if r.get("step", 0) <= resume_step]
            path.write_text("".join(json.dumps(r) + "\n" for r in kept), encoding="utf-8")
        elif enabled:
            path.write_text("", encoding="utf-8")
        self._file = open(path, "a", encoding="utf-8") if enabled else None  # noqa: SIM115
        mode = progress
        if mode == "auto":
            mode = "bar" if sys.stdout.isatty() and os.environ.get("TERM") != "dumb" else "lines"
        self.mode = mode if enabled else "off"
        self._bar = None
        self._task = None
        self._last: dict[str, Any] = {}

    def start(self, step: int) -> None:
        if self.mode != "bar":
            return
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        self._bar = Progress(
            TextColumn("[bold]train"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[info]}"),
            TextColumn("ETA"),
            TimeRemainingColumn(),
        )
        self._bar.start()
        self._task = self._bar.add_task("train", total=self.total_steps, completed=step, info="")

    def log(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        record = {
            k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()
        }
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self.wandb_run is not None:
            self.wandb_run.log(
                {k: v for k, v in record.items() if isinstance(v, int | float)}, step=record["step"]
            )
        self._last.update(
            {k: v for k, v in record.items() if k in ("train_loss", "val_loss", "tokens_per_s")}
        )
        self._show(record)

    def _show(self, record: dict[str, Any]) -> None:
        if self.mode == "bar" and self._bar is not None:
            info = "  ".join(f"{k}={_fmt(v)}" for k, v in self._last.items() if v is not None)
            self._bar.update(self._task, completed=record["step"], info=info)
        elif self.mode == "lines":
            keys = ("kind", "step", "tokens", "train_loss", "val_loss", "tokens_per_s", "eta")
            extra = {"eta": format_duration(record["eta_s"])} if "eta_s" in record else {}
            shown = {**record, **extra}
            line = " ".join(f"{k}={_fmt(shown[k])}" for k in keys if shown.get(k) is not None)
            print(line, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None
        if self._file is not None:
            self._file.close()
            self._file = None


def run_start_fields(cfg, run_dir, local_replicas: int, device) -> dict[str, Any]:
    """The start line's first fields: the run and what trains it."""
    return {
        "run": cfg.run.name,
        "dir": run_dir,
        "method": cfg.method if cfg.dp.comm_hook == "none" else f"dp+{cfg.dp.comm_hook}",
        "inner": cfg.inner.optimizer,
        "workers": cfg.workers,
        "local_replicas": local_replicas,
        "device": device,
        "model": describe_model(cfg.model),
    }


def log_run_start(fields: dict[str, Any], optimizer, offload_ignored: bool) -> None:
    """The start line (key=value), the inner optimizer's routing, and a note when simulation.offload
    has no effect on this device."""
    log.info(" ".join(f"{key}=%s" for key in fields), *fields.values())
    describe = getattr(optimizer, "describe", None)
    if describe is not None:
        log.info("inner optimizer routing:\n%s", describe())
    if offload_ignored:
        log.info(
            "simulation.offload has no effect on device=%s (replicas live in host memory)", fields["device"]
        )


def start_wandb(cfg, run_dir: Path) -> Any:
    """A wandb run under the run directory; offline when no API key is configured."""
    import wandb

    if not os.environ.get("WANDB_API_KEY") and "WANDB_MODE" not in os.environ:
        os.environ["WANDB_MODE"] = "offline"
    return wandb.init(
        project=cfg.logging.wandb_project,
        group=cfg.logging.wandb_group,
        name=cfg.run.name,
        dir=str(run_dir),
        config=cfg.to_dict(),
        reinit="finish_previous",
    )


def finish_wandb(wandb_run: Any, summary: dict[str, Any]) -> None:
    """The summary's scalars on the wandb run, then the run closed."""
    wandb_run.summary.update({k: v for k, v in summary.items() if isinstance(v, int | float | str)})
    wandb_run.finish()
