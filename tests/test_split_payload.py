"""``tests/gpu/split_payload.py``: the device payload re-cut into parts that fit one call beside the tree."""
import hashlib
import importlib.util
import os
from pathlib import Path

import pytest

spec = importlib.util.spec_from_file_location("split_payload", Path(__file__).parent / "gpu" / "split_payload.py")
split_payload = importlib.util.module_from_spec(spec)
spec.loader.exec_module(split_payload)


def build(device: Path, stream: bytes, prefix: str, stem: str, sha: str, part_bytes: int) -> None:
    """What ../shared/device/build_*payload.sh write: numbered folders, the checksum in the last."""
    cuts = [stream[i:i + part_bytes] for i in range(0, len(stream), part_bytes)]
    for i, cut in enumerate(cuts):
        folder = device / f"{prefix}{i + 1}"
        folder.mkdir(parents=True)
        (folder / f"{stem}.{i}").write_bytes(cut)
        (folder / "stage_part.sh").write_text("stage\n")
    (folder / sha).write_text(f"{hashlib.sha256(stream).hexdigest()}  payload\n")
    (folder / ("install_payload.sh" if prefix == "p" else "install_model.sh")).write_text("install\n")


@pytest.fixture
def device(tmp_path, monkeypatch):
    monkeypatch.setattr(split_payload, "CHUNK_BYTES", 1000)
    payload, model = os.urandom(12_345), os.urandom(4_321)
    build(tmp_path / ".device", payload, "p", "part", "payload.sha256", 6000)
    build(tmp_path / ".device", model, "m", "model.part", "model.sha256", 3000)
    stage = tmp_path / "stage_part.sh"
    stage.write_text("#!/bin/sh\n")
    return tmp_path / ".device", payload, model, stage


def test_parts_fit_their_room_and_add_up_to_the_streams(device):
    folder, payload, model, stage = device
    parts = split_payload.split_payload(folder, room=3500, first_room=2500, stage_script=stage)
    sizes = [split_payload.folder_bytes(p) for p in parts]
    assert sizes[0] <= 2500 and all(s <= 3500 for s in sizes[1:])
    assert sorted(p.name for p in folder.iterdir()) == [f"s{i}" for i in range(1, len(parts) + 1)]
    assert all((p / "stage_part.sh").read_text() == "#!/bin/sh\n" for p in parts)
    staged = {f.name: f.read_bytes() for p in parts for f in p.iterdir()}  # what /tmp/oscar-payload holds
    # install_payload.sh and install_model.sh concatenate `part.*` and `model.part.*` in name order.
    assert b"".join(staged[n] for n in sorted(staged) if n.startswith("part.")) == payload
    assert b"".join(staged[n] for n in sorted(staged) if n.startswith("model.part.")) == model
    names = set(os.listdir(parts[-1]))
    assert {"install_payload.sh", "payload.sha256", "install_model.sh", "model.sha256"} <= names
    assert not any((p / "payload.sha256").exists() for p in parts[:-1])


def test_a_part_that_does_not_add_up_to_its_checksum_is_refused(device):
    folder, _, _, stage = device
    (folder / "p2" / "part.1").write_bytes(b"truncated")
    with pytest.raises(split_payload.PayloadError, match="do not add up to payload.sha256"):
        split_payload.split_payload(folder, room=3500, first_room=2500, stage_script=stage)
    assert (folder / "p1").is_dir()


def test_a_chunk_larger_than_the_room_is_refused(device):
    folder, _, _, stage = device
    with pytest.raises(split_payload.PayloadError, match="does not fit"):
        split_payload.split_payload(folder, room=900, first_room=900, stage_script=stage)


def test_an_earlier_split_is_cut_again_for_less_room(device):
    """The tree grows between sessions: the s1.. parts of a split are joined and cut again, for
    the room beside the tree as it is now, with the same streams and install files."""
    folder, payload, model, stage = device
    first = split_payload.split_payload(folder, room=3500, first_room=2500, stage_script=stage)
    again = split_payload.split_payload(folder, room=2200, first_room=2100, stage_script=stage)
    assert len(again) > len(first)
    assert all(split_payload.folder_bytes(p) <= 2200 for p in again)
    assert {p.name for p in folder.iterdir()} == {f"s{i}" for i in range(1, len(again) + 1)}
    staged = {f.name: f.read_bytes() for p in again for f in p.iterdir()}
    assert b"".join(staged[n] for n in sorted(staged) if n.startswith("part.")) == payload
    assert b"".join(staged[n] for n in sorted(staged) if n.startswith("model.part.")) == model
    assert {"install_payload.sh", "payload.sha256", "install_model.sh", "model.sha256"} <= set(os.listdir(again[-1]))
