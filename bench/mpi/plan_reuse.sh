#!/usr/bin/env bash
# sparsefill-worker --device cuda: what planning costs a batch whose prompt lengths differ (each
# new length plans its device prefill again), with the plans' buffers kept between them
# (model::DeviceBufferCache, the default) and freed (SF_DEVICE_BUFFER_CACHE=0). np 2 x CP 2,
# --model synthetic:llama3-8b:LAYERS, seeded random token ids.
# SF_PLAN_COMPARE=staging compares instead the default pinned K/V ring (--kv-staging-layers 8)
# with a slot per layer (--kv-staging-layers 0), the buffer cache on in both.
#
#   bench/mpi/plan_reuse.sh [BUILD_DIR] [OUT.json]
#
# SF_PLAN_LENGTHS: the requests' lengths in batch order (default 126976,131072,118784,122880:
# the second grows past the first, the last two fit in what the second left); SF_PLAN_LAYERS
# (default 8); SF_PLAN_REPS (default 1) pairs of jobs, alternating which mode goes first;
# SF_PLAN_ARGS: more worker flags for both. An untimed one-request job runs first (a fresh
# machine's first job pays for first-touching its memory).
# SF_PLAN_ARGS must not set --kv-staging-layers or --tp (the records name 8 and 1).
# Each record: the job's wall time and, per request, plan_s (the worker's: the last plan's
# release and this plan) and plan_parts (this rank's device prefill plan: device buffers, pinned
# host buffers, sparse plans, shapes; bytes reused and allocated), prefill_s and export_s.
set -euo pipefail
lengths="${SF_PLAN_LENGTHS:-126976,131072,118784,122880}"; layers="${SF_PLAN_LAYERS:-8}"
extra="${SF_PLAN_ARGS:-}"
compare="${SF_PLAN_COMPARE:-cache}"
[[ "$compare" == cache || "$compare" == staging ]] || { echo "SF_PLAN_COMPARE: cache or staging" >&2; exit 2; }
cmdline="SF_PLAN_COMPARE=$compare SF_PLAN_LENGTHS=$lengths SF_PLAN_LAYERS=$layers SF_PLAN_REPS=${SF_PLAN_REPS:-1} SF_PLAN_ARGS='$extra' $0 $*"
# shellcheck source=bench/mpi/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
mpi_bench_setup plan-reuse.json "$@"
export NCCL_NVLS_ENABLE=0
model="synthetic:llama3-8b:$layers"
python3 - "$tmp" "$lengths" <<'PY'
import json, random, sys
tmp, lengths = sys.argv[1], [int(x) for x in sys.argv[2].split(",")]
rng = random.Random(1234)
with open(f"{tmp}/p.jsonl", "w") as f:
    for i, n in enumerate(lengths):
        # ids below 32000, inside Llama-3's vocabulary
        f.write(json.dumps({"id": f"r{i}", "tokens": [rng.randrange(32000) for _ in range(n)]}) + "\n")
PY
run_job() {  # $1: batch file, $2: out dir, $3: log, $4: the mode (1: the default, 0: the other)
  local cache=1 more=""
  if [[ "$4" == 0 && "$compare" == cache ]]; then cache=0; fi
  if [[ "$4" == 0 && "$compare" == staging ]]; then more="--kv-staging-layers 0"; fi
  # shellcheck disable=SC2086
  SF_DEVICE_BUFFER_CACHE=$cache mpirun --bind-to none --oversubscribe -np 2 -x SF_DEVICE_BUFFER_CACHE \
    "$worker" --model "$model" --device cuda --cp 2 $more $extra --batch "$1" --out "$2" >"$3" 2>&1 ||
    { cat "$3"; exit 1; }
}
head -1 "$tmp/p.jsonl" >"$tmp/w.jsonl"
run_job "$tmp/w.jsonl" "$tmp/warm" "$tmp/log" 1
rm -rf "$tmp/warm"
order=()
for ((i = 0; i < ${SF_PLAN_REPS:-1}; i++)); do
  if ((i % 2 == 0)); then order+=(1 0); else order+=(0 1); fi
done
records=()
for mode in "${order[@]}"; do
  rm -rf "$tmp/out"
  t0=$(date +%s%N)
  run_job "$tmp/p.jsonl" "$tmp/out" "$tmp/log" "$mode"
  wall=$(( ($(date +%s%N) - t0) / 1000000 ))
  grep -E '^\[group|^batch' "$tmp/log" || true
  records+=("$mode $wall $(cat "$tmp"/out/r*.json | python3 -c 'import json,sys; r=[json.loads(l) for l in sys.stdin]; print(json.dumps(r))')")
done
device="$(mpi_bench_device gpu)"
commit="$(mpi_bench_commit)"
python3 - "$out" "$commit" "$cmdline" "$device" "$model" "$compare" "${records[@]}" <<'PY'
import json, sys, datetime
out, commit, cmd, device, model, compare, *recs = sys.argv[1:]
rows = []
for rec in recs:
    mode, wall, reqs = rec.split(" ", 2)
    reqs = sorted(json.loads(reqs), key=lambda r: r["line"])
    rows.append({"variant": ("default" if mode == "1" else
                             ("SF_DEVICE_BUFFER_CACHE=0" if compare == "cache" else "--kv-staging-layers 0")),
                 "buffer_cache": mode == "1" or compare == "staging",
                 "kv_staging_layers": 0 if (mode == "0" and compare == "staging") else 8,
                 "job_s": int(wall) / 1000,
                 "plan_s": sum(r["plan_s"] for r in reqs),
                 "requests": [{k: r[k] for k in ("id", "n_tokens", "plan_s", "plan_parts", "prefill_s", "export_s", "export_wait_s")}
                              for r in reqs]})
doc = {"bench": "plan_reuse", "device": device, "model": model, "tp": 1, "cp": 2,
       "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
       "commit": commit, "command": cmd, "runs": rows}
json.dump(doc, open(out, "w"), indent=1)
for r in rows:
    per = ", ".join(f"{q['n_tokens']}: {q['plan_s']:.2f}" for q in r["requests"])
    pre = ", ".join(f"{q['prefill_s']:.2f}" for q in r["requests"])
    print(f"{r['variant']}: job {r['job_s']:.2f} s, plans {r['plan_s']:.2f} s ({per}), prefills {pre} s")
print("wrote", out)
PY
