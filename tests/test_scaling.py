"""anvil_fast.studies.scaling on CPU: the seed's 8-way sharding, 8 gloo processes, 20 steps (sharded and
one-process steps agree; the GPU timings come from `python -m anvil_fast.studies.scaling gpu` on the device)."""

from __future__ import annotations

import pytest

from anvil_fast.studies import scaling


@pytest.mark.slow
@pytest.mark.distributed
def test_eight_gloo_ranks_twenty_steps(tmp_path):
    out = tmp_path / "table.md"
    rc = scaling.main(["cpu", "--world", "8", "--out", str(out)])
    text = out.read_text()
    assert rc == 0, text
    assert "| NO |" not in text and text.count("| yes |") == 5
