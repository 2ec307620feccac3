"""`muloco plan`: projected time per outer step and network wait of DDP, DiLoCo, MuLoCo and streaming MuLoCo
on a link (net/wan.py's model), for a config's run or the flags' model and settings."""

from __future__ import annotations

import argparse

from muloco.errors import UserError


def plan_params(text: str) -> float:
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


def plan_settings(args: argparse.Namespace) -> tuple[float, argparse.Namespace]:
    """The model size and settings to project: each flag as given, else the config's run (its model, K,
    H, bits when it compresses, streaming P and tau, a worker's tokens per step, its collectives' library:
    `plan_transport`), else the default."""
    from pathlib import Path

    from muloco.optim.check import load_run_config

    from_config: dict = {}
    cfg = None
    params = plan_params(args.params) if args.params is not None else None
    if args.config is not None and "=" in args.config and not Path(args.config).exists():
        raise UserError(f"KEY=VALUE overrides ({args.config}) need a CONFIG before them")
    if args.config is not None:
        cfg = load_run_config(args.config, args.overrides)
        params = params or config_params(cfg)
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
    args.transport, args.transport_why = plan_transport(args.transport, cfg)
    return params or plan_params("150M"), args


def plan_transport(flag: str | None, cfg) -> tuple[str, str]:
    """The library whose collectives to model (gloo or nccl) and why: --transport, else what the config's
    run would use (backend.torch.dist_backend, else its device), else what a run on this machine would
    (muloco.comm.torch_dist: nccl when CUDA is present)."""
    if flag is not None:
        return flag, "--transport"
    if cfg is not None:
        kind = cfg.backend.kind
        if kind == "torchft":
            return "gloo", "backend.kind=torchft: its workers' process group is gloo"
        if kind == "hivemind":
            return "gloo", "backend.kind=hivemind: its own averaging, not modelled; gloo's is the nearer"
        chosen = cfg.backend.torch.dist_backend
        if chosen != "auto":
            return chosen, f"the config's backend.torch.dist_backend={chosen}"
        if cfg.device != "auto":
            return ("nccl" if cfg.device == "cuda" else "gloo"), f"the config's device={cfg.device}"
    import torch

    if torch.cuda.is_available():
        return "nccl", "CUDA on this machine"
    return "gloo", "no CUDA on this machine; --transport nccl for a GPU deployment"


def config_params(cfg) -> float:
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
    from muloco.net.wan import (
        BACKEND_MODELS,
        Link,
        bytes_in_flight,
        estimate_step_seconds,
        format_plan,
        plan,
        plan_as_dict,
    )

    params, args = plan_settings(args)
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
            params,
            args.workers,
            args.sync_every,
            step,
            link,
            args.bits,
            args.fragments,
            args.overlap,
            args.transport,
        )
        results.append((link, rows))
    if args.json:
        entries = [
            {"bandwidth_mbps": link.bandwidth_mbps, "transport": args.transport, "rows": plan_as_dict(rows)}
            for link, rows in results
        ]
        print(json.dumps(entries, indent=2))
        return 0
    if args.config is not None:
        print(f"the run of {' '.join([args.config, *args.overrides])}")
    print(
        f"params={params / 1e6:.1f}M workers={args.workers} H={args.sync_every} step_time={step:.3f}s "
        f"latency={args.latency_ms}ms (time per outer step = H inner steps)"
    )
    print(f"transport: {args.transport} ({args.transport_why})\n  {BACKEND_MODELS[args.transport]}")
    for link, rows in results:
        full = ""
        if args.transport == "nccl" and link.latency_ms > 0:
            in_flight = bytes_in_flight(link) / 1e6
            full = f" (full only with {in_flight:.1f} MB in flight per node: NCCL's sockets x TCP windows)"
        print(f"\nlink {link.bandwidth_mbps:g} Mbit/s{full}\n{format_plan(rows)}")
    return 0
