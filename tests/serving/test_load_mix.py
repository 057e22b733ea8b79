"""The GPU reliability stages' logic on the CPU (tests/gpu/load_mix.py, tests/gpu/serve_load.py): the
request mix, comparing replies token for token, reading a server's metrics and OSCAR log line,
the soak's table and plot, what fails a run, and the TP=2 checkpoint and rotations."""
import importlib.util
import json
import logging
import sys
import time
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "gpu"))
import load_mix  # noqa: E402
from load_mix import (  # noqa: E402
    SPECIAL_PROMPT_LENGTHS,
    Reply,
    build_mix,
    compare,
    failure_summary,
    first_divergence,
    growth,
    identical_runs,
    percentile,
    pick_alone,
    prometheus_value,
    soak_rows,
    window_pages_logged,
)

TEXT = [(7 * i) % 30000 + 5 for i in range(40000)]


@pytest.fixture(scope="module")
def serve_load():
    spec = importlib.util.spec_from_file_location("serve_load", REPO / "tests" / "gpu" / "serve_load.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


def reply(ids, tops=None):
    return Reply(list(ids), [{t: -0.1} | {k: -1.0 for k in extra} for t, extra in zip(ids, tops or [()] * len(ids))])


# ---------------------------------------------------------------------------- comparing replies


def test_equal_replies_do_not_diverge():
    assert first_divergence(reply([1, 2, 3]), reply([1, 2, 3])) is None


def test_a_near_tie_is_close_and_a_wrong_token_is_far():
    # position 2: each side's token among the other's top logprobs -> a flip floating point allows
    a = reply([1, 2, 3, 9], tops=[(), (), (4,), ()])
    b = reply([1, 2, 4, 8], tops=[(), (), (3,), ()])
    assert first_divergence(a, b) == {"position": 2, "close": True}
    # only one side knows the other's token: far, as check_logprobs_close judges it
    b_far = reply([1, 2, 4, 8])
    assert first_divergence(a, b_far) == {"position": 2, "close": False}
    assert first_divergence(reply([5, 6]), reply([7, 6])) == {"position": 0, "close": False}


def test_a_shorter_reply_diverges_where_it_ends():
    assert first_divergence(reply([1, 2, 3]), reply([1, 2])) == {"position": 2, "close": False}
    assert first_divergence(Reply([1, 2], []), Reply([1, 3], [])) == {"position": 1, "close": False}


def test_compare_counts_every_choice():
    batched = {0: [reply([1, 2, 3])], 1: [reply([1, 2, 3], [(), (5,), ()]), reply([4, 4])], 2: [reply([9, 9, 9])],
               3: [reply([1])]}
    alone = {0: [reply([1, 2, 3])], 1: [reply([1, 5, 3], [(), (2,), ()]), reply([4, 4])], 2: [reply([9, 8, 9])]}
    c = compare(batched, alone)
    assert (c["compared"], c["equal"], c["close"], c["far"]) == (4, 2, 1, 1)
    assert c["mismatch_rate"] == 0.5 and c["first_divergence_positions"] == [1, 1]
    assert c["far_cases"] == [{"request": 2, "choice": 0, "position": 1}]
    assert compare({}, {})["mismatch_rate"] == 0.0


def test_identical_runs():
    runs = [[[1, 2], [3]], [[1, 2], [3]], [[1, 2], [4]]]
    assert identical_runs(runs) == {"runs": 3, "requests": 2, "identical_every_time": 1, "runs_differing": 1,
                                    "differing_requests": [1]}


# ---------------------------------------------------------------------------- the mix


def test_the_mix_covers_what_the_issue_lists():
    mix = build_mix(TEXT, 512, 8192, seed=0)
    assert len(mix) == 512 and [r.index for r in mix] == list(range(512))
    lengths = {len(r.prompt) for r in mix}
    assert set(SPECIAL_PROMPT_LENGTHS) <= lengths, "shorter than the sink, 63/64/65, 320/321, whole blocks"
    assert min(lengths) == 10 and any(len(r.prompt) + r.max_tokens == 8192 for r in mix), "10 tokens to the context"
    assert all(len(r.prompt) + r.max_tokens <= 8192 for r in mix)
    outputs = [r.max_tokens for r in mix]
    assert min(outputs) == 1 and max(outputs) == 2048
    shared = [r for r in mix if r.shared_prefix >= 0]
    assert 150 <= len(shared) <= 180, "a third on long shared system prompts"
    systems = {0: TEXT[:1536], 1: TEXT[1536:1536 + 3072]}
    assert all(r.prompt[:len(systems[r.shared_prefix])] == systems[r.shared_prefix] for r in shared)
    assert sum(r.stream for r in mix) == 256
    sampled = [r for r in mix if r.kind == "sampled"]
    assert 30 <= len(sampled) <= 50 and {r.n for r in sampled} == {2, 3}
    cancels = [r for r in mix if r.kind == "cancel"]
    assert len(cancels) == 8 and all(r.stream and r.max_tokens >= 512 and r.cancel_after >= 2 for r in cancels)
    again = build_mix(TEXT, 512, 8192, seed=0)
    assert [(r.prompt, r.max_tokens, r.stream, r.kind) for r in again] == [(r.prompt, r.max_tokens, r.stream, r.kind)
                                                                            for r in mix]


def test_the_mix_fits_a_short_context():
    mix = build_mix(TEXT, 100, 2048, seed=1)
    assert all(len(r.prompt) + r.max_tokens <= 2048 and r.max_tokens >= 1 for r in mix)
    assert all(len(r.prompt) > len(TEXT[:1536]) for r in mix if r.shared_prefix == 0)
    with pytest.raises(ValueError, match="text tokens"):
        build_mix(TEXT[:1000], 10, 2048)


def test_requests_ask_for_what_the_comparison_needs():
    greedy, sampled = load_mix.Request(0, [1], 5, False), load_mix.Request(1, [1], 5, True, kind="sampled", n=3)
    assert greedy.sampling["temperature"] == 0.0 and greedy.sampling["logprobs"] == 5
    assert greedy.sampling["extra_body"] == {"ignore_eos": True, "return_token_ids": True,
                                             "return_tokens_as_token_ids": True}
    assert sampled.sampling["n"] == 3 and sampled.sampling["seed"] == 1001 and sampled.sampling["temperature"] > 0
    assert load_mix.token_id("token_id:1234") == 1234
    quiet = load_mix.Request(2, [1], 5, True, logprobs=False)
    assert "logprobs" not in quiet.sampling and quiet.sampling["extra_body"] == greedy.sampling["extra_body"]


def test_the_client_lets_go_of_idle_connections_before_the_server_does(serve_load, monkeypatch, tmp_path):
    """vLLM closes a kept-alive connection after VLLM_HTTP_TIMEOUT_KEEP_ALIVE idle; a pooled
    connection the client still trusts then fails the request written on it (the soak's
    ReadErrors, the load check's first request). The servers the harness starts keep theirs
    longer than vLLM's default, and the client lets go first."""
    import asyncio

    import vllm.envs

    server = serve_load.Server("MODEL", "OSCAR", "ROT", tmp_path / "log", 8000, 4096, 8, eager=True, memory=0.5)
    monkeypatch.setenv("VLLM_HTTP_TIMEOUT_KEEP_ALIVE", server.env["VLLM_HTTP_TIMEOUT_KEEP_ALIVE"])
    server_keepalive = vllm.envs.VLLM_HTTP_TIMEOUT_KEEP_ALIVE  # as the server process reads it
    monkeypatch.delenv("VLLM_HTTP_TIMEOUT_KEEP_ALIVE")
    assert server_keepalive == serve_load.SERVER_KEEPALIVE_S > vllm.envs.VLLM_HTTP_TIMEOUT_KEEP_ALIVE
    client = serve_load.client_for(server)
    pool = client._client._transport._pool
    assert pool._keepalive_expiry == serve_load.CLIENT_KEEPALIVE_S < vllm.envs.VLLM_HTTP_TIMEOUT_KEEP_ALIVE
    assert pool._max_connections == sys.maxsize and client.max_retries == 0  # no cap: one per worker
    asyncio.run(client.close())


def test_the_requests_sent_alone_cover_every_kind():
    mix = build_mix(TEXT, 512, 8192, seed=0)
    alone = pick_alone(mix, 48)
    kinds = {r.index for r in alone}
    assert len(alone) == 48 and all(r.kind != "cancel" for r in alone)
    assert {r.index for r in mix if r.special} <= kinds
    assert any(r.kind == "sampled" for r in alone) and any(r.shared_prefix >= 0 for r in alone)
    assert max(r.max_tokens for r in alone) == 2048
    assert len(pick_alone(mix, 5)) == 5


# ---------------------------------------------------------------------------- reading a server


METRICS = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="model"} 3.0
vllm:num_requests_running_total{engine="0"} 99.0
vllm:kv_cache_usage_perc{engine="0",model_name="model"} 0.0125
vllm:num_requests_waiting{engine="0",model_name="model"} 0.0
"""


def test_metrics_are_read_by_exact_name():
    assert prometheus_value(METRICS, "vllm:num_requests_running") == 3.0
    assert prometheus_value(METRICS, "vllm:kv_cache_usage_perc") == 0.0125
    assert prometheus_value(METRICS, "vllm:num_requests_waiting") == 0.0
    assert prometheus_value(METRICS, "vllm:gpu_cache_usage_perc") is None


class Lines(logging.Handler):
    """The messages of one logger, each once (vLLM's loggers may or may not propagate)."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def test_the_window_pages_line_the_scheduler_logs_is_the_one_read():
    """The OSCAR scheduler's allocator on vLLM's real block pool (as tests/serving/test_window_pages.py
    drives it): a line when pages are first held, none while they change within the interval,
    and one at once when the last request gives them back."""
    pytest.importorskip("vllm")
    from test_window_pages import PAGES, admit, manager, request

    from oscar_vllm.serving import window_pages

    logger, lines = logging.getLogger("vllm.oscar_vllm"), Lines()
    level = logger.level
    logger.addHandler(lines)
    logger.setLevel(logging.INFO)
    try:
        kv, alloc = manager(40)
        admit(kv, request("a", list(range(130))), alloc)
        alloc.log_usage()
        admit(kv, request("b", list(range(500, 630))), alloc)
        alloc.log_usage()  # changed, but within the interval: no line
        kv.free(alloc.requests["a"])
        kv.free(alloc.requests["b"])  # the last pages back: a line at once
    finally:
        logger.removeHandler(lines)
        logger.setLevel(level)
    assert window_pages_logged("\n".join(lines.lines)) == [PAGES, 0], lines.lines
    assert window_pages_logged(window_pages.USAGE_LOG % (17, 2)) == [17]


def test_percentiles_and_growth():
    assert percentile([], 0.5) is None and percentile([3.0], 0.99) == 3.0
    assert percentile([1, 2, 3, 4], 0.5) == 2.5 and percentile(list(range(101)), 0.99) == pytest.approx(99.0)
    rows = [{"x": 9.0}, {"x": 1.0}, {"x": None}, {"x": 1.5}]
    assert growth(rows, "x") == 0.5 and growth(rows[:2], "x") is None


def test_soak_rows_per_interval():
    events = [{"end": 5, "latency": 1.0, "ok": True}, {"end": 50, "latency": 3.0, "ok": True},
              {"end": 59.9, "latency": 9.0, "ok": False}, {"end": 61, "latency": 2.0, "ok": True}]
    samples = [{"t": 60, "gpu_memory_gib": 10.0}, {"t": 120, "gpu_memory_gib": 10.0}]
    rows = soak_rows(events, samples, 60)
    assert rows[0] == {"minute": 1.0, "completed": 2, "failed": 1, "p50_s": 2.0, "p99_s": pytest.approx(2.98),
                       "gpu_memory_gib": 10.0}
    assert rows[1]["completed"] == 1 and rows[1]["minute"] == 2.0 and soak_rows(events, [], 60) == []


def test_failures_are_grouped_by_error(serve_load):
    reset = "APIConnectionError: Connection error. <- ReadError:  <- BrokenResourceError:  <- ConnectionResetError: x"
    events = [{"end": 5, "latency": 1.0, "ok": True, "stream": True},
              {"end": 70, "latency": 0.01, "ok": False, "error": reset, "stream": True},
              {"end": 30, "latency": 0.03, "ok": False, "error": reset, "stream": False},
              {"end": 80, "latency": 12.0, "ok": False, "error": "lengths [3], asked 9", "stream": True},
              {"end": 90, "latency": 4.0, "ok": False, "error": None}]
    groups = failure_summary(events)
    assert [g["count"] for g in groups] == [2, 1, 1] and groups[0]["error"] == reset
    assert (groups[0]["first_end_s"], groups[0]["last_end_s"], groups[0]["streamed"]) == (30, 70, 1)
    assert groups[0]["latency_p50_s"] == pytest.approx(0.02) and groups[0]["latency_max_s"] == 0.03
    assert {g["error"] for g in groups[1:]} == {"lengths [3], asked 9", "no error text"}
    assert failure_summary(events[:1]) == [] and serve_load.failures_table([]) == []
    table = serve_load.failures_table(groups)
    assert len(table) == 4 + 3 + 1 and "| 2 | 1 | 30.0, 70.0 | 0.02, 0.03 |" in table[4]


def test_the_soak_sees_its_client_stall(serve_load):
    """A loop blocked 0.3 s (as by parsing a burst of streams on one thread) shows as a stall of
    about that, and the busy wait as CPU; an idle stretch after it shows neither."""
    import asyncio

    async def run():
        health = serve_load.ClientHealth(tick=0.02)
        watching = asyncio.create_task(health.watch(time.perf_counter() + 1.0))
        await asyncio.sleep(0.05)
        cpu = time.process_time()
        while time.process_time() - cpu < 0.3:  # busy, not sleeping: the loop cannot wake the watcher
            pass
        await asyncio.sleep(0.05)
        busy = health.take()
        await asyncio.sleep(0.3)
        idle = health.take()
        await watching
        return busy, idle

    busy, idle = asyncio.run(run())
    # 0.3 s of the process's CPU: at least that long a stall, however busy the machine is.
    assert busy["client_stall_s"] >= 0.28 and busy["client_cpu"] > idle["client_cpu"]
    assert idle["client_stall_s"] < 0.2 and idle["client_cpu"] < 0.3


def test_the_soak_report_renders_from_its_record(serve_load):
    row = {"minute": 1.0, "completed": 9, "failed": 1, "p50_s": 2.0, "p99_s": None, "gpu_memory_gib": 50.0,
           "server_rss_gib": 3.0, "window_pages": 40, "kv_cache_usage": 0.5, "running": 7.0, "client_cpu": 0.93,
           "client_stall_s": 4.25}
    idle = {"settled": True, "kv_cache_usage": 0.0, "window_pages_last_logged": 0}
    meta = {"backend": "FLASH_ATTN", "concurrency": 256, "minutes": 1.0, "date": "d", "hardware": "h", "command": "c",
            "versions": "v", "requests": 10, "cancelled": 2, "start_seconds": 99.0, "rows": [row],
            "checks": {"idle": {"baseline": idle, "idle": idle},
                       "failures_by_error": failure_summary([{"end": 3, "latency": 1, "ok": False, "error": "E"}])},
            "failures": ["1 requests failed, first: E"]}
    text = serve_load.soak_markdown(meta)
    assert text.startswith("# Soak: FLASH_ATTN soak, SmolLM2-135M, concurrency 256, 1.0 min")
    assert "| 1.0 | 9 | 1 | 2.00 | 0.00 | 50.00 | 3.00 | 40 | 50.0% | 93% | 4.25 |" in text
    assert "| E | 1 | 0 | 3.0, 3.0 |" in text
    assert text.rstrip().endswith("FAILED: 1 requests failed, first: E") and "![" not in text


def test_the_soak_plot_is_written(serve_load, tmp_path):
    rows = [{"minute": m, "completed": 900, "failed": 0, "p50_s": 1.5, "p99_s": 6.0, "gpu_memory_gib": 50.0,
             "server_rss_gib": 3.1, "window_pages": 4000, "kv_cache_usage": 0.2, "running": 256} for m in (1, 2, 3)]
    serve_load.soak_plot(rows, tmp_path / "soak.png", "test")
    assert (tmp_path / "soak.png").read_bytes()[:4] == b"\x89PNG"
    for r in rows:
        r.update(client_cpu=0.9, client_stall_s=2.5)
    serve_load.soak_plot(rows, tmp_path / "soak-client.png", "test")
    assert (tmp_path / "soak-client.png").read_bytes()[:4] == b"\x89PNG"


# ---------------------------------------------------------------------------- the stages


def test_the_stages_parse_their_arguments(serve_load):
    parser = serve_load.build_parser()
    load = parser.parse_args(["load", "--model", "m"])
    assert (load.requests, load.concurrency, load.repeats, load.backends) == (512, 256, 20, ["FLASH_ATTN", "OSCAR"])
    assert load.graph_batches == [1, 7, 25, 45, 123, 200] and max(serve_load.CAPTURE_SIZES) < 200
    assert all(b > max(serve_load.CAPTURE_SIZES) or b in serve_load.CAPTURE_SIZES
               or any(c > b for c in serve_load.CAPTURE_SIZES) for b in load.graph_batches)
    soak = parser.parse_args(["soak", "--model", "m", "--minutes", "2", "--interval", "20"])
    assert (soak.minutes, soak.interval, soak.backend, soak.concurrency) == (2, 20, "OSCAR", 256)
    tp2 = parser.parse_args(["tp2"])
    assert tp2.tokens == 64 and not tp2.cuda_graphs
    assert parser.parse_args(["refuse", "--model", "m"]).rotations == "tests/data/smollm2_rotations"
    with pytest.raises(SystemExit):
        parser.parse_args(["load"])
    assert parser.parse_args(["load", "--model", "m", "--graph-batches"]).graph_batches == [], "no eager server"


def idle(usage, pages=None):
    return {"settled": True, "kv_cache_usage": usage, "window_pages_last_logged": pages, "window_pages_peak_logged": 40}


def backend_result(far=0, rate=0.1, usage_after=0.0, pages_after=0, identical=24, graphs_equal=5):
    comparison = {"compared": 40, "equal": 36, "close": 4 - far, "far": far, "mismatch_rate": rate,
                  "first_divergence_positions": [], "far_cases": []}
    return {"failed": [], "baseline": idle(0.0, 0), "after_load": idle(usage_after, pages_after),
            "after_cancel_only": idle(0.0, 0), "greedy": comparison,
            "sampled": {**comparison, "close": 4, "far": 0, "mismatch_rate": 0.1},
            "repeats": {"runs": 20, "requests": 24, "identical_every_time": identical, "runs_differing": 0},
            "graphs_vs_eager": {"7": {"equal": graphs_equal, "close": 0, "far": 0}}}


def test_what_fails_a_load_run(serve_load):
    checks = serve_load.load_checks
    assert checks({"FLASH_ATTN": backend_result(), "OSCAR": backend_result()}) == []
    failing = {
        "no near tie": backend_result(far=1),
        "mismatch rate": backend_result(rate=0.2),
        "KV cache usage": backend_result(usage_after=0.01),
        "window pages still held": backend_result(pages_after=40),
        "identical every time": backend_result(identical=23),
        "batch 7": backend_result(graphs_equal=2),
    }
    for words, oscar in failing.items():
        failures = checks({"FLASH_ATTN": backend_result(), "OSCAR": oscar})
        assert len(failures) == 1 and words in failures[0], (words, failures)
    broken = backend_result()
    broken["failed"] = [{"index": 3, "error": "APIConnectionError"}]
    assert "1 requests failed" in checks({"FLASH_ATTN": broken})[0]


def test_the_load_summary_renders(serve_load, monkeypatch):
    monkeypatch.setenv("OSCAR_PREFILL_READ", "decode")
    results = {b: {**backend_result(), "start_seconds_graphs": 60, "start_seconds_eager": 20, "load_seconds": 30,
                   "cancelled": 8, "rss_bytes": 3 * 2**30} for b in ("FLASH_ATTN", "OSCAR")}
    results["OSCAR"]["repeats"] = {**results["OSCAR"]["repeats"], "differing_requests": [2, 17]}
    meta = {"date": "2026-12-01 00:00 UTC", "hardware": "NVIDIA H200", "command": "serve_load.py load", "versions": "v"}
    text = serve_load.load_markdown(results, {"requests": 512}, [], meta)
    assert "| greedy: equal / near tie / far (of compared) | 36 / 4 / 0 (40) | 36 / 4 / 0 (40) |" in text
    assert ("| same batch 20 times: requests that differed (the first third on shared system prompts) "
            "| not recorded | [2, 17] |") in text
    assert '"prefill_read": "decode"' in text and '"sink_size": 64' in text and "rotation_path" not in text
    assert "Checks: all passed" in text
    # One backend alone: its own bookkeeping checked, and the line says the comparisons were not made.
    alone = serve_load.load_markdown({"OSCAR": results["OSCAR"]}, {"requests": 512}, [], meta)
    assert "Checks: all passed (only what needs no FLASH_ATTN: the comparisons with it were not made)" in alone
    # A run without the eager server (--graph-batches with no sizes) beside one with it.
    results["OSCAR"]["graphs_vs_eager"], results["OSCAR"]["start_seconds_eager"] = {}, "not started"
    assert serve_load.load_checks(results) == []
    text = serve_load.load_markdown(results, {"requests": 512}, [], meta)
    assert "| graphs vs eager, batch 7: equal / near tie / far | 5 / 0 / 0 | not run |" in text
    assert "| server start, graphs / eager (s) | 60 / 20 | 60 / not started |" in text


def test_the_tp2_checkpoint_has_the_weights_vllm_and_transformers_load(serve_load, tmp_path):
    transformers = pytest.importorskip("transformers")
    config = dict(serve_load.TP_CONFIG, hidden_size=64, intermediate_size=96, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=32, vocab_size=128, num_hidden_layers=2)
    serve_load.write_tp_checkpoint(tmp_path / "ckpt", config)
    from safetensors.torch import load_file

    written = load_file(str(tmp_path / "ckpt" / "model.safetensors"))
    model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**{k: v for k, v in config.items()
                                                                      if k not in ("architectures", "torch_dtype")}))
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    assert {k: tuple(v.shape) for k, v in written.items()} == expected
    again = tmp_path / "again"
    serve_load.write_tp_checkpoint(again, config)
    assert torch.equal(load_file(str(again / "model.safetensors"))["lm_head.weight"], written["lm_head.weight"]), \
        "a fixed seed: TP=1 and TP=2 load the same numbers wherever the file is written"
    assert json.loads((tmp_path / "ckpt" / "config.json").read_text()) == config


@pytest.mark.parametrize("per_head", [False, True])
def test_the_tp2_rotations_are_valid_for_the_checkpoint(serve_load, tmp_path, per_head):
    from oscar_vllm.core.rotation_io import ModelShape, load_rotations

    serve_load.write_tp_rotations(tmp_path, per_head)
    shape = ModelShape.from_hf_config(serve_load.TP_CONFIG, name="qwen3-tp-seeded")
    rot = load_rotations(tmp_path, shape)  # validates: orthogonal, every layer, 8 KV heads when per head
    assert rot.key.per_head == per_head and rot.key.rotations[0].shape[-1] == 128
    assert not torch.equal(rot.key.rotations[0], rot.value.rotations[0])


@pytest.fixture(scope="module")
def smollm2_configs(tmp_path_factory):
    """SmolLM2's config.json (no weights), and vLLM configs buildable on the CPU (benchmarks/vllm_cpu.py)."""
    pytest.importorskip("vllm")
    from benchmarks.vllm_cpu import SMOLLM2_CONFIG, vllm_configs_on_cpu

    folder = tmp_path_factory.mktemp("smollm2")
    (folder / "config.json").write_text(json.dumps(SMOLLM2_CONFIG))
    with vllm_configs_on_cpu() as engine_args:
        yield folder, engine_args


@pytest.mark.parametrize("eager", [False, True])
def test_the_load_servers_command_passes_vllms_parser_and_the_startup_checks(serve_load, smollm2_configs, tmp_path,
                                                                            eager):
    """The exact `vllm serve` command of the load and soak stages, parsed by vLLM's own parser and
    built into an engine config, with the committed SmolLM2 rotations."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.openai.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    folder, _ = smollm2_configs
    rotations = str(REPO / "tests" / "data" / "smollm2_rotations")
    server = serve_load.Server(str(folder), "OSCAR", rotations, tmp_path / "log", 8100, 8192, 256, eager, 0.35)
    args = make_arg_parser(FlexibleArgumentParser()).parse_args(server.args[server.args.index("serve") + 1:])
    args.model = args.model_tag
    config = AsyncEngineArgs.from_cli_args(args).create_engine_config()
    assert config.additional_config["oscar"]["rotation_path"] == rotations
    assert config.scheduler_config.max_num_seqs == 256 and config.model_config.max_model_len == 8192
    assert config.model_config.dtype == torch.bfloat16, "FLASH_ATTN serves no float32, the prepared folder's dtype"
    assert (config.compilation_config.cudagraph_capture_sizes or []) == ([] if eager else serve_load.CAPTURE_SIZES)


def test_the_refuse_stage_expects_what_the_startup_checks_say(serve_load, smollm2_configs, tmp_path, monkeypatch):
    """Every case of the GPU refuse stage but the last (a worker's), through the same startup checks
    on the CPU: each refused, with the words the stage looks for."""
    folder, engine_args = smollm2_configs
    args = serve_load.build_parser().parse_args(["refuse", "--model", str(folder), "--rotations",
                                                 str(REPO / "tests" / "data" / "smollm2_rotations")])
    common = serve_load.refusal_engine(args)
    engine_args(**common).create_engine_config()  # the unchanged engine passes
    cases = serve_load.refusal_cases(args, tmp_path)
    assert len(cases) >= 8
    for kind, kwargs, expect, env in cases:
        with monkeypatch.context() as m:
            for k, v in env.items():
                m.setenv(k, v)
            with pytest.raises(Exception) as info:
                engine_args(**{**common, **kwargs}).create_engine_config()
        assert expect in str(info.value), (kind, str(info.value))


def test_replies_are_read_from_vllms_responses_through_the_openai_types(serve_load):
    """vLLM's completion response and stream chunks (its own protocol classes, with the token ids
    and token-id logprobs the stages ask for), read back through the openai client's types as the
    client builds them (leniently: a chunk's finish_reason is null until the last)."""
    openai = pytest.importorskip("openai")
    pytest.importorskip("vllm")
    from vllm.entrypoints.openai.completion.protocol import (
        CompletionLogProbs,
        CompletionResponse,
        CompletionResponseChoice,
        CompletionResponseStreamChoice,
        CompletionStreamResponse,
    )
    from vllm.entrypoints.openai.engine.protocol import UsageInfo

    def logprobs(ids, alt):
        return CompletionLogProbs(tokens=[f"token_id:{i}" for i in ids], token_logprobs=[-0.1] * len(ids),
                                  top_logprobs=[{f"token_id:{i}": -0.1, f"token_id:{alt}": -2.0} for i in ids])

    response = CompletionResponse(model="model", usage=UsageInfo(prompt_tokens=3, completion_tokens=4), choices=[
        CompletionResponseChoice(index=i, text="", token_ids=ids, logprobs=logprobs(ids, 99))
        for i, ids in enumerate(([5, 6], [7, 8]))])
    replies = {0: Reply(), 1: Reply()}
    for choice in openai.types.Completion.construct(**json.loads(response.model_dump_json())).choices:
        serve_load.add_choice(replies, choice)
    assert replies[1].ids == [7, 8] and replies[1].top == [{7: -0.1, 99: -2.0}, {8: -0.1, 99: -2.0}]
    stream = Reply()
    for ids in ([1], [2, 3], []):
        chunk = CompletionStreamResponse(model="model", choices=[CompletionResponseStreamChoice(
            index=0, text="", token_ids=ids, logprobs=logprobs(ids, 42) if ids else None)])
        for choice in openai.types.Completion.construct(**json.loads(chunk.model_dump_json())).choices:
            serve_load.add_choice({0: stream}, choice)
    assert stream.ids == [1, 2, 3] and [sorted(t) for t in stream.top] == [[1, 42], [2, 42], [3, 42]]


def test_vllm_process_bytes_counts_the_cached_rope_tables(serve_load, monkeypatch):
    """What the refusal check forgives is exactly the RoPE tables vLLM caches for the process."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import _ROPE_DICT, get_rope
    from vllm.platforms import current_platform

    # VllmConfig() needs a device type, which a machine without a GPU lacks (the test passed
    # only after another had set one).
    monkeypatch.setattr(current_platform, "device_type", "cpu")
    before = serve_load.vllm_process_bytes("cpu")
    with set_current_vllm_config(VllmConfig()):
        rope = get_rope(64, 8191, dtype=torch.bfloat16)
    try:
        assert serve_load.vllm_process_bytes("cpu") - before == rope.cos_sin_cache.untyped_storage().nbytes()
        assert rope.cos_sin_cache.untyped_storage().nbytes() == 8191 * 64 * 2
        assert serve_load.vllm_process_bytes("cuda") == 0
    finally:
        for key in [k for k, v in _ROPE_DICT.items() if v is rope]:
            del _ROPE_DICT[key]


def test_a_failed_request_names_what_the_client_error_wraps(serve_load):
    """The load check's one failure on both backends was an ``APIConnectionError`` with no more
    said; a failed request now carries the errors under it and how long it took."""
    import asyncio

    class Refusing:
        class completions:
            @staticmethod
            async def create(**kwargs):
                try:
                    raise ConnectionResetError("peer closed the kept-alive connection")
                except ConnectionResetError as e:
                    raise RuntimeError("Connection error.") from e

    got = asyncio.run(serve_load.send(Refusing(), load_mix.Request(3, [1, 2, 3], 4, stream=False)))
    assert got["ok"] is False and got["index"] == 3 and got["latency"] >= 0
    assert got["error"] == ("RuntimeError: Connection error. <- ConnectionResetError: peer closed the "
                            "kept-alive connection")
    # The soak's failures said "ReadError:  <- ReadError: " and stopped: the socket error lies
    # deeper (openai -> httpx -> httpcore -> anyio -> OSError), and the chain now reaches it.
    err = None
    for name in ("ConnectionResetError", "BrokenResourceError", "ReadError", "ReadError", "APIConnectionError"):
        try:
            raise type(name, (Exception,), {})("" if "Read" in name or "Broken" in name else name) from err
        except Exception as e:
            err = e
    assert serve_load.error_chain(err).endswith(
        "<- BrokenResourceError:  <- ConnectionResetError: ConnectionResetError")


def test_client_rate_reads_every_chunk_of_a_local_server(tmp_path):
    """`serve_load.py client-rate` (what one process of the harness's client can read) runs on
    any machine: every chunk of every stream comes back through the harness's own send()."""
    import subprocess

    run = subprocess.run([sys.executable, str(REPO / "tests" / "gpu" / "serve_load.py"), "client-rate", "--requests",
                          "12", "--concurrency", "4", "--tokens", "9", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    line = json.loads(next(x for x in run.stdout.splitlines() if x.startswith("RESULT "))[len("RESULT "):])
    assert (line["failed"], line["chunks"]) == (0, 12 * 9) and line["chunks_per_s"] > 0
    assert f"| 12 | 4 | 9 | 0 | {line['seconds']} |" in (tmp_path / "client_rate.md").read_text()
