#!/usr/bin/env bash
# KV-cache fidelity at GPU scale on SmolLM2-135M-Instruct: every method of oscar-evaluate
# (BF16, INT4, naive/Hadamard/OSCAR INT2 variants) on the Chesterton evaluation text.
#   bash benchmarks/fidelity.sh [OUT_DIR]         (needs a CUDA GPU; ~5 min on an H200)
# Writes OUT_DIR/ctx2048 (65,536 tokens in 2K windows) and OUT_DIR/ctx4096 (131,072
# tokens in 4K windows), each with fidelity.md, fidelity.json and fidelity.png.
set -euo pipefail
out=${1:-results}
python3 -m oscar_vllm.calibration.evaluate --device cuda --context 2048 --eval-tokens 65536 --output-dir "$out/ctx2048"
python3 -m oscar_vllm.calibration.evaluate --device cuda --context 4096 --eval-tokens 131072 --output-dir "$out/ctx4096"
