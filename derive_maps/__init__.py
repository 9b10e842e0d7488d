"""derive_maps: re-derives ANVIL-kind quintic map sets and the Polar Express coefficients from first
principles (mpmath/scipy), and certifies any map set with interval arithmetic."""
