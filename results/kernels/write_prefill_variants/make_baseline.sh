# On the CPU machine, from the repository root: main's kernels package as the baseline of the
# prefill-write comparison (gpu_call.sh puts it first on PYTHONPATH for the "before" runs).
set -euo pipefail
B=.carry/variants/write_before; rm -rf $B; mkdir -p $B
git archive main csrc_triton | tar -x -C $B
