"""Every patch the OSCAR backend makes to vLLM, declared in one table (``HOOKS``), and the one
way they are installed (``install``), checked and bound.

A hook is data: its name, its target (a vLLM module and a qualified name in it), the parameters
its wrapper reads (by name) and the wrapper (``"module:factory"``, imported only once the target
is). Installing it checks that the target is still there and that every parameter it reads is
still a parameter of it that a call can pass; a target that no longer fits is refused, in one
line that names the hook, the target and what changed (``VllmHookError``). The wrapper then reads
those arguments by name from every call, by keyword or at the position the target's own signature
gives them (``Arguments``), never at a position written here: what ``inspect.Signature.bind``
would give, read off the signature once: ``bind`` itself costs microseconds a call (9 us on the
CI's CPU), and the window-page hooks run for every running request in every scheduler step.

When they install. vLLM 0.26.0 runs ``register()``, the ``vllm.general_plugins`` entry point, in
every process it starts, before that process uses any target: in the one that starts an engine
(from ``EngineArgs``, before it builds the engine's config), in the engine core
(``EngineCore.__init__``, before its executor and scheduler; a spawned one unpickles its config
earlier still, which runs ``register()`` through ``plugin.oscar_backend_member``) and in every
worker (``WorkerWrapperBase.init_worker``, before it imports the worker class and with it the
model runner). A forked process skips ``register()`` (vLLM's ``plugins_loaded`` is inherited) and
inherits instead what its parent installed and armed. But ``register()`` must stay cheap, and
most targets live in modules it must not import (the model runner brings the whole worker, and
Triton, into the process that serves HTTP). So ``install()``, which ``register()`` calls, installs
the hooks whose module is loaded already, checks that every other module is there (on disk,
importing nothing) and arms the rest: a finder on ``sys.meta_path`` installs each the moment vLLM
imports its module, once the module has run and before whatever imported it can use it or copy a
name out of it. That covers every process vLLM starts and every order it imports in, forked ones
included (tests/serving/test_hooks.py shows each path). Installing from the
backend module, as before, covered only the processes that build an OSCAR layer: an engine core
whose workers run in other processes builds a scheduler, which needs its hook, and no layer (a
spawned one got its hook when it unpickled the OSCAR enum member). The backend module still calls
``install()`` (it is idempotent), for code that imports it without loading plugins. A target
that no longer fits is refused as its module loads: an engine that could not run OSCAR right
stops at startup, before any request. ``register()`` itself checks only that each armed module
is still there; a vLLM other than 0.26.0 never gets this far (``plugin.vllm_version_problem``):
the table is what a port to another vLLM checks first.

The hooks act in every engine of a process, whichever backend it runs: each wrapper passes the
call through unchanged unless its layer, builder or config is OSCAR's. Kinds:

* ``wrap``: the target is replaced by its wrapper (``__oscar_wrapped__``; installed once).
* ``instance``: checked as its module loads; its owner wraps one object's bound method with
  ``wrap_instance`` (the window pages wrap one scheduler's KV-cache coordinator, block pool and
  ``schedule``; ``oscar_vllm.serving.window_pages``).
* ``member``: the wrapper adds a member to the target enum; ``params`` are the attributes it uses.

Plain Python: ``plugin`` imports this module, so it imports neither torch nor vLLM.
"""
from __future__ import annotations

import functools
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import inspect
import sys
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version

from oscar_vllm.core.errors import OscarError

SUPPORTED_VLLM = "0.26.0"  # the vLLM every hook below is written against, exactly

WRAP, INSTANCE, MEMBER = "wrap", "instance", "member"


class VllmHookError(OscarError, RuntimeError):
    """A vLLM whose code no longer fits a hook: the message (one line) names the hook, its target
    and what changed."""


@dataclass(frozen=True)
class Hook:
    name: str
    module: str  # the vLLM module that holds the target
    qualname: str  # the target in it: "Class.method", "function", "Enum"
    params: tuple[str, ...]  # what the wrapper reads from each call, by name (member: attributes)
    wrapper: str  # "module:factory": factory(original, read, *context) -> the wrapper
    does: str  # what it is for, in a line
    kind: str = WRAP

    @property
    def attribute(self) -> str:
        return self.qualname.rpartition(".")[2]


WINDOW_PAGES = "oscar_vllm.serving.window_pages"
VLLM_HOOKS = "oscar_vllm.serving.vllm_hooks"
COORDINATOR = "vllm.v1.core.kv_cache_coordinator"

HOOKS: tuple[Hook, ...] = (
    Hook("backend-name", "vllm.v1.attention.backends.registry", "AttentionBackendEnum",
         ("CUSTOM", "_member_map_", "_value2member_map_", "_member_names_"),
         "oscar_vllm.serving.plugin:add_oscar_member",
         "--attention-backend OSCAR parses to a member of vLLM's backend enum", kind=MEMBER),
    Hook("startup-check", "vllm.engine.arg_utils", "EngineArgs.create_engine_config", (),
         "oscar_vllm.serving.preflight:check_configs_as_built",
         "an OSCAR engine's config is checked (and its settings pinned) as it is built, before any engine process"),
    Hook("kv-cache-spec", "vllm.model_executor.layers.attention.attention", "Attention.get_kv_cache_spec",
         ("self", "vllm_config"), f"{VLLM_HOOKS}:report_int2_pages",
         "OSCAR layers report INT2 pages, so vLLM sizes the KV cache by the real page"),
    Hook("scheduler-window-pages", "vllm.v1.core.sched.scheduler", "Scheduler.__init__", ("self",),
         f"{VLLM_HOOKS}:give_window_pages_to_schedulers",
         "an OSCAR engine's scheduler gives each request its window pages from its own block pool"),
    Hook("new-rows-window-pages", "vllm.v1.worker.gpu.model_runner", "GPUModelRunner.add_requests",
         ("self", "scheduler_output"), f"{VLLM_HOOKS}:assign_new_rows_window_pages",
         "a new request's row gets its window pages and an empty ring in every OSCAR builder"),
    Hook("batch-rows", "vllm.v1.worker.gpu.model_states.default", "DefaultModelState.prepare_attn",
         ("input_batch", "attn_groups"), f"{VLLM_HOOKS}:give_builders_batch_rows",
         "each batch's request rows go to the OSCAR metadata builders"),
    Hook("weight-fold", "vllm.model_executor.model_loader.base_loader", "process_weights_after_loading", ("model",),
         f"{VLLM_HOOKS}:fold_rotations_after_loading",
         "once the weights are loaded: the rotations loaded, the value rotation folded, each layer its key rotation"),
    Hook("kernel-warm-up", "vllm.v1.worker.gpu.model_runner", "GPUModelRunner.initialize_kv_cache", ("self",),
         f"{VLLM_HOOKS}:warm_up_after_kv_cache",
         "once the KV cache exists, every kernel variant serving launches is compiled, before graph capture"),
    Hook("window-pages-hits", COORDINATOR, "KVCacheCoordinator.find_longest_cache_hit",
         ("block_hashes", "max_cache_hit_length"), f"{WINDOW_PAGES}:trim_cache_hits",
         "prefix-cache hits end where a request's windows can be served", kind=INSTANCE),
    Hook("window-pages-count", COORDINATOR, "KVCacheCoordinator.get_num_blocks_to_allocate",
         ("request_id", "new_computed_blocks"), f"{WINDOW_PAGES}:count_pages",
         "admission counts a new request's window pages", kind=INSTANCE),
    Hook("window-pages-hit-pages", COORDINATOR, "KVCacheCoordinator.allocate_new_computed_blocks",
         ("request_id", "new_computed_blocks"), f"{WINDOW_PAGES}:claim_hit_pages",
         "a request admitted with a hit takes the cached sink and ring it hit", kind=INSTANCE),
    Hook("window-pages-take", COORDINATOR, "KVCacheCoordinator.allocate_new_blocks", ("request_id",),
         f"{WINDOW_PAGES}:take_pages", "a request takes its window pages with its first blocks", kind=INSTANCE),
    Hook("window-pages-free", COORDINATOR, "KVCacheCoordinator.free", ("request_id",),
         f"{WINDOW_PAGES}:free_pages", "a request's pages leave with its blocks", kind=INSTANCE),
    Hook("window-pages-deferred-free", COORDINATOR, "KVCacheCoordinator.pop_blocks_for_free", ("request_id",),
         f"{WINDOW_PAGES}:pop_pages", "a request's pages wait with its blocks where their free is deferred",
         kind=INSTANCE),
    Hook("window-pages-fresh-blocks", "vllm.v1.core.block_pool", "BlockPool.cache_full_blocks",
         ("blocks", "num_cached_blocks", "num_full_blocks"), f"{WINDOW_PAGES}:note_cached_blocks",
         "blocks cached in this step are known, so that no hit covers them", kind=INSTANCE),
    Hook("window-pages-schedule", "vllm.v1.core.sched.scheduler", "Scheduler.schedule", (),
         f"{WINDOW_PAGES}:schedule_with_pages",
         "every scheduler output names the window pages of the requests it sends as new", kind=INSTANCE),
)
BY_NAME = {hook.name: hook for hook in HOOKS}

# No lock: an armed module's hooks install under its own import lock, and installing twice finds
# the wrapper there already (``check``).
_pending: dict[str, dict[str, Hook]] = {}  # by module: hooks armed, to install when it loads
_done: dict[str, str] = {}  # hook name -> "installed" or "checked" (an instance hook's target)


def vllm_version() -> str:
    try:
        return version("vllm")
    except PackageNotFoundError:
        return "(not installed)"


def refusal(what: str) -> str:
    """The one line that refuses a vLLM where ``what`` changed (it names the hook)."""
    return f"vLLM {vllm_version()}{what}: oscar_vllm supports vLLM {SUPPORTED_VLLM}"


class Arguments:
    """Reads the arguments of a call to one target that a hook names, as the target binds them:
    by keyword, else at the position its signature gives the parameter, else its default.
    ``read(args, kwargs)`` is a tuple in the hook's order."""

    __slots__ = ("signature", "slots")

    def __init__(self, signature: inspect.Signature, names: tuple[str, ...]):
        self.signature = signature
        positional = [p.name for p in signature.parameters.values()
                      if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        self.slots = []
        for name in names:
            p = signature.parameters[name]
            self.slots.append((name, positional.index(name) if name in positional else None,
                               p.kind is not p.POSITIONAL_ONLY, p.default))

    def __call__(self, args: tuple, kwargs: dict) -> tuple:
        values = []
        for name, index, by_keyword, default in self.slots:
            if by_keyword and name in kwargs:
                values.append(kwargs[name])
            elif index is not None and index < len(args):
                values.append(args[index])
            elif default is not inspect.Parameter.empty:
                values.append(default)
            else:
                self.signature.bind(*args, **kwargs)  # the TypeError the target itself would raise
                raise TypeError(f"missing argument {name!r}")
        return tuple(values)


def parameters_problem(hook: Hook, target, shown: str) -> tuple[str | None, inspect.Signature | None]:
    """``(refusal or None, the target's signature)``: whether each parameter the hook reads is one a
    call can pass (by position or keyword; not ``*args`` or ``**kwargs``)."""
    named = f"OSCAR hook {hook.name!r}"
    if not callable(target):
        return refusal(f"'s {shown} is not the function {named} wraps (now of type {type(target).__name__})"), None
    try:
        signature = inspect.signature(target)
    except (TypeError, ValueError):
        return refusal(f"'s {shown} has no signature for {named} to bind"), None
    for name in hook.params:
        p = signature.parameters.get(name)
        if p is None:
            return refusal(f"'s {shown} has no parameter {name!r} that {named} binds"), signature
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            stars = "*" if p.kind is p.VAR_POSITIONAL else "**"
            return refusal(f"'s {shown} takes {stars}{name}, not the one parameter {name!r} that {named} binds"), \
                signature
    return None, signature


def check(hook: Hook, module) -> tuple[str | None, tuple | None]:
    """``(refusal or None, (owner, attribute, target, signature))``: the hook's target in its loaded
    ``module``, where it fits; None for a target installed already (in this process, or in the one
    it was forked from)."""
    owner = module
    for part in hook.qualname.split(".")[:-1]:
        owner = getattr(owner, part, None)
    target = getattr(owner, hook.attribute, None) if owner is not None else None
    if target is None:
        return refusal(f" has no {hook.module}.{hook.qualname} for OSCAR hook {hook.name!r} to wrap"), None
    if hook.kind == MEMBER:
        missing = [name for name in hook.params if not hasattr(target, name)]
        if missing:
            return refusal(f"'s {hook.qualname} has no attribute {missing[0]!r} that OSCAR hook {hook.name!r} "
                           "uses"), None
        return None, (owner, hook.attribute, target, None)
    if getattr(target, "__oscar_hook__", None) == hook.name:
        return None, None
    problem, signature = parameters_problem(hook, target, hook.qualname)
    return problem, None if problem else (owner, hook.attribute, target, signature)


def factory(hook: Hook):
    module, _, name = hook.wrapper.partition(":")
    return getattr(importlib.import_module(module), name)


def wrapped(hook: Hook, original, signature: inspect.Signature, *context):
    """``original`` wrapped by ``hook``'s wrapper, made for it (and ``context``)."""
    wrapper = functools.wraps(original)(factory(hook)(original, Arguments(signature, hook.params), *context))
    wrapper.__oscar_wrapped__ = True
    wrapper.__oscar_hook__ = hook.name
    return wrapper


def install_in(module, hooks: list[Hook]) -> None:
    """Install ``hooks``, whose targets are in the loaded ``module``: all checked first, so that
    none is installed if one does not fit."""
    checked = [(hook, *check(hook, module)) for hook in hooks]
    problems = [problem for _, problem, _ in checked if problem]
    if problems:
        raise VllmHookError("; ".join(problems))
    for hook, _, found in checked:
        if hook.kind == MEMBER:
            factory(hook)(found[2])
        elif hook.kind == WRAP and found is not None:
            owner, attribute, original, signature = found
            setattr(owner, attribute, wrapped(hook, original, signature))
        _done[hook.name] = "checked" if hook.kind == INSTANCE else "installed"


def module_exists(name: str) -> bool:
    """Whether module ``name`` is there to import, importing nothing: searched with the path finder,
    from its longest loaded parent down (a top-level package: by ``find_spec``, which loads nothing)."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        loaded = sys.modules.get(".".join(parts[:i]))
        if loaded is not None:
            path = getattr(loaded, "__path__", None)
            break
    else:
        spec = importlib.util.find_spec(parts[0])
        if spec is None:
            return False
        i, path = 1, spec.submodule_search_locations
    for j in range(i, len(parts)):
        spec = None if path is None else importlib.machinery.PathFinder.find_spec(".".join(parts[: j + 1]), path)
        if spec is None:
            return False
        path = spec.submodule_search_locations
    return True


def loading(module) -> bool:
    """Whether ``module`` (in ``sys.modules``) is still running, not yet whole."""
    return bool(getattr(getattr(module, "__spec__", None), "_initializing", False))


class _InstallAfterLoading(importlib.abc.Loader):
    """The loader of an armed module: runs it, then installs its hooks."""

    def __init__(self, loader):
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        module.__loader__ = module.__spec__.loader = self.loader  # nothing of this one stays behind
        self.loader.exec_module(module)
        install_armed(module)


class _ArmedModules(importlib.abc.MetaPathFinder):
    """Finds nothing itself: an armed module, as the other finders find it, gets a loader that
    installs its hooks once it has run."""

    def find_spec(self, fullname, path, target=None):
        if _pending and any(m in sys.modules for m in _pending):
            install_loaded()  # armed while they were running (install() from inside their import)
        if fullname not in _pending:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _InstallAfterLoading(spec.loader)
                return spec
        return None


_FINDER = _ArmedModules()


def install_armed(module) -> None:
    """Install the hooks armed for ``module``, loaded now; they stay armed if one does not fit (and
    the import fails: a second one fails the same way)."""
    hooks = _pending.pop(module.__name__, None)  # first: the wrappers' imports must not find them armed
    if hooks:
        try:
            install_in(module, list(hooks.values()))
        except BaseException:
            _pending.setdefault(module.__name__, {}).update(hooks)
            raise


def install_loaded() -> None:
    """Install the hooks armed for modules that were running when they were armed, and are whole now."""
    for name in list(_pending):
        module = sys.modules.get(name)
        if module is not None and not loading(module):
            install_armed(module)


def install(hooks: tuple[Hook, ...] = HOOKS) -> None:
    """Install ``hooks`` whose vLLM module is loaded; arm the rest, to install as their module loads
    (see the module's docstring). Idempotent. Imports nothing but the wrappers of what it installs."""
    by_module: dict[str, list[Hook]] = {}
    for hook in hooks:
        if hook.name not in _done and hook.name not in _pending.get(hook.module, ()):
            by_module.setdefault(hook.module, []).append(hook)
    missing = [hook for module, found in by_module.items()
               if module not in sys.modules and not module_exists(module) for hook in found]
    if missing:
        raise VllmHookError("; ".join(refusal(f" has no module {h.module}, where OSCAR hook {h.name!r} wraps "
                                              f"{h.qualname}") for h in missing))
    for module, found in by_module.items():
        loaded = sys.modules.get(module)
        if loaded is not None and not loading(loaded):
            install_in(loaded, found)
        else:
            _pending.setdefault(module, {}).update((hook.name, hook) for hook in found)
    if _pending and _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)


def wrap_instance(name: str, instance, *context):
    """Wrap the bound method of ``instance`` that instance hook ``name`` targets, checked against
    that method's own signature; ``context`` goes to the wrapper's factory. Returns the wrapper."""
    hook = BY_NAME[name]
    if hook.kind != INSTANCE:
        raise ValueError(f"OSCAR hook {name!r} wraps its target where vLLM declares it, not an instance's")
    shown = f"{type(instance).__name__}.{hook.attribute}"
    original = getattr(instance, hook.attribute, None)
    if original is None:
        raise VllmHookError(refusal(f"'s {type(instance).__name__} has no {hook.attribute} for OSCAR hook "
                                    f"{hook.name!r} to wrap"))
    problem, signature = parameters_problem(hook, original, shown)
    if problem:
        raise VllmHookError(problem)
    wrapper = wrapped(hook, original, signature, *context)
    setattr(instance, hook.attribute, wrapper)
    return wrapper


def status() -> dict[str, str]:
    """Each declared hook's state in this process: "installed", "checked" (an instance hook whose
    target fits), "armed" (its module not loaded yet) or "not installed"."""
    armed = {name for hooks in _pending.values() for name in hooks}
    return {hook.name: _done.get(hook.name) or ("armed" if hook.name in armed else "not installed") for hook in HOOKS}
