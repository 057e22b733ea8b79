"""Atomic outputs: `oscar-rotations convert` and `oscar-calibrate` killed (SIGKILL, real processes)
at each step of writing their folder leave the previous folder as it was, or none, never a
half-written one; a leftover temporary folder is never loaded, and the next write clears it."""
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from oscar_vllm.core import atomic_output, rotation_io
from oscar_vllm.core.atomic_output import OutputDirError, atomic_output_dir, is_partial_output, recover
from oscar_vllm.core.rotation_io import (
    ModelShape,
    OscarRotations,
    RotationFileError,
    hadamard_rotation_sets,
    load_rotations,
    save_rotations,
)
from rotationzoo_files import write_published_files

REPO = Path(__file__).resolve().parents[2]

# Runs a CLI in a child process that stops (prints PAUSED, then sleeps until killed) at one
# point of the output's writing, chosen by KILL_AT:
#   file:N     after the N-th rotation file is written into the temporary folder
#   torn:N     the N-th file written only half (the bytes a kill in the middle of it leaves)
#   rename:N   just before the N-th rename (1: temporary folder complete; 2: old folder moved aside)
#   swapped    after the new folder is in place, before the old one is deleted
#   none       no stop; prints WRITING when the write begins (for kills at random times)
DRIVER = textwrap.dedent("""
    import os, sys, time
    import torch
    from oscar_vllm.core import atomic_output, rotation_io

    point, cli, argv = os.environ["KILL_AT"], sys.argv[1], sys.argv[2:]
    kind, _, n = point.partition(":")
    count = [0]

    def pause():
        print("PAUSED " + point, flush=True)
        time.sleep(600)

    def counted(write):
        def wrapper(obj, path, *args, **kwargs):
            if count[0] == 0:
                print("WRITING", flush=True)
            write(obj, path, *args, **kwargs)
            count[0] += 1
            if kind == "torn" and count[0] == int(n):
                data = open(path, "rb").read()
                open(path, "wb").write(data[: len(data) // 2])
                pause()
            if kind == "file" and count[0] == int(n):
                pause()
        return wrapper

    rotation_io.save_file = counted(rotation_io.save_file)
    torch.save = counted(torch.save)

    class Os:
        renames = 0

        def __getattr__(self, name):
            return getattr(os, name)

        def rename(self, a, b):
            Os.renames += 1
            if kind == "rename" and Os.renames == int(n):
                pause()
            os.rename(a, b)

    atomic_output.os = Os()
    fsync = atomic_output._fsync

    def fsync_then_stop(path):  # the last fsync, of the parent folder, follows the swap
        fsync(path)
        if kind == "swapped" and Os.renames >= 1 and path.is_dir() and not atomic_output.is_partial_output(path):
            pause()

    atomic_output._fsync = fsync_then_stop
    if cli == "convert":
        rotation_io.main(["convert", *argv])
    else:
        from oscar_vllm.calibration import calibrate
        calibrate.main(argv)
    print("DONE", flush=True)
""")


def start(cli: str, argv: list[str], point: str, log: Path) -> subprocess.Popen:
    """The child's stderr goes to ``log`` (a pipe nobody reads could fill and stall it)."""
    env = dict(os.environ, KILL_AT=point, PYTHONPATH=str(REPO))
    with open(log, "w") as err:
        proc = subprocess.Popen([sys.executable, "-c", DRIVER, cli, *argv], cwd=REPO, env=env,
                                stdout=subprocess.PIPE, stderr=err, text=True)
    proc.log = log
    return proc


def kill_when(proc: subprocess.Popen, marker: str, delay: float = 0.0) -> str:
    """SIGKILL ``proc`` ``delay`` seconds after it prints a line starting with ``marker``."""
    for line in proc.stdout:
        if line.startswith(marker):
            time.sleep(delay)
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=60)
            return line.strip()
        if line.startswith("DONE"):
            break
    proc.wait(timeout=60)
    raise AssertionError(f"the child never printed {marker!r} (exit {proc.returncode}): {proc.log.read_text()[-2000:]}")


def signature(rot: OscarRotations) -> tuple:
    """What tells two rotation sets apart here: layer count and the first entries of layer 0."""
    return (len(rot.layer_ids), *(round(x, 6) for x in rot.key.rotations[0].flatten()[:4].tolist()),
            *(round(x, 6) for x in rot.value.rotations[0].flatten()[:2].tolist()))


def state_of(target: Path, old: tuple | None, new: tuple) -> str:
    """'old', 'new' or 'absent', and every other folder beside it a refused leftover."""
    for other in target.parent.iterdir():
        if other != target:
            assert is_partial_output(other), other
            with pytest.raises(RotationFileError, match="temporary folder of an output"):
                load_rotations(other)
    if not target.exists():
        return "absent"
    got = signature(load_rotations(target))  # never a folder that fails to load
    assert got in (old, new), (got, old, new)
    return "old" if got == old else "new"


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """Two RotationZoo folders of different rotations (4 layers, head_dim 128)."""
    base = tmp_path_factory.mktemp("sources")
    old_src = write_published_files(base / "old", 4, 128)
    new_src = shutil.copytree(old_src, base / "new")
    new_rot = load_rotations(new_src)
    new_rot.key.rotations[0] = -new_rot.key.rotations[0]  # another rotation, still orthogonal
    rotation_io.save_rotationzoo(new_rot, new_src)
    return old_src, new_src, signature(load_rotations(old_src)), signature(load_rotations(new_src))


def old_output(target: Path, old_src: Path) -> None:
    rotation_io.main(["convert", str(old_src), str(target), "--to", "oscar"])


DETERMINISTIC = {  # point -> what the folder must be after a kill there
    "file:1": "old", "torn:2": "old", "rename:1": "old", "rename:2": "absent", "swapped": "new",
}


def test_convert_killed_at_every_step_leaves_the_old_folder_or_none(sources, tmp_path):
    old_src, new_src, old, new = sources
    runs = {}
    for point in DETERMINISTIC:  # one child per point, all at once
        target = tmp_path / point.replace(":", "-") / "rotations"
        old_output(target, old_src)
        proc = start("convert", [str(new_src), str(target), "--to", "oscar"], point, target.parent.parent / "log")
        runs[point] = (target, proc)
    for point, (target, proc) in runs.items():
        assert kill_when(proc, "PAUSED") == f"PAUSED {point}"
        assert state_of(target, old, new) == DETERMINISTIC[point], point
        leftovers = [p for p in target.parent.iterdir() if p != target]
        assert leftovers, "a killed write leaves its temporary folder (hidden, refused by the loaders)"
        if point == "rename:2":  # killed inside the swap: the next write puts the old folder back first
            recover(target)
            assert state_of(target, old, new) == "old"
        rotation_io.main(["convert", str(new_src), str(target), "--to", "oscar"])
        assert state_of(target, old, new) == "new"
        assert list(target.parent.iterdir()) == [target], "the next write clears the killed writer's leftovers"


def test_convert_killed_at_random_times(sources, tmp_path):
    """Kills at random moments from the start of the write (no stop in the child): the folder is
    the old one, the new one, or (inside the swap) none, wherever the kill lands."""
    old_src, new_src, old, new = sources
    rng = random.Random(0)
    runs = []
    for i in range(2):
        target = tmp_path / f"timing-{i}" / "rotations"
        old_output(target, old_src)
        runs.append((target, start("convert", [str(new_src), str(target), "--to", "oscar"], "none",
                                   tmp_path / f"log-{i}")))
    for target, proc in runs:
        kill_when(proc, "WRITING", delay=rng.uniform(0, 0.02))
        assert state_of(target, old, new) in ("old", "new", "absent")
        rotation_io.main(["convert", str(new_src), str(target), "--to", "oscar"])
        assert state_of(target, old, new) == "new" and list(target.parent.iterdir()) == [target]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    """A two-layer Llama with random weights and a byte-level tokenizer: calibrates in seconds."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    folder = tmp_path_factory.mktemp("tiny-llama")
    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(folder)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=64, max_position_embeddings=512)
    LlamaForCausalLM(config).save_pretrained(folder)
    text = folder / "corpus.txt"
    text.write_text(" ".join(f"word{i % 97} and some text number {i}." for i in range(200)))
    return folder, text


def test_calibrate_killed_inside_the_swap_loses_nothing(tiny_model, tmp_path):
    folder, text = tiny_model
    target = tmp_path / "out" / "rotations"
    k, v = hadamard_rotation_sets([0, 1], 64)
    for rs in (k, v):  # the sets share one tensor across layers, which safetensors will not write
        rs.rotations = {i: r.clone() for i, r in rs.rotations.items()}
        rs.eigenvalues = {i: e.clone() for i, e in rs.eigenvalues.items()}
    save_rotations(OscarRotations(k, v, model="earlier"), target)
    old = signature(load_rotations(target))
    argv = ["--model-path", str(folder), "--corpus", str(text), "--output-dir", str(target),
            "--calib-tokens", "256", "--heldout-tokens", "0", "--seq-len", "128"]
    kill_when(start("calibrate", argv, "rename:2", tmp_path / "log"), "PAUSED")
    assert not target.exists(), "killed between moving the old folder aside and the new one in"
    recover(target)
    assert signature(load_rotations(target)) == old
    from oscar_vllm.calibration import calibrate

    calibrate.main(argv)
    rot = load_rotations(target, ModelShape(2, 1, 64))
    assert signature(rot) != old and rot.model == folder.name
    assert list(target.parent.iterdir()) == [target]


def test_an_error_while_writing_leaves_the_old_folder(tmp_path):
    target = tmp_path / "rotations"
    target.mkdir()
    (target / "k_rotation.safetensors").write_text("old")
    with pytest.raises(ValueError, match="boom"):
        with atomic_output_dir(target) as tmp:
            (tmp / "k_rotation.safetensors").write_text("new")
            raise ValueError("boom")
    assert (target / "k_rotation.safetensors").read_text() == "old"
    assert list(tmp_path.iterdir()) == [target]


def test_folders_that_hold_other_things_are_refused(tmp_path, monkeypatch):
    (tmp_path / "notes.txt").write_text("mine")
    (tmp_path / "k_rotation.safetensors").write_text("")
    with pytest.raises(OutputDirError, match=r"holds notes\.txt, which are not rotation files"):
        with atomic_output_dir(tmp_path / "."):
            pass
    assert (tmp_path / "notes.txt").exists()
    with pytest.raises(OutputDirError, match="exists and is not a folder"):
        atomic_output.check_replaceable(tmp_path / "notes.txt")
    empty = tmp_path / "empty"
    empty.mkdir()
    monkeypatch.chdir(empty)
    with pytest.raises(OutputDirError, match="is the current folder"):
        atomic_output.check_replaceable(".")


def test_only_leftovers_of_writers_that_are_gone_are_cleared(tmp_path):
    target = tmp_path / "rotations"
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    host = atomic_output.socket.gethostname()
    gone = tmp_path / f".rotations{atomic_output.PARTIAL_MARK}{host}-{done.stdout.strip()}"
    live = tmp_path / f".rotations{atomic_output.PARTIAL_MARK}{host}-{os.getpid()}"
    elsewhere = tmp_path / f".rotations{atomic_output.PARTIAL_MARK}another-host-1"
    for p in (gone, live, elsewhere):
        p.mkdir()
    recover(target)
    assert not gone.exists()
    assert live.exists() and elsewhere.exists(), "a running writer, or one on another host: not ours to clear"
    assert all(is_partial_output(p) for p in (gone, live, elsewhere))
    assert not is_partial_output(target) and not is_partial_output(tmp_path / "oscar-partial-notes")


def test_convert_output_is_a_complete_folder(sources, tmp_path):
    old_src, _, old, _ = sources
    old_output(tmp_path / "r", old_src)
    info = json.loads((tmp_path / "r" / rotation_io.METADATA_FILE).read_text())
    assert info["layer_ids"] == list(range(4)) and signature(load_rotations(tmp_path / "r")) == old
