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

Usage: python3 bench/gpu/sdpa_peer.py --lengths 8192,32768 --out sdpa.json
"""
import argparse
import json
import statistics
import sys
import traceback


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

    def save():  # after every record: a run cut short by its time limit keeps what it measured
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)

    for L in [int(x) for x in a.lengths.split(",") if x]:
        flops = 4.0 * a.heads * a.head_dim * L * (L + 1) / 2.0
        for name, backend, dtype, dname in plan:
            if dname == "fp32" and L > a.fp32_max_len:
                continue
            rec = {"seq_len": L, "backend": name, "dtype": dname, "ok": False}
            try:
                g = torch.Generator(device=dev).manual_seed(L)
                q = torch.randn(1, a.heads, L, a.head_dim, device=dev, dtype=dtype, generator=g)
                k = torch.randn(1, a.kv_heads, L, a.head_dim, device=dev, dtype=dtype, generator=g)
                v = torch.randn(1, a.kv_heads, L, a.head_dim, device=dev, dtype=dtype, generator=g)

                def run():
                    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

                with sdpa_kernel([backend]):
                    try:
                        run()
                        torch.cuda.synchronize()
                    except Exception as e:  # backend refuses native GQA: expand K/V once
                        rec["gqa_error"] = str(e).splitlines()[0][:200]
                        rep = a.heads // a.kv_heads
                        k = k.repeat_interleave(rep, 1).contiguous()
                        v = v.repeat_interleave(rep, 1).contiguous()
                        rec["kv_expanded"] = True

                        def run():  # noqa: F811  (plain MHA call on the expanded K/V)
                            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
                        run()
                        torch.cuda.synchronize()
                    for _ in range(2):
                        run()
                    ts = []
                    for _ in range(a.reps):
                        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                        s.record()
                        run()
                        e.record()
                        e.synchronize()
                        ts.append(s.elapsed_time(e))
                ms = statistics.median(ts)
                rec.update(ok=True, time_ms=ms, tflops=flops / (ms * 1e-3) / 1e12, reps=a.reps)
                rec.setdefault("kv_expanded", False)
                print(f"sdpa {name:9s} {dname} L={L}: {ms:.3f} ms  {rec['tflops']:.1f} TFLOP/s"
                      f"{'  (K/V expanded)' if rec['kv_expanded'] else ''}", flush=True)
            except Exception as e:
                rec["error"] = str(e).splitlines()[0][:300] if str(e) else repr(e)
                print(f"sdpa {name} {dname} L={L}: FAILED {rec['error']}", flush=True)
                traceback.print_exc(limit=1)
            out["results"].append(rec)
            save()
            del rec
            torch.cuda.empty_cache()
    save()
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
