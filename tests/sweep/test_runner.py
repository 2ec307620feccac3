"""muloco/sweep/runner.py: running a plan and resuming it (a fake launcher: no training)."""

import json

from muloco.sweep.plan import plan_sweep
from muloco.sweep.runner import run_sweep
from muloco.sweep.spec import load_sweep


def test_resume_skips_completed_runs_and_reruns_failed_ones(write_sweep, FakeProcess):
    spec = load_sweep(write_sweep({"grid": {"workers": [1, 2, 4]}}))
    runs = plan_sweep(spec, threads=1)
    for run, status in zip(runs, ["completed", "failed"]):
        run.run_dir.mkdir(parents=True)
        (run.run_dir / "summary.json").write_text(json.dumps({"status": status}))
    launched = []

    def launch(spec, run, log_path):
        launched.append(run.name)
        return FakeProcess(run.run_dir, code=1 if run.name == "w2" else 0)

    result = run_sweep(spec, runs, jobs=2, launch=launch, poll_s=0)
    assert result.skipped == ["w1"] and launched == ["w2", "w4"]
    assert list(result.failed) == ["w2"] and "exit code 1" in result.failed["w2"]  # w4 ran all the same
    launched.clear()
    result = run_sweep(spec, runs, jobs=1, launch=launch, poll_s=0)
    assert launched == ["w2"] and result.skipped == ["w1", "w4"]


def test_a_dp_comm_hook_run_starts_as_one_process_per_worker(write_sweep, tmp_path, monkeypatch):
    """torch's DDP hooks need a process per worker: the sweep starts such a run with `muloco launch`."""
    from muloco.sweep import runner

    body = {"fixed": {"method": "dp", "workers": 2}, "grid": {"dp.comm_hook": ["none", "powersgd"]}}
    spec = load_sweep(write_sweep(body))
    started = []
    monkeypatch.setattr(runner, "start_muloco", lambda args, **kwargs: started.append(args[:4]))
    runs = plan_sweep(spec, threads=4)
    for run in runs:
        run.run_dir.mkdir(parents=True)
        runner.start_process(spec, run, tmp_path / f"{run.name}.log")
    assert started == [
        ["train", str(spec.base), *started[0][2:4]],
        ["launch", "--nproc", "2", str(spec.base)],
    ]
    assert [run.config.train.threads for run in runs] == [4, 2]  # the job's cores shared by its processes
