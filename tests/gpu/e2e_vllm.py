"""End-to-end checks of the OSCAR backend inside vLLM 0.26.0, on a GPU.

Each subcommand starts one vLLM engine (run them as separate processes: a process keeps
its GPU memory) and prints one JSON line with what it measured, prefixed ``RESULT``.

  prepare   SmolLM2-135M-Instruct as a plain HF folder; a Qwen3-8B-shaped folder (config +
            SmolLM2's tokenizer) for dummy-weight runs
  ppl       perplexity of SmolLM2 on the evaluation text, chunked prefill of 256 tokens,
            plus greedy text
  qwen3     LLM(attention_backend=...) on the Qwen3-8B shape: generates, KV capacity
  decode    decode tokens/s at batch 1/32 and context 8K/32K (Qwen3-8B shape)
  serve     `oscar-vllm serve` on the Qwen3-8B shape, answered through the openai client
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

# The Qwen3-8B architecture (its config.json), for runs with dummy weights.
QWEN3_8B_CONFIG = Path(__file__).resolve().parents[2] / "benchmarks" / "configs" / "qwen3-8b.json"


def result(**kw) -> None:
    """One JSON line with what a check measured, and where and when (date, hardware, command,
    versions: the same header the fidelity reports carry)."""
    from oscar_vllm.evaluate import environment

    print("RESULT " + json.dumps({**kw, **environment("tests/gpu/e2e_vllm.py")}), flush=True)


def oscar_config(rotations: str) -> dict:
    return {"oscar": {"rotation_path": rotations, "sink_size": 64, "recent_size": 256}}


def cmd_prepare(args) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from oscar_vllm.hf import smollm2_gguf_path

    out = Path(args.work)
    gguf = smollm2_gguf_path()
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, torch_dtype=torch.float32)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    plain.load_state_dict(loaded.state_dict())
    plain.save_pretrained(out / "smollm2")
    tok.save_pretrained(out / "smollm2")
    qwen = out / "qwen3-8b-shape"
    qwen.mkdir(parents=True, exist_ok=True)
    (qwen / "config.json").write_text(QWEN3_8B_CONFIG.read_text())
    tok.save_pretrained(qwen)
    result(check="prepare", smollm2=str(out / "smollm2"), qwen3=str(qwen))


def eval_windows(model_dir: str, tokens: int, context: int):
    from transformers import AutoTokenizer

    from oscar_vllm import corpus
    from oscar_vllm.calibrate import split_sequences

    tok = AutoTokenizer.from_pretrained(model_dir)
    ids = corpus.tokenize(tok, corpus.evaluation_text())[:tokens]
    return [w.tolist() for w in split_sequences(ids, context) if w.numel() == context], tok


def cmd_ppl(args) -> None:
    import math

    from vllm import LLM, SamplingParams

    windows, tok = eval_windows(args.model, args.tokens, args.context)
    kw = dict(additional_config=oscar_config(args.rotations)) if args.backend == "OSCAR" else {}
    llm = LLM(args.model, attention_backend=args.backend, dtype=args.dtype, enforce_eager=args.eager,
              max_model_len=args.context + 64, max_num_batched_tokens=args.chunk, max_num_seqs=8,
              enable_prefix_caching=False, gpu_memory_utilization=0.5, seed=0, **kw)
    t0 = time.time()
    outs = llm.generate([{"prompt_token_ids": w} for w in windows],
                        SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    nll, n = 0.0, 0
    for w, o in zip(windows, outs):
        for pos, lp in enumerate(o.prompt_logprobs[1:], start=1):
            nll -= lp[w[pos]].logprob
            n += 1
    prompt = windows[0][:600]
    greedy = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=48, temperature=0),
                          use_tqdm=False)[0].outputs[0]
    result(check="ppl", backend=args.backend, dtype=args.dtype, eager=args.eager, chunk=args.chunk,
           context=args.context, tokens_scored=n, ppl=math.exp(nll / n), seconds=round(time.time() - t0, 1),
           greedy_ids=greedy.token_ids, greedy_text=tok.decode(greedy.token_ids))


def engine_kv_tokens(llm) -> int | None:
    cfg = llm.llm_engine.vllm_config.cache_config
    blocks = getattr(cfg, "num_gpu_blocks", None)
    return None if blocks is None else blocks * cfg.block_size


def cmd_qwen3(args) -> None:
    from vllm import LLM, SamplingParams

    kw = dict(additional_config=oscar_config(args.rotations)) if args.backend == "OSCAR" else {}
    llm = LLM(args.model, load_format="dummy", skip_tokenizer_init=True, attention_backend=args.backend,
              max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
              gpu_memory_utilization=args.gpu_memory_utilization, enforce_eager=args.eager, seed=0, **kw)
    prompts = [{"prompt_token_ids": [(7 * i + 13 * j) % 30000 + 100 for j in range(300 + 97 * i)]} for i in range(4)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True), use_tqdm=False)
    result(check="qwen3", backend=args.backend, kv_cache_tokens=engine_kv_tokens(llm),
           max_num_seqs=args.max_num_seqs, gpu_memory_utilization=args.gpu_memory_utilization,
           generated=[len(o.outputs[0].token_ids) for o in outs], first_ids=outs[0].outputs[0].token_ids[:8])


def cmd_decode(args) -> None:
    import random

    from vllm import LLM, SamplingParams

    kw = dict(additional_config=oscar_config(args.rotations)) if args.backend == "OSCAR" else {}
    max_ctx = max(args.contexts)
    llm = LLM(args.model, load_format="dummy", skip_tokenizer_init=True, attention_backend=args.backend,
              max_model_len=max_ctx + args.new_tokens + 16, max_num_seqs=max(args.batches),
              gpu_memory_utilization=0.9, seed=0, **kw)
    kv_tokens = engine_kv_tokens(llm)
    rng = random.Random(0)
    for ctx in args.contexts:
        prompt = [rng.randrange(100, 30000) for _ in range(ctx)]
        for batch in args.batches:
            # Same prompt for the whole batch: prefix caching prefills it once (in the warm-up
            # call), and every request still attends over its full context when decoding.
            reqs = [{"prompt_token_ids": prompt} for _ in range(batch)]
            llm.generate(reqs, SamplingParams(max_tokens=1, ignore_eos=True), use_tqdm=False)
            t0 = time.perf_counter()
            outs = llm.generate(reqs, SamplingParams(max_tokens=args.new_tokens, ignore_eos=True), use_tqdm=False)
            dt = time.perf_counter() - t0
            n = sum(len(o.outputs[0].token_ids) for o in outs)
            result(check="decode", backend=args.backend, context=ctx, batch=batch, new_tokens=args.new_tokens,
                   seconds=round(dt, 4), tokens_per_s=round(n / dt, 1), kv_cache_tokens=kv_tokens)


def cmd_serve(args) -> None:
    import openai

    port = 8011
    env = dict(os.environ, VLLM_USE_FLASHINFER_SAMPLER="0")
    server = subprocess.Popen(
        [sys.executable, "-m", "oscar_vllm.serve", "serve", args.model, "--load-format", "dummy", "--oscar-rotation-path", args.rotations,
         "--oscar-sink-size", "64", "--oscar-recent-size", "256", "--max-model-len", "4096", "--max-num-seqs", "16",
         "--gpu-memory-utilization", "0.5", "--enforce-eager", "--port", str(port)],
        env=env, stdout=sys.stdout, stderr=sys.stderr)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
    try:
        deadline = time.time() + 400
        while True:
            try:
                models = client.models.list()
                break
            except openai.APIConnectionError:
                if server.poll() is not None or time.time() > deadline:
                    raise SystemExit("the server did not come up")
                time.sleep(3)
        done = client.completions.create(model=args.model, prompt="The quick brown fox", max_tokens=16, temperature=0)
        chat = client.chat.completions.create(model=args.model, max_tokens=16,
                                              messages=[{"role": "user", "content": "Say hello."}])
        result(check="serve", models=[m.id for m in models.data], completion_tokens=done.usage.completion_tokens,
               completion=done.choices[0].text, chat_tokens=chat.usage.completion_tokens,
               chat=chat.choices[0].message.content)
    finally:
        server.terminate()
        server.wait(timeout=60)


def main() -> None:
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("prepare")
    s.add_argument("--work", required=True)
    for name in ("ppl", "qwen3", "decode", "serve"):
        s = sub.add_parser(name)
        s.add_argument("--model", required=True)
        s.add_argument("--rotations", default="")
        s.add_argument("--backend", default="OSCAR")
        s.add_argument("--eager", action="store_true")
    sp = sub.choices["ppl"]
    sp.add_argument("--dtype", default="float32")
    sp.add_argument("--chunk", type=int, default=256)
    sp.add_argument("--context", type=int, default=2048)
    sp.add_argument("--tokens", type=int, default=16384)
    sq = sub.choices["qwen3"]
    sq.add_argument("--max-model-len", type=int, default=8192)
    sq.add_argument("--max-num-seqs", type=int, default=64)
    sq.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    sd = sub.choices["decode"]
    sd.add_argument("--contexts", type=int, nargs="+", default=[8192, 32768])
    sd.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    sd.add_argument("--new-tokens", type=int, default=128)
    args = p.parse_args()
    globals()[f"cmd_{args.cmd}"](args)


if __name__ == "__main__":
    main()
