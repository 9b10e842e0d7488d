"""anvil_fast.bench: the registry every command goes through, and the one FLOP count the tables use
(timings come only from the GPU)."""

from __future__ import annotations

import argparse

import pytest

from anvil_fast import bench
from anvil_fast.bench import common


def test_every_registered_command_has_its_interface():
    assert set(bench.COMMANDS) >= {"bank", "optimizer", "dropin"}
    for name in bench.COMMANDS:
        mod = bench.command_module(name)
        assert callable(mod.add_args) and callable(mod.run), name
        assert isinstance(mod.SUMMARY, str) and "\n" not in mod.SUMMARY, name
        mod.add_args(argparse.ArgumentParser())


def test_one_line_registers_a_command(monkeypatch, capsys):
    # A stand-in command module: this test file itself, registered by absolute name.
    monkeypatch.setitem(bench.COMMANDS, "probe", __name__)
    assert bench.main(["probe", "--answer", "7"]) == 7
    assert "probe" in capsys.readouterr().out


SUMMARY = "a command that only echoes its argument"


def add_args(ap):
    ap.add_argument("--answer", type=int, required=True)


def run(a):
    print("probe", a.answer)
    return a.answer


@pytest.mark.parametrize("shape,k,K", [((2, 256, 768), 256, 768), ((3, 768, 256), 256, 768), ((1, 300, 300), 300, 300)])
def test_cascade_flops_count_full_and_lower_tile_products(shape, k, K):
    c = shape[0]
    t = -(-k // 128)
    lower = t * (t + 1) / 2 / t ** 2
    plain = 6 * (4 * k * k * K + 2 * k ** 3) * c  # per map: Gram 2k^2K, A@A 2k^3, X@B 2k^2K
    executed = 6 * (lower * (2 * k * k * K + 2 * k ** 3) + 2 * k * k * K) * c
    got = common.flops(shape)
    assert got[0] == pytest.approx(plain, rel=1e-15) and got[1] == pytest.approx(executed, rel=1e-15)
    from anvil_fast.core.gram_side import map_flops

    mf = map_flops(shape)
    assert mf.gram[1] == pytest.approx(lower * 2 * k * k * K * c, rel=1e-15) and mf.axb[0] == mf.axb[1]


@pytest.mark.parametrize("shape", [(12, 3072, 768), (12, 768, 3072), (4, 2048, 512), (6, 1152, 384)])
def test_executed_flops_count_the_gram_side_where_a_bank_takes_it(shape):
    from anvil_fast.core.cascade import GRAM_SIDE_RESTARTS
    from anvil_fast.core.gram_side import cascade_flops

    c, m, n = shape
    gram_side = c * cascade_flops(m, n, restarts=GRAM_SIDE_RESTARTS)["gram_side"]
    standard = common.flops(shape)[1]
    assert gram_side < standard
    # the default configuration on CUDA takes the Gram side on these shapes; on the CPU it is SAFE
    assert common.executed_flops(shape) == pytest.approx(gram_side, rel=1e-15)
    assert common.executed_flops(shape, device="cpu") == standard
    assert common.executed_flops(shape, "safe") == standard
    assert common.executed_flops(shape, "gram_side") == pytest.approx(gram_side, rel=1e-15)
    # a restart schedule of the configuration's own is counted, not the default one
    import dataclasses

    from anvil_fast.core.cascade import GRAM_SIDE
    other = dataclasses.replace(GRAM_SIDE, gram_side=(2, 4))
    assert common.executed_flops(shape, other) == pytest.approx(c * cascade_flops(m, n, restarts=(2, 4))["gram_side"],
                                                                rel=1e-15)


@pytest.mark.parametrize("shape", [(12, 768, 768), (72, 256, 768), (6, 1152, 256)])
def test_executed_flops_are_the_standard_count_where_the_bank_keeps_it(shape):
    # square banks, and on CUDA short sides under GRAM_SIDE_MIN_SHORT (384), keep the standard cascade even
    # under GRAM_SIDE
    assert common.executed_flops(shape) == common.flops(shape)[1]
    assert common.executed_flops(shape, "gram_side") == common.flops(shape)[1]
