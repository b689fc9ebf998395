#!/usr/bin/env bash
# pool_metrics.sh SPARSEFILL PROMPT TMPDIR: `prefill --kv-pool ... --metrics-file F` writes the
# pool's per-tier counters as Prometheus text, and they say what the printed pool line says.
set -u
sf="$1"; prompt="$2"; tmp="$3"
rm -rf "$tmp"; mkdir -p "$tmp"
fail() { echo "FAIL: $*"; echo "--- output"; cat "$tmp/out"; echo "--- metrics"; cat "$tmp/pool.prom" 2>/dev/null; exit 1; }
"$sf" prefill --model default --prompt-file "$prompt" --kv-pool "host=1M,disk=$tmp/kvp" \
  --metrics-file "$tmp/pool.prom" >"$tmp/out" 2>&1 || fail "exit $?"
line=$(grep '^kv pool: ' "$tmp/out") || fail "no pool line"
m() { awk -v k="$1" '$1 == k { print $2 }' "$tmp/pool.prom"; }
for tier in host disk; do
  blocks=$(printf '%s\n' "$line" | sed -n "s/.* $tier \([0-9]*\) blocks \([0-9]*\) bytes.*/\1/p")
  bytes=$(printf '%s\n' "$line" | sed -n "s/.* $tier \([0-9]*\) blocks \([0-9]*\) bytes.*/\2/p")
  [ -n "$blocks" ] && [ "$blocks" -gt 0 ] || fail "no $tier blocks in the line"
  [ "$(m "sparsefill_kv_pool_blocks{tier=\"$tier\"}")" = "$blocks" ] || fail "$tier blocks"
  [ "$(m "sparsefill_kv_pool_bytes{tier=\"$tier\"}")" = "$bytes" ] || fail "$tier bytes"
done
# A one-block-a-layer prompt: the blocks past the host budget spilled to disk (no moves), and the
# device tier is exported with zeros.
[ "$(m 'sparsefill_kv_pool_spilled_total{tier="disk"}')" = "$(m 'sparsefill_kv_pool_blocks{tier="disk"}')" ] || fail "disk spills"
[ "$(m 'sparsefill_kv_pool_capacity_bytes{tier="device"}')" = 0 ] || fail "device capacity"
grep -q '^# TYPE sparsefill_kv_pool_bytes_moved_total counter$' "$tmp/pool.prom" || fail "TYPE line"
# Host fast tier: nothing drains in the background, so the forward never waited for host room.
[ "$(m 'sparsefill_kv_tiering_host_wait_seconds_total')" = 0 ] || fail "host wait"
! ls "$tmp" | grep -q '\.tmp' || fail "temporary file left: $(ls "$tmp")"
echo "ok"
