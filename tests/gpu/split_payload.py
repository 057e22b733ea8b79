"""Re-split the device payload so each part fits one call beside this tree.

`../shared/device/build_payload.sh` and `build_model_payload.sh` write parts of 60 MB (`p1..`,
`m1..`). A device call carries at most 64 MiB in all, the tracked tree included, and this tree is
about 7 MB: a 60 MB part no longer fits beside it. This script joins the parts back into their
streams, cuts them into small chunks and packs the chunks into `s1, s2, ...`, each as full as the
room beside the tree allows (the first also leaves room for `.carry`, which travels with it once).
The last part holds the install scripts and checksums, so the order of the calls stays the
device README's: stage every part back to back, install from the last.

    bash ../shared/device/build_payload.sh .device && bash ../shared/device/build_model_payload.sh .device
    python tests/gpu/split_payload.py .device   # again, on the s1.. parts, when the tree has grown
    # then one call per part: carry [".device/s1", ".carry"], run `bash .device/s1/stage_part.sh`;
    # s2 .. sN alike without .carry; the last one: `bash .device/sN/stage_part.sh &&
    # bash .device/sN/install_payload.sh && bash /tmp/oscar-payload/install_model.sh && ...`
"""
from __future__ import annotations

import argparse
import hashlib
import re
import shutil
import subprocess
from pathlib import Path

CALL_BYTES = 64 * 2**20  # what one device call carries, tree included
MARGIN_BYTES = 8 * 2**20  # the tree grows between the split and the calls (results: up to 4 MiB in a day)
CHUNK_BYTES = 4_000_000
INSTALL_FILES = ("install_payload.sh", "payload.sha256", "install_model.sh", "model.sha256")


class PayloadError(RuntimeError):
    pass


def tracked_bytes(repo: Path) -> int:
    """What the device call copies of the tree: tracked and untracked files git does not ignore."""
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                         cwd=repo, capture_output=True, check=True).stdout
    return sum((repo / name).stat().st_size for name in out.decode().split("\0")
               if name and (repo / name).is_file())


def folder_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.is_dir() else 0


def _numbered(folders: list[Path], pattern: str) -> list[Path]:
    files = [f for d in folders for f in d.iterdir() if re.fullmatch(pattern, f.name)]
    return sorted(files, key=lambda f: int(f.name.rsplit(".", 1)[1]))


def read_streams(device_dir: Path) -> tuple[dict[str, bytes], dict[str, bytes]]:
    """The payload and model streams from the build's parts (or, where there are none, from an
    earlier split's ``s1..``: the tree grew and they no longer fit), checked against their
    checksums, and the install scripts and checksums that go with them."""
    streams, extras = {}, {}
    built = any(re.fullmatch(r"[pm]\d+", d.name) for d in device_dir.iterdir())
    for prefix, stem, sha in (("p", "part", "payload.sha256"), ("m", "model.part", "model.sha256")):
        prefix = prefix if built else "s"
        folders = sorted(d for d in device_dir.iterdir() if re.fullmatch(rf"{prefix}\d+", d.name))
        if not folders:
            continue
        data = b"".join(f.read_bytes() for f in _numbered(folders, rf"{re.escape(stem)}\.\d+"))
        sums = [d / sha for d in folders if (d / sha).is_file()]
        if not data and not sums and not built:  # an earlier split without this stream
            continue
        if not sums:
            raise PayloadError(f"{device_dir}/{prefix}*: no {sha}; build the payload again")
        want = sums[0].read_text().split()[0]
        if hashlib.sha256(data).hexdigest() != want:
            raise PayloadError(f"{device_dir}/{prefix}*: the parts do not add up to {sha}; build the payload again")
        streams[stem] = data
        for d in folders:
            for name in INSTALL_FILES:
                if (d / name).is_file():
                    extras[name] = (d / name).read_bytes()
    if not streams:
        raise PayloadError(f"{device_dir}: no p1.., m1.. or s1.. parts; run ../shared/device/build_payload.sh first")
    return streams, extras


def pack(chunks: list[tuple[str, int]], rooms: list[int]) -> list[list[str]]:
    """Chunks, in order, into parts: each part as full as its room allows (the last room repeats)."""
    parts: list[list[str]] = [[]]
    used = 0
    for name, size in chunks:
        room = rooms[min(len(parts) - 1, len(rooms) - 1)]
        if size > room:
            raise PayloadError(f"a chunk of {size} bytes does not fit a part's room of {room} bytes")
        if used + size > room:
            parts.append([])
            used = 0
        parts[-1].append(name)
        used += size
    return parts


def split_payload(device_dir: Path, room: int, first_room: int, stage_script: Path) -> list[Path]:
    streams, extras = read_streams(device_dir)
    chunks: dict[str, bytes] = {}
    for stem, data in streams.items():
        for i in range(0, len(data), CHUNK_BYTES):
            chunks[f"{stem}.{i // CHUNK_BYTES:03d}"] = data[i:i + CHUNK_BYTES]
    extra_bytes = sum(map(len, extras.values())) + stage_script.stat().st_size
    parts = pack([(n, len(b)) for n, b in chunks.items()], [first_room - extra_bytes, room - extra_bytes])
    for old in device_dir.iterdir():
        if re.fullmatch(r"[pms]\d+", old.name):
            shutil.rmtree(old)
    out = []
    for i, names in enumerate(parts, 1):
        part = device_dir / f"s{i}"
        part.mkdir()
        for name in names:
            (part / name).write_bytes(chunks[name])
        shutil.copy(stage_script, part / "stage_part.sh")
        out.append(part)
    for name, data in extras.items():
        (out[-1] / name).write_bytes(data)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("device_dir", type=Path, nargs="?", default=Path(".device"))
    p.add_argument("--carry", type=Path, default=Path(".carry"),
                   help="travels with the first part (default: %(default)s)")
    p.add_argument("--stage-script", type=Path, default=Path("../shared/device/stage_part.sh"))
    args = p.parse_args()
    repo = Path(subprocess.run(["git", "rev-parse", "--show-toplevel"], capture_output=True, text=True,
                               check=True).stdout.strip())
    tree, carry = tracked_bytes(repo), folder_bytes(args.carry)
    room = CALL_BYTES - tree - MARGIN_BYTES
    parts = split_payload(args.device_dir, room, room - carry, args.stage_script)
    for part in parts:
        print(f"{part}: {folder_bytes(part) / 1e6:.1f} MB")
    print(f"{len(parts)} parts, each beside a tree of {tree / 1e6:.1f} MB "
          f"(the first with {args.carry}, {carry / 1e6:.1f} MB)")


if __name__ == "__main__":
    main()
