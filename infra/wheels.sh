#!/bin/sh
# Copy the CPU torch wheel infra/Dockerfile installs into infra/wheels/ (its build context) from
# pip's local find-links (PIP_FIND_LINKS, `pip config`), when this machine has one: the build
# then downloads no torch. Nothing found: the build takes it from PyTorch's CPU index.
set -eu
cd "$(dirname "$0")/.."
want="torch-2.13.0+cpu-cp311-cp311-manylinux*_x86_64.whl"
ls infra/wheels/$want >/dev/null 2>&1 && exit 0
links="${PIP_FIND_LINKS:-} $(python3 -m pip config list 2>/dev/null \
  | sed -n "s/^[a-z:.]*find-links='\(.*\)'$/\1/p")"
for dir in $links; do
  for whl in "${dir#file://}"/$want; do
    if [ -f "$whl" ]; then
      cp "$whl" infra/wheels/ && echo "infra/wheels.sh: copied $(basename "$whl")" && exit 0
    fi
  done
done
echo "infra/wheels.sh: no local CPU torch wheel; the build takes it from PyTorch's CPU index"
