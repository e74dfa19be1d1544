#!/usr/bin/env bash
# Nsight Compute on one causal attention forward (GPT-2's B8 H12 S1024 D64 unless B H S D are
# given): torchfuse's per-tile and persistent sm 90 forwards beside stock's (cuDNN's fprop),
# pipe and instruction counts and stall reasons. The second of three calls is profiled.
# Usage: scripts/probes/ncu_attention_fwd.sh [LIB_DIR] [B H S D]
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
lib_dir="${1:-$root/.dev}"; shift || true
metrics=gpu__time_duration.sum,smsp__inst_executed.sum,sm__inst_executed_pipe_alu.sum
metrics+=,sm__inst_executed_pipe_fma.sum,sm__inst_executed_pipe_xu.sum
metrics+=,sm__inst_issued.avg.pct_of_peak_sustained_active
metrics+=,sm__pipe_alu_cycles_active.avg.pct_of_peak_sustained_active
metrics+=,sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active
for stall in wait barrier long_scoreboard short_scoreboard math_pipe_throttle selected not_selected; do
  metrics+=,smsp__warp_issue_stalled_${stall}_per_warp_active.pct
done
for side in wg persistent stock; do
  kernel=attn_fwd; [ "$side" = stock ] && kernel=fprop
  python3 "$root/scripts/probes/attention_fwd_once.py" "$lib_dir" "$side" "$@"  # compiles ours first
  echo "=== $side"
  ncu --clock-control none -k "regex:$kernel" -s 1 -c 1 --metrics "$metrics" \
    python3 "$root/scripts/probes/attention_fwd_once.py" "$lib_dir" "$side" "$@" 2>&1 \
    | grep -E "^\s+(gpu__|sm__|smsp__)"
done
