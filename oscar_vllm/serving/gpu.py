"""Which GPUs the OSCAR backend serves, and which decode kernels each takes.

The Gluon kernels (``csrc_triton.oscar_decode``'s decode and ``oscar_write.oscar_write_decode``)
emit Hopper-only instructions: they serve cards of compute capability 9.x (H100, H200). Every
other card of capability 8.0 or newer (A100, A10, L4, L40S, RTX 30xx-50xx, B200) takes the Triton
decode kernel and write (``oscar_attention``, ``oscar_write.oscar_write``), which is also what the
``decode_kernel`` setting "triton" forces on a Hopper card. Prefill is Triton and vLLM's
FlashAttention on every card (FA2 on 8.x, FA3 on 9.x, FA4 on 10.x: vLLM picks it). Below 8.0
neither Triton's bf16 tensor-core products nor FlashAttention run, so those cards are refused.
Two limits of the Triton kernels refuse a model's head_dim on some cards, by name: at 256 their
programs take more shared memory than a card of compute capability 8.x or 12.x gives one, and on
10.x (B200) the pinned Triton does not compile the INT2 prefill kernel's launch at head_dim 128 and
256. Each limit is compiled again by ``tests/serving/test_gpu.py``.

Plain Python, no torch: ``oscar-vllm serve`` checks the card before it loads vLLM. The card is
read through NVML, as vLLM's CUDA platform reads it, so no CUDA context is created in a process
vLLM forks its engine from.
"""
from __future__ import annotations

import os
from typing import Mapping

from oscar_vllm.core.errors import OscarError

MIN_CAPABILITY = (8, 0)  # the Triton kernels' and FlashAttention's oldest architecture (Ampere)
GLUON_MAJOR = 9  # the Gluon kernels are compiled for sm_90 (Hopper) only
# The most shared memory one program may take (bytes, CUDA's opt-in maximum per block), by compute capability.
SHARED_MEMORY_PER_PROGRAM = {(8, 0): 166_912, (8, 6): 101_376, (8, 7): 166_912, (8, 9): 101_376, (9, 0): 232_448,
                             (10, 0): 232_448, (10, 3): 232_448, (12, 0): 101_376, (12, 1): 101_376}
# The shared memory of the Triton kernels' largest program at each head_dim, as Triton compiles them for
# sm_80 and sm_89: at 128 and 256 the prefill over a cached prefix (PREFILL_LAUNCH), at 64 the prefill
# write (tests/serving/test_gpu.py compiles the prefill again).
KERNEL_SHARED_MEMORY = {64: 24_576, 128: 90_368, 256: 180_480}
# Head dims whose INT2 prefill launch (PREFILL_LAUNCH: 128 query rows; 64 with a key mean) Triton 3.6
# cannot compile for a compute capability's major version: on 10.x its tensor-memory layout pass fails
# ("parent layout must have at least rank >= 2"); head_dim 64's launch of 16 rows compiles.
UNCOMPILED_HEAD_DIMS = {10: (128, 256)}
WHAT_SERVES = ("on this card serve with vLLM's own attention backends (leave out --attention-backend OSCAR), or "
               "serve OSCAR on a newer one (A100, A10, L4, L40S, RTX 30xx-50xx, H100, H200)")


class OscarGpuError(OscarError, RuntimeError):
    """No GPU the backend can serve on; the message names the card, or says there is none."""


def capability_text(capability: tuple[int, int]) -> str:
    return f"{capability[0]}.{capability[1]}"


def decode_kernel_for(capability: tuple[int, int], decode_kernel: str = "auto") -> str:
    """``"gluon"`` or ``"triton"``: the decode kernels a card of ``capability`` takes under the
    ``decode_kernel`` setting (``gpu_problem`` says which pairs are refused). The backend's layers
    take this (and the model's shape, ``OscarAttentionImpl``); its metadata builder takes theirs."""
    if decode_kernel == "triton" or tuple(capability)[0] != GLUON_MAJOR:
        return "triton"
    return "gluon"


def gpu_problem(capability: tuple[int, int], decode_kernel: str = "auto", name: str | None = None,
                head_dim: int | None = None) -> str | None:
    """Why the backend cannot serve on a card of ``capability`` (named ``name``) with the
    ``decode_kernel`` setting (and a model of ``head_dim``, where given), as one sentence that says
    what would serve it; None where it can."""
    capability = tuple(capability)
    card = f"{name + ' ' if name else 'a GPU '}(compute capability {capability_text(capability)})"
    if capability < MIN_CAPABILITY:
        return (f"the OSCAR backend does not serve {card}: its Triton kernels and FlashAttention need compute "
                f"capability {capability_text(MIN_CAPABILITY)} or newer; {WHAT_SERVES}")
    if decode_kernel == "gluon" and decode_kernel_for(capability, decode_kernel) != "gluon":
        return (f"decode_kernel 'gluon' on {card}: the Gluon decode kernels are compiled for compute capability "
                f"{GLUON_MAJOR}.x (H100, H200) only; leave decode_kernel at 'auto' (or 'triton'), and the Triton "
                "decode kernels serve this card")
    if head_dim in UNCOMPILED_HEAD_DIMS.get(capability[0], ()):
        return (f"head_dim {head_dim} on {card}: Triton 3.6 does not compile the OSCAR INT2 prefill kernel's "
                f"head_dim {head_dim} launch for compute capability {capability[0]}.x (its tensor-memory layout pass "
                "fails); serve this model with OSCAR on a card of compute capability 8.x or 9.x (A100, L40S, H100, "
                "H200), or on this one with vLLM's own attention backends (leave out --attention-backend OSCAR)")
    need, limit = KERNEL_SHARED_MEMORY.get(head_dim), SHARED_MEMORY_PER_PROGRAM.get(capability)
    if need and limit and need > limit:
        return (f"head_dim {head_dim} on {card}: the OSCAR Triton prefill kernel at head_dim {head_dim} takes "
                f"{need // 1024} KiB of shared memory a program, and this card gives one at most {limit // 1024} KiB; "
                "serve this model with OSCAR on a card of compute capability 9.x (H100, H200), or on "
                "this one with vLLM's own attention backends (leave out --attention-backend OSCAR)")
    return None


def supports_capability(capability: tuple[int, int], decode_kernel: str = "auto", head_dim: int | None = None) -> bool:
    return gpu_problem(capability, decode_kernel, head_dim=head_dim) is None


def first_visible_device(environ: Mapping[str, str] | None = None) -> int | str | None:
    """The first GPU CUDA sees, as NVML names it: ``CUDA_VISIBLE_DEVICES``' first entry, an index or
    a ``GPU-``/``MIG-`` UUID; GPU 0 where the variable is unset; None where it hides every GPU (set
    but empty, or ``-1``: CUDA then sees none, and vLLM refuses an empty one)."""
    environ = os.environ if environ is None else environ
    if "CUDA_VISIBLE_DEVICES" not in environ:
        return 0
    first = environ["CUDA_VISIBLE_DEVICES"].split(",")[0].strip()
    if first.isdigit():
        return int(first)
    if first.startswith(("GPU-", "MIG-")):
        return first
    return None


def first_visible_gpu(environ: Mapping[str, str] | None = None) -> tuple[str, tuple[int, int]]:
    """``(name, compute capability)`` of the GPU vLLM would serve on (the first CUDA sees), read
    through NVML as vLLM's CUDA platform reads it; :class:`OscarGpuError` where there is none."""
    environ = os.environ if environ is None else environ
    device = first_visible_device(environ)
    if device is None:
        raise OscarGpuError(f"no CUDA GPU: CUDA_VISIBLE_DEVICES={environ['CUDA_VISIBLE_DEVICES']!r} "
                            "hides every GPU; the OSCAR backend serves on an NVIDIA GPU of compute capability "
                            f"{capability_text(MIN_CAPABILITY)} or newer")
    try:
        import pynvml  # nvidia-ml-py, a dependency of vLLM
    except ImportError:
        from vllm.third_party import pynvml
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as e:
        raise OscarGpuError(f"no CUDA GPU found (NVML: {e}): the OSCAR backend serves on an NVIDIA GPU of compute "
                            f"capability {capability_text(MIN_CAPABILITY)} or newer") from None
    try:
        handle = (pynvml.nvmlDeviceGetHandleByIndex(device) if isinstance(device, int)
                  else pynvml.nvmlDeviceGetHandleByUUID(device))
        name = pynvml.nvmlDeviceGetName(handle)
        major, minor = pynvml.nvmlDeviceGetCudaComputeCapability(handle)
    except pynvml.NVMLError as e:
        raise OscarGpuError(f"no CUDA GPU {device} (NVML: {e}): the OSCAR backend serves on an NVIDIA GPU of compute "
                            f"capability {capability_text(MIN_CAPABILITY)} or newer") from None
    finally:
        pynvml.nvmlShutdown()
    return (name.decode() if isinstance(name, bytes) else name), (major, minor)


def check_gpu(decode_kernel: str = "auto", environ: Mapping[str, str] | None = None) -> tuple[str, tuple[int, int]]:
    """The GPU vLLM would serve on, or :class:`OscarGpuError` naming why there is none it can use."""
    name, capability = first_visible_gpu(environ)
    problem = gpu_problem(capability, decode_kernel, name)
    if problem:
        raise OscarGpuError(problem)
    return name, capability
