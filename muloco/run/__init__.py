"""One training run (`muloco train`): the loop and the pieces it wires together.

    trainer.py      the loop: inner steps -> engine.start -> engine.finish -> eval / log / checkpoint
    build.py        replicas, the sync engine, the autocast and the device, from the config
    replica.py      one replica: model + inner optimizer + data stream (+ its step counters)
    batched.py      simulation.batched: K replicas stepped together (one optimizer step for all)
    offload.py      simulation.offload: replicas kept in host memory, moved to the device in turn
    dp.py           method: dp, the data-parallel baseline
    state.py        the run's counters as checkpointable components (progress, bytes, WAN projection)
    resume.py       which checkpoint to resume from, checked against the config
    run_dir.py      the run directory: config.yaml, atomic JSON writes, the tokenizer record
    metrics.py      metrics.jsonl, the progress bar, wandb
    summary.py      summary.json
    signals.py      Ctrl+C / SIGTERM: stop after the current step, agreed across ranks
    lr_schedule.py  the inner lr multiplier (warmup, cosine / linear / constant)
    alignment.py    diagnostics.alignment: how far the replicas' updates are from one big batch's

Nothing is imported here, so that `muloco.run.state` (which the sync engine books into) loads alone.
"""
