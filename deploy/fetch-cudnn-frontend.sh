#!/usr/bin/env bash
# Fetches the cuDNN frontend headers (NVIDIA's header-only C++ graph API over cuDNN) into
# .deps/cudnn-frontend/include, where CMake looks for them (SF_CUDNN_FRONTEND_INCLUDE). The CUDA
# build uses them for the bf16 dense attention path (cuDNN's fused flash attention); without them
# that path reports kUnsupported and everything else builds as before.
# Source: the PyPI wheel nvidia-cudnn-frontend==1.32.0, downloaded without dependencies for one
# fixed platform tag (so every machine gets the same file), sha256-checked, include/ unpacked.
# Idempotent. Needs only pip and PyPI; the cuDNN library itself comes with the CUDA toolkit
# (CPU build machines) or the torch environment (GPU hosts, see bench/gpu/run.sh).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
ver="1.32.0"
whl="nvidia_cudnn_frontend-${ver}-cp312-cp312-manylinux_2_27_x86_64.manylinux_2_28_x86_64.whl"
sha="8b354a8e550c083eb247f1eb39a7d69a4a269075f5a01e4fcbd2531680b17239"
dest="$root/.deps/cudnn-frontend"
if [ -f "$dest/include/cudnn_frontend.h" ] && [ "$(cat "$dest/VERSION" 2>/dev/null)" = "$ver" ]; then
  echo "fetch-cudnn-frontend: $dest present ($ver)"
  exit 0
fi
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --dest "$tmp" "nvidia-cudnn-frontend==$ver"
if ! echo "$sha  $tmp/$whl" | sha256sum -c --status; then
  echo "fetch-cudnn-frontend: sha256 mismatch or missing $whl (expected $sha)" >&2
  exit 1
fi
python3 - "$tmp/$whl" "$tmp/x" <<'PY'
import sys, zipfile
whl, out = sys.argv[1:]
with zipfile.ZipFile(whl) as z:
    members = [m for m in z.namelist() if m.startswith("include/")]
    if not any(m == "include/cudnn_frontend.h" for m in members):
        sys.exit(f"fetch-cudnn-frontend: include/cudnn_frontend.h not in {whl}")
    z.extractall(out, members)
PY
rm -rf "$dest"
mkdir -p "$dest"
mv "$tmp/x/include" "$dest/include"
echo "$ver" >"$dest/VERSION"
echo "fetch-cudnn-frontend: wrote $dest/include ($ver)"
