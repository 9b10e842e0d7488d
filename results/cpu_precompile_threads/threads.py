"""Six tl.dot kernels compiled for sm_90 on this machine's CPU (Triton needs no GPU to compile), one after
another and then on six threads, each from an empty Triton cache folder; prints the wall seconds and each
cubin's SHA-256 prefix (python threads.py > threads.log, from this folder)."""
import hashlib
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

CONFIGS = [(128, 128, 64, 8, 3), (128, 256, 64, 8, 3), (64, 128, 64, 4, 4), (128, 64, 64, 4, 3),
           (64, 64, 64, 4, 2), (256, 128, 64, 8, 3)]


@triton.jit
def mm(a, b, c, M, N, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        x = tl.load(a + rm[:, None] * K + (k0 + rk)[None, :])
        y = tl.load(b + (k0 + rk)[:, None] * N + rn[None, :])
        acc += tl.dot(x, y)
    tl.store(c + rm[:, None] * N + rn[None, :], acc.to(tl.bfloat16))


def compile_one(cfg):
    bm, bn, bk, warps, stages = cfg
    sig = {"a": "*bf16", "b": "*bf16", "c": "*bf16", "M": "i32", "N": "i32", "K": "i32",
           "BM": "constexpr", "BN": "constexpr", "BK": "constexpr"}
    src = ASTSource(fn=mm, signature=sig, constexprs={"BM": bm, "BN": bn, "BK": bk})
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages})
    return hashlib.sha256(k.asm["cubin"]).hexdigest()[:12]


def run(mode):
    compile_one((64, 64, 32, 4, 2))  # imports and LLVM's initialization, outside the timing
    t = time.time()
    if mode == "serial":
        hashes = [compile_one(c) for c in CONFIGS]
    else:
        with ThreadPoolExecutor(len(CONFIGS)) as ex:
            hashes = list(ex.map(compile_one, CONFIGS))
    print(f"{mode}: {time.time() - t:.2f} s, cubins {' '.join(hashes)}", flush=True)


if __name__ == "__main__":
    if len(sys.argv) > 1:
        run(sys.argv[1])
    else:
        print(f"triton {triton.__version__}, {os.cpu_count()} CPUs", flush=True)
        for mode in ("serial", "threads"):
            env = {**os.environ, "TRITON_CACHE_DIR": tempfile.mkdtemp(), "TRITON_DEFAULT_FP_FUSION": "1"}
            subprocess.run([sys.executable, __file__, mode], env=env, check=True)
