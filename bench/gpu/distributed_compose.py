#!/usr/bin/env python3
"""distributed-<gpu>.json from sf_bench_distributed's records (bench/gpu/distributed.sh runs it).

  distributed_compose.py RECORDS.jsonl|RESULT.json OUT.json [COMMAND COMMIT NGPU]

Adds the device (nvidia-smi), date, commit and command, and per record: speedup over the one-GPU
run of the same length, attention and chunk (each record carries its run's), scaling efficiency, and the communication split. CP
exchanges and blocking all-reduces run after the compute stream drains, so their time
(comm_exposed_s, host wait) is all exposed. An overlapped TP grid (tp_overlap) has no such wait
inside a layer: its exposed communication is derived from its blocking twin (same grid, length
and attention, "b" grid): hidden = twin prefill_s - prefill_s, exposed = twin comm - hidden.
Given a RESULT.json instead of records, it re-derives these from the records it holds (stdlib only).
"""
import datetime
import json
import subprocess
import sys


def load(src):
    if src.endswith(".json"):
        old = json.load(open(src))
        return old["records"], old
    try:
        return [json.loads(l) for l in open(src) if l.strip()], None
    except FileNotFoundError:
        return [], None


def derive(recs):
    for r in recs:
        r.setdefault("host_wait_s", r["comm_exposed_s"])  # what the leader's host waited on
        base = r["single_gpu_prefill_s"]
        r["speedup"] = round(base / r["prefill_s"], 4) if r["prefill_s"] > 0 and base > 0 else None
        r["scaling_efficiency"] = round(r["speedup"] / r["gpus"], 4) if r["speedup"] else None
        r["comm_hidden_s"], r["comm_hidden_fraction"] = 0.0, 0.0
        r["comm_exposed_s"] = r["host_wait_s"]
        if r.get("tp_overlap"):
            twin = next((b for b in recs if not b.get("tp_overlap") and b["tp"] == r["tp"]
                         and b["cp"] == r["cp"] and b["seq_len"] == r["seq_len"]
                         and b["attention"] == r["attention"] and b.get("chunk") == r.get("chunk")), None)
            if twin is None:  # not measured
                r["comm_hidden_s"] = r["comm_hidden_fraction"] = r["comm_exposed_s"] = None
            else:
                comm = twin.get("host_wait_s", twin["comm_exposed_s"])
                hidden = twin["prefill_s"] - r["prefill_s"]
                r["comm_hidden_s"] = round(hidden, 6)
                r["comm_hidden_fraction"] = round(hidden / comm, 4) if comm > 0 else None
                r["comm_exposed_s"] = round(comm - hidden, 6)
        r["comm_exposed_fraction"] = (round(r["comm_exposed_s"] / r["prefill_s"], 4)
                                      if r["comm_exposed_s"] is not None and r["prefill_s"] else None)
        if not r["attention"].startswith(("dense", "vertical", "block", "a-shape", "adaptive", "moa", "config")):
            continue
        if "(" not in r["attention"]:
            r["attention"] = ("dense (cuDNN fused flash attention, bf16)" if r["attention"] == "dense" else
                              r["attention"] + " (device estimator per CP piece + our wgmma sparse kernel, bf16)")


def main():
    src, dst = sys.argv[1], sys.argv[2]
    recs, old = load(src)
    derive(recs)
    if old is not None and len(sys.argv) < 6:
        old["records"] = recs
        json.dump(old, open(dst, "w"), indent=1)
        print("re-derived", dst, len(recs), "records")
        return
    cmd, commit, ngpu = sys.argv[3:6]
    smi = lambda q: subprocess.run(["nvidia-smi", f"--query-gpu={q}", "--format=csv,noheader"],
                                   capture_output=True, text=True).stdout.strip().splitlines()
    json.dump({"device": {"gpus": smi("name"), "driver": (smi("driver_version") or ["?"])[0],
                          "count": int(ngpu)},
               "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               "commit": commit, "command": "bench/gpu/distributed.sh (" + cmd + ")",
               "model": "Llama-3-8B-shaped (32 layers, hidden 4096, 32/8 heads of 128, intermediate "
                        "14336, vocab 128256), synthetic bf16 weights drawn on each device",
               "note": "prefill_s: median wall time of the timed runs on the group leader, all layers "
                       "plus the last row's logits; host_wait_s: time the leader's host waited on NCCL "
                       "(drained CP exchanges, blocking all-reduces; overlapped runs: the final wait, "
                       "which includes the GPU finishing its queued compute); comm_exposed_s, "
                       "comm_hidden_s, comm_hidden_fraction: see bench/gpu/distributed_compose.py",
               "records": recs}, open(dst, "w"), indent=1)
    print("wrote", dst, len(recs), "records")


if __name__ == "__main__":
    main()
