#!/usr/bin/env bash
# export_via_pool.sh SPARSEFILL TMPDIR: `prefill --kv-pool ... --export-kv` exports from the pool
# (host and disk blocks read back), not from a second copy the forward keeps. The export must be
# byte for byte the one a run without the pool writes, and the forward must have held at most
# one layer's K/V (the pool holds the only full copy).
set -u
sf="$1"; tmp="$2"
rm -rf "$tmp"; mkdir -p "$tmp"
fail() { echo "FAIL: $*"; cat "$tmp"/*.log; exit 1; }
printf 'The lighthouse keeper climbed the stairs and looked out over the harbour, where the boats of the evening fleet were coming in one by one, their lanterns swinging. ' >"$tmp/p.txt"
for i in 1 2 3 4 5 6; do cat "$tmp/p.txt" "$tmp/p.txt" >"$tmp/q.txt"; mv "$tmp/q.txt" "$tmp/p.txt"; done
"$sf" prefill --model default --prompt-file "$tmp/p.txt" --export-kv "$tmp/plain" \
  --retention snapkv:budget=512 >"$tmp/plain.log" 2>&1 || fail "plain run"
"$sf" prefill --model default --prompt-file "$tmp/p.txt" --export-kv "$tmp/pooled" \
  --retention snapkv:budget=512 --kv-pool host=2M,disk="$tmp/blocks" >"$tmp/pooled.log" 2>&1 \
  || fail "pooled run"
n=0
for f in "$tmp"/plain/*.safetensors "$tmp"/plain/manifest.json; do
  cmp -s "$f" "$tmp/pooled/$(basename "$f")" || fail "$(basename "$f") differs"
  n=$((n + 1))
done
[ "$n" -ge 31 ] || fail "only $n files compared"
tokens=$(sed -n 's/^prompt tokens: //p' "$tmp/plain.log")
held=$(sed -n 's/.*the forward held at most \([0-9]*\) bytes of KV.*/\1/p' "$tmp/pooled.log")
disk=$(sed -n 's/.* disk \([0-9]*\) blocks .*/\1/p' "$tmp/pooled.log")
# SmolLM2-135M: 3 KV heads x 64 dims, K and V in F32: 1,536 bytes a token and layer.
layer=$((tokens * 1536))
[ -n "$held" ] && [ "$held" -le "$layer" ] || fail "the forward held $held bytes, one layer is $layer"
[ -n "$disk" ] && [ "$disk" -gt 0 ] || fail "no block went to disk ($disk): the disk tier was not read"
echo "ok: $n files identical; $tokens tokens, the forward held $held bytes (one layer $layer), $disk blocks on disk"
