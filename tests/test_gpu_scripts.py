"""The GPU scripts' CPU side: what ``tests/gpu/e2e_vllm.py`` builds before an engine starts (a
mistake there shows only on the GPU machine otherwise, after minutes of staging)."""
import importlib.util
from pathlib import Path

import pytest

from oscar_vllm.calibration.evaluate import CACHED_PREFIX_CUTS, CACHED_PREFIX_WINDOWS, cached_prefix_tokens


@pytest.fixture
def e2e(monkeypatch):
    """``e2e_vllm`` with the evaluation text's tokens replaced by distinct ids (no tokenizer, no corpus)."""
    spec = importlib.util.spec_from_file_location("e2e_vllm", Path(__file__).parent / "gpu" / "e2e_vllm.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    asked = []

    def eval_windows(model_dir, tokens, context):
        asked.append(tokens)
        ids = list(range(tokens + context))
        return [ids[i:i + context] for i in range(0, tokens + 1, context)], None

    monkeypatch.setattr(module, "eval_windows", eval_windows)
    module.asked = asked
    return module


@pytest.mark.parametrize("windows", [None, 156])
def test_prefix_workload_is_the_check_each_stage_asks_for(e2e, windows):
    # preempt and chunked ask without a count (the check's default), prefix with --windows.
    chats, shared, got = e2e.prefix_workload("model") if windows is None else e2e.prefix_workload("model", windows)
    n = windows or CACHED_PREFIX_WINDOWS
    assert e2e.asked == [cached_prefix_tokens(n)]
    assert len(chats) == 16 and len(got) == n and len(shared) == 512
    assert all(w[:512] == shared for w in got)
    assert len({tuple(w[512:]) for w in got}) == n, "windows past the shared prefix must be distinct text"
    # Each cut's request is the window up to it and scores its next two tokens.
    assert all(len(w) >= 512 + max(CACHED_PREFIX_CUTS) + 2 for w in got)
