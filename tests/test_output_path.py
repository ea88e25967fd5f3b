"""The output path is the user's: what is not one of our artifacts is refused (``--force`` replaces
it, atomically), concurrent writers of one output are serialised by its lock, a SIGKILL in the
publish window leaves leftovers that the next compile or ``qcompiler clean`` removes (never a live
writer's), and an unwritable destination is a typed user error naming the path."""

from __future__ import annotations

import json
import os
import pwd
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest

from qcompiler.artifact import ArtifactWriteError, ArtifactWriter, verify_published
from qcompiler.artifact.manifest import ARTIFACT_SCHEMA
from qcompiler.artifact.output import OutputBusyError, OutputError, remove_leftovers
from qcompiler.testing import run_cli

SOURCE = "qcompiler.examples:tiny_llama_hf"
COMPILE = ("compile", SOURCE, "--scheme", "w4-g32", "--target", "safetensors")
WRITER = (
    "import sys\n"
    "from pathlib import Path\n"
    "from qcompiler.artifact import ArtifactWriter\n"
    "with ArtifactWriter(Path(sys.argv[1])) as w:\n"
    "    w.write_file('weights/model.bin', b'new' * 100)\n"
    f"    w.publish({{'versions': {{'artifact_schema': {ARTIFACT_SCHEMA}}}, 'payload': 'new'}})\n"
)


def publish(
    dest: Path, payload: bytes = b"old", force: bool = False, verify: Callable[[Path], object] | None = None
) -> Path:
    with ArtifactWriter(dest, force=force) as w:
        w.write_file("weights/model.bin", payload)
        return w.publish({"versions": {"artifact_schema": ARTIFACT_SCHEMA}, "payload": payload.hex()}, verify)


def tree(root: Path) -> dict[str, object]:
    """Everything under ``root`` without following links: files by content, links by target."""
    out: dict[str, object] = {}
    for dirpath, dirs, files in os.walk(root):
        for name in dirs + files:
            p = Path(dirpath) / name
            rel = p.relative_to(root).as_posix()
            out[rel] = ("link", os.readlink(p)) if p.is_symlink() else p.read_bytes() if p.is_file() else "dir"
    return out


def user_content(tmp_path: Path, kind: str) -> Path:
    """An output path holding what a user keeps there (not one of our artifacts)."""
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("my notes")
    out = tmp_path / "out"
    if kind == "directory":
        out.mkdir()
        (out / "thesis.tex").write_text("years of work")
    elif kind == "damaged-manifest":
        out.mkdir()
        (out / "manifest.json").write_text('{"files": []}')
    elif kind == "file":
        out.write_text("a file")
    elif kind == "symlink-to-dir":
        out.symlink_to(tmp_path / "mine")
    else:
        out.symlink_to(tmp_path / "mine" / "notes.txt")
    return out


def paused(argv: list[str], step: str, cwd: Path) -> tuple[subprocess.Popen[str], Path]:
    """Start ``argv`` with the writer's pause hook at ``step``; returns once it is paused there, with
    the temp directory it announced."""
    env = {**os.environ, "QC_WRITER_PAUSE_AT": step, "TQDM_DISABLE": "1"}
    proc = subprocess.Popen(argv, cwd=cwd, env=env, stderr=subprocess.PIPE, text=True)
    assert proc.stderr is not None
    seen: list[str] = []
    for line in proc.stderr:
        seen.append(line)
        if line.startswith(f"paused at step {step}: "):
            return proc, Path(line.split(": ", 1)[1].strip())
    proc.wait()
    raise AssertionError(f"never paused at {step} (exit {proc.returncode}): {''.join(seen)[-2000:]}")


def kill(proc: subprocess.Popen[str]) -> None:
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert proc.stderr is not None
    proc.stderr.close()


KINDS = ["directory", "damaged-manifest", "file", "symlink-to-dir", "symlink-to-file"]


@pytest.mark.parametrize("kind", KINDS)
def test_what_is_not_an_artifact_is_refused_untouched(tmp_path: Path, kind: str) -> None:
    out = user_content(tmp_path, kind)
    before = tree(tmp_path)
    with pytest.raises(OutputError, match=rf"{out}: refusing to replace .*found .*--force replaces it"):
        publish(out)
    assert tree(tmp_path) == before  # no temp directory, no lock file, nothing changed
    result = run_cli(*COMPILE, "-o", str(out))  # refused before the slow capture
    assert result.code == 1
    assert "--force replaces it" in result.err
    assert "internal error" not in result.err
    assert tree(tmp_path) == before


@pytest.mark.parametrize("kind", KINDS)
def test_force_replaces_it_atomically(tmp_path: Path, kind: str) -> None:
    out = user_content(tmp_path, kind)
    publish(out, b"new", force=True)
    assert verify_published(out)["payload"] == b"new".hex()
    assert sorted(os.listdir(tmp_path)) == ["mine", "out"]  # old content removed, nothing left beside
    assert (tmp_path / "mine" / "notes.txt").read_text() == "my notes"  # a link's target is not followed


def test_an_artifact_holding_a_file_of_the_users_is_refused(tmp_path: Path) -> None:
    out = tmp_path / "out"
    publish(out, b"one")
    (out / "weights" / "notes.txt").write_text("mine")
    with pytest.raises(OutputError, match=r"not a qcompiler artifact \(it holds files .* weights/notes\.txt\)"):
        publish(out, b"two")
    assert (out / "weights" / "notes.txt").read_text() == "mine"
    publish(out, b"two", force=True)
    assert verify_published(out)["payload"] == b"two".hex()


def test_an_empty_directory_and_an_artifact_are_replaced(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    publish(out, b"one")
    publish(out, b"two")
    assert verify_published(out)["payload"] == b"two".hex()
    assert os.listdir(tmp_path) == ["out"]


@pytest.mark.parametrize("start", ["absent", "empty"])
def test_content_put_there_while_writing_is_swapped_back(tmp_path: Path, start: str) -> None:
    """The check at publish time is the authority: what the atomic swap displaced is looked at
    before it is deleted, and put back if it is not ours."""
    out = tmp_path / "out"
    if start == "empty":
        out.mkdir()

    def meanwhile(_: Path) -> None:  # runs after the entry check, just before the swap
        out.mkdir(exist_ok=True)
        (out / "thesis.tex").write_text("years of work")

    with pytest.raises(OutputError, match="put there while the artifact was written"):
        publish(out, verify=meanwhile)
    assert tree(tmp_path) == {"out": "dir", "out/thesis.tex": b"years of work"}


def test_a_foreign_lock_file_is_not_ours(tmp_path: Path) -> None:
    (tmp_path / ".out.lock").write_text("someone else's")
    with pytest.raises(OutputError, match=r"\.out\.lock: exists and is not a qcompiler lock file"):
        publish(tmp_path / "out")
    assert tree(tmp_path) == {".out.lock": b"someone else's"}


def test_a_writer_killed_at_swap_is_cleaned_by_the_next_writer(tmp_path: Path) -> None:
    out = tmp_path / "out"
    publish(out, b"old")
    proc, tmp = paused([sys.executable, "-c", WRITER, str(out)], "swap", tmp_path)
    with pytest.raises(OutputBusyError, match=rf"{out}: another compile \(pid {proc.pid}, since .*\) is writing"):
        publish(out, b"two")
    assert tmp.is_dir()
    kill(proc)
    assert sorted(os.listdir(tmp_path)) == sorted(["out", ".out.lock", tmp.name])  # the lock file is stale
    publish(out, b"two")
    assert verify_published(out)["payload"] == b"two".hex()
    assert os.listdir(tmp_path) == ["out"]


def test_clean_removes_only_stale_leftovers(tmp_path: Path) -> None:
    """Killed after the exchange: the new artifact is in place, the old one under the temp name."""
    out = tmp_path / "out"
    publish(out, b"old")
    (tmp_path / ".out.tmp-notours").mkdir()  # not our exact naming: never touched
    proc, tmp = paused([sys.executable, "-c", WRITER, str(out)], "cleanup", tmp_path)
    busy = run_cli("clean", str(tmp_path), "--json")
    assert busy.code == 0
    assert json.loads(busy.out)["busy"][0]["output"] == str(out)
    with pytest.raises(OutputBusyError):
        remove_leftovers(out)
    assert verify_published(tmp)["payload"] == b"old".hex()  # a live writer's directory is left alone
    kill(proc)
    dry = json.loads(run_cli("clean", str(tmp_path), "--dry-run", "--json").out)
    assert [(d["path"], d["kind"], d["pid"]) for d in dry["leftovers"]] == [(str(tmp), "tmp", proc.pid)]
    assert tmp.is_dir()
    assert not dry["removed"]
    done = run_cli("clean", str(tmp_path))
    assert done.code == 0
    assert f"removed {tmp}" in done.out
    assert sorted(os.listdir(tmp_path)) == [".out.tmp-notours", "out"]
    assert verify_published(out)["payload"] == "new"
    assert "nothing to clean" in run_cli("clean", str(tmp_path)).out


def test_a_path_under_a_regular_file_is_a_user_error(tmp_path: Path) -> None:
    """ENOTDIR is real for root too: no component of OUT's directory can be created under a file."""
    (tmp_path / "afile").write_text("x")
    out = tmp_path / "afile" / "sub" / "out"
    with pytest.raises(ArtifactWriteError, match=rf"{tmp_path / 'afile'}: not a directory"):
        publish(out)
    result = run_cli(*COMPILE, "-o", str(out))
    assert result.code == 1
    assert f"{tmp_path / 'afile'}: not a directory" in result.err
    assert "internal error" not in result.err


def test_an_unwritable_filesystem_is_a_user_error() -> None:
    """``/proc`` refuses new files even to root: the lock cannot be created, named with the reason."""
    result = run_cli(*COMPILE, "-o", "/proc/qcompiler-out")
    assert result.code == 1
    assert "/proc: cannot create the lock .qcompiler-out.lock" in result.err
    assert "internal error" not in result.err


def as_other_user(fn: Callable[[], str]) -> str:
    """Run ``fn`` in a forked child; as root, the child first becomes ``nobody`` (root ignores mode bits)."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover (the child)
        os.close(read)
        try:
            if os.geteuid() == 0:
                nobody = pwd.getpwnam("nobody")
                os.setgroups([])
                os.setgid(nobody.pw_gid)
                os.setuid(nobody.pw_uid)
            text = fn()
        except BaseException as e:
            text = f"child failed: {type(e).__name__}: {e}"
        os.write(write, text.encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as f:
        text = f.read()
    os.waitpid(pid, 0)
    return text


def test_a_read_only_directory_is_a_user_error(tmp_path: Path) -> None:
    """A directory of mode 0555, written by a user that is not root (``nobody`` in a forked child when
    the tests run as root, since root ignores mode bits): the writer reports the system's EACCES on
    the lock, naming the directory; ``compile`` says so before the capture (``os.access``, which is
    honest for a non-root user)."""
    if os.geteuid() == 0:
        try:
            pwd.getpwnam("nobody")
        except KeyError:
            pytest.skip("no user 'nobody' to drop to")
    (tmp_path / "afile").write_text("x")
    assert run_cli(*COMPILE, "-o", str(tmp_path / "afile")).code == 1  # load what compile needs, as root
    base = Path(tempfile.mkdtemp(prefix="qc-ro-"))  # under /tmp, which every user may traverse
    try:
        base.chmod(0o711)
        ro = base / "ro"
        ro.mkdir(mode=0o555)
        ro.chmod(0o555)

        def write() -> str:
            try:
                publish(ro / "out")
            except ArtifactWriteError as e:
                return str(e)
            return "published"

        assert f"{ro}: cannot create the lock .out.lock of {ro / 'out'}: Permission denied" in as_other_user(write)
        text = as_other_user(lambda: run_cli(*COMPILE, "-o", str(ro / "out")).err)
        assert f"{ro}: this user cannot write in this directory" in text
        assert "internal error" not in text
        assert os.listdir(ro) == []
    finally:
        shutil.rmtree(base)


def test_a_full_destination_is_a_user_error(tmp_path: Path) -> None:
    """A real EFBIG from the kernel (RLIMIT_FSIZE in the child): the file and the reason are named,
    nothing is published, the previous artifact is intact."""
    out = tmp_path / "out"
    publish(out, b"old")

    def limit() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (200, 200))

    script = (
        "import sys\n"
        "from qcompiler.artifact import ArtifactWriteError, ArtifactWriter\n"
        "try:\n"
        "    with ArtifactWriter(sys.argv[1]) as w:\n"
        "        w.write_file('weights/model.bin', b'new' * 1000)\n"
        "except ArtifactWriteError as e:\n"
        "    sys.exit(f'ArtifactWriteError: {e}')\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script, str(out)], cwd=tmp_path, preexec_fn=limit, capture_output=True, text=True
    )
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.startswith("ArtifactWriteError: "), proc.stderr
    assert "weights/model.bin" in proc.stderr
    assert "File too large" in proc.stderr
    assert verify_published(out)["payload"] == b"old".hex()
    assert os.listdir(tmp_path) == ["out"]


def test_compile_killed_in_the_publish_window_then_forced(tmp_path: Path) -> None:
    """Two real compiles: one SIGKILLed just before its swap (a second compile meanwhile is refused at
    once as busy); then one with --force replaces the user's directory and removes the leftover."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "thesis.tex").write_text("years of work")
    argv = [sys.executable, "-m", "qcompiler.cli.main", *COMPILE, "-o", str(out), "--force"]
    proc, tmp = paused(argv, "swap", tmp_path)
    busy = run_cli(*COMPILE, "-o", str(out), "--force")
    assert busy.code == 1
    assert f"another compile (pid {proc.pid}" in busy.err
    kill(proc)
    assert tmp.is_dir()
    assert tree(out) == {"thesis.tex": b"years of work"}
    done = run_cli(*COMPILE, "-o", str(out), "--force")
    assert done.code == 0, done.err
    assert os.listdir(tmp_path) == ["out"]
    assert "thesis.tex" not in os.listdir(out)
    assert verify_published(out)["versions"]["artifact_schema"] == ARTIFACT_SCHEMA
