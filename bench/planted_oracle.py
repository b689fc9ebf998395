#!/usr/bin/env python3
"""How concentrated the planted benchmark inputs are, and what that allows the adaptive target.

Uses the numpy model of `sparsefill bench attention`'s generator (bench/planted_vs_model.py) on
rows L/4, L/2, 3L/4 and L-1 (the bench's sampled rows), and prints per setting:
  - top3%: the mass on a row's top 1/32 of keys (MInference's Fig. 2(b) for Llama-3-8B at 128K:
    the top 4K of 128K keys hold 96.4% of the attention), to compare the inputs with a real model;
  - keys95 / blocks95: the fraction of a row's causal keys (64-key blocks) an exact per-row oracle
    needs for 0.95 of its mass; no index covering 0.95 of every row computes fewer pairs;
  - bound: 1 / keys95, the speedup over dense that computing only those keys would give at equal
    throughput (the adaptive target asks 20x SDPA at 1M with gamma 0.95).
Settings: the bench's generator (rotary base 10000, peak logit 12), Llama-3's rotary base
(500000), and stronger peaks (sharper decay with distance).

Usage: .venv-ref/bin/python bench/planted_oracle.py [--lengths 131072,1048576]
(numpy from tools/golden/requirements.txt; about a minute at 1M)
"""
import argparse

import numpy as np

from planted_vs_model import logits, softmax_rows


def fraction_for(p, gamma):
    s = np.sort(p)[::-1]
    return (int(np.searchsorted(np.cumsum(s), gamma)) + 1) / len(p)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", default="131072,1048576")
    ap.add_argument("--gamma", type=float, default=0.95)
    args = ap.parse_args()
    settings = [(1e4, 12.0, "bench generator"), (5e5, 12.0, "Llama-3 rotary base"),
                (5e5, 16.0, "Llama-3 base, peak 16"), (1e4, 16.0, "peak 16")]
    print("| L | setting | base | peak | top3% (mean) | keys95 (mean, max) | blocks95 (mean, max) | bound 1/keys95 |")
    print("|---|---|---|---|---|---|---|---|")
    for L in (int(x) for x in args.lengths.split(",")):
        rows = np.array([L // 4, L // 2, 3 * L // 4, L - 1])
        for base, peak, name in settings:
            p = softmax_rows(logits(L, rows, base=base, peak=peak))
            top, kf, bf = [], [], []
            for a, i in enumerate(rows):
                r = p[a, : i + 1]
                top.append(np.sort(r)[::-1][: max(1, (i + 1) // 32)].sum())
                kf.append(fraction_for(r, args.gamma))
                nb = (i + 1 + 63) // 64
                rb = np.zeros(nb * 64)
                rb[: i + 1] = r
                bf.append(fraction_for(rb.reshape(nb, 64).sum(1), args.gamma))
            print(f"| {L} | {name} | {base:.0f} | {peak:.0f} | {np.mean(top):.3f} | "
                  f"{np.mean(kf):.4f}, {np.max(kf):.4f} | {np.mean(bf):.4f}, {np.max(bf):.4f} | "
                  f"{1 / np.mean(kf):.1f}x |")


if __name__ == "__main__":
    main()
