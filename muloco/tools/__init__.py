"""Commands that read finished runs (they never train).

report.py  `muloco report DIR` (and the end of `muloco sweep`): summary.csv, report.md, tables
plots.py   the report's loss and bytes plots (matplotlib)
sample.py  `muloco sample RUN_DIR`: text from a run's newest checkpoint
"""
