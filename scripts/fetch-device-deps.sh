#!/usr/bin/env bash
# Downloads, on a Debian 12 machine with network, the Debian packages a GPU machine lacks to build ds
# (JSON, CLI11, valijson, HDF5, liburing, GoogleTest, gloo's headers) into .device-deps/ (ignored by git;
# about 5 MB). scripts/device-check.sh unpacks them there, never into /.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .device-deps
cd .device-deps
apt-get download nlohmann-json3-dev libcli11-dev libvalijson-dev libhdf5-dev libhdf5-103-1 libhdf5-cpp-103-1 \
  libhdf5-hl-100 libsz2 libaec0 libaec-dev liburing-dev liburing2 libgtest-dev libgloo-dev
ls -1 *.deb | wc -l | xargs echo "== .device-deps: packages:"
