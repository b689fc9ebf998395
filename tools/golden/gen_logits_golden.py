#!/usr/bin/env python3
"""Generate end-to-end logits golden files for the default model from Hugging Face transformers.

Run from the repository root, with the pinned reference stack (tools/golden/requirements.txt):

    .venv-ref/bin/python tools/golden/gen_logits_golden.py

Options: --model PATH (default models/SmolLM2-135M-Instruct.Q4_1.gguf), --out-dir DIR (default
tests/golden), --only NAME (chat, code or long; repeatable).

For each of three prompts ("chat", "code", "long") it writes tests/golden/logits_<name>.safetensors:

    token_ids     I32 [n]         the prompt's token ids (HF tokenizer built from the GGUF)
    argmax        I32 [n]         HF argmax of the logits at every position
    top2_gap      F32 [n]         best minus second-best logit at every position (flags near-ties)
    positions     I32 [k]         k = 8 positions: first, six spread evenly, last
    logits        F32 [k, vocab]  full logits at those positions
    continuation  I32 [32]        HF greedy continuation (model.generate, do_sample=False)

and records the package versions, the model's sha256 and the choices below in __metadata__.

Reference choices, made on purpose (each is also written to the metadata):

* fp32 everywhere: the GGUF weights are dequantized by transformers/gguf to fp32, the forward runs
  in fp32 on CPU, without a KV cache, over all positions at once.
* Tied embeddings. The GGUF has no `output.weight` (the LM head is tied to `token_embd.weight`), but
  transformers 4.46.3's GGUF config conversion leaves tie_word_embeddings=False and would
  initialise a *random* lm_head. We pass tie_word_embeddings=True, which is what the model is.
* BOS. The GGUF says tokenizer.ggml.add_bos_token = false, but the tokenizer transformers builds
  from it prepends BOS (id 1, `<|im_start|>`) anyway, which would give the chat prompt a doubled
  `<|im_start|><|im_start|>system`. We follow the GGUF: `tok(text, add_special_tokens=<GGUF
  add_bos_token>)["input_ids"]`, i.e. no BOS for this model. Consumers should compare against
  `token_ids` from the file, not re-tokenize with their own BOS rule.
* The continuation ignores EOS: it is 32 plain greedy steps (eos_token_id unset), so a consumer can
  reproduce it with a bare argmax loop. generate() uses a KV cache, so its first token can differ
  from argmax[-1] only at a near-tie; the script prints whether they agree.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import sys
import time

import numpy as np
import torch

REPO = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
DEFAULT_MODEL = os.path.join(REPO, "models", "SmolLM2-135M-Instruct.Q4_1.gguf")
DEFAULT_OUT = os.path.join(REPO, "tests", "golden")
DOCUMENT = os.path.join(REPO, "data", "long_document.txt")

N_POSITIONS = 8
N_CONTINUATION = 32
LONG_TOKENS = 2300
NEAR_TIE = 1e-3

CHAT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
CHAT_QUESTION = (
    "Why does a canal with locks on both sides of a hill need a reservoir near its highest point?"
)

CODE_SNIPPET = '''def moving_average(values, window):
    """Return the mean of each run of `window` consecutive values."""
    if window <= 0:
        raise ValueError("window must be positive")
    result = []
    total = 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        if i >= window - 1:
            result.append(total / window)
    return result


def summarize(readings):
    smooth = moving_average(readings, 3)
    peak = max(smooth)
    return {"count": len(readings), "peak": round(peak, 2), "last": smooth[-1]}
'''
CODE_INSTRUCTION = (
    "Explain in two sentences what summarize() returns, and say what happens when it is given "
    "a list with fewer than three readings."
)


def sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def gguf_add_bos(model_path: str) -> bool:
    """Read tokenizer.ggml.add_bos_token from the GGUF (default false, as llama.cpp's gpt2 vocab)."""
    import gguf

    reader = gguf.GGUFReader(model_path)
    field = reader.fields.get("tokenizer.ggml.add_bos_token")
    if field is None or not field.data:
        return False
    return bool(field.parts[field.data[0]][0])


def versions() -> dict:
    import gguf  # noqa: F401
    import safetensors
    import tokenizers
    import transformers
    from importlib.metadata import version

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "tokenizers": tokenizers.__version__,
        "gguf": version("gguf"),
        "safetensors": safetensors.__version__,
        "numpy": np.__version__,
    }


def load(model_path: str):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    d, f = os.path.split(os.path.abspath(model_path))
    tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
    model = AutoModelForCausalLM.from_pretrained(
        d, gguf_file=f, torch_dtype=torch.float32, tie_word_embeddings=True
    )
    model.eval()
    # generate() replaces an unset eos_token_id by the model's default (2, <|im_end|>), so clear
    # that default: the continuation is 32 plain greedy steps that never stop early.
    model.generation_config.eos_token_id = None
    if model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr():
        sys.exit("error: lm_head is not tied to embed_tokens; the reference would be wrong")
    return tok, model


def build_prompts(tok, add_bos: bool) -> dict:
    """Return {name: (token_ids list, description)}."""
    prompts = {}

    messages = [
        {"role": "system", "content": CHAT_SYSTEM},
        {"role": "user", "content": CHAT_QUESTION},
    ]
    if getattr(tok, "chat_template", None):
        chat_text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        how = "apply_chat_template(add_generation_prompt=True)"
    else:
        chat_text = (
            f"<|im_start|>system\n{CHAT_SYSTEM}<|im_end|>\n"
            f"<|im_start|>user\n{CHAT_QUESTION}<|im_end|>\n<|im_start|>assistant\n"
        )
        how = "hand-written ChatML"
    prompts["chat"] = (tok(chat_text, add_special_tokens=add_bos)["input_ids"], chat_text, how)

    code_text = CODE_SNIPPET + "\n" + CODE_INSTRUCTION + "\n"
    prompts["code"] = (tok(code_text, add_special_tokens=add_bos)["input_ids"], code_text, "plain text")

    with open(DOCUMENT, encoding="utf-8") as fh:
        doc = fh.read()
    ids = tok(doc, add_special_tokens=add_bos)["input_ids"]
    if len(ids) < LONG_TOKENS:
        sys.exit(f"error: {DOCUMENT} has only {len(ids)} tokens, need {LONG_TOKENS}")
    prompts["long"] = (ids[:LONG_TOKENS], None, f"data/long_document.txt, first {LONG_TOKENS} token ids")
    return prompts


def spread_positions(n: int, k: int) -> list:
    pos = sorted({int(round(x)) for x in np.linspace(0, n - 1, k)})
    return pos


@torch.no_grad()
def reference(model, ids: list, pad_id: int):
    from transformers import GenerationConfig

    x = torch.tensor([ids], dtype=torch.long)
    logits = model(input_ids=x, use_cache=False).logits[0].float()  # [n, vocab]
    top2 = torch.topk(logits, 2, dim=-1)
    argmax = top2.indices[:, 0].to(torch.int32)
    gap = (top2.values[:, 0] - top2.values[:, 1]).to(torch.float32)
    positions = spread_positions(len(ids), N_POSITIONS)
    sel = logits[positions].contiguous().clone()
    del logits

    gen_cfg = GenerationConfig(
        max_new_tokens=N_CONTINUATION,
        min_new_tokens=0,
        do_sample=False,
        num_beams=1,
        eos_token_id=None,  # 32 plain greedy steps: never stop early
        pad_token_id=pad_id,
    )
    out = model.generate(x, attention_mask=torch.ones_like(x), generation_config=gen_cfg)
    cont = out[0, len(ids):].to(torch.int32)
    if cont.numel() != N_CONTINUATION:
        sys.exit(f"error: generate returned {cont.numel()} tokens, expected {N_CONTINUATION}")
    return {
        "token_ids": torch.tensor(ids, dtype=torch.int32),
        "argmax": argmax.contiguous(),
        "top2_gap": gap.contiguous(),
        "positions": torch.tensor(positions, dtype=torch.int32),
        "logits": sel,
        "continuation": cont.contiguous(),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--out-dir", default=DEFAULT_OUT)
    ap.add_argument("--only", action="append", choices=["chat", "code", "long"])
    args = ap.parse_args()

    torch.set_num_threads(2)
    torch.manual_seed(0)
    from safetensors.torch import save_file

    t0 = time.time()
    model_sha = sha256_file(args.model)
    add_bos = gguf_add_bos(args.model)
    tok, model = load(args.model)
    ver = versions()
    pad_id = tok.convert_tokens_to_ids("<|im_end|>")
    prompts = build_prompts(tok, add_bos)
    os.makedirs(args.out_dir, exist_ok=True)
    print(f"model {os.path.basename(args.model)} sha256 {model_sha}")
    print("versions " + json.dumps(ver))
    print(f"add_bos (from GGUF) = {add_bos}; load {time.time() - t0:.1f}s")

    for name, (ids, text, how) in prompts.items():
        if args.only and name not in args.only:
            continue
        t1 = time.time()
        r = reference(model, ids, pad_id)
        meta = {
            "generator": "tools/golden/gen_logits_golden.py",
            "prompt_name": name,
            "prompt_source": how,
            "model_file": os.path.basename(args.model),
            "model_sha256": model_sha,
            "versions": json.dumps(ver, sort_keys=True),
            "dtype": "F32",
            "n_tokens": str(len(ids)),
            "vocab_size": str(r["logits"].shape[1]),
            "add_bos": str(add_bos).lower(),
            "tie_word_embeddings": "true (forced; GGUF has no output.weight)",
            "forward": "single full forward, use_cache=False, torch fp32 CPU",
            "continuation": f"model.generate greedy, {N_CONTINUATION} new tokens, eos ignored",
            "near_tie_threshold": str(NEAR_TIE),
        }
        if text is not None:
            meta["prompt_text"] = text
        else:
            with open(DOCUMENT, "rb") as fh:
                meta["document_sha256"] = hashlib.sha256(fh.read()).hexdigest()
        path = os.path.join(args.out_dir, f"logits_{name}.safetensors")
        save_file(r, path, metadata=meta)

        gap = r["top2_gap"]
        near = int((gap < NEAR_TIE).sum())
        agree = int(r["continuation"][0]) == int(r["argmax"][-1])
        print(f"\n[{name}] {len(ids)} tokens ({how}); {time.time() - t1:.1f}s")
        print(f"  positions {r['positions'].tolist()}")
        print(f"  top2_gap: min {gap.min().item():.3e}  median {gap.median().item():.3f}  "
              f"near-ties (<{NEAR_TIE:g}) {near}  (<1e-2) {int((gap < 1e-2).sum())}")
        if near:
            idx = torch.nonzero(gap < NEAR_TIE).flatten().tolist()
            print(f"  near-tie positions {idx[:20]}{' ...' if len(idx) > 20 else ''}")
        print(f"  continuation[0] == argmax[-1]: {agree}")
        print(f"  continuation: {tok.decode(r['continuation'].tolist())!r}")
        print(f"  wrote {path} ({os.path.getsize(path)} bytes)")
    print(f"\ntotal {time.time() - t0:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
