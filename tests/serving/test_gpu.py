"""Which GPUs the backend serves and which decode kernels each takes (oscar_vllm/serving/gpu.py), on
the CPU: the card's compute capability is an argument, and the backend's layers, its metadata
builder, vLLM's own backend selection and the startup check all take their choice from there."""
from types import SimpleNamespace

import pytest
import torch
from benchmarks.vllm_cpu import Card

from oscar_vllm.core.settings import OscarSettings, OscarSettingsError
from oscar_vllm.serving.gpu import (
    OscarGpuError,
    check_gpu,
    decode_kernel_for,
    first_visible_device,
    first_visible_gpu,
    gpu_problem,
)

vllm = pytest.importorskip("vllm")

A100, L40S, H100, B200, T4 = (8, 0), (8, 9), (9, 0), (10, 0), (7, 5)
SERVED = [A100, L40S, H100, B200]


@pytest.mark.parametrize("capability,auto", [(A100, "triton"), (L40S, "triton"), (H100, "gluon"), ((9, 2), "gluon"),
                                             (B200, "triton"), ((12, 0), "triton")])
def test_only_hopper_takes_the_gluon_kernels_and_triton_forces_the_fallback(capability, auto):
    assert decode_kernel_for(capability) == decode_kernel_for(capability, "auto") == auto
    assert decode_kernel_for(capability, "triton") == "triton"
    assert gpu_problem(capability) is None and gpu_problem(capability, "triton") is None


def test_a_card_below_8_0_is_refused_in_one_sentence_naming_it():
    message = gpu_problem(T4, name="Tesla T4")
    assert message.startswith("the OSCAR backend does not serve Tesla T4 (compute capability 7.5): its Triton "
                              "kernels and FlashAttention need compute capability 8.0 or newer; on this card "
                              "serve with vLLM's own attention backends (leave out --attention-backend OSCAR), or "
                              "serve OSCAR on a newer one (A100,")
    assert "\n" not in message
    assert gpu_problem(T4, "triton", "Tesla T4") == message, "no setting serves it"
    assert "a GPU (compute capability 7.0)" in gpu_problem((7, 0))  # where the name is not known


@pytest.mark.parametrize("capability", [A100, L40S, B200])
def test_gluon_is_refused_off_hopper_by_name(capability):
    message = gpu_problem(capability, "gluon", "NVIDIA X")
    assert message.startswith(f"decode_kernel 'gluon' on NVIDIA X (compute capability {capability[0]}."
                              f"{capability[1]}): the Gluon decode kernels are compiled for compute capability 9.x "
                              "(H100, H200) only")
    assert gpu_problem(H100, "gluon", "NVIDIA H100") is None and decode_kernel_for(H100, "gluon") == "gluon"


@pytest.mark.parametrize("capability,refused", [(A100, (256,)), (L40S, (256,)), ((12, 0), (256,)), (H100, ()),
                                               (B200, (128, 256))])
def test_head_dims_the_triton_kernels_cannot_launch_on_a_card_are_refused_by_name(capability, refused):
    for head_dim in (64, 128, 256):
        message = gpu_problem(capability, name="NVIDIA X", head_dim=head_dim)
        assert (message is not None) == (head_dim in refused), head_dim
        if message:
            assert message.startswith(f"head_dim {head_dim} on NVIDIA X (compute capability "
                                      f"{capability[0]}.{capability[1]}): ")
            assert "serve this model with OSCAR on a card of compute capability" in message


def test_the_decode_kernel_setting_from_either_source_and_a_bad_one_by_name():
    assert OscarSettings.from_sources({}, environ={}).decode_kernel == "auto"
    assert OscarSettings.from_sources({}, environ={"OSCAR_DECODE_KERNEL": "triton"}).decode_kernel == "triton"
    assert OscarSettings.from_sources({"oscar": {"decode_kernel": "gluon"}},
                                      environ={"OSCAR_DECODE_KERNEL": "triton"}).decode_kernel == "gluon"
    with pytest.raises(OscarSettingsError, match=r"decode_kernel must be one of \('auto', 'gluon', 'triton'\), "
                                                 r"got 'cuda'"):
        OscarSettings.from_sources({}, environ={"OSCAR_DECODE_KERNEL": "cuda"})


# ------------------------------------------------------------------ the backend's layers and builder


LAYER = dict(num_heads=32, num_kv_heads=8, head_size=128, dtype=torch.bfloat16)  # a shape the Gluon kernel serves


@pytest.mark.parametrize("capability", SERVED)
@pytest.mark.parametrize("setting", ["auto", "triton"])
def test_a_layer_takes_the_gluon_decode_on_hopper_only(capability, setting):
    from oscar_vllm.serving.backend import uses_gluon_decode

    settings = OscarSettings(decode_kernel=setting)
    assert uses_gluon_decode(settings, **LAYER, capability=capability) == (capability == H100 and setting == "auto")
    assert not uses_gluon_decode(settings, **LAYER, capability=None), "no CUDA device"
    # Shapes the Gluon kernel does not serve take the Triton one on Hopper too.
    assert not uses_gluon_decode(settings, **dict(LAYER, dtype=torch.float32), capability=capability)
    assert not uses_gluon_decode(settings, **dict(LAYER, head_size=256), capability=capability)


def test_gluon_forced_on_a_shape_it_does_not_serve_is_refused_by_name():
    from oscar_vllm.serving.backend import uses_gluon_decode

    settings = OscarSettings(decode_kernel="gluon")
    assert uses_gluon_decode(settings, **LAYER, capability=H100)
    with pytest.raises(OscarSettingsError, match=r"decode_kernel 'gluon': the Gluon decode kernel does not serve this "
                                                 r"model's layers \(32 query and 8 KV heads, head_dim 256, bfloat16"):
        uses_gluon_decode(settings, **dict(LAYER, head_size=256), capability=H100)


def test_the_builder_takes_the_decode_kernels_its_layers_chose():
    from oscar_vllm.serving.backend import layers_use_gluon_decode

    assert layers_use_gluon_decode([SimpleNamespace(gluon_decode=True)] * 3)
    assert not layers_use_gluon_decode([SimpleNamespace(gluon_decode=False)] * 3)
    with pytest.raises(RuntimeError, match="chose different decode kernels"):
        layers_use_gluon_decode([SimpleNamespace(gluon_decode=True), SimpleNamespace(gluon_decode=False)])


# ------------------------------------------------------------------ vLLM's backend selection


def selection_reasons(capability: tuple[int, int], head_size: int = 128) -> list[str]:
    """What vLLM's ``validate_configuration`` (its backend selection) says of the OSCAR backend on a card."""
    from vllm.platforms.interface import DeviceCapability

    from oscar_vllm.serving.backend import OscarAttentionBackend

    return OscarAttentionBackend.validate_configuration(
        head_size=head_size, dtype=torch.bfloat16, kv_cache_dtype="auto", block_size=64, use_mla=False, has_sink=False,
        use_sparse=False, use_mm_prefix=False, use_per_head_quant_scales=False,
        device_capability=DeviceCapability(*capability), attn_type="decoder")


def test_vllm_selects_the_backend_from_8_0_and_refuses_older_cards_by_capability(monkeypatch):
    """The card's name in the reasons is this machine's first GPU, as vLLM's platform names it (none here)."""
    monkeypatch.delenv("OSCAR_DECODE_KERNEL", raising=False)
    for capability in SERVED:
        assert selection_reasons(capability, head_size=64) == []
        assert selection_reasons(capability) == [] or capability == B200
    reasons = selection_reasons(T4)
    assert reasons[0] == "compute capability not supported"  # vLLM's own, from supports_compute_capability
    assert "(compute capability 7.5): its Triton kernels and FlashAttention need compute capability 8.0" in reasons[1]
    [reason] = selection_reasons(A100, head_size=256)
    assert reason.startswith("head_dim 256 on ") and "(compute capability 8.0): the OSCAR Triton prefill" in reason
    [reason] = selection_reasons(B200)
    assert reason.startswith("head_dim 128 on ") and "(compute capability 10.0): Triton 3.6 does not compile" in reason
    monkeypatch.setenv("OSCAR_DECODE_KERNEL", "gluon")
    assert selection_reasons(H100) == []
    assert "(compute capability 8.9): the Gluon decode kernels are compiled for" in selection_reasons(L40S)[1]


# ------------------------------------------------------------------ the startup check and the card itself


def test_the_startup_check_names_a_card_it_cannot_serve(monkeypatch):
    from oscar_vllm.serving import preflight

    def on(card: Card, settings: OscarSettings, head_dim: int | None = None) -> list[str]:
        monkeypatch.setattr(preflight, "serving_platform", lambda: card)
        return preflight.gpu_problems(settings, head_dim)

    assert on(Card("NVIDIA A100-SXM4-80GB", A100), OscarSettings()) == []
    assert on(Card("NVIDIA H200", H100), OscarSettings(decode_kernel="gluon"), 256) == []
    assert on(Card("Tesla T4", T4), OscarSettings()) == [gpu_problem(T4, name="Tesla T4")]
    assert on(Card("NVIDIA L40S", L40S), OscarSettings(decode_kernel="gluon")) == [
        gpu_problem(L40S, "gluon", "NVIDIA L40S")]
    assert on(Card("NVIDIA L40S", L40S), OscarSettings(), 128) == []
    assert on(Card("NVIDIA L40S", L40S), OscarSettings(), 256) == [gpu_problem(L40S, name="NVIDIA L40S", head_dim=256)]
    monkeypatch.undo()
    if not torch.cuda.is_available():  # vLLM on no CUDA platform: nothing to check (CPU tests build configs so)
        assert preflight.gpu_problems(OscarSettings(decode_kernel="gluon"), 256) == []


@pytest.mark.parametrize("visible,device", [(None, 0), ("", None), ("-1", None), ("2,0", 2), (" 1", 1),
                                            ("GPU-8a2b", "GPU-8a2b"), ("MIG-4f1c,GPU-1", "MIG-4f1c")])
def test_the_first_visible_gpu_is_cuda_visible_devices_first_entry(visible, device):
    environ = {} if visible is None else {"CUDA_VISIBLE_DEVICES": visible}
    assert first_visible_device(environ) == device


@pytest.mark.parametrize("visible", ["", "-1"])
def test_no_visible_gpu_is_one_error_naming_the_variable(visible):
    with pytest.raises(OscarGpuError, match=rf"^no CUDA GPU: CUDA_VISIBLE_DEVICES='{visible}' hides every GPU; "
                                            "the OSCAR backend serves on an NVIDIA GPU of compute capability 8.0 "
                                            "or newer$"):
        first_visible_gpu({"CUDA_VISIBLE_DEVICES": visible})
    with pytest.raises(OscarGpuError):
        check_gpu(environ={"CUDA_VISIBLE_DEVICES": visible})


def test_this_machines_gpu_as_nvml_reads_it():
    """On a machine without a GPU (no NVML): the error that says so; with one, what NVML names."""
    try:
        name, capability = first_visible_gpu()
    except OscarGpuError as e:
        assert not torch.cuda.is_available()
        assert str(e).startswith("no CUDA GPU") and "compute capability 8.0 or newer" in str(e)
        return
    assert tuple(torch.cuda.get_device_capability(0)) == capability and name


# ------------------------------------------------------------------ the kernels' limits, compiled again

COMPILE = """
import json, sys, types
from benchmarks.kernel_bench import compile_check
from triton.backends.compiler import GPUTarget
from csrc_triton import oscar_attention

for arch, d in json.loads(sys.argv[1]):
    compile_check.GPUTarget = lambda *_: GPUTarget("cuda", arch, 32)
    shape = types.SimpleNamespace(g=4, d=d, block_m=oscar_attention.PREFILL_LAUNCH[0], no_asm=False, key_mean=False)
    try:
        kernel = compile_check.compile_kernel(oscar_attention._oscar_attention_kernel,
                                              compile_check.prefill_consts(shape), *oscar_attention.PREFILL_LAUNCH[1:])
        print(json.dumps([arch, d, kernel.metadata.shared]))
    except Exception as e:  # the compiler's own failure, whatever its type
        print(json.dumps([arch, d, type(e).__name__]))
"""


def test_the_head_dim_limits_are_what_triton_compiles():
    """The INT2 prefill kernel at its launch, compiled as Triton compiles it for each card (no GPU):
    at head_dim 128 it fits the 99 KiB an L40S gives a program, at 256 not even an A100's 163 KiB, and
    for a B200 it does not compile; where one of these changes, so must gpu.py's tables."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    from oscar_vllm.serving.gpu import KERNEL_SHARED_MEMORY, SHARED_MEMORY_PER_PROGRAM

    repo = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # a real compile
    env["PYTHONPATH"] = str(repo)
    cases = [(89, 128), (80, 256), (100, 128)]
    proc = subprocess.run([sys.executable, "-c", COMPILE, json.dumps(cases)], capture_output=True, text=True,
                          env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = {(arch, d): shared for arch, d, shared in map(json.loads, proc.stdout.splitlines())}
    assert got[89, 128] == KERNEL_SHARED_MEMORY[128] <= SHARED_MEMORY_PER_PROGRAM[L40S]
    assert got[80, 256] == KERNEL_SHARED_MEMORY[256] > SHARED_MEMORY_PER_PROGRAM[A100]
    assert not isinstance(got[100, 128], int), "compiles for sm_100 now: lift gpu.UNCOMPILED_HEAD_DIMS"
    assert gpu_problem(L40S, head_dim=128) is None and gpu_problem(H100, head_dim=256) is None
    assert "256 takes 176 KiB of shared memory a program" in gpu_problem(A100, head_dim=256)
    assert "Triton 3.6 does not compile" in gpu_problem(B200, head_dim=128) and gpu_problem(B200, head_dim=64) is None
