"""The ``vllm.general_plugins`` entry point: makes ``--attention-backend OSCAR`` select the
OSCAR backend (and ``CUSTOM``, when no other plugin has claimed that slot), and installs the
backend's hooks into vLLM (``oscar_vllm.serving.hooks``).

vLLM loads general plugins in every process, before it parses ``--attention-backend`` into
an ``AttentionBackendEnum`` member, so ``register()`` adds the ``OSCAR`` member there (hook
``backend-name``). It installs every other hook whose vLLM module is loaded, and arms the rest to
install as vLLM imports their module (``hooks.install``): where ``EngineArgs`` is loaded already
(the process that starts an engine), the configs it builds are checked at once
(``oscar_vllm.serving.preflight``). It is idempotent, imports only vLLM's small registry module
(and the wrappers of hooks whose module is loaded) and never touches CUDA.
"""
from __future__ import annotations

import logging
from importlib.metadata import PackageNotFoundError, version

from oscar_vllm.core.settings import BACKEND_NAME, BACKEND_PATH
from oscar_vllm.serving import hooks
from oscar_vllm.serving.hooks import SUPPORTED_VLLM

logger = logging.getLogger(__name__)


def vllm_version_problem() -> str | None:
    try:
        found = version("vllm")
    except PackageNotFoundError:
        return "vLLM is not installed"
    if found != SUPPORTED_VLLM:
        return f"oscar_vllm is built for vLLM {SUPPORTED_VLLM} exactly, found vLLM {found}"
    return None


def check_vllm_version() -> None:
    problem = vllm_version_problem()
    if problem:
        raise RuntimeError(f"{problem}: install it with `pip install vllm=={SUPPORTED_VLLM}`")


def oscar_backend_member():
    """``AttentionBackendEnum.OSCAR``, registering it first: what unpickling the member calls.

    vLLM pickles its config (and this member in it) into spawned engine processes, which
    unpickle it before they load plugins; by value the member would not exist there yet.
    ``register()`` also arms the hooks there, before the process builds its scheduler.
    """
    register()
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    return AttentionBackendEnum[BACKEND_NAME]


def _reduce_oscar_member(protocol):
    return oscar_backend_member, ()


def _add_enum_member(enum_cls, name: str, value: str):
    """Add ``name = value`` to an existing Enum class (Python 3.10-3.13 internals)."""
    if name in enum_cls.__members__:
        return enum_cls[name]
    member = object.__new__(enum_cls)
    member._name_ = name
    member._value_ = value
    member.__reduce_ex__ = _reduce_oscar_member
    member._sort_order_ = len(enum_cls._member_names_)
    enum_cls._member_map_[name] = member
    enum_cls._value2member_map_[value] = member
    enum_cls._member_names_.append(name)
    type.__setattr__(enum_cls, name, member)
    return member


def add_oscar_member(enum_cls) -> None:
    """Hook ``backend-name``: ``OSCAR`` in vLLM's ``AttentionBackendEnum``."""
    _add_enum_member(enum_cls, BACKEND_NAME, BACKEND_PATH)


def register() -> None:
    problem = vllm_version_problem()
    if problem:
        logger.warning("%s; the OSCAR attention backend will refuse to start", problem)
        return
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    # The enum member at once (its module is loaded); the process that starts an engine registers
    # plugins from EngineArgs, imported by then: its configs are checked as they are built, before
    # any engine process or GPU memory. The rest as vLLM imports their modules.
    hooks.install()
    if not AttentionBackendEnum.CUSTOM.is_overridden():
        register_backend(AttentionBackendEnum.CUSTOM, BACKEND_PATH)
