"""Reliability of the OSCAR backend as a server, on a GPU (tests/gpu/run.sh stages refuse, load,
soak, tp2; docs/reliability.md). Each subcommand prints one ``RESULT {json}`` line and writes a
markdown summary (and its data) into ``--out``; it exits non-zero when a check fails.

  refuse  bad input refused in one process (in-process engines), and torch's GPU memory back to
          its baseline after each refusal, including one a worker makes after loading the model
  load    `vllm serve` under load, OSCAR and FLASH_ATTN through the same test, one after the
          other: 512 requests at concurrency 256 (load_mix.build_mix), every reply of a chosen
          set compared with the same request sent alone; free KV blocks and window pages back at
          their idle values after the load and after cancellations; the same mixed batch 20
          times; CUDA graphs against eager at batch sizes 1, 7, 25, 45, 123 and one larger than
          any captured size
  soak    N minutes of mixed load on an OSCAR server at full concurrency, sampled per interval
          (requests completed and failed, p50/p99 latency, GPU memory, server RSS, window pages,
          KV usage): soak-BACKEND.csv, .png, .md (and -failures.csv)
  tp2     a Qwen3-architecture checkpoint (8 KV heads, head_dim 128) written once with a fixed
          seed, served at TP=1 and TP=2 with FLASH_ATTN and with OSCAR (per-layer and per-head
          rotations): OSCAR's TP=2 against TP=1 agreement against FLASH_ATTN's; each rank's capacity
  plan    the load mix's sizes, without a GPU
  client-rate  streamed chunks a second one process of this client reads from a local server
          (CPU): what the soak's client can take

The SmolLM2 model folder comes from `tests/gpu/e2e_vllm.py prepare`; the text is the evaluation
corpus (OSCAR_CORPUS_DIR).
"""
from __future__ import annotations

import argparse
import asyncio
import functools
import gc
import json
import os
import signal
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from e2e_vllm import oscar_config, oscar_settings_in_use  # noqa: E402  (one engine configuration for both)
from load_mix import (  # noqa: E402
    Reply,
    Request,
    build_mix,
    compare,
    failure_summary,
    growth,
    identical_runs,
    mix_summary,
    pick_alone,
    prometheus_value,
    soak_rows,
    token_id,
    window_pages_logged,
)

REPO = Path(__file__).resolve().parents[2]
SERVED_NAME = "model"
CAPTURE_SIZES = [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128]  # batches 7, 25, 45, 123 run padded; 200 runs uncaptured
GRAPH_BATCHES = [1, 7, 25, 45, 123, 200]
BACKENDS = ("FLASH_ATTN", "OSCAR")
# vLLM's server closes a kept-alive connection after VLLM_HTTP_TIMEOUT_KEEP_ALIVE (5 s by default)
# idle, and a request written on a connection the server is closing that moment fails (ReadError,
# BrokenPipeError). The client lets go of idle connections after 2 s, and the servers the harness
# starts keep them 60 s: a client whose one event loop is busy starting 256 requests may take
# seconds to write one on a connection it took from the pool (the load check's first request, on
# both backends, 2026-12-02). Production clients retry such errors (openai's max_retries); the
# harness sends each request once, so that every failure it counts is the server's.
CLIENT_KEEPALIVE_S = 2.0
SERVER_KEEPALIVE_S = 60
LAG_TICK_S = 0.1  # the soak's client measures how late its event loop wakes from sleeps this long


def result(**kw) -> dict:
    """One JSON line with what a check measured, and where and when (as tests/gpu/e2e_vllm.py)."""
    from oscar_vllm.calibration.evaluate import environment

    line = {**kw, **environment("tests/gpu/serve_load.py")}
    print("RESULT " + json.dumps(line), flush=True)
    return line


def text_ids(model: str) -> list[int]:
    """The evaluation corpus in the model's tokens."""
    from transformers import AutoTokenizer

    from oscar_vllm.calibration import corpus

    return corpus.tokenize(AutoTokenizer.from_pretrained(model), corpus.evaluation_text()).tolist()


def context_of(model: str, cap: int) -> int:
    config = json.loads((Path(model) / "config.json").read_text())
    return min(cap, int(config.get("max_position_embeddings", cap)))


# ---------------------------------------------------------------------------- a server


class Server:
    """``vllm serve`` in its own process group; its log in a file."""

    def __init__(self, model: str, backend: str, rotations: str, log: Path, port: int, context: int,
                 max_num_seqs: int, eager: bool, memory: float):
        self.log, self.port, self.backend = log, port, backend
        args = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", model, "--served-model-name", SERVED_NAME,
                "--attention-backend", backend, "--dtype", "bfloat16",  # the prepared folder says float32
                "--max-model-len", str(context), "--max-num-seqs", str(max_num_seqs),
                "--gpu-memory-utilization", str(memory), "--seed", "0", "--port", str(port),
                "--disable-uvicorn-access-log", "--uvicorn-log-level", "warning"]
        if eager:
            args.append("--enforce-eager")
        else:
            args += ["--compilation-config", json.dumps({"cudagraph_capture_sizes": CAPTURE_SIZES})]
        if backend == "OSCAR":
            args += ["--additional-config", json.dumps(oscar_config(rotations))]
        self.args = args
        self.env = dict(os.environ, VLLM_USE_FLASHINFER_SAMPLER="0",
                        VLLM_HTTP_TIMEOUT_KEEP_ALIVE=str(SERVER_KEEPALIVE_S))
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> "Server":
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "w") as f:
            self.proc = subprocess.Popen(self.args, stdout=f, stderr=subprocess.STDOUT, start_new_session=True,
                                         env=self.env)
        self.started = time.time()
        return self

    def wait_ready(self, timeout: float = 480) -> float:
        import httpx

        while True:
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    return time.time() - self.started
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None or time.time() - self.started > timeout:
                raise SystemExit(f"{self.backend} server did not come up (exit {self.proc.poll()}); its log ends:\n"
                                 + self.log_text()[-4000:])
            time.sleep(2)

    def metrics(self) -> str:
        import httpx

        return httpx.get(self.url + "/metrics", timeout=10).text

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")

    def rss_bytes(self) -> int:
        """Resident memory of the server's processes (API server, engine core, workers)."""
        import psutil

        try:
            root = psutil.Process(self.proc.pid)
        except psutil.Error:
            return 0
        total = 0
        for p in [root, *root.children(recursive=True)]:
            try:
                total += p.memory_info().rss
            except psutil.Error:
                pass
        return total

    def __exit__(self, *exc) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def gpu_memory_used() -> int | None:
    """Bytes in use on GPU 0 (all processes), from NVML: no CUDA context in this process."""
    try:
        import pynvml

        pynvml.nvmlInit()
        return int(pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(0)).used)
    except Exception:  # no NVML: the column stays empty
        return None


# ---------------------------------------------------------------------------- requests


def client_for(server: Server, timeout: float = 600):
    import httpx
    import openai

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None, keepalive_expiry=CLIENT_KEEPALIVE_S)
    return openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=timeout,
                              http_client=openai.DefaultAsyncHttpxClient(limits=limits, timeout=timeout))


def add_choice(replies: dict[int, Reply], choice) -> None:
    reply = replies[choice.index]
    reply.ids.extend(getattr(choice, "token_ids", None) or [])
    if choice.logprobs is not None and choice.logprobs.top_logprobs:
        reply.top.extend({token_id(k): v for k, v in (d or {}).items()} for d in choice.logprobs.top_logprobs)


def error_chain(e: BaseException, depth: int = 6) -> str:
    """An exception and what raised it: the openai client's ``APIConnectionError`` says only
    "Connection error."; the httpx and httpcore errors under it say whether the server refused,
    closed or timed out, and the socket error under those (a reset, a closed stream) which."""
    parts = []
    while e is not None and len(parts) < depth:
        parts.append(f"{type(e).__name__}: {e}")
        e = e.__cause__ or e.__context__
    return " <- ".join(parts)


async def send(client, req: Request, stream: bool | None = None) -> dict:
    """One request; for a ``cancel`` one, the connection is closed after ``cancel_after`` chunks."""
    stream = req.stream if stream is None else stream
    replies: dict[int, Reply] = defaultdict(Reply)
    t0 = time.perf_counter()
    try:
        if stream:
            response = await client.completions.create(model=SERVED_NAME, prompt=req.prompt, stream=True,
                                                       **req.sampling)
            chunks = 0
            async for chunk in response:
                for choice in chunk.choices:
                    add_choice(replies, choice)
                chunks += 1
                # A stream whose chunks are already buffered is read without giving the event loop
                # back; one that yields each chunk lets the other streams (and the pool) run.
                await asyncio.sleep(0)
                if req.kind == "cancel" and chunks >= req.cancel_after:
                    await response.close()
                    return {"index": req.index, "ok": True, "cancelled": True, "latency": time.perf_counter() - t0}
        else:
            response = await client.completions.create(model=SERVED_NAME, prompt=req.prompt, **req.sampling)
            for choice in response.choices:
                add_choice(replies, choice)
    except Exception as e:  # a failed request is a result, counted and shown
        return {"index": req.index, "ok": False, "error": error_chain(e)[:300], "latency": time.perf_counter() - t0}
    choices = [replies[i] for i in range(req.n)]
    ok = all(len(c.ids) == req.max_tokens for c in choices)
    return {"index": req.index, "ok": ok, "choices": choices, "latency": time.perf_counter() - t0,
            **({} if ok else {"error": f"lengths {[len(c.ids) for c in choices]}, asked {req.max_tokens}"})}


async def send_all(client, reqs: list[Request], concurrency: int) -> list[dict]:
    gate = asyncio.Semaphore(concurrency)

    async def one(r):
        async with gate:
            return await send(client, r)

    return await asyncio.gather(*(one(r) for r in reqs))


async def batch_call(client, prompts: list[list[int]], max_tokens: int) -> list[Reply]:
    """Prompts in one completion request (they reach the engine together), greedy."""
    response = await client.completions.create(
        model=SERVED_NAME, prompt=prompts, max_tokens=max_tokens, temperature=0.0, logprobs=5,
        extra_body={"ignore_eos": True, "return_token_ids": True, "return_tokens_as_token_ids": True})
    replies: dict[int, Reply] = defaultdict(Reply)
    for choice in response.choices:
        add_choice(replies, choice)
    return [replies[i] for i in range(len(prompts))]


async def idle_state(server: Server, client, timeout: float = 120) -> dict:
    """The KV cache usage vLLM reports and the window pages the OSCAR scheduler last logged, once
    nothing runs. An engine with no requests takes no steps, so its stats (and /metrics) keep
    what the last step saw, even after aborts since: a one-token request makes a step, after
    which the stats are current. Repeated until that step saw nothing else running."""
    t0 = time.time()
    while True:
        await send(client, Request(-1, [1, 2, 3, 4], 1, stream=False))
        await asyncio.sleep(1.5)
        m = await asyncio.to_thread(server.metrics)
        busy = ((prometheus_value(m, "vllm:num_requests_running") or 0)
                + (prometheus_value(m, "vllm:num_requests_waiting") or 0))
        if not busy:
            break
        if time.time() - t0 > timeout:
            return {"settled": False, "busy": busy}
    pages = window_pages_logged(await asyncio.to_thread(server.log_text))
    return {"settled": True, "kv_cache_usage": prometheus_value(m, "vllm:kv_cache_usage_perc"),
            "window_pages_last_logged": pages[-1] if pages else None,
            "window_pages_peak_logged": max(pages) if pages else None}


def replies_of(results: list[dict]) -> dict[int, list[Reply]]:
    return {r["index"]: r["choices"] for r in results if r.get("ok") and "choices" in r}


# ---------------------------------------------------------------------------- load


def graph_prompts(ids: list[int], sizes: list[int], seed: int = 7) -> dict[int, list[list[int]]]:
    import random

    rng = random.Random(seed)
    out = {}
    for b in sizes:
        lengths = [rng.randint(16, 400) for _ in range(b)]
        out[b] = [ids[(s := rng.randrange(0, len(ids) - n)):s + n] for n in lengths]
    return out


def repeat_prompts(mix: list[Request], count: int) -> list[list[int]]:
    """A mixed batch: prompts of the mix up to 2K tokens, several on shared system prompts."""
    shared = [r.prompt for r in mix if r.shared_prefix >= 0 and len(r.prompt) <= 3500][: count // 3]
    plain = [r.prompt for r in mix if r.shared_prefix < 0 and len(r.prompt) <= 2048]
    return (shared + plain)[:count]


async def load_phases(server: Server, args, mix, alone_reqs, graphs, repeats) -> dict:
    client = client_for(server)
    out: dict = {"baseline": await idle_state(server, client)}
    t0 = time.perf_counter()
    loaded = await send_all(client, mix, args.concurrency)
    out["load_seconds"] = round(time.perf_counter() - t0, 1)
    by_index = {r.index: r for r in mix}
    out["failed"] = [{"index": r["index"], "error": r.get("error"), "seconds": round(r["latency"], 3),
                      "stream": by_index[r["index"]].stream, "prompt_tokens": len(by_index[r["index"]].prompt)}
                     for r in loaded if not r["ok"]]
    out["cancelled"] = sum(bool(r.get("cancelled")) for r in loaded)
    out["after_load"] = await idle_state(server, client)
    # Cancellations alone: long streams closed after a few chunks, then idle again.
    ids = [t for r in mix for t in r.prompt[:200]]
    cancels = [Request(10_000 + i, ids[i * 97:i * 97 + 600], 1024, stream=True, kind="cancel", cancel_after=3 + i % 5)
               for i in range(args.cancel_only)]
    await send_all(client, cancels, len(cancels))
    out["after_cancel_only"] = await idle_state(server, client)
    t0 = time.perf_counter()
    alone = [await send(client, r, stream=False) for r in alone_reqs]
    out["alone_seconds"] = round(time.perf_counter() - t0, 1)
    out["alone_failed"] = sum(not r["ok"] for r in alone)
    batched = replies_of(loaded)
    alone_ok = {i: c for i, c in replies_of(alone).items() if i in batched}
    by_kind = {r.index: r.kind for r in alone_reqs}
    out["greedy"] = compare(batched, {i: c for i, c in alone_ok.items() if by_kind[i] == "greedy"})
    out["sampled"] = compare(batched, {i: c for i, c in alone_ok.items() if by_kind[i] == "sampled"})
    runs = [[c.ids for c in await batch_call(client, repeats, args.repeat_tokens)] for _ in range(args.repeats)]
    out["repeats"] = identical_runs(runs)
    out["graph_batches"] = {b: await batch_call(client, p, args.graph_tokens) for b, p in graphs.items()}
    out["rss_bytes"] = server.rss_bytes()
    await client.close()
    return out


def run_backend(backend: str, args, mix, alone_reqs, graphs, repeats, port: int) -> dict:
    out_dir = Path(args.out)
    common = dict(model=args.model, backend=backend, rotations=args.rotations, context=args.context,
                  max_num_seqs=args.concurrency, memory=args.gpu_memory_utilization)
    with Server(log=out_dir / f"server-{backend}-graphs.log", port=port, eager=False, **common) as server:
        started = server.wait_ready()
        res = asyncio.run(load_phases(server, args, mix, alone_reqs, graphs, repeats))
        res["start_seconds_graphs"] = round(started, 1)
    res["start_seconds_eager"] = "not started"
    res["graphs_vs_eager"] = {}
    if not graphs:  # --graph-batches with no sizes: no eager server
        del res["graph_batches"]
        return res
    with Server(log=out_dir / f"server-{backend}-eager.log", port=port + 1, eager=True, **common) as server:
        res["start_seconds_eager"] = round(server.wait_ready(), 1)

        async def eager_batches():
            client = client_for(server)
            replies = {b: await batch_call(client, p, args.graph_tokens) for b, p in graphs.items()}
            await client.close()
            return replies

        eager = asyncio.run(eager_batches())
    res["graphs_vs_eager"] = {  # keyed by str(batch), as the results read back from JSON are
        str(b): compare({i: [r] for i, r in enumerate(res["graph_batches"][b])},
                        {i: [r] for i, r in enumerate(eager[b])})
        for b in graphs}
    del res["graph_batches"]
    return res


def load_checks(results: dict[str, dict]) -> list[str]:
    """What must hold; each failure as a sentence."""
    failures = []
    for backend, r in results.items():
        if r["failed"]:
            failures.append(f"{backend}: {len(r['failed'])} requests failed, first {r['failed'][0]}")
        for phase in ("after_load", "after_cancel_only"):
            idle, base = r[phase], r["baseline"]
            if not idle.get("settled"):
                failures.append(f"{backend} {phase}: requests still running")
            elif idle["kv_cache_usage"] is None or idle["kv_cache_usage"] > (base["kv_cache_usage"] or 0) + 1e-9:
                failures.append(f"{backend} {phase}: KV cache usage {idle['kv_cache_usage']}, "
                                f"idle {base['kv_cache_usage']}")
            if backend == "OSCAR" and idle.get("window_pages_last_logged") not in (0, None):
                failures.append(f"OSCAR {phase}: {idle['window_pages_last_logged']} window pages still held")
        if backend == "OSCAR" and r["after_load"].get("window_pages_peak_logged") in (0, None):
            failures.append("OSCAR: the server never logged window pages in use under load")
    if set(BACKENDS) <= set(results):
        o, f = results["OSCAR"], results["FLASH_ATTN"]
        for kind in ("greedy", "sampled"):
            if o[kind]["far"] > f[kind]["far"]:
                failures.append(f"{kind}: {o[kind]['far']} OSCAR replies diverge from alone at a token that is no "
                                f"near tie, FLASH_ATTN {f[kind]['far']}")
            if o[kind]["mismatch_rate"] > f[kind]["mismatch_rate"] + 0.05:
                failures.append(f"{kind}: OSCAR mismatch rate {o[kind]['mismatch_rate']:.3f} against alone, "
                                f"FLASH_ATTN {f[kind]['mismatch_rate']:.3f}")
        if o["repeats"]["identical_every_time"] < f["repeats"]["identical_every_time"]:
            failures.append(f"repeats: OSCAR {o['repeats']['identical_every_time']} of {o['repeats']['requests']} "
                            f"identical every time, FLASH_ATTN {f['repeats']['identical_every_time']}")
        for b in [b for b in o["graphs_vs_eager"] if b in f["graphs_vs_eager"]]:
            og, fg = o["graphs_vs_eager"][b], f["graphs_vs_eager"][b]
            if og["far"] > fg["far"] or og["equal"] + 2 < fg["equal"]:
                failures.append(f"batch {b}: OSCAR graphs vs eager {og['equal']} equal, {og['far']} far; "
                                f"FLASH_ATTN {fg['equal']} equal, {fg['far']} far")
    return failures


def load_markdown(results: dict, mix_info: dict, failures: list[str], meta: dict) -> str:
    lines = ["# Server under load: OSCAR and FLASH_ATTN through the same test", "",
             f"{meta['date']}, {meta['hardware']}, `{meta['command']}`; {meta['versions']}", "",
             f"Mix: {json.dumps(mix_info)}", "",
             f"OSCAR settings (rotations aside): {json.dumps(oscar_settings_in_use())}", "",
             "| | " + " | ".join(results) + " |", "|---|" + "---|" * len(results)]

    def row(name, f):
        lines.append(f"| {name} | " + " | ".join(str(f(r)) for r in results.values()) + " |")

    row("server start, graphs / eager (s)", lambda r: f"{r['start_seconds_graphs']} / {r['start_seconds_eager']}")
    row("load pass (s)", lambda r: r["load_seconds"])
    row("failed requests", lambda r: len(r["failed"]))
    row("cancelled mid-stream", lambda r: r["cancelled"])
    for kind in ("greedy", "sampled"):
        row(f"{kind}: equal / near tie / far (of compared)",
            lambda r, k=kind: f"{r[k]['equal']} / {r[k]['close']} / {r[k]['far']} ({r[k]['compared']})")
        row(f"{kind}: mismatch rate", lambda r, k=kind: f"{r[k]['mismatch_rate']:.3f}")
        row(f"{kind}: first divergences at", lambda r, k=kind: r[k]["first_divergence_positions"][:12])
    for phase in ("baseline", "after_load", "after_cancel_only"):
        row(f"{phase}: KV usage, window pages logged",
            lambda r, p=phase: f"{r[p].get('kv_cache_usage')}, {r[p].get('window_pages_last_logged')}")
    row("window pages, peak logged", lambda r: r["after_load"].get("window_pages_peak_logged"))
    row("same batch 20 times: requests identical every time",
        lambda r: f"{r['repeats']['identical_every_time']} of {r['repeats']['requests']}")
    # repeat_prompts puts the shared-system-prompt requests first: their indices say whether
    # prefix-cache hits are among the causes.
    row("same batch 20 times: requests that differed (the first third on shared system prompts)",
        lambda r: r["repeats"].get("differing_requests", "not recorded"))
    for b in dict.fromkeys(b for r in results.values() for b in r["graphs_vs_eager"]):
        row(f"graphs vs eager, batch {b}: equal / near tie / far",
            lambda r, b=b: "not run" if b not in r["graphs_vs_eager"] else
            f"{r['graphs_vs_eager'][b]['equal']} / {r['graphs_vs_eager'][b]['close']} / "
            f"{r['graphs_vs_eager'][b]['far']}")
    row("server RSS after the phases (GiB)", lambda r: f"{r['rss_bytes'] / 2**30:.2f}")
    verdict = "all passed" if not failures else "FAILED: " + "; ".join(failures)
    if not set(BACKENDS) <= set(results):
        # Far divergences, mismatch rates, repeats and graphs against eager are judged against
        # FLASH_ATTN's in the same test: with one backend only its own bookkeeping was checked.
        verdict += " (only what needs no FLASH_ATTN: the comparisons with it were not made)"
    lines += ["", "Checks: " + verdict, ""]
    return "\n".join(lines)


def cmd_load(args) -> None:
    ids = text_ids(args.model)
    args.context = context_of(args.model, args.max_model_len)
    mix = build_mix(ids, args.requests, args.context, seed=args.seed, cancelled=args.cancelled)
    alone_reqs = pick_alone(mix, args.alone, seed=args.seed)
    graphs = graph_prompts(ids, args.graph_batches)
    repeats = repeat_prompts(mix, args.repeat_batch)
    out, keep = Path(args.out), Path(args.keep)
    out.mkdir(parents=True, exist_ok=True)
    keep.mkdir(parents=True, exist_ok=True)
    info = mix_summary(mix)
    info.update(alone=len(alone_reqs), seed=args.seed, concurrency=args.concurrency)
    results = {}
    for k, backend in enumerate(args.backends):
        print(f"load: {backend}", flush=True)
        results[backend] = run_backend(backend, args, mix, alone_reqs, graphs, repeats, port=8100 + 10 * k)
        results[backend]["mix"] = info
        for folder in (out, keep):
            (folder / f"load-{backend}.json").write_text(json.dumps(results[backend], indent=1))
    for backend in BACKENDS:  # the other backend from an earlier call of this stage, if it sent the same mix
        earlier = keep / f"load-{backend}.json"
        if backend not in results and earlier.exists() and json.loads(earlier.read_text()).get("mix") == info:
            results[backend] = json.loads(earlier.read_text())
            print(f"load: {backend} from {earlier} (an earlier run of the same mix)", flush=True)
    results = {b: results[b] for b in BACKENDS if b in results}
    failures = load_checks(results)
    summary = {b: {k: v for k, v in r.items() if k not in ("failed",)} | {"failed": len(r["failed"])}
               for b, r in results.items()}
    meta = result(check="load", mix=info, backends=summary, failures=failures)
    (out / "load.md").write_text(load_markdown(results, info, failures, meta))
    if failures:
        raise SystemExit("load: " + "; ".join(failures))


def cmd_plan(args) -> None:
    """The mix's sizes (no GPU): what a load run will send."""
    ids = text_ids(args.model)
    context = context_of(args.model, args.max_model_len)
    mix = build_mix(ids, args.requests, context, seed=args.seed, cancelled=args.cancelled)
    alone = pick_alone(mix, args.alone, seed=args.seed)
    info = mix_summary(mix)
    info.update(context=context, alone=len(alone), alone_output_tokens=sum(r.max_tokens * r.n for r in alone))
    print(json.dumps(info, indent=1))


# ---------------------------------------------------------------------------- soak


class ClientHealth:
    """The client's own health between two ``take()`` calls: the share of a core its process used,
    and how late its event loop woke at worst. A client whose one loop falls behind reads no stream
    for that long and leaves pooled connections idle (what the 2026-12-02 soak's stalls looked like)."""

    def __init__(self, tick: float = LAG_TICK_S):
        self.tick, self.stall = tick, 0.0
        self.wall, self.cpu = time.perf_counter(), time.process_time()

    async def watch(self, stop_at: float) -> None:
        while time.perf_counter() < stop_at:
            t = time.perf_counter()
            await asyncio.sleep(self.tick)
            self.stall = max(self.stall, time.perf_counter() - t - self.tick)

    def take(self) -> dict:
        wall, cpu = time.perf_counter(), time.process_time()
        out = {"client_cpu": (cpu - self.cpu) / max(1e-9, wall - self.wall), "client_stall_s": self.stall}
        self.wall, self.cpu, self.stall = wall, cpu, 0.0
        return out


async def soak_load(server: Server, args, mix: list[Request]) -> tuple[list[dict], list[dict], dict]:
    client = client_for(server)
    baseline = await idle_state(server, client)
    events: list[dict] = []
    samples: list[dict] = []
    t_start = time.perf_counter()
    stop_at = t_start + 60 * args.minutes
    counter = iter(range(10**9))

    async def worker():
        while time.perf_counter() < stop_at and server.proc.poll() is None:
            r = mix[next(counter) % len(mix)]
            res = await send(client, r)
            events.append({"end": time.perf_counter() - t_start, "latency": res["latency"], "ok": res["ok"],
                           "cancelled": bool(res.get("cancelled")), "error": res.get("error"), "index": r.index,
                           "kind": r.kind, "stream": r.stream, "prompt_tokens": len(r.prompt),
                           "max_tokens": r.max_tokens})
            if not res["ok"]:
                await asyncio.sleep(1)  # a failing server is not hammered

    def readings() -> dict:
        try:
            m = server.metrics()
        except Exception:  # the server is gone: its row says so with empty readings
            m = ""
        pages = window_pages_logged(server.log_text())
        return {"gpu_memory_gib": (gpu_memory_used() or 0) / 2**30, "server_rss_gib": server.rss_bytes() / 2**30,
                "window_pages": pages[-1] if pages else None,
                "kv_cache_usage": prometheus_value(m, "vllm:kv_cache_usage_perc"),
                "running": prometheus_value(m, "vllm:num_requests_running")}

    health = ClientHealth()

    async def sampler():
        k = 1
        while True:
            await asyncio.sleep(max(0.0, t_start + k * args.interval - time.perf_counter()))
            client = health.take()
            # In a thread: the workers' streams keep being read while /metrics answers.
            samples.append({"t": time.perf_counter() - t_start, **client, **await asyncio.to_thread(readings)})
            k += 1
            if time.perf_counter() >= stop_at:
                return

    await asyncio.gather(sampler(), health.watch(stop_at), *(worker() for _ in range(args.concurrency)))
    idle = await idle_state(server, client)
    await client.close()
    return events, samples, {"baseline": baseline, "idle": idle}


def soak_plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = [r["minute"] for r in rows]
    fig, axes = plt.subplots(2, 2, figsize=(11, 7), sharex=True)
    ax = axes[0][0]
    ax.plot(x, [r["completed"] for r in rows], "o-", label="completed")
    ax.plot(x, [r["failed"] for r in rows], "x-", color="red", label="failed")
    ax.set_ylabel("requests per interval")
    ax.legend()
    ax = axes[0][1]
    ax.plot(x, [r["p50_s"] for r in rows], "o-", label="p50")
    ax.plot(x, [r["p99_s"] for r in rows], "o-", label="p99")
    if any("client_stall_s" in r for r in rows):  # the client's longest event-loop stall: its own delay
        ax.plot(x, [r.get("client_stall_s") or 0 for r in rows], "^:", color="black", label="client stall (longest)")
    ax.set_ylabel("latency (s)")
    ax.legend()
    ax = axes[1][0]
    ax.plot(x, [r["gpu_memory_gib"] for r in rows], "o-", label="GPU memory used")
    ax.plot(x, [r["server_rss_gib"] for r in rows], "o-", label="server RSS")
    ax.set_ylabel("GiB")
    ax.set_ylim(bottom=0)
    ax.legend()
    ax = axes[1][1]
    ax.plot(x, [r["window_pages"] or 0 for r in rows], "o-", label="window pages held (last logged)")
    ax.set_ylabel("blocks")
    ax2 = ax.twinx()
    ax2.plot(x, [100 * (r["kv_cache_usage"] or 0) for r in rows], "s--", color="gray", label="KV cache usage")
    ax2.set_ylabel("KV cache usage (%)")
    ax.legend(loc="upper left")
    for a in axes[1]:
        a.set_xlabel("minutes")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def failures_table(groups: list[dict]) -> list[str]:
    """Markdown lines for ``failure_summary``'s groups (none when nothing failed)."""
    if not groups:
        return []
    lines = ["Failed requests by error (seconds from the start; how long they had run):", "",
             "| error | count | streamed | first, last end (s) | ran p50, max (s) |", "|---|---|---|---|---|"]
    for g in groups:
        lines.append(f"| {g['error'].replace('|', '/')} | {g['count']} | {g['streamed']} | {g['first_end_s']:.1f}, "
                     f"{g['last_end_s']:.1f} | {g['latency_p50_s']:.2f}, {g['latency_max_s']:.2f} |")
    return [*lines, ""]


def soak_title(backend: str, concurrency: int, minutes: float) -> str:
    return f"{backend} soak, SmolLM2-135M, concurrency {concurrency}, {minutes} min"


def soak_markdown(meta: dict) -> str:
    """The soak's report from its RESULT record (``cmd_soak``); the plot is ``soak-BACKEND.png`` beside it."""
    rows, checks, failures = meta["rows"], meta["checks"], meta["failures"]
    table = ["| minute | completed | failed | p50 (s) | p99 (s) | GPU memory (GiB) | server RSS (GiB) | window pages "
             "| KV usage | client CPU | client stall (s) |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        stall = r.get("client_stall_s")
        table.append(f"| {r['minute']} | {r['completed']} | {r['failed']} | {r['p50_s'] or 0:.2f} "
                     f"| {r['p99_s'] or 0:.2f} "
                     f"| {r['gpu_memory_gib']:.2f} | {r['server_rss_gib']:.2f} | {r['window_pages']} "
                     f"| {100 * (r['kv_cache_usage'] or 0):.1f}% | {100 * r.get('client_cpu', 0):.0f}% "
                     f"| {'' if stall is None else f'{stall:.2f}'} |")
    idle = checks["idle"]
    return "\n".join([
        f"# Soak: {soak_title(meta['backend'], meta['concurrency'], meta['minutes'])}", "",
        f"{meta['date']}, {meta['hardware']}, `{meta['command']}`; {meta['versions']}; {meta['requests']} requests "
        f"({meta['cancelled']} closed mid-stream on purpose), server start {meta['start_seconds']} s", "",
        *table, "", f"Idle before: {json.dumps(idle['baseline'])}; idle after: {json.dumps(idle['idle'])}", "",
        *failures_table(checks.get("failures_by_error", [])),
        "Checks: " + ("all passed" if not failures else "FAILED: " + "; ".join(failures)), ""])


def write_csv(path: Path, rows: list[dict]) -> None:
    """``rows`` (dicts with the first one's keys) as a CSV file with a header."""
    import csv

    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def cmd_soak(args) -> None:
    ids = text_ids(args.model)
    args.context = context_of(args.model, args.max_model_len)
    mix = build_mix(ids, 4096, args.context, seed=args.seed, cancelled=64)
    for r in mix:  # a soak measures steady serving: outputs to 512, so requests keep turning over
        r.max_tokens = min(r.max_tokens, args.max_output)
        r.logprobs = False  # nothing is compared, and parsing them kept the client's one thread busy
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with Server(args.model, args.backend, args.rotations, out / f"server-soak-{args.backend}.log", 8200,
                args.context, args.concurrency, eager=False, memory=args.gpu_memory_utilization) as server:
        started = server.wait_ready()
        events, samples, idle = asyncio.run(soak_load(server, args, mix))
    rows = soak_rows(events, samples, args.interval)
    name = f"soak-{args.backend}"  # FLASH_ATTN's soak, the comparison, beside OSCAR's
    write_csv(out / f"{name}.csv", rows)
    failed = [e for e in events if not e["ok"]]
    if failed:
        write_csv(out / f"{name}-failures.csv", failed)
    checks = {"failed_requests": len(failed), "failures_by_error": failure_summary(events),
              "gpu_memory_growth_gib": growth(rows, "gpu_memory_gib"), "rss_growth_gib": growth(rows, "server_rss_gib"),
              "idle": idle}
    checks["client_stall_max_s"] = max((r.get("client_stall_s") or 0 for r in rows), default=0.0)
    failures = []
    if failed:
        failures.append(f"{len(failed)} requests failed, first: {failed[0]['error']} (the client's event loop stalled "
                        f"up to {checks['client_stall_max_s']:.1f} s)")
    if (checks["gpu_memory_growth_gib"] or 0) > 0.25:
        failures.append(f"GPU memory grew {checks['gpu_memory_growth_gib']:.2f} GiB after the first interval")
    rss = [r["server_rss_gib"] for r in rows[1:]]
    if len(rss) >= 2 and rss[-1] - rss[0] > max(0.5, 0.1 * rss[0]):
        failures.append(f"server RSS grew {rss[-1] - rss[0]:.2f} GiB after the first interval")
    if args.backend == "OSCAR" and idle["idle"].get("window_pages_last_logged") not in (0, None):
        failures.append(f"{idle['idle']['window_pages_last_logged']} window pages held when idle")
    base = idle["baseline"].get("kv_cache_usage") or 0
    if not idle["idle"].get("settled") or (idle["idle"].get("kv_cache_usage") or 0) > base + 1e-9:
        failures.append(f"KV cache usage when idle {idle['idle'].get('kv_cache_usage')}, at the start {base}")
    soak_plot(rows, out / f"{name}.png", soak_title(args.backend, args.concurrency, args.minutes))
    meta = result(check="soak", backend=args.backend, minutes=args.minutes, concurrency=args.concurrency,
                  start_seconds=round(started, 1), requests=len(events), cancelled=sum(e["cancelled"] for e in events),
                  rows=rows, checks=checks, failures=failures)
    (out / f"{name}.md").write_text(soak_markdown(meta))
    if failures:
        raise SystemExit("soak: " + "; ".join(failures))


# ---------------------------------------------------------------------------- client rate


def stand_in_app(chunk_yield: int = 8):
    """An OpenAI-style ``/v1/completions`` that streams ``max_tokens`` chunks (each with its token
    id, as vLLM sends them with ``return_token_ids``) as fast as it can: what the harness's
    client is measured against in ``client-rate``, never a stand-in for vLLM in a check."""
    from fastapi import FastAPI
    from fastapi.responses import StreamingResponse

    app = FastAPI()

    @app.post("/v1/completions")
    async def completions(body: dict):
        async def chunks():
            for i in range(body.get("max_tokens", 16)):
                choice = {"index": 0, "text": " x", "logprobs": None, "finish_reason": None, "token_ids": [i]}
                yield "data: " + json.dumps({"id": "c", "object": "text_completion", "created": 0,
                                             "model": SERVED_NAME, "choices": [choice]}) + "\n\n"
                if i % chunk_yield == 0:
                    await asyncio.sleep(0)
            yield "data: [DONE]\n\n"

        return StreamingResponse(chunks(), media_type="text/event-stream")

    return app


def cmd_stand_in_server(args) -> None:
    import uvicorn

    uvicorn.run(stand_in_app(), host="127.0.0.1", port=args.port, log_level="warning")


def cmd_client_rate(args) -> None:
    """How many streamed chunks a second this harness's client (one process, ``send``) reads, from
    a local server in another process that streams as fast as it can: the most a soak's client
    can take before its event loop falls behind (``ClientHealth``). CPU only."""
    import socket

    import httpx

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = subprocess.Popen([sys.executable, __file__, "stand-in-server", "--port", str(port)])
    try:
        for _ in range(300):
            try:
                httpx.get(f"http://127.0.0.1:{port}/docs", timeout=1)
                break
            except httpx.HTTPError:
                time.sleep(0.1)
        reqs = [Request(i, [1, 2, 3], args.tokens, stream=True, logprobs=False) for i in range(args.requests)]
        target = type("Target", (), {"url": f"http://127.0.0.1:{port}"})

        async def run():
            client = client_for(target)
            health = ClientHealth()
            watching = asyncio.create_task(health.watch(float("inf")))
            t0 = time.perf_counter()
            results = await send_all(client, reqs, args.concurrency)
            seconds = time.perf_counter() - t0
            watching.cancel()
            await client.close()
            return results, seconds, health.take()

        results, seconds, health = asyncio.run(run())
    finally:
        server.terminate()
        server.wait(timeout=30)
    chunks = sum(len(c.ids) for r in results if r["ok"] for c in r["choices"])
    meta = result(check="client-rate", requests=args.requests, concurrency=args.concurrency, tokens=args.tokens,
                  failed=sum(not r["ok"] for r in results), chunks=chunks, seconds=round(seconds, 2),
                  chunks_per_s=round(chunks / seconds), client_cpu=round(health["client_cpu"], 2),
                  client_stall_s=round(health["client_stall_s"], 3), cpus=os.cpu_count())
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "client_rate.md").write_text("\n".join([
            "# What one client process reads", "",
            f"{meta['date']}, {meta['hardware']} ({meta['cpus']} CPUs, the local server's process among their "
            f"users), `{meta['command']}`; {meta['versions']}", "",
            "| streams | concurrency | chunks each | failed | seconds | chunks/s | client CPU | client stall (s) |",
            "|---|---|---|---|---|---|---|---|",
            f"| {args.requests} | {args.concurrency} | {args.tokens} | {meta['failed']} | {meta['seconds']} "
            f"| {meta['chunks_per_s']:,} | {100 * meta['client_cpu']:.0f}% | {meta['client_stall_s']} |", ""]))


# ---------------------------------------------------------------------------- refuse


def refusal_engine(args) -> dict:
    """The engine every refusal case changes one thing of: small, eager, OSCAR."""
    return dict(model=args.model, attention_backend="OSCAR", additional_config=oscar_config(args.rotations),
                dtype="bfloat16", max_model_len=2048, max_num_seqs=8, gpu_memory_utilization=0.3, enforce_eager=True,
                seed=0)


def refusal_cases(args, scratch: Path) -> list[tuple[str, dict, str, dict]]:
    """(kind, LLM arguments, what the error must say, environment) per refusal."""
    from oscar_vllm.core.rotation_io import OscarRotations, hadamard_rotation_sets, load_rotations, save_rotations

    good = load_rotations(args.rotations)
    short = OscarRotations(*hadamard_rotation_sets(list(range(12)), 64))
    for rs in (short.key, short.value):  # one tensor per layer, as files hold them
        rs.rotations = {i: r.clone() for i, r in rs.rotations.items()}
        rs.eigenvalues = {i: e.clone() for i, e in rs.eigenvalues.items()}
    save_rotations(short, scratch / "twelve-layers")
    good.key.rotations[3] = good.key.rotations[3] * 1.01
    save_rotations(good, scratch / "not-orthogonal")
    swa = scratch / "sliding-window"
    swa.mkdir(exist_ok=True)
    for f in Path(args.model).iterdir():
        if f.name != "config.json" and not (swa / f.name).exists():
            (swa / f.name).symlink_to(f.resolve())
    (swa / "config.json").write_text(json.dumps({**json.loads((Path(args.model) / "config.json").read_text()),
                                                 "sliding_window": 1024}))
    oscar = oscar_config(args.rotations)["oscar"]
    return [
        ("rotations with the wrong layer count",
         {"additional_config": {"oscar": {**oscar, "rotation_path": str(scratch / "twelve-layers")}}},
         "missing layers 12-29", {}),
        ("non-orthogonal rotations",
         {"additional_config": {"oscar": {**oscar, "rotation_path": str(scratch / "not-orthogonal")}}},
         "layer 3 rotation is not orthogonal", {}),
        ("unknown setting", {"additional_config": {"oscar": {**oscar, "sink": 64}}}, "unknown OSCAR setting", {}),
        ("conflicting --kv-cache-dtype", {"kv_cache_dtype": "fp8"}, "--kv-cache-dtype fp8", {}),
        ("windows not whole pages", {"additional_config": {"oscar": {**oscar, "sink_size": 50}}}, "sink_size 50", {}),
        ("speculative decoding", {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3,
                                                         "prompt_lookup_max": 3}}, "speculative decoding", {}),
        ("V1 model runner", {}, "V1 model runner", {"VLLM_USE_V2_MODEL_RUNNER": "0"}),
        ("quantized weights", {"quantization": "fp8"}, "quantized weights (fp8)", {}),
        ("sliding window", {"model": str(swa)}, "sliding-window attention (window 1024)", {}),
    ]


def vllm_process_bytes(device_type: str = "cuda") -> int:
    """Bytes of ``device_type`` memory vLLM keeps for the rest of the process once it has built a
    model, whatever the attention backend and whether the engine then started: the RoPE modules
    ``get_rope`` caches process-wide (``_ROPE_DICT``), each with its cos/sin table (SmolLM2: 8,192
    positions x 64 dims in bf16, 1 MiB). A refusal is judged on what stays beyond them."""
    from vllm.model_executor.layers.rotary_embedding import _ROPE_DICT

    storages = {}
    for module in _ROPE_DICT.values():
        for t in [*module.buffers(), *module.parameters()]:
            if t.device.type == device_type:
                storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(storages.values())


def cmd_refuse(args) -> None:
    """Every refusal in this one process; torch's allocated GPU memory after each against the
    baseline (less what vLLM keeps process-wide once a model was built: ``vllm_process_bytes``),
    and the device's used memory for the record."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine in this process: its memory is ours to see
    import tempfile

    import torch
    from vllm import LLM
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.engine.llm_engine import LLMEngine

    torch.cuda.init()
    base_alloc = torch.cuda.memory_allocated()
    base_used = torch.cuda.mem_get_info()[1] - torch.cuda.mem_get_info()[0]
    scratch = Path(tempfile.mkdtemp(prefix="oscar-refuse-"))
    common = refusal_engine(args)
    rows, failures = [], []

    def attempt(start) -> str | None:
        """The error ``start()`` raises, as text: the exception and its traceback (which holds
        the frames, and so whatever the failed engine allocated) are gone when it returns."""
        try:
            start()
        except Exception as e:  # the refusal under test, with what it was raised from
            return error_chain(e, depth=4)
        return None

    def measure(kind: str, error: str | None, expect: str) -> None:
        gc.collect()
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info()
        row = {"kind": kind, "refused": error is not None and expect in error,
               "error": None if error is None else error[:500],
               "allocated_delta": torch.cuda.memory_allocated() - base_alloc,
               "vllm_process_bytes": vllm_process_bytes(),
               "device_used_delta_mib": round((total - free - base_used) / 2**20, 1)}
        rows.append(row)
        print(json.dumps(row), flush=True)
        if not row["refused"]:
            failures.append(f"{kind}: expected an error saying {expect!r}, got {row['error']}")
        left = row["allocated_delta"] - row["vllm_process_bytes"]
        if left:
            failures.append(f"{kind}: {left} bytes of GPU memory left allocated beyond vLLM's process-wide caches")

    for kind, kwargs, expect, env in refusal_cases(args, scratch):
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            error = attempt(lambda: LLM(**{**common, **kwargs}))
        finally:
            for k, v in saved.items():
                os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
        measure(kind, error, expect)
    # A worker that cannot read what the process that started vLLM could: the check passes on the
    # folder, which is gone when the engine's worker (in this process) loads the model.
    moved = scratch / "rotations"
    import shutil

    shutil.copytree(args.rotations, moved)
    config = EngineArgs(**{**common, "additional_config": oscar_config(str(moved))}).create_engine_config()
    shutil.rmtree(moved)
    # The worker refuses, its weights on the GPU. A partial, not a closure over `config`: once attempt
    # returns, only the name holds the config, and `del` drops it before the memory is measured.
    error = attempt(functools.partial(LLMEngine.from_vllm_config, config))
    del config
    measure("rotation path a worker cannot read (after loading the weights)", error,
            "vLLM worker (tensor-parallel rank 0) on host")
    meta = result(check="refuse", cases=rows, failures=failures)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    lines = ["# Bad input refused in one process, GPU memory after each", "",
             f"{meta['date']}, {meta['hardware']}, `{meta['command']}`", "",
             "| kind | refused by name | torch allocated after (bytes over baseline) | of which vLLM's process-wide "
             "RoPE tables | device used after (MiB over baseline) |",
             "|---|---|---|---|---|"]
    lines += [f"| {r['kind']} | {r['refused']} | {r['allocated_delta']} | {r['vllm_process_bytes']} | "
              f"{r['device_used_delta_mib']} |" for r in rows]
    lines += ["", "Checks: " + ("all passed" if not failures else "FAILED: " + "; ".join(failures)), ""]
    (out / "refuse.md").write_text("\n".join(lines))
    if failures:
        raise SystemExit("refuse: " + "; ".join(failures))


# ---------------------------------------------------------------------------- tp2

TP_CONFIG = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 1024, "intermediate_size": 2048,
    "num_hidden_layers": 4, "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
    "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "vocab_size": 8192,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "hidden_act": "silu", "attention_bias": False,
    "bos_token_id": 1, "eos_token_id": 2,
}


def write_tp_checkpoint(folder: Path, config: dict = TP_CONFIG, seed: int = 0) -> None:
    """The checkpoint, written once: weights drawn from a seeded generator, scaled so that the
    next-token distributions are peaked (greedy decoding then follows the model, not rounding)."""
    if (folder / "model.safetensors").exists():
        return
    import torch
    from safetensors.torch import save_file

    c = config
    g = torch.Generator().manual_seed(seed)
    h, d, hq, hkv, inter = (c["hidden_size"], c["head_dim"], c["num_attention_heads"], c["num_key_value_heads"],
                            c["intermediate_size"])

    def w(*shape, std):
        return (torch.randn(*shape, generator=g) * std).to(torch.bfloat16)

    tensors = {"model.embed_tokens.weight": w(c["vocab_size"], h, std=1.0),
               "model.norm.weight": torch.ones(h, dtype=torch.bfloat16),
               "lm_head.weight": w(c["vocab_size"], h, std=0.15)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        tensors.update({
            p + "self_attn.q_proj.weight": w(hq * d, h, std=h ** -0.5),
            p + "self_attn.k_proj.weight": w(hkv * d, h, std=h ** -0.5),
            p + "self_attn.v_proj.weight": w(hkv * d, h, std=h ** -0.5),
            p + "self_attn.o_proj.weight": w(h, hq * d, std=(hq * d) ** -0.5),
            p + "self_attn.q_norm.weight": torch.ones(d, dtype=torch.bfloat16),
            p + "self_attn.k_norm.weight": torch.ones(d, dtype=torch.bfloat16),
            p + "mlp.gate_proj.weight": w(inter, h, std=h ** -0.5),
            p + "mlp.up_proj.weight": w(inter, h, std=h ** -0.5),
            p + "mlp.down_proj.weight": w(h, inter, std=inter ** -0.5),
            p + "input_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
            p + "post_attention_layernorm.weight": torch.ones(h, dtype=torch.bfloat16)})
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(config, indent=1))


def write_tp_rotations(folder: Path, per_head: bool, seed: int = 1) -> None:
    """Seeded random orthogonal rotations in our format: per layer, or per KV head."""
    if (folder / "oscar_rotations.json").exists():
        return
    import torch

    from oscar_vllm.core.rotation_io import ModelShape, OscarRotations, RotationSet, save_rotations

    g = torch.Generator().manual_seed(seed + per_head)
    shape = ModelShape.from_hf_config(TP_CONFIG, name="qwen3-tp-seeded")
    lead = (shape.num_kv_heads,) if per_head else ()

    def orthogonal():
        q, r = torch.linalg.qr(torch.randn(*lead, shape.head_dim, shape.head_dim, generator=g, dtype=torch.float64))
        return (q * torch.sign(torch.diagonal(r, dim1=-2, dim2=-1)).unsqueeze(-2)).float()

    sets = [RotationSet(kind, objective, {i: orthogonal() for i in range(shape.num_layers)}, {})
            for kind, objective in (("key", "qqt_seeded_random"), ("value", "sst_seeded_random"))]
    save_rotations(OscarRotations(*sets, model=shape.name, model_fingerprint=dict(shape.fingerprint),
                                  calibration={"seeded_random_orthogonal": seed}), folder)


def rank_capacity(worker) -> dict:
    """What one rank reports: its KV cache memory and blocks (run in each worker by collective_rpc)."""
    import torch

    config = worker.model_runner.kv_cache_config
    block = config.kv_cache_groups[0].kv_cache_spec.block_size
    return {"rank": worker.rank,
            "available_kv_cache_gib": round(getattr(worker, "available_kv_cache_memory_bytes", 0) / 2**30, 3),
            "num_blocks": config.num_blocks, "kv_cache_tokens": config.num_blocks * block,
            "torch_allocated_gib": round(torch.cuda.memory_allocated() / 2**30, 3)}


def tp_prompts(seed: int = 3, count: int = 48) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(3, TP_CONFIG["vocab_size"])
             for _ in range(rng.choice((40, 63, 64, 65, 320, 321, 700, 1500)))]
            for _ in range(count)]


def cmd_tp2_run(args) -> None:
    """One engine (a subprocess of tp2): greedy outputs with top-5 logprobs, and each rank's capacity."""
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # collective_rpc with a function
    from vllm import LLM, SamplingParams

    kw = dict(additional_config=oscar_config(args.rotations)) if args.backend == "OSCAR" else {}
    llm = LLM(args.model, tensor_parallel_size=args.tp, attention_backend=args.backend, skip_tokenizer_init=True,
              max_model_len=4096, max_num_seqs=64, gpu_memory_utilization=args.gpu_memory_utilization,
              enforce_eager=not args.cuda_graphs, seed=0, **kw)
    params = SamplingParams(max_tokens=args.tokens, temperature=0, logprobs=5, ignore_eos=True, detokenize=False)
    outs = llm.generate([{"prompt_token_ids": p} for p in tp_prompts()], params, use_tqdm=False)
    replies = [{"ids": list(o.outputs[0].token_ids),
                "top": [{str(k): v.logprob for k, v in lp.items()} for lp in o.outputs[0].logprobs]} for o in outs]
    Path(args.out).write_text(json.dumps({"replies": replies, "ranks": llm.collective_rpc(rank_capacity)}))


def cmd_tp2(args) -> None:
    import torch

    if torch.cuda.device_count() < 2:
        raise SystemExit(f"tp2 needs 2 GPUs, this machine has {torch.cuda.device_count()}")
    work, out = Path(args.work), Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = work / "qwen3-tp-seeded"
    write_tp_checkpoint(model)
    rotations = {"per_layer": work / "qwen3-tp-rotations-layer", "per_head": work / "qwen3-tp-rotations-head"}
    for name, folder in rotations.items():
        write_tp_rotations(folder, per_head=name == "per_head")
    engines = [("FLASH_ATTN", None), ("OSCAR", "per_layer"), ("OSCAR", "per_head")]

    def launch(backend, rot, tp, gpus):
        path = out / f"tp{tp}-{backend}-{rot or 'none'}.json"
        cmd = [sys.executable, __file__, "tp2-run", "--model", str(model), "--backend", backend, "--tp", str(tp),
               "--rotations", str(rotations[rot]) if rot else "", "--out", str(path), "--tokens", str(args.tokens),
               "--gpu-memory-utilization", str(args.gpu_memory_utilization)]
        cmd += ["--cuda-graphs"] if args.cuda_graphs else []
        log = open(out / f"tp{tp}-{backend}-{rot or 'none'}.log", "w")
        env = dict(os.environ, CUDA_VISIBLE_DEVICES=gpus, VLLM_USE_FLASHINFER_SAMPLER="0")
        return path, subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)

    runs = {}
    t0 = time.time()
    for pair in (engines[:2], engines[2:]):  # TP=1 engines two at a time, one per GPU
        started = [(e, *launch(*e, 1, str(i))) for i, e in enumerate(pair)]
        for e, path, proc in started:
            if proc.wait() != 0:
                raise SystemExit(f"tp2: the TP=1 {e} engine failed; see {out}")
            runs[(e, 1)] = json.loads(path.read_text())
    for e in engines:
        path, proc = launch(*e, 2, "0,1")
        if proc.wait() != 0:
            raise SystemExit(f"tp2: the TP=2 {e} engine failed; see {out}")
        runs[(e, 2)] = json.loads(path.read_text())

    def replies(run):
        return {i: [Reply(r["ids"], [{int(k): v for k, v in t.items()} for t in r["top"]])]
                for i, r in enumerate(run["replies"])}

    agreement = {f"{b}{'' if r is None else ' ' + r}": compare(replies(runs[((b, r), 2)]), replies(runs[((b, r), 1)]))
                 for b, r in engines}
    capacity = {f"{b}{'' if r is None else ' ' + r} TP={tp}": runs[((b, r), tp)]["ranks"]
                for b, r in engines for tp in (1, 2)}
    fa = agreement["FLASH_ATTN"]
    failures = [f"{name}: TP=2 against TP=1 {a['equal']} equal, {a['far']} far; FLASH_ATTN {fa['equal']} equal, "
                f"{fa['far']} far" for name, a in agreement.items()
                if name != "FLASH_ATTN" and (a["far"] > fa["far"] or a["mismatch_rate"] > fa["mismatch_rate"] + 0.05)]
    meta = result(check="tp2", model=TP_CONFIG, agreement=agreement, capacity=capacity, cuda_graphs=args.cuda_graphs,
                  seconds=round(time.time() - t0, 1), failures=failures)
    lines = ["# Tensor parallelism 2 against 1, seeded Qwen3-architecture checkpoint", "",
             f"{meta['date']}, {meta['hardware']}, `{meta['command']}`; {meta['versions']}", "",
             f"4 layers, hidden 1024, 16 query heads, 8 KV heads, head_dim 128, vocab 8192, bf16; {len(tp_prompts())} "
             f"prompts of 40-1500 tokens, {args.tokens} greedy tokens each; "
             f"CUDA graphs {'on' if args.cuda_graphs else 'off'}.", "",
             "| engine | TP=2 vs TP=1: equal / near tie / far | mismatch rate | first divergences |",
             "|---|---|---|---|"]
    lines += [f"| {n} | {a['equal']} / {a['close']} / {a['far']} | {a['mismatch_rate']:.3f} | "
              f"{a['first_divergence_positions'][:10]} |" for n, a in agreement.items()]
    lines += ["", "| engine | rank | KV cache memory (GiB) | blocks | KV cache tokens |", "|---|---|---|---|---|"]
    lines += [f"| {n} | {r['rank']} | {r['available_kv_cache_gib']} | {r['num_blocks']} | {r['kv_cache_tokens']:,} |"
              for n, ranks in capacity.items() for r in ranks]
    lines += ["", "Checks: " + ("all passed" if not failures else "FAILED: " + "; ".join(failures)), ""]
    (out / "tp2.md").write_text("\n".join(lines))
    if failures:
        raise SystemExit("tp2: " + "; ".join(failures))


# ---------------------------------------------------------------------------- arguments


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tests/gpu/serve_load.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    for name in ("load", "plan", "soak", "refuse"):
        s = sub.add_parser(name)
        s.add_argument("--model", required=True, help="the SmolLM2 folder of `e2e_vllm.py prepare`")
        s.add_argument("--rotations", default="tests/data/smollm2_rotations",
                       help="OSCAR rotations for it (default: %(default)s)")
        s.add_argument("--out", default="results/reliability",
                       help="folder for the summary and data (default: %(default)s)")
        s.add_argument("--max-model-len", type=int, default=8192,
                       help="context, capped by the model's (default: %(default)s)")
        s.add_argument("--seed", type=int, default=0, help="the mix's seed (default: %(default)s)")
        s.add_argument("--gpu-memory-utilization", type=float, default=0.35, help="per server (default: %(default)s)")
    for name in ("load", "plan"):
        s = sub.choices[name]
        s.add_argument("--requests", type=int, default=512, help="requests of the load pass (default: %(default)s)")
        s.add_argument("--concurrency", type=int, default=256,
                       help="requests in flight, and the server's --max-num-seqs (default: %(default)s)")
        s.add_argument("--cancelled", type=int, default=8,
                       help="streams closed mid-way in the load pass (default: %(default)s)")
        s.add_argument("--alone", type=int, default=48,
                       help="requests sent alone too, to compare token for token (default: %(default)s)")
    s = sub.choices["load"]
    s.add_argument("--backends", nargs="+", choices=BACKENDS, default=list(BACKENDS),
                   help="(default: both, FLASH_ATTN first); a backend not run here is compared from --keep")
    s.add_argument("--keep", default="/tmp/oscar-e2e/load-results",
                   help="where each backend's results stay for a later call of the other (default: %(default)s)")
    s.add_argument("--cancel-only", type=int, default=16,
                   help="streams closed mid-way on an idle server (default: %(default)s)")
    s.add_argument("--repeats", type=int, default=20, help="times the same mixed batch is sent (default: %(default)s)")
    s.add_argument("--repeat-batch", type=int, default=24, help="prompts of that batch (default: %(default)s)")
    s.add_argument("--repeat-tokens", type=int, default=48, help="tokens each (default: %(default)s)")
    s.add_argument("--graph-batches", type=int, nargs="*", default=GRAPH_BATCHES,
                   help=f"batch sizes, CUDA graphs against eager; captured sizes {CAPTURE_SIZES}; none: no eager "
                        "server, for a quicker pass (default: %(default)s)")
    s.add_argument("--graph-tokens", type=int, default=32, help="tokens per request there (default: %(default)s)")
    s = sub.choices["soak"]
    s.add_argument("--minutes", type=float, default=8, help="how long the load runs (default: %(default)s)")
    s.add_argument("--interval", type=float, default=60, help="seconds per sample and table row (default: %(default)s)")
    s.add_argument("--concurrency", type=int, default=256, help="(default: %(default)s)")
    s.add_argument("--max-output", type=int, default=512, help="longest output of the soak mix (default: %(default)s)")
    s.add_argument("--backend", choices=BACKENDS, default="OSCAR", help="(default: %(default)s)")
    s = sub.add_parser("client-rate", help="streamed chunks/s one client process reads (CPU, a local server)")
    s.add_argument("--requests", type=int, default=512, help="(default: %(default)s)")
    s.add_argument("--concurrency", type=int, default=256, help="(default: %(default)s)")
    s.add_argument("--tokens", type=int, default=256, help="chunks per stream (default: %(default)s)")
    s.add_argument("--out", default="", help="folder for client_rate.md (default: none, the RESULT line only)")
    s = sub.add_parser("stand-in-server", help="client-rate's local server (internal)")
    s.add_argument("--port", type=int, required=True)
    s = sub.add_parser("tp2")
    s.add_argument("--work", default="/tmp/oscar-e2e",
                   help="where the checkpoint and rotations are written (default: %(default)s)")
    s.add_argument("--out", default="results/reliability", help="(default: %(default)s)")
    s.add_argument("--tokens", type=int, default=64, help="greedy tokens per prompt (default: %(default)s)")
    s.add_argument("--cuda-graphs", action="store_true",
                   help="serve with CUDA graphs (default: eager, quicker to start)")
    s.add_argument("--gpu-memory-utilization", type=float, default=0.4, help="(default: %(default)s)")
    s = sub.add_parser("tp2-run", help="one engine of tp2 (internal)")
    s.add_argument("--model", required=True)
    s.add_argument("--backend", required=True)
    s.add_argument("--tp", type=int, required=True)
    s.add_argument("--rotations", default="")
    s.add_argument("--out", required=True)
    s.add_argument("--tokens", type=int, default=64)
    s.add_argument("--cuda-graphs", action="store_true")
    s.add_argument("--gpu-memory-utilization", type=float, default=0.4)
    return p


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    globals()[f"cmd_{args.cmd.replace('-', '_')}"](args)


if __name__ == "__main__":
    main()
