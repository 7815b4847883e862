#!/usr/bin/env bash
# Installs everything ds needs to build and test on Debian 12 (run as root).
# Idempotent: packages already present are skipped, so a second run takes seconds.
set -euo pipefail

packages=(
  build-essential cmake ninja-build git pkg-config
  libcli11-dev nlohmann-json3-dev libvalijson-dev
  libgtest-dev googletest
  libhdf5-dev liburing-dev
  libsentencepiece-dev  # tests only: the reference a tokenizer.model is checked against
  libtorch-dev libgloo-dev libopenblas0-pthread  # libgloo-dev: c10d's ProcessGroupGloo.hpp includes gloo's headers
  python3
  clang libclang-rt-14-dev libomp-14-dev  # the sanitizer build: ASan, UBSan, libFuzzer (scripts/sanitize.sh)
)

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done

if [ ${#missing[@]} -eq 0 ]; then
  echo "install-deps: all ${#packages[@]} packages already installed"
  exit 0
fi

if [ "$(id -u)" -ne 0 ]; then
  echo "install-deps: missing packages: ${missing[*]}" >&2
  echo "install-deps: run this script as root (or with sudo) to install them" >&2
  exit 1
fi

echo "install-deps: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
apt-get update -q
apt-get install -y -q --no-install-recommends "${missing[@]}"
