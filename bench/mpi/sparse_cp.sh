#!/usr/bin/env bash
# Sparsity-aware CP on the CPU: bytes the selective KV exchange moves against the per-layer
# all-gather, with the index estimated where the keys live (--cp-estimate --selective-kv), on the
# default model and ~4,150 tokens of the bundled document.
#
#   bench/mpi/sparse_cp.sh [BUILD_DIR] [OUT.json]
#
# SF_SPARSE_CP_CHARS: prompt length in characters (default 18000, ~4,150 tokens); past the
# 25,897 characters of data/long_document.txt the bundled documents are joined (the model's 8K
# context is exceeded past ~35,000: the run passes --allow-long, bytes are what is measured).
# SF_SPARSE_CP_RUNS: "CP MODE" pairs separated by ';' (default: the six below).
#
# Configs: the shipped configs/smollm2-135m-instruct.json (vertical-slash, block-sparse, a-shape
# and dense heads), "vs-only" (its block-sparse heads replaced by vertical-slash with n_vertical
# 256, n_slash 130, spread 256) and "a-shape" (sink + window), the lower bound.
set -euo pipefail
cmdline="SF_SPARSE_CP_CHARS=${SF_SPARSE_CP_CHARS:-18000} SF_SPARSE_CP_RUNS='${SF_SPARSE_CP_RUNS:-default}' $0 $*"
# shellcheck source=bench/mpi/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
mpi_bench_setup sparse-cp-cpu.json "$@"
export SF_NUM_THREADS=1
python3 - "$root" "$tmp" <<'EOF'
import json, sys
root, tmp = sys.argv[1:]
c = json.load(open(f"{root}/configs/smollm2-135m-instruct.json"))
for layer in c["layers"]:
    for h in layer:
        if h["pattern"] in ("block-sparse", "adaptive-block"):
            keep = {k: h[k] for k in ("sink", "local", "score") if k in h}
            h.clear()
            h.update(keep, pattern="vertical-slash", n_vertical=256, n_slash=130, spread_rows=256)
json.dump(c, open(f"{tmp}/vs-only.json", "w"))
import os
docs = ["long_document.txt", "long_document_2.txt", "calibration_document.txt", "calibration_document_2.txt"]
text = "\n\n".join(open(f"{root}/data/{d}").read() for d in docs)[: int(os.environ.get("SF_SPARSE_CP_CHARS", "18000"))]
open(f"{tmp}/p.jsonl", "w").write(json.dumps({"id": "doc", "prompt": text}) + "\n")
EOF
records=()
runs="${SF_SPARSE_CP_RUNS:-2 config:$root/configs/smollm2-135m-instruct.json;4 config:$root/configs/smollm2-135m-instruct.json;2 config:$tmp/vs-only.json;4 config:$tmp/vs-only.json;2 a-shape;4 a-shape}"
IFS=';' read -ra run_list <<<"${runs//\$tmp/$tmp}"
for run in "${run_list[@]}"; do
  set -- $run
  rm -rf "$tmp/out"
  mpirun --bind-to none --oversubscribe -np "$1" "$worker" --model default --cp "$1" --attention "$2" \
    --cp-estimate --selective-kv --allow-long --batch "$tmp/p.jsonl" --out "$tmp/out" >"$tmp/log" 2>&1 || { cat "$tmp/log"; exit 1; }
  records+=("$(sed -e "s|$tmp/||" -e "s|$root/||" "$tmp/out/doc.json")")
  echo "cp $1 $2: $(grep 'doc:' "$tmp/log")"
done
python3 - "$out" "$(git -C "$root" rev-parse HEAD)$(git -C "$root" diff --quiet HEAD -- . || echo -dirty)" "$cmdline" "${records[@]}" <<'EOF'
import json, sys, datetime
out, commit, cmd, *recs = sys.argv[1:]
rows = []
for r in map(json.loads, recs):
    ag = r["kv_allgather_bytes"]
    rows.append({"cp": r["cp"], "attention": r["attention"], "seq_len": r["n_tokens"], "density": r["density"],
                 "allgather_bytes": ag, "kv_moved_bytes": r["kv_moved_bytes"], "estimate_bytes": r["estimate_bytes"],
                 "estimate_bytes_parts": r.get("estimate_bytes_parts"),
                 "moved_fraction": round(r["kv_moved_bytes"] / ag, 4),
                 "moved_plus_estimate_fraction": round((r["kv_moved_bytes"] + r["estimate_bytes"]) / ag, 4),
                 "prefill_s": r["prefill_s"]})
    if "group_kv_allgather_bytes" in r:
        gag = r["group_kv_allgather_bytes"]
        rows[-1].update({"group_density": r["group_density"], "group_allgather_bytes": gag,
                         "group_kv_moved_bytes": r["group_kv_moved_bytes"],
                         "group_estimate_bytes": r["group_estimate_bytes"],
                         "kv_moved_bytes_by_rank": r["kv_moved_bytes_by_rank"],
                         "estimate_bytes_by_rank": r["estimate_bytes_by_rank"],
                         "group_moved_fraction": round(r["group_kv_moved_bytes"] / gag, 4),
                         "group_moved_plus_estimate_fraction":
                             round((r["group_kv_moved_bytes"] + r["group_estimate_bytes"]) / gag, 4),
                         "max_rank_moved_plus_estimate_fraction":
                             round(max(m + e for m, e in zip(r["kv_moved_bytes_by_rank"],
                                                             r["estimate_bytes_by_rank"])) * len(r["kv_moved_bytes_by_rank"]) / gag, 4)})
cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "")
json.dump({"device": {"cpu": cpu}, "date": datetime.datetime.utcnow().isoformat() + "Z", "commit": commit,
           "command": cmd, "model": "SmolLM2-135M-Instruct Q4_1 (fp32 compute)",
           "note": "allgather_bytes, kv_moved_bytes, estimate_bytes, density and the *_fraction fields "
                   "without a prefix are rank 0's (it holds the last chunk); group_* are the sums over "
                   "every rank of the job, *_by_rank each rank's (rank order), max_rank_* the worst "
                   "rank against its own all-gather share; bytes are received per prefill (all "
                   "layers); estimate bytes count each all-reduce as a reduce-scatter plus an all-gather, 2(CP-1)/CP of its array (before 5323697: twice its array)",
           "records": rows}, open(out, "w"), indent=1)
print("wrote", out)
EOF
