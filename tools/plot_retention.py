"""Plots the retention-*.json files of one `sparsefill eval --retention` run into one PNG.

    .venv-ref/bin/python tools/plot_retention.py bench/results/retention.png bench/results/retention-*.json
"""
import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(out, paths):
    fig, ax = plt.subplots(1, 3, figsize=(15, 4))
    meta = None
    for p in paths:
        d = json.load(open(p))
        meta = meta or d
        recs = [r for r in d["records"] if r["decode"] == "full" and r["policy"] != "full"]
        if recs:
            x = [r["kv_bytes"] / r["kv_bytes_full"] for r in recs]
            name = recs[0]["policy"]
            ax[0].plot(x, [r["kl_mean_64"] for r in recs], "o-", label=name)
            ax[1].plot(x, [r["greedy_match_forced_64"] for r in recs], "o-", label=name)
            ax[2].plot(x, [r["passkey_accuracy"] for r in recs], "o-", label=name)
        for r in d["records"]:
            if "psa_eps" in r:
                # KL and the forced match are the teacher-forced draft's: plot them at the draft's
                # reads (a verified run's blocks_visited_frac is its free-running drafts + passes).
                x = r.get("blocks_visited_frac_forced_draft", r["blocks_visited_frac"])
                ax[0].plot(x, r["kl_mean_64"], "k^")
                ax[0].annotate(f"psa {r['psa_eps']}", (x, r["kl_mean_64"]), fontsize=7)
                ax[1].plot(x, r["greedy_match_forced_64"], "k^")
            if r["policy"] == "full" and r["decode"] == "full":
                for a in ax[2:]:
                    a.axhline(r["dense_passkey_accuracy"], color="gray", ls="--", label="full KV")
    ax[0].set_yscale("log")
    ax[0].set_ylabel("mean KL(full || policy), nats")
    ax[1].set_ylabel("teacher-forced greedy match")
    ax[2].set_ylabel("passkey accuracy")
    for a in ax:
        a.set_xlabel("KV bytes kept / full (PSA: blocks visited)")
        a.legend(fontsize=7)
    fig.suptitle(f"KV retention, {meta['prompt_tokens']}-token prompt, {meta['continuation_tokens']} decode steps "
                 f"({meta['device']['cpu']}, {meta['date'][:10]}, {meta['git_commit'][:8]})", fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
