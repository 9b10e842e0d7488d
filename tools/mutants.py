"""Mutation check of the tests: apply one deliberate bug at a time to anvil_ref, or to one of the
fast path's element-wise Triton kernels (run by the tests in Triton's CPU interpreter), and show
that the tests catch it (a test must be able to fail).

    python tools/mutants.py        # prints CAUGHT/MISSED per mutant; exit status 1 if any is missed

Each mutant is an exact one-line replacement, applied in a scratch copy of the tree (never in the
working tree, which others may be testing at the same time).
"""
import pathlib
import shutil
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
TESTS = ["tests/test_rails.py", "tests/test_cascade.py", "tests/test_equalizer.py", "tests/test_update.py",
         "tests/test_storage.py", "tests/test_adam.py", "tests/test_optimizer.py", "tests/test_normalize.py",
         "tests/test_bank.py"]
MUTANTS = [
    ("anvil_ref/rails.py", "return like(beta * v_ + (1.0 - beta) * g_, g)", "return like(beta * v_ - (1.0 - beta) * g_, g)", "wrong sign in EMA"),
    ("anvil_ref/rails.py", "return beta_min + (step / warmup_steps)", "return beta_min + ((step + 1) / warmup_steps)", "schedule off-by-one (warmup)"),
    ("anvil_ref/rails.py", "((step - cooldown_start) / cooldown_steps)", "((step - cooldown_start + 1) / cooldown_steps)", "schedule off-by-one (cooldown)"),
    ("anvil_ref/rails.py", "if step < engage_step:", "if step <= engage_step:", "engage off-by-one"),
    ("anvil_ref/cascade.py", "return shape[-2] > shape[-1]", "return shape[-2] < shape[-1]", "swapped orientation"),
    ("anvil_ref/cascade.py", "return shape[-2] > shape[-1]", "return shape[-2] >= shape[-1]", "square takes tall branch"),
    ("anvil_ref/cascade.py", "poly = b * a_ + c * (a_ @ a_)", "poly = b * a_ - c * (a_ @ a_)", "wrong sign in map"),
    ("anvil_ref/equalizer.py", "return -1 if shape[-2] >= shape[-1] else -2", "return -2 if shape[-2] >= shape[-1] else -1", "equalizer axis swapped"),
    ("anvil_ref/update.py", "return like((g * p_ >= 0).astype(np.float64), p)", "return like((g * p_ > 0).astype(np.float64), p)", "strict decay gate"),
    ("anvil_ref/update.py", "return like(p_ - p_ * aligned * wd * lr - u * lr, p)", "return like(p_ - p_ * aligned * wd * lr + u * lr, p)", "wrong update sign"),
    ("anvil_ref/adam.py", "return lr * (math.sqrt(1.0 - beta2 ** step) / (1.0 - beta1 ** step))", "return lr * (math.sqrt(1.0 - beta2 ** (step + 1)) / (1.0 - beta1 ** (step + 1)))", "bias-correction off-by-one"),
    ("anvil_ref/adam.py", "u = u + p_ * (u * p_ > 0) * eff_wd", "u = u + p_ * (u * p_ >= 0) * eff_wd", "Adam gate non-strict"),
    ("anvil_ref/storage.py", "return Halves(_out((bits >> 16).astype(np.uint16), master),", "return Halves(_out((bits >> 15).astype(np.uint16), master),", "split shift"),
    ("anvil_ref/optimizer.py", "pending[LM_HEAD_LABEL] = pending[LM_HEAD_LABEL] + pending[EMBED_LABEL].T", "pending[LM_HEAD_LABEL] = pending[LM_HEAD_LABEL]", "tied grad not added"),
    ("anvil_ref/optimizer.py", "            self.pending_grads = pending\n            return", "            self.pending_grads = {}\n            return", "adam grads dropped"),
    ("anvil_ref/optimizer.py", "p_new = sign_aligned_update(p, u, rails.v_slow,", "p_new = sign_aligned_update(p, u, rails.v_fast,", "gate on fast rail"),
    ("anvil_ref/config.py", "lr_mul = shape_lr_multiplier(reshape[-2], reshape[-1], convention=convention) * lr_mul", "lr_mul = shape_lr_multiplier(reshape[-1], reshape[-2], convention=convention) * lr_mul", "shape multiplier transposed"),
    # the fast path's element-wise kernels
    ("anvil_fast/rails.py", "tl.fma(-(1.0 - w), d, b))", "tl.fma(-(1.0 - w), d, a))", "fast lerp: wrong base of the large-weight branch"),
    ("anvil_fast/rails.py", "CLAMP=bool(prescale),", "CLAMP=False,", "fast rails: SAFE clamp dropped"),
    ("anvil_fast/normalize.py", "f = _exp2i(_floor_log2(pa, LIMIT) - e)", "f = _exp2i(e - _floor_log2(pa, LIMIT))", "fast norm: block factor inverted"),
    ("anvil_fast/normalize.py", "e = ((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127", "e = ((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 126", "fast norm: exponent off by one"),
    ("anvil_fast/equalizer.py", "ok = pre <= bound  #", "ok = pre <= 10 * bound  #", "fast equalizer: guard bound"),
    ("anvil_fast/equalizer.py", "GUARD_NORM_RATIO * math.sqrt(min(rows, cols)), 1 - float(beta2),", "GUARD_NORM_RATIO * math.sqrt(min(rows, cols)), float(beta2),", "fast equalizer: EMA weight"),
    ("anvil_fast/equalizer.py", "lane = inner // cols if LANE_IS_ROW else inner % cols", "lane = inner % cols if LANE_IS_ROW else inner // cols", "fast equalizer: lane index"),
]


def main() -> int:
    missed = 0
    with tempfile.TemporaryDirectory() as tmp:
        work = pathlib.Path(tmp) / "tree"
        shutil.copytree(ROOT, work, ignore=shutil.ignore_patterns(".git", "__pycache__", "*.egg-info"))
        for path, old, new, name in MUTANTS:
            p = work / path
            src = p.read_text()
            if src.count(old) != 1:
                raise SystemExit(f"mutant {name!r}: the original line is not found exactly once in {path}")
            try:
                p.write_text(src.replace(old, new))
                r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *TESTS],
                                   cwd=work, capture_output=True, text=True)
            finally:
                p.write_text(src)
            missed += r.returncode == 0
            print(f"{'CAUGHT' if r.returncode else 'MISSED'}  {name}", flush=True)
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
