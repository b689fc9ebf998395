#!/usr/bin/env bash
# Pinned Python reference stack (independent implementation for golden + interop tests).
# Installs into .venv-ref/ at the repository root (git-ignored). Idempotent.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$root/.venv-ref"
req="$root/tools/golden/requirements.txt"
stamp="$venv/.installed-$(sha256sum "$req" | cut -c1-16)"
if [ -f "$stamp" ]; then echo "setup-reference: $venv up to date"; exit 0; fi
python3 -m venv "$venv"
"$venv/bin/pip" install -q --upgrade pip
"$venv/bin/pip" install -q -r "$req"
touch "$stamp"
echo "setup-reference: installed into $venv"
