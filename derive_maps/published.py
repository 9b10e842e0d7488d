"""Published coefficient tables, typed from their sources (facts to reproduce, never outputs of
this package). Tests compare :mod:`derive_maps.polar_express` against these numbers.

Sources:

* ``PAPER_TABLE``: N. Amsel, D. Persson, C. Musco, R. M. Gower, "The Polar Express: Optimal Matrix
  Sign Methods and Their Application to the Muon Algorithm", arXiv:2505.16932 (v. of September 29,
  2025), Algorithm 1, ``coeffs_list`` before its safety-factor line: degree 5, ``l = 1e-3``,
  computed by the paper's Appendix G code (cushion 0.02407327424182761, recentred, no safety).
  Algorithm 1 then divides every row but the last by ``PAPER_SAFETY`` (``a/1.01, b/1.01^3,
  c/1.01^5``) and normalizes by ``||X||_F * 1.01 + 1e-7``.
* ``NANOGPT_TABLE``: KellerJordan/modded-nanogpt, ``train_gpt.py``, ``polar_express_coeffs``
  (five iterations; the comment there reads "num_iters=5, safety_factor=2e-2, cushion=2").
* ``MUON_QUINTIC``: Keller Jordan's Newton-Schulz quintic used by Muon, ``(3.4445, -4.7750, 2.0315)``,
  applied five times.
"""

from __future__ import annotations

PAPER_TABLE: tuple[tuple[float, float, float], ...] = (
    (8.28721201814563, -23.595886519098837, 17.300387312530933),
    (4.107059111542203, -2.9478499167379106, 0.5448431082926601),
    (3.9486908534822946, -2.908902115962949, 0.5518191394370137),
    (3.3184196573706015, -2.488488024314874, 0.51004894012372),
    (2.300652019954817, -1.6689039845747493, 0.4188073119525673),
    (1.891301407787398, -1.2679958271945868, 0.37680408948524835),
    (1.8750014808534479, -1.2500016453999487, 0.3750001645474248),
    (1.875, -1.25, 0.375),
)
PAPER_SAFETY: float = 1.01

NANOGPT_TABLE: tuple[tuple[float, float, float], ...] = (
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
)

MUON_QUINTIC: tuple[float, float, float] = (3.4445, -4.7750, 2.0315)
MUON_STEPS: int = 5
