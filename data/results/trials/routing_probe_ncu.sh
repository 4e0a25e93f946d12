# Trial (data/results/trials/README.md): stall reasons and pipe use of main's routing kernel and probe4 under ncu.
# Run from the repository root on the GPU machine: PYTHONPATH=lib bash data/results/trials/routing_probe_ncu.sh
M=""
for r in wait math_pipe_throttle short_scoreboard long_scoreboard not_selected selected dispatch_stall no_instruction \
         barrier lg_throttle drain mio_throttle membar sleeping branch_resolving misc tex_throttle imc_miss; do
  M="$M,smsp__warp_issue_stalled_${r}_per_warp_active.pct"
done
M="${M:1},sm__cycles_active.avg,sm__cycles_elapsed.avg,smsp__inst_executed.sum,sm__pipe_alu_cycles_active.avg.pct_of_peak_sustained_active,smsp__warps_active.avg.per_cycle_active,smsp__issue_active.avg.pct_of_peak_sustained_active,gpu__time_duration.sum"
for k in _route_rows16_kernel _probe4_kernel; do
  /usr/local/cuda/bin/ncu --kernel-name $k --launch-skip 2 --launch-count 4 --metrics $M \
    python data/results/trials/routing_probe.py ncu 2>&1 | grep -v "^==PROF==" | grep -v -i "warn"
done
