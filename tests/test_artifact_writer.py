"""The transactional writer: a failure (injected at every step, or a real SIGKILL mid-write) never
publishes a partial artifact and never damages the previous one."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from qcompiler.artifact import ArtifactWriteError, ArtifactWriter, verify_published
from qcompiler.artifact.manifest import ARTIFACT_SCHEMA
from qcompiler.artifact.writer import MANIFEST, STEPS, InjectedFailure


def publish(dest: Path, payload: bytes, fail_at: str | None = None) -> None:
    with ArtifactWriter(dest, fail_at=fail_at) as w:
        w.write_file("weights/model.bin", [payload[: len(payload) // 2], payload[len(payload) // 2 :]])
        w.write_file("config.json", b'{"a": 1}')
        w.publish({"versions": {"artifact_schema": ARTIFACT_SCHEMA}, "payload": payload[:4].hex()})


def snapshot(dest: Path) -> dict[str, bytes]:
    return {p.relative_to(dest).as_posix(): p.read_bytes() for p in sorted(dest.rglob("*")) if p.is_file()}


def test_publish_lists_every_file_and_verifies(tmp_path: Path) -> None:
    dest = tmp_path / "art"
    publish(dest, b"x" * 1000)
    manifest = verify_published(dest)
    assert [f["path"] for f in manifest["files"]] == ["config.json", "weights/model.bin"]
    assert manifest["files"][1]["size"] == 1000
    assert [p.name for p in tmp_path.iterdir()] == ["art"]


@pytest.mark.parametrize("step", STEPS)
def test_failure_at_any_step_keeps_the_previous_artifact(tmp_path: Path, step: str) -> None:
    dest = tmp_path / "art"
    publish(dest, b"old" * 100)
    before = snapshot(dest)
    with pytest.raises(InjectedFailure, match=f"step '{step}'"):
        publish(dest, b"new" * 100, fail_at=step)
    after = snapshot(dest)
    verify_published(dest)
    if step == "cleanup":  # the new artifact was already swapped in, whole
        assert json.loads(after[MANIFEST])["payload"] == (b"new" * 100)[:4].hex()
        return
    assert after == before
    assert [p.name for p in tmp_path.iterdir()] == ["art"]  # no temp directory left behind


@pytest.mark.parametrize("step", [s for s in STEPS if s != "cleanup"])
def test_failure_without_previous_artifact_publishes_nothing(tmp_path: Path, step: str) -> None:
    dest = tmp_path / "art"
    with pytest.raises(InjectedFailure):
        publish(dest, b"new" * 100, fail_at=step)
    assert not dest.exists()
    assert list(tmp_path.iterdir()) == []


def test_sigkill_mid_write_leaves_the_previous_artifact(tmp_path: Path) -> None:
    dest = tmp_path / "art"
    publish(dest, b"old" * 100)
    before = snapshot(dest)
    script = (
        "import sys, time\n"
        "from pathlib import Path\n"
        "from qcompiler.artifact import ArtifactWriter\n"
        "def slow():\n"
        "    for _ in range(1000):\n"
        "        yield b'y' * 4096\n"
        "        time.sleep(0.01)\n"
        "with ArtifactWriter(Path(sys.argv[1])) as w:\n"
        "    w.write_file('weights/model.bin', slow())\n"
        "    w.publish({'schema': 1})\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", script, str(dest)])
    deadline = time.time() + 60
    while time.time() < deadline and not any(p.name.startswith(".art.tmp-") for p in tmp_path.iterdir()):
        time.sleep(0.05)
    time.sleep(0.3)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    assert snapshot(dest) == before
    verify_published(dest)


def test_file_names_must_stay_inside(tmp_path: Path) -> None:
    with ArtifactWriter(tmp_path / "art") as w, pytest.raises(ArtifactWriteError, match="must be relative"):
        w.write_file("../escape.bin", b"x")


def test_verify_catches_a_flipped_byte_and_extra_files(tmp_path: Path) -> None:
    dest = tmp_path / "art"
    publish(dest, b"abcdef" * 50)
    blob = dest / "weights" / "model.bin"
    data = bytearray(blob.read_bytes())
    data[7] ^= 0x01
    blob.write_bytes(bytes(data))
    with pytest.raises(ArtifactWriteError, match=r"model.bin: sha256 \(expected"):
        verify_published(dest)
    blob.write_bytes(b"abcdef" * 50)
    (dest / "stray.txt").write_text("x")
    with pytest.raises(ArtifactWriteError, match=r"stray\.txt: file is not listed"):
        verify_published(dest)


def test_a_failed_fsync_is_named_and_publishes_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Files are fsync'd in a thread while the next ones are written; a failure there stops the
    publish before the manifest, naming the file, and the previous artifact stays."""
    dest = tmp_path / "art"
    publish(dest, b"a" * 100)
    before = snapshot(dest)
    real = os.fsync
    synced: list[int] = []

    def failing(fd: int) -> None:
        synced.append(fd)
        if len(synced) == 1:  # weights/model.bin, the first file written
            raise OSError(5, "Input/output error")
        real(fd)

    monkeypatch.setattr(os, "fsync", failing)
    with pytest.raises(ArtifactWriteError, match=r"weights/model\.bin.*Input/output error"):
        publish(dest, b"b" * 100)
    assert len(synced) == 2  # both files were written and fsync'd; no manifest after the failure
    assert snapshot(dest) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["art"]
