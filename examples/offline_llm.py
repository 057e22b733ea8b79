"""The same prompts through vLLM's offline ``LLM()`` with FLASH_ATTN (BF16 KV cache) and with
OSCAR (2-bit KV cache): each engine's KV capacity, then the greedy outputs side by side.

    python examples/offline_llm.py --model /path/to/model [--rotations DIR|hadamard]
    python examples/offline_llm.py --model /tmp/oscar-e2e/qwen3-8b-shape --dummy-weights

--model is a local folder (or a Hub id already in the cache): config, tokenizer and, unless
--dummy-weights, the weights. A local SmolLM2 folder is made, without a GPU or network, by
`python tests/gpu/e2e_vllm.py prepare --work /tmp/oscar-e2e` (it also writes a Qwen3-8B-shaped
folder for --dummy-weights); its OSCAR rotations are committed in tests/data/smollm2_rotations.
Each engine runs in its own process, one after the other, so that the second finds the GPU
memory the first held. Two prompts are short: they fit in the BF16 windows, where OSCAR differs
from BF16 only by rounding (rotated keys, value rotation folded into the weights). The third is
a long document (the start of docs/method.md) with a question after it, most of which OSCAR
reads in 2 bits. Needs a CUDA GPU.
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BACKENDS = ("FLASH_ATTN", "OSCAR")
SHORT_PROMPTS = [
    "The three primary colors are",
    "Q: What is the capital of France?\nA:",
]


DOCUMENT_CHARS = 6000  # about 1,500 tokens: most of it outside the 64 + 256 BF16 windows


def prompts() -> list[str]:
    text = (REPO / "docs" / "method.md").read_text()
    document = text[: text.rfind("\n\n", 0, DOCUMENT_CHARS)]
    return [*SHORT_PROMPTS,
            f"{document}\n\nQuestion: what does this quantizer store instead of the zero point, and why?\nAnswer:"]


def run_engine(args) -> dict:
    """One engine: its KV capacity and the greedy outputs (runs in a child process)."""
    from vllm import LLM, SamplingParams

    kw = dict(attention_backend=args.engine, max_model_len=args.max_model_len,
              gpu_memory_utilization=args.gpu_memory_utilization, seed=0)
    if args.engine == "OSCAR":
        kw["additional_config"] = {"oscar": {"rotation_path": args.rotations}}
    if args.dummy_weights:
        kw["load_format"] = "dummy"
    llm = LLM(args.model, **kw)
    cache = llm.llm_engine.vllm_config.cache_config
    outs = llm.generate(prompts(), SamplingParams(max_tokens=args.max_tokens, temperature=0))
    return {"kv_cache_tokens": cache.num_gpu_blocks * cache.block_size,
            "prompt_tokens": [len(o.prompt_token_ids) for o in outs],
            "token_ids": [list(o.outputs[0].token_ids) for o in outs],
            "text": [o.outputs[0].text for o in outs]}


def side_by_side(left: str, right: str, width: int) -> list[str]:
    cols = [textwrap.wrap(" ".join(t.split()), width) or [""] for t in (left, right)]
    depth = max(map(len, cols))
    cols = [c + [""] * (depth - len(c)) for c in cols]
    return [f"{a:<{width}} | {b}" for a, b in zip(*cols)]


def compare(results: dict[str, dict]) -> None:
    base, oscar = (results[b] for b in BACKENDS)
    print(f"KV cache tokens: FLASH_ATTN {base['kv_cache_tokens']:,}, OSCAR {oscar['kv_cache_tokens']:,} "
          f"({oscar['kv_cache_tokens'] / base['kv_cache_tokens']:.2f}x)")
    width = max(30, (shutil.get_terminal_size((120, 24)).columns - 3) // 2)
    for i, (prompt, n) in enumerate(zip(prompts(), base["prompt_tokens"])):
        a, b = base["token_ids"][i], oscar["token_ids"][i]
        same = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        head = " ".join(prompt.split())
        print(f"\n[{i + 1}] {n} prompt tokens: {head[:70]}{'...' if len(head) > 70 else ''}")
        print(f"    the first {same} of {len(a)} generated tokens are the same")
        print("\n".join(side_by_side("FLASH_ATTN", "OSCAR", width)))
        print("-" * width + "-+-" + "-" * width)
        print("\n".join(side_by_side(base["text"][i], oscar["text"][i], width)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="a local model folder (or a Hub id in the local cache)")
    parser.add_argument("--rotations", default="hadamard",
                        help="OSCAR rotation_path: a folder, hf://ORG/REPO[/SUB][@REV], or hadamard "
                             "(default: %(default)s, data-free)")
    parser.add_argument("--dummy-weights", action="store_true",
                        help="random weights (load_format=dummy): a config is enough; the text is noise (default: off)")
    parser.add_argument("--max-tokens", type=int, default=48, help="greedy tokens per prompt (default: %(default)s)")
    parser.add_argument("--max-model-len", type=int, default=4096,
                        help="vLLM's max_model_len for both engines (default: %(default)s)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                        help="vLLM's gpu_memory_utilization for both engines (default: %(default)s)")
    parser.add_argument("--engine", choices=BACKENDS, help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.engine:
        Path(args.result).write_text(json.dumps(run_engine(args)))
        return

    import torch

    if not torch.cuda.is_available():
        sys.exit("offline_llm.py: vLLM needs a CUDA GPU, and this machine has none; nothing was run.")
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for engine in BACKENDS:
            result = Path(tmp) / f"{engine}.json"
            print(f"--- {engine}", flush=True)
            proc = subprocess.run([sys.executable, __file__, *sys.argv[1:],
                                   "--engine", engine, "--result", str(result)])
            if proc.returncode:
                sys.exit(f"offline_llm.py: the {engine} engine failed (exit status {proc.returncode}); "
                         "its log is above")
            results[engine] = json.loads(result.read_text())
    print()
    compare(results)


if __name__ == "__main__":
    main()
