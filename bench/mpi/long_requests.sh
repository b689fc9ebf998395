#!/usr/bin/env bash
# One sparsefill-worker batch of long requests on TP x CP GPUs (default CP 2, Llama-3-8B-shaped
# synthetic weights, seeded random token ids) and each request's summary: where a long prefill's time goes
# (plan_s, prefill_s, attention_s, estimate_s, sparse_grows, kv_alloc_s, kv_copy_s, export_s), the
# chunk and plan workspace each ran with, and on GPUs each GPU's peak memory in use (nvidia-smi).
#
#   bench/mpi/long_requests.sh [BUILD_DIR] [OUT.json]
#
# SF_LONG_LENGTHS: the requests' lengths in batch order (default 1040384,1048576: the second is
# a new length, whose plan starts at the first plan's sparse capacity); SF_LONG_LAYERS (default
# 8); SF_LONG_TP and SF_LONG_CP (default 1 and 2; the job runs TP x CP ranks); SF_LONG_ARGS: more worker flags (default "--attention vertical-slash --kv-dtype int4";
# int4 keeps a 1M export to about 11 GB); SF_LONG_DEVICE (default cuda) and SF_LONG_MODEL
# (default synthetic:llama3-8b:LAYERS, which needs a GPU): a smoke test on a CPU machine is
# SF_LONG_DEVICE=cpu SF_LONG_MODEL=default SF_LONG_LENGTHS=1024,1536. On a GPU host:
# bench/gpu/run.sh's SF_WORKER_LONG. SF_WAIT_WHOLE_EXPORT=1 reaches the worker (a request short
# of memory beside a pending export then waits for all of it: the A/B of freeing its K/V early).
set -euo pipefail
lengths="${SF_LONG_LENGTHS:-1040384,1048576}"; layers="${SF_LONG_LAYERS:-8}"
extra="${SF_LONG_ARGS:---attention vertical-slash --kv-dtype int4}"
device="${SF_LONG_DEVICE:-cuda}"; model="${SF_LONG_MODEL:-synthetic:llama3-8b:$layers}"
tp="${SF_LONG_TP:-1}"; cp="${SF_LONG_CP:-2}"
[[ "$tp" =~ ^[1-9][0-9]*$ && "$cp" =~ ^[1-9][0-9]*$ ]] ||
  { echo "long_requests.sh: SF_LONG_TP and SF_LONG_CP must be positive integers (got '$tp', '$cp')" >&2; exit 2; }
whole="${SF_WAIT_WHOLE_EXPORT:-}"
cmdline="${whole:+SF_WAIT_WHOLE_EXPORT=$whole }SF_LONG_DEVICE=$device SF_LONG_MODEL=$model SF_LONG_LENGTHS=$lengths SF_LONG_LAYERS=$layers SF_LONG_TP=$tp SF_LONG_CP=$cp SF_LONG_ARGS='$extra' $0 $*"
# shellcheck source=bench/mpi/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
mpi_bench_setup long-requests.json "$@"
export NCCL_NVLS_ENABLE=0
python3 - "$tmp/p.jsonl" "$lengths" <<'PY'
import json, random, sys
rng = random.Random(1234)
with open(sys.argv[1], "w") as f:
    for i, n in enumerate(int(x) for x in sys.argv[2].split(",")):
        # ids below 32000, inside Llama-3's vocabulary
        f.write(json.dumps({"id": f"r{i}", "tokens": [rng.randrange(32000) for _ in range(n)]}) + "\n")
PY
# On GPUs: every GPU's memory in use, sampled every 250 ms while the job runs (the whole
# processes': weights, plan workspace, cuBLAS/cuDNN/NCCL), for the peak beside the plan's own count.
mem_pid=
if [[ "$device" == cuda ]] && command -v nvidia-smi >/dev/null; then
  nvidia-smi --query-gpu=index,memory.used --format=csv,noheader,nounits -lms 250 >"$tmp/mem.csv" 2>/dev/null &
  mem_pid=$!
fi
t0=$(date +%s%N)
# shellcheck disable=SC2086
mpirun --bind-to none --oversubscribe ${whole:+-x SF_WAIT_WHOLE_EXPORT} -np $((tp * cp)) "$worker" --model "$model" --tp "$tp" --cp "$cp" \
  --device "$device" $extra --batch "$tmp/p.jsonl" --out "$tmp/out" >"$tmp/log" 2>&1 ||
  { [[ -n "$mem_pid" ]] && kill "$mem_pid" 2>/dev/null; cat "$tmp/log"; exit 1; }
wall=$(( ($(date +%s%N) - t0) / 1000000 ))
[[ -n "$mem_pid" ]] && { kill "$mem_pid" 2>/dev/null; wait "$mem_pid" 2>/dev/null || true; }
grep -E '^\[group|^batch' "$tmp/log"
python3 - "$out" "$(mpi_bench_commit)" "$cmdline" "$(mpi_bench_device "$([[ "$device" == cuda ]] && echo gpu)")" "$model" "$wall" "$tmp/out" "$tp" "$cp" "$tmp/mem.csv" <<'PY'
import datetime, glob, json, os, sys
out, commit, cmd, device, model, wall, odir, tp, cp, mem_csv = sys.argv[1:]
peak = {}  # GPU index -> the most MiB in use any sample saw
if os.path.exists(mem_csv):
    for line in open(mem_csv):
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 2 and parts[0].isdigit() and parts[1].isdigit():
            peak[int(parts[0])] = max(peak.get(int(parts[0]), 0), int(parts[1]))
keys = ("id", "n_tokens", "attention", "density", "plan_s", "prefill_s", "attention_s", "estimate_s",
        "sparse_grows", "kv_alloc_s", "kv_copy_s", "comm_s", "export_s", "export_wait_s",
        "export_streamed", "export_layers_at_prefill_end", "memory_wait_s", "export_bytes", "kv_dtype", "chunk",
        "device_workspace_bytes", "plan_parts", "prefill_s_by_rank", "attention_s_by_rank",
        "comm_s_by_rank", "density_by_rank")
reqs = []
for f in sorted(glob.glob(os.path.join(odir, "r*.json"))):
    s = json.load(open(f))
    reqs.append({k: s.get(k) for k in keys})
doc = {"bench": "long_requests", "device": device, "model": model,
       "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
       "commit": commit, "command": cmd, "tp": int(tp), "cp": int(cp), "job_s": int(wall) / 1000,
       "device_memory_peak_mib": [peak[i] for i in sorted(peak)] or None,
       "requests": reqs}
json.dump(doc, open(out, "w"), indent=1)
print("wrote", out)
PY
