#!/usr/bin/env python3
"""Dense-attention peer for `sparsefill bench attention`: torch scaled_dot_product_attention on the
benchmark's shape (batch 1, causal, 32 query heads, 8 KV heads, head_dim 128), per backend.

Tested with the GPU host's environment (GPU-HOST.md): Python 3.12, torch 2.11 (CUDA 13, cuDNN 9.19).
Versions actually used are written into the JSON.

Each backend is forced with torch.nn.attention.sdpa_kernel. GQA is passed natively
(enable_gqa=True); a backend that refuses it is retried with K/V expanded to 32 heads (the JSON
says which, as `kv_expanded`). bf16 runs cuDNN and flash (the peers in DESIGN.md); fp32 runs the
memory-efficient backend, the same-precision peer of our fp32 kernels. Timing: CUDA events,
median of --reps after warm-up; inputs are random normal, never zeros.

--inputs FILE.safetensors (q [n, heads, d], k and v [n, kv_heads, d]), or a pattern with {L}
(`sparsefill bench attention --seed S --dump-inputs PREFIX` writes PREFIX-<L>.safetensors, the
planted tensors our kernels are timed on at each length): each length is also timed on the
file's (first L) rows, its reps alternating with the random inputs' so clock drift weighs on
both; records say which (`inputs`). A GPU at its power cap clocks by the data it
multiplies, so only the same data makes a fair peer.

Usage: python3 bench/gpu/sdpa_peer.py --lengths 8192,32768 --out sdpa.json
"""
import argparse
import json
import os
import statistics
import struct
import sys
import traceback


def read_safetensors(path):
    """({name: (dtype, shape, offset in the file, bytes)}, __metadata__): the format's own
    header, no package."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    base = 8 + n
    return ({k: (v["dtype"], v["shape"], base + v["data_offsets"][0],
                 v["data_offsets"][1] - v["data_offsets"][0])
             for k, v in header.items() if k != "__metadata__"},
            header.get("__metadata__", {}))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", default="8192,32768")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--fp32-max-len", type=int, default=32768,
                    help="skip the fp32 (efficient backend) peer above this length")
    ap.add_argument("--backends", default="cudnn,flash,efficient",
                    help="subset of cudnn,flash,efficient (efficient is the fp32 peer)")
    ap.add_argument("--inputs", default="",
                    help="safetensors q/k/v [n, heads, d]: also time each length on its first rows")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()

    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    dev = torch.device("cuda")
    props = torch.cuda.get_device_properties(dev)
    out = {
        "tool": "bench/gpu/sdpa_peer.py",
        "command": " ".join(sys.argv),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version(),
        "device": props.name,
        "shape": {"heads": a.heads, "kv_heads": a.kv_heads, "head_dim": a.head_dim, "batch": 1,
                  "causal": True},
        "results": [],
    }
    plan = [("cudnn", SDPBackend.CUDNN_ATTENTION, torch.bfloat16, "bf16"),
            ("flash", SDPBackend.FLASH_ATTENTION, torch.bfloat16, "bf16"),
            ("efficient", SDPBackend.EFFICIENT_ATTENTION, torch.float32, "fp32")]
    wanted = set(a.backends.split(","))
    plan = [p for p in plan if p[0] in wanted]

    def load_inputs(path):
        """(q, k, v [n, heads, d] on the host, the file's metadata), or (None, {}) when the file
        does not exist."""
        if not os.path.exists(path):
            return None, {}
        import numpy as np
        meta, file_meta = read_safetensors(path)
        np_dt = {"BF16": np.uint16, "F16": np.float16, "F32": np.float32}
        t = {}
        for name in ("q", "k", "v"):
            dt, shape, off, nbytes = meta[name]
            arr = np.fromfile(path, dtype=np_dt[dt], count=nbytes // np.dtype(np_dt[dt]).itemsize,
                              offset=off).reshape(shape)
            x = torch.from_numpy(arr)
            t[name] = x.view(torch.bfloat16) if dt == "BF16" else x
        if (t["q"].shape[1] != a.heads or t["k"].shape[1] != a.kv_heads
                or t["q"].shape[2] != a.head_dim):
            sys.exit(f"--inputs {path}: shape {list(t['q'].shape)} / {list(t['k'].shape)} "
                     f"is not heads {a.heads}, kv heads {a.kv_heads}, head_dim {a.head_dim}")
        return t, file_meta

    if a.inputs:
        out["inputs_file"] = a.inputs

    def save():  # after every record: a run cut short by its time limit keeps what it measured
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)

    def setup(L, dtype, backend, file_t, rec):
        """The set's tensors on the device and a warmed-up call, or an exception (the record then
        says why). Out of memory is not a GQA refusal: it is raised, not retried expanded."""
        if file_t is None:
            g = torch.Generator(device=dev).manual_seed(L)
            q = torch.randn(1, a.heads, L, a.head_dim, device=dev, dtype=dtype, generator=g)
            k = torch.randn(1, a.kv_heads, L, a.head_dim, device=dev, dtype=dtype, generator=g)
            v = torch.randn(1, a.kv_heads, L, a.head_dim, device=dev, dtype=dtype, generator=g)
        else:  # [n, h, d] -> [1, h, L, d]
            q, k, v = (file_t[n][:L].to(dev).to(dtype).permute(1, 0, 2).unsqueeze(0).contiguous()
                       for n in ("q", "k", "v"))

        def run(q=q, k=k, v=v):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

        with sdpa_kernel([backend]):
            try:
                run()
                torch.cuda.synchronize()
            except torch.cuda.OutOfMemoryError:
                raise
            except Exception as e:  # backend refuses native GQA: expand K/V once
                rec["gqa_error"] = str(e).splitlines()[0][:200]
                rep = a.heads // a.kv_heads
                k = k.repeat_interleave(rep, 1).contiguous()
                v = v.repeat_interleave(rep, 1).contiguous()
                rec["kv_expanded"] = True

                def run(q=q, k=k, v=v):  # noqa: F811  (plain MHA call, expanded K/V)
                    return F.scaled_dot_product_attention(q, k, v, is_causal=True)
                run()
                torch.cuda.synchronize()
            for _ in range(2):
                run()
        rec.setdefault("kv_expanded", False)
        return run

    file_t, file_meta = None, {}
    for L in [int(x) for x in a.lengths.split(",") if x]:
        flops = 4.0 * a.heads * a.head_dim * L * (L + 1) / 2.0
        file_path = a.inputs.replace("{L}", str(L)) if a.inputs else ""
        file_t = None  # the previous length's host copy goes before the next is read
        if file_path:
            file_t, file_meta = load_inputs(file_path)
        for name, backend, dtype, dname in plan:
            if dname == "fp32" and L > a.fp32_max_len:
                continue
            # The input sets timed at this length: random normal, and the file's (first L) rows.
            # The file is BF16, so it is the same data as our kernels' only for bf16 backends.
            sets = [("random normal", None)]
            if file_t is not None and L <= file_t["q"].shape[0] and dname == "bf16":
                sets.append((f"file {os.path.basename(file_path)} (first {L} rows)", file_t))
            recs, runs = [], []
            for label, src in sets:  # each set on its own: one failing keeps the other's record
                rec = {"seq_len": L, "backend": name, "dtype": dname, "inputs": label, "ok": False}
                if src is not None:
                    rec["inputs_meta"] = file_meta
                try:
                    runs.append(setup(L, dtype, backend, src, rec))
                    recs.append(rec)
                except Exception as e:
                    rec["error"] = str(e).splitlines()[0][:300] if str(e) else repr(e)
                    print(f"sdpa {name} {dname} L={L} [{label[:40]}]: FAILED {rec['error']}", flush=True)
                    traceback.print_exc(limit=1)
                    out["results"].append(rec)
                    torch.cuda.empty_cache()
            try:
                ts = [[] for _ in recs]
                with sdpa_kernel([backend]):
                    for r in range(a.reps):  # the sets' reps alternate, the first rotating
                        for j in range(len(recs)):
                            i = (r + j) % len(recs)
                            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                            s.record()
                            runs[i]()
                            e.record()
                            e.synchronize()
                            ts[i].append(s.elapsed_time(e))
                for rec, t in zip(recs, ts):
                    ms = statistics.median(t)
                    rec.update(ok=True, time_ms=ms, tflops=flops / (ms * 1e-3) / 1e12, reps=a.reps)
                    print(f"sdpa {name:9s} {dname} L={L} [{rec['inputs'][:40]}]: {ms:.3f} ms  "
                          f"{rec['tflops']:.1f} TFLOP/s{'  (K/V expanded)' if rec['kv_expanded'] else ''}",
                          flush=True)
            except Exception as e:
                for rec in recs:
                    if not rec["ok"]:
                        rec["error"] = str(e).splitlines()[0][:300] if str(e) else repr(e)
                print(f"sdpa {name} {dname} L={L}: FAILED timing: {e}", flush=True)
                traceback.print_exc(limit=1)
            out["results"].extend(recs)
            save()
            # The closures hold the tensors: drop them before the next backend or length.
            del recs, runs
            torch.cuda.empty_cache()
    save()
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
