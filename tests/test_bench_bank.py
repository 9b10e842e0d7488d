"""anvil_fast.bench bank: the tables' arithmetic on made-up timings, the CPU refusal, and on a GPU one
small shape measured end to end (timings themselves come only from H200 runs)."""

from __future__ import annotations

import argparse
import math

import pytest
import torch

from anvil_fast.bench import bank as B
from anvil_fast.bench.common import ELEMENTWISE_BYTES, flops

SHAPE = (8, 256, 768)


def _row(**over) -> dict:
    r = dict(shape=SHAPE, plain=1.0, plain_graph=0.8, fast=0.5, safe_graph=0.4, faithful_graph=0.45,
             plain_casc_graph=0.6, fast_casc_graph=0.3)
    r.update(over)
    return r


def _cells(table: str, shape=SHAPE) -> list[str]:
    (line,) = [ln for ln in table.splitlines() if ln.startswith("x".join(map(str, shape)))]
    return line.split()


def test_the_bank_table_divides_the_roofline_by_the_graphed_safe_time():
    tflops, gbs = 500.0, 4000.0
    cells = _cells(B.format_bank([_row()], tflops, gbs))
    c, m, n = SHAPE
    plain_f, exec_f = flops(SHAPE)
    floor = exec_f / (tflops * 1e9) + ELEMENTWISE_BYTES * c * m * n / (gbs * 1e6)
    assert float(cells[6]) == pytest.approx(0.8 / 0.4, abs=0.006)      # xG = plain+G / safe+G
    assert float(cells[9]) == pytest.approx(0.6 / 0.3, abs=0.006)      # xcasc
    assert float(cells[12]) == pytest.approx(floor, abs=6e-4)
    assert cells[13] == f"{100 * floor / 0.4:.0f}%"
    assert float(cells[10]) == pytest.approx(plain_f / 0.4 / 1e9, abs=0.6)


def test_a_slower_safe_update_lowers_its_share_of_the_floor():
    tflops, gbs = 500.0, 4000.0
    fast = float(_cells(B.format_bank([_row(safe_graph=0.2)], tflops, gbs))[13].rstrip("%"))
    slow = float(_cells(B.format_bank([_row(safe_graph=0.4)], tflops, gbs))[13].rstrip("%"))
    assert fast == pytest.approx(2 * slow, rel=0.02)


def test_the_gram_side_table_states_both_ratios_and_the_dispatch():
    r = dict(shape=(24, 3072, 768), dispatch=True, flop_ratio=1.7, safe_casc=0.9, gram_side_casc=0.6,
             safe_update=1.2, gram_side_update=1.0)
    cells = [c for c in _cells(B.format_gram_side([r]), r["shape"]) if c != "|"]
    assert cells[1] == "4.00" and cells[2] == "yes" and cells[3] == "1.70"
    assert float(cells[6]) == pytest.approx(0.9 / 0.6, abs=0.006)
    assert float(cells[9]) == pytest.approx(1.2 / 1.0, abs=0.006)


def test_the_phase_table_splits_the_update_into_six_maps_and_the_rest():
    r = _row(ph_rails=0.05, ph_casc=0.3, ph_post=0.04, k_gram=10.0, k_gram_cublas=12.0, k_baa=8.0,
             k_baa_cublas=9.0, k_axb=7.0, k_axb_cublas=8.0)
    cells = [c for c in _cells(B.format_phases([r], 500.0, 4000.0)) if c != "|"]
    maps_ms = 6 * (10.0 + 8.0 + 7.0) / 1000
    assert float(cells[-2]) == pytest.approx(maps_ms, abs=6e-4)
    assert float(cells[-1]) == pytest.approx(0.4 - maps_ms, abs=6e-4)
    assert "k_gram" not in _row()  # rows without the breakdown are left out of the phase table
    assert len(B.format_phases([_row()], 500.0, 4000.0).splitlines()) == 3


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU refusal")
def test_without_cuda_it_refuses_with_status_2(capsys):
    ap = argparse.ArgumentParser()
    B.add_args(ap)
    assert B.run(ap.parse_args([])) == 2
    assert "needs a CUDA device" in capsys.readouterr().out


@pytest.mark.gpu
def test_one_small_bank_is_measured_end_to_end():
    (r,) = B.bank_rows([(2, 128, 256)], rep_ms=5)
    keys = ("plain", "plain_graph", "fast", "safe_graph", "faithful_graph", "plain_casc_graph", "fast_casc_graph")
    assert all(math.isfinite(r[k]) and r[k] > 0 for k in keys), r
    (g,) = B.gram_side_rows([(2, 128, 512)], rep_ms=5)
    assert all(math.isfinite(g[k]) and g[k] > 0 for k in ("safe_casc", "gram_side_casc", "safe_update",
                                                          "gram_side_update"))


def test_the_peer_table_gives_each_time_over_safe_and_names_a_failure():
    rows = [dict(shape=SHAPE, name="anvil SAFE", ms=0.40, mode="graphed",
                 gaussian=dict(err_polar=0.30, sigma_min=0.70, sigma_max=1.10),
                 decaying=dict(err_polar=0.35, sigma_min=0.60, sigma_max=1.12)),
            dict(shape=SHAPE, name="gram-newton-schulz GramNewtonSchulz", ms=0.30, mode="its own compile",
                 gaussian=dict(err_polar=0.20, sigma_min=0.80, sigma_max=1.05),
                 decaying=dict(err_polar=0.25, sigma_min=0.75, sigma_max=1.06)),
            dict(shape=SHAPE, name="gram-newton-schulz StandardNewtonSchulz", error="ImportError: no quack")]
    table = B.format_peers(rows)
    gns = [ln for ln in table.splitlines() if "GramNewtonSchulz" in ln][0]
    assert " 0.300   0.75 |" in gns and "0.2000  0.800..1.050" in gns, gns
    assert "StandardNewtonSchulz  failed: ImportError: no quack" in table


def test_the_peer_shapes_are_the_small_and_medium_layouts_banks():
    from anvil_fast.bench.optimizer import gpt2_small_layout

    small = [v[1] for v in gpt2_small_layout().values() if v[1] is not None]
    medium = [v[1] for v in gpt2_small_layout(n_layer=24, width=1024, heads=8, hidden=4096).values()
              if v[1] is not None]
    assert list(B.PEER_SHAPES) == small + medium


@pytest.mark.gpu
def test_the_orthogonalizers_are_timed_and_judged_on_one_bank():
    rows = B.peer_rows([(2, 256, 512)], rep_ms=5)
    safe = next(r for r in rows if r["name"] == "anvil SAFE")
    assert safe["ms"] > 0 and 0 < safe["gaussian"]["err_polar"] < 0.5, safe
    assert 0.5 < safe["gaussian"]["sigma_min"] <= safe["gaussian"]["sigma_max"] < 1.5, safe
    # a function that returns its input is far from the polar factor: the column can fail
    (bad,) = B.peer_rows([(2, 256, 512)], rep_ms=5, fns={"identity": lambda x: x.clone()})
    assert bad["gaussian"]["err_polar"] > 0.5, bad


def test_the_equal_work_row_runs_five_maps_in_the_banks_default_configuration():
    # gram-newton-schulz's default is five Polar Express iterations: the row must do five maps too
    import anvil_ref as A
    from anvil_fast.core.cascade import SAFE, fast_cascade

    assert len(A.load_maps(B.EQUAL_WORK_MAPS)) == 5
    fns = B.orthogonalizers()
    name = f"anvil kernels, 5 maps ({B.EQUAL_WORK_MAPS})"
    x = torch.randn(2, 96, 32, generator=torch.Generator().manual_seed(3))
    # on the CPU every bank's default configuration is SAFE
    assert torch.equal(fns[name](x), fast_cascade(x, maps=B.EQUAL_WORK_MAPS, config=SAFE))
    assert not torch.equal(fns[name](x), fns["anvil SAFE"](x))


def test_the_split_rows_run_anvils_maps_on_streams(monkeypatch):
    # the rows a bank goal is judged by: SAFE and GRAM_SIDE on one stream and split over SPLIT_STREAMS,
    # every one ANVIL's maps, each split row the bits of its one-stream row
    import anvil_fast.core.cascade as casc

    real, seen = casc.fast_cascade, []

    def spy(x, **kw):
        seen.append((kw["config"].name, kw.get("streams", 1), kw.get("maps")))
        return real(x, **kw)

    monkeypatch.setattr(casc, "fast_cascade", spy)
    fns = B.orthogonalizers()
    x = torch.randn(3, 96, 32, generator=torch.Generator().manual_seed(4))
    outs = {name: fns[name](x) for name in B.ANVIL_ROWS}
    assert seen == [("safe", 1, None), ("gram_side", 1, None), ("safe", B.SPLIT_STREAMS, None),
                    ("gram_side", B.SPLIT_STREAMS, None)]
    assert B.SPLIT_STREAMS > 1
    for cfg in ("SAFE", "GRAM_SIDE"):
        assert torch.equal(outs[f"anvil {cfg}, {B.SPLIT_STREAMS} streams"], outs[f"anvil {cfg}"]), cfg


def test_anvils_rows_are_told_by_name():
    assert all(B.is_anvil_row(n) for n in B.ANVIL_ROWS) and len(set(B.ANVIL_ROWS)) == 4
    assert B.anvil_row("SAFE", 3) == "anvil SAFE, 3 streams" and B.is_anvil_row("anvil SAFE, 3 streams")
    for other in (B.EQUAL_WORK_ROW, "gram-newton-schulz GramNewtonSchulz", "anvil SAFE, streams", "anvil FAITHFUL"):
        assert not B.is_anvil_row(other), other
    # a name reads back as the configuration and stream count it was made from
    assert [B.parse_anvil_row(B.anvil_row(c, k)) for c in ("SAFE", "GRAM_SIDE") for k in (1, 2, 12)] == [
        (c, k) for c in ("SAFE", "GRAM_SIDE") for k in (1, 2, 12)]
    assert B.parse_anvil_row(B.EQUAL_WORK_ROW) is None


def test_split_streams_below_two_are_refused(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    ap = argparse.ArgumentParser()
    B.add_args(ap)
    for bad in ("1", "2,x"):
        assert B.run(ap.parse_args(["--split-streams", bad])) == 2
        assert "--split-streams: counts of at least 2 expected" in capsys.readouterr().out
