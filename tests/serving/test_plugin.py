"""Plugin registration (in fresh interpreters, as vLLM's processes do), version check and
KV-cache spec sizing, with vLLM imported."""
import math
import subprocess
import sys
import textwrap
from importlib.metadata import entry_points
from types import SimpleNamespace

import pytest
import torch

from oscar_vllm.serving import plugin


def run_python(code: str) -> str:
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.strip().splitlines()[-1]


def test_entry_point_is_declared():
    eps = {e.name: e.value for e in entry_points(group="vllm.general_plugins")}
    assert eps.get("oscar") == "oscar_vllm.serving.plugin:register"


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
        assert E.OSCAR.get_path() == E.CUSTOM.get_path() == "oscar_vllm.serving.backend.OscarAttentionBackend"
        import pickle
        assert pickle.loads(pickle.dumps(E.OSCAR)) is E.OSCAR
        assert not torch.cuda.is_initialized()
        assert not any(m.startswith(("oscar_vllm.serving.backend", "csrc_triton")) for m in sys.modules)
        print("ok")
    """)
    assert out == "ok"


def test_member_unpickles_in_a_process_that_has_not_loaded_plugins():
    """vLLM's spawned engine core unpickles its config before it loads plugins."""
    blob = run_python("""
        import base64, pickle
        from oscar_vllm.serving.plugin import register
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
    assert out == "OSCAR oscar_vllm.serving.backend.OscarAttentionBackend"


def test_custom_slot_taken_by_another_plugin_is_left_alone():
    out = run_python("""
        from vllm.v1.attention.backends.registry import AttentionBackendEnum as E, register_backend
        register_backend(E.CUSTOM, "someone.else.Backend")
        from oscar_vllm.serving.plugin import register
        register()
        print(E.CUSTOM.get_path(), E.OSCAR.get_path())
    """)
    assert out == "someone.else.Backend oscar_vllm.serving.backend.OscarAttentionBackend"


def test_backend_class_resolves_and_installs_its_hooks():
    out = run_python("""
        from oscar_vllm.serving.plugin import register
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
        # Every hook of the table fits vLLM 0.26.0: installed (or, an instance's, checked) as its module loads.
        import importlib
        from oscar_vllm.serving import hooks
        for hook in hooks.HOOKS:
            importlib.import_module(hook.module)
        state = hooks.status()
        assert state == {h.name: "checked" if h.kind == hooks.INSTANCE else "installed" for h in hooks.HOOKS}, state
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

    import oscar_vllm.serving.backend  # noqa: F401  (installs the hooks)
    from oscar_vllm.serving.backend import OscarAttentionBackend
    from oscar_vllm.serving.vllm_hooks import oscar_kv_cache_spec

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
    import oscar_vllm.serving.backend  # noqa: F401  (installs the hooks)
    from oscar_vllm.serving.vllm_hooks import give_dense_prefill_buffers

    def impl():
        return SimpleNamespace(num_kv_heads=8, head_size=128, flash_attention=print, window_pos=torch.empty(0),
                               dense_kv=None, key_mean={})

    config = SimpleNamespace(model_config=SimpleNamespace(max_model_len=1000, dtype=torch.bfloat16),
                             scheduler_config=SimpleNamespace(max_num_batched_tokens=256))
    impls = [impl() for _ in range(3)]
    assert give_dense_prefill_buffers(impls, config) == 2 * (1000 + 256) * 8 * 128 * 2
    assert impls[0].dense_kv[0].shape == (1256, 8, 128) and impls[0].dense_kv[0].dtype == torch.bfloat16
    assert not impls[0].dense_kv[0].any(), "zeros: whatever FlashAttention reads past a batch is finite"
    assert all(i.dense_kv is impls[0].dense_kv for i in impls), "one pair of buffers for all layers"
    no_flash = [impl(), impl()]
    no_flash[1].flash_attention = None  # an fp32 model: FlashAttention cannot run, nor the dense path
    assert give_dense_prefill_buffers(no_flash, config) == 0 and no_flash[0].dense_kv is None
    with_mean = [impl(), impl()]
    with_mean[0].key_mean = {"key_mean": torch.zeros(8, 128)}  # key_mean "on": the dense path adds it back
    assert give_dense_prefill_buffers(with_mean, config) > 0 and with_mean[1].dense_kv is with_mean[0].dense_kv


def test_dense_prefill_is_taken_where_a_prefill_has_a_prefix_and_the_host_knows_the_shapes():
    from oscar_vllm.serving.backend import OscarAttentionImpl

    buf = torch.empty(100, 2, 16)
    impl = SimpleNamespace(dense_kv=(buf, buf), rotate=lambda x: x * 2, flash_attention=print, key_mean={},
                           dense_mean_basis=None)
    k = torch.arange(7.0).view(7, 1, 1).expand(7, 2, 16)
    shapes = ((3, 60), (2, 70))  # more rows than the buffers: oscar_dense_prefill_attention groups them

    def md(**kw):
        base = dict(prefill_has_prefix=True, num_decodes=2, num_reqs=4, prefill_shapes=shapes)
        return SimpleNamespace(**{**base, **kw})

    dense = OscarAttentionImpl.dense_prefill(impl, md(), k)
    assert dense.k_rot[:, 0, 0].tolist() == [4.0, 6.0, 8.0, 10.0, 12.0], "the prefill rows, rotated"
    assert dense.k_buf.data_ptr() == buf.data_ptr() and dense.k_buf.shape[0] == 100
    assert dense.shapes == shapes and dense.max_seq_len == 70 and dense.attention is print
    for why in (dict(prefill_shapes=()), dict(prefill_has_prefix=False), dict(num_decodes=4)):
        assert OscarAttentionImpl.dense_prefill(impl, md(**why), k) is None, why
    assert dense.mean_basis is None and dense.cos_sin is None
    # key_mean "on": the dense path reads the INT2 rows plus the layer's mean
    impl.key_mean = {"key_mean": torch.zeros(2, 16), "cos_sin": torch.zeros(40, 16)}
    impl.dense_mean_basis = torch.ones(16, 2, 16)
    dense = OscarAttentionImpl.dense_prefill(impl, md(), k)
    assert dense.mean_basis is impl.dense_mean_basis and dense.cos_sin is impl.key_mean["cos_sin"]
    impl.key_mean, impl.dense_kv = {}, None
    assert OscarAttentionImpl.dense_prefill(impl, md(), k) is None


def builder_state(max_seqs=4, pages=3, layers=2):
    from oscar_vllm.serving.backend import OscarAttentionMetadataBuilder

    state = SimpleNamespace(null_row=max_seqs, pages_per_ring=pages, sink_pages=1, sink=2, recent=3, batch_rows=None,
                            window_pages=torch.zeros(max_seqs + 1, pages, dtype=torch.int32),
                            ring_slots=torch.full((max_seqs + 2,), max_seqs, dtype=torch.int32),
                            layers=[SimpleNamespace(window_pos=torch.arange(float(max_seqs + 1) * 5).view(-1, 5).int())
                                    for _ in range(layers)])
    # Each layer's KV cache: 12 blocks of 4 bytes, every byte its own value.
    state.caches = [torch.arange(48, dtype=torch.int32).view(12, 4).to(torch.uint8) + 64 * i for i in range(layers)]
    state.layer_caches = lambda: state.caches
    return OscarAttentionMetadataBuilder, state


def test_fixed_decode_splits_size_the_scratch_within_the_kernels_reach():
    from csrc_triton import oscar_attention, oscar_decode
    from oscar_vllm.core.settings import OscarSettingsError
    from oscar_vllm.serving.backend import decode_split_scratch_rows

    assert decode_split_scratch_rows(oscar_decode, 16, 256, 8, 132) == 256 * 16
    assert decode_split_scratch_rows(oscar_decode, 128, 4, 8, 132) == 4 * 128
    assert decode_split_scratch_rows(oscar_decode, 0, 256, 8, 132) == oscar_decode.decode_split_rows(256, 8, 132)
    with pytest.raises(OscarSettingsError, match="decode_splits 128: csrc_triton.oscar_attention splits a request's "
                                                 "keys over at most 64 programs"):
        decode_split_scratch_rows(oscar_attention, 128, 4, 8, 132)
    # Each batch's count: the setting's for every batch size, else the kernel's per size.
    cls, b = builder_state()
    b.decode_kernel, b.num_kv_heads, b.num_sms, b.fixed_splits = oscar_decode, 8, 132, 16
    assert {cls.decode_splits(b, n) for n in (1, 7, 64, 256)} == {16}
    b.fixed_splits = 0
    assert [cls.decode_splits(b, n) for n in (1, 256)] == [oscar_decode.decode_splits(n, 8, 132) for n in (1, 256)]
    assert len({cls.decode_splits(b, n) for n in (1, 7, 64, 256)}) > 1


def test_padded_batch_entries_read_the_empty_row():
    cls, b = builder_state()
    b.batch_rows = torch.tensor([2, 0], dtype=torch.int32)
    b.ring_slots.fill_(1)  # what an earlier batch left
    cls.fill_ring_slots(b, 5)  # a CUDA graph padded 2 requests to 5 entries
    assert b.ring_slots[:5].tolist() == [2, 0, 4, 4, 4]
    for bad in (1, 7):  # fewer entries than rows; more entries than the buffers hold
        with pytest.raises(RuntimeError, match="entries for 2 request rows"):
            cls.fill_ring_slots(b, bad)
    b.batch_rows = None
    with pytest.raises(RuntimeError, match="V2 model runner"):
        cls.fill_ring_slots(b, 2)


def test_new_rows_get_their_pages_and_empty_rings_in_every_layer():
    from oscar_vllm.serving.window_pages import WindowPagesError

    cls, b = builder_state()
    cls.assign_windows(b, [3, 1], [[7, 8, 9], [4, 5, 6]], num_blocks=10)
    assert b.window_pages[3].tolist() == [7, 8, 9] and b.window_pages[1].tolist() == [4, 5, 6]
    for layer in b.layers:
        assert (layer.window_pos[[1, 3]] == -1).all() and (layer.window_pos[[0, 2, 4]] >= 0).all()
    for pages in ([[1, 2]], [[0, 1, 2]], [[1, 2, 10]]):  # too few; the null block; past the pool
        with pytest.raises(WindowPagesError, match="each row needs 3 block ids"):
            cls.assign_windows(b, [0], pages, num_blocks=10)
    cls.assign_windows(b, [0], [[0, 0, 0]], num_blocks=10, allow_null=True)  # vLLM's start-up warm-up


def test_rows_that_share_a_cached_sink_read_it_and_nothing_else():
    cls, b = builder_state()
    cls.assign_windows(b, [3], [[7, 8, 9]], num_blocks=10)
    cls.assign_windows(b, [1, 2], [[7, 5, 6], [1, 2, 4]], num_blocks=10, sink_shared=[True, False])
    assert b.window_pages[1].tolist() == [7, 5, 6], "row 1 shares row 3's sink page"
    for layer in b.layers:
        assert layer.window_pos[1].tolist() == [0, 1, -1, -1, -1], "the sink (2 positions) only"
        assert (layer.window_pos[[2, 3]] == -1).all()


def test_a_row_that_copies_an_earlier_requests_ring_reads_the_positions_it_holds():
    """A ring of positions [4, 9) (sink 2, recent 3): it holds the last three, 6, 7 and 8, each at
    its entry 2 + (p - 2) % 3, as the write kernels left them; every other entry stays empty. Its
    pages (8, 9) are copied into each taker's recent pages in every layer, and stay as they were."""
    from oscar_vllm.serving.window_pages import WindowPagesError

    cls, b = builder_state()
    before = [c.clone() for c in b.caches]
    cls.assign_windows(b, [3], [[7, 8, 9]], num_blocks=12)
    cls.assign_windows(b, [1, 2, 0], [[7, 5, 6], [1, 2, 4], [3, 10, 11]], num_blocks=12,
                       sink_shared=[True, False, False], rings=[(4, 9, [8, 9]), None, (7, 9, [8, 9])])
    for layer in b.layers:
        assert layer.window_pos[1].tolist() == [0, 1, 8, 6, 7], "the shared sink and the copied ring"
        assert layer.window_pos[2].tolist() == [-1] * 5
        assert layer.window_pos[0].tolist() == [-1, -1, 8, -1, 7], "a ring that holds only 7 and 8"
    for cache, old in zip(b.caches, before):
        assert torch.equal(cache[[5, 6]], old[[8, 9]]) and torch.equal(cache[[10, 11]], old[[8, 9]])
        untouched = [i for i in range(12) if i not in (5, 6, 10, 11)]
        assert torch.equal(cache[untouched], old[untouched]), "the sources and every other block as they were"
    for bad in ([8], [8, 12], [0, 8]):  # too few; past the pool; the null block
        with pytest.raises(WindowPagesError, match="ring source pages"):
            cls.assign_windows(b, [1], [[7, 5, 6]], num_blocks=12, rings=[(4, 9, bad)])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (tests/gpu/run.sh tests)")
def test_admitting_requests_does_not_synchronize_the_gpu():
    # A synchronizing copy here made every step that admits requests wait for the step before.
    cls, b = builder_state()
    b.window_pages, b.ring_slots = b.window_pages.cuda(), b.ring_slots.cuda()
    for layer in b.layers:
        layer.window_pos = layer.window_pos.cuda()
    b.caches = [c.cuda() for c in b.caches]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        cls.assign_windows(b, [3], [[7, 8, 9]], num_blocks=10)
        cls.assign_windows(b, [1, 2], [[7, 5, 6], [1, 2, 4]], num_blocks=10, sink_shared=[True, False],
                           rings=[(4, 9, [8, 9]), None])
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert b.window_pages[1].tolist() == [7, 5, 6] and b.window_pages[2].tolist() == [1, 2, 4]
    for layer in b.layers:
        assert layer.window_pos[1].tolist() == [0, 1, 8, 6, 7] and (layer.window_pos[[2, 3]] == -1).all()


def test_a_second_weight_hook_would_fold_twice_and_is_refused():
    from oscar_vllm.core.fold import RotationFoldError
    from oscar_vllm.core.settings import BACKEND_NAME
    from oscar_vllm.serving.vllm_hooks import prepare_model

    backend = SimpleNamespace(get_name=lambda: BACKEND_NAME)

    class Block(torch.nn.Module):
        def __init__(self, i):
            super().__init__()
            self.qkv_proj = torch.nn.Linear(2, 2)
            self.o_proj = torch.nn.Linear(2, 2)
            self.attn = torch.nn.Module()
            self.attn.attn_backend = backend
            self.attn.layer_name = f"model.layers.{i}.self_attn.attn"
            self.attn.impl = SimpleNamespace(rot_k=torch.eye(2) if i == 1 else None)

    model = torch.nn.Sequential(Block(0), Block(1))
    before = [p.clone() for p in model.parameters()]
    with pytest.raises(RotationFoldError, match=r"layers \[1\] already hold their rotations"):
        prepare_model(model)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters())), "no weight touched"


def test_key_means_take_rotate_half_rope_over_the_whole_head_from_vllm():
    """The RoPE table key means are turned with: vLLM's own rotary embedding of the block, where it is
    the rotate-half form over all dims; any other is refused at load, naming the layer."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope

    from oscar_vllm.core.settings import OscarSettingsError
    from oscar_vllm.serving.vllm_hooks import rope_table_of
    from benchmarks.vllm_cpu import vllm_configs_on_cpu

    with vllm_configs_on_cpu(), set_current_vllm_config(VllmConfig()):  # vLLM's ops read it when built
        neox = get_rope(64, 128, is_neox_style=True, dtype=torch.float32)
        gptj = get_rope(64, 128, is_neox_style=False, dtype=torch.float32)
    table = rope_table_of(SimpleNamespace(rotary_emb=neox), 3, 64)
    assert table.shape == (128, 64)
    angle = 5 * neox.base ** (-2 * 7 / 64)  # position 5, frequency 7
    torch.testing.assert_close(table[5, [7, 39]].double(), torch.tensor([math.cos(angle), math.sin(angle)],
                                                                          dtype=torch.float64), atol=1e-6, rtol=0)
    for block in (SimpleNamespace(rotary_emb=gptj), SimpleNamespace()):
        with pytest.raises(OscarSettingsError, match="key_mean 'on' needs rotate-half RoPE over all 64 dims of a "
                                                     "head.*layer 3"):
            rope_table_of(block, 3, 64)


def test_key_mean_auto_serves_means_where_the_rotations_and_the_rope_take_them():
    """``key_mean`` "auto", the default: the layers' RoPE tables where the rotations have means,
    prefill_read is "chunk" and every layer's RoPE is rotate-half over the whole head (one table for
    layers sharing an embedding); otherwise the keys as they are. "on" refuses what "auto" passes
    over; "off" serves the keys as they are."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope

    from oscar_vllm.core.settings import OscarSettings, OscarSettingsError
    from oscar_vllm.serving.vllm_hooks import rope_tables_for_key_means
    from benchmarks.vllm_cpu import vllm_configs_on_cpu

    with vllm_configs_on_cpu(), set_current_vllm_config(VllmConfig()):
        neox = get_rope(64, 128, is_neox_style=True, dtype=torch.float32)
        gptj = get_rope(64, 128, is_neox_style=False, dtype=torch.float32)

    def block(rotary):
        return SimpleNamespace(rotary_emb=rotary, attn=SimpleNamespace(impl=SimpleNamespace(head_size=64)))

    auto, on = OscarSettings(key_mean="auto"), OscarSettings(key_mean="on")
    tables = rope_tables_for_key_means(auto, True, [(0, block(neox)), (1, block(neox))])
    assert sorted(tables) == [0, 1] and tables[0] is tables[1] and tables[0].dtype == torch.float32
    assert rope_tables_for_key_means(auto, False, [(0, block(neox))]) is None
    assert rope_tables_for_key_means(OscarSettings(key_mean="auto", prefill_read="decode"), True,
                                     [(0, block(neox))]) is None
    assert rope_tables_for_key_means(OscarSettings(key_mean="off"), True, [(0, block(neox))]) is None
    assert OscarSettings().key_mean == "off"  # the means are opt-in: they cost passkeys (docs/quality.md)
    mixed = [(0, block(neox)), (1, block(gptj))]
    assert rope_tables_for_key_means(auto, True, mixed) is None
    with pytest.raises(OscarSettingsError, match="layer 1"):
        rope_tables_for_key_means(on, True, mixed)
