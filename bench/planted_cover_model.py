#!/usr/bin/env python3
"""Adaptive vertical-slash selection as one cover: a numpy model on the planted inputs.

adaptive-vs (FlexPrefill's rule) keeps the columns holding gamma of the scoring rows' mass AND the
diagonals holding gamma of it. Each set alone is sized for all the mass, and the vertical columns'
mass also enters the diagonal sums (a column read by the scoring rows adds to as many offsets), so
its diagonal set scatters over most 64 x 64 tiles (bench/NOTES.md, twentieth and twenty-third
sessions). This models the alternative: columns and diagonals chosen together until their UNION
holds gamma of the scoring rows' mass, each step taking the item (a column or a diagonal) that
adds the most mass not yet covered:
  - greedy: one item a step, exact (a lazy heap; the textbook max-coverage greedy);
  - rounds (what sparsefill runs, sparse_select.h vs_cover_select, CPU and CUDA): each round the
    items with the most uncovered mass, in order, until their uncovered masses sum to half of
    what is missing (all of it once that is under 1/32 of the total), then an exact recount; at
    most 16 rounds. --frac 1 takes all that is missing each round (the first version modelled:
    more overlap between one round's picks, 0.047 against 0.031 at 1M calibrated).
Sinks (columns 0..63) and the local diagonals 0..64 are forced, as in sparsefill. Scoring rows:
the last 64 plus --spread rows spread over [L/8, L-64) (the shipped configs' spread_rows).
Cost: columns as the pairs they add, diagonals as the 64 x 64 tiles they touch (as in
planted_vs_model.py); recall on rows L/4, L/2, 3L/4, L-1 (the bench's sampled rows).

Usage: .venv-ref/bin/python bench/planted_cover_model.py [--lengths 131072] [--spread 256] [--band] [--no-greedy]
       [--base 10000 --peak 12] (the bench's generator) or [--base 500000 --peak 16] (calibrated
       to MInference's Llama-3 figure, bench/planted_oracle.py). 1M: about 2 minutes, 3 GB.
"""
import argparse
import heapq

import numpy as np

from planted_vs_model import gamma_set, logits, recall, softmax_rows, tile_density


def forced_cover(rows, L):
    cov = np.zeros((len(rows), L), bool)
    for a, i in enumerate(rows):
        cov[a, :64] = True
        cov[a, max(0, i - 64): i + 1] = True
    return cov


def residual_sums(p, cov, rows, L):
    pr = np.where(cov, 0.0, p)
    col = pr.sum(axis=0)
    diag = np.zeros(L)
    for a, i in enumerate(rows):
        np.add.at(diag, i - np.arange(i + 1), pr[a, : i + 1])
    return col, diag


def take(p, cov, rows, kind, x, band=False):
    """Covers item x; returns the mass it added and the per-(row, key) updates. band: a diagonal
    covers, in each row, the 64 keys of the unaligned tile the index builder makes for it in the
    row's query block (keys s - x .. s - x + 63, s the block's first row), not only its own key."""
    added = []
    for a, i in enumerate(rows):
        if kind == 1 and band:
            s = (i // 64) * 64
            lo, hi = max(0, s - x), min(i, s - x + 63)
            if lo > hi:
                continue
            new = ~cov[a, lo:hi + 1]
            cov[a, lo:hi + 1] = True
            added.extend((a, i, j, p[a, j]) for j in lo + np.nonzero(new)[0])
            continue
        j = x if kind == 0 else i - x
        if 0 <= j <= i and not cov[a, j]:
            cov[a, j] = True
            added.append((a, i, j, p[a, j]))
    return added


def cover_greedy(p, rows, L, gamma):
    cov = forced_cover(rows, L)
    total, got = p.sum(), (p * cov).sum()
    col, diag = residual_sums(p, cov, rows, L)
    cur = [col, diag]
    heap = [(-col[j], 0, j) for j in np.nonzero(col > 0)[0]]
    heap += [(-diag[o], 1, o) for o in np.nonzero(diag > 0)[0]]
    heapq.heapify(heap)
    picked = ([], [])
    while got < gamma * total and heap:
        neg, kind, x = heapq.heappop(heap)
        v = cur[kind][x]
        if v <= 0:
            continue
        if -neg > v * (1 + 1e-9):  # stale: re-queue at its current value
            heapq.heappush(heap, (-v, kind, x))
            continue
        picked[kind].append(x)
        cur[kind][x] = 0
        for a, i, j, m in take(p, cov, rows, kind, x):
            got += m
            if kind == 0:
                diag[i - j] -= m
            else:
                col[j] -= m
    return picked, got / total


def marginal_costs(L, diags, width_only=False):
    """Pairs each item would add to the index: column j its L - j rows; diagonal d, in every query
    block after it, the offsets of its 64-key range (s - key in [d - 63, d]) that no chosen
    diagonal's range (the forced 0..64 included) reaches yet, for each of the block's 64 rows.
    width_only: a column costs 1 and a diagonal its new offsets (no row counts)."""
    reached = np.zeros(L + 64, bool)
    for d in set(range(65)) | set(diags):
        reached[max(0, d - 63): d + 1] = True
    s = np.concatenate([[0], np.cumsum(~reached)])
    d = np.arange(L)
    new = s[d + 1] - s[np.maximum(0, d - 63)]
    if width_only:
        return np.concatenate([np.ones(L), new.astype(float)])
    return np.concatenate([(L - d).astype(float), (new * (L - d)).astype(float)])


def cover_rounds(p, rows, L, gamma, max_rounds=16, frac=0.5, finish=1 / 32, band=False,
                 rank_band=False, cost=None, free=False):
    """band: diagonals credited with their whole key range; rank_band: also ranked by its
    uncovered mass (band_sums); cost "pairs" or "width": ranked by uncovered mass over
    marginal_costs (credit unchanged: an item's own keys only); free: after each round every
    diagonal whose whole range [d - 63, d] the chosen ranges already read (width 0: the index
    computes it in every row of every query block) is taken too, at no cost."""
    cov = forced_cover(rows, L)
    total = p.sum()
    picked = ([], [])
    n_rounds = 0
    for n_rounds in range(1, max_rounds + 1):
        got = (p * cov).sum()
        if got >= gamma * total:
            n_rounds -= 1
            break
        col, diag = residual_sums(p, cov, rows, L)
        vals = np.concatenate([col, band_sums(p, cov, rows, L) if rank_band else diag])
        if cost:
            c = marginal_costs(L, picked[1], width_only=cost == "width")
            key = np.where(c > 0, vals / np.maximum(c, 1), np.where(vals > 0, np.inf, 0))
            order = np.argsort(-key, kind="stable")
        else:
            order = np.argsort(-vals, kind="stable")
        need = gamma * total - got
        target = need * frac if need > finish * total else need
        k = int(np.searchsorted(np.cumsum(vals[order]), target) + 1)
        for idx in order[:k]:
            kind, x = (0, idx) if idx < L else (1, idx - L)
            if vals[idx] <= 0:
                continue
            picked[kind].append(int(x))
            take(p, cov, rows, kind, int(x), band)
        if free:
            w = marginal_costs(L, picked[1], width_only=True)[L:]
            have = set(range(65)) | set(picked[1])
            for d in np.nonzero(w == 0)[0]:
                if int(d) not in have:
                    picked[1].append(int(d))
                    take(p, cov, rows, 1, int(d))
    return picked, (p * cov).sum() / total, n_rounds


def unaligned_density(L, diags):
    """The diagonal set's pairs as the index builder computes them (fractions of L^2 / 2): in each
    query block (rows s .. s + 63) the diagonals <= 64 apart merge into one key range
    [s - d_last, s - d_first + 63], clipped to the causal keys, every row reading it whole."""
    d = np.sort(diags)
    groups, start = [], d[0]
    for a, b in zip(d[:-1], d[1:]):
        if b - a > 64:
            groups.append((start, a))
            start = b
    groups.append((start, d[-1]))
    s = np.arange(0, L, 64)
    pairs = 0
    for lo, hi in groups:
        w = np.minimum(s - lo + 63, s + 63) - np.maximum(s - hi, 0) + 1
        pairs += 64 * int(np.sum(np.maximum(w, 0)))
    return pairs / (L * L / 2)


def band_recall(p_rows, rows, cols, diags):
    """recall() with each diagonal covering its whole unaligned tile in the row's query block,
    as the built index does (what the bench's sampled recall measures)."""
    got = []
    for a, i in enumerate(rows):
        keep = np.zeros(i + 1, bool)
        keep[cols[cols <= i]] = True
        s = (i // 64) * 64
        for x in diags:
            lo, hi = max(0, s - x), min(i, s - x + 63)
            if lo <= hi:
                keep[lo:hi + 1] = True
        got.append(p_rows[a, : i + 1][keep].sum())
    return float(np.mean(got)), float(np.min(got))


def band_sums(p, cov, rows, L):
    """Each diagonal's uncovered mass over its whole key range (band=True's coverage): for row i
    in the query block from s, diagonal d reads keys s - d .. s - d + 63 (clipped to 0 .. i), a
    window sum of the row's uncovered probabilities (prefix sums, all d at once)."""
    out = np.zeros(L)
    d = np.arange(L)
    for a, i in enumerate(rows):
        c = np.concatenate([[0.0], np.cumsum(np.where(cov[a, : i + 1], 0.0, p[a, : i + 1]))])
        s = (i // 64) * 64
        lo = np.clip(s - d, 0, i + 1)
        hi = np.clip(s - d + 64, 0, i + 1)
        out += c[hi] - c[lo]
    return out


def report(name, L, cols, diags, ps, sampled, extra=""):
    cols = np.array(sorted(set(range(64)) | set(cols)))
    diags = np.array(sorted(set(range(65)) | set(diags)))
    cp = float(np.sum(L - cols)) / (L * L / 2)
    td = tile_density(L, diags)
    ud = unaligned_density(L, diags)
    r = recall(ps, sampled, cols, diags)
    rb = band_recall(ps, sampled, cols, diags)
    print(f"  {name}: {len(cols)} columns (pairs {cp:.4f}), {len(diags)} diagonals (tiles {td:.4f},"
          f" unaligned ranges {ud:.4f}); density about {cp + td:.4f} ({cp + ud:.4f} unaligned);"
          f" sampled-row mass mean {r[0]:.3f}, min {r[1]:.3f} (with the ranges' other keys"
          f" {rb[0]:.3f}, {rb[1]:.3f}){extra}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", default="131072")
    ap.add_argument("--gamma", type=float, default=0.95)
    ap.add_argument("--spread", type=int, default=256)
    ap.add_argument("--base", type=float, default=10000.0)
    ap.add_argument("--peak", type=float, default=12.0)
    ap.add_argument("--frac", type=float, default=0.5)
    ap.add_argument("--band", action="store_true",
                    help="also the rounds with each diagonal credited with its whole key range")
    ap.add_argument("--no-greedy", action="store_true", help="skip the exact greedy (slow at 1M)")
    ap.add_argument("--free", action="store_true",
                    help="also the rounds taking, after each, the diagonals the chosen ranges "
                         "already compute")
    ap.add_argument("--cost", choices=["pairs", "width"],
                    help="also the rounds ranking items by uncovered mass over their marginal "
                         "pairs, or (width) over a diagonal's new offsets with columns at 1")
    args = ap.parse_args()
    for L in (int(x) for x in args.lengths.split(",")):
        last = np.arange(L - 64, L)
        spread = np.linspace(L // 8, L - 65, args.spread).astype(int) if args.spread else []
        rows = np.concatenate([np.asarray(spread, int), last])
        p = softmax_rows(logits(L, rows, base=args.base, peak=args.peak))
        sampled = np.array([L // 4, L // 2, 3 * L // 4, L - 1])
        ps = softmax_rows(logits(L, sampled, base=args.base, peak=args.peak))
        print(f"L={L} base={args.base:.0f} peak={args.peak:g} gamma={args.gamma} "
              f"scoring rows {len(rows)}:")
        # FlexPrefill's two sets, from the same scoring rows.
        col = p.sum(axis=0)
        diag = np.zeros(L)
        for a, i in enumerate(rows):
            np.add.at(diag, i - np.arange(i + 1), p[a, : i + 1])
        report("two gamma sets (adaptive-vs)", L, gamma_set(col, args.gamma, 64),
               gamma_set(diag, args.gamma, 65), ps, sampled)
        if not args.no_greedy:
            (gc, gd), gcov = cover_greedy(p, rows, L, args.gamma)
            report("one cover, greedy", L, gc, gd, ps, sampled, f"; scoring rows {gcov:.3f}")
        (rc, rd), rcov, nr = cover_rounds(p, rows, L, args.gamma, frac=args.frac)
        report("one cover, rounds", L, rc, rd, ps, sampled,
               f"; scoring rows {rcov:.3f} after {nr} rounds")
        if args.free:
            (fc, fd), fcov, nf = cover_rounds(p, rows, L, args.gamma, frac=args.frac, free=True)
            report("one cover, rounds, free diagonals taken", L, fc, fd, ps, sampled,
                   f"; scoring rows {fcov:.3f} after {nf} rounds")
        if args.cost:
            (cc, cd), ccov, nc = cover_rounds(p, rows, L, args.gamma, frac=args.frac,
                                              cost=args.cost)
            report(f"one cover, rounds, ranked by mass over marginal cost ({args.cost})", L, cc,
                   cd, ps, sampled,
                   f"; scoring rows {ccov:.3f} after {nc} rounds")
        if args.band:
            (bc, bd), bcov, nb = cover_rounds(p, rows, L, args.gamma, frac=args.frac, band=True)
            report("one cover, rounds, diagonals credited with their ranges", L, bc, bd, ps,
                   sampled, f"; scoring rows {bcov:.3f} after {nb} rounds")
            (bc, bd), bcov, nb = cover_rounds(p, rows, L, args.gamma, frac=args.frac, band=True,
                                              rank_band=True)
            report("one cover, rounds, diagonals credited with and ranked by their ranges", L,
                   bc, bd, ps, sampled, f"; scoring rows {bcov:.3f} after {nb} rounds")


if __name__ == "__main__":
    main()
