"""Plots a bench/results JSON beside it (same name, .png).

    .venv-ref/bin/python tools/plot_bench.py bench/results/prefill-cpu.json
"""
import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def plot_prefill(d, out):
    recs = d["records"]
    L = [r["seq_len"] for r in recs]
    fig, ax = plt.subplots(1, 2, figsize=(10, 4))
    ax[0].plot(L, [r["tokens_per_s"] for r in recs], "o-")
    ax[0].set_xscale("log", base=2)
    ax[0].set_xlabel("prompt tokens")
    ax[0].set_ylabel("prefill tokens/s")
    ax[0].set_title("CPU prefill throughput")
    ax[1].plot(L, [r["ratio_to_sgemm_ceiling"] for r in recs], "o-", color="C1")
    ax[1].set_xscale("log", base=2)
    ax[1].set_ylim(0, 1)
    ax[1].set_xlabel("prompt tokens")
    ax[1].set_ylabel("achieved FLOP/s / sgemm FLOP/s")
    ax[1].set_title(f"vs sgemm ceiling {d['sgemm_gflops_2048']:.0f} GFLOP/s")
    dev = d["device"]
    fig.suptitle(f"{d['model']['name']} on {dev['name']} ({dev['hardware_threads']} threads), "
                 f"{d['date'][:10]}, {d.get('source_commit', d['git_commit'])[:10]}", fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=100)


def plot_attention(d, out):
    recs = d["records"]
    fig, ax = plt.subplots(1, 2, figsize=(12, 4.5))
    # Left: dense throughput, ours per dtype beside each SDPA backend of the same run.
    # One line per (mode, dtype, kernel): "dense-ours" has a record per sparse mainloop.
    dense_modes = ("dense", "dense-ours")
    for mode in dense_modes:
        for dt, mk in (("fp32", "s-"), ("bf16", "o-")):
            rs_all = [r for r in recs if r["mode"] == mode and r["dtype"] == dt]
            for kernel in dict.fromkeys(r.get("kernel", "") for r in rs_all):
                rs = [r for r in rs_all if r.get("kernel", "") == kernel]
                ax[0].plot([r["seq_len"] for r in rs], [r["tflops"] for r in rs], mk,
                           label=f"{mode} {dt}: {kernel[:48]}")
    peer = d.get("sdpa_peer", {}).get("results", [])
    for be in sorted({r["backend"] + " " + r["dtype"] for r in peer if r.get("ok")}):
        rs = [r for r in peer if r.get("ok") and r["backend"] + " " + r["dtype"] == be]
        ax[0].plot([r["seq_len"] for r in rs], [r["tflops"] for r in rs], "x--",
                   label=f"SDPA {be}")
    ax[0].set_xscale("log", base=2)
    ax[0].set_yscale("log")
    ax[0].set_xlabel("sequence length")
    ax[0].set_ylabel("TFLOP/s (causal)")
    ax[0].set_title("dense attention")
    ax[0].legend(fontsize=7)
    # Right: total time (estimate + kernel) against density, sparse modes, bf16 and fp32.
    # Records with "error" (a mode that did not fit) have no timing.
    sparse = [r for r in recs if r["mode"] not in dense_modes and "error" not in r]
    lens = sorted({r["seq_len"] for r in sparse})
    for i, L in enumerate(lens):
        for dt, mk in (("fp32", "s"), ("bf16", "o")):
            rs = [r for r in sparse if r["seq_len"] == L and r["dtype"] == dt]
            if not rs:
                continue
            ax[1].scatter([r["density"] for r in rs],
                          [r["time_ms"] + r["estimate_ms"] for r in rs], marker=mk,
                          color=f"C{i}", label=f"{L // 1024}K {dt}: estimate + kernel")
            ax[1].scatter([r["density"] for r in rs], [r["time_ms"] for r in rs], marker=mk,
                          facecolors="none", edgecolors=f"C{i}", label=f"{L // 1024}K {dt}: kernel")
        # bf16 records only: an fp32 record's sdpa_time_ms is the fp32 peer's (another backend).
        sd = [r["sdpa_time_ms"] for r in recs
              if r["seq_len"] == L and r.get("dtype") == "bf16" and r.get("sdpa_time_ms")]
        if sd:
            ax[1].axhline(sd[0], color=f"C{i}", ls="--", lw=1, label=f"{L // 1024}K SDPA best bf16")
    ax[1].set_yscale("log")
    ax[1].set_xlabel("density (fraction of causal pairs computed)")
    ax[1].set_ylabel("ms")
    where = {r.get("estimate_where", "host CPU").split(" ")[0] for r in sparse}
    ax[1].set_title("sparse modes (estimate on " + (", ".join(sorted(where)) or "host") + ")")
    ax[1].legend(fontsize=6)
    dev = d["device"]
    fig.suptitle(f"attention {d['shape']['heads']}q/{d['shape']['kv_heads']}kv heads, "
                 f"d={d['shape']['head_dim']}, causal, on {dev['name']} (driver {dev['driver']}), "
                 f"{d['date'][:10]}, {d.get('source_commit', d['git_commit'])[:10]}", fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=100)


def main():
    for p in sys.argv[1:]:
        d = json.loads(Path(p).read_text())
        out = Path(p).with_suffix(".png")
        if d.get("benchmark") == "prefill-cpu":
            plot_prefill(d, out)
        elif d.get("benchmark") == "attention":
            plot_attention(d, out)
        else:
            sys.exit(f"plot_bench: no plot for benchmark {d.get('benchmark')!r}")
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
