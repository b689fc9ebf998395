# Sourced by the profile scripts: sets ncu_bin to Nsight Compute's CLI (PATH first, then the
# CUDA toolkit's and standalone installs' usual places), or to "" when the host has none.
ncu_bin="$(command -v ncu || true)"
for c in /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/nsight-compute*/ncu; do
  [[ -z "$ncu_bin" && -x "$c" ]] && ncu_bin="$c"
done
