#!/usr/bin/env bash
# Deterministic mode's tests under every CPU kernel path this machine has: the default kernels, MKL and oneDNN capped
# to AVX2 (and to AVX-512 / AMX where the CPU has them), torch's own kernels capped to AVX2, the invariant kernels'
# AVX2 and scalar builds (on AMX also its AVX512_BF16 path), and one torch thread. The tests themselves run 1 and 2
# threads where thread counts matter.
# Usage: bash scripts/test_deterministic.sh [pytest args]   (after scripts/bootstrap.sh; scripts/test.sh calls it)
set -uo pipefail
cd "$(dirname "$0")/.."
TESTS=(
  tests/kernels/test_kernels_batch_invariant.py
  tests/kernels/test_kernels_invariant.py
  tests/kernels/test_kernels_paged_attention_invariant.py
  tests/services/rollout/test_rollout_batching.py
  tests/services/rollout/test_rollout_kl.py
)
flags=$(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null || true)
has() { [[ " $flags " == *" $1 "* ]]; }
# torch's kernels capped to AVX2: on a CPU with AMX oneDNN too, as on a real AVX2 machine (torch's bf16 CPU flash
# attention otherwise takes oneDNN's AMX path and refuses: "pack_vnni2 is only supported when avx512 is supported").
aten_avx2="ATEN_CPU_CAPABILITY=avx2"
if has amx_tile; then aten_avx2="ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2"; fi
CAPS=("" "MKL_ENABLE_INSTRUCTIONS=AVX2" "ONEDNN_MAX_CPU_ISA=AVX2" "$aten_avx2"
      "TRAINYARD_INVARIANT_ISA=scalar" "OMP_NUM_THREADS=1")
if has avx2 && has fma; then CAPS+=("TRAINYARD_INVARIANT_ISA=avx2"); fi
if has avx512f; then CAPS+=("MKL_ENABLE_INSTRUCTIONS=AVX512" "ONEDNN_MAX_CPU_ISA=AVX512_CORE"); fi
if has amx_tile; then CAPS+=("ONEDNN_MAX_CPU_ISA=AVX512_CORE_AMX" "TRAINYARD_INVARIANT_AMX=0"); fi
failed=()
for cap in "${CAPS[@]}"; do
  echo "=== deterministic-mode tests, kernel path: ${cap:-default kernels}"
  # shellcheck disable=SC2086
  env $cap .venv/bin/python -m pytest -p no:cacheprovider "${TESTS[@]}" "$@"
  rc=$?
  if [ "$rc" -ne 0 ]; then failed+=("${cap:-default} (pytest exit $rc)"); fi
done
if [ "${#failed[@]}" -gt 0 ]; then
  echo "deterministic-mode tests failed under: ${failed[*]}" >&2
  exit 1
fi
echo "deterministic-mode tests passed under ${#CAPS[@]} kernel paths"
