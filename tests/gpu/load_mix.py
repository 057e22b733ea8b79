"""What the server checks (``serve_load.py``) send and how they judge the replies: plain Python,
no GPU, no vLLM, so the CPU tests run all of it (``tests/serving/test_load_mix.py``).

* :func:`build_mix`: the requests of the load test: prompt lengths from 10 tokens to the model's
  context (shorter than the sink, exactly 63/64/65 and 320/321 around the windows, whole
  blocks), outputs from 1 token to 2K, a third on long shared system prompts, half streamed,
  some ``n > 1`` (sampled, seeded: vLLM refuses ``n > 1`` with greedy decoding), a few cancelled
  mid-stream.
* :func:`compare`: each reply against the same request sent alone, token for token, as vLLM's
  ``check_outputs_equal``; where they differ, the first position and whether the two tokens
  there are in each other's top logprobs (``check_logprobs_close``: a near tie that floating
  point may flip) or not (a wrong read).
* Reading a server: Prometheus text (``/metrics``), the OSCAR window-pages log line.
* The soak's per-minute table.
"""
from __future__ import annotations

import math
import random
import re
from dataclasses import asdict, dataclass, field

SINK, RECENT, BLOCK = 64, 256, 64
# Prompt lengths every load test sends: shorter than the sink, around its end, around the end of
# the first ring (sink + recent = 320), whole blocks, and long ones.
SPECIAL_PROMPT_LENGTHS = (10, 17, 40, 63, 64, 65, 127, 128, 129, 255, 256, 257, 319, 320, 321, 383, 384, 448,
                          640, 1023, 1024, 1025, 1984, 2048, 3000, 4096, 6000)
# Output lengths: mostly short, as traffic is, and a few long ones (to 2K). (tokens, share)
OUTPUT_BUCKETS = ((1, 1, 0.05), (2, 16, 0.33), (17, 128, 0.35), (129, 512, 0.17), (513, 1024, 0.07),
                  (2048, 2048, 0.03))


@dataclass
class Request:
    """One request of the mix. ``prompt`` is token ids; ``kind``: ``greedy``, ``sampled`` (n > 1,
    seeded) or ``cancel`` (streamed, closed after ``cancel_after`` chunks)."""

    index: int
    prompt: list[int]
    max_tokens: int
    stream: bool
    kind: str = "greedy"
    n: int = 1
    shared_prefix: int = -1  # which system prompt it starts with, -1: none
    cancel_after: int = 0
    special: bool = False  # a prompt length from SPECIAL_PROMPT_LENGTHS (or the whole context)
    logprobs: bool = True  # the top 5 with every token, for comparing replies (a soak needs none)

    @property
    def sampling(self) -> dict:
        """The completion request's sampling fields (vLLM's extras included)."""
        base = {"max_tokens": self.max_tokens, **({"logprobs": 5} if self.logprobs else {}),
                "extra_body": {"ignore_eos": True, "return_token_ids": True, "return_tokens_as_token_ids": True}}
        if self.kind == "sampled":
            return {**base, "n": self.n, "temperature": 0.8, "top_p": 0.95, "seed": 1000 + self.index}
        return {**base, "temperature": 0.0}

    def to_dict(self) -> dict:
        return asdict(self)


def output_length(rng: random.Random) -> int:
    x, acc = rng.random(), 0.0
    for low, high, share in OUTPUT_BUCKETS:
        acc += share
        if x < acc:
            return rng.randint(low, high)
    return OUTPUT_BUCKETS[-1][1]


def build_mix(text_ids: list[int], requests: int, context: int, seed: int = 0, system_prompts: tuple = (1536, 3072),
              cancelled: int = 8, sampled_share: float = 0.08) -> list[Request]:
    """``requests`` requests over token ids ``text_ids`` (a long text), for a model of ``context``
    tokens. Prompts are slices of the text, so replies are about something; shared system
    prompts are the text's first tokens."""
    rng = random.Random(seed)
    need = max(context, sum(system_prompts)) + 1
    if len(text_ids) < need:
        raise ValueError(f"{len(text_ids)} text tokens; the mix needs {need}")
    systems = [text_ids[sum(system_prompts[:i]):sum(system_prompts[:i + 1])] for i in range(len(system_prompts))]
    out: list[Request] = []

    def piece(length: int) -> list[int]:
        start = rng.randrange(0, len(text_ids) - length)
        return text_ids[start:start + length]

    lengths = [n for n in SPECIAL_PROMPT_LENGTHS if n < context - 1]
    for i in range(requests):
        max_tokens = output_length(rng)
        shared = -1
        if i < len(lengths):  # every special length once, then the whole context once
            length, special = lengths[i], True
        elif i == len(lengths):
            length, special, max_tokens = context - 1, True, 1  # prompt + output = the model's context
        elif i % 3 == 0:
            shared = rng.randrange(len(systems))
            length, special = len(systems[shared]) + rng.randint(10, 400), False
        else:  # log-uniform from 10 tokens to the context
            length, special = int(math.exp(rng.uniform(math.log(10), math.log(context - 2)))), False
        if length + max_tokens > context:  # shorter output first; a prompt of the whole context keeps 1 token
            max_tokens = max(1, context - length)
            length = min(length, context - max_tokens)
        if shared >= 0 and length <= len(systems[shared]):  # a context too short for this system prompt
            shared, length = -1, min(length, context - max_tokens)
        prompt = systems[shared] + piece(length - len(systems[shared])) if shared >= 0 else piece(length)
        out.append(Request(i, prompt, max_tokens, stream=False, shared_prefix=shared, special=special))
    order = list(range(requests))
    rng.shuffle(order)
    for rank, i in enumerate(order):  # half streamed, whatever their lengths
        out[i].stream = rank % 2 == 0
    plain = [r for r in out if not r.special and r.max_tokens > 1]
    for r in rng.sample(plain, min(len(plain), max(1, round(sampled_share * requests)))):
        r.kind, r.n = "sampled", rng.choice((2, 3))
    long_streams = [r for r in out if r.kind == "greedy" and not r.special and r.stream]
    long_streams.sort(key=lambda r: -r.max_tokens)
    for r in long_streams[:cancelled]:
        r.kind, r.cancel_after = "cancel", rng.randint(2, 12)
        r.max_tokens = max(r.max_tokens, 512)
        if len(r.prompt) + r.max_tokens > context:
            r.prompt = r.prompt[:context - r.max_tokens]
    return out


def pick_alone(mix: list[Request], count: int, seed: int = 0) -> list[Request]:
    """The requests to send alone too: every special length, the sampled ones, shared-prefix
    ones, the longest outputs, then random ones, ``count`` in all (never cancelled ones)."""
    rng = random.Random(seed)
    pool = [r for r in mix if r.kind != "cancel"]
    chosen: dict[int, Request] = {}

    def take(rs, limit):
        for r in rs[:limit]:
            if len(chosen) < count:
                chosen.setdefault(r.index, r)

    take([r for r in pool if r.special], len(pool))
    take([r for r in pool if r.kind == "sampled"], 4)
    take([r for r in pool if r.shared_prefix >= 0], 8)
    take(sorted(pool, key=lambda r: -r.max_tokens), 2)
    rest = [r for r in pool if r.index not in chosen]
    rng.shuffle(rest)
    take(rest, len(rest))
    return sorted(chosen.values(), key=lambda r: r.index)


def mix_summary(mix: list[Request]) -> dict:
    prompt = [len(r.prompt) for r in mix]
    return {"requests": len(mix), "streamed": sum(r.stream for r in mix),
            "shared_prefix": sum(r.shared_prefix >= 0 for r in mix),
            "sampled_n_gt_1": sum(r.kind == "sampled" for r in mix),
            "cancelled": sum(r.kind == "cancel" for r in mix), "prompt_tokens": sum(prompt),
            "prompt_min_max": [min(prompt), max(prompt)], "output_tokens": sum(r.max_tokens * r.n for r in mix),
            "output_min_max": [min(r.max_tokens for r in mix), max(r.max_tokens for r in mix)],
            "special_lengths": sorted({len(r.prompt) for r in mix if r.special})}


# ---------------------------------------------------------------------------- comparing replies


@dataclass
class Reply:
    """One choice of a reply: token ids, and per position the top logprobs by token id."""

    ids: list[int] = field(default_factory=list)
    top: list[dict[int, float]] = field(default_factory=list)


def token_id(key: str) -> int:
    """``"token_id:123"`` (vLLM's ``return_tokens_as_token_ids``) -> 123."""
    return int(key.rsplit(":", 1)[1])


def first_divergence(a: Reply, b: Reply) -> dict | None:
    """None when ``a`` and ``b`` are equal token for token; else the first differing position, and
    whether it is a near tie (each side's token among the other's top logprobs), as vLLM's
    ``check_logprobs_close`` judges it. A length difference diverges where the shorter ends."""
    for i, (x, y) in enumerate(zip(a.ids, b.ids)):
        if x != y:
            close = (i < len(a.top) and i < len(b.top) and y in a.top[i] and x in b.top[i])
            return {"position": i, "close": close}
    if len(a.ids) != len(b.ids):
        return {"position": min(len(a.ids), len(b.ids)), "close": False}
    return None


def compare(batched: dict[int, list[Reply]], alone: dict[int, list[Reply]]) -> dict:
    """Replies of the same requests, batched and alone (request index -> choices): how many
    choices are equal, near ties, far apart, and where they first diverge."""
    equal = close = far = 0
    positions, far_cases = [], []
    for index in sorted(alone):
        for choice, (x, y) in enumerate(zip(batched[index], alone[index])):
            d = first_divergence(x, y)
            if d is None:
                equal += 1
                continue
            positions.append(d["position"])
            if d["close"]:
                close += 1
            else:
                far += 1
                far_cases.append({"request": index, "choice": choice, "position": d["position"]})
    total = equal + close + far
    return {"compared": total, "equal": equal, "close": close, "far": far,
            "mismatch_rate": 0.0 if total == 0 else (close + far) / total,
            "first_divergence_positions": sorted(positions), "far_cases": far_cases[:20]}


def identical_runs(runs: list[list[list[int]]]) -> dict:
    """Runs of the same batch (run -> request -> token ids): how many requests got the same reply
    every time, and which did not (their index in the batch)."""
    requests = len(runs[0])
    differing = [i for i in range(requests) if any(run[i] != runs[0][i] for run in runs)]
    differing_runs = sum(any(run[i] != runs[0][i] for i in range(requests)) for run in runs)
    return {"runs": len(runs), "requests": requests, "identical_every_time": requests - len(differing),
            "runs_differing": differing_runs, "differing_requests": differing}


# ---------------------------------------------------------------------------- reading a server


def prometheus_value(text: str, name: str) -> float | None:
    """The sum over label sets of metric ``name`` in Prometheus text, None if absent."""
    values = []
    for line in text.splitlines():
        if line.startswith(name) and (len(line) == len(name) or line[len(name)] in " {"):
            values.append(float(line.rsplit(" ", 1)[1]))
    return sum(values) if values else None


# oscar_vllm.serving.window_pages.USAGE_LOG, as it reaches a server's log
WINDOW_PAGES_LINE = re.compile(r"OSCAR window pages held: (\d+) blocks by (\d+) requests")


def window_pages_logged(log_text: str) -> list[int]:
    """Every window-pages count the server has logged, in order."""
    return [int(m[1]) for m in WINDOW_PAGES_LINE.finditer(log_text)]


def percentile(values: list[float], q: float) -> float | None:
    """The ``q`` quantile (0..1) by linear interpolation; None for no values."""
    if not values:
        return None
    xs = sorted(values)
    pos = q * (len(xs) - 1)
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def soak_rows(events: list[dict], samples: list[dict], interval: float) -> list[dict]:
    """Per interval (seconds from the start): requests completed and failed there (by end time),
    p50/p99 latency of those completed, and the resources sampled at its end.

    ``events``: {"end": s, "latency": s, "ok": bool}; ``samples``: {"t": s, ...resources}."""
    if not samples:
        return []
    rows = []
    for k, sample in enumerate(samples):
        start, end = k * interval, (k + 1) * interval
        done = [e for e in events if start <= e["end"] < end]
        ok = [e["latency"] for e in done if e["ok"]]
        rows.append({"minute": round(end / 60, 2), "completed": len(ok), "failed": len(done) - len(ok),
                     "p50_s": percentile(ok, 0.5), "p99_s": percentile(ok, 0.99),
                     **{k2: v for k2, v in sample.items() if k2 != "t"}})
    return rows


def failure_summary(events: list[dict]) -> list[dict]:
    """Failed requests grouped by their error (as recorded, up to 300 characters), most frequent first: how
    many, when the first and last ended (seconds from the start), how long they had run (median,
    longest; a request that fails at once never reached the server's reply), and how many were
    streamed. ``events``: {"end", "latency", "ok", "error", "stream"}."""
    groups: dict[str, list[dict]] = {}
    for e in events:
        if not e["ok"]:
            groups.setdefault((e.get("error") or "no error text")[:300], []).append(e)
    rows = []
    for error, es in groups.items():
        ends, lat = [e["end"] for e in es], [e["latency"] for e in es]
        rows.append({"error": error, "count": len(es), "first_end_s": min(ends), "last_end_s": max(ends),
                     "latency_p50_s": percentile(lat, 0.5), "latency_max_s": max(lat),
                     "streamed": sum(bool(e.get("stream")) for e in es)})
    return sorted(rows, key=lambda r: -r["count"])


def growth(rows: list[dict], key: str, skip: int = 1) -> float | None:
    """How much ``key`` grew from the first row after ``skip`` warm-up rows to the last."""
    values = [r[key] for r in rows[skip:] if r.get(key) is not None]
    return None if len(values) < 2 else values[-1] - values[0]
