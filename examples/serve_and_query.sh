#!/usr/bin/env bash
# Serve a model with `vllm serve --attention-backend OSCAR`, wait until it is healthy, ask it
# through the OpenAI API (a chat, a completion and a streamed completion, with the `openai`
# client that comes with vLLM), then stop it. Needs a CUDA GPU.
usage="usage: bash examples/serve_and_query.sh --model DIR [--rotations PATH] [--port N] [--dummy-weights] [-- VLLM_SERVE_ARGS...]

  --model DIR        a local model folder (config, tokenizer, weights), or a Hub id in the local cache
  --rotations PATH   OSCAR rotation_path: a folder, hf://ORG/REPO[/SUB][@REV] or hadamard (default: hadamard)
  --port N           the server's port (default: 8000)
  --dummy-weights    random weights (--load-format dummy): the config and tokenizer are enough
  -- ARGS            passed on to vllm serve (default: --max-model-len 4096)

A local SmolLM2 folder comes from \`python tests/gpu/e2e_vllm.py prepare --work /tmp/oscar-e2e\`
(no GPU, no network); its rotations are committed in tests/data/smollm2_rotations:
  bash examples/serve_and_query.sh --model /tmp/oscar-e2e/smollm2 --rotations tests/data/smollm2_rotations
The server's log goes to runs/serve_and_query/server.log."
set -euo pipefail
cd "$(dirname "$0")/.."
model="" rotations=hadamard port=8000 extra=()
while [ $# -gt 0 ]; do
  case $1 in
    -h|--help) echo "$usage"; exit 0 ;;
    --model) model=${2:?--model needs a value}; shift 2 ;;
    --rotations) rotations=${2:?--rotations needs a value}; shift 2 ;;
    --port) port=${2:?--port needs a value}; shift 2 ;;
    --dummy-weights) extra+=(--load-format dummy); shift ;;
    --) shift; extra+=("$@"); break ;;
    *) echo "serve_and_query.sh: unknown argument $1" >&2; echo "$usage" >&2; exit 2 ;;
  esac
done
[ -n "$model" ] || { echo "serve_and_query.sh: --model is required" >&2; echo "$usage" >&2; exit 2; }
python=${PYTHON:-python3}
if ! "$python" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  echo "serve_and_query.sh: vllm serve needs a CUDA GPU, and this machine has none; nothing was run." >&2
  exit 1
fi
if command -v vllm >/dev/null; then serve=(vllm serve); else serve=("$python" -m vllm.entrypoints.cli.main serve); fi
[[ " ${extra[*]} " == *" --max-model-len "* ]] || extra+=(--max-model-len 4096)
log_dir=runs/serve_and_query
mkdir -p "$log_dir"

# The server in its own process group, so that stopping it stops its engine process too.
setsid "${serve[@]}" "$model" --attention-backend OSCAR --port "$port" \
  --additional-config "{\"oscar\": {\"rotation_path\": \"$rotations\"}}" "${extra[@]}" > "$log_dir/server.log" 2>&1 &
server=$!
stop() {
  if kill -0 "$server" 2>/dev/null; then
    echo "stopping the server (pid $server)"
    kill -TERM -- "-$server" 2>/dev/null || true
    for _ in $(seq 60); do kill -0 "$server" 2>/dev/null || break; sleep 1; done
    kill -KILL -- "-$server" 2>/dev/null || true
  fi
}
trap stop EXIT INT TERM

echo "starting: ${serve[*]} $model --attention-backend OSCAR --port $port --additional-config '{\"oscar\": {\"rotation_path\": \"$rotations\"}}' ${extra[*]} (log: $log_dir/server.log)"
for second in $(seq 600); do
  if curl -sf "http://127.0.0.1:$port/health" >/dev/null; then break; fi
  if ! kill -0 "$server" 2>/dev/null; then
    echo "serve_and_query.sh: the server exited before it was healthy; the end of its log:" >&2
    tail -n 30 "$log_dir/server.log" >&2
    exit 1
  fi
  [ "$second" -lt 600 ] || { echo "serve_and_query.sh: not healthy after 600 s" >&2; exit 1; }
  sleep 1
done
echo "healthy after about ${second} s"
grep -m1 -i "GPU KV cache size" "$log_dir/server.log" || true

"$python" - "$port" <<'EOF'
import sys

import openai

client = openai.OpenAI(base_url=f"http://127.0.0.1:{sys.argv[1]}/v1", api_key="none")
model = client.models.list().data[0].id
print(f"model: {model}")
chat = client.chat.completions.create(
    model=model, max_tokens=48, temperature=0,
    messages=[{"role": "user", "content": "In one sentence: why would a KV cache be stored in 2 bits?"}])
print(f"\n[chat] {chat.choices[0].message.content!r} ({chat.usage.completion_tokens} tokens)")
done = client.completions.create(model=model, prompt="The three primary colors are", max_tokens=32, temperature=0)
print(f"\n[completion] {done.choices[0].text!r} ({done.usage.completion_tokens} tokens)")
print("\n[streamed completion] ", end="", flush=True)
pieces = 0
for chunk in client.completions.create(model=model, prompt="Once upon a time", max_tokens=32, temperature=0,
                                       stream=True):
    if chunk.choices:
        print(chunk.choices[0].text, end="", flush=True)
        pieces += 1
print(f"\n({pieces} chunks)")
if pieces < 2:
    sys.exit("the streamed completion came back in fewer than 2 chunks")
EOF
