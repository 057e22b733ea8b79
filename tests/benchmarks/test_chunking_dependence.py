"""benchmarks/studies/chunking_dependence.py on a tiny random model: each read is what it says, and
the comparison counts what it says."""
import json

import torch

from benchmarks.studies import chunking_dependence as cd
from tiny_llama import tiny_llama, tiny_specs


def test_chunk_boundaries_change_the_int2_reads_and_nothing_else():
    loaded = tiny_llama()
    ids = torch.randint(0, 128, (64,), generator=torch.Generator().manual_seed(2))
    logp = cd.read_logprobs(loaded, ids, tiny_specs("int2"), tiny_specs("bf16"), (8, 16, 64), sink=4, recent=8)
    assert list(logp) == list(cd.reads((8, 16, 64))) and all(v.shape == (63, 128) for v in logp.values())
    # One chunk over the whole prompt reads every key in BF16: as the BF16 cache, up to the rotation.
    torch.testing.assert_close(logp["chunk_64"], logp["bf16"], atol=2e-2, rtol=0)
    # Lossless rows: every read is the BF16 one, whatever the chunks.
    lossless = cd.read_logprobs(loaded, ids, tiny_specs("bf16"), tiny_specs("bf16"), (8, 16, 64), sink=4, recent=8)
    for name in ("chunk_8", "chunk_16", "decode"):
        torch.testing.assert_close(lossless[name], lossless["bf16"], atol=2e-2, rtol=0)
    # With 2-bit rows other cuts read other keys in 2 bits, and decode reads what no chunking
    # does: far apart next to what rounding alone moves.
    for a, b in (("chunk_8", "chunk_16"), ("chunk_16", "chunk_64"), ("chunk_8", "decode")):
        kl, rounding = cd.compare(logp[a], logp[b])["kl"], cd.compare(lossless[a], lossless[b])["kl"]
        assert kl > 1e-7 and kl > 100 * rounding, (a, b, kl, rounding)


def test_compare_counts_differing_greedy_tokens_and_kl():
    a = torch.log_softmax(torch.tensor([[2.0, 0.0, 0.0], [0.0, 2.0, 0.0], [0.0, 0.0, 2.0], [1.0, 0.0, 0.0]]), -1)
    assert cd.compare(a, a) == {"top1_differs": 0.0, "kl": 0.0}
    b = a.flip(0)  # positions 0 and 3 keep token 0 on top, 1 and 2 swap
    got = cd.compare(a, b)
    assert got["top1_differs"] == 0.5
    want = (a.exp() * (a - b)).sum(-1).mean()
    assert abs(got["kl"] - float(want)) < 1e-6 and got["kl"] > 0


def test_reports_are_saved_as_json_and_markdown_with_one_header(tmp_path, capsys):
    """The reference-cache benchmarks' shared ending: the data, the text, the text printed."""
    from oscar_vllm.calibration.evaluate import environment, report_header, save_report

    meta = {**environment("python benchmarks/x.py"), "model": "tiny-llama", "dtype": "float32"}
    header = report_header(meta)
    assert (header[0].startswith(f"- date: {meta['date']}; hardware: ")
            and header[0].endswith("model: tiny-llama (float32)"))
    assert header[1:] == [f"- command: `{meta['command']}`", f"- {meta['versions']}"]
    save_report(tmp_path / "out", "x", {"meta": meta, "a": [1, 2]}, "# X\n", indent=1)
    assert json.loads((tmp_path / "out" / "x.json").read_text()) == {"meta": meta, "a": [1, 2]}
    assert (tmp_path / "out" / "x.json").read_text().startswith('{\n "meta"')
    assert (tmp_path / "out" / "x.md").read_text() == "# X\n" and capsys.readouterr().out == "# X\n\n"
