"""The commands that run something or read runs: train, config, launch, sweep, report, data prepare, sample,
export, eval, swarm-key. Each imports what it needs when it runs, so `muloco --help` and `muloco config`
stay fast; a config is loaded for a run with its inner optimizer checked (muloco/optim/check.py)."""

from __future__ import annotations

import argparse
import logging

from muloco.errors import UserError


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

    # Fail here, once, rather than in every rank; checked as the ranks will run it (their backend.kind).
    cfg = load_run_config(args.config, [*args.overrides, f"backend.kind={args.backend}"])
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
