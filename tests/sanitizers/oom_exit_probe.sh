#!/usr/bin/env bash
# Runs oom_exit_probe.cu's check on a full device, plain and under compute-sanitizer memcheck,
# and prints each exit status (GPU host; $OUT optional). See the .cu for why.
set -u
here=$(cd "$(dirname "$0")" && pwd)
bin=${TMPDIR:-/tmp}/oom_exit_probe
nvcc -O1 -arch=sm_90a -o "$bin" "$here/oom_exit_probe.cu" || exit 1
san=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
"$bin" fill >"$bin.fill.log" 2>&1 &
filler=$!
for _ in $(seq 1 120); do grep -q '^full' "$bin.fill.log" && break; sleep 0.5; done
cat "$bin.fill.log"
"$bin" check; echo "plain: exit $?"
"$san" --tool memcheck "$bin" check; echo "memcheck: exit $?"
"$san" --tool memcheck --report-api-errors no "$bin" check; echo "memcheck --report-api-errors no: exit $?"
"$san" --tool memcheck --leak-check full "$bin" check; echo "memcheck --leak-check full: exit $?"
kill "$filler"; wait "$filler" 2>/dev/null
"$san" --tool memcheck "$bin" check; echo "memcheck, device not full: exit $?"
