#!/usr/bin/env bash
# Regenerate the committed table of the README's main job, results/fidelity/, and splice it
# into the README. `oscar-evaluate` alone writes runs/fidelity/ and leaves the clone clean;
# this script is the explicit way to replace the committed files (6-7 minutes on 2 CPU cores).
#   bash benchmarks/main_job.sh
set -euo pipefail
cd "$(dirname "$0")/.."
oscar-evaluate --output-dir results/fidelity
python benchmarks/readme_tables.py
