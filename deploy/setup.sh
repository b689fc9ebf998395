#!/usr/bin/env bash
# Installs every system dependency of sparsefill on Debian 12 (bookworm). Idempotent.
#   deploy/setup.sh                   build + test dependencies (apt)
#   deploy/setup.sh --with-reference  also the pinned Python reference stack (torch, PyPI's CUDA
#                                     build, transformers, gguf, safetensors) used by golden/interop
#                                     tests
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
with_ref=0
for a in "$@"; do
  case "$a" in
    --with-reference) with_ref=1 ;;
    -h|--help) sed -n '2,6p' "$0"; exit 0 ;;
    *) echo "setup.sh: unknown option '$a'" >&2; exit 2 ;;
  esac
done

pkgs=(
  build-essential cmake ninja-build ccache pkg-config git
  libopenblas-dev
  libgtest-dev libgmock-dev
  libboost1.81-dev libboost-json1.81-dev
  libopenmpi-dev openmpi-bin
  libucx-dev
  libxxhash-dev
  clang-14 libclang-rt-14-dev
  python3 python3-venv python3-pip
)
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "setup.sh: installing ${missing[*]}"
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO=sudo
  # A fresh VM's apt-daily or unattended-upgrades may hold the dpkg lock for a while: wait for it
  # instead of failing at once.
  $SUDO apt-get -o DPkg::Lock::Timeout=600 update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get -o DPkg::Lock::Timeout=600 install -y -qq \
    --no-install-recommends "${missing[@]}"
else
  echo "setup.sh: system packages present"
fi

# cuDNN frontend headers (the CUDA build's bf16 dense attention path); a no-op when present.
"$here/fetch-cudnn-frontend.sh"

# xxhash.h beside them: the GPU hosts have no libxxhash-dev, so bench/gpu/run.sh builds the
# library from this header, which a GPU call carries (.deps/xxhash).
mkdir -p "$here/../.deps/xxhash"
cmp -s /usr/include/xxhash.h "$here/../.deps/xxhash/xxhash.h" ||
  cp /usr/include/xxhash.h "$here/../.deps/xxhash/xxhash.h"

if ((with_ref)); then
  "$here/setup-reference.sh"
fi
