#!/usr/bin/env bash
# Per-launch GPU time of the decode attention kernels for one call (Nsight Compute's
# gpu__time_duration, each launch serialized), after bench/gpu/run.sh has built build-gpu. Runs
# sf_bench_decode and times the launches ncu picks:
#   SF_PROFILE_DECODE   the bench arguments (default "131072 32 8 128 0.15 f32")
#   SF_PROFILE_KERNELS  an ncu regex of kernel names (default "gqa_|psa_bounds|psa_rank")
#   SF_PROFILE_SKIP     matching launches skipped first (default 92: the bench's psa:0.95 and
#                       psa-avg:0.95 calls, 23 each with bounds and rank, come before psa+gqa)
#   SF_PROFILE_COUNT    launches timed (default 20: one +gqa call at 2,048 pages, 6 rounds)
#   SF_PROFILE_TAG      a suffix for the output files
#   SF_PROFILE_BENCH    the bench binary (default sf_bench_decode; sf_bench_decode_session times
#                       a whole step's kernels, e.g. SF_PROFILE_DECODE="smollm2 4096 2 int8 bf16"
#                       SF_PROFILE_KERNELS=. SF_PROFILE_SKIP=0 SF_PROFILE_COUNT=3000)
# Writes $OUT/ncu-decode-timesTAG.csv (ncu's rows) and $OUT/ncu-decode-timesTAG.txt (time per
# launch and per kernel name).
set -uo pipefail
root="$(pwd)"
out="${OUT:-$root/build-gpu/out}"
mkdir -p "$out"
source "$(dirname "${BASH_SOURCE[0]}")/find_ncu.sh"
if [[ -z "$ncu_bin" ]]; then
  echo "profile_decode_times.sh: no ncu on this host" | tee "$out/ncu-decode-times${SF_PROFILE_TAG:-}.txt"
  exit 2
fi
read -r -a args <<<"${SF_PROFILE_DECODE:-131072 32 8 128 0.15 f32}"
timeout 400 "$ncu_bin" --kernel-name "regex:${SF_PROFILE_KERNELS:-gqa_|psa_bounds|psa_rank}" \
  --launch-skip "${SF_PROFILE_SKIP:-92}" --launch-count "${SF_PROFILE_COUNT:-20}" \
  --metrics gpu__time_duration.sum --csv \
  "$root/build-gpu/bench/${SF_PROFILE_BENCH:-sf_bench_decode}" "${args[@]}" >"$out/ncu-decode-times${SF_PROFILE_TAG:-}.csv" 2>&1
rc=$?
txt="$out/ncu-decode-times${SF_PROFILE_TAG:-}.txt"
{
  echo "# command: SF_PROFILE_BENCH=${SF_PROFILE_BENCH:-sf_bench_decode} SF_PROFILE_DECODE='${args[*]}' SF_PROFILE_KERNELS='${SF_PROFILE_KERNELS:-gqa_|psa_bounds|psa_rank}' SF_PROFILE_SKIP=${SF_PROFILE_SKIP:-92} SF_PROFILE_COUNT=${SF_PROFILE_COUNT:-20} bench/gpu/profile_decode_times.sh"
  echo "# commit: ${SF_SOURCE_COMMIT:-$(cat "$root/.source-commit" 2>/dev/null || git -C "$root" rev-parse --short HEAD 2>/dev/null)}; device: $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | head -1); date: $(date -u +%FT%TZ)"
} >"$txt"
python3 - "$out/ncu-decode-times${SF_PROFILE_TAG:-}.csv" >>"$txt" <<'PY'
import csv, sys, collections
rows = list(csv.reader(open(sys.argv[1])))
start = next((i for i, r in enumerate(rows) if r and r[0] == "ID"), None)
if start is None:
    print("no ncu rows"); sys.exit(0)
h, rows = rows[start], [r for r in rows[start:] if len(r) == len(rows[start])]
ki, vi, ui = h.index("Kernel Name"), h.index("Metric Value"), h.index("Metric Unit")
tot = collections.OrderedDict()
for r in rows[1:]:
    name = r[ki].split("(")[0].split("<")[0].split("::")[-1]
    v = float(r[vi].replace(",", ""))
    unit = r[ui]
    us = v / 1e3 if unit in ("ns", "nsecond") else v if unit in ("us", "usecond") else v * 1e3
    if len(rows) <= 101:  # every launch only for short lists
        print(f"{name:28s} {us:9.1f} us")
    n, t = tot.get(name, (0, 0.0))
    tot[name] = (n + 1, t + us)
print("per kernel:")
for k, (n, t) in tot.items():
    print(f"{k:28s} {n:5d} launches {t:10.1f} us  ({t / n:.1f} us each)")
print(f"total {sum(t for _, t in tot.values()):.1f} us")
PY
exit $rc
