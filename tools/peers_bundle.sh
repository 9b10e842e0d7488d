#!/usr/bin/env bash
# Builds the three ignored folders a device call carries for the peers (a fresh checkout has none):
#   .whl         the PyPI peers' wheels at the versions results/h200_orthogonalizers and results/h200_peers
#                name (their own dependencies are on the device image)
#   .gns         gram-newton-schulz and its kernels' wheels (tools/gns_bundle.sh; skipped where present)
#   .peers/dion  microsoft/dion's source from a git directory (the device tool's `fetch github:microsoft/dion`
#                returns one), its HEAD unless DION_REV names another commit
# Run from the repository root: bash tools/peers_bundle.sh /path/to/microsoft+dion/repo
set -euo pipefail
dion_git=${1:?"usage: bash tools/peers_bundle.sh DION_GIT_DIR (a git directory of microsoft/dion)"}
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl \
  heavyball==3.2.1 pytorch-optimizer==4.1.0 emerging-optimizers==0.3.0
[ -f .gns/libs_base.tar.xz ] || bash tools/gns_bundle.sh
rm -rf .peers/dion && mkdir -p .peers/dion
git --git-dir="$dion_git" archive "${DION_REV:-HEAD}" | tar x -C .peers/dion
echo "dion $(git --git-dir="$dion_git" rev-parse "${DION_REV:-HEAD}")" > .peers/dion/REVISION
du -sh .whl .gns .peers
