"""The command lines as a user meets them: one-line errors, --debug, help texts, and the
main job writing outside the committed results."""
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from oscar_vllm.calibration import calibrate, evaluate
from oscar_vllm.core import rotation_io
from oscar_vllm.core.rotation_io import RotationFileError
from oscar_vllm.serving import serve
from oscar_vllm.serving.serve import FLAGS

REPO = Path(__file__).resolve().parents[1]


def run_module(module: str, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """The CLI in a fresh interpreter, as its console script runs it."""
    return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, timeout=300,
                          cwd=REPO, env=env)


def one_line_error(capsys, main, argv) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 1
    captured = capsys.readouterr()
    assert captured.err.startswith("error: ") and captured.err.count("\n") == 1, captured.err
    return captured.err


def test_missing_rotation_folder_is_one_line(tmp_path):
    proc = run_module("oscar_vllm.core.rotation_io", "inspect", str(tmp_path / "does-not-exist"))
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr == f"error: {tmp_path / 'does-not-exist'}: rotation path does not exist\n"


def test_truncated_rotation_file_is_one_line(tmp_path, capsys, written_qwen3_8b_rotations):
    for f in written_qwen3_8b_rotations.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes()[: 100_000 if f.name.startswith("k_") else None])
    err = one_line_error(capsys, rotation_io.main, ["inspect", str(tmp_path)])
    assert "k_rotation_qqt_r_h_pbr.pt: is not a readable torch.save file" in err


def test_debug_shows_the_traceback(tmp_path):
    with pytest.raises(RotationFileError, match="rotation path does not exist"):
        rotation_io.main(["inspect", str(tmp_path / "nope"), "--debug"])
    with pytest.raises(RotationFileError, match="rotation path does not exist"):
        rotation_io.main(["--debug", "inspect", str(tmp_path / "nope")])


def test_unreadable_model_config_is_one_line(tmp_path, capsys, written_qwen3_8b_rotations):
    err = one_line_error(capsys, rotation_io.main,
                         ["inspect", str(written_qwen3_8b_rotations), "--config", str(tmp_path / "config.json")])
    assert "config.json: cannot read the model config (No such file or directory)" in err
    (tmp_path / "config.json").write_text("{")
    err = one_line_error(capsys, rotation_io.main,
                         ["inspect", str(written_qwen3_8b_rotations), "--config", str(tmp_path / "config.json")])
    assert "the model config is not valid JSON" in err


def test_evaluate_errors_are_one_line(tmp_path, capsys, monkeypatch):
    err = one_line_error(capsys, evaluate.main, ["--methods", "bf16,int3"])
    assert "unknown methods ['int3']; choose from bf16, int4," in err
    err = one_line_error(capsys, evaluate.main, ["--eval-tokens", "100"])
    assert "--eval-tokens 100 is less than one window of --context 2048" in err
    err = one_line_error(capsys, evaluate.main, ["--contexts", "1024,2k"])
    assert "--contexts must be comma-separated token counts, e.g. 1024,2048,4096, got '1024,2k'" in err
    err = one_line_error(capsys, evaluate.main, ["--contexts", "3000,4096", "--eval-tokens", "8192"])
    assert "--eval-tokens 8192 makes no whole windows of every context of --contexts 3000,4096 (at least " in err
    err = one_line_error(capsys, evaluate.main, ["--rotations", str(tmp_path / "nope")])
    assert err == f"error: {tmp_path / 'nope'}: rotation path does not exist\n"
    monkeypatch.setenv("OSCAR_CORPUS_DIR", str(tmp_path))
    err = one_line_error(capsys, evaluate.main, ["--output-dir", str(tmp_path / "out")])
    assert "not found: fetch the corpus once with `python -m oscar_vllm.calibration.corpus install`" in err


def test_calibrate_errors_are_one_line(tmp_path, capsys):
    err = one_line_error(capsys, calibrate.main,
                         ["--output-dir", str(tmp_path), "--corpus", str(tmp_path / "nope.txt")])
    assert "nope.txt: cannot read the --corpus file (No such file or directory)" in err
    (tmp_path / "text.txt").write_text("Too short to calibrate on.")
    args = ["--output-dir", str(tmp_path / "out"), "--corpus", str(tmp_path / "text.txt"), "--model-path"]
    err = one_line_error(capsys, calibrate.main, [*args, str(tmp_path / "no-model")])
    assert err == f"error: {tmp_path / 'no-model'}: no such model folder\n"
    (tmp_path / "empty").mkdir()
    err = one_line_error(capsys, calibrate.main, [*args, str(tmp_path / "empty")])
    assert "empty: no config.json in this folder" in err
    (tmp_path / "empty" / "config.json").write_text("{}")
    err = one_line_error(capsys, calibrate.main, [*args, str(tmp_path / "empty")])
    assert "empty: cannot load the model (" in err
    # --from-rotations: its folder read before the model loads; it keeps rotations --per-head would make anew
    err = one_line_error(capsys, calibrate.main, [*args, str(tmp_path / "empty"), "--from-rotations",
                                                  str(tmp_path / "no-zoo")])
    assert err == f"error: {tmp_path / 'no-zoo'}: rotation path does not exist\n"
    err = one_line_error(capsys, calibrate.main, [*args, "m", "--from-rotations", str(tmp_path), "--per-head"])
    assert "--per-head computes new rotations; --from-rotations keeps DIR's as they are" in err


def test_serve_errors_are_one_line(capsys):
    err = one_line_error(capsys, serve.main, ["Qwen/Qwen3-8B"])
    assert "oscar-vllm runs `serve` only" in err
    err = one_line_error(capsys, serve.main, ["serve", "m", "--oscar-recent-size", "0"])
    assert err == "error: recent_size must be >= 1, got 0\n"
    err = one_line_error(capsys, serve.main, ["serve", "m", "--oscar-logit-correction", "-0.5"])
    assert err == "error: logit_correction must be a finite number >= 0 (0 turns it off), got -0.5\n"


def test_calibrate_refuses_counts_below_one_as_it_parses(tmp_path, capsys):
    """Before anything loads: --calib-tokens -5 once sliced the corpus to all but its last 5 tokens."""
    args = ["--output-dir", str(tmp_path / "out"), "--model-path", str(tmp_path / "no-model")]
    for flag, value, least in [("--calib-tokens", "-5", 1), ("--calib-tokens", "0", 1), ("--seq-len", "-1", 1),
                               ("--heldout-tokens", "-2048", 0), ("--group-size", "0", 1)]:
        err = one_line_error(capsys, calibrate.main, [*args, flag, value])
        assert err == f"error: argument {flag}: must be {least} or more, got {value} (oscar-calibrate --help lists " \
                      "the options)\n"
    err = one_line_error(capsys, calibrate.main, [*args, "--calib-tokens", "8k"])
    assert "argument --calib-tokens: '8k' is not a whole number" in err
    err = one_line_error(capsys, calibrate.main, ["--calib-tokens", "64"])
    assert "the following arguments are required: --output-dir" in err
    assert calibrate.build_parser().parse_args([*args, "--heldout-tokens", "0"]).heldout_tokens == 0


def test_calibrate_names_a_missing_relative_model_folder_at_once(tmp_path, capsys, monkeypatch):
    """A bare name or a relative path that is no folder here: no Hub lookup, one line at once."""
    monkeypatch.chdir(tmp_path)
    args = ["--output-dir", str(tmp_path / "out"), "--corpus", str(tmp_path / "text.txt"), "--model-path"]
    (tmp_path / "text.txt").write_text("Too short to calibrate on.")
    err = one_line_error(capsys, calibrate.main, [*args, "mymodel"])
    assert err == ("error: mymodel: no such model folder, and not a Hugging Face Hub id (those are ORG/NAME, such as "
                   "HuggingFaceTB/SmolLM2-135M-Instruct)\n")
    for path in ("./mymodel", "models/org/mymodel", "~/no-such-model-here"):
        assert one_line_error(capsys, calibrate.main, [*args, path]) == f"error: {path}: no such model folder\n"


def test_calibrate_asks_the_hub_once_for_a_hub_id_it_does_not_have(tmp_path, capsys, monkeypatch):
    """An ORG/NAME neither here nor in the Hugging Face cache: one request to the Hub, no retries
    (transformers retried an unreachable Hub for about 50 s). Without a network it says the Hub
    cannot be reached; with one, that the Hub has no such model."""
    import huggingface_hub.constants as hub_constants

    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(tmp_path / "hub"))  # nothing cached
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", False)
    (tmp_path / "text.txt").write_text("Too short to calibrate on.")
    args = ["--output-dir", str(tmp_path / "out"), "--corpus", str(tmp_path / "text.txt")]
    start = time.monotonic()
    err = one_line_error(capsys, calibrate.main, [*args, "--model-path", "no-such-org-x7/no-model"])
    assert time.monotonic() - start < 30
    assert err.startswith("error: no-such-org-x7/no-model: no such model folder, ")
    assert ("the Hub cannot be reached" in err and "`hf download no-such-org-x7/no-model`" in err) or \
        "the Hugging Face Hub has no model of that id" in err, err


def serve_cli(*argv: str, **env: str) -> tuple[subprocess.CompletedProcess, float]:
    """``oscar-vllm`` in a fresh interpreter, as its console script runs it, and its seconds."""
    start = time.monotonic()
    proc = run_module("oscar_vllm.serving.serve", *argv, env={**os.environ, **env})
    return proc, time.monotonic() - start


@pytest.mark.parametrize("argv,env,error", [
    # the user's own mistakes first, whatever the machine: the settings, from any source ...
    (["serve", "m", "--oscar-rotation-path", "hadamard"], {"OSCAR_SINK_SIZE": "-3"}, "sink_size must be >= 0, got -3"),
    (["serve", "m", "--oscar-rotation-path", "/no/such/rotations"], {"OSCAR_SINK_SIZE": "-3"},
     "sink_size must be >= 0, got -3"),
    # ... the model argument and the rotation folder ...
    (["serve", "--oscar-rotation-path", "hadamard"], {}, "no model given: name it first, `oscar-vllm serve MODEL ...`"),
    (["serve", "m", "--oscar-rotation-path", "/no/such/rotations"], {},
     "/no/such/rotations: rotation path does not exist"),
    (["serve", "m"], {}, "the OSCAR backend needs rotations: give a rotation folder"),
    # ... then the GPU: none here (hidden, on a GPU machine)
    (["serve", "m", "--oscar-rotation-path", "hadamard"], {"CUDA_VISIBLE_DEVICES": "-1"},
     "no CUDA GPU: CUDA_VISIBLE_DEVICES='-1' hides every GPU; the OSCAR backend serves on an NVIDIA GPU of compute "
     "capability 8.0 or newer"),
])
def test_serve_refuses_in_one_line_before_vllm_starts(argv, env, error):
    proc, seconds = serve_cli(*argv, **env)
    assert proc.returncode == 1 and proc.stdout == "", proc.stderr[-2000:]
    assert proc.stderr.startswith(f"error: {error}") and proc.stderr.count("\n") == 1, proc.stderr[-2000:]
    assert seconds < 60


def test_serve_checks_a_rotation_folders_files_before_vllm(tmp_path, capsys, monkeypatch):
    (tmp_path / "empty").mkdir()
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "-1")
    err = one_line_error(capsys, serve.main, ["serve", "m", "--oscar-rotation-path", str(tmp_path / "empty")])
    assert "empty: no rotation files found" in err
    err = one_line_error(capsys, serve.main, ["serve", "m", "--oscar-rotation-path",
                                              str(REPO / "tests" / "data" / "smollm2_rotations")])
    assert err.startswith("error: no CUDA GPU: CUDA_VISIBLE_DEVICES='-1' hides every GPU"), "the folder passed"
    err = one_line_error(capsys, serve.main, ["serve", "m", "--oscar-rotation-path", "hadamard",
                                              "--oscar-decode-kernel", "fastest"])
    assert err == "error: decode_kernel must be one of ('auto', 'gluon', 'triton'), got 'fastest'\n"


def test_serve_help_lists_every_oscar_flag_without_starting_vllm():
    probe = ("import sys\nfrom oscar_vllm.serving import serve\ntry:\n    serve.main(['serve', '--help'])\n"
             "except SystemExit as e:\n    code = e.code\n"
             "print('exit', code, 'vllm' in sys.modules, 'torch' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-2000:]
    ours, _, status = proc.stdout.rpartition("exit ")
    assert status.split() == ["0", "False", "False"], status  # exit 0, neither vLLM nor torch imported
    usage = ours.split("\n\n")[0]
    assert all(flag in usage and ours.count(flag) >= 2 for flag in FLAGS), ours  # the usage line and a help line
    assert " ".join(ours.split()).endswith(serve.VLLM_HELP)
    assert "--- vllm serve" not in ours and proc.stderr == ""


def test_serve_help_all_hands_on_to_vllm():
    proc = run_module("oscar_vllm.serving.serve", "serve", "--help=all")
    assert proc.returncode == 0, proc.stderr[-2000:]
    ours, _, vllms = proc.stdout.partition("--- vllm serve --help=all ---")
    assert all(flag in ours for flag in FLAGS), ours
    assert "Traceback" not in proc.stdout + proc.stderr
    if torch.cuda.is_available():
        assert "--max-model-len" in vllms
    else:
        assert vllms.strip() == ("vLLM's own help (`vllm serve --help=all`) needs a CUDA GPU, and this machine has "
                                 "none. Every argument not listed above goes to `vllm serve` unchanged.")


@pytest.mark.parametrize("argv, vllm_help", [(["--help"], None), (["-h"], None), (["serve", "m", "-h"], None),
                                             (["serve", "m", "--help=all"], "--help=all"),
                                             (["--help=max-model-len"], "--help=max-model-len")])
def test_every_help_form(argv, vllm_help, capsys, monkeypatch):
    asked = []
    monkeypatch.setattr(serve, "vllm_serve_help", lambda help_arg: asked.append(help_arg) or 0)
    with pytest.raises(SystemExit) as exit_info:
        serve.main(argv)
    assert exit_info.value.code == 0 and asked == ([vllm_help] if vllm_help else [])
    out = capsys.readouterr().out
    assert all(flag in out for flag in FLAGS), out


@pytest.mark.parametrize("parser", [evaluate.build_parser(), calibrate.build_parser()], ids=["evaluate", "calibrate"])
def test_every_option_says_its_default(parser):
    for action in parser._actions:
        if action.dest == "help":
            continue
        text = (action.help or "") % {"default": action.default}
        assert "default" in text or "required" in text, f"{action.option_strings}: {action.help!r}"


def test_the_main_job_writes_outside_the_committed_results():
    out = evaluate.build_parser().parse_args([]).output_dir
    assert out == Path("runs/fidelity")
    if not (REPO / ".git").exists():
        pytest.skip("not a git clone: nothing to keep clean")
    ignored = subprocess.run(["git", "check-ignore", "-q", str(out / "fidelity.md")], cwd=REPO)
    assert ignored.returncode == 0, f"{out} is not ignored by git"
