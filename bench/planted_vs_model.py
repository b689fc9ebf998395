#!/usr/bin/env python3
"""Where adaptive-vs's density comes from on the planted benchmark inputs: a numpy model.

Models one head of `sparsefill bench attention`'s generator (tools/cli/cmd_bench_attention.cpp,
make_inputs) at strength 1: logits (after the 1/sqrt(d) scale) of query i and key j are
12/32 * sum_f cos((i - j) * 10000^(-f/32)) over 32 rotary pairs, plus 10 on keys 0..3 and a
logit in [4, 9] on ~0.5% of keys. The vertical columns come from numpy's generator, not the
C++ splitmix, so this is a model of the inputs, not the inputs.

From the last 64 rows' softmax it forms adaptive-vs's two gamma sets (columns by summed
probability, diagonals by summed probability along i - j; sink columns 0..63 and diagonals
0..64 forced) and prints, for each:
  - its cost: a column j as the pairs it adds (L - j), the diagonal set as the 64 x 64 tiles its
    offsets touch (a diagonal crosses two tile diagonals), each counted whole as the kernel does;
  - the mass it covers on rows L/4, L/2, 3L/4 and L-1 (mean, min), alone and with the other set.
Densities are fractions of the causal pairs L^2 / 2.

Usage: .venv-ref/bin/python bench/planted_vs_model.py [--lengths 131072] [--gamma 0.95]
(numpy from tools/golden/requirements.txt, via deploy/setup-reference.sh; 1M takes a minute)
"""
import argparse

import numpy as np

N_ROT = 32


def logits(L, rows, seed=1, base=10000.0, peak=12.0):
    """The generator's logits for query rows `rows` (base: the rotary ladder's base; peak: the
    diagonal logit; the bench uses 10000 and 12)."""
    rng = np.random.default_rng(seed)
    h = rng.random(L)
    vert = np.where(h < 1 / 200, 4 + 5 * rng.random(L), 0.0)
    vert[:4] = 10.0
    theta = base ** (-np.arange(N_ROT) / N_ROT)
    out = np.full((len(rows), L), -np.inf)
    for a, i in enumerate(rows):
        dist = (i - np.arange(i + 1)).astype(np.float64)
        k = np.zeros(i + 1)
        for t in theta:
            k += np.cos(dist * t)
        out[a, : i + 1] = peak / N_ROT * k + vert[: i + 1]
    return out


def softmax_rows(lg):
    p = np.exp(lg - lg.max(axis=1, keepdims=True))
    return p / p.sum(axis=1, keepdims=True)


def gamma_set(score, gamma, n_forced):
    """Forced items [0, n_forced), then by score descending until gamma of the total."""
    forced = np.arange(min(n_forced, len(score)))
    rest = np.arange(len(forced), len(score))  # ties: lower index first (stable sort)
    rest = rest[np.argsort(-score[rest], kind="stable")]
    need = gamma * score.sum() - score[forced].sum()
    take = 0 if need <= 0 else int(np.searchsorted(np.cumsum(score[rest]), need) + 1)
    return np.sort(np.concatenate([forced, rest[:take]]))


def tile_density(L, diags):
    n_b = L // 64
    offs = np.unique(np.concatenate([diags // 64, diags // 64 + 1]))
    offs = offs[offs < n_b]
    return float(np.sum(n_b - offs)) * 4096 / (L * L / 2)


def recall(p_rows, rows, cols, diags):
    got = []
    for a, i in enumerate(rows):
        keep = np.zeros(i + 1, bool)
        keep[cols[cols <= i]] = True
        keep[i - diags[diags <= i]] = True
        got.append(p_rows[a, : i + 1][keep].sum())
    return float(np.mean(got)), float(np.min(got))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", default="131072")
    ap.add_argument("--gamma", type=float, default=0.95)
    ap.add_argument("--base", type=float, default=10000.0, help="rotary base (bench: 10000)")
    ap.add_argument("--peak", type=float, default=12.0, help="diagonal logit (bench: 12)")
    args = ap.parse_args()
    for L in (int(x) for x in args.lengths.split(",")):
        last = np.arange(L - 64, L)
        p = softmax_rows(logits(L, last, base=args.base, peak=args.peak))
        col = p.sum(axis=0)
        diag = np.zeros(L)
        for a, i in enumerate(last):
            np.add.at(diag, i - np.arange(i + 1), p[a, : i + 1])
        cols = gamma_set(col, args.gamma, 64)
        diags = gamma_set(diag, args.gamma, 65)
        sampled = np.array([L // 4, L // 2, 3 * L // 4, L - 1])
        ps = softmax_rows(logits(L, sampled, base=args.base, peak=args.peak))
        local = np.arange(65)
        col_cost = float(np.sum(L - cols)) / (L * L / 2)
        print(f"L={L} gamma={args.gamma}: {len(cols)} columns, {len(diags)} diagonals")
        print(f"  column set: pairs {col_cost:.3f}; diagonal set: tiles {tile_density(L, diags):.3f}")
        print("  sampled-row mass (mean, min): both sets %.3f, %.3f; columns + local %.3f, %.3f; "
              "diagonals + sink %.3f, %.3f" % (*recall(ps, sampled, cols, diags),
                                             *recall(ps, sampled, cols, local),
                                             *recall(ps, sampled, np.arange(64), diags)))


if __name__ == "__main__":
    main()
