"""The command lines as a user meets them: one-line errors, --debug, help texts, and the
main job writing outside the committed results."""
import subprocess
import sys
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
    err = one_line_error(capsys, calibrate.main, ["--output-dir", str(tmp_path), "--corpus", str(tmp_path / "nope.txt")])
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


def test_serve_errors_are_one_line(capsys):
    err = one_line_error(capsys, serve.main, ["Qwen/Qwen3-8B"])
    assert "oscar-vllm runs `serve` only" in err
    err = one_line_error(capsys, serve.main, ["serve", "m", "--oscar-recent-size", "0"])
    assert err == "error: recent_size must be >= 1, got 0\n"
    err = one_line_error(capsys, serve.main, ["serve", "m", "--oscar-logit-correction", "-0.5"])
    assert err == "error: logit_correction must be a finite number >= 0 (0 turns it off), got -0.5\n"


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
