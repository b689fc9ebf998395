#!/usr/bin/env bash
# expect_fail.sh [--stdout-lacks REGEX2] REGEX CMD...: passes when CMD exits non-zero and its
# stderr is one line matching REGEX (the CLI's bad-input contract: one clear line, non-zero exit).
# --stdout-lacks also requires that no stdout line matches REGEX2 (e.g. that a refusal came before
# the slow part, which prints its timing).
set -u
lacks=""
if [ "${1:-}" = "--stdout-lacks" ]; then lacks="$2"; shift 2; fi
regex="$1"; shift
out_file="$(mktemp)"
trap 'rm -f "$out_file"' EXIT
err="$("$@" 2>&1 >"$out_file")"
rc=$?
if [ $rc -eq 0 ]; then echo "FAIL: exited 0 (expected an error)"; exit 1; fi
# 126-255: not run, or killed by a signal (an abort or crash after the error line) - not a refusal.
if [ $rc -gt 125 ]; then echo "FAIL: exited $rc (a signal or a failed exec, not an error exit)"; printf '%s\n' "$err" | tail -n 20; exit 1; fi
# Log lines ([I model] ...) are not errors; the error itself must be exactly one line.
errlines="$(printf '%s\n' "$err" | grep -v '^\[[DIWE] ' || true)"
n="$(printf '%s\n' "$errlines" | grep -c .)"
if [ "$n" -ne 1 ]; then echo "FAIL: expected one error line, got $n:"; printf '%s\n' "$errlines"; exit 1; fi
if ! printf '%s\n' "$errlines" | grep -Eq -- "$regex"; then echo "FAIL: '$errlines' does not match /$regex/"; exit 1; fi
if [ -n "$lacks" ] && grep -Eq -- "$lacks" "$out_file"; then
  echo "FAIL: stdout has /$lacks/:"; grep -E -- "$lacks" "$out_file"; exit 1
fi
echo "ok (rc=$rc): $errlines"
