"""derive_maps.analysis: the interval chain and the alternation points."""

import numpy as np

from anvil_ref.cascade import composite
from anvil_ref.constants import ANVIL_MAPS
from derive_maps.analysis import analyse


def test_chain_contains_every_stage_value_and_flags_fragile_stages():
    a = analyse(ANVIL_MAPS, "1/300", "1/1.05")
    x = np.geomspace(1 / 300, 1 / 1.05, 50_001)
    x[0], x[-1] = np.nextafter(1 / 300, 1), np.nextafter(1 / 1.05, 0)
    s = x
    assert [st.k for st in a.chain] == list(range(7))
    for st in a.chain[1:]:
        s = composite(s, maps=[st.coeffs])
        assert st.lo <= s.min() and s.max() <= st.hi
    # ANVIL's first stages have almost no headroom, its composite none above 1/1.05
    assert a.chain[0].headroom < 1e-4 and a.chain[1].headroom < 1e-4
    assert a.chain[-1].headroom is None
    assert a.n_extrema == 82
    worst = max(abs(v) for _, v in a.alternation)
    assert a.envelope.max_abs_log_attained <= worst * (1 + 1e-9) <= a.envelope.max_abs_log_certified * (1 + 1e-9)
