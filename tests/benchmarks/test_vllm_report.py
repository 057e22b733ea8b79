"""benchmarks/vllm_report.py: each vLLM OSCAR perplexity is held against the reference of the
path its prompt chunks take, and the recorded run still reads as it did."""
import json
from pathlib import Path

import pytest

from benchmarks import vllm_report

REPO = Path(__file__).resolve().parents[2]


def run(dtype, ppl, backend="OSCAR"):
    return {"check": "ppl", "backend": backend, "dtype": dtype, "eager": dtype == "float32", "chunk": 256, "ppl": ppl}


def test_fp32_is_held_against_the_corrected_reference_and_bf16_against_the_uncorrected():
    ref = {"results": {"bf16": {"ppl": 36.9}, "oscar-int2-fit": {"ppl": 37.6},
                       "oscar-int2-fit-debiased-half": {"ppl": 37.3}}, "meta": {"prefill_chunk": 256}}
    table = "\n".join(vllm_report.ppl_table([run("float32", 37.3), run("bfloat16", 37.6 * 1.001),
                                             run("bfloat16", 36.9, "FLASH_ATTN")], ref))
    assert ("| vLLM OSCAR, float32, eager, chunked prefill 256 | 37.300 | "
            "+0.000% (`oscar-int2-fit-debiased-half`) |") in table
    assert "| 37.638 | +0.100% (`oscar-int2-fit`) |" in table
    assert "| vLLM FLASH_ATTN, bfloat16, torch.compile + CUDA graphs, chunked prefill 256 | 36.900 |  |" in table
    with pytest.raises(ValueError, match="no single reference"):
        vllm_report.reference_of(run("float32", 1.0), ["oscar-int2-fit", "oscar-int2"])


def test_a_recorded_run_with_one_reference_method_compares_every_row_with_it():
    rows, ref = vllm_report.load(REPO / "results" / "vllm_prefill")
    table = vllm_report.ppl_table(rows, ref)
    recorded = (REPO / "results" / "vllm_prefill" / "report.md").read_text()
    for line in table:
        if line.startswith("| vLLM"):
            assert line in recorded
    assert json.loads((REPO / "results" / "vllm_prefill" / "reference_fidelity.json").read_text())["results"].keys() \
        == {"bf16", "oscar-int2-fit"}


def decode_row(backend, context, batch, tokens_per_s, **extra):
    return {"check": "decode", "backend": backend, "context": context, "batch": batch, "tokens_per_s": tokens_per_s,
            "kv_cache_tokens": 791_312 if backend == "FLASH_ATTN" else 5_620_288, **extra}


def test_decode_table_says_which_shape_does_not_fit_and_what_prompts_it_ran():
    rows = [decode_row("FLASH_ATTN", 8192, 32, 2000.0, prompts="distinct"),
            decode_row("OSCAR", 8192, 32, 2500.0, prompts="distinct"),
            decode_row("FLASH_ATTN", 32768, 32, None, prompts="distinct", kv_tokens_needed=1_052_672),
            decode_row("OSCAR", 32768, 32, 900.0, prompts="distinct")]
    table, data = vllm_report.decode_table(rows)
    assert "| 8,192 | 32 | 2,000.0 | 2,500.0 | 1.25x |" in table
    assert "| 32,768 | 32 | does not fit (1,052,672 KV tokens, has 791,312) | 900.0 | n/a |" in table
    assert data["prompts"] == "a distinct prompt per request"
    # A run recorded before the prompts were distinct says so.
    assert vllm_report.decode_table([decode_row("OSCAR", 8192, 1, 160.0)])[1]["prompts"] == \
        "one prompt shared by the batch"
