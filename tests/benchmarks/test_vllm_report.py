"""benchmarks/vllm_report.py: each vLLM OSCAR perplexity is held against the reference of the
path its prompt chunks take, and the recorded run still reads as it did."""
import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))

import vllm_report  # noqa: E402


def run(dtype, ppl, backend="OSCAR"):
    return {"check": "ppl", "backend": backend, "dtype": dtype, "eager": dtype == "float32", "chunk": 256, "ppl": ppl}


def test_fp32_is_held_against_the_corrected_reference_and_bf16_against_the_uncorrected():
    ref = {"results": {"bf16": {"ppl": 36.9}, "oscar-int2-fit": {"ppl": 37.6},
                       "oscar-int2-fit-debiased-half": {"ppl": 37.3}}, "meta": {"prefill_chunk": 256}}
    table = "\n".join(vllm_report.ppl_table([run("float32", 37.3), run("bfloat16", 37.6 * 1.001),
                                             run("bfloat16", 36.9, "FLASH_ATTN")], ref))
    assert "| vLLM OSCAR, float32, eager, chunked prefill 256 | 37.300 | +0.000% (`oscar-int2-fit-debiased-half`) |" in table
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
