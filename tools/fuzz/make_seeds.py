#!/usr/bin/env python3
"""Writes small valid seed inputs for the libFuzzer targets (tests/fuzz).

  make_seeds.py OUT_DIR  ->  OUT_DIR/gguf/*.gguf, OUT_DIR/safetensors/*.safetensors,
                            OUT_DIR/hf_config/*.json

GGUF seeds come from the reference `gguf` package (llama.cpp's writer) and safetensors seeds from
the `safetensors` package, so the fuzzers start from files an independent implementation wrote.
Seeds are kept under a few KB: libFuzzer mutates small inputs far faster. Deterministic output.
Needs numpy, gguf and safetensors (all in .venv-ref: deploy/setup-reference.sh).
"""
import json
import os
import struct
import sys

import numpy as np
import gguf
from gguf.quants import quantize
from safetensors.numpy import save_file

GQT = gguf.GGMLQuantizationType


def write_gguf(path, tensors, alignment=None, extra_kv=True):
    w = gguf.GGUFWriter(path, arch="llama")
    w.add_name("fuzz-seed")
    if alignment is not None:
        w.add_custom_alignment(alignment)
    if extra_kv:
        w.add_uint32("llama.context_length", 2048)
        w.add_uint32("llama.block_count", 1)
        w.add_float32("llama.rope.freq_base", 10000.0)
        w.add_float64("test.f64", -0.25)
        w.add_int8("test.i8", -3)
        w.add_uint16("test.u16", 65535)
        w.add_int64("test.i64", -(1 << 40))
        w.add_uint64("test.u64", 1 << 63)
        w.add_bool("test.bool", True)
        w.add_array("tokenizer.ggml.tokens", ["<s>", "</s>", "a", "\u00e9"])
        w.add_array("tokenizer.ggml.token_type", [1, 3, 1, 1])
        w.add_array("tokenizer.ggml.scores", [0.0, -1.5, 2.25, 0.5])
    for name, arr, qtype in tensors:
        if qtype in (GQT.F32, GQT.F16):
            data = arr.astype(np.float32 if qtype == GQT.F32 else np.float16)
            w.add_tensor(name, data)
        else:
            q = quantize(arr.astype(np.float32), qtype)
            w.add_tensor(name, q, raw_dtype=qtype)  # shape derived from the byte shape
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def main():
    if len(sys.argv) != 2:
        sys.exit("usage: make_seeds.py OUT_DIR")
    out = sys.argv[1]
    gdir = os.path.join(out, "gguf")
    sdir = os.path.join(out, "safetensors")
    os.makedirs(gdir, exist_ok=True)
    os.makedirs(sdir, exist_ok=True)
    rng = np.random.default_rng(1234)

    def rnd(*shape):
        return rng.standard_normal(shape).astype(np.float32)

    # numpy shapes are row-major: the last dim is ggml's dims[0] (the block-quantized row).
    write_gguf(os.path.join(gdir, "mixed.gguf"), [
        ("token_embd.weight", rnd(2, 4), GQT.F32),
        ("blk.0.attn_norm.weight", rnd(8), GQT.F16),
        ("blk.0.attn_q.weight", rnd(2, 32), GQT.Q8_0),
        ("blk.0.attn_k.weight", rnd(2, 32), GQT.Q4_0),
        ("blk.0.attn_v.weight", rnd(1, 64), GQT.Q4_1),
        ("blk.0.ffn_up.weight", rnd(2, 2, 32), GQT.BF16),
    ])
    write_gguf(os.path.join(gdir, "aligned64.gguf"), [
        ("a", rnd(32), GQT.Q8_0),
        ("b", rnd(3), GQT.F32),
    ], alignment=64, extra_kv=False)
    write_gguf(os.path.join(gdir, "metadata_only.gguf"), [])

    save_file({
        "model.embed_tokens.weight": rnd(4, 3),
        "model.norm.weight": rnd(3).astype(np.float16),
        "ids": np.arange(5, dtype=np.int64),
        "mask": np.array([True, False, True]),
        "bytes": np.arange(7, dtype=np.uint8),
        "i32": np.arange(-2, 2, dtype=np.int32),
        "f64": np.linspace(0, 1, 3),
        "empty": np.zeros((0, 4), dtype=np.float32),
        "scalar": np.array(1.5, dtype=np.float32),
    }, os.path.join(sdir, "mixed.safetensors"), metadata={"format": "pt", "note": "seed"})
    save_file({"k": rnd(2, 2, 4).astype(np.float16)}, os.path.join(sdir, "single.safetensors"))
    # BF16 (numpy has no bfloat16) and a padded header, written by hand per the format.
    header = b'{"v":{"dtype":"BF16","shape":[2,2],"data_offsets":[0,8]}}'
    header += b" " * ((8 - len(header) % 8) % 8)
    with open(os.path.join(sdir, "bf16.safetensors"), "wb") as f:
        f.write(struct.pack("<Q", len(header)) + header + bytes(range(8)))
    with open(os.path.join(sdir, "empty.safetensors"), "wb") as f:
        f.write(struct.pack("<Q", 2) + b"{}")

    # Trimmed Hugging Face config.json files of the supported families.
    cdir = os.path.join(out, "hf_config")
    os.makedirs(cdir, exist_ok=True)
    base = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100,
            "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "hidden_act": "silu",
            "tie_word_embeddings": False}
    configs = {
        "llama3": dict(base, architectures=["LlamaForCausalLM"], rope_theta=500000.0,
                       rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                     "high_freq_factor": 4.0,
                                     "original_max_position_embeddings": 8192}),
        "qwen2": dict(base, architectures=["Qwen2ForCausalLM"], use_sliding_window=False,
                      sliding_window=32768, tie_word_embeddings=True),
        "mistral": dict(base, model_type="mistral", sliding_window=None, head_dim=32),
    }
    for name, cfg in configs.items():
        with open(os.path.join(cdir, name + ".json"), "w") as f:
            json.dump(cfg, f)


if __name__ == "__main__":
    main()
