"""The constants chosen from a measurement hold on a small rerun of it: `DEFAULT_STAT_RANGE` is the minimax r
(experiments/benchmarks/bench_stat_range.py) and `GRAM_BLOCK = 2` keeps bf16 Gram Newton-Schulz from
diverging where longer blocks do (bench_gram_block.py)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "experiments/benchmarks"))


def test_each_default_stat_range_is_a_minimax_choice_of_the_sweep():
    import bench_stat_range

    results = bench_stat_range.sweep(256, 1024)
    for bits, res in results.items():
        assert res["default_is_minimax"], f"{bits} bits: {res['rows']}"
    assert not results["1"]["r_matters"]  # one split at the mean, whatever r
    assert results["8"]["r_matters"] and results["4"]["r_matters"]


@pytest.mark.parametrize("spectrum", ["inv_sq", "rank1"])
def test_gram_blocks_of_two_stay_close_where_a_whole_block_diverges(spectrum):
    import bench_gram_block

    g64 = bench_gram_block.make_matrix(spectrum, 64, 256)
    errors = bench_gram_block.run_case(g64, "polar_express")
    assert not bench_gram_block.diverged(errors, "gram_block_2"), errors
    assert bench_gram_block.diverged(errors, "gram_block_5"), errors
