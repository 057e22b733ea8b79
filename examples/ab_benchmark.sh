#!/usr/bin/env bash
# A small A/B run, OSCAR against FLASH_ATTN (vLLM's BF16 KV cache), through the A/B harness
# (python -m benchmarks.ab): prefill and prefix-cached decode of N distinct prompts, and the
# KV capacity of both engines; then the `vllm bench throughput` commands for the same
# workload, printed, and run with --vllm-bench. Needs a CUDA GPU.
usage="usage: bash examples/ab_benchmark.sh [--model DIR] [--rotations PATH] [--num-prompts N] [--prompt-len L] [--output-len K] [--out DIR] [--vllm-bench]

  --model DIR        a local model folder (default: the Qwen3-8B shape with dummy weights, no download)
  --rotations PATH   OSCAR rotation_path (default: hadamard; speed does not depend on the values)
  --num-prompts N    distinct prompts (default: 8)
  --prompt-len L     tokens per prompt (default: 4096)
  --output-len K     tokens each request decodes (default: 128)
  --out DIR          where ab.md, ab.csv, ab.png and the logs go (default: runs/ab_example)
  --vllm-bench       also run the vllm bench throughput commands (needs tokenizer files in --model)

The two engines run one after the other, each in its own process; the tables go to OUT/ab.md.
The runs behind docs/ab.md: python -m benchmarks.ab --help."
set -euo pipefail
cd "$(dirname "$0")/.."
model="" rotations=hadamard prompts=8 len=4096 out_len=128 out=runs/ab_example bench=0
while [ $# -gt 0 ]; do
  case $1 in
    -h|--help) echo "$usage"; exit 0 ;;
    --model) model=${2:?--model needs a value}; shift 2 ;;
    --rotations) rotations=${2:?--rotations needs a value}; shift 2 ;;
    --num-prompts) prompts=${2:?--num-prompts needs a value}; shift 2 ;;
    --prompt-len) len=${2:?--prompt-len needs a value}; shift 2 ;;
    --output-len) out_len=${2:?--output-len needs a value}; shift 2 ;;
    --out) out=${2:?--out needs a value}; shift 2 ;;
    --vllm-bench) bench=1; shift ;;
    *) echo "ab_benchmark.sh: unknown argument $1" >&2; echo "$usage" >&2; exit 2 ;;
  esac
done
python=${PYTHON:-python3}
if ! "$python" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  echo "ab_benchmark.sh: vLLM needs a CUDA GPU, and this machine has none; nothing was run." >&2
  exit 1
fi
if [ "$bench" = 1 ] && [ -z "$model" ]; then
  echo "ab_benchmark.sh: --vllm-bench needs --model (a folder with tokenizer files)" >&2
  exit 2
fi

ab=("$python" -m benchmarks.ab --configs OSCAR FLASH_ATTN --scenarios prefill decode
    --num-prompts "$prompts" --prompt-len "$len" --output-len "$out_len" --rotations "$rotations"
    --timeout 900 --out "$out")
[ -z "$model" ] || ab+=(--model "$model")
echo "+ ${ab[*]}"
"${ab[@]}"

# The same workload through vLLM's own benchmark: random prompts of L tokens, K out each.
if command -v vllm >/dev/null; then vllm=(vllm); else vllm=("$python" -m vllm.entrypoints.cli.main); fi
workload=(--dataset-name random --random-input-len "$len" --random-output-len "$out_len" --num-prompts "$prompts")
max_len=$((len + out_len + 64))
# A folder without weights is served with random ones, as the A/B harness does.
if [ -n "$model" ] && [ -d "$model" ] && ! compgen -G "$model/*.safetensors" >/dev/null; then
  workload+=(--load-format dummy)
fi
oscar=("${vllm[@]}" bench throughput --model "${model:-MODEL}" --attention-backend OSCAR
       --additional-config "{\"oscar\": {\"rotation_path\": \"$rotations\"}}" --max-model-len "$max_len"
       "${workload[@]}" --output-json "$out/vllm_bench_OSCAR.json")
bf16=("${vllm[@]}" bench throughput --model "${model:-MODEL}" --attention-backend FLASH_ATTN
      --max-model-len "$max_len" "${workload[@]}" --output-json "$out/vllm_bench_FLASH_ATTN.json")
show() {  # a command line as it can be pasted, quoting only the arguments that need it
  local line="" arg
  for arg in "$@"; do
    if [[ $arg =~ ^[A-Za-z0-9_./=:,+@-]+$ ]]; then line+=" $arg"; else line+=" '${arg//\'/\'\\\'\'}'"; fi
  done
  echo " $line"
}
echo
echo "The same workload with vllm bench (it needs tokenizer files in the model folder):"
show "${oscar[@]}"
show "${bf16[@]}"
if [ "$bench" = 1 ]; then
  "${oscar[@]}"
  "${bf16[@]}"
  "$python" - "$out" <<'EOF'
import json
import sys
from pathlib import Path

runs = {name: json.loads((Path(sys.argv[1]) / f"vllm_bench_{name}.json").read_text()) for name in ("OSCAR", "FLASH_ATTN")}
for key in ("requests_per_second", "tokens_per_second"):
    print(f"vllm bench {key}: OSCAR {runs['OSCAR'][key]:,.1f}, FLASH_ATTN {runs['FLASH_ATTN'][key]:,.1f} "
          f"({runs['OSCAR'][key] / runs['FLASH_ATTN'][key]:.2f}x)")
EOF
fi
