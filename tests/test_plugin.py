"""Plugin registration (in fresh interpreters, as vLLM's processes do), version check and
KV-cache spec sizing, with vLLM imported."""
import subprocess
import sys
import textwrap
from importlib.metadata import entry_points
from types import SimpleNamespace

import pytest
import torch

from oscar_vllm import plugin


def run_python(code: str) -> str:
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.strip().splitlines()[-1]


def test_entry_point_is_declared():
    eps = {e.name: e.value for e in entry_points(group="vllm.general_plugins")}
    assert eps.get("oscar") == "oscar_vllm.plugin:register"


def test_vllm_loads_the_plugin_and_parses_the_backend_name():
    out = run_python("""
        import sys, torch
        from vllm.plugins import load_general_plugins
        load_general_plugins(); load_general_plugins()
        from vllm.config.attention import AttentionConfig
        from vllm.v1.attention.backends.registry import AttentionBackendEnum as E
        names = [m.name for m in E]
        assert names.count("OSCAR") == 1, names
        assert AttentionConfig(backend="OSCAR").backend is E.OSCAR
        assert AttentionConfig(backend="oscar").backend is E.OSCAR
        assert E.OSCAR.get_path() == E.CUSTOM.get_path() == "oscar_vllm.backend.OscarAttentionBackend"
        import pickle
        assert pickle.loads(pickle.dumps(E.OSCAR)) is E.OSCAR
        assert not torch.cuda.is_initialized()
        assert not any(m.startswith(("oscar_vllm.backend", "csrc_triton")) for m in sys.modules)
        print("ok")
    """)
    assert out == "ok"


def test_member_unpickles_in_a_process_that_has_not_loaded_plugins():
    """vLLM's spawned engine core unpickles its config before it loads plugins."""
    blob = run_python("""
        import base64, pickle
        from oscar_vllm.plugin import register
        register()
        from vllm.config.attention import AttentionConfig
        print(base64.b64encode(pickle.dumps(AttentionConfig(backend="OSCAR"))).decode())
    """)
    out = run_python(f"""
        import base64, pickle
        config = pickle.loads(base64.b64decode("{blob}"))
        # The engine process builds its scheduler next: it must give requests their window pages.
        from vllm.v1.core.sched.scheduler import Scheduler
        assert Scheduler.__init__.__oscar_wrapped__
        print(config.backend.name, config.backend.get_path())
    """)
    assert out == "OSCAR oscar_vllm.backend.OscarAttentionBackend"


def test_custom_slot_taken_by_another_plugin_is_left_alone():
    out = run_python("""
        from vllm.v1.attention.backends.registry import AttentionBackendEnum as E, register_backend
        register_backend(E.CUSTOM, "someone.else.Backend")
        from oscar_vllm.plugin import register
        register()
        print(E.CUSTOM.get_path(), E.OSCAR.get_path())
    """)
    assert out == "someone.else.Backend oscar_vllm.backend.OscarAttentionBackend"


def test_backend_class_resolves_and_installs_its_hooks():
    out = run_python("""
        from oscar_vllm.plugin import register
        register()
        from vllm.v1.attention.backends.registry import AttentionBackendEnum as E
        backend = E.OSCAR.get_class()
        from vllm.model_executor.layers.attention.attention import Attention
        from vllm.v1.worker.gpu.model_runner import GPUModelRunner
        assert Attention.get_kv_cache_spec.__oscar_wrapped__
        assert GPUModelRunner.initialize_kv_cache.__oscar_wrapped__  # the kernels' warm-up
        assert GPUModelRunner.add_requests.__oscar_wrapped__  # new rows' window pages
        from vllm.v1.core.sched.scheduler import Scheduler
        assert Scheduler.__init__.__oscar_wrapped__  # the pages come from the scheduler's pool
        print(backend.get_name(), backend.get_kv_cache_shape(10, 64, 8, 128))
    """)
    assert out == "OSCAR (10, 8, 4608)"


def test_version_check_names_the_versions(monkeypatch):
    monkeypatch.setattr(plugin, "version", lambda name: "0.25.1")
    with pytest.raises(RuntimeError, match=r"vLLM 0\.26\.0 exactly, found vLLM 0\.25\.1.*pip install vllm==0\.26\.0"):
        plugin.check_vllm_version()


@pytest.mark.parametrize("head_dim,slot", [(64, 40), (128, 72), (256, 136)])
def test_int2_page_is_reported_truthfully(head_dim, slot):
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    import oscar_vllm.backend  # noqa: F401  (installs the hooks)
    from oscar_vllm.backend import OscarAttentionBackend
    from oscar_vllm.vllm_hooks import oscar_kv_cache_spec

    layer = SimpleNamespace(num_kv_heads=8, head_size=head_dim)
    config = SimpleNamespace(cache_config=SimpleNamespace(block_size=64))
    spec = oscar_kv_cache_spec(layer, config)
    assert spec.page_size_bytes == 64 * 8 * slot
    # The tensor vLLM carves from those bytes has exactly the backend's shape.
    shape = OscarAttentionBackend.get_kv_cache_shape(5, 64, 8, head_dim)
    assert torch.Size(shape).numel() == 5 * spec.page_size_bytes
    with pytest.raises(ValueError, match="64 tokens"):
        OscarAttentionBackend.get_kv_cache_shape(5, 16, 8, head_dim)
    bf16 = FullAttentionSpec(block_size=64, num_kv_heads=8, head_size=head_dim, dtype=torch.bfloat16)
    assert bf16.page_size_bytes / spec.page_size_bytes == pytest.approx(4 * head_dim / slot)
    if head_dim == 128:  # the Qwen3-8B arithmetic: 72 bytes against 512, 7.1x
        assert bf16.page_size_bytes / spec.page_size_bytes == pytest.approx(512 / 72)


def test_dense_prefill_buffers_are_shared_and_sized_for_a_longest_request():
    import oscar_vllm.backend  # noqa: F401  (installs the hooks)
    from oscar_vllm.vllm_hooks import give_dense_prefill_buffers

    def impl():
        return SimpleNamespace(num_kv_heads=8, head_size=128, flash_attention=print, window_pos=torch.empty(0),
                               dense_kv=None)

    config = SimpleNamespace(model_config=SimpleNamespace(max_model_len=1000, dtype=torch.bfloat16),
                             scheduler_config=SimpleNamespace(max_num_batched_tokens=256))
    impls = [impl() for _ in range(3)]
    assert give_dense_prefill_buffers(impls, config) == 2 * (1000 + 256) * 8 * 128 * 2
    assert impls[0].dense_kv[0].shape == (1256, 8, 128) and impls[0].dense_kv[0].dtype == torch.bfloat16
    assert all(i.dense_kv is impls[0].dense_kv for i in impls), "one pair of buffers for all layers"
    no_flash = [impl(), impl()]
    no_flash[1].flash_attention = None  # an fp32 model: FlashAttention cannot run, nor the dense path
    assert give_dense_prefill_buffers(no_flash, config) == 0 and no_flash[0].dense_kv is None


def test_dense_prefill_is_taken_only_when_the_batch_fits():
    from oscar_vllm.backend import OscarAttentionImpl

    buf = torch.empty(100, 2, 16)
    impl = SimpleNamespace(dense_kv=(buf, buf), rotate=lambda x: x * 2, flash_attention=print)
    k = torch.arange(7.0).view(7, 1, 1).expand(7, 2, 16)

    def md(**kw):
        base = dict(prefill_has_prefix=True, num_decodes=2, num_reqs=3, prefill_kv_rows=100, prefill_max_seq=100)
        return SimpleNamespace(**{**base, **kw})

    dense = OscarAttentionImpl.dense_prefill(impl, md(), k)
    assert dense.k_rot[:, 0, 0].tolist() == [4.0, 6.0, 8.0, 10.0, 12.0], "the prefill rows, rotated"
    assert dense.k_buf is buf and dense.max_seq_len == 100 and dense.attention is print
    for why in (dict(prefill_kv_rows=101), dict(prefill_kv_rows=-1), dict(prefill_has_prefix=False),
                dict(num_decodes=3)):
        assert OscarAttentionImpl.dense_prefill(impl, md(**why), k) is None, why
    impl.dense_kv = None
    assert OscarAttentionImpl.dense_prefill(impl, md(), k) is None
