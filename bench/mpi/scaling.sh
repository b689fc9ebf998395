#!/usr/bin/env bash
# CPU sanity figure for the MPI runtime (issue 5, "record the MPI runs' scaling"): one prompt of
# the bundled document through sparsefill-worker on several TP x CP grids, each against one rank
# with one BLAS/pool thread (the per-rank setting of every grid). Not a target: on a 2-core
# machine only CP 2 / TP 2 have a core per rank; larger grids are oversubscribed.
#
#   bench/mpi/scaling.sh [BUILD_DIR] [OUT.json] [CHARS]
#
# Ranks are not bound to cores (--bind-to none): OpenMPI binds np <= 2 jobs to one core each by
# default, which would also pin a one-rank baseline's threads to one core.
set -euo pipefail
cmdline="$0 $*"
load0="$(cut -d' ' -f1-3 /proc/loadavg)"
# shellcheck source=bench/mpi/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
mpi_bench_setup distributed-cpu-mpi.json "$@"
chars="${3:-9000}"
export SF_NUM_THREADS=1
python3 - "$root/data/long_document.txt" "$chars" >"$tmp/p.jsonl" <<'EOF'
import json, sys
print(json.dumps({"id": "doc", "prompt": open(sys.argv[1]).read()[: int(sys.argv[2])]}))
EOF
grids=("1 1" "1 2" "3 1" "1 4")
records=()
for g in "${grids[@]}"; do
  set -- $g
  np=$(( $1 * $2 ))
  rm -rf "$tmp/out"
  mpirun --bind-to none --oversubscribe -np "$np" "$worker" --model default --tp "$1" --cp "$2" \
    --batch "$tmp/p.jsonl" --out "$tmp/out" >"$tmp/log" 2>&1 || { cat "$tmp/log"; exit 1; }
  records+=("$(cat "$tmp/out/doc.json")")
  echo "tp $1 cp $2: $(grep 'doc:' "$tmp/log")"
done
python3 - "$out" "$(nproc)" "$(git -C "$root" rev-parse HEAD)" "$cmdline" "$load0" "${records[@]}" <<'EOF'
import json, sys, datetime, platform
out, ncpu, commit, cmd, load0, *recs = sys.argv[1:]
recs = [json.loads(r) for r in recs]
base = next(r for r in recs if r["tp"] == 1 and r["cp"] == 1)["prefill_s"]
cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), platform.processor())
rows = []
for r in recs:
    rows.append({"tp": r["tp"], "cp": r["cp"], "ranks": r["tp"] * r["cp"], "seq_len": r["n_tokens"],
                 "prefill_s": r["prefill_s"], "single_rank_prefill_s": base, "speedup": round(base / r["prefill_s"], 3),
                 "comm_s": r["comm_s"], "comm_bytes": r["comm_bytes"], "allgather_bytes": r["kv_allgather_bytes"],
                 "tp_allreduce_bytes": r["tp_allreduce_bytes"]})
json.dump({"device": {"cpu": cpu, "cores": int(ncpu)}, "date": datetime.datetime.utcnow().isoformat() + "Z",
           "commit": commit, "command": cmd, "model": "SmolLM2-135M-Instruct Q4_1 (fp32 compute)",
           "note": "one BLAS/pool thread per rank; grids beyond the core count are oversubscribed",
           "loadavg_before": load0, "loadavg_after": open("/proc/loadavg").read().split()[:3],
           "records": rows}, open(out, "w"), indent=1)
print("wrote", out)
EOF
