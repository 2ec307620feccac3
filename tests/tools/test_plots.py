"""The report's loss plot tells its curves apart: every DP baseline of a panel has a style of its own."""

from muloco.tools.plots import BASELINE_STYLES, curve_styles, loss_vs_tokens


def test_every_dp_baseline_of_a_panel_has_its_own_style(tmp_path):
    curves = [("muon_w2", False, [1.0], [3.0])]
    curves += [(f"dp_muon_w{k}", True, [1.0, 2.0], [3.0, 2.5]) for k in (1, 2, 4, 8)]
    styles = curve_styles(curves)
    baselines = [tuple(sorted((k, str(v)) for k, v in s.items())) for s in styles[1:]]
    assert len(set(baselines)) == 4  # the legend can tell them apart
    assert all(s["linestyle"] != "-" for s in styles[1:]) and "linestyle" not in styles[0]
    assert len(BASELINE_STYLES) >= 4
    loss_vs_tokens({"muon": curves}, tmp_path / "loss.png")
    assert (tmp_path / "loss.png").stat().st_size > 1000
