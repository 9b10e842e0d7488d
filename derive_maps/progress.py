"""The progress bar of derive_maps' long computations: :mod:`anvil_ref.progress`, which every package of
the project imports (it lives at the bottom of the dependency order)."""

from anvil_ref.progress import Progress

__all__ = ["Progress"]
