#!/usr/bin/env python3
"""Golden token ids for the C++ tokenizer (tests/worker/model/test_tokenizer.cpp).

Run from the repository root with the pinned reference stack (tools/golden/requirements.txt):

    .venv-ref/bin/python tools/golden/gen_tokenizer_golden.py [--model models/X.gguf]

Reads tests/golden/tokenizer_corpus.json (hand-written texts), adds --random seeded random
mixes of character classes, and writes tests/golden/tokenizer_ids.json:

  generator      versions of the stack, the model file name and its sha256
  cases[]        source       "corpus" or "random"
                 text
                 ids          tok(text)["input_ids"] of AutoTokenizer loaded from the GGUF
                              (HF's GGUF conversion; sparsefill's default TokenizerCompat)
                 ids_no_special   the same with add_special_tokens=False
                 ids_gguf     the tokenizer as the GGUF metadata describes it: pre-tokenizer
                              from tokenizer.ggml.pre (smollm = Digits(individual) + ByteLevel)
                              and tokenizer.ggml.add_bos_token (TokenizerCompat::kGguf)
                 pieces       per pre-tokenizer name, the [begin, end) UTF-8 byte offsets of
                              the pre-tokens produced by HF `tokenizers` (Oniguruma regexes)
"""
import argparse
import copy
import hashlib
import importlib.metadata
import json
import os
import platform
import random
import sys

import gguf
from tokenizers import Regex, pre_tokenizers, processors
from transformers import AutoTokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

LLAMA3_RE = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
             r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_RE = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"
            r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def byte_level():
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def split_then_bytes(regex):
    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])


# Names as in tokenizer.ggml.pre / sparsefill's pre_tokenizer_from_name.
PRE_TOKENIZERS = {
    "gpt2": byte_level(),
    "smollm": pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                       byte_level()]),
    "llama-bpe": split_then_bytes(LLAMA3_RE),
    "qwen2": split_then_bytes(QWEN2_RE),
}


def byte_level_char_map():
    # GPT-2 byte <-> unicode table, written out here to turn pre-token strings back into bytes.
    printable = (list(range(0x21, 0x7F)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100)))
    out, extra = {}, 0
    for b in range(256):
        if b in printable:
            out[chr(b)] = b
        else:
            out[chr(256 + extra)] = b
            extra += 1
    return out


BYTE_OF_CHAR = byte_level_char_map()


def piece_offsets(pre, text):
    """[begin, end) byte offsets of pre-tokens; checks they tile the UTF-8 text exactly."""
    raw = text.encode("utf-8")
    offs, pos = [], 0
    for piece, _ in pre.pre_tokenize_str(text):
        b = bytes(BYTE_OF_CHAR[c] for c in piece)
        assert raw[pos:pos + len(b)] == b, (text, piece)
        offs.append([pos, pos + len(b)])
        pos += len(b)
    assert pos == len(raw), text
    return offs


def random_texts(n, seed=20261122):
    """Seeded random mixes of character classes that stress the regex alternatives (contraction
    case folding, space runs before words/digits/newlines, specials, digits in many scripts)."""
    rng = random.Random(seed)
    pools = ["abcxyzABCXYZ", "0123456789", " ", "  \t\n\r", "'", "sStTrReEvVmMlLdD",
             ".,;:!?-_()[]{}<>/\\\"#$%&*+=@^`|~", "éèñüßÅøłžç", "абвгдЖЩЯ", "αβγΩ",
             "中文字漢ひらカタ한국", "١٢٣٤५६²³½Ⅻ", "\u00a0\u3000\u2009\u2028\u0085\u001c\u000b\u000c",
             "😀👍🏽\u200d🇯🇵❤️\ufe0f", "\u0301\u0300\u200b\u00ad\ufeff", "ſK", "\x01\x7f"]
    specials = ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|im_sta", "<file_sep>"]
    out = []
    for _ in range(n):
        parts = []
        for _ in range(rng.randint(1, 30)):
            if rng.random() < 0.03:
                parts.append(rng.choice(specials))
            else:
                pool = rng.choice(pools)
                parts.append("".join(rng.choice(pool) for _ in range(rng.randint(1, 6))))
        out.append("".join(parts))
    return out


def gguf_field(reader, key):
    f = reader.fields.get(key)
    if f is None:
        return None
    v = f.parts[f.data[0]]
    return bytes(v).decode() if f.types[0] == gguf.GGUFValueType.STRING else v.tolist()[0]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=os.path.join(ROOT, "models",
                                                    "SmolLM2-135M-Instruct.Q4_1.gguf"))
    ap.add_argument("--corpus", default=os.path.join(ROOT, "tests/golden/tokenizer_corpus.json"))
    ap.add_argument("--random", type=int, default=64, help="seeded random texts to add")
    ap.add_argument("--out", default=os.path.join(ROOT, "tests/golden/tokenizer_ids.json"))
    args = ap.parse_args()

    corpus = json.load(open(args.corpus, encoding="utf-8"))["texts"]
    texts = corpus + random_texts(args.random)
    model_dir, model_file = os.path.split(os.path.abspath(args.model))
    tok = AutoTokenizer.from_pretrained(model_dir, gguf_file=model_file)

    # The GGUF-as-written variant: same vocabulary and merges, pre-tokenizer from
    # tokenizer.ggml.pre and BOS only if tokenizer.ggml.add_bos_token says so.
    reader = gguf.GGUFReader(args.model)
    pre_name = gguf_field(reader, "tokenizer.ggml.pre")
    add_bos = bool(gguf_field(reader, "tokenizer.ggml.add_bos_token"))
    backend = copy.deepcopy(tok.backend_tokenizer)
    backend.pre_tokenizer = PRE_TOKENIZERS[pre_name]
    if not add_bos:
        backend.post_processor = processors.ByteLevel(trim_offsets=False)

    cases = []
    for i, text in enumerate(texts):
        ids = tok(text)["input_ids"]
        ids_no_special = tok(text, add_special_tokens=False)["input_ids"]
        ids_gguf = backend.encode(text, add_special_tokens=True).ids
        cases.append({
            "source": "corpus" if i < len(corpus) else "random",
            "text": text,
            "ids": ids,
            "ids_no_special": ids_no_special,
            "ids_gguf": ids_gguf,
            "pieces": {name: piece_offsets(pre, text) for name, pre in PRE_TOKENIZERS.items()},
        })

    sha = hashlib.sha256()
    with open(args.model, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            sha.update(chunk)
    out = {
        "generator": {
            "script": "tools/golden/gen_tokenizer_golden.py",
            "python": platform.python_version(),
            "transformers": importlib.metadata.version("transformers"),
            "tokenizers": importlib.metadata.version("tokenizers"),
            "gguf": importlib.metadata.version("gguf"),
            "model": model_file,
            "model_sha256": sha.hexdigest(),
            "gguf_pre": pre_name,
            "gguf_add_bos": add_bos,
            "hf_pre_tokenizer": json.loads(tok.backend_tokenizer.to_str())["pre_tokenizer"],
        },
        "cases": cases,
    }
    # One case per line keeps the file small and its diffs readable.
    with open(args.out, "w", encoding="utf-8") as f:
        f.write('{\n "generator": ' + json.dumps(out["generator"], ensure_ascii=False) + ',\n')
        f.write(' "cases": [\n')
        f.write(",\n".join("  " + json.dumps(c, ensure_ascii=False, separators=(",", ":"))
                           for c in cases))
        f.write("\n ]\n}\n")
    print(f"wrote {len(cases)} cases to {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
