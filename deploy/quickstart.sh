#!/usr/bin/env bash
# The main job on the embedded default: installs dependencies, fetches SmolLM2-135M, builds, and
# prefills the bundled long document on the CPU, exporting its KV cache to out/kv-quickstart.
# Extra arguments go to `sparsefill prefill` (not --export-kv or --force again: a repeated option
# is refused).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$root/deploy/setup.sh"
"$root/deploy/fetch-model.sh"
"$root/deploy/build.sh"
exec "$root/build/tools/sparsefill" prefill --model default --prompt-file "$root/data/long_document.txt" \
  --export-kv "$root/out/kv-quickstart" --force "$@"
