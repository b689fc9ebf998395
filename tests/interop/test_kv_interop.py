#!/usr/bin/env python3
"""KV-export interop test: a sparsefill KV export must drive Hugging Face generation unchanged.

Usage (standalone):

    .venv-ref/bin/python tests/interop/test_kv_interop.py --bin build/tools/sparsefill \
        --model models/SmolLM2-135M-Instruct.Q4_1.gguf --workdir /tmp/sf-interop
    .venv-ref/bin/python tests/interop/test_kv_interop.py --self-check --workdir /tmp/sf-interop

ctest runs it through tests/interop/run_interop.sh (label `interop`).
Exit codes: 0 pass, 1 fail, 77 skip (prints "SKIP: <reason>"), 2 usage error.

For each case (a ~500-token slice of data/long_document.txt, and a short ChatML prompt) it:

1. writes the prompt file and runs `sparsefill prefill --model M --prompt-file F --export-kv DIR --force`;
2. checks manifest.json (format "sparsefill-kv", format_version 6, dtype F32, kv_dtype f32 (the
   default encoding), retention "full" with every head's `runs` decoded here to [0, n_tokens),
   model geometry against the HF config, one shard per layer, shard sizes) and, when the `xxhash`
   package is importable, each shard's xxh64 (of the whole file, seed 0); without it only that check
   is skipped and the output says so;
3. loads each layer_XXX.safetensors (`key`, `value`: F32 [1, n_kv_heads, N, head_dim], keys after
   RoPE in HF's rotate-half convention) with safetensors.torch.load_file;
4. runs HF's own forward on the manifest's token_ids with a DynamicCache and reports, per layer,
   max |K_ours - K_hf| and max |V_ours - V_hf|; fails above TOL (below);
5. fills a transformers.DynamicCache from the export (cache.update(key, value, layer)), feeds
   `first_token` and decodes 16 tokens greedily; separately runs HF generate (greedy, 17 new tokens,
   EOS ignored) on the full token_ids; asserts HF's first token == manifest first_token and that
   the 16 continuation tokens match exactly.

Tolerance. Both sides are fp32 computations from the same dequantized GGUF weights, so they differ
only by rounding and summation order. Measured on this model (500-token prompt), HF fp32 keys and
values differ from an fp64 run of the same model by at most 3.5e-5 (|K| reaches ~20, |V| ~15), so
an independent fp32 implementation is expected within ~1e-4. TOL = 1e-3 absolute leaves ~30x head
room over fp32 rounding while catching any real error: a single value off by 0.1, a wrong RoPE
convention (interleaved vs rotate-half), theta or position (errors of order |K|), or a
quantized-activation matmul (~1e-2). Override with --tol for diagnosis only.

Model loading notes (transformers 4.46.3 with a GGUF): the GGUF has no output.weight, so the model
is loaded with tie_word_embeddings=True (otherwise HF initialises a random lm_head).

--self-check needs no binary: it fabricates exports from HF's own cache in the same format and
checks that the verification passes on them, and fails on (a) one key value perturbed by 0.1 (with
checksums updated, so the numeric check must catch it), (b) keys stored in the interleaved RoPE
layout, and (c) a shard modified without updating its xxh64 (when xxhash is present).
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time

SKIP = 77
HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.abspath(os.path.join(HERE, "..", ".."))
DEFAULT_MODEL = os.path.join(REPO, "models", "SmolLM2-135M-Instruct.Q4_1.gguf")

TOL = 1e-3
N_CONT = 16
DOC_SLICE_START = "5. The Arithmetic of Water"
DOC_SLICE_TOKENS = 500
CHAT_TEXT = (
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
    "<|im_end|>\n<|im_start|>user\nWhat does the cill of a canal lock do, and why should boaters "
    "keep clear of it?<|im_end|>\n<|im_start|>assistant\n"
)


def decode_position_runs(text: str) -> list:
    """A manifest head's `runs` (format 6): base64 of LEB128 varint pairs (gap, length)."""
    data = base64.b64decode(text, validate=True)
    vals, v, shift = [], 0, 0
    for b in data:
        v |= (b & 0x7F) << shift
        shift += 7
        if not b & 0x80:
            vals.append(v)
            v, shift = 0, 0
    out, end = [], 0
    for gap, length in zip(vals[0::2], vals[1::2]):
        out.append((end + gap, end + gap + length))
        end += gap + length
    return out


def encode_position_runs(runs: list) -> str:
    """The inverse of decode_position_runs: [(begin, end), ...] in order -> base64 LEB128."""
    out, end = bytearray(), 0
    for b, e in runs:
        for v in (b - end, e - b):
            while True:
                byte = v & 0x7F
                v >>= 7
                out.append(byte | (0x80 if v else 0))
                if not v:
                    break
        end = e
    return base64.b64encode(bytes(out)).decode()


def skip(reason: str) -> None:
    # deploy/test.sh installs the reference stack and sets SF_REQUIRE_REFERENCE: there a missing
    # or broken stack is a failure, not a skip that leaves CI green.
    if os.environ.get("SF_REQUIRE_REFERENCE") == "1":
        print(f"FAIL (SF_REQUIRE_REFERENCE=1): {reason}", flush=True)
        sys.exit(1)
    print(f"SKIP: {reason}", flush=True)
    sys.exit(SKIP)


try:
    import torch
    import safetensors.torch as st
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache, GenerationConfig
except Exception as e:  # noqa: BLE001 - any import failure means the reference stack is absent
    torch = None
    _IMPORT_ERROR = f"{type(e).__name__}: {e}"
else:
    _IMPORT_ERROR = None



def _no_grad(fn):
    """torch.no_grad() as a decorator, tolerating a missing torch (the script then skips)."""
    return torch.no_grad()(fn) if torch is not None else fn


try:
    import xxhash
except Exception:  # noqa: BLE001
    xxhash = None


# --------------------------------------------------------------------------------------------
# Reference model


class Reference:
    def __init__(self, model_path: str):
        d, f = os.path.split(os.path.abspath(model_path))
        t0 = time.time()
        self.tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
        self.model = AutoModelForCausalLM.from_pretrained(
            d, gguf_file=f, torch_dtype=torch.float32, tie_word_embeddings=True
        ).eval()
        if self.model.lm_head.weight.data_ptr() != self.model.model.embed_tokens.weight.data_ptr():
            raise RuntimeError("lm_head is not tied to embed_tokens")
        # generate() replaces an unset eos_token_id by the model's (2, <|im_end|>), so clear the
        # model default: continuations are plain greedy steps that never stop early.
        self.model.generation_config.eos_token_id = None
        c = self.model.config
        self.n_layers = c.num_hidden_layers
        self.n_kv_heads = c.num_key_value_heads
        self.head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        self.rope_theta = float(c.rope_theta)
        print(f"HF reference loaded in {time.time() - t0:.1f}s: {self.n_layers} layers, "
              f"{self.n_kv_heads} kv heads, head_dim {self.head_dim}, theta {self.rope_theta:g}")

    def encode(self, text: str) -> list:
        # The GGUF says add_bos_token=false; the HF tokenizer built from it adds BOS regardless.
        return self.tok(text, add_special_tokens=False)["input_ids"]

    @_no_grad
    def prefill(self, ids: list):
        """HF forward with a DynamicCache: (cache, last-position logits)."""
        cache = DynamicCache()
        out = self.model(input_ids=torch.tensor([ids]), past_key_values=cache, use_cache=True,
                         num_logits_to_keep=1)
        return out.past_key_values, out.logits[0, -1].float()

    @_no_grad
    def generate(self, ids: list, n: int):
        """HF greedy generate, EOS ignored: (tokens, top-2 gap per step)."""
        x = torch.tensor([ids])
        cfg = GenerationConfig(max_new_tokens=n, do_sample=False, num_beams=1, eos_token_id=None,
                               pad_token_id=self.tok.convert_tokens_to_ids("<|im_end|>"))
        out = self.model.generate(x, attention_mask=torch.ones_like(x), generation_config=cfg,
                                  output_scores=True, return_dict_in_generate=True)
        toks = out.sequences[0, len(ids):].tolist()
        if len(toks) != n:
            raise RuntimeError(f"HF generate returned {len(toks)} tokens, expected {n}")
        gaps = []
        for s in out.scores:
            t2 = torch.topk(s[0].float(), 2).values
            gaps.append(float(t2[0] - t2[1]))
        return toks, gaps

    @_no_grad
    def decode_from_cache(self, cache, first_token: int, n: int) -> list:
        """Feed first_token on top of `cache` and decode n tokens greedily."""
        toks, cur = [], first_token
        for _ in range(n):
            out = self.model(input_ids=torch.tensor([[cur]]), past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            cur = int(torch.argmax(out.logits[0, -1]))
            toks.append(cur)
        return toks


def cache_layers(cache):
    if hasattr(cache, "key_cache"):
        return list(zip(cache.key_cache, cache.value_cache))
    return [(k, v) for k, v in cache]  # legacy tuple format


# --------------------------------------------------------------------------------------------
# Export verification


class Failures(list):
    def add(self, msg: str) -> None:
        print(f"  FAIL: {msg}", flush=True)
        self.append(msg)


def xxh64_file(path: str) -> str:
    h = xxhash.xxh64(seed=0)
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def check_manifest(man: dict, ref: Reference, export_dir: str, fails: Failures) -> list:
    """Validate manifest.json; return the shard list sorted by layer (or [] when unusable)."""
    def expect(cond, msg):
        if not cond:
            fails.add(msg)
        return cond

    expect(man.get("format") == "sparsefill-kv", f"manifest.format = {man.get('format')!r}")
    expect(man.get("format_version") == 6, f"manifest.format_version = {man.get('format_version')!r}")
    expect(man.get("kv_dtype") == "f32", f"manifest.kv_dtype = {man.get('kv_dtype')!r}, expected f32")
    expect(man.get("dtype") == "F32", f"manifest.dtype = {man.get('dtype')!r}, expected F32")
    expect(man.get("block_size") == 64, f"manifest.block_size = {man.get('block_size')!r}")
    ch = man.get("compat_hash")
    expect(isinstance(ch, str) and len(ch) >= 8 and all(c in "0123456789abcdefABCDEF" for c in ch),
           f"manifest.compat_hash = {ch!r} is not a hex string")
    ret = man.get("retention") or {}
    expect(ret.get("policy") == "full",
           f"manifest.retention.policy = {ret.get('policy')!r}; this test needs the full cache")
    ids = man.get("token_ids")
    n = man.get("n_tokens")
    # Format 6 keeps each head's positions as base64 LEB128 varints (gap from the previous run's
    # end, then length); under full retention every head keeps [0, n_tokens) as one run.
    layers = ret.get("layers") or []
    expect(len(layers) == ref.n_layers, f"manifest.retention.layers has {len(layers)} entries")
    for lj in layers:
        for hi, hj in enumerate(lj.get("heads") or []):
            runs = decode_position_runs(hj.get("runs", ""))
            expect(runs == [(0, n)] and hj.get("n") == n,
                   f"retention layer {lj.get('layer')} head {hi}: runs {runs[:3]}, n {hj.get('n')}, "
                   f"expected [(0, {n})]")
    if not expect(isinstance(ids, list) and ids and all(isinstance(t, int) for t in ids),
                  "manifest.token_ids missing or not a list of ints"):
        return []
    expect(n == len(ids), f"manifest.n_tokens = {n!r} but token_ids has {len(ids)} entries")
    expect(isinstance(man.get("first_token"), int), "manifest.first_token missing or not an int")
    vocab = ref.model.config.vocab_size
    expect(all(0 <= t < vocab for t in ids), "manifest.token_ids has ids outside the vocabulary")

    m = man.get("model") or {}
    expect(m.get("n_layers") == ref.n_layers, f"model.n_layers = {m.get('n_layers')!r}, HF {ref.n_layers}")
    expect(m.get("n_kv_heads") == ref.n_kv_heads,
           f"model.n_kv_heads = {m.get('n_kv_heads')!r}, HF {ref.n_kv_heads}")
    expect(m.get("head_dim") == ref.head_dim, f"model.head_dim = {m.get('head_dim')!r}, HF {ref.head_dim}")
    rt = m.get("rope_theta")
    expect(isinstance(rt, (int, float)) and abs(rt - ref.rope_theta) <= 1e-6 * ref.rope_theta,
           f"model.rope_theta = {rt!r}, HF {ref.rope_theta:g}")
    expect(str(m.get("arch", "")).lower() == "llama", f"model.arch = {m.get('arch')!r}")
    expect(bool(m.get("name")), "model.name missing")

    shards = man.get("shards")
    if not expect(isinstance(shards, list) and len(shards) == ref.n_layers,
                  f"manifest.shards has {len(shards) if isinstance(shards, list) else 'no'} entries, "
                  f"expected {ref.n_layers}"):
        return []
    layers = sorted(s.get("layer", -1) for s in shards)
    if not expect(layers == list(range(ref.n_layers)), f"shard layers {layers} are not 0..{ref.n_layers - 1}"):
        return []
    shards = sorted(shards, key=lambda s: s["layer"])
    if xxhash is None:
        print("  NOTE: xxhash not importable: shard xxh64 checksums NOT verified (other checks run)")
    for s in shards:
        f = s.get("file", "")
        expect(f == f"layer_{s['layer']:03d}.safetensors", f"shard {s['layer']} file name {f!r}")
        if os.path.basename(f) != f:
            fails.add(f"shard file {f!r} is not a plain file name")
            return []
        p = os.path.join(export_dir, f)
        if not expect(os.path.isfile(p), f"shard file {f} missing"):
            return []
        size = os.path.getsize(p)
        expect(s.get("bytes") == size, f"{f}: manifest bytes {s.get('bytes')!r}, file has {size}")
        x = s.get("xxh64")
        if not expect(isinstance(x, str) and len(x) == 16, f"{f}: xxh64 {x!r} is not 16 hex digits"):
            continue
        if xxhash is not None:
            got = xxh64_file(p)
            expect(got == x.lower(), f"{f}: xxh64 mismatch: manifest {x}, file {got}")
    if xxhash is not None:
        print(f"  xxh64 checked for {len(shards)} shards")
    return shards


def verify_export(export_dir: str, ref: Reference, tol: float, expect_ids: list | None = None) -> list:
    """Run every check against one export directory; return the list of failures (empty = pass)."""
    fails = Failures()
    mpath = os.path.join(export_dir, "manifest.json")
    try:
        with open(mpath, encoding="utf-8") as f:
            man = json.load(f)
    except (OSError, ValueError) as e:
        fails.add(f"cannot read {mpath}: {e}")
        return fails
    shards = check_manifest(man, ref, export_dir, fails)
    if not shards:
        return fails
    ids = man["token_ids"]
    n = len(ids)
    first = man["first_token"]
    print(f"  manifest: {n} tokens, first_token {first}, compat_hash {man.get('compat_hash')}")
    if expect_ids is not None and expect_ids != ids:
        diff = next((i for i, (a, b) in enumerate(zip(expect_ids, ids)) if a != b),
                    min(len(expect_ids), len(ids)))
        print(f"  WARNING: tokenizer differs from HF: {len(ids)} ids vs HF {len(expect_ids)}, "
              f"first difference at index {diff} (the test continues on the manifest's ids)")

    # Load the export.
    want = (1, ref.n_kv_heads, n, ref.head_dim)
    ours = []
    for s in shards:
        p = os.path.join(export_dir, s["file"])
        try:
            t = st.load_file(p)
        except Exception as e:  # noqa: BLE001
            fails.add(f"{s['file']}: safetensors load failed: {e}")
            return fails
        for name in ("key", "value"):
            if name not in t:
                fails.add(f"{s['file']}: tensor {name!r} missing (has {sorted(t)})")
                return fails
            if t[name].dtype != torch.float32 or tuple(t[name].shape) != want:
                fails.add(f"{s['file']}: {name} is {t[name].dtype} {tuple(t[name].shape)}, "
                          f"expected float32 {want}")
                return fails
        extra = sorted(set(t) - {"key", "value"})
        if extra and s["layer"] == 0:
            print(f"  note: extra tensors in shards: {extra}")
        ours.append((t["key"], t["value"]))

    # Compare with HF's own cache.
    t0 = time.time()
    hf_cache, hf_last = ref.prefill(ids)
    hf = cache_layers(hf_cache)
    worst_k = worst_v = 0.0
    print(f"  HF prefill {time.time() - t0:.1f}s; per layer max|K_ours-K_hf| max|V_ours-V_hf| (tol {tol:g}):")
    row, bad = [], []
    for l, ((k, v), (hk, hv)) in enumerate(zip(ours, hf)):
        dk = float((k - hk).abs().max())
        dv = float((v - hv).abs().max())
        worst_k, worst_v = max(worst_k, dk), max(worst_v, dv)
        row.append(f"{l:2d}: {dk:.2e} {dv:.2e}")
        if not (dk <= tol and dv <= tol):  # (a NaN difference fails too)
            which, d, a, b = ("K", dk, k, hk) if not dk < dv else ("V", dv, v, hv)
            diff = (a - b).abs()
            hit = torch.nonzero(torch.isnan(diff) if d != d else diff == d)
            where = hit[0].tolist() if len(hit) else []
            bad.append(f"layer {l} max|dK| {dk:.3e} max|dV| {dv:.3e} "
                       f"({which} worst at [b,h,t,d]={where})")
    for i in range(0, len(row), 5):
        print("    " + "   ".join(row[i:i + 5]))
    if bad:
        fails.add(f"{len(bad)} of {len(ours)} layers exceed tol {tol:g}: " + "; ".join(bad[:3])
                  + (" ..." if len(bad) > 3 else ""))
    kmax = max(float(hk.abs().max()) for hk, _ in hf)
    print(f"  worst |dK| {worst_k:.3e} (max |K_hf| {kmax:.1f}), worst |dV| {worst_v:.3e}")

    # Generation: HF's own, and HF on top of our cache.
    hf_argmax = int(torch.argmax(hf_last))
    t0 = time.time()
    ref_toks, gaps = ref.generate(ids, N_CONT + 1)
    cache = DynamicCache()
    for l, (k, v) in enumerate(ours):
        cache.update(k.contiguous(), v.contiguous(), l)
    if cache.get_seq_length() != n:
        fails.add(f"DynamicCache built from the export holds {cache.get_seq_length()} tokens, expected {n}")
        return fails
    our_toks = ref.decode_from_cache(cache, first, N_CONT)
    print(f"  generation {time.time() - t0:.1f}s; HF argmax after prompt {hf_argmax}, "
          f"HF generate first {ref_toks[0]}, manifest first_token {first} (HF top-2 gap {gaps[0]:.3f})")
    if ref_toks[0] != first:
        fails.add(f"first token: manifest {first} ({ref.tok.decode([first])!r}) != HF "
                  f"{ref_toks[0]} ({ref.tok.decode([ref_toks[0]])!r}); HF top-2 gap {gaps[0]:.3e}")
    if our_toks != ref_toks[1:]:
        i = next(j for j, (a, b) in enumerate(zip(our_toks, ref_toks[1:])) if a != b)
        fails.add(f"continuation differs at step {i}: from export {our_toks}, HF {ref_toks[1:]} "
                  f"(HF top-2 gap there {gaps[i + 1]:.3e})")
    else:
        print(f"  continuation matches ({N_CONT} tokens, min HF top-2 gap {min(gaps[1:]):.3f}): "
              f"{ref.tok.decode(our_toks)!r}")
    return fails


# --------------------------------------------------------------------------------------------
# Prompts, CLI and fake exports


def doc_slice(ref: Reference) -> str:
    with open(os.path.join(REPO, "data", "long_document.txt"), encoding="utf-8") as f:
        doc = f.read()
    start = doc.find(DOC_SLICE_START)
    if start < 0:
        start = 0
    text = doc[start:]
    enc = ref.tok(text, add_special_tokens=False, return_offsets_mapping=True)
    offs = enc["offset_mapping"]
    if len(offs) <= DOC_SLICE_TOKENS:
        return text
    end = offs[DOC_SLICE_TOKENS][1]
    before, after = text.rfind("\n", 0, end), text.find("\n", end)
    # end at the line break nearest to token DOC_SLICE_TOKENS
    cut = min((c for c in (before, after) if c > 0), key=lambda c: abs(c - end), default=end)
    return text[:cut] + "\n"


def cases(ref: Reference) -> dict:
    return {"doc": doc_slice(ref), "chat": CHAT_TEXT}


def run_cli(binary: str, model: str, prompt_file: str, export_dir: str, timeout: int) -> tuple:
    cmd = [binary, "prefill", "--model", model, "--prompt-file", prompt_file,
           "--export-kv", export_dir, "--force"]
    print("  $ " + " ".join(cmd), flush=True)
    t0 = time.time()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return False, f"timed out after {timeout}s"
    tail = "\n".join((p.stdout + p.stderr).strip().splitlines()[-15:])
    print(f"  exit {p.returncode} after {time.time() - t0:.1f}s")
    if p.returncode != 0:
        return False, f"sparsefill exited {p.returncode}:\n{tail}"
    return True, tail


def write_fake_export(ref: Reference, ids: list, export_dir: str, layout: str = "rotate_half") -> None:
    """Write an export in the sparsefill-kv format from HF's own cache (for --self-check)."""
    if os.path.exists(export_dir):
        shutil.rmtree(export_dir)
    os.makedirs(export_dir)
    cache, last = ref.prefill(ids)
    shards = []
    for l, (k, v) in enumerate(cache_layers(cache)):
        k = k.detach().clone()
        if layout == "interleaved":  # GPT-J / GGML "normal" RoPE order: (x0,x1) pairs adjacent
            h = ref.head_dim // 2
            k = torch.stack([k[..., :h], k[..., h:]], dim=-1).reshape(k.shape)
        fname = f"layer_{l:03d}.safetensors"
        path = os.path.join(export_dir, fname)
        st.save_file({"key": k.contiguous(), "value": v.detach().contiguous()}, path)
        shards.append({"file": fname, "layer": l, "bytes": os.path.getsize(path),
                       "xxh64": xxh64_file(path) if xxhash else "0" * 16})
    model = {"name": "SmolLM2-135M-Instruct", "arch": "llama", "n_layers": ref.n_layers,
             "n_kv_heads": ref.n_kv_heads, "head_dim": ref.head_dim, "rope_theta": ref.rope_theta}
    compat = hashlib.sha256(json.dumps([model, "F32", 64], sort_keys=True).encode()).hexdigest()[:16]
    # Format 6: the retention names each head's kept positions (full: [0, n) as one run).
    n = len(ids)
    heads = [{"n": n, "runs": encode_position_runs([(0, n)])} for _ in range(ref.n_kv_heads)]
    retention = {"policy": "full",
                 "layers": [{"layer": l, "heads": heads} for l in range(ref.n_layers)]}
    man = {"format": "sparsefill-kv", "format_version": 6, "model": model, "compat_hash": compat,
           "dtype": "F32", "kv_dtype": "f32", "block_size": 64, "n_tokens": n, "token_ids": ids,
           "first_token": int(torch.argmax(last)), "retention": retention, "shards": shards}
    with open(os.path.join(export_dir, "manifest.json"), "w", encoding="utf-8") as f:
        json.dump(man, f)


def perturb(export_dir: str, layer: int, update_checksum: bool, delta: float = 0.1) -> str:
    """Add delta to one key element of one shard; optionally fix up bytes/xxh64 in the manifest."""
    fname = f"layer_{layer:03d}.safetensors"
    path = os.path.join(export_dir, fname)
    t = st.load_file(path)
    n = t["key"].shape[2]
    t["key"][0, 1, n // 2, 3] += delta
    st.save_file(t, path)
    if update_checksum:
        mpath = os.path.join(export_dir, "manifest.json")
        with open(mpath, encoding="utf-8") as f:
            man = json.load(f)
        for s in man["shards"]:
            if s["layer"] == layer:
                s["bytes"] = os.path.getsize(path)
                s["xxh64"] = xxh64_file(path) if xxhash else "0" * 16
        with open(mpath, "w", encoding="utf-8") as f:
            json.dump(man, f)
    return f"{fname} key[0,1,{n // 2},3] += {delta}"


def self_check(ref: Reference, workdir: str, tol: float) -> int:
    ok = True
    prompts = cases(ref)
    for name, text in prompts.items():
        ids = ref.encode(text)
        d = os.path.join(workdir, f"fake_{name}")
        write_fake_export(ref, ids, d)
        print(f"\n[self-check {name}] clean export from HF's cache, {len(ids)} tokens: expect PASS")
        f = verify_export(d, ref, tol, expect_ids=ids)
        print(f"  -> {'PASS' if not f else 'FAIL'} ({'as designed' if not f else 'UNEXPECTED'})")
        ok &= not f

    ids = ref.encode(prompts["doc"])
    negatives = [("one key +0.1, checksums updated", "rotate_half", lambda d: perturb(d, 15, True)),
                 ("one key NaN, checksums updated", "rotate_half",
                  lambda d: perturb(d, 11, True, float("nan"))),
                 ("keys in interleaved RoPE layout", "interleaved", lambda d: "interleaved layout")]
    if xxhash is not None:
        negatives.append(("one key +0.1, checksum NOT updated", "rotate_half",
                          lambda d: perturb(d, 7, False)))
    else:
        print("\nNOTE: xxhash not importable: skipping the stale-checksum negative case")
    for label, layout, mutate in negatives:
        d = os.path.join(workdir, "fake_bad")
        write_fake_export(ref, ids, d, layout)
        what = mutate(d)
        print(f"\n[self-check negative] {label} ({what}): expect FAIL")
        f = verify_export(d, ref, tol)
        print(f"  -> {'FAIL' if f else 'PASS'} ({'as designed' if f else 'UNEXPECTED: not detected'})")
        ok &= bool(f)
    print(f"\nself-check: {'OK' if ok else 'BROKEN'}")
    return 0 if ok else 1


# --------------------------------------------------------------------------------------------


def main() -> int:
    ap = argparse.ArgumentParser(description="sparsefill KV-export interop test against HF")
    ap.add_argument("--bin", help="path to the sparsefill CLI")
    ap.add_argument("--model", default=os.environ.get("SF_MODEL", DEFAULT_MODEL))
    ap.add_argument("--workdir", required=True, help="scratch directory (created if missing)")
    ap.add_argument("--self-check", action="store_true",
                    help="verify the checker itself on fabricated exports (no binary needed)")
    ap.add_argument("--tol", type=float, default=TOL, help=f"max |dK|,|dV| (default {TOL:g})")
    ap.add_argument("--case", action="append", choices=["doc", "chat"], help="run only these cases")
    ap.add_argument("--timeout", type=int, default=600, help="seconds per CLI run")
    args = ap.parse_args()

    if _IMPORT_ERROR is not None:
        skip(f"reference stack not importable (torch/transformers/safetensors): {_IMPORT_ERROR}")
    if not args.self_check:
        if not args.bin:
            skip("no --bin given")
        if not (os.path.isfile(args.bin) and os.access(args.bin, os.X_OK)):
            skip(f"sparsefill binary not found or not executable: {args.bin}")
    if not os.path.isfile(args.model):
        skip(f"model not found: {args.model}")

    torch.set_num_threads(2)
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, "
          f"xxhash {'%s' % xxhash.VERSION if xxhash else 'not available'}")
    os.makedirs(args.workdir, exist_ok=True)
    ref = Reference(args.model)

    if args.self_check:
        return self_check(ref, args.workdir, args.tol)

    results = {}
    for name, text in cases(ref).items():
        if args.case and name not in args.case:
            continue
        print(f"\n[{name}]")
        pf = os.path.join(args.workdir, f"prompt_{name}.txt")
        with open(pf, "w", encoding="utf-8") as f:
            f.write(text)
        ed = os.path.join(args.workdir, f"kv_{name}")
        ok, msg = run_cli(args.bin, args.model, pf, ed, args.timeout)
        if not ok:
            print(f"  FAIL: {msg}")
            results[name] = [msg]
            continue
        results[name] = verify_export(ed, ref, args.tol, expect_ids=ref.encode(text))
    print()
    for name, f in results.items():
        print(f"{name}: {'PASS' if not f else 'FAIL (%d problems)' % len(f)}")
    n_fail = sum(1 for f in results.values() if f)
    print(f"{len(results) - n_fail} passed, {n_fail} failed")
    return 1 if n_fail else 0


if __name__ == "__main__":
    sys.exit(main())
