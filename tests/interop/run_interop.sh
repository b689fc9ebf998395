#!/usr/bin/env bash
# ctest wrapper for the KV-export interop test (label: interop).
# Usage: run_interop.sh PATH_TO_sparsefill SOURCE_DIR [--self-check]
# --self-check: the checker itself on exports fabricated from HF's cache (clean ones must pass,
# perturbed ones fail), so a checker that cannot fail is caught.
# Uses SOURCE_DIR/.venv-ref/bin/python (deploy/setup.sh --with-reference); exits 77 (skip) without it.
# Model: $SF_MODEL, else SOURCE_DIR/models/SmolLM2-135M-Instruct.Q4_1.gguf.
set -euo pipefail

if [ "$#" -lt 2 ] || [ "$#" -gt 3 ] || { [ "$#" -eq 3 ] && [ "$3" != --self-check ]; }; then
  echo "usage: $0 PATH_TO_sparsefill SOURCE_DIR [--self-check]" >&2
  exit 2
fi
BIN=$1
SRC=$2
MODE=(--bin "$BIN")
if [ "$#" -eq 3 ]; then MODE=(--self-check); fi
PY="$SRC/.venv-ref/bin/python"
if [ ! -x "$PY" ]; then
  # deploy/test.sh installs the stack and sets SF_REQUIRE_REFERENCE=1: a missing one fails there.
  if [ "${SF_REQUIRE_REFERENCE:-0}" = 1 ]; then
    echo "FAIL: SF_REQUIRE_REFERENCE=1 but the reference stack is not installed ($PY)"
    exit 1
  fi
  echo "SKIP: reference stack not installed (deploy/setup.sh --with-reference)"
  exit 77
fi
MODEL=${SF_MODEL:-$SRC/models/SmolLM2-135M-Instruct.Q4_1.gguf}

WORKDIR=$(mktemp -d "${TMPDIR:-/tmp}/sf-interop.XXXXXX")
cleanup() { rm -rf -- "$WORKDIR"; }
trap cleanup EXIT

rc=0
"$PY" "$SRC/tests/interop/test_kv_interop.py" "${MODE[@]}" --model "$MODEL" --workdir "$WORKDIR" || rc=$?
exit "$rc"
