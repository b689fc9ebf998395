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
                 f"{d['date'][:10]}, {d['git_commit'][:10]}", fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=100)


def main():
    for p in sys.argv[1:]:
        d = json.loads(Path(p).read_text())
        out = Path(p).with_suffix(".png")
        if d.get("benchmark") == "prefill-cpu":
            plot_prefill(d, out)
        else:
            sys.exit(f"plot_bench: no plot for benchmark {d.get('benchmark')!r}")
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
