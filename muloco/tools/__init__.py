"""Commands that read finished runs (they never train).

report.py         `muloco report DIR` (and the end of `muloco sweep`): summary.csv, report.md, the PNGs
  runs.py         the run directories as records, each run's DP baseline
  report_tables.py  summary.csv and report.md
  report_plots.py   which plots a report draws (plots.py draws them with matplotlib)
  tuning.py       the tuned comparison (a sweep's `tune:`)
trained.py        a run rebuilt for use: config, tokenizer, model with a checkpoint's global parameters
  sample.py       `muloco sample RUN_DIR`: text from a run's newest checkpoint
  export.py       `muloco export RUN_DIR OUT`: a Hugging Face directory
  eval_model.py   `muloco eval PATH`: loss, perplexity, bits per byte
"""
