"""The in-vLLM quality benchmark's arithmetic and report, from synthetic engine runs (the engines
themselves run on a GPU: tests/gpu/run.sh quality_vllm)."""
import json
import math

import pytest

from benchmarks import quality_vllm as qv


def test_windows_are_distinct_and_spread_over_the_text():
    ids = list(range(10_000))
    ws = qv.windows(ids, 2048, 64)
    assert len(ws) == 64 and all(len(w) == 2048 for w in ws)
    assert len({w[0] for w in ws}) == 64 and ws[-1][-1] <= 9_999 and ws[-1][-1] > 9_900
    with pytest.raises(ValueError, match="no 64 distinct windows of 9990"):
        qv.windows(ids, 9990, 64)


def test_greedy_agreement_counts_the_first_difference_and_equal_tokens():
    want = [[1, 2, 3, 4], [5, 6, 7, 8]]
    got = [[1, 2, 9, 4], [5, 6, 7, 8]]
    first, equal = qv.greedy_agreement(got, want)
    assert first == (2 + 4) / 2  # a continuation equal throughout counts its length
    assert equal == 7 / 8


def run(config: str, nll: float, found: list[bool], greedy: list[list[int]]) -> dict:
    cfg = qv.CONFIGS[config]
    ppl = {t: {"ppl": math.exp(nll + shift), "tokens": 4, "nll": [nll + shift + e for e in (0.1, -0.1, 0.2, -0.2)]}
           for t, shift in (("prose", 0.0), ("code", -1.0))}
    return {"config": config, "what": cfg["what"], "bits": cfg["bits"], "ppl": ppl,
            "greedy": {"2048": greedy, "4096": greedy},
            "passkey": [{"length": 2048, "depth": 0.5, "key": 1, "answer": "", "found": f} for f in found]}


def test_the_report_compares_every_configuration_with_bf16_of_the_same_run(tmp_path):
    runs = {
        "bf16": run("bf16", 3.0, [True, True, False, True], [[1, 2, 3], [4, 5, 6]]),
        "fp8": run("fp8", 3.01, [True, False, False, True], [[1, 2, 0], [4, 5, 6]]),
        "oscar": run("oscar", 3.005, [True, True, True, True], [[1, 2, 3], [0, 5, 6]]),
    }
    for name, r in runs.items():
        (tmp_path / f"engine_{name}.json").write_text(json.dumps(r))
    (tmp_path / "meta.json").write_text(json.dumps({"date": "d", "hardware": "H100", "command": "c"}))
    text = qv.report(tmp_path, "c")
    rows = json.loads((tmp_path / "quality.json").read_text())["rows"]
    assert list(rows) == ["bf16", "fp8", "oscar"]  # CONFIGS' order
    assert rows["fp8"]["ppl"]["prose"]["delta_pct"] == pytest.approx(100 * (math.exp(0.01) - 1))
    assert rows["fp8"]["ppl"]["code"]["delta_pct"] == pytest.approx(100 * (math.exp(0.01) - 1))
    assert rows["oscar"]["ppl"]["prose"]["se_pct"] == pytest.approx(0.0, abs=1e-9)  # the same shift on every token
    assert rows["fp8"]["greedy"]["2048"] == {"first_diff": 2.5, "equal": 5 / 6}
    assert rows["oscar"]["greedy"]["4096"]["first_diff"] == 1.5
    # passkeys counted where BF16 found them (3 of 4); OSCAR found one BF16 missed
    assert rows["fp8"]["passkey"] == {"found": 2, "where_bf16": 2, "bf16_found": 3, "trials": 4}
    assert rows["oscar"]["passkey"] == {"found": 4, "where_bf16": 3, "bf16_found": 3, "trials": 4}
    assert "| fp8 (FLASH_ATTN) | 8 | +1.01% ± " in text and "3 of 3 (all: 4 of 4)" in text
    assert (tmp_path / "quality.png").stat().st_size > 0
    (tmp_path / "engine_bf16.json").unlink()
    with pytest.raises(SystemExit, match="no bf16 run"):
        qv.report(tmp_path, "c")


def test_passkey_prompts_hide_each_key_at_its_depth_within_the_length():
    class Chars:  # one token a character: lengths and positions are exact
        def encode(self, text, add_special_tokens=False):
            return [ord(c) for c in text]

    prompts = qv.passkey_prompts(Chars())
    assert len(prompts) == len(qv.PASSKEY_LENGTHS) * len(qv.PASSKEY_DEPTHS) * len(qv.PASSKEY_KEYS)
    for p in prompts:
        text = "".join(map(chr, p["ids"]))
        assert len(p["ids"]) == p["length"] and text.endswith("The pass key is")
        needle = f" The pass key is {p['key']}. Remember it. {p['key']} is the pass key. "
        room = p["length"] - len(needle) - len("\nWhat is the pass key? The pass key is")
        assert text.index(needle) == int(p["depth"] * room) and text.count(str(p["key"])) == 2


def test_a_run_without_a_part_shows_it_as_missing_and_the_rest_against_bf16(tmp_path):
    bf16 = run("bf16", 3.0, [True, False], [[1, 2, 3]])
    oscar = {**run("oscar", 3.02, [False, False], []), "greedy": {}}  # measured with --parts ppl passkey
    fp8 = {**run("fp8", 3.01, [], [[1, 2, 3]]), "passkey": []}  # measured with --parts ppl greedy
    for r in (bf16, oscar, fp8):
        (tmp_path / f"engine_{r['config']}.json").write_text(json.dumps(r))
    text = qv.report(tmp_path, "c")
    rows = json.loads((tmp_path / "quality.json").read_text())["rows"]
    assert rows["oscar"]["greedy"] == {} and rows["oscar"]["passkey"]["where_bf16"] == 0
    assert rows["fp8"]["passkey"] == {} and rows["fp8"]["greedy"]["2048"]["first_diff"] == 3
    assert rows["oscar"]["ppl"]["prose"]["delta_pct"] == pytest.approx(100 * (math.exp(0.02) - 1))
    oscar_line = next(line for line in text.splitlines() if line.startswith(f"| {qv.CONFIGS['oscar']['what']}"))
    assert oscar_line.endswith("| — | — | — | 0 of 1 (all: 0 of 2) |")
    assert next(line for line in text.splitlines() if line.startswith("| fp8")).endswith("| 100.0% | — |")


def test_greedy_columns_only_where_a_configuration_was_compared(tmp_path):
    bf16 = run("bf16", 3.0, [True], [[1, 2, 3]])
    oscar = {**run("oscar", 3.02, [True], []), "greedy": {}}
    for r in (bf16, oscar):
        (tmp_path / f"engine_{r['config']}.json").write_text(json.dumps(r))
    header = next(line for line in qv.report(tmp_path, "c").splitlines() if line.startswith("| KV cache"))
    assert header == "| KV cache | bits/elem | ΔPPL prose | ΔPPL code | passkey found where BF16 finds it |"


def test_chunk_sets_the_engines_step_and_the_report_says_it(tmp_path, monkeypatch):
    import sys
    import types

    made = {}

    class LLM:
        def __init__(self, model, **kw):
            made.update(kw)

        def get_tokenizer(self):
            return None

    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(LLM=LLM, SamplingParams=dict))
    qv.run_engine("bf16", "m", "r", tmp_path / "engine_bf16.json", parts=(), chunk=8192)
    assert made["max_num_batched_tokens"] == 8192
    assert json.loads((tmp_path / "engine_bf16.json").read_text())["chunk"] == 8192
    (tmp_path / "meta.json").write_text(json.dumps({"date": "d", "hardware": "h", "command": "c", "chunk": 8192}))
    assert "prompts prefilled in chunks of 8192 " in qv.report(tmp_path, "c")
