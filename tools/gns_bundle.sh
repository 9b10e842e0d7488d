#!/usr/bin/env bash
# Builds .gns/ (ignored; carried to the H200 by the device tool): Dao AI Lab's gram-newton-schulz and
# the wheels its CUDA kernels need that the H200 image lacks (quack-kernels, nvidia-cutlass-dsl and its
# libs, apache-tvm-ffi, torch-c-dlpack-ext; the image has cuda-bindings, cuda-pathfinder and einops).
# nvidia-cutlass-dsl-libs-base is a 74.5 MB wheel, more than one call's tree may hold (64 MiB), so it
# travels unpacked and xz-compressed with xz's x86 branch filter before LZMA2 (its two shared libraries
# are most of it; the filter takes the archive from about 52 MB to 42 MB, room the carried tree needs
# beside the table's JSONs); tools/h200_session.sh's install_peers unpacks it into /tmp/site beside the
# other wheels (tar's xz reads the filter chain from the file). Run from the repository root:
# bash tools/gns_bundle.sh
set -euo pipefail
dl() { python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
         --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
         --platform manylinux2014_x86_64 -d "$1" "${@:2}"; }
rm -rf .gns && mkdir -p .gns /tmp/gns_bundle
dl .gns gram-newton-schulz==0.1.6 quack-kernels==0.5.0 nvidia-cutlass-dsl==4.5.2 'apache-tvm-ffi>=0.1.6,<0.2' \
   torch-c-dlpack-ext
dl /tmp/gns_bundle nvidia-cutlass-dsl-libs-base==4.5.2
rm -rf /tmp/gns_bundle/x && mkdir /tmp/gns_bundle/x
(cd /tmp/gns_bundle/x && unzip -q ../nvidia_cutlass_dsl_libs_base-*.whl && tar cf - . | xz --x86 --lzma2=preset=9e,dict=192MiB -T1 > "$OLDPWD/.gns/libs_base.tar.xz")
grep -qxF /.gns/ .git/info/exclude 2>/dev/null || echo /.gns/ >> .git/info/exclude
du -sh .gns
