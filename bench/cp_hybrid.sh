#!/usr/bin/env bash
# Sparsity-aware CP: the bytes of the runtime's pull exchange against a push-or-pull exchange,
# counted on the default model's sparse indices of the bundled documents (sf_bench_cp_hybrid,
# bench/cp_hybrid_bench.cpp says what each prices). One single-rank prefill; no MPI.
#
#   bench/cp_hybrid.sh [BUILD_DIR] [OUT.json]
#
# SF_CP_HYBRID_CHARS: prompt length in characters (default 72000, ~16,000 tokens; the documents
# joined as bench/mpi/sparse_cp.sh joins them). SF_CP_HYBRID_CPS: CP sizes (default 2,4,8).
# SF_CP_HYBRID_ARGS: more sf_bench_cp_hybrid options (--skip-pattern P, --parts blocks|columns,
# --share-group P). SF_CP_HYBRID_CONFIG: the sparse config (default the shipped one).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${1:-$root/build}"
out="${2:-$root/bench/results/cp-hybrid-cpu.json}"
chars="${SF_CP_HYBRID_CHARS:-72000}"
cps="${SF_CP_HYBRID_CPS:-2,4,8}"
extra="${SF_CP_HYBRID_ARGS:-}"
config="${SF_CP_HYBRID_CONFIG:-configs/smollm2-135m-instruct.json}"
cmdline="SF_CP_HYBRID_CHARS=$chars SF_CP_HYBRID_CPS=$cps SF_CP_HYBRID_ARGS='$extra' SF_CP_HYBRID_CONFIG=$config $0 $*"
d="$root/data"
tmp="$(mktemp)"
trap 'rm -f "$tmp"' EXIT
"$build/bench/sf_bench_cp_hybrid" --model "$root/models/SmolLM2-135M-Instruct.Q4_1.gguf" \
  --text "$d/long_document.txt,$d/long_document_2.txt,$d/calibration_document.txt,$d/calibration_document_2.txt" \
  --chars "$chars" --config "$root/$config" --cp "$cps" --out "$tmp" $extra
python3 - "$tmp" "$out" "$(git -C "$root" rev-parse HEAD)$(git -C "$root" diff --quiet HEAD -- . || echo -dirty)" "$cmdline" "$config" <<'PY'
import json, sys, datetime, platform
src, out, commit, cmd, config = sys.argv[1:]
doc = json.load(open(src))
cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), platform.machine())
doc = {"device": f"CPU: {cpu}", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
       "commit": commit, "command": cmd, **doc}
doc["config"] = config
json.dump(doc, open(out, "w"), indent=1)
print(f"wrote {out}")
PY
