"""The hook registry (``oscar_vllm.serving.hooks``): each patch into vLLM is checked against its
target as it installs, reads its arguments by name, and a vLLM whose target no longer fits is
refused in one line that names the hook. Fake vLLM modules, written here, stand in for a vLLM
whose code changed."""
import dataclasses
import importlib
import inspect
import os
import subprocess
import sys
import textwrap
import uuid
from types import SimpleNamespace

import pytest

from oscar_vllm.core.errors import OscarError
from oscar_vllm.core.settings import BACKEND_NAME
from oscar_vllm.serving import hooks
from oscar_vllm.serving.hooks import VllmHookError

# vLLM 0.26.0's DefaultModelState.prepare_attn, and two changed ones: the argument the hook reads
# renamed; moved, the others keyword-only.
CURRENT = """
class DefaultModelState:
    def prepare_attn(self, input_batch, cudagraph_mode, block_tables, slot_mappings, attn_groups, kv_cache_config,
                     for_capture=False):
        return ("metadata", attn_groups)
"""
RENAMED = CURRENT.replace("attn_groups, kv_cache_config", "attention_groups, kv_cache_config").replace(
    '("metadata", attn_groups)', '("metadata", attention_groups)')
MOVED = """
class DefaultModelState:
    def prepare_attn(self, input_batch, attn_groups, *, cudagraph_mode, block_tables, slot_mappings, kv_cache_config,
                     for_capture=False):
        return ("metadata", attn_groups)
"""


@pytest.fixture
def registry(monkeypatch):
    """The registry's state for this test alone (what it armed and installed)."""
    monkeypatch.setattr(hooks, "_pending", {})
    monkeypatch.setattr(hooks, "_done", {})


@pytest.fixture
def fake_vllm(tmp_path, monkeypatch, registry):
    """``write(source) -> (module name, the batch-rows hook declared on that module)``: a module not
    imported yet; the hook is the real one (its wrapper, parameters and name), its target moved."""
    monkeypatch.syspath_prepend(str(tmp_path))
    names = []

    def write(source: str):
        name = f"fake_vllm_{uuid.uuid4().hex[:10]}"
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
        importlib.invalidate_caches()
        names.append(name)
        return name, dataclasses.replace(hooks.BY_NAME["batch-rows"], module=name)

    yield write
    for name in names:
        sys.modules.pop(name, None)


def refusal(what: str, hook: str = "batch-rows") -> str:
    return f"vLLM {hooks.vllm_version()}'s {what} that OSCAR hook {hook!r} binds: oscar_vllm supports vLLM 0.26.0"


def test_a_loaded_target_whose_signature_differs_is_refused_in_one_line(fake_vllm):
    name, hook = fake_vllm(RENAMED)
    module = importlib.import_module(name)
    original = module.DefaultModelState.prepare_attn
    with pytest.raises(VllmHookError) as refused:
        hooks.install((hook,))
    message = str(refused.value)
    assert message == refusal("DefaultModelState.prepare_attn has no parameter 'attn_groups'")
    assert "\n" not in message and isinstance(refused.value, OscarError)
    assert module.DefaultModelState.prepare_attn is original, "nothing installed"


def test_a_target_armed_before_its_module_loads_is_refused_as_it_loads(fake_vllm):
    """As in a worker: register() arms the hook, and vLLM imports the module later."""
    name, hook = fake_vllm(RENAMED)
    hooks.install((hook,))
    assert name not in sys.modules and hooks.status()["batch-rows"] == "armed"
    for _ in range(2):  # the import fails, and fails again: the hook stays armed
        with pytest.raises(VllmHookError) as refused:
            importlib.import_module(name)
        assert str(refused.value) == refusal("DefaultModelState.prepare_attn has no parameter 'attn_groups'")
        assert name not in sys.modules


@pytest.mark.parametrize("source, what", [
    (CURRENT.replace("attn_groups, kv_cache_config", "*attn_groups, kv_cache_config"),
     "DefaultModelState.prepare_attn takes *attn_groups, not the one parameter 'attn_groups'"),
    (CURRENT.replace("def prepare_attn", "def build_attn"), None),
    (CURRENT.replace("class DefaultModelState", "class ModelState"), None),
    ("class DefaultModelState:\n    prepare_attn = 3\n",
     "DefaultModelState.prepare_attn is not the function OSCAR hook 'batch-rows' wraps (now of type int)"),
], ids=["now-var-positional", "method-gone", "class-gone", "not-a-function"])
def test_every_change_of_a_target_is_refused_in_one_line_naming_the_hook(fake_vllm, source, what):
    name, hook = fake_vllm(source)
    importlib.import_module(name)
    with pytest.raises(VllmHookError) as refused:
        hooks.install((hook,))
    message = str(refused.value)
    version = hooks.vllm_version()
    if what is None:
        assert message == (f"vLLM {version} has no {name}.DefaultModelState.prepare_attn for OSCAR hook "
                           "'batch-rows' to wrap: oscar_vllm supports vLLM 0.26.0")
    elif what.endswith("int)"):
        assert message == f"vLLM {version}'s {what}: oscar_vllm supports vLLM 0.26.0"
    else:
        assert message == refusal(what)
    assert "\n" not in message


def test_a_module_that_is_gone_is_refused_at_once_importing_nothing(tmp_path, monkeypatch, registry):
    package = tmp_path / f"fake_vllm_{uuid.uuid4().hex[:10]}"
    package.mkdir()
    (package / "__init__.py").write_text("raise AssertionError('imported')\n")
    (package / "scheduler.py").write_text("raise AssertionError('imported')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    assert hooks.module_exists(f"{package.name}.scheduler")
    assert not hooks.module_exists(f"{package.name}.sched.scheduler")
    moved = dataclasses.replace(hooks.BY_NAME["scheduler-window-pages"], module=f"{package.name}.sched.scheduler")
    with pytest.raises(VllmHookError) as refused:
        hooks.install((moved,))
    assert str(refused.value) == (f"vLLM {hooks.vllm_version()} has no module {package.name}.sched.scheduler, where "
                                  "OSCAR hook 'scheduler-window-pages' wraps Scheduler.__init__: oscar_vllm supports "
                                  "vLLM 0.26.0")
    assert not any(m.startswith(package.name) for m in sys.modules)


def oscar_groups():
    """Attention groups as the model runner holds them: one OSCAR, one on another backend."""
    def group(name):
        return SimpleNamespace(backend=SimpleNamespace(get_name=lambda: name),
                               metadata_builders=[SimpleNamespace(batch_rows=None)])

    return [[group(BACKEND_NAME), group("FLASH_ATTN")]]


VALUES = {"cudagraph_mode": "NONE", "block_tables": (), "slot_mappings": None, "kv_cache_config": None}


@pytest.mark.parametrize("source, by_position", [
    (CURRENT, lambda state, b, g: state.prepare_attn(b, "NONE", (), None, g, None)),  # as model_runner.py calls it
    (MOVED, lambda state, b, g: state.prepare_attn(b, g, **VALUES)),
], ids=["vllm-0.26.0", "parameters-moved"])
@pytest.mark.parametrize("loaded", [True, False], ids=["loaded-first", "armed"])
def test_a_hook_bound_by_name_reads_its_argument_however_vllm_passes_it(fake_vllm, source, by_position, loaded):
    """The real ``batch-rows`` wrapper: the rows reach the OSCAR builder whether vLLM passes the
    groups by position or by keyword, and wherever the signature has them."""
    name, hook = fake_vllm(source)
    if loaded:
        importlib.import_module(name)
    hooks.install((hook,))
    state_cls = importlib.import_module(name).DefaultModelState
    assert state_cls.prepare_attn.__oscar_wrapped__ and hooks.status()["batch-rows"] == "installed"
    state = state_cls()
    calls = {
        "by position": lambda b, g: by_position(state, b, g),
        "by keyword": lambda b, g: state.prepare_attn(input_batch=b, attn_groups=g, for_capture=True, **VALUES),
        "through the class": lambda b, g: state_cls.prepare_attn(state, b, attn_groups=g, **VALUES),
    }
    for how, call in calls.items():
        batch, groups = SimpleNamespace(idx_mapping=object()), oscar_groups()
        assert call(batch, groups) == ("metadata", groups), how
        oscar, other = groups[0]
        assert oscar.metadata_builders[0].batch_rows is batch.idx_mapping, how
        assert other.metadata_builders[0].batch_rows is None, how


def test_a_forked_process_installs_what_its_parent_armed(fake_vllm):
    """vLLM forks its engine core and workers where it can; they skip register() (vLLM's
    plugins_loaded is inherited) and import the targets' modules themselves."""
    name, hook = fake_vllm(CURRENT)
    hooks.install((hook,))
    pid = os.fork()
    if pid == 0:  # the child: only an import and an attribute, then out, whatever happens
        code = 4
        try:
            code = 0 if getattr(importlib.import_module(name).DefaultModelState.prepare_attn, "__oscar_wrapped__",
                                False) else 3
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0 and name not in sys.modules


def test_a_hook_armed_while_its_module_runs_installs_at_the_next_import(fake_vllm):
    """register() called from inside the import of a target's module (vLLM 0.26.0 does not, but a
    plugin loader may): the module is not whole yet, so the hook waits for the next import."""
    name, hook = fake_vllm(CURRENT + "\nfrom oscar_vllm.serving import hooks\nhooks.install(HOOK)\n")
    import builtins

    builtins.HOOK = (hook,)  # what the module arms, as it runs
    try:
        module = importlib.import_module(name)
    finally:
        del builtins.HOOK
    assert hooks.status()["batch-rows"] == "armed" and not hasattr(module.DefaultModelState.prepare_attn, "__wrapped__")
    other, _ = fake_vllm("")
    importlib.import_module(other)
    assert module.DefaultModelState.prepare_attn.__oscar_wrapped__ and hooks.status()["batch-rows"] == "installed"


def test_installing_twice_wraps_once(fake_vllm, monkeypatch):
    name, hook = fake_vllm(CURRENT)
    state_cls = importlib.import_module(name).DefaultModelState
    original = state_cls.prepare_attn
    hooks.install((hook,))
    hooks.install((hook,))
    monkeypatch.setattr(hooks, "_done", {})  # a registry that forgot, as a forked process's may not
    hooks.install((hook,))
    assert state_cls.prepare_attn.__wrapped__ is original


def target(a, /, b, c=3, *rest, d, e=5, **extra):
    pass


@pytest.mark.parametrize("args, kwargs", [
    ((1, 2), {"d": 4}),
    ((1,), {"b": 2, "d": 4, "e": 6}),
    ((1, 2, 7, 8, 9), {"d": 4, "x": 1}),
    ((1, 2), {"c": 0, "d": None}),
])
def test_arguments_read_what_signature_bind_binds(args, kwargs):
    """``Arguments`` reads, off the signature once, what ``inspect.Signature.bind`` binds each call."""
    signature = inspect.signature(target)
    names = ("a", "b", "c", "d", "e")
    bound = signature.bind(*args, **kwargs)
    bound.apply_defaults()
    assert hooks.Arguments(signature, names)(args, kwargs) == tuple(bound.arguments[n] for n in names)
    with pytest.raises(TypeError):
        hooks.Arguments(signature, names)((1,), {"d": 4})  # no b: the TypeError the call itself raises


def test_an_instance_hook_is_checked_against_the_instances_own_method(registry):
    class Coordinator:
        def free(self, request):
            return request

    with pytest.raises(VllmHookError) as refused:
        hooks.wrap_instance("window-pages-free", Coordinator(), None)
    assert str(refused.value) == refusal("Coordinator.free has no parameter 'request_id'", "window-pages-free")
    with pytest.raises(ValueError, match="not an instance's"):
        hooks.wrap_instance("batch-rows", Coordinator())


def test_register_refuses_a_vllm_whose_target_changed_in_one_line():
    """The real table through ``register()``, in a fresh interpreter as vLLM's processes run it, on
    a vLLM whose ``Attention.get_kv_cache_spec`` renamed the argument the hook reads."""
    code = textwrap.dedent("""
        from vllm.model_executor.layers.attention.attention import Attention

        def get_kv_cache_spec(self, config):
            pass

        Attention.get_kv_cache_spec = get_kv_cache_spec
        from oscar_vllm.serving.plugin import register
        try:
            register()
        except Exception as e:
            print(type(e).__name__, "|", e)
        else:
            print("registered")
    """)
    proc = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "VllmHookError | " + refusal(
        "Attention.get_kv_cache_spec has no parameter 'vllm_config'", "kv-cache-spec")
