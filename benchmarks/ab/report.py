"""The report of an A/B run: ``ab.md`` (a table of every metric, each configuration's ratio to
FLASH_ATTN of the same run), ``ab.csv`` and ``ab.png`` from the workers' result files, of one run
or of several runs of one plan merged."""
from __future__ import annotations

import json
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

from .scenarios import BASELINE, CONFIGS, MEMORY_BOUND, SCENARIOS, scenario_sizes, tok


METRICS = [  # (scenario, field, label, higher is better; None: a count shown without a ratio), issue 18's order
    (None, "kv_cache_tokens", "KV cache capacity (tokens)", True),
    (None, "kv_tokens_all_running", "KV tokens left with all max_num_seqs requests running", True),
    ("latency", "tpot_ms", "batch 1: time per output token (ms), {context} context, {output_len} out", False),
    ("ttft", "fresh_ttft_median_s", "TTFT (s), fresh: median of {requests} x {prompt_len} sent at once", False),
    ("ttft", "fresh_ttft_p90_s", "TTFT (s), fresh: p90, same call", False),
    ("ttft", "fresh_s", "TTFT fresh: the call's seconds", False),
    ("ttft", "hit_ttft_median_s",
     "TTFT (s), prefix hit: median of the same {requests} prompts + {suffix_len} new tokens each", False),
    ("ttft", "hit_ttft_p90_s", "TTFT (s), prefix hit: p90, same call", False),
    ("ttft", "hit_s", "TTFT prefix hit: the call's seconds", False),
    ("ttft", "hit_cached_tokens", "TTFT prefix hit: prompt tokens the cache served (median of a request's)", None),
    ("ttft", "one_user_ttft_s", "TTFT (s), prefix hit, one user: 1 x ({prompt_len} cached + {suffix_len} new)",
     False),
    ("ttft", "one_user_cached_tokens", "TTFT prefix hit, one user: prompt tokens the cache served", None),
    ("ttft", "long_ttft_s", "TTFT (s), long: 1 x {long_len} fresh prompt", False),
    ("ttft", "long_prefill_tok_s", "TTFT long: prefill tok/s (its prompt over its TTFT)", True),
    ("short", "output_tok_s", "output tok/s, {requests} x ({prompt_len} in, {output_len} out), fresh", True),
    ("decode", "decode_tok_s", "decode tok/s, {requests} x {context} context, prefix-cached", True),
    ("decode", "tpot_ms", "time per output token (ms), same run", False),
    ("decode", "hit_s", "the same prompts' prefix hit, 1 token out (s)", False),
    ("fresh", "output_tok_s", "fresh: output tok/s, {requests} x {prompt_len}, prefill + {output_len} out", True),
    ("fresh", "seconds", "fresh: seconds, same run", False),
    ("reasoning", "output_tok_s",
     "reasoning: output tok/s, {requests} x ({prompt_len} in, {output_len} out), fresh", True),
    ("reasoning", "mean_running", "reasoning: requests decoding at once (mean)", None),
    ("reasoning", "preemptions", "reasoning: preemptions", None),
    ("overflow", "output_tok_s",
     "overflow: output tok/s, {requests} x ({prompt_len} in, {output_len} out), fresh", True),
    ("overflow", "mean_running", "overflow: requests decoding at once (mean)", None),
    ("overflow", "preemptions", "overflow: preemptions", None),
    ("capacity", "first_pass_s", "capacity, first pass (s): prefill of {requests} x ~{prompt_len}, 1 token out", False),
    ("capacity", "output_tok_s",
     "capacity, follow-up output tok/s: the same {requests} prompts, {output_len} out each", True),
    ("capacity", "prompt_tokens_computed", "capacity, follow-up: prompt tokens computed again", None),
    ("prefill", "prefill_tok_s", "prefill tok/s, {requests} x {prompt_len} distinct prompts", True),
    ("long", "prefill_tok_s", "prefill tok/s, 1 x {prompt_len} prompt", True),
]
SIZE_FIELDS = ("requests", "prompt_len", "context", "contexts", "output_len", "suffix_len", "long_len")


@dataclass
class Column:
    """One configuration in the main table: its results (``run``; merged over runs that ran
    different scenarios) and, per scenario, the FLASH_ATTN result of the run it came from
    (``bases``; None: the engine's own figures, from its first run), or of an earlier run of
    the same sizes where its own run had no FLASH_ATTN (those scenarios in ``across``)."""
    name: str
    run: dict
    bases: dict
    across: set = field(default_factory=set)


def _load(out: Path) -> tuple[dict, dict, dict, dict | None]:
    """The main runs (config -> result), the sweep ((max_num_seqs, config) -> result), meta and plan of one run."""
    runs, sweep = {}, {}
    for p in sorted(out.glob("run_*.json")):
        r = json.loads(p.read_text())
        if "running" in r and "error" not in r:
            # The harness itself was ended (a GPU call's limit) before its worker's result was
            # finished: the scenarios done stand, the one under way gets no row.
            r["error"] = f"ended from outside in {r['running']}, before a result (see log_{r['config']}.txt)"
        if r.get("sweep_max_num_seqs"):
            sweep[(r["sweep_max_num_seqs"], r["config"])] = r
        else:
            runs[r["config"]] = r
    plan = json.loads((out / "plan.json").read_text()) if (out / "plan.json").exists() else None
    return runs, sweep, json.loads((out / "meta.json").read_text()), plan


def _columns(loaded: list) -> list[Column]:
    """A column per configuration, in the order of CONFIGS, each scenario from the first run that
    has it; a configuration that runs a scenario again in a later run gets a column of that
    run's (``FLASH_ATTN (run 2)``: the baseline of run 2's ratios)."""
    cols: dict[str, Column] = {}
    for i, (runs, _, _, _) in enumerate(loaded):
        for c in (c for c in CONFIGS if c in runs):
            r, col = runs[c], cols.get(c)
            ran = [s for s in SCENARIOS if s in r]
            bases = {s: _baseline(loaded, i, s) for s in [None, *ran]}
            across = {s for s, (_, other) in bases.items() if other}
            bases = {s: b for s, (b, _) in bases.items()}
            if col and not set(ran) & set(col.run):  # other scenarios of the same configuration
                col.run.update({s: r[s] for s in ran})
                col.bases.update({s: bases[s] for s in ran})
                col.across.update(across - {None})
                if "error" in r:
                    col.run["error"] = "; ".join(filter(None, [col.run.get("error"), f"run {i + 1}: {r['error']}"]))
                continue
            name = c if not col else f"{c} (run {i + 1})"
            cols[name] = Column(name, dict(r), bases, across)
    order = list(CONFIGS)
    return sorted(cols.values(), key=lambda col: order.index(col.run["config"]))


def _baseline(loaded: list, i: int, scen: str | None) -> tuple[dict | None, bool]:
    """The FLASH_ATTN result run ``i``'s ratios in ``scen`` take (None: the engine's own figures),
    and whether it is another run's: run ``i``'s own, else the latest earlier run's that ran
    ``scen`` at the same sizes with the same engine arguments (a run split over invocations to
    fit a GPU call's time limit; each engine in its own process either way)."""
    runs, _, meta, plan = loaded[i]
    if BASELINE in runs:
        return runs[BASELINE], False
    for runs_j, _, meta_j, plan_j in reversed(loaded[:i]):
        base = runs_j.get(BASELINE)
        if not base or meta_j["engine_args"] != meta["engine_args"]:
            continue
        if scen is None or (scen in base and plan and plan_j and scenario_sizes(plan["sizes"], scen)
                            == scenario_sizes(plan_j["sizes"], scen) is not None):
            return base, True
    return None, False


def _cell(col_run: dict, v, b, higher, across: bool = False) -> tuple[str, float | None]:
    """A table cell (the value and its ratio to the baseline's ``b``, marked † if that is
    another run's) and that ratio."""
    if v is None:  # what it did not finish; the reason is under the table
        return "failed" if "error" in col_run else "", None
    if v < 0:  # OSCAR's windows for max_num_seqs requests would take more than the whole pool
        return f"{v:,} (windows over the pool)", None
    ratio = (v / b if higher else b / v) if higher is not None and b and v else None
    shown = ratio and col_run.get("config") != BASELINE
    return f"{v:,}" + (f" ({ratio:.2f}x{'†' if across else ''})" if shown else ""), ratio


def _line(label: str, cols: list[Column], values: dict, higher, csv: list, plot_rows: list | None,
          metric: str | None = None) -> str:
    """One table line: each column's value and its ratio to its own baseline's; the same into
    ``csv`` and (if given) ``plot_rows`` under ``metric`` (default: ``label``)."""
    metric, cells = metric or label, []
    for col in cols:
        v, b = values.get(col.name), values.get(f"base:{col.name}")
        text, ratio = _cell(col.run, v, b, higher, values.get(f"across:{col.name}", False))
        cells.append(text)
        if v is not None:
            csv.append(f"\"{metric}\",{col.name},{v},{'' if ratio is None else round(ratio, 4)}")
            if ratio and plot_rows is not None and col.run.get("config") != BASELINE:
                plot_rows.append((metric, col.name, ratio))
    return f"| {label} | " + " | ".join(cells) + " |"


def _label(template: str, sizes: dict) -> str:
    return template.format(**{k: tok(v) if k in ("prompt_len", "output_len", "context", "long_len") else v
                              for k, v in sizes.items()})


def _main_rows(cols: list[Column]):
    """(label, values, higher) of every metric some column has, in METRICS' order: values maps a
    column's name to its value and ``base:<name>`` to its baseline's."""
    def get(run: dict | None, scen, field, ctx=None):
        g = (run or {}).get(scen) if scen else run
        if ctx is not None:
            g = next((r for r in (g or {}).get("per_context", []) if r["context"] == ctx), None)
        return (g or {}).get(field) if isinstance(g, dict) else None

    for scen, metric, template, higher in METRICS:
        if scen == "latency":
            contexts = sorted({r["context"] for c in cols for r in (c.run.get("latency") or {}).get("per_context", [])})
            keys = [(ctx, {"context": ctx, "output_len": next(c.run["latency"]["output_len"] for c in cols
                                                               if c.run.get("latency"))}) for ctx in contexts]
        else:
            having = [g for g in ((c.run.get(scen) or {}) if scen else c.run for c in cols) if metric in g]
            keys = [(None, having[0])] if having else []
        for ctx, sizes in keys:
            values = {}
            for c in cols:
                values[c.name] = get(c.run, scen, metric, ctx)
                values[f"base:{c.name}"] = get(c.bases.get(scen), scen, metric, ctx)
                values[f"across:{c.name}"] = scen in c.across
            yield (_label(template, sizes) if scen else template), values, higher


def _size_notes(cols: list[Column]) -> list[str]:
    """Where the configurations ran different sizes (ratios then compare different work), and how
    much KV the memory-bound scenarios need against each engine's cache."""
    notes = []
    for scen in SCENARIOS:
        seen = {json.dumps({k: c.run[scen][k] for k in SIZE_FIELDS if k in c.run[scen]}) for c in cols
                if isinstance(c.run.get(scen), dict)}
        if len(seen) > 1:
            notes.append(f"**{scen}: sizes differ between configurations** ({'; '.join(sorted(seen))}): "
                         "its ratios compare different work")
    need = []
    for scen in MEMORY_BOUND:
        z = next((c.run[scen] for c in cols if isinstance(c.run.get(scen), dict)), None)
        if not z:
            continue
        tokens = z["requests"] * (z["prompt_len"] + (0 if scen == "capacity" else z["output_len"]))
        shares = []
        for c in cols:
            kv, seqs = c.run.get("kv_cache_tokens"), c.run.get("max_num_seqs")
            if kv:
                window = (kv - c.run.get("kv_tokens_all_running", kv)) // seqs if seqs else 0
                shares.append(f"{c.name} {(tokens + z['requests'] * window) / kv:.2f}")
        need.append(f"{scen} {tokens:,} ({', '.join(shares)})")
    if need:
        notes.append("KV tokens the requests hold when all run at once (capacity: the prompts), as a share of "
                     "each engine's KV cache (OSCAR's with its BF16 windows; above 1 they queue or preempt): "
                     + "; ".join(need))
    return notes


def _plan_line(plan: dict | None) -> str:
    if not plan:
        return "- sizes: as the table's labels give them"
    inp = plan["inputs"]
    if plan.get("fixed"):
        how = f"the sizes of {inp.get('plan_from', 'an earlier plan')}"
    elif inp.get("budget_s"):
        how = (f"the defaults scaled by {plan['scale']} to fit --budget-s {inp['budget_s']:g} per configuration"
               + ("" if plan["fits"] else " (estimated over budget even at the floors)"))
    else:
        how = "the options' sizes, unscaled"
    bounds = [f"overflow to need over {inp['overflow_factor']:g}x the largest KV cache of "
              f"{' and '.join(inp['overflow_configs'])}"] if "overflow" in plan["sizes"] else []
    bounds += [f"capacity over {inp['overflow_factor']:g}x BF16's"] if "capacity" in plan["sizes"] else []
    bound = (f"; {' and '.join(bounds)}, BF16's KV cache being {plan['bf16_kv_tokens']:,} tokens "
             f"({plan['bf16_kv_source']})") if bounds and not plan.get("fixed") else ""
    return f"- sizes: {how}{bound}"


def report(out: Path, *more: Path) -> str:
    """``ab.md`` / ``ab.csv`` / ``ab.png`` in ``out`` from the per-configuration JSON files in
    ``out`` and ``more`` (runs of one plan split over invocations: each ratio against the
    FLASH_ATTN of its own run). Headings below the title are bold lines, so that the file splices
    into another document (benchmarks/readme_tables.py) without adding to its outline."""
    loaded = [_load(d) for d in (out, *more)]
    cols = _columns(loaded)
    runs = {c.name: c.run for c in cols}
    meta = loaded[0][2]
    lines = [f"# A/B throughput: {meta['model']}", ""]
    for i, (r, _, m, plan) in enumerate(loaded):
        if len(loaded) == 1:
            lines += [f"- date: {m['date']}; hardware: {m['hardware']}", f"- command: `{m['command']}`"]
        else:
            lines.append(f"- run {i + 1} ({', '.join(c for c in CONFIGS if c in r)}): {m['date']}; "
                         f"{m['hardware']}; `{m['command']}`")
        if i == 0 or m["versions"] != meta["versions"]:
            lines.append(f"- {m['versions']}")
        if m.get("oscar_env"):
            lines.append(f"- OSCAR settings from the environment: {json.dumps(m['oscar_env'])}")
        if m.get("gpus", 1) > 1:
            lines.append(f"- {m['gpus']} configurations at a time, one GPU each (sharing the host's CPUs)")
        if plan:
            lines.append(_plan_line(plan))
    lines += [f"- engine arguments: {meta['engine_args']} (else vLLM's defaults)",
              "- every request has its own prompt; ratios are against FLASH_ATTN (BF16) in the same run "
              "(for times: FLASH_ATTN's over this one's), higher is better"]
    csv, plot_rows = ["metric,config,value,ratio_vs_bf16"], []
    if cols:
        lines += ["", "| metric | " + " | ".join(c.name for c in cols) + " |", "|---|" + "---|" * len(cols)]
        for label, values, higher in _main_rows(cols):
            lines.append(_line(label, cols, values, higher, csv, plot_rows if higher is not None else None))
    notes = _size_notes(cols)
    if any(c.across for c in cols):
        notes.insert(0, "† against the FLASH_ATTN of an earlier run with the same sizes and engine arguments "
                     "(a run split over invocations to fit a GPU call's time limit)")
    compiled = [f"{n} {scen}: {', '.join(r[scen]['jit_compiles'])}" for n, r in runs.items()
                for scen in SCENARIOS if isinstance(r.get(scen), dict) and r[scen].get("jit_compiles")]
    if compiled:
        notes.append("Triton kernels vLLM logged compiling inside a timed call (their compile time is in that "
                     "scenario's numbers): " + "; ".join(compiled) + ".")
    timing = [f"{f'run {i + 1} ' if len(loaded) > 1 else ''}{c} {runs_i[c]['worker_s']:.0f}"
              + (f" ({plan['estimate_s'][c]['total']:.0f})" if plan and c in plan["estimate_s"] else "")
              for i, (runs_i, _, _, plan) in enumerate(loaded) for c in CONFIGS if "worker_s" in runs_i.get(c, {})]
    if timing:
        notes.append("Seconds per configuration, engine start to exit (the plan's estimate): " + ", ".join(timing))
    lines += [x for n in notes for x in ("", n)]
    failed = [(c.name, c.run) for c in cols if "error" in c.run]
    sweep = {}
    for _, run_sweep, _, _ in loaded:
        for key, r in run_sweep.items():
            sweep.setdefault(key, r)
    if sweep:
        lines += _sweep_tables(sweep, loaded[0][0], csv, plot_rows, failed)
    for n, r in failed:
        lines.append(f"\n**{n} failed:** `{r['error']}`")
    text = "\n".join(lines) + "\n"
    (out / "ab.md").write_text(text)
    (out / "ab.csv").write_text("\n".join(csv) + "\n")
    _plot(plot_rows, out / "ab.png", meta)
    return text


def _sweep_tables(sweep: dict, runs: dict, csv: list, plot_rows: list, failed: list) -> list[str]:
    """The KV capacity of engines started with each max_num_seqs of the sweep, beside the main runs'."""
    lines, rows = [], {}  # label -> config -> result
    if runs:  # the main runs, at the max_num_seqs vLLM chose (or --engine-args set)
        seqs = "/".join(map(str, sorted({r["max_num_seqs"] for r in runs.values() if "max_num_seqs" in r})))
        eager = any(r.get("engine_args", {}).get("enforce_eager") for r in runs.values())
        rows[f"{seqs or '?'} (main run, {'eager' if eager else 'CUDA graphs'})"] = runs
    for v in sorted({v for v, _ in sweep}):
        rows[f"{v} (enforce_eager)"] = row = {c: sweep[v, c] for c in CONFIGS if (v, c) in sweep}
        failed += [(f"{c} (max_num_seqs={v})", r) for c, r in row.items() if "error" in r]
    names = [c for c in CONFIGS if any(c in row for row in rows.values())]
    cols = [Column(c, {"config": c}, {}) for c in names]

    def table(field: str, metric: str, plot: bool) -> list[str]:
        out = ["| max_num_seqs | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
        for label, row in rows.items():
            values = {c: r.get(field) for c, r in row.items()}
            values.update({f"base:{c}": values.get(BASELINE) for c in names})
            for col in cols:
                col.run = row.get(col.name, {"config": col.name})
            out.append(_line(label, cols, values, True, csv, plot_rows if plot and row is not runs else None,
                             metric=f"{metric}, max_num_seqs {label}"))
        return out

    lines += ["", "**KV cache capacity by max_num_seqs**", "",
              "KV cache tokens of engines started with that max_num_seqs and enforce_eager=True (to start "
              "fast), then stopped (\"main run\": the scenarios' engines); ratios against FLASH_ATTN "
              "in the same row", "", *table("kv_cache_tokens", "KV cache capacity (tokens)", True)]
    if any("kv_tokens_all_running" in r for row in rows.values() for r in row.values()):
        lines += ["", "OSCAR's BF16 windows are blocks of that pool, taken per running request; with all "
                  "max_num_seqs requests running, this much is left for KV tokens:", "",
                  *table("kv_tokens_all_running", "KV tokens left with all running", False)]
    return lines


def _plot(rows, path: Path, meta: dict) -> None:
    """Horizontal bars: each workload's ratio to FLASH_ATTN, one bar per configuration."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(dict.fromkeys(r[0] for r in rows))
    names = list(dict.fromkeys(r[1] for r in rows))
    if not labels:
        return
    fig, ax = plt.subplots(figsize=(11, 0.3 * len(labels) * max(1, len(names)) + 2))
    h = 0.8 / len(names)
    for i, n in enumerate(names):
        vals = [next((r[2] for r in rows if r[0] == lab and r[1] == n), 0) for lab in labels]
        ax.barh([j + i * h for j in range(len(labels))], vals, height=h, label=n)
    ax.axvline(1.0, color="k", lw=0.8)
    ax.set_yticks([j + 0.4 - h / 2 for j in range(len(labels))], [textwrap.fill(lab, 48) for lab in labels],
                  fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("ratio to FLASH_ATTN (BF16) of the same run or plan, higher is better")
    ax.set_title(f"{meta['model']}, {meta['hardware']}, {meta['date']}", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
