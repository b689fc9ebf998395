#!/usr/bin/env bash
# expect_ok.sh REGEX CMD...: passes when CMD exits 0 and its output (stdout and stderr together)
# matches REGEX (an ERE over the whole output, newlines included). ctest's PASS_REGULAR_EXPRESSION
# alone ignores the exit code, so a crash after the matched line would pass.
# --or-error REGEX2: an error exit (1-125) also passes when its last output line matches REGEX2
# (e.g. a command whose device part cannot run on a host without one), REGEX still required.
set -u
or_error=""
if [ "${1:-}" = "--or-error" ]; then or_error="$2"; shift 2; fi
regex="$1"; shift
out="$("$@" 2>&1)"
rc=$?
printf '%s\n' "$out" | tail -n 60
if [ $rc -ne 0 ]; then
  last="$(printf '%s\n' "$out" | tail -n 1)"
  if [ -z "$or_error" ] || [ $rc -gt 125 ] || ! printf '%s\n' "$last" | grep -Eq -- "$or_error"; then
    echo "FAIL: exited $rc"; exit 1
  fi
fi
if ! printf '%s' "$out" | grep -Ezq -- "$regex"; then echo "FAIL: the output does not match /$regex/"; exit 1; fi
echo "ok (rc=$rc)"
