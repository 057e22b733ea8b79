#!/usr/bin/env bash
# Calibrate SmolLM2 (the embedded default), look at the result, export it as RotationZoo
# files, and score it against BF16 on a short slice. About 3 minutes on 2 CPU cores.
set -euo pipefail
out=${1:-rotations/smollm2}
oscar-calibrate --output-dir "$out" --calib-tokens 8192
oscar-rotations inspect "$out"
oscar-rotations convert "$out" "$out-rotationzoo" --to rotationzoo
oscar-evaluate --rotations "$out" --methods bf16,oscar-int2,oscar-int2-fit --eval-tokens 2048 --output-dir "$out-fidelity"
