#!/usr/bin/env bash
# worker_cases.sh CASE MPIEXEC WORKER TMPDIR: one `mpi`-label contract of sparsefill-worker.
# The environment (loopback only, root allowed, one BLAS thread) comes from ctest.
#   batch       np 4, 2 groups of cp 2: a batch with bad lines writes the good requests, reports
#               each bad line with its number, exits 3; a second run resumes (writes nothing new);
#               --metrics-file: each group's Prometheus file counts what its summaries say; a
#               resume removes a killed job's partial outputs; a second job on a locked --out,
#               or on a --metrics-file whose lock another job holds, stops at start
#   world       np 3 with --tp 2: one error line naming the world size and tp x cp, exit 2
#   flags       --selective-kv without --cp-estimate, a --metrics-file in a missing directory,
#               --model synthetic:... without --device cuda or malformed: one error line, exit 2,
#               no request run
#   tp          np 2 with --tp 2 on the default model (3 KV heads): one error line, exit 2
#   load        rank 1 cannot load the model: every rank prints the same single line, exit 1;
#               a line only rank 1 refuses (SF_WORKER_FAULT=refuse_line) is a bad line
#               everywhere and leaves its id to the corrected line after it
#   hosts       np 2 by MPMD, each rank in its own directory: an --attention config file missing
#               on rank 1, then one with other contents, is one start-up error naming it, exit 2
#   group_fail  np 2, CP 2: rank 1 fails every request alone after its prefill; the group
#               reports 4 failed with rank 1's reason, no deadline; a gathered export slower than
#               --comm-timeout is waited for (under --stall-timeout) and written
#   killed      rank 1 SIGKILLs itself at layer 3: the job fails within 30 s
#   stalled     rank 1 SIGSTOPs itself at layer 3: rank 0's all-gather passes its 3 s deadline,
#               the job fails within 30 s with the error naming the collective and the ranks
#   stalled_group  np 2, two groups of one: group 1's rank SIGSTOPs at layer 3; group 0
#               finishes, then ends the job after --stall-timeout 3 with the group named (30 s);
#               a group that is slow but sends notes (150 ms a layer) outlasts --stall-timeout 2
#               and the job finishes; a CP 2 group's member that stops after the group's last
#               request (before the final tally) ends the job after --stall-timeout 3
#   sharded     np 2 with --cp 2, a ~530-token prompt: the default sharded export has one shard per
#               layer and rank, whose manifest entries cover the prompt, and it decodes exactly as
#               the gathered export (--export gathered) does; --export bogus is refused
#   retention   np 2 with --cp 2, the same prompt, --retention snapkv (importance scored where
#               the keys live): the sharded export (block-aligned per-head parts, rows moved
#               between ranks) keeps exactly the gathered export's positions and decodes as it
#               does; a line's own "retention" overrides the flag; bad specs are bad lines or a
#               start-up error; a budget larger than its prompt is a bad line (no prefill); the
#               same at TP 3 x CP 2 (np 6) and CP 4 (np 4, runs that span several chunks)
#   overlap     np 2, CP 2, prefills and gathered exports slowed alike: --export-overlap on and
#               off write the same files (and sharded exports too); on, the batch waits less than
#               half as long for its exports; summaries' export_wait_s add up
#               to the metrics counter; a request failing while the one before it is written
#               leaves that export whole, and a rerun computes only the failed one; a rank short
#               of host memory makes the pending export finish before the next prefill; a bad
#               value is refused
#   freeing     np 2, CP 2, the freeing fault (rank 0's export sleeps 50 ms after each layer it
#               frees, and has room once half the pending K/V is freed): the next request starts
#               with some layers of the pending export still held (full retention, snapkv, two
#               tiers), its memory_wait_s in its summary and the metrics, the files those of a run
#               without the overlap; SF_WAIT_WHOLE_EXPORT=1 waits for the whole export
#   stream      np 2, CP 2, the two long prompts: --export-stream on (each full-retention export
#               begun with its prefill, a layer written as the prefill makes it final) writes the
#               files --export-stream off does, its summaries say so, and with rank 0's prefill
#               slowed the leader had written layers by its prefill's end (off: none); a request
#               failing after its prefill, its export still writing, leaves no export and no
#               partial directory, its writer stopped at the next layer; a retention
#               or a gathered export is not streamed; a bad value is refused
#   dry_run     np 4, 2 groups of cp 2, --dry-run: bad lines reported, a plan line per request
#               (group, status, KV sizes) and the totals, exit 3, no prefill, --out not created;
#               the peak host KV differs with --export-overlap off; after a run with one summary
#               removed, the plan marks the others complete and that one to compute again
#   prefix      np 1 with --prefix-cache: a request sharing 200 tokens with an earlier one reuses
#               its 3 whole blocks (192 tokens) and computes the rest; its export (snapkv, so
#               importance counts too) is byte for byte the one the same request writes alone,
#               from nothing cached (manifest with shard checksums, positions, importance); a
#               run without the cache (another code path, runtime::parallel_prefill) keeps the
#               same positions; --prefix-cache with --cp 2, and a budget under one entry (with
#               and without --dry-run), are one start-up error each, exit 2
set -u
case_name="$1"; mpiexec="$2"; worker="$3"; tmp="$4"
rm -rf "$tmp"; mkdir -p "$tmp"
fail() { echo "FAIL ($case_name): $*"; echo "--- stdout"; cat "$tmp/stdout"; echo "--- stderr"; cat "$tmp/stderr"; exit 1; }
run() {  # run NP ARGS...: runs the worker, sets rc and ms
  local np="$1"; shift
  local t0; t0=$(date +%s%N)
  # shellcheck disable=SC2086
  "$mpiexec" --oversubscribe ${mpi_extra:-} -np "$np" "$worker" "$@" >"$tmp/stdout" 2>"$tmp/stderr"
  rc=$?
  ms=$(( ($(date +%s%N) - t0) / 1000000 ))
}
errors() { grep '^error: ' "$tmp/stderr" || true; }
# locked NAME LOCKFILE TEXT ARGS...: runs the worker (np 4) while a shell holds LOCKFILE's flock
# with TEXT in it, as another job would; then it must stop at start with one error line, run no
# request and leave the first job's metrics files ($m0, $m1).
locked() {
  local name="$1" lock="$2" text="$3" holder
  shift 3
  rm -f "$tmp/held"
  ( exec 9>"$lock"; flock 9; [ -z "$text" ] || echo "$text" >&9; touch "$tmp/held"; exec sleep 30 ) &
  holder=$!  # the sleep itself, holding the lock's descriptor: killing it releases the lock
  for _ in $(seq 100); do [ -e "$tmp/held" ] && break; sleep 0.1; done
  run 4 "$@"
  kill "$holder" 2>/dev/null; wait "$holder" 2>/dev/null
  [ -f "$m0" ] && [ -f "$m1" ] || fail "$name: the second job removed the first one's metrics files"
  [ "$rc" -eq 2 ] || fail "$name: exit $rc, want 2"
  [ "$(errors | wc -l)" -eq 1 ] || fail "$name: want one error line"
  ! grep -q "written" "$tmp/stdout" || fail "$name: a request ran"
}
# Two ~530-token prompts of the long document into $tmp/long.jsonl (at CP 2 both ranks hold rows
# of each).
two_long_prompts() {
  local root part text
  root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
  for part in 1 2; do
    text=$(head -c $((2500 * part)) "$root/data/long_document.txt" | tail -c 2500 | tr '\n\t"\\' '    ')
    printf '{"id": "doc%d", "prompt": "%s"}\n' "$part" "$text"
  done >"$tmp/long.jsonl"
}

# same_files WANT GOT WHAT: both long prompts' exports hold the same files, byte for byte.
same_files() {
  local id f
  for id in doc1 doc2; do
    [ "$(ls "$2/$id")" = "$(ls "$1/$id")" ] || fail "$3: $id: other files"
    for f in "$1/$id"/*; do
      cmp -s "$f" "$2/$id/$(basename "$f")" || fail "$3: $id: $(basename "$f") differs"
    done
  done
}

cat >"$tmp/prompts.jsonl" <<'EOF'
{"id": "lighthouse", "prompt": "The lighthouse keeper climbed the stairs and"}
{"id": "ids", "tokens": [1, 504, 3821, 314, 253, 1345, 30, 2]}
not json at all
{"id": "bad/id", "prompt": "x"}

{"id": "village", "prompt": "Once upon a time in a small village by the sea, there lived an old fisherman who"}
{"id": "lighthouse", "prompt": "a repeated id"}
{"id": "vocab", "tokens": [1, 99999999]}
{"id": "both", "prompt": "x", "tokens": [1]}
{"id": "canal", "prompt": "Canal locks raise and lower boats between stretches of water at different levels."}
EOF

case "$case_name" in
  batch)
    mkdir -p "$tmp/metrics"
    # Without SF_NUM_THREADS (ctest sets 1) and unbound: the worker's own split of the CPUs.
    saved_threads="${SF_NUM_THREADS-}"; unset SF_NUM_THREADS
    mpi_extra="--bind-to none"
    run 4 --model default --cp 2 --batch "$tmp/prompts.jsonl" --out "$tmp/out" --metrics-file "$tmp/metrics/w.prom"
    mpi_extra=""; export SF_NUM_THREADS="$saved_threads"
    [ "$rc" -eq 3 ] || fail "exit $rc, want 3 (bad lines present)"
    # Four unbound ranks share this process's CPUs: each pool takes a quarter (one at the least).
    cpus=$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)
    share=$(( cpus / 4 )); [ "$share" -ge 1 ] || share=1
    threads=$(grep -o '[0-9]* host threads a rank' "$tmp/stdout" | grep -o '^[0-9]*')
    [ "$threads" = "$share" ] || fail "host threads a rank '$threads', want $share of $cpus CPUs"
    for l in 3 4 7 8 9; do
      grep -q "prompts.jsonl:$l: .*; skipped" "$tmp/stderr" || fail "bad line $l not reported"
    done
    [ "$(grep -c '; skipped$' "$tmp/stderr")" -eq 5 ] || fail "want exactly 5 bad lines reported"
    for id in lighthouse ids village canal; do
      [ -f "$tmp/out/$id/manifest.json" ] || fail "no KV export for $id"
      ls "$tmp/out/$id"/layer_029.r*.safetensors >/dev/null 2>&1 || fail "no layer 29 shard for $id"
      grep -q "\"id\": \"$id\"" "$tmp/out/$id.json" || fail "no summary for $id"
      grep -Eq "\] [0-9]+/[0-9]+ $id: [0-9]+ tokens, first token" "$tmp/stdout" || fail "no progress line for $id"
    done
    [ ! -e "$tmp/out/bad" ] && [ ! -e "$tmp/out/vocab" ] || fail "output written for a bad line"
    grep -q "batch done: 4 written, 0 already complete, 0 failed, 5 bad lines" "$tmp/stdout" || fail "summary"
    # Both groups worked.
    grep -q '"group": 0' "$tmp"/out/*.json && grep -q '"group": 1' "$tmp"/out/*.json || fail "one group did nothing"
    # Metrics: one Prometheus text file a group; their written requests and prompt tokens add
    # up to the summaries', the bad lines are in group 0's file only, both groups finished.
    m0="$tmp/metrics/w.g0.prom"; m1="$tmp/metrics/w.g1.prom"
    [ -f "$m0" ] && [ -f "$m1" ] && [ ! -e "$tmp/metrics/w.prom" ] || fail "metrics files: $(ls "$tmp/metrics")"
    # (series keyed without the job's out="..." label, which every series carries)
    metric() { sed 's/,out="[^"]*"//' "$1" | awk -v k="$2" '$1 == k { print $2 }'; }
    grep -q "^sparsefill_worker_finished{group=\"0\",out=\"$tmp/out\"} 1$" "$m0" || fail "metrics: no out label"
    w0=$(metric "$m0" 'sparsefill_worker_requests_total{group="0",outcome="written"}')
    w1=$(metric "$m1" 'sparsefill_worker_requests_total{group="1",outcome="written"}')
    [ "$((w0 + w1))" -eq 4 ] && [ "$w0" -ge 1 ] && [ "$w1" -ge 1 ] || fail "metrics: written $w0 + $w1, want 4"
    [ "$(metric "$m0" 'sparsefill_worker_batch_bad_lines{group="0"}')" = 5 ] || fail "metrics: bad lines"
    ! grep -q batch_bad_lines "$m1" || fail "metrics: bad lines in group 1's file"
    for g in 0 1; do
      f="$tmp/metrics/w.g$g.prom"
      [ "$(metric "$f" "sparsefill_worker_finished{group=\"$g\"}")" = 1 ] || fail "metrics: group $g not finished"
      [ "$(metric "$f" "sparsefill_worker_prefill_seconds_count{group=\"$g\"}")" = \
        "$(metric "$f" "sparsefill_worker_requests_total{group=\"$g\",outcome=\"written\"}")" ] || fail "metrics: histogram count"
      [ "$(metric "$f" "sparsefill_worker_export_seconds_count{group=\"$g\"}")" = \
        "$(metric "$f" "sparsefill_worker_requests_total{group=\"$g\",outcome=\"written\"}")" ] || fail "metrics: export histogram count"
      # CP 2 all-gathers its K/V: bytes counted, and the moved bytes equal them (no --selective-kv).
      ag=$(metric "$f" "sparsefill_worker_kv_allgather_bytes_total{group=\"$g\"}")
      [ "$ag" -gt 0 ] && [ "$ag" = "$(metric "$f" "sparsefill_worker_kv_moved_bytes_total{group=\"$g\"}")" ] || fail "metrics: group $g K/V bytes $ag"
    done
    want_tokens=$(grep -ho '"n_tokens": [0-9]*' "$tmp"/out/*.json | awk '{ s += $2 } END { print s }')
    got_tokens=$(( $(metric "$m0" 'sparsefill_worker_prompt_tokens_total{group="0"}') + $(metric "$m1" 'sparsefill_worker_prompt_tokens_total{group="1"}') ))
    [ "$got_tokens" -eq "$want_tokens" ] || fail "metrics: prompt tokens $got_tokens, summaries $want_tokens"
    # Sparse plan grows: the summaries' sum (0 on the CPU, whose estimators size their own index),
    # and the series exported by both groups.
    want_grows=$(grep -ho '"sparse_grows": [0-9]*' "$tmp"/out/*.json | awk '{ s += $2 } END { print s + 0 }')
    got_grows=$(( $(metric "$m0" 'sparsefill_worker_sparse_grows_total{group="0"}') + $(metric "$m1" 'sparsefill_worker_sparse_grows_total{group="1"}') ))
    [ "$got_grows" -eq "$want_grows" ] || fail "metrics: sparse grows $got_grows, summaries $want_grows"
    # Per-rank figures: one entry per rank of the CP 2 group, the leader's first and its own.
    for j in "$tmp"/out/*.json; do
      python3 - "$j" <<'PY' || fail "summary $j: per-rank figures"
import json, sys
s = json.load(open(sys.argv[1]))
byr = {k: s[k + "_by_rank"] for k in ("prefill_s", "attention_s", "comm_s", "density")}
assert all(len(v) == 2 for v in byr.values()), byr
assert all(abs(byr[k][0] - s[k]) <= 1e-6 for k in byr), (byr, {k: s[k] for k in byr})
assert all(0 < d <= 1 for d in byr["density"]) and all(t > 0 for t in byr["prefill_s"]), byr
PY
    done
    # Per-rank metrics: each group's series per rank add up its summaries' per-rank figures.
    python3 - "$tmp/out" "$m0" "$m1" <<'PY' || fail "metrics: per-rank series against the summaries"
import glob, json, os, re, sys
want = {}
for f in glob.glob(os.path.join(sys.argv[1], "*.json")):
    s = json.load(open(f))
    for k in ("attention_s", "comm_s"):
        for r, x in enumerate(s[k + "_by_rank"]):
            want[(k, s["group"], r)] = want.get((k, s["group"], r), 0.0) + x
got = {}
for f in sys.argv[2:]:
    for line in open(f):
        m = re.match(r'sparsefill_worker_rank_(attention|comm)_seconds_total\{group="(\d+)",out="[^"]*",rank="(\d+)"\} (\S+)$', line)
        if m:
            got[(m[1] + "_s", int(m[2]), int(m[3]))] = float(m[4])
assert sorted(got) == sorted(want), (sorted(got), sorted(want))
assert all(abs(got[k] - want[k]) <= 1e-5 * (1 + abs(want[k])) for k in want), (got, want)
assert any(v > 0 for (k, _, _), v in got.items() if k == "attention_s"), got
PY
    # Export bytes: each summary's are its export directory's files, and the metrics add them up.
    for j in "$tmp"/out/*.json; do
      d="${j%.json}"
      on_disk=$(find "$d" -maxdepth 1 -type f -printf '%s\n' | awk '{ s += $1 } END { print s }')
      [ "$(grep -o '"export_bytes": [0-9]*' "$j" | awk '{ print $2 }')" = "$on_disk" ] || fail "summary $j: export_bytes, files hold $on_disk"
    done
    want_eb=$(grep -ho '"export_bytes": [0-9]*' "$tmp"/out/*.json | awk '{ s += $2 } END { print s }')
    got_eb=$(( $(metric "$m0" 'sparsefill_worker_export_bytes_total{group="0"}') + $(metric "$m1" 'sparsefill_worker_export_bytes_total{group="1"}') ))
    [ "$want_eb" -gt 0 ] && [ "$got_eb" -eq "$want_eb" ] || fail "metrics: export bytes $got_eb, summaries $want_eb"
    # No temporary left; each leader's lock file stays (not *.prom: the collector skips it).
    [ "$(ls "$tmp/metrics")" = "$(printf 'w.g0.prom\nw.g0.prom.lock\nw.g1.prom\nw.g1.prom.lock')" ] \
      || fail "metrics: files beside them: $(ls "$tmp/metrics")"
    # Resume: one export removed, the rest are complete and skipped. What a killed job left half
    # written (an export's temporary directory, a summary's .tmp) goes at start, under the lock.
    rm -rf "$tmp/out/village"
    # (a dead process of this host: stale now; another host's, idle for two hours: stale; another
    # host's, fresh: a job there may be live, kept; an export and user files named alike: kept)
    host=$(hostname)
    mkdir -p "$tmp/out/village.partial-$host-4194301" && echo junk >"$tmp/out/village.partial-$host-4194301/layer_000.safetensors"
    mkdir -p "$tmp/out/old.partial-elsewhere-77" && touch -d '2 hours ago' "$tmp/out/old.partial-elsewhere-77"
    mkdir -p "$tmp/out/live.partial-elsewhere-78"
    echo '{"id": "ghost"' >"$tmp/out/ghost.json.tmp.Ab12Cd" && touch -d '1 hour ago' "$tmp/out/ghost.json.tmp.Ab12Cd"
    mkdir -p "$tmp/out/doc.tmp.v1" && echo '{}' >"$tmp/out/doc.tmp.v1/manifest.json"
    echo notes >"$tmp/out/notes.tmp"
    run 4 --model default --cp 2 --batch "$tmp/prompts.jsonl" --out "$tmp/out" --metrics-file "$tmp/metrics/w.prom"
    [ "$rc" -eq 3 ] || fail "resume: exit $rc, want 3"
    grep -q "batch done: 1 written, 3 already complete, 0 failed, 5 bad lines" "$tmp/stdout" || fail "resume summary"
    s0=$(metric "$m0" 'sparsefill_worker_requests_total{group="0",outcome="skipped"}')
    s1=$(metric "$m1" 'sparsefill_worker_requests_total{group="1",outcome="skipped"}')
    w0=$(metric "$m0" 'sparsefill_worker_requests_total{group="0",outcome="written"}')
    w1=$(metric "$m1" 'sparsefill_worker_requests_total{group="1",outcome="written"}')
    [ "$((s0 + s1))" -eq 3 ] && [ "$((w0 + w1))" -eq 1 ] || fail "metrics on resume: skipped $s0 + $s1, written $w0 + $w1"
    [ ! -e "$tmp/out/village.partial-$host-4194301" ] && [ ! -e "$tmp/out/old.partial-elsewhere-77" ] &&
      [ ! -e "$tmp/out/ghost.json.tmp.Ab12Cd" ] || fail "stale partial outputs were left: $(ls "$tmp/out")"
    [ -d "$tmp/out/live.partial-elsewhere-78" ] && [ -f "$tmp/out/doc.tmp.v1/manifest.json" ] &&
      [ -f "$tmp/out/notes.tmp" ] || fail "something not stale was removed: $(ls "$tmp/out")"
    grep -q "removed 3 stale partial output(s) of an earlier job" "$tmp/stdout" || fail "no line for the stale partials"
    # One job a directory: while another holds --out's lock, a second job stops at start, and
    # none of its group leaders removes the running job's metrics files (the lock is agreed on
    # before any leader touches them).
    locked locked "$tmp/out/.sparsefill-worker.lock" "" \
      --model default --cp 2 --batch "$tmp/prompts.jsonl" --out "$tmp/out" --metrics-file "$tmp/metrics/w.prom"
    errors | grep -q "^error: --out '.*/out' is in use by another sparsefill-worker job" || fail "locked: message"
    # One job a metrics file: while another job holds group 0's file lock (its text naming it), a
    # job with its own --out stops at start.
    locked "metrics locked" "$tmp/metrics/w.g0.prom.lock" "another job" \
      --model default --cp 2 --batch "$tmp/prompts.jsonl" --out "$tmp/out_m" --metrics-file "$tmp/metrics/w.prom"
    errors | grep -q "^error: --metrics-file '.*/metrics/w.g0.prom' is in use by another sparsefill-worker job (another job)" \
      || fail "metrics locked: message"
    [ -f "$tmp/out/village/manifest.json" ] || fail "resume did not rewrite village"
    grep -q '"fingerprint": "[0-9a-f]\{16\}"' "$tmp/out/village.json" || fail "summary has no fingerprint"
    # Resume after a line changed (canal's retention) and after a job stopped between an export
    # and its summary (lighthouse's summary gone): both computed again, the rest skipped.
    sed 's/"id": "canal", "prompt"/"id": "canal", "retention": "streaming:sink=2,window=8", "prompt"/' \
      "$tmp/prompts.jsonl" >"$tmp/changed.jsonl"
    rm -f "$tmp/out/lighthouse.json"
    # An old summary that cannot be removed (here a non-empty directory in its place) fails its
    # request before the export is touched; the others go on.
    rm -f "$tmp/out/village.json" && mkdir "$tmp/out/village.json" && touch "$tmp/out/village.json/keep"
    village_export=$(stat -c '%i %Y' "$tmp/out/village" "$tmp/out/village/manifest.json")
    run 4 --model default --cp 2 --batch "$tmp/changed.jsonl" --out "$tmp/out"
    [ "$rc" -eq 3 ] || fail "changed resume: exit $rc, want 3"
    grep -q "batch done: 2 written, 1 already complete, 1 failed, 5 bad lines" "$tmp/stdout" || fail "changed resume summary"
    grep -q "changed.jsonl:6: request 'village' failed: cannot remove its old summary '.*/village.json' before replacing its export" "$tmp/stderr" \
      || fail "the summary that could not be removed was not reported"
    # (the same inodes: a recompute would have renamed a new directory into place)
    [ "$(stat -c '%i %Y' "$tmp/out/village" "$tmp/out/village/manifest.json")" = "$village_export" ] || fail "village's export was replaced"
    rm -rf "$tmp/out/village.json"
    grep -q "canal: its export was made for other inputs (fingerprint [0-9a-f]*, now [0-9a-f]*); computed again" "$tmp/stdout" \
      || fail "the changed line was not reported as recomputed"
    grep -q "lighthouse: its export has no summary with a fingerprint; computed again" "$tmp/stdout" \
      || fail "the export without a summary was not reported as recomputed"
    grep -q '"retention": "streaming:' "$tmp/out/canal.json" || fail "canal's summary is not the new retention's"
    # Another grid (CP 1 instead of 2) is other inputs too: everything is computed again.
    run 2 --model default --batch "$tmp/changed.jsonl" --out "$tmp/out"
    [ "$rc" -eq 3 ] || fail "grid resume: exit $rc, want 3"
    grep -q "batch done: 4 written, 0 already complete, 0 failed, 5 bad lines" "$tmp/stdout" || fail "grid resume summary"
    ;;
  prefix)
    shared=$(seq -s, 1000 1199)  # 200 token ids
    {
      printf '{"id": "first", "tokens": [%s,%s]}\n' "$shared" "$(seq -s, 3000 3039)"
      printf '{"id": "second", "tokens": [%s,%s]}\n' "$shared" "$(seq -s, 4000 4059)"
      printf '{"id": "other", "tokens": [%s]}\n' "$(seq -s, 5000 5199)"
    } >"$tmp/prefix.jsonl"
    common=(--model default --batch "$tmp/prefix.jsonl" --retention snapkv:budget=128,window=32)
    run 1 "${common[@]}" --out "$tmp/plain"
    [ "$rc" -eq 0 ] || fail "plain run: exit $rc"
    run 1 "${common[@]}" --prefix-cache 64M --out "$tmp/cached"
    [ "$rc" -eq 0 ] || fail "cached run: exit $rc"
    grep -Eq "\] 1/3 first: 240 tokens \(0 from the prefix cache\)" "$tmp/stdout" || fail "first request"
    grep -Eq "\] 2/3 second: 260 tokens \(192 from the prefix cache\)" "$tmp/stdout" || fail "no reuse for second"
    grep -Eq "\] 3/3 other: 200 tokens \(0 from the prefix cache\)" "$tmp/stdout" || fail "other request"
    grep -q "prefix cache: 192 prompt tokens reused, not computed" "$tmp/stdout" || fail "total"
    grep -q '"prefix_reused_tokens": 192' "$tmp/cached/second.json" || fail "summary field"
    # The hit against the same request alone (nothing cached: every token computed).
    grep '"id": "second"' "$tmp/prefix.jsonl" >"$tmp/alone.jsonl"
    run 1 --model default --batch "$tmp/alone.jsonl" --retention snapkv:budget=128,window=32 \
      --prefix-cache 64M --out "$tmp/alone"
    [ "$rc" -eq 0 ] || fail "alone run: exit $rc"
    grep -Eq "\] 1/1 second: 260 tokens \(0 from the prefix cache\)" "$tmp/stdout" || fail "alone reused"
    cmp -s "$tmp/cached/second/manifest.json" "$tmp/alone/second/manifest.json" \
      || fail "the prefix hit's export differs from the same request computed in full"
    # Without the cache the forward is the runtime's (its sums may round differently): the same
    # positions kept.
    for id in first second other; do
      python3 - "$tmp/plain/$id/manifest.json" "$tmp/cached/$id/manifest.json" <<'PY' \
        || fail "$id: the cached run keeps other positions than the plain run"
import json, sys
a, b = (json.load(open(p))["retention"]["layers"] for p in sys.argv[1:3])
sys.exit(0 if a == b else 1)
PY
    done
    # A budget under one entry (a 64-token block for each of the 30 layers: 30 x 98,304 bytes)
    # would cache nothing and warn at every request: one start-up error instead.
    run 1 --model default --prefix-cache 2M --batch "$tmp/prefix.jsonl" --out "$tmp/small"
    [ "$rc" -eq 2 ] && [ "$(errors | wc -l)" -eq 1 ] || fail "--prefix-cache 2M: exit $rc, want 2"
    errors | grep -q "^error: --prefix-cache 2097152 bytes holds no cache entry: one (64 tokens of every layer's K and V) takes 2949120 bytes for this model" \
      || fail "--prefix-cache 2M: message"
    [ ! -e "$tmp/small/first" ] || fail "--prefix-cache 2M: a request ran"
    # --dry-run reports it too, instead of a plan for a job that could not start.
    run 1 --model default --prefix-cache 2M --batch "$tmp/prefix.jsonl" --out "$tmp/small" --dry-run
    [ "$rc" -eq 2 ] && [ "$(errors | wc -l)" -eq 1 ] || fail "--prefix-cache 2M --dry-run: exit $rc, want 2"
    errors | grep -q "^error: --prefix-cache 2097152 bytes holds no cache entry" \
      || fail "--prefix-cache 2M --dry-run: message"
    ! grep -q "^plan:" "$tmp/stdout" || fail "--prefix-cache 2M --dry-run: printed a plan"
    run 2 --model default --cp 2 --prefix-cache 64M --batch "$tmp/prefix.jsonl" --out "$tmp/bad"
    [ "$rc" -eq 2 ] || fail "--prefix-cache with --cp 2: exit $rc, want 2"
    errors | grep -q "^error: --prefix-cache needs a positive size, --tp 1 --cp 1 and dense attention" || fail "message"
    ;;
  world)
    run 3 --model default --tp 2 --batch "$tmp/prompts.jsonl" --out "$tmp/out"
    [ "$rc" -eq 2 ] || fail "exit $rc, want 2"
    [ "$(errors | wc -l)" -eq 1 ] || fail "want one error line"
    errors | grep -q '^error: world size 3 is not a multiple of tp x cp = 2 x 1 = 2' || fail "message"
    ;;
  flags)
    run 2 --model default --cp 2 --selective-kv --batch "$tmp/prompts.jsonl" --out "$tmp/out"
    [ "$rc" -eq 2 ] || fail "exit $rc, want 2"
    [ "$(errors | wc -l)" -eq 1 ] || fail "want one error line"
    errors | grep -q "^error: --selective-kv needs --cp-estimate" || fail "message"
    run 2 --model default --cp 2 --cp 2 --batch "$tmp/prompts.jsonl" --out "$tmp/out"
    [ "$rc" -eq 2 ] && errors | grep -q "^error: option --cp is given twice" || fail "twice: exit $rc"
    # The parser is the sparsefill CLI's (common/args.h): --help prints the usage on stdout and
    # exits 0 before the required options are checked; --key=VALUE gives a value.
    run 2 --help
    [ "$rc" -eq 0 ] && grep -q "^usage: mpirun -np N sparsefill-worker" "$tmp/stdout" && [ -z "$(errors)" ] || fail "--help: exit $rc"
    grep -q -- "--metrics-file PATH.prom" "$tmp/stdout" || fail "--help: the usage lacks --metrics-file"
    run 2 --model=default --cp=2 --batch="$tmp/prompts.jsonl" --out "$tmp/out_eq" --dry-run \
      --metrics-file="$tmp/metrics.txt"
    [ "$rc" -eq 3 ] && grep -q "^plan: lighthouse (line 1)" "$tmp/stdout" || fail "--key=VALUE: exit $rc"
    # A metrics file node_exporter would not read (not *.prom): one warning, the job goes on.
    [ "$(grep -c "^warning: --metrics-file '.*/metrics.txt' does not end in .prom" "$tmp/stderr")" -eq 1 ] \
      || fail "--metrics-file not .prom: want one warning"
    # A directory given as the batch file is one start-up error (an ifstream opens it and read
    # nothing: the job ran no request and exited 0).
    mkdir -p "$tmp/batch_dir"
    run 2 --model default --cp 2 --batch "$tmp/batch_dir" --out "$tmp/out_dir"
    [ "$rc" -eq 2 ] && [ "$(errors | wc -l)" -eq 1 ] || fail "batch directory: exit $rc"
    errors | grep -q "^error: batch file '.*/batch_dir' is a directory, not a file" || fail "batch directory: message"
    # A metrics file the leaders cannot write (np 4: two groups, each leader its own file) is
    # one start-up error, before the model loads.
    run 4 --model default --cp 2 --metrics-file "$tmp/no/such/dir/w.prom" --batch "$tmp/prompts.jsonl" --out "$tmp/out"
    [ "$rc" -eq 2 ] || fail "metrics: exit $rc, want 2"
    [ "$(errors | wc -l)" -eq 1 ] || fail "metrics: want one error line"
    errors | grep -q "^error: --metrics-file '.*/no/such/dir/w.g0.prom': its directory '.*/no/such/dir' does not exist" || fail "metrics: message"
    grep -q "loaded" "$tmp/stderr" && fail "metrics: the model was loaded before the check"
    [ ! -e "$tmp/out/lighthouse" ] || fail "metrics: a request ran"
    # --model synthetic:...: weights drawn on the GPU only; a malformed spec is named.
    run 1 --model synthetic:llama3-8b:2 --batch "$tmp/prompts.jsonl" --out "$tmp/out"
    [ "$rc" -eq 2 ] && [ "$(errors | wc -l)" -eq 1 ] || fail "synthetic on cpu: exit $rc"
    errors | grep -q "^error: --model synthetic:llama3-8b:2 draws its weights on the GPU: it needs --device cuda" || fail "synthetic on cpu: message"
    run 1 --model synthetic:llama3-8b:0 --device cuda --batch "$tmp/prompts.jsonl" --out "$tmp/out"
    [ "$rc" -eq 2 ] && errors | grep -q "^error: --model synthetic:llama3-8b:0: want synthetic:SHAPE\[:LAYERS\[:SEED\]\] with SHAPE llama3-8b ('0' is not a number in \[1, 32\])" \
      || fail "synthetic layers 0: exit $rc"
    ;;
  tp)
    run 2 --model default --tp 2 --batch "$tmp/prompts.jsonl" --out "$tmp/out"
    [ "$rc" -eq 2 ] || fail "exit $rc, want 2"
    [ "$(errors | wc -l)" -eq 1 ] || fail "want one error line"
    errors | grep -q "has 3 KV heads (9 query heads), which do not divide by --tp 2" || fail "message"
    ;;
  load)
    SF_WORKER_FAULT=load:1 run 3 --model default --batch "$tmp/prompts.jsonl" --out "$tmp/out"
    [ "$rc" -eq 1 ] || fail "exit $rc, want 1"
    [ "$(errors | wc -l)" -eq 3 ] || fail "want one error line from each of the 3 ranks"
    [ "$(errors | sort -u | wc -l)" -eq 1 ] || fail "ranks printed different messages"
    errors | grep -q "^error: rank 1 could not load the model: " || fail "message"
    # A line only rank 1 refuses (as a moa config some hosts cannot read) is a bad line
    # everywhere, and leaves its id to the corrected line after it: ids are settled on the lines
    # every rank agreed on (two groups of one rank).
    printf '%s\n' '{"id": "twice", "prompt": "A first copy of a line"}' \
      '{"id": "twice", "prompt": "The corrected copy of the line"}' \
      '{"id": "twice", "prompt": "A third copy, repeating the second"}' >"$tmp/twice.jsonl"
    SF_WORKER_FAULT=refuse_line:1:1 run 2 --model default --batch "$tmp/twice.jsonl" --out "$tmp/twice"
    [ "$rc" -eq 3 ] || fail "refuse_line: exit $rc, want 3"
    grep -q "twice.jsonl:1: rejected on another rank" "$tmp/stderr" || fail "refuse_line: line 1"
    grep -q "twice.jsonl:3: id 'twice' repeats an earlier line's" "$tmp/stderr" || fail "refuse_line: line 3"
    ! grep -q "twice.jsonl:2:" "$tmp/stderr" || fail "refuse_line: line 2 refused"
    grep -q "batch done: 1 written" "$tmp/stdout" && [ -f "$tmp/twice/twice/manifest.json" ] \
      || fail "refuse_line: the corrected line did not run"
    ;;
  group_fail)
    # Rank 1 of a CP 2 group fails every request alone, after its prefill: the whole group counts
    # each as failed with rank 1's reason (no rank runs ahead into the next request's collectives).
    SF_WORKER_FAULT=fail_after:1 run 2 --model default --cp 2 --comm-timeout 5 --batch "$tmp/prompts.jsonl" --out "$tmp/out"
    [ "$rc" -eq 3 ] || fail "exit $rc, want 3"
    [ "$ms" -lt 30000 ] || fail "took $ms ms: a deadline, not an agreement"
    grep -q "batch done: 0 written, 0 already complete, 4 failed" "$tmp/stdout" || fail "want 4 failed"
    [ "$(grep -c "failed: fault injection: rank 1 fails the request after its prefill" "$tmp/stderr")" -eq 4 ] \
      || fail "want rank 1's reason for each of the 4 requests"
    ! grep -q "deadline" "$tmp/stderr" || fail "a collective timed out"
    # A gathered export slower than --comm-timeout (30 layers x 300 ms against 5 s): the other
    # rank waits for it under --stall-timeout, and every request is written.
    SF_WORKER_FAULT=slow_export:0:300 run 2 --model default --cp 2 --export gathered --comm-timeout 5 \
      --batch "$tmp/prompts.jsonl" --out "$tmp/slow"
    [ "$rc" -eq 3 ] || fail "slow gathered export: exit $rc, want 3 (the batch's bad lines)"
    [ "$(find "$tmp/slow" -name manifest.json | wc -l)" -eq 4 ] || fail "want 4 exports"
    [ "$ms" -gt 9000 ] || fail "the exports took only $ms ms: the sleep did not happen"
    # The same with sharded exports, rank 1's shards the slow ones: rank 0 waits for them in the
    # export's closing collective under --stall-timeout, not --comm-timeout.
    SF_WORKER_FAULT=slow_export:1:300 run 2 --model default --cp 2 --comm-timeout 5 \
      --batch "$tmp/prompts.jsonl" --out "$tmp/slow_sharded"
    [ "$rc" -eq 3 ] || fail "slow sharded export: exit $rc, want 3 (the batch's bad lines)"
    [ "$(find "$tmp/slow_sharded" -name manifest.json | wc -l)" -eq 4 ] || fail "want 4 sharded exports"
    [ "$ms" -gt 9000 ] || fail "the sharded exports took only $ms ms: the sleep did not happen"
    ;;
  killed)
    SF_WORKER_FAULT=kill:1:3 run 2 --model default --cp 2 --comm-timeout 10 --batch "$tmp/prompts.jsonl" --out "$tmp/out"
    [ "$rc" -ne 0 ] || fail "exit 0 with a killed rank"
    [ "$ms" -lt 30000 ] || fail "took $ms ms (deadline 30 s)"
    grep -Eq "exited on signal 9|did not complete within its deadline|unexpectedly disconnected" "$tmp/stderr" \
      || fail "no clear error"
    ;;
  hosts)
    # Each rank reads --attention config:FILE on its own host (here: its own working directory,
    # by MPMD). A rank that cannot read it, or reads other contents, is one clear start-up error
    # on rank 0, exit 2, not a grid barrier waiting out its deadline.
    src="$(cd "$(dirname "$0")/../.." && pwd)"
    mkdir -p "$tmp/a" "$tmp/b"
    cp "$src/configs/smollm2-135m-instruct.json" "$tmp/a/c.json"
    hosts() {  # rank 0 in a/, rank 1 in b/
      local t0; t0=$(date +%s%N)
      SF_COMM_TIMEOUT_S=30 "$mpiexec" --oversubscribe -np 1 --wdir "$tmp/a" "$worker" "$@" : \
        -np 1 --wdir "$tmp/b" "$worker" "$@" >"$tmp/stdout" 2>"$tmp/stderr"
      rc=$?
      ms=$(( ($(date +%s%N) - t0) / 1000000 ))
    }
    hosts --model default --cp 2 --attention config:c.json --batch "$tmp/prompts.jsonl" --out "$tmp/out"
    [ "$rc" -eq 2 ] || fail "config missing on rank 1: exit $rc, want 2"
    [ "$ms" -lt 20000 ] || fail "took $ms ms: waited on a deadline instead of agreeing"
    [ "$(errors | wc -l)" -eq 1 ] || fail "want one error line"
    errors | grep -q "^error: rank 1: .*c.json" || fail "message should name rank 1 and the file"
    # Other contents on rank 1's host (one more byte): the ranks would build different indexes.
    { cat "$tmp/a/c.json"; echo; } >"$tmp/b/c.json"
    hosts --model default --cp 2 --attention config:c.json --batch "$tmp/prompts.jsonl" --out "$tmp/out"
    [ "$rc" -eq 2 ] || fail "config differs on rank 1: exit $rc, want 2"
    [ "$(errors | wc -l)" -eq 1 ] || fail "want one error line"
    errors | grep -q "^error: the ranks read different model weights or --attention config files" \
      || fail "message"
    [ ! -e "$tmp/out" ] || [ -z "$(find "$tmp/out" -name manifest.json)" ] || fail "exports were written"
    # A flag that decides collectives, given to one rank only: one start-up error, no deadline.
    t0=$(date +%s%N)
    SF_COMM_TIMEOUT_S=30 "$mpiexec" --oversubscribe -np 1 "$worker" --model default --cp 2 \
      --batch "$tmp/prompts.jsonl" --out "$tmp/out_f" : -np 1 "$worker" --model default --cp 2 \
      --host-memory-check off --batch "$tmp/prompts.jsonl" --out "$tmp/out_f" >"$tmp/stdout" 2>"$tmp/stderr"
    rc=$?
    ms=$(( ($(date +%s%N) - t0) / 1000000 ))
    [ "$rc" -eq 2 ] && [ "$ms" -lt 20000 ] || fail "--host-memory-check on one rank only: exit $rc after $ms ms"
    errors | grep -q "^error: the ranks were given different --dry-run, --export-overlap, --host-memory-check, --kv-host-dtype, --export-stream or --chunk flags" \
      || fail "--host-memory-check on one rank only: message"
    # --export-stream decides whether an export opens (a collective) before the prefill.
    SF_COMM_TIMEOUT_S=30 "$mpiexec" --oversubscribe -np 1 "$worker" --model default --cp 2 \
      --batch "$tmp/prompts.jsonl" --out "$tmp/out_f" : -np 1 "$worker" --model default --cp 2 \
      --export-stream on --batch "$tmp/prompts.jsonl" --out "$tmp/out_f" >"$tmp/stdout" 2>"$tmp/stderr"
    rc=$?
    [ "$rc" -eq 2 ] && errors | grep -q "^error: the ranks were given different .*--export-stream or --chunk flags" \
      || fail "--export-stream on one rank only: exit $rc"
    # --chunk sets how many sums a TP layer issues (per chunk): one rank's own value is refused too.
    SF_COMM_TIMEOUT_S=30 "$mpiexec" --oversubscribe -np 1 "$worker" --model default --tp 2 \
      --batch "$tmp/prompts.jsonl" --out "$tmp/out_f" : -np 1 "$worker" --model default --tp 2 \
      --chunk 64 --batch "$tmp/prompts.jsonl" --out "$tmp/out_f" >"$tmp/stdout" 2>"$tmp/stderr"
    rc=$?
    [ "$rc" -eq 2 ] && errors | grep -q "^error: the ranks were given different .*--chunk flags" \
      || fail "--chunk on one rank only: exit $rc"
    ;;
  stalled)
    SF_WORKER_FAULT=stop:1:3 run 2 --model default --cp 2 --comm-timeout 3 --batch "$tmp/prompts.jsonl" --out "$tmp/out"
    [ "$rc" -ne 0 ] || fail "exit 0 with a stalled rank"
    [ "$ms" -lt 30000 ] || fail "took $ms ms (deadline 30 s)"
    errors | grep -Eq "^error: comm: all_gatherv on 'cp \(group 0, tp rank 0\)' \(2 ranks: world 0-1; .*deadline of 3.0 s" \
      || fail "no deadline error naming the collective and ranks"
    ;;
  stalled_group)
    # Two groups of one rank: group 1's only rank stops at layer 3 of its first request, where no
    # collective can notice. Group 0 finishes, waits for group 1's progress notes, and ends the
    # job after --stall-timeout instead of holding the final tally for its day-long deadline.
    SF_WORKER_FAULT=stop:1:3 run 2 --model default --stall-timeout 3 --batch "$tmp/prompts.jsonl" --out "$tmp/out"
    [ "$rc" -ne 0 ] || fail "exit 0 with a stalled group"
    [ "$ms" -lt 30000 ] || fail "took $ms ms (stall timeout 3 s)"
    errors | grep -Eq "^error: group 1 \(world ranks 1-1\) sent no progress for 3 s while group 0 waited" \
      || fail "no error naming the stalled group"
    grep -q "1/2 lighthouse" "$tmp/stdout" && grep -q "2/2 village" "$tmp/stdout" \
      || fail "group 0 should have finished its requests first"
    # Slow but alive: group 1's rank sleeps 150 ms at each of its 30 layers a request, so group
    # 0 (done in about a second) waits ~9 s, far past a 2 s stall timeout, on notes that keep
    # coming. The job must finish.
    SF_WORKER_FAULT=slow:1:150 run 2 --model default --stall-timeout 2 --batch "$tmp/prompts.jsonl" --out "$tmp/slow"
    [ "$rc" -eq 3 ] || fail "a slow, live group: exit $rc, want 3 (the batch's bad lines)"
    [ "$(find "$tmp/slow" -name manifest.json | wc -l)" -eq 4 ] || fail "want 4 exports from the slow run"
    [ "$ms" -gt 8000 ] || fail "the slow rank took only $ms ms: the sleep did not happen"
    run 2 --model default --stall-timeout 0 --batch "$tmp/prompts.jsonl" --out "$tmp/out"
    [ "$rc" -eq 2 ] || fail "--stall-timeout 0: exit $rc, want 2"
    # A member of a two-rank group (CP 2) stops after the group's last request, where neither a
    # collective nor the leaders' notes can see it: the leader's tally ends the job after
    # --stall-timeout 3 instead of a day.
    SF_WORKER_FAULT=stop_end:1 run 2 --model default --cp 2 --stall-timeout 3 --batch "$tmp/prompts.jsonl" --out "$tmp/end"
    [ "$rc" -ne 0 ] || fail "exit 0 with a member stopped before the tally"
    [ "$ms" -lt 30000 ] || fail "took $ms ms (stall timeout 3 s)"
    errors | grep -Eq "^error: the final tally: every group finished its requests, but a rank did not arrive within --stall-timeout \(3 s\)" \
      || fail "no error naming the tally"
    [ "$(find "$tmp/end" -name manifest.json | wc -l)" -eq 4 ] || fail "the group's 4 exports should be written first"
    ;;
  sharded)
    root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
    decoder="$(dirname "$worker")/../decode/sparsefill-decode"
    # 2,500 characters of the bundled document (~530 tokens: both CP ranks hold chunks), one line.
    text=$(head -c 2500 "$root/data/long_document.txt" | tr '\n\t"\\' '    ')
    printf '{"id": "doc", "prompt": "%s"}\n' "$text" >"$tmp/long.jsonl"
    run 2 --model default --cp 2 --batch "$tmp/long.jsonl" --out "$tmp/out_s"
    [ "$rc" -eq 0 ] || fail "sharded: exit $rc"
    [ -f "$tmp/out_s/doc/layer_029.r0.safetensors" ] && [ -f "$tmp/out_s/doc/layer_029.r1.safetensors" ] \
      || fail "want a layer-29 shard from each rank"
    [ ! -e "$tmp/out_s/doc/layer_029.safetensors" ] || fail "a whole-layer shard in a sharded export"
    grep -q '"format_version":6' "$tmp/out_s/doc/manifest.json" || fail "manifest is not format 6"
    grep -Eq '"tokens":\[\[0,128\],\[384,5[0-9]{2}\]\],"kv_heads":\[0,3\]' "$tmp/out_s/doc/manifest.json" \
      || fail "rank 0's shard entry does not name its zigzag chunks"
    grep -q '"export": "sharded"' "$tmp/out_s/doc.json" || fail "summary does not say sharded"
    run 2 --model default --cp 2 --export gathered --batch "$tmp/long.jsonl" --out "$tmp/out_g"
    [ "$rc" -eq 0 ] || fail "gathered: exit $rc"
    [ -f "$tmp/out_g/doc/layer_029.safetensors" ] && [ ! -e "$tmp/out_g/doc/layer_029.r1.safetensors" ] \
      || fail "a gathered export is one shard per layer, from the leader"
    "$decoder" --model default --kv "$tmp/out_s/doc" --tokens 12 >"$tmp/dec_s" 2>&1 || { cat "$tmp/dec_s"; fail "decode of the sharded export"; }
    "$decoder" --model default --kv "$tmp/out_g/doc" --tokens 12 >"$tmp/dec_g" 2>&1 || { cat "$tmp/dec_g"; fail "decode of the gathered export"; }
    grep '^tokens:' "$tmp/dec_s" >"$tmp/tok_s"; grep '^tokens:' "$tmp/dec_g" >"$tmp/tok_g"
    [ -s "$tmp/tok_s" ] && cmp -s "$tmp/tok_s" "$tmp/tok_g" || fail "sharded and gathered exports decode differently"
    # int8 K/V: each rank encodes its own chunks; the sharded export decodes as the gathered one.
    run 2 --model default --cp 2 --kv-dtype int8 --batch "$tmp/long.jsonl" --out "$tmp/out_s8"
    [ "$rc" -eq 0 ] || fail "sharded int8: exit $rc"
    run 2 --model default --cp 2 --kv-dtype int8 --export gathered --batch "$tmp/long.jsonl" --out "$tmp/out_g8"
    [ "$rc" -eq 0 ] || fail "gathered int8: exit $rc"
    grep -q '"kv_dtype":"int8"' "$tmp/out_s8/doc/manifest.json" || fail "manifest does not say int8"
    grep -q '"kv_dtype": "int8"' "$tmp/out_s8/doc.json" || fail "summary does not say int8"
    "$decoder" --model default --kv "$tmp/out_s8/doc" --tokens 12 >"$tmp/dec_s8" 2>&1 || { cat "$tmp/dec_s8"; fail "decode of the sharded int8 export"; }
    "$decoder" --model default --kv "$tmp/out_g8/doc" --tokens 12 >"$tmp/dec_g8" 2>&1 || { cat "$tmp/dec_g8"; fail "decode of the gathered int8 export"; }
    grep '^tokens:' "$tmp/dec_s8" >"$tmp/tok_s8"; grep '^tokens:' "$tmp/dec_g8" >"$tmp/tok_g8"
    [ -s "$tmp/tok_s8" ] && cmp -s "$tmp/tok_s8" "$tmp/tok_g8" || fail "sharded and gathered int8 exports decode differently"
    grep -q "K/V stored as int8" "$tmp/dec_s8" || fail "decode does not say int8"
    # A line's own kv_dtype overrides --kv-dtype.
    sed 's/"prompt"/"kv_dtype": "bf16", "prompt"/' "$tmp/long.jsonl" >"$tmp/long16.jsonl"
    run 2 --model default --cp 2 --kv-dtype int8 --batch "$tmp/long16.jsonl" --out "$tmp/out_s16"
    [ "$rc" -eq 0 ] || fail "line kv_dtype: exit $rc"
    grep -q '"kv_dtype":"bf16"' "$tmp/out_s16/doc/manifest.json" || fail "a line's kv_dtype did not override --kv-dtype"
    run 2 --model default --cp 2 --kv-dtype fp8 --batch "$tmp/long.jsonl" --out "$tmp/out_b8"
    [ "$rc" -eq 2 ] || fail "--kv-dtype fp8: exit $rc, want 2"
    errors | grep -q "^error: --kv-dtype: KV encoding 'fp8' is not f32, bf16, int8 or int4" || fail "--kv-dtype message"
    run 2 --model default --cp 2 --export bogus --batch "$tmp/long.jsonl" --out "$tmp/out_b"
    [ "$rc" -eq 2 ] || fail "--export bogus: exit $rc, want 2"
    errors | grep -q "^error: --export must be sharded or gathered, got 'bogus'" || fail "--export message"
    ;;
  retention)
    root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
    decoder="$(dirname "$worker")/../decode/sparsefill-decode"
    text=$(head -c 2500 "$root/data/long_document.txt" | tr '\n\t"\\' '    ')
    {
      printf '{"id": "doc", "prompt": "%s"}\n' "$text"
      printf '{"id": "ada", "prompt": "%s", "retention": "adakv:budget=100,span=4"}\n' "$text"
      printf '{"id": "neg", "prompt": "x", "retention": "snapkv:budget=64,bogus=1"}\n'
      printf '{"id": "huge", "prompt": "%s", "retention": "snapkv:budget=100000"}\n' "$text"
    } >"$tmp/ret.jsonl"
    for mode in sharded gathered; do
      run 2 --model default --cp 2 --retention snapkv:budget=128 --export "$mode" --batch "$tmp/ret.jsonl" --out "$tmp/out_$mode"
      [ "$rc" -eq 3 ] || fail "$mode: exit $rc, want 3 (two bad lines)"
      grep -q "ret.jsonl:3: field 'retention': .*bogus" "$tmp/stderr" || fail "$mode: bad retention line not reported"
      grep -q "ret.jsonl:4: field 'retention': retention snapkv: budget 100000 tokens out of range \[32, 529\]" "$tmp/stderr" || fail "$mode: oversized budget not reported"
      grep -q '"retention": "snapkv:budget=128,window=32,pool=7"' "$tmp/out_$mode/doc.json" || fail "$mode: summary retention"
      grep -q '"retention": "adakv:budget=100' "$tmp/out_$mode/ada.json" || fail "$mode: the line's retention did not override"
      for id in doc ada; do
        "$decoder" --model default --kv "$tmp/out_$mode/$id" --tokens 12 >"$tmp/dec_${mode}_$id" 2>&1 || { cat "$tmp/dec_${mode}_$id"; fail "decode of $mode $id"; }
        grep '^tokens:' "$tmp/dec_${mode}_$id" >"$tmp/tok_${mode}_$id"
      done
    done
    [ -f "$tmp/out_sharded/doc/layer_029.r0.h2.safetensors" ] || fail "want per-head parts in a sharded retention export"
    ls "$tmp/out_sharded/doc" | grep -q '\.r1\.h' || fail "rank 1 wrote no part"
    for id in doc ada; do
      [ -s "$tmp/tok_sharded_$id" ] && cmp -s "$tmp/tok_sharded_$id" "$tmp/tok_gathered_$id" || fail "$id: sharded and gathered decode differently"
      python3 -c 'import json,sys; a,b=(json.load(open(f))["retention"] for f in sys.argv[1:]); sys.exit(a!=b or a["policy"]=="full")' \
        "$tmp/out_sharded/$id/manifest.json" "$tmp/out_gathered/$id/manifest.json" || fail "$id: kept positions differ"
    done
    # Two tiers (format 5): adakv's top 96 tokens a head in int8, the rest of its 256 in int4,
    # each tier in its own shards. On one rank and sharded over CP 2 (each tier cut on its own
    # blocks, rows moving between ranks per tier) the export decodes as the gathered one.
    head -1 "$tmp/ret.jsonl" >"$tmp/one.jsonl"
    for grid in "1 --export sharded" "2 --cp 2 --export sharded" "2 --cp 2 --export gathered"; do
      set -- $grid
      np="$1"; shift
      tag="np${np}_${*: -1}"
      run "$np" --model default "$@" --retention adakv:budget=256,high=96 --kv-dtype int8+int4 --batch "$tmp/one.jsonl" --out "$tmp/tier_$tag"
      [ "$rc" -eq 0 ] || fail "two tiers ($grid): exit $rc"
      m="$tmp/tier_$tag/doc/manifest.json"
      grep -q '"format_version":6' "$m" && grep -q '"kv_dtype_low":"int4"' "$m" || fail "two tiers ($grid): manifest"
      ls "$tmp/tier_$tag/doc" | grep -q '^layer_029.*\.low\.safetensors$' || fail "two tiers ($grid): no low-tier shard"
      grep -q '"kv_dtype": "int8+int4"' "$tmp/tier_$tag/doc.json" || fail "two tiers ($grid): summary"
      "$decoder" --model default --kv "$tmp/tier_$tag/doc" --tokens 12 >"$tmp/dec_tier_$tag" 2>&1 || { cat "$tmp/dec_tier_$tag"; fail "decode of two tiers ($grid)"; }
      grep -q "K/V stored as int8+int4" "$tmp/dec_tier_$tag" || fail "two tiers ($grid): decode does not say int8+int4"
      grep '^tokens:' "$tmp/dec_tier_$tag" >"$tmp/tok_tier_$tag"
    done
    ls "$tmp/tier_np2_sharded/doc" | grep -q '^layer_029\.r1\.h[0-9]\.low\.safetensors$' || fail "two tiers: rank 1 wrote no low-tier part"
    [ -s "$tmp/tok_tier_np2_sharded" ] && cmp -s "$tmp/tok_tier_np2_sharded" "$tmp/tok_tier_np2_gathered" \
      || fail "two tiers: sharded and gathered exports decode differently"
    # high= without a two-tier encoding (and the reverse) is a bad line, caught before the prefill.
    run 1 --model default --export gathered --retention adakv:budget=256,high=96 --batch "$tmp/one.jsonl" --out "$tmp/tier_mis"
    [ "$rc" -eq 3 ] || fail "high= without HIGH+LOW: exit $rc, want 3"
    grep -q "one.jsonl:1: a retention with high= needs a two-tier kv_dtype (HIGH+LOW)" "$tmp/stderr" \
      || fail "high= without HIGH+LOW: message"
    # TP 3 x CP 2: each TP rank cuts and moves the rows of its own KV head. CP 4 with 100 kept
    # tokens a head: chunks of ~66 tokens keep fewer than a block each, so runs are empty and a
    # block gathers rows from several chunks (and ranks).
    # The last grid: two tiers over CP 4, each tier's runs cut and moved on their own.
    for grid in "6 --tp 3 --cp 2 --retention adakv:budget=128,span=4" "4 --cp 4 --retention adakv:budget=100,span=4" \
                "4 --cp 4 --retention adakv:budget=160,high=72,span=4 --kv-dtype int8+int4"; do
      set -- $grid
      np="$1"; shift
      tag="np$np"
      [[ "$grid" == *int8+int4* ]] && tag="np${np}t"
      for mode in sharded gathered; do
        run "$np" --model default "$@" --export "$mode" --batch "$tmp/one.jsonl" --out "$tmp/${tag}_$mode"
        [ "$rc" -eq 0 ] || fail "$grid $mode: exit $rc"
        "$decoder" --model default --kv "$tmp/${tag}_$mode/doc" --tokens 12 2>&1 | grep '^tokens:' >"$tmp/tok_${tag}_$mode"
      done
      python3 -c 'import json,sys; a,b=(json.load(open(f))["retention"] for f in sys.argv[1:]); sys.exit(a!=b or a["policy"]!="adakv")' \
        "$tmp/${tag}_sharded/doc/manifest.json" "$tmp/${tag}_gathered/doc/manifest.json" || fail "$grid: kept positions differ"
      [ -s "$tmp/tok_${tag}_sharded" ] && cmp -s "$tmp/tok_${tag}_sharded" "$tmp/tok_${tag}_gathered" || fail "$grid: sharded and gathered decode differently"
    done
    ls "$tmp/np4_sharded/doc" | grep -q '\.r3\.h' || fail "cp 4: rank 3 wrote no part"
    run 2 --model default --cp 2 --retention bogus --batch "$tmp/ret.jsonl" --out "$tmp/out_b"
    [ "$rc" -eq 2 ] || fail "--retention bogus: exit $rc, want 2"
    errors | grep -q "^error: --retention: " || fail "--retention message"
    ;;
  overlap)
    # --export-overlap on (the default) and off, each prefill slowed on rank 0 (60 ms a layer) and
    # each gathered export as much (one layer at a time): the same files either way; with the
    # overlap each export but the last hides behind the next request's prefill.
    mkdir -p "$tmp/metrics"
    for mode in on off; do
      SF_WORKER_FAULT=slow_all:0:60 run 2 --model default --cp 2 --export gathered --export-overlap "$mode" \
        --batch "$tmp/prompts.jsonl" --out "$tmp/out_$mode" --metrics-file "$tmp/metrics/$mode.prom"
      [ "$rc" -eq 3 ] || fail "overlap $mode: exit $rc, want 3 (the batch's bad lines)"
      grep -q "batch done: 4 written, 0 already complete, 0 failed, 5 bad lines" "$tmp/stdout" || fail "overlap $mode: summary"
      eval "ms_$mode=$ms"
      waited=$(grep -ho '"export_wait_s": [0-9.]*' "$tmp/out_$mode"/*.json | awk '{ s += $2 } END { printf "%.6f", s }')
      eval "wait_$mode=$waited"
      # Each summary's wait is part of its export (up to the waiting thread's wake-up, 50 ms on
      # a loaded box); the metrics counter adds the waits up.
      for j in "$tmp/out_$mode"/*.json; do
        awk '{ match($0, /"export_s": [0-9.]+/); e = substr($0, RSTART + 12, RLENGTH - 12);
               match($0, /"export_wait_s": [0-9.]+/); w = substr($0, RSTART + 17, RLENGTH - 17);
               exit !(e >= 30 * 0.06 && w >= 0 && w <= e + 0.05) }' "$j" || fail "overlap $mode: $j: export_s / export_wait_s"
      done
      counter=$(sed 's/,out="[^"]*"//' "$tmp/metrics/$mode.prom" | awk '$1 == "sparsefill_worker_export_wait_seconds_total{group=\"0\"}" { print $2 }')
      awk -v a="$counter" -v b="$waited" 'BEGIN { exit !(a - b < 0.001 && b - a < 0.001) }' || fail "overlap $mode: metrics wait $counter, summaries $waited"
    done
    for id in lighthouse ids village canal; do
      [ "$(ls "$tmp/out_on/$id")" = "$(ls "$tmp/out_off/$id")" ] || fail "$id: other files with the overlap"
      for f in "$tmp/out_on/$id"/*; do
        cmp -s "$f" "$tmp/out_off/$id/$(basename "$f")" || fail "$id: $(basename "$f") differs with the overlap"
      done
    done
    # Off, the batch waits for every export (4 x 30 x 60 ms at least); on, for about the last one.
    awk -v on="$wait_on" -v off="$wait_off" 'BEGIN { exit !(off >= 4 * 30 * 0.06 && on < 0.5 * off) }' \
      || fail "export waits: $wait_on s with the overlap, $wait_off s without"
    # (The jobs' wall times are printed, not compared: their start-up, model load and MPI
    # wire-up, varies by seconds when other tests share the two cores.)
    # Sharded exports (each rank writing its own shards on its own thread; with a retention,
    # rows moved between ranks first): the same files too. Two ~530-token prompts, so both ranks
    # hold rows of each.
    two_long_prompts
    for mode in on off; do
      run 2 --model default --cp 2 --retention snapkv:budget=128 --export-overlap "$mode" --batch "$tmp/long.jsonl" --out "$tmp/sh_$mode"
      [ "$rc" -eq 0 ] || fail "sharded overlap $mode: exit $rc"
    done
    # Three shard files at once (--export-threads; the CPU's overlapped default is one): the same
    # files again.
    run 2 --model default --cp 2 --retention snapkv:budget=128 --export-threads 3 --batch "$tmp/long.jsonl" --out "$tmp/sh_t3"
    [ "$rc" -eq 0 ] || fail "--export-threads 3: exit $rc"
    for id in doc1 doc2; do
      [ "$(ls "$tmp/sh_on/$id")" = "$(ls "$tmp/sh_off/$id")" ] && ls "$tmp/sh_on/$id" | grep -q '\.r1\.' || fail "$id: sharded files"
      for f in "$tmp/sh_on/$id"/*; do
        cmp -s "$f" "$tmp/sh_off/$id/$(basename "$f")" || fail "$id: sharded $(basename "$f") differs with the overlap"
        cmp -s "$f" "$tmp/sh_t3/$id/$(basename "$f")" || fail "$id: sharded $(basename "$f") differs with --export-threads 3"
      done
    done
    run 1 --model default --export-threads 65 --batch "$tmp/long.jsonl" --out "$tmp/sh_bad"
    [ "$rc" -eq 2 ] && grep -q "^error: --export-threads must be in \[1, 64\], got 65" "$tmp/stderr" || fail "--export-threads 65: exit $rc"
    run 1 --model default --kv-staging-layers -1 --batch "$tmp/long.jsonl" --out "$tmp/sh_bad"
    [ "$rc" -eq 2 ] && grep -q "^error: --kv-staging-layers must be in \[0, 4096\], got -1" "$tmp/stderr" || fail "--kv-staging-layers -1: exit $rc"
    run 1 --model default --kv-staging-max-gib -1 --batch "$tmp/long.jsonl" --out "$tmp/sh_bad"
    [ "$rc" -eq 2 ] && grep -q "^error: --kv-staging-max-gib: '-1' is not a number in \[0, 65536\]" "$tmp/stderr" || fail "--kv-staging-max-gib -1: exit $rc"
    # A request that fails (rank 1, after its prefill) while the one before it is being written:
    # that export completes, the rest go on. A second run then computes only the failed one
    # while skipping complete ones with its export pending.
    SF_WORKER_FAULT=fail_nth:1:2 run 2 --model default --cp 2 --batch "$tmp/prompts.jsonl" --out "$tmp/fail"
    [ "$rc" -eq 3 ] || fail "fail_nth: exit $rc, want 3"
    grep -q "batch done: 3 written, 0 already complete, 1 failed" "$tmp/stdout" || fail "fail_nth: summary"
    grep -q "request 'ids' failed: fault injection: rank 1 fails the request after its prefill" "$tmp/stderr" || fail "fail_nth: message"
    [ -f "$tmp/fail/lighthouse/manifest.json" ] && [ -f "$tmp/fail/lighthouse.json" ] && [ ! -e "$tmp/fail/ids" ] || fail "fail_nth: outputs $(ls "$tmp/fail")"
    run 2 --model default --cp 2 --batch "$tmp/prompts.jsonl" --out "$tmp/fail"
    [ "$rc" -eq 3 ] || fail "fail_nth resume: exit $rc, want 3"
    grep -q "batch done: 1 written, 3 already complete, 0 failed" "$tmp/stdout" || fail "fail_nth resume: summary"
    for id in lighthouse ids village canal; do
      [ -f "$tmp/fail/$id/manifest.json" ] && ls "$tmp/fail/$id"/layer_029.r*.safetensors >/dev/null 2>&1 \
        || fail "fail_nth resume: $id's export: $(ls "$tmp/fail/$id")"
    done
    # A rank short of host memory for the next request's KV: the pending export finishes before
    # that prefill (said once a request), and the files are still the same.
    SF_WORKER_FAULT=low_memory:1 run 2 --model default --cp 2 --retention snapkv:budget=128 --batch "$tmp/long.jsonl" --out "$tmp/sh_low"
    [ "$rc" -eq 0 ] || fail "low memory: exit $rc"
    [ "$(grep -c "doc2: .* GB of KV to compute on this host, and a host of the group is short of memory for it beside doc1's: it waits as that export frees its K/V$" "$tmp/stdout")" -eq 1 ] \
      || fail "low memory: want one line saying doc2 waits for doc1's export"
    ! grep -q "doc2: starts with" "$tmp/stdout" || fail "low memory: doc2 started beside doc1's export"
    for id in doc1 doc2; do
      for f in "$tmp/sh_off/$id"/*; do
        cmp -s "$f" "$tmp/sh_low/$id/$(basename "$f")" || fail "low memory: $id: $(basename "$f") differs"
      done
    done
    # A rank with no host memory for any request's KV: each request fails before its prefill,
    # with the need and the way out named, and the job goes on to the end; without the check
    # the same job writes both.
    SF_WORKER_FAULT=no_memory:1 run 2 --model default --cp 2 --batch "$tmp/long.jsonl" --out "$tmp/sh_nomem"
    [ "$rc" -eq 3 ] || fail "no memory: exit $rc, want 3"
    grep -q "batch done: 0 written, 0 already complete, 2 failed" "$tmp/stdout" || fail "no memory: summary"
    [ "$(grep -c "request 'doc[12]' failed: its KV needs [0-9.]* [kMG]B of host memory for the 2 rank(s) on the leader's host, and a host of the group can give 0 B (0.8 of its available memory); --dry-run prints each request's need, --host-memory-check off skips this check" "$tmp/stderr")" -eq 2 ] \
      || fail "no memory: want both requests' reason"
    [ ! -e "$tmp/sh_nomem/doc1" ] && [ ! -e "$tmp/sh_nomem/doc2" ] || fail "no memory: outputs $(ls "$tmp/sh_nomem")"
    SF_WORKER_FAULT=no_memory:1 run 2 --model default --cp 2 --host-memory-check off --batch "$tmp/long.jsonl" --out "$tmp/sh_nomem"
    [ "$rc" -eq 0 ] && grep -q "batch done: 2 written, 0 already complete, 0 failed" "$tmp/stdout" || fail "no memory, check off: exit $rc"
    run 1 --model default --host-memory-check maybe --batch "$tmp/long.jsonl" --out "$tmp/bad"
    [ "$rc" -eq 2 ] && grep -q "^error: --host-memory-check must be on or off, got 'maybe'" "$tmp/stderr" || fail "--host-memory-check maybe: exit $rc"
    run 2 --model default --cp 2 --export-overlap maybe --batch "$tmp/prompts.jsonl" --out "$tmp/bad"
    [ "$rc" -eq 2 ] || fail "--export-overlap maybe: exit $rc, want 2"
    errors | grep -q "^error: --export-overlap must be on or off, got 'maybe'" || fail "--export-overlap message"
    echo "overlap: $ms_on ms (waited $wait_on s) against $ms_off ms (waited $wait_off s)"
    ;;
  freeing)
    # np 2, CP 2, the two long prompts: an export frees each layer's host K/V as its files are
    # written, and a request that did not fit beside the whole export starts once enough is gone.
    # The freeing fault: rank 0's export sleeps 50 ms after each layer it frees, and that rank has
    # room once half of doc1's K/V is freed; so doc2 starts before doc1's export ends (some layers
    # still held), and the files are those of a run without the overlap.
    two_long_prompts
    mkdir -p "$tmp/metrics"
    # started_early WHAT: doc2 started with 1 to 15 of doc1's 30 layers held on rank 0.
    started_early() {
      local left
      left=$(sed -n "s/.*doc2: starts with \([0-9]*\) of doc1's 30 layers of K\/V not yet freed here, after .*/\1/p" "$tmp/stdout")
      [ -n "$left" ] && [ "$left" -gt 0 ] && [ "$left" -le 15 ] || fail "$1: doc2 started with '$left' of 30 layers held ($(grep 'doc2' "$tmp/stdout"))"
      echo "$1: doc2 started with $left of doc1's 30 layers held on rank 0"
    }
    # Full retention.
    run 2 --model default --cp 2 --export-overlap off --batch "$tmp/long.jsonl" --out "$tmp/full_off"
    [ "$rc" -eq 0 ] || fail "full retention, overlap off: exit $rc"
    SF_WORKER_FAULT=freeing:0:50 run 2 --model default --cp 2 --batch "$tmp/long.jsonl" --out "$tmp/full_free" --metrics-file "$tmp/metrics/free.prom"
    [ "$rc" -eq 0 ] || fail "freeing: exit $rc"
    grep -q "doc2: .* short of memory for it beside doc1's: it waits as that export frees its K/V$" "$tmp/stdout" || fail "freeing: no wait line"
    started_early freeing
    same_files "$tmp/full_off" "$tmp/full_free" freeing
    # The wait is doc2's (its summary's memory_wait_s, over the 100 ms a re-check sleeps), not
    # doc1's, and the metrics counter adds it up.
    w1=$(grep -o '"memory_wait_s": [0-9.]*' "$tmp/full_free/doc1.json" | awk '{ print $2 }')
    w2=$(grep -o '"memory_wait_s": [0-9.]*' "$tmp/full_free/doc2.json" | awk '{ print $2 }')
    awk -v a="$w1" -v b="$w2" 'BEGIN { exit !(a == 0 && b > 0.1) }' || fail "freeing: memory_wait_s doc1 '$w1', doc2 '$w2'"
    counter=$(sed 's/,out="[^"]*"//' "$tmp/metrics/free.prom" | awk '$1 == "sparsefill_worker_memory_wait_seconds_total{group=\"0\"}" { print $2 }')
    awk -v a="$counter" -v b="$w2" 'BEGIN { exit !(a - b < 0.001 && b - a < 0.001) }' || fail "freeing: metrics memory wait '$counter', summary '$w2'"
    # A retention (snapkv: (layer, KV head) parts, rows moved between ranks), then two tiers
    # (int8 + int4, each tier's parts written in turn): a layer goes once all its parts are
    # written.
    for ret in "snapkv:budget=128" "snapkv:budget=128,high=64 --kv-dtype int8+int4"; do
      # shellcheck disable=SC2086  # $ret carries a flag and its value
      run 2 --model default --cp 2 --retention $ret --export-overlap off --batch "$tmp/long.jsonl" --out "$tmp/ret_off"
      [ "$rc" -eq 0 ] || fail "$ret, overlap off: exit $rc"
      # shellcheck disable=SC2086
      SF_WORKER_FAULT=freeing:0:50 run 2 --model default --cp 2 --retention $ret --batch "$tmp/long.jsonl" --out "$tmp/ret_free"
      [ "$rc" -eq 0 ] || fail "freeing, $ret: exit $rc"
      started_early "freeing, $ret"
      same_files "$tmp/ret_off" "$tmp/ret_free" "freeing, $ret"
      rm -rf "$tmp/ret_off" "$tmp/ret_free"
    done
    # SF_WAIT_WHOLE_EXPORT=1 (the A/B switch): the whole export first, as before, said so; the
    # same files.
    SF_WAIT_WHOLE_EXPORT=1 SF_WORKER_FAULT=freeing:0:50 run 2 --model default --cp 2 --batch "$tmp/long.jsonl" --out "$tmp/whole"
    [ "$rc" -eq 0 ] && ! grep -q "doc2: starts with" "$tmp/stdout" || fail "SF_WAIT_WHOLE_EXPORT=1: exit $rc, or doc2 started beside doc1's export"
    grep -q "doc2: .* short of memory for it beside doc1's: that export finishes first$" "$tmp/stdout" || fail "SF_WAIT_WHOLE_EXPORT=1: no line saying doc1's export finishes first"
    same_files "$tmp/full_off" "$tmp/whole" "SF_WAIT_WHOLE_EXPORT=1"
    ;;
  stream)
    two_long_prompts
    run 2 --model default --cp 2 --export-stream off --batch "$tmp/long.jsonl" --out "$tmp/off"
    [ "$rc" -eq 0 ] || fail "off: exit $rc"
    # Rank 0's prefill sleeps 60 ms a layer: its export writes each layer while later ones run.
    SF_WORKER_FAULT=slow:0:60 run 2 --model default --cp 2 --export-stream on --batch "$tmp/long.jsonl" --out "$tmp/on"
    [ "$rc" -eq 0 ] || fail "on: exit $rc"
    same_files "$tmp/off" "$tmp/on" "--export-stream on"
    for id in doc1 doc2; do
      grep -q '"export_streamed": false, "export_layers_at_prefill_end": 0,' "$tmp/off/$id.json" || fail "off: $id's summary"
      grep -q '"export_streamed": true, ' "$tmp/on/$id.json" || fail "on: $id's summary says it was not streamed"
      n=$(grep -o '"export_layers_at_prefill_end": [0-9]*' "$tmp/on/$id.json" | awk '{ print $2 }')
      [ -n "$n" ] && [ "$n" -ge 5 ] && [ "$n" -le 30 ] || fail "on: $id: '$n' of 30 layers written when its prefill ended"
      echo "stream: $id: $n of 30 layers written here when its prefill ended"
    done
    # A request that fails after its prefill (rank 1, whose streamed export sleeps 1 s after each
    # layer, so it is still reading the prefill's rows then): its streamed export, files and all,
    # goes, and the writer stops at its next layer. Timed against the same failing job without
    # streaming (no export starts there): writing the rest out would add tens of seconds (about
    # 25 layers x 1 s a request); stopping adds at most a layer's sleep a request. A fixed bound
    # (12 s) failed on a slower 2-core machine, where the job alone took 12.5 s. Under an
    # SF_ASAN build this also catches rows freed under the writer (it did, before bf9a982).
    SF_WORKER_FAULT=fail_after:1:1000 run 2 --model default --cp 2 --export-stream off --batch "$tmp/long.jsonl" --out "$tmp/fail_off"
    [ "$rc" -eq 3 ] && grep -q "batch done: 0 written, 0 already complete, 2 failed" "$tmp/stdout" || fail "fail_after, off: exit $rc"
    ms_off=$ms
    SF_WORKER_FAULT=fail_after:1:1000 run 2 --model default --cp 2 --export-stream on --batch "$tmp/long.jsonl" --out "$tmp/fail"
    [ "$rc" -eq 3 ] && grep -q "batch done: 0 written, 0 already complete, 2 failed" "$tmp/stdout" || fail "fail_after: exit $rc"
    ! ls -a "$tmp/fail" | grep -q -e '^doc' -e 'partial' || fail "fail_after: left $(ls -a "$tmp/fail")"
    echo "stream: failing job $ms ms streamed, $ms_off ms without streaming"
    [ "$ms" -lt $((ms_off + 10000)) ] || fail "fail_after: the job took $ms ms against $ms_off without streaming: the failed exports were written out"
    # Not streamable (a retention's cut needs the whole prefill; a gathered export is the
    # leader's after the gather): written after the prefill, as with off.
    run 2 --model default --cp 2 --export-stream on --retention snapkv:budget=128 --batch "$tmp/long.jsonl" --out "$tmp/ret"
    [ "$rc" -eq 0 ] && grep -q '"export_streamed": false, ' "$tmp/ret/doc1.json" || fail "snapkv: exit $rc or streamed"
    run 2 --model default --cp 2 --export-stream on --export gathered --batch "$tmp/long.jsonl" --out "$tmp/gath"
    [ "$rc" -eq 0 ] && grep -q '"export_streamed": false, ' "$tmp/gath/doc1.json" || fail "gathered: exit $rc or streamed"
    run 1 --model default --export-stream maybe --batch "$tmp/long.jsonl" --out "$tmp/bad"
    [ "$rc" -eq 2 ] && grep -q "^error: --export-stream must be auto, on or off, got 'maybe'" "$tmp/stderr" || fail "--export-stream maybe: exit $rc"
    ;;
  dry_run)
    # The plan: bad lines as a run reports them, a line per good request with its group and
    # status, the totals; no prefill, and --out is not even created.
    run 4 --model default --cp 2 --dry-run --batch "$tmp/prompts.jsonl" --out "$tmp/out"
    [ "$rc" -eq 3 ] || fail "dry run: exit $rc, want 3 (bad lines)"
    [ "$(grep -c '; skipped$' "$tmp/stderr")" -eq 5 ] || fail "dry run: want 5 bad lines reported"
    [ ! -e "$tmp/out" ] || fail "dry run: --out was created"
    ! grep -q "first token" "$tmp/stdout" || fail "dry run: a request ran"
    # 7 tokens x 30 layers x 3 KV heads x 64 x (K, V) x 4 bytes = 322,560; a rank holds 4 rows
    # of them (184,320) and, on the CPU, one layer's whole-prompt K/V twice (21,504).
    grep -q "^plan: lighthouse (line 1): 7 tokens, group 0, to compute; K/V 323 kB in f32, host KV 206 kB a rank in f32$" "$tmp/stdout" || fail "dry run: lighthouse's line"
    grep -q "^plan: ids (line 2): 8 tokens, group 1, to compute;" "$tmp/stdout" || fail "dry run: ids's line"
    grep -q "^plan: 4 of 4 requests to compute (48 tokens), K/V to write at most 2.21 MB; peak host KV a rank .* (--export-overlap on), 4 rank(s) on this host: .* of its .* available$" "$tmp/stdout" \
      || fail "dry run: totals"
    peak_on=$(sed -n 's/.*peak host KV a rank \(.*\) (--export-overlap on).*/\1/p' "$tmp/stdout")
    run 4 --model default --cp 2 --dry-run --export-overlap off --batch "$tmp/prompts.jsonl" --out "$tmp/out"
    peak_off=$(sed -n 's/.*peak host KV a rank \(.*\) (--export-overlap off).*/\1/p' "$tmp/stdout")
    [ -n "$peak_on" ] && [ -n "$peak_off" ] && [ "$peak_on" != "$peak_off" ] || fail "dry run: peak $peak_on with the overlap, $peak_off without"
    # --device cuda (planned only, no GPU needed): the pinned K/V ring, sized for the largest
    # request (village, 18 tokens, under 2 x CP x 64, so each CP rank computes all of it: 18 rows
    # x 3 KV heads x 64 x (K, V) x 4 bytes = 27,648 a layer): 2 slots, then one for each of the
    # 30 layers; and lighthouse's host KV is its 7 tokens whole (7 x 30 x 3 x 64 x 2 x 4).
    run 4 --model default --cp 2 --device cuda --kv-staging-layers 2 --kv-host-dtype f32 --dry-run --batch "$tmp/prompts.jsonl" --out "$tmp/out"
    grep -q "(--export-overlap on), and 55.3 kB of pinned K/V staging (--kv-staging-layers 2, --kv-staging-max-gib 8), 4 rank(s) on this host" "$tmp/stdout" || fail "dry run: staging 2 ($(grep '^plan: 4 of' "$tmp/stdout"))"
    grep -q "^plan: lighthouse (line 1): 7 tokens, group 0, to compute; K/V 161 kB in bf16, host KV 323 kB a rank in f32$" "$tmp/stdout" || fail "dry run: cuda lighthouse ($(grep '^plan: lighthouse' "$tmp/stdout"))"
    # --kv-host-dtype bf16: half of both (161,280 bytes of host KV; 27,648 / 2 a slot).
    run 4 --model default --cp 2 --device cuda --kv-staging-layers 2 --kv-host-dtype bf16 --dry-run --batch "$tmp/prompts.jsonl" --out "$tmp/out"
    grep -q "(--export-overlap on), and 27.6 kB of pinned K/V staging (--kv-staging-layers 2, --kv-staging-max-gib 8), 4 rank(s) on this host" "$tmp/stdout" || fail "dry run: bf16 staging ($(grep '^plan: 4 of' "$tmp/stdout"))"
    grep -q "^plan: lighthouse (line 1): 7 tokens, group 0, to compute; K/V 161 kB in bf16, host KV 161 kB a rank in bf16$" "$tmp/stdout" || fail "dry run: bf16 host KV ($(grep '^plan: lighthouse' "$tmp/stdout"))"
    # auto (the default): bf16 when every export of the job is plain bf16 (--kv-dtype auto is bf16
    # on the device), f32 for a quantized or f32 job, or when one line's own kv_dtype is.
    run 4 --model default --cp 2 --device cuda --kv-staging-layers 2 --dry-run --batch "$tmp/prompts.jsonl" --out "$tmp/out"
    grep -q "^plan: lighthouse (line 1): 7 tokens, group 0, to compute; K/V 161 kB in bf16, host KV 161 kB a rank in bf16$" "$tmp/stdout" || fail "dry run: auto, bf16 exports ($(grep '^plan: lighthouse' "$tmp/stdout"))"
    run 4 --model default --cp 2 --device cuda --kv-dtype int8 --dry-run --batch "$tmp/prompts.jsonl" --out "$tmp/out"
    grep -q "^plan: lighthouse (line 1): 7 tokens, group 0, to compute; K/V .* in int8, host KV 323 kB a rank in f32$" "$tmp/stdout" || fail "dry run: auto, int8 exports ($(grep '^plan: lighthouse' "$tmp/stdout"))"
    { head -n 2 "$tmp/prompts.jsonl"; echo '{"id": "own", "prompt": "a line of its own dtype", "kv_dtype": "f32"}'; } >"$tmp/own.jsonl"
    run 4 --model default --cp 2 --device cuda --dry-run --batch "$tmp/own.jsonl" --out "$tmp/out"
    grep -q "^plan: lighthouse (line 1): 7 tokens, group 0, to compute; K/V 161 kB in bf16, host KV 323 kB a rank in f32$" "$tmp/stdout" || fail "dry run: auto, an f32 line ($(grep '^plan: lighthouse' "$tmp/stdout"))"
    run 4 --model default --cp 2 --dry-run --batch "$tmp/prompts.jsonl" --out "$tmp/out"
    grep -q "^plan: lighthouse (line 1): 7 tokens, group 0, to compute; K/V 323 kB in f32, host KV 206 kB a rank in f32$" "$tmp/stdout" || fail "dry run: auto on the CPU ($(grep '^plan: lighthouse' "$tmp/stdout"))"
    # ... on the device only, and not for an f32 export.
    run 4 --model default --cp 2 --device cuda --kv-host-dtype bf16 --kv-dtype f32 --dry-run --batch "$tmp/prompts.jsonl" --out "$tmp/out"
    [ "$rc" -eq 2 ] && grep -q "^error: --kv-host-dtype bf16 keeps bf16 values: an f32 export (--kv-dtype) needs --kv-host-dtype f32" "$tmp/stderr" || fail "--kv-host-dtype bf16 --kv-dtype f32: exit $rc"
    run 1 --model default --kv-host-dtype bf16 --batch "$tmp/prompts.jsonl" --out "$tmp/out"
    [ "$rc" -eq 2 ] && grep -q "^error: --kv-host-dtype bf16 is the device prefill's" "$tmp/stderr" || fail "--kv-host-dtype bf16 on the CPU: exit $rc"
    run 1 --model default --kv-host-dtype f16 --batch "$tmp/prompts.jsonl" --out "$tmp/out"
    [ "$rc" -eq 2 ] && grep -q "^error: --kv-host-dtype must be auto, f32 or bf16, got 'f16'" "$tmp/stderr" || fail "--kv-host-dtype f16: exit $rc"
    run 4 --model default --cp 2 --device cuda --kv-host-dtype f32 --kv-staging-layers 0 --dry-run --batch "$tmp/prompts.jsonl" --out "$tmp/out"
    grep -q "and 829 kB of pinned K/V staging (--kv-staging-layers 0, --kv-staging-max-gib 8)" "$tmp/stdout" || fail "dry run: staging 0 ($(grep '^plan: 4 of' "$tmp/stdout"))"
    # A byte cap on the ring (model::kv_staging_slots): 0.0001 GiB (107,374 bytes) holds 3 of
    # village's slots of 27,648 bytes (82,944) but 4 of a 16-token request's 24,576 (98,304, the
    # largest plan); a cap below two slots still gets two (village's 55,296).
    run 4 --model default --cp 2 --device cuda --kv-host-dtype f32 --kv-staging-max-gib 0.0001 --dry-run --batch "$tmp/prompts.jsonl" --out "$tmp/out"
    grep -q "and 98.3 kB of pinned K/V staging (--kv-staging-layers 8, --kv-staging-max-gib 0.0001)" "$tmp/stdout" || fail "dry run: staging cap 3 slots ($(grep '^plan: 4 of' "$tmp/stdout"))"
    run 4 --model default --cp 2 --device cuda --kv-host-dtype f32 --kv-staging-max-gib 0.00000001 --dry-run --batch "$tmp/prompts.jsonl" --out "$tmp/out"
    grep -q "and 55.3 kB of pinned K/V staging (--kv-staging-layers 8, --kv-staging-max-gib 1e-08)" "$tmp/stdout" || fail "dry run: staging cap floor ($(grep '^plan: 4 of' "$tmp/stdout"))"
    # A host with no memory to spare (the no_memory fault on rank 0, which prints the plan): each
    # request to compute is marked as one a run's host check fails, and the totals say how many;
    # with the check off, none is.
    SF_WORKER_FAULT=no_memory:0 run 4 --model default --cp 2 --dry-run --batch "$tmp/prompts.jsonl" --out "$tmp/out"
    [ "$(grep -c "a rank in f32; more than this host's memory allows now: a run would fail it (--host-memory-check)$" "$tmp/stdout")" -eq 4 ] || fail "dry run, no memory: want 4 marked requests"
    grep -q "^plan: 4 request(s) need more host memory than this host can give now (0.8 of its available memory, for its 4 rank(s)); a run fails them before their prefills" "$tmp/stdout" || fail "dry run, no memory: totals"
    SF_WORKER_FAULT=no_memory:0 run 4 --model default --cp 2 --dry-run --host-memory-check off --batch "$tmp/prompts.jsonl" --out "$tmp/out"
    ! grep -q "more than this host's memory\|need more host memory" "$tmp/stdout" || fail "dry run, no memory, check off: a request was marked"
    # The host check counts what each rank holds: with --export gathered at CP 4 the leader holds
    # the whole cache and the other three only the forward's two whole-prompt layers. lighthouse
    # (7 tokens): 7 x 30 layers x 3 KV heads x 512 bytes = 322,560, plus 2 x 7 x 3 x 512 = 21,504
    # on every rank: 344,064 + 3 x 21,504 = 408,576 (x 1.25 = 510,720); ids (8 tokens) 466,944
    # (583,680); village (18 tokens) 1,050,624. With 600,000 bytes available the first two fit
    # and village does not (counting the whole cache on all four ranks, lighthouse would not).
    SF_WORKER_FAULT=memory:0:600000 run 4 --model default --cp 4 --export gathered --dry-run --batch "$tmp/prompts.jsonl" --out "$tmp/out"
    grep -q "^plan: lighthouse (line 1): 7 tokens, group 0, to compute; .* a rank in f32$" "$tmp/stdout" || fail "dry run, gathered: lighthouse was marked"
    grep -q "^plan: ids (line 2): 8 tokens, group 0, to compute; .* a rank in f32$" "$tmp/stdout" || fail "dry run, gathered: ids was marked"
    grep -q "^plan: village (line 6): 18 tokens, .*: a run would fail it (--host-memory-check)$" "$tmp/stdout" || fail "dry run, gathered: village was not marked"
    SF_WORKER_FAULT=memory:0:510719 run 4 --model default --cp 4 --export gathered --dry-run --batch "$tmp/prompts.jsonl" --out "$tmp/out"
    grep -q "^plan: lighthouse (line 1): .*: a run would fail it (--host-memory-check)$" "$tmp/stdout" || fail "dry run, gathered: lighthouse one byte short was not marked"
    # After a run, with one summary removed: the plan says what a resume would do.
    run 4 --model default --cp 2 --batch "$tmp/prompts.jsonl" --out "$tmp/out"
    [ "$rc" -eq 3 ] || fail "real run: exit $rc"
    rm -f "$tmp/out/village.json"
    run 4 --model default --cp 2 --dry-run --batch "$tmp/prompts.jsonl" --out "$tmp/out"
    grep -q "^plan: lighthouse (line 1): 7 tokens, group 0, complete, a run skips it;" "$tmp/stdout" || fail "dry run after a run: lighthouse"
    grep -q "^plan: village (line 6): 18 tokens, group 0, to compute again (its export has no summary with a fingerprint);" "$tmp/stdout" || fail "dry run after a run: village"
    grep -q "^plan: 1 of 4 requests to compute (18 tokens)" "$tmp/stdout" || fail "dry run after a run: totals"
    [ -f "$tmp/out/village/manifest.json" ] || fail "dry run: it touched village's export"
    ;;
  *) echo "unknown case $case_name"; exit 2 ;;
esac
echo "ok ($case_name): exit $rc in $ms ms"
