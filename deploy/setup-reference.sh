#!/usr/bin/env bash
# Pinned Python reference stack (independent implementation for golden + interop tests).
# Installs into .venv-ref/ at the repository root (git-ignored). Idempotent.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$root/.venv-ref"
req="$root/tools/golden/requirements.txt"
# Every transitive package at the version the pinned stack resolved to (unpinned, a later
# huggingface_hub or packaging could break transformers 4.46.3 under the interop test).
cons="$root/tools/golden/constraints.txt"
stamp="$venv/.installed-$(cat "$req" "$cons" | sha256sum | cut -c1-16)"
if [ -f "$stamp" ]; then echo "setup-reference: $venv up to date"; exit 0; fi

# torch==2.5.1 from PyPI is its CUDA build: the installed stack is about 5.4 GiB (2.7 GiB of
# nvidia-*-cu12 wheels), and pip holds the downloaded wheels beside it until it is done, about
# 8.5 GiB at the peak. A full disk fails pip halfway with ENOSPC: say so up front, and keep pip's
# scratch beside the venv so an interrupted install cannot leak into /tmp.
need_kib=$((9 * 1024 * 1024))
avail_kib=$(df -Pk "$root" | awk 'NR==2 {print $4}')
if [ "${avail_kib:-0}" -lt "$need_kib" ]; then
  echo "setup-reference: $((avail_kib / 1024)) MiB free under $root; the reference stack needs" \
       "about 9216 MiB while it installs (free space, or run deploy/test.sh --no-reference)" >&2
  exit 1
fi
scratch="$root/.venv-ref-tmp"
rm -rf "$scratch"; mkdir -p "$scratch"
trap 'rm -rf "$scratch"' EXIT
export TMPDIR="$scratch"

python3 -m venv "$venv"
"$venv/bin/pip" install -q --no-cache-dir "pip==26.3"
"$venv/bin/pip" install -q --no-cache-dir -r "$req" -c "$cons"
touch "$stamp"
echo "setup-reference: installed into $venv"
