#!/usr/bin/env bash
# Nsight Compute source-level (SASS) stall sampling of one kernel launch on a GPU host, after
# bench/gpu/run.sh has built build-gpu: where in the kernel the warps wait. Writes
# $OUT/ncu-source-top.txt (the 60 SASS lines with the most stall samples, with their line numbers)
# and $OUT/ncu-source.csv (every line: samples, instructions executed).
#   OUT=... SF_PROFILE_KERNELS=block_select SF_PROFILE_LENGTH=131072 \
#     SF_PROFILE_MODE=block-sparse bench/gpu/profile_source.sh
# SF_PROFILE_DECODE="ARGS" profiles sf_bench_decode ARGS instead of the attention benchmark (e.g.
# SF_PROFILE_KERNELS=psa_kernel SF_PROFILE_DECODE="131072 32 8 128 1.0 f32"). SF_PROFILE_VIEW=cuda
# ranks CUDA source lines instead of SASS lines (build with -DCMAKE_CUDA_FLAGS=-lineinfo).
# SF_PROFILE_SKIP: matching launches to skip before the profiled one (default 0).
set -uo pipefail
root="$(pwd)"
# As in run.sh: the bench JSON these profiles embed names the commit the caller sent.
if [[ -z "${SF_SOURCE_COMMIT:-}" && -f "$root/.source-commit" ]]; then
  export SF_SOURCE_COMMIT="$(cat "$root/.source-commit")"
fi
out="${OUT:-$root/build-gpu/out}"
mkdir -p "$out"
source "$(dirname "${BASH_SOURCE[0]}")/find_ncu.sh"
if [[ -z "$ncu_bin" ]]; then
  echo "profile_source.sh: no ncu on this host" | tee "$out/ncu-source-top.txt"
  exit 2
fi
L="${SF_PROFILE_LENGTH:-131072}"
mode="${SF_PROFILE_MODE:-block-sparse}"
rep="$out/source.ncu-rep"
view="${SF_PROFILE_VIEW:-sass}"
if [[ -n "${SF_PROFILE_DECODE:-}" ]]; then
  # shellcheck disable=SC2206  # the arguments are words on purpose
  cmd=("$root/build-gpu/bench/sf_bench_decode" ${SF_PROFILE_DECODE})
  what="SF_PROFILE_DECODE='${SF_PROFILE_DECODE}'"
else
  cmd=("$root/build-gpu/tools/sparsefill" bench attention --lengths "$L" --sparse-lengths "$L"
       --modes "$mode" --dtypes bf16 --reps 1 --dense-ours-max 0 --host-estimate-max 0)
  what="SF_PROFILE_LENGTH=$L SF_PROFILE_MODE=$mode"
fi
timeout 500 "$ncu_bin" --kernel-name "regex:${SF_PROFILE_KERNELS:-block_select}" \
  --launch-skip "${SF_PROFILE_SKIP:-0}" --launch-count 1 \
  --section SourceCounters --section WarpStateStats --section SpeedOfLight -o "${rep%.ncu-rep}" -f \
  "${cmd[@]}" >"$out/ncu-source.log" 2>&1
print_source=sass
[[ "$view" == cuda ]] && print_source=cuda,sass  # cuda alone prints no metrics
"$ncu_bin" -i "$rep" --page source --csv --print-source "$print_source" >"$out/ncu-source.csv" \
  2>>"$out/ncu-source.log"
"$ncu_bin" -i "$rep" --page details >>"$out/ncu-source.log" 2>&1
rm -f "$rep"
{
  echo "# command: SF_PROFILE_KERNELS='${SF_PROFILE_KERNELS:-block_select}' $what SF_PROFILE_VIEW=$view bench/gpu/profile_source.sh"
  echo "# commit: ${SF_SOURCE_COMMIT:-$(git -C "$root" rev-parse HEAD 2>/dev/null)}; device: $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | head -1); date: $(date -u +%FT%TZ)"
} >"$out/ncu-source-top.txt"
python3 - "$out/ncu-source.csv" "$view" "${SF_PROFILE_FILE:-decode_attention.cu}" \
  >>"$out/ncu-source-top.txt" <<'PY'
import csv, sys
rows = list(csv.reader(open(sys.argv[1])))
view, ours = sys.argv[2], sys.argv[3]
def num(x):
    try:
        return float(x)
    except ValueError:
        return 0.0
if view != "cuda":
    head = next(i for i, r in enumerate(rows) if r and r[0] == "Address")
    hdr, data = rows[head], [r for r in rows[head + 1:] if len(rows[head]) == len(r)]
    si = next(i for i, h in enumerate(hdr) if h.startswith("Warp Stall Sampling (All"))
    ei = next(i for i, h in enumerate(hdr) if h.startswith("Instructions Executed"))
    tot = sum(num(r[si]) for r in data) or 1.0
    print(f"{rows[0][1] if rows[0] else ''}: {int(tot)} stall samples over {len(data)} SASS lines")
    top = sorted(range(len(data)), key=lambda k: -num(data[k][si]))[:60]
    for k in sorted(top):
        r = data[k]
        print(f"{k:6d} {100 * num(r[si]) / tot:5.1f}% {r[ei]:>12} {r[1].strip()}")
    sys.exit(0)
# cuda,sass: per file a "File Path" row, a header row, then each source line ("Line No" set)
# followed by its SASS rows (Address in column 2).
f = line = hdr = None
by_addr = {}
for r in rows:
    if not r or r[0] == "Function Name":
        continue
    if r[0] == "File Path":
        f = r[1].split("/")[-1]
        continue
    if r[0] == "Line No":
        hdr = r
        si = hdr.index("Warp Stall Sampling (All Samples)")
        continue
    if hdr is None or len(r) != len(hdr):
        continue
    if r[0] != "":
        line = (f, int(r[0]), r[1].strip()[:110])
        continue
    by_addr.setdefault(r[2], [num(r[si]), []])[1].append(line)
agg, tot = {}, 0.0
for s, lines in by_addr.values():
    mine = [l for l in lines if l[0] == ours]
    l = (mine or lines)[-1]
    agg[l] = agg.get(l, 0.0) + s
    tot += s
print(f"{int(tot)} stall samples over {len(by_addr)} SASS instructions, by CUDA line")
for k, v in sorted(agg.items(), key=lambda x: -x[1])[:40]:
    print(f"{100 * v / (tot or 1):5.1f}% {k[0]}:{k[1]}  {k[2]}")
PY
echo "profile_source.sh: wrote $out/ncu-source-top.txt"
