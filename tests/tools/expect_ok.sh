#!/usr/bin/env bash
# expect_ok.sh REGEX CMD...: passes when CMD exits 0 and its output (stdout and stderr together)
# matches REGEX (an ERE over the whole output, newlines included). ctest's PASS_REGULAR_EXPRESSION
# alone ignores the exit code, so a crash after the matched line would pass.
set -u
regex="$1"; shift
out="$("$@" 2>&1)"
rc=$?
printf '%s\n' "$out" | tail -n 60
if [ $rc -ne 0 ]; then echo "FAIL: exited $rc"; exit 1; fi
if ! printf '%s' "$out" | grep -Ezq -- "$regex"; then echo "FAIL: the output does not match /$regex/"; exit 1; fi
echo "ok (rc=0)"
