"""The collectives' probe on loopback (experiments/wan/probe_collectives.py --loopback): what a run with no
link pays for each collective, which the WAN planner check does not count twice."""

import pytest

from muloco.testbed.probe import time_collectives


# ~4 s: 2 processes import torch and run each op 12 times.
@pytest.mark.slow(seconds=5)
def test_each_op_is_timed_among_processes_on_loopback():
    ops = [
        ("fp32", "all_reduce", 4096),
        ("bf16", "all_reduce_bf16", 4096),
        ("gather", "all_gather", 1024),
        ("scatter", "reduce_scatter", 1024, 512),
    ]
    measured = time_collectives(None, ops, pause_s=0.0, workers=2)
    assert list(measured) == ["fp32", "bf16", "gather", "scatter"]
    assert all(0 < seconds < 5 for seconds in measured.values())
