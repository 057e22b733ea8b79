"""Quality of OSCAR's cache and vLLM's own KV caches, measured inside vLLM on one GPU.

    python benchmarks/quality_vllm.py --model /tmp/oscar-e2e/smollm2 --out results/quality_vllm
    python benchmarks/quality_vllm.py --report results/quality_vllm

The model is SmolLM2-135M-Instruct as a plain folder (``tests/gpu/e2e_vllm.py prepare``). Every
configuration runs in a process of its own (one engine each, eager, bf16, prefix caching off,
prompts prefilled in chunks of 256, or ``--chunk``'s) and measures:

* **perplexity** of two held-out texts scored from prompt log-probabilities, in windows of 2,048
  tokens: prose (the evaluation books, ``oscar_vllm.calibration.corpus``) and source code (vLLM
  0.26.0's own ``v1`` package, a kind of text no rotation was calibrated on); ΔPPL against BF16;
* **greedy continuations**: 256 tokens after 64 distinct prompts at 2K, 4K and 7K tokens of prose,
  compared token by token with BF16's: the mean position of the first token that differs (256
  where none does) and the share of positions whose tokens are equal;
* **passkey retrieval**: a five-digit key hidden at five depths of 2K, 4K and 7K tokens of filler,
  asked for at the end; scored where BF16 finds it.

Configurations: BF16 (FLASH_ATTN), fp8 (FLASH_ATTN, ``kv_cache_dtype`` fp8), INT4 per token and
head (TRITON_ATTN, ``int4_per_token_head``), OSCAR as served by default (``key_mean`` off, λ 0.5),
OSCAR with keys less their block's mean (``key_mean`` auto, λ 0), and each of those two with the
keys clipped at 0.96 instead of the file's fitted ratios. ``--parts`` measures part of
each (``ppl greedy passkey``). ``--report`` writes ``quality.md``, ``quality.json`` and
``quality.png`` from the configurations' files.

Chunks of 256 make most of a prompt's reads cross chunks, where OSCAR's read of a prompt differs
from one in a single chunk; ``--chunk 8192`` (vLLM's ``max_num_batched_tokens`` for ``vllm serve``
on an H100 or H200) prefills each prompt here in one chunk, as a server mostly does, and takes the
greedy part's 832K prompt tokens in about 100 steps, not 3,300:

    python benchmarks/quality_vllm.py --model /tmp/oscar-e2e/smollm2 --parts greedy --chunk 8192 --out OUT/greedy
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CHUNK = 256  # prompt tokens an engine step takes (max_num_batched_tokens) unless --chunk says otherwise
PPL_CONTEXT = 2048
PPL_TOKENS = 65536
GREEDY_CONTEXTS = (2048, 4096, 7168)
GREEDY_PROMPTS = 64
GREEDY_TOKENS = 256
PASSKEY_LENGTHS = (2048, 4096, 7168)
PASSKEY_DEPTHS = (0.1, 0.3, 0.5, 0.7, 0.9)
PASSKEY_KEYS = (50261, 73914, 18526, 94037)
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
CODE_CHARS = 600_000  # about 170K tokens: room for the 65,536 scored and the greedy windows, tokenized in seconds
CODE_TEXT = f"vLLM 0.26.0's v1 package, its .py files in sorted order (vllm/v1/**/*.py), first {CODE_CHARS:,} chars"
CONFIGS = {
    "bf16": dict(backend="FLASH_ATTN", what="BF16 (FLASH_ATTN)", bits=16),
    "fp8": dict(backend="FLASH_ATTN", kv_cache_dtype="fp8", what="fp8 (FLASH_ATTN)", bits=8),
    "int4": dict(backend="TRITON_ATTN", kv_cache_dtype="int4_per_token_head",
                 what="int4_per_token_head (TRITON_ATTN)", bits=4.25),
    "oscar": dict(backend="OSCAR", what="OSCAR, default (keys as they are, λ 0.5)", bits=2.25),
    "oscar-key-mean": dict(backend="OSCAR", env={"OSCAR_KEY_MEAN": "auto"},
                           what="OSCAR, keys less their block's mean (key_mean auto, λ 0)", bits=2.25),
    # The lighter key clip that kept passkeys in the reference cache (results/quality/passkey_reference/)
    "oscar-clip96": dict(backend="OSCAR", env={"OSCAR_CLIP_RATIO_K": "0.96"},
                         what="OSCAR, keys clipped at 0.96 (λ 0.5)", bits=2.25),
    "oscar-key-mean-clip96": dict(backend="OSCAR", env={"OSCAR_KEY_MEAN": "auto", "OSCAR_CLIP_RATIO_K": "0.96"},
                                  what="OSCAR, keys less their block's mean clipped at 0.96 (λ 0)", bits=2.25),
}
REFERENCE = "bf16"


def code_text() -> str:
    """vLLM 0.26.0's ``v1`` sources (found without importing vLLM), in a fixed order."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("the code text is vLLM's own source: vLLM must be installed")
    root = Path(spec.submodule_search_locations[0])
    return "\n\n".join(p.read_text(encoding="utf-8") for p in sorted((root / "v1").rglob("*.py")))[:CODE_CHARS]


def texts(tokenizer) -> dict[str, list[int]]:
    from oscar_vllm.calibration import corpus

    return {"prose": corpus.tokenize(tokenizer, corpus.evaluation_text()).tolist(),
            "code": corpus.tokenize(tokenizer, code_text()).tolist()}


def windows(ids: list[int], length: int, count: int) -> list[list[int]]:
    """``count`` windows of ``length`` tokens spread evenly over ``ids`` (distinct starts)."""
    if len(ids) < length + count:
        raise ValueError(f"a text of {len(ids)} tokens holds no {count} distinct windows of {length}")
    step = (len(ids) - length) // max(count - 1, 1)
    return [ids[i * step:i * step + length] for i in range(count)]


def passkey_prompts(tokenizer) -> list[dict]:
    """Filler with a key at each depth of each length, then the question (token ids)."""
    out = []
    question = tokenizer.encode("\nWhat is the pass key? The pass key is", add_special_tokens=False)
    unit = tokenizer.encode(FILLER, add_special_tokens=False)
    for length in PASSKEY_LENGTHS:
        for depth in PASSKEY_DEPTHS:
            for key in PASSKEY_KEYS:
                needle = tokenizer.encode(f" The pass key is {key}. Remember it. {key} is the pass key. ",
                                          add_special_tokens=False)
                room = length - len(needle) - len(question)
                filler = (unit * (room // len(unit) + 1))[:room]
                at = int(depth * room)
                out.append({"length": length, "depth": depth, "key": key,
                            "ids": filler[:at] + needle + filler[at:] + question})
    return out


PARTS = ("ppl", "greedy", "passkey")


def run_engine(name: str, model: str, rotations: str, out: Path, parts: tuple[str, ...] = PARTS,
               chunk: int = CHUNK) -> None:
    """One configuration's measurements (``parts`` of them), written to ``out`` as JSON."""
    from vllm import LLM, SamplingParams

    cfg = CONFIGS[name]
    kw = {"additional_config": {"oscar": {"rotation_path": rotations}}} if cfg["backend"] == "OSCAR" else {}
    if "kv_cache_dtype" in cfg:
        kw["kv_cache_dtype"] = cfg["kv_cache_dtype"]
    t0 = time.time()
    llm = LLM(model, attention_backend=cfg["backend"], dtype="bfloat16", enforce_eager=True, max_model_len=8192,
              max_num_batched_tokens=chunk, enable_prefix_caching=False, gpu_memory_utilization=0.5, seed=0, **kw)
    tokenizer = llm.get_tokenizer()
    result: dict = {"config": name, **{k: v for k, v in cfg.items() if k != "env"}, "env": cfg.get("env", {}),
                    "start_s": round(time.time() - t0, 1), "chunk": chunk, "ppl": {}, "greedy": {}, "passkey": []}
    all_texts = texts(tokenizer) if {"ppl", "greedy"} & set(parts) else {}
    if "ppl" in parts:
        for text, ids in all_texts.items():
            ws = windows(ids[:PPL_TOKENS], PPL_CONTEXT, PPL_TOKENS // PPL_CONTEXT)
            outs = llm.generate([{"prompt_token_ids": w} for w in ws],
                                SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
            nll = [-o.prompt_logprobs[i][w[i]].logprob for w, o in zip(ws, outs) for i in range(1, len(w))]
            result["ppl"][text] = {"ppl": math.exp(sum(nll) / len(nll)), "tokens": len(nll), "nll": nll}
    if "greedy" in parts:
        greedy = SamplingParams(max_tokens=GREEDY_TOKENS, temperature=0, ignore_eos=True)
        for ctx in GREEDY_CONTEXTS:
            ws = windows(all_texts["prose"], ctx, GREEDY_PROMPTS)
            outs = llm.generate([{"prompt_token_ids": w} for w in ws], greedy, use_tqdm=False)
            result["greedy"][str(ctx)] = [list(o.outputs[0].token_ids) for o in outs]
    if "passkey" in parts:  # a part left out sends the engine no request at all
        prompts = passkey_prompts(tokenizer)
        outs = llm.generate([{"prompt_token_ids": p["ids"]} for p in prompts],
                            SamplingParams(max_tokens=12, temperature=0), use_tqdm=False)
        for p, o in zip(prompts, outs):
            text = o.outputs[0].text
            result["passkey"].append({"length": p["length"], "depth": p["depth"], "key": p["key"],
                                      "answer": text, "found": str(p["key"]) in text})
    result["seconds"] = round(time.time() - t0, 1)
    out.write_text(json.dumps(result) + "\n")


def greedy_agreement(got: list[list[int]], want: list[list[int]]) -> tuple[float, float]:
    """Mean position of the first token that differs (the length where none does) and the share of
    equal tokens, over paired continuations."""
    first, equal, total = [], 0, 0
    for g, w in zip(got, want):
        diff = next((i for i, (a, b) in enumerate(zip(g, w)) if a != b), len(w))
        first.append(diff)
        equal += sum(a == b for a, b in zip(g, w))
        total += len(w)
    return sum(first) / len(first), equal / total


def summarize(results: dict[str, dict]) -> dict[str, dict]:
    """Per configuration, against BF16 of the same run: ΔPPL per text (with the paired standard
    error of the mean NLL difference), greedy agreement per context, passkeys found where BF16's
    were."""
    ref = results[REFERENCE]
    found_ref = [p["found"] for p in ref["passkey"]]
    rows = {}
    for name, r in results.items():
        row = {"what": r["what"], "bits": r["bits"], "ppl": {}, "greedy": {}}
        for text, s in ((t, s) for t, s in r["ppl"].items() if t in ref["ppl"]):
            diffs = [a - b for a, b in zip(s["nll"], ref["ppl"][text]["nll"])]
            mean = sum(diffs) / len(diffs)
            sd = math.sqrt(sum((x - mean) ** 2 for x in diffs) / (len(diffs) - 1))
            row["ppl"][text] = {"ppl": s["ppl"], "delta_pct": 100 * (s["ppl"] / ref["ppl"][text]["ppl"] - 1),
                                "se_pct": 100 * sd / math.sqrt(len(diffs))}
        for ctx, conts in ((c, g) for c, g in r["greedy"].items() if c in ref["greedy"]):
            first, equal = greedy_agreement(conts, ref["greedy"][ctx])
            row["greedy"][ctx] = {"first_diff": first, "equal": equal}
        mine = [p["found"] for p in r["passkey"]] if len(r["passkey"]) == len(found_ref) else []
        row["passkey"] = {"found": sum(mine), "where_bf16": sum(a and b for a, b in zip(mine, found_ref)),
                          "bf16_found": sum(found_ref), "trials": len(mine)} if mine else {}
        rows[name] = row
    return rows


def markdown(rows: dict[str, dict], meta: dict) -> str:
    # greedy columns for the contexts some configuration compared with BF16's (none: no columns)
    ctxs = [c for c in rows[REFERENCE]["greedy"] if any(c in r["greedy"] for n, r in rows.items() if n != REFERENCE)]
    greedy_head = "".join(f"first differing token at {int(c) // 1024}K | " for c in ctxs)
    lines = [f"- date: {meta['date']}; hardware: {meta['hardware']}; model: SmolLM2-135M-Instruct (bf16, eager)",
             f"- command: `{meta['command']}`",
             f"- texts: prose, {meta['prose']}; code, {CODE_TEXT}; ΔPPL over {PPL_TOKENS:,} tokens of each in windows "
             f"of {PPL_CONTEXT:,}, prompts prefilled in chunks of {meta.get('chunk', CHUNK)} (± one standard error, "
             "paired by token)",
             f"- greedy: {GREEDY_TOKENS} tokens after {GREEDY_PROMPTS} prompts at each context, against BF16's; "
             f"passkey: {len(PASSKEY_KEYS)} keys at {len(PASSKEY_DEPTHS)} depths of each length "
             f"({', '.join(map(str, PASSKEY_LENGTHS))} tokens)", "",
             "| KV cache | bits/elem | ΔPPL prose | ΔPPL code | " + greedy_head + ("equal tokens | " if ctxs else "")
             + "passkey found where BF16 finds it |",
             "|---" * (5 + len(ctxs) + bool(ctxs)) + "|"]
    for name, r in rows.items():
        ppl = ["—" if t not in r["ppl"] else f"{r['ppl'][t]['ppl']:.3f} (ppl)" if name == REFERENCE else
               f"{r['ppl'][t]['delta_pct']:+.2f}% ± {r['ppl'][t]['se_pct']:.2f}" for t in ("prose", "code")]
        greedy = [f"{r['greedy'][c]['first_diff']:.1f}" if c in r["greedy"] else "—" for c in ctxs]
        if ctxs:
            greedy.append(f"{100 * sum(r['greedy'][c]['equal'] for c in ctxs) / len(ctxs):.1f}%"
                          if all(c in r["greedy"] for c in ctxs) else "—")
        pk = r["passkey"]
        found = f"{pk['where_bf16']} of {pk['bf16_found']} (all: {pk['found']} of {pk['trials']})" if pk else "—"
        lines.append(f"| {r['what']} | {r['bits']:g} | {' | '.join(ppl + greedy)} | {found} |")
    return "\n".join(lines) + "\n"


def plot(rows: dict[str, dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [n for n in rows if n != REFERENCE]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 3.8))
    x = range(len(names))
    for i, text in enumerate(("prose", "code")):
        got = [rows[n]["ppl"].get(text, {"delta_pct": 0.0, "se_pct": 0.0}) for n in names]
        a.bar([j + 0.4 * i for j in x], [g["delta_pct"] for g in got], 0.4, yerr=[g["se_pct"] for g in got],
              label=text)
    a.set_xticks([j + 0.2 for j in x], names, rotation=15)
    a.set_ylabel("ΔPPL against BF16 (%)")
    a.legend()
    ctxs = list(rows[REFERENCE]["greedy"])
    for n in (n for n in names if ctxs and all(c in rows[n]["greedy"] for c in ctxs)):
        b.plot([int(c) for c in ctxs], [rows[n]["greedy"][c]["first_diff"] for c in ctxs], marker="o", label=n)
    b.set_xlabel("context (tokens)")
    b.set_ylabel("first token differing from BF16's")
    if b.lines:  # no configuration but BF16 ran the greedy part: an empty panel, no legend
        b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def report(folder: Path, command: str) -> str:
    from oscar_vllm.calibration import corpus

    results = {json.loads(p.read_text())["config"]: json.loads(p.read_text())
               for p in sorted(folder.glob("engine_*.json"))}
    if REFERENCE not in results:
        raise SystemExit(f"no {REFERENCE} run in {folder}: every figure is against it")
    results = {n: results[n] for n in CONFIGS if n in results}
    meta = json.loads((folder / "meta.json").read_text()) if (folder / "meta.json").exists() else {}
    meta = {"date": "?", "hardware": "?", **meta, "command": meta.get("command", command),
            "prose": corpus.EVALUATION_NAME}
    rows = summarize(results)
    text = markdown(rows, meta)
    (folder / "quality.md").write_text(text)
    (folder / "quality.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    plot(rows, folder / "quality.png")
    return text


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="SmolLM2 as a plain folder (tests/gpu/e2e_vllm.py prepare)")
    p.add_argument("--rotations", default=str(REPO / "tests" / "data" / "smollm2_rotations"))
    p.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    p.add_argument("--out", type=Path, default=REPO / "runs" / "quality_vllm")
    p.add_argument("--report", type=Path, help="only write the report of a folder's runs")
    p.add_argument("--parts", nargs="+", default=list(PARTS), choices=PARTS,
                   help="what each engine measures (the report shows the rest as —)")
    p.add_argument("--chunk", type=int, default=CHUNK, help="prompt tokens a step (max_num_batched_tokens)")
    p.add_argument("--engine", choices=list(CONFIGS), help=argparse.SUPPRESS)
    args = p.parse_args()
    command = "python benchmarks/quality_vllm.py " + " ".join(sys.argv[1:])
    if args.report:
        print(report(args.report, command))
        return
    if args.model is None:
        p.error("--model is needed to run the engines")
    if args.engine:
        run_engine(args.engine, args.model, args.rotations, args.out / f"engine_{args.engine}.json",
                   tuple(args.parts), args.chunk)
        return
    from oscar_vllm.calibration.evaluate import environment

    args.out.mkdir(parents=True, exist_ok=True)
    env_meta = environment("python benchmarks/quality_vllm.py")
    (args.out / "meta.json").write_text(json.dumps({**{k: env_meta[k] for k in ("date", "hardware", "command")},
                                                    "chunk": args.chunk}) + "\n")
    failed = []
    for name in args.configs:
        env = {**os.environ, **CONFIGS[name].get("env", {})}
        code = subprocess.run([sys.executable, __file__, "--engine", name, "--model", args.model, "--rotations",
                               args.rotations, "--out", str(args.out), "--chunk", str(args.chunk),
                               "--parts", *args.parts],
                              env=env).returncode
        if code:
            failed.append(name)
    if (args.out / f"engine_{REFERENCE}.json").exists():
        print(report(args.out, command))
    if failed:
        raise SystemExit(f"failed: {', '.join(failed)}")


if __name__ == "__main__":
    main()
