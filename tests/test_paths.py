"""The path policy (``qcompiler/paths.py``): no reader reads a byte outside the artifact root.

First the three cases measured against the readers before the policy existed, on an artifact of every
target, with the manifest re-listed as an attacker would (so the hash gate cannot be what refuses):
``graph.qir`` reading its tensors through a symlinked directory that points outside the artifact, a
listed file that is a hard link to a file outside, and an unlisted symlink to an outside directory.
Then the policy's own rules, one by one, and the source policy (links inside a source directory or an
HF cache snapshot are fine; links out of it are not).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest

from qcompiler.artifact.reader import ArtifactError, open_artifact
from qcompiler.errors import QcError
from qcompiler.examples import tiny_llama_hf
from qcompiler.paths import ARTIFACT, SOURCE, Identity, PathError, check_rel, open_in, reopen, walk
from qcompiler.testing import rehash, run_cli

LLAMA = "qcompiler.examples:tiny_llama_hf"
TARGETS = {"safetensors": "w4-g32", "triton": "w4-g32", "gguf": "q4_0", "onnx-nbits": "w4-g32"}
LOCATION = re.compile(r'blob<"sha256:[0-9a-f]{64}", "(\w+):([^#"]+)(#[^"]*)?">')


@pytest.fixture(scope="module")
def bases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("bases")
    out: dict[str, Path] = {}
    for target, scheme in TARGETS.items():
        path = root / target
        r = run_cli("compile", LLAMA, "--scheme", scheme, "--target", target, "-o", str(path))
        assert r.code == 0, r.err
        out[target] = path
    return out


def copy(src: Path, tmp_path: Path) -> Path:
    dest = tmp_path / "art"
    shutil.copytree(src, dest)
    return dest


def refused_everywhere(art: Path, phrase: str) -> None:
    """``open_artifact`` and the runtime's ``load`` raise a typed error with ``phrase``; ``verify`` and
    ``inspect`` exit 1 saying it, with no traceback."""
    from qcompiler.runtime import load

    for reader in (open_artifact, load):
        with pytest.raises(ArtifactError) as e:
            reader(art)
        assert phrase in str(e.value), str(e.value)
    for command in (("verify", str(art), "--json"), ("inspect", str(art), "--json")):
        r = run_cli(*command)
        assert r.code == 1, (command, r.out, r.err)
        assert "Traceback" not in r.err + r.out, r.err
        assert phrase in r.err + r.out, (command, r.out, r.err)


def container_of(art: Path) -> tuple[str, str]:
    """The scheme and file of graph.qir's first tensor location."""
    m = LOCATION.search((art / "graph.qir").read_text())
    assert m, "graph.qir has a tensor location"
    return m.group(1), m.group(2)


# ------------------------------------------------------------------- the three measured cases


@pytest.mark.parametrize("target", TARGETS)
def test_graph_reading_its_tensors_through_a_symlinked_directory_is_refused(
    bases: dict[str, Path], tmp_path: Path, target: str
) -> None:
    art = copy(bases[target], tmp_path)
    scheme, file = container_of(art)
    outside = tmp_path / "outside"
    outside.mkdir()
    shutil.copy2(art / file, outside / file)
    (art / "d").symlink_to(outside, target_is_directory=True)
    text = (art / "graph.qir").read_text()
    (art / "graph.qir").write_text(text.replace(f'"{scheme}:{file}', f'"{scheme}:d/{file}'))
    manifest = json.loads((art / "manifest.json").read_text())
    rehash(art)  # rglob does not enter the link: list d/<file> as the attacker would
    edited = json.loads((art / "manifest.json").read_text())
    listed = [f for f in edited["files"] if f["path"] == file]
    edited["files"].append({**listed[0], "path": f"d/{file}"})
    assert manifest["files"] != edited["files"]
    from qcompiler.artifact.writer import SELF_DIGEST, manifest_digest

    edited[SELF_DIGEST] = manifest_digest(edited)
    (art / "manifest.json").write_text(json.dumps(edited, indent=2, sort_keys=True))
    refused_everywhere(art, "symbolic link")


@pytest.mark.parametrize("target", TARGETS)
def test_a_listed_file_hard_linked_to_a_file_outside_is_refused(
    bases: dict[str, Path], tmp_path: Path, target: str
) -> None:
    art = copy(bases[target], tmp_path)
    _, file = container_of(art)
    os.link(art / file, tmp_path / "elsewhere.bin")  # same bytes, so every sha256 still holds
    refused_everywhere(art, "has 2 hard links")


@pytest.mark.parametrize("target", TARGETS)
def test_an_unlisted_symlink_to_an_outside_directory_is_refused(
    bases: dict[str, Path], tmp_path: Path, target: str
) -> None:
    art = copy(bases[target], tmp_path)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.txt").write_text("not the artifact's")
    (art / "extra").symlink_to(outside, target_is_directory=True)
    refused_everywhere(art, "symbolic link")


def test_untouched_artifacts_open(bases: dict[str, Path]) -> None:
    for target, art in bases.items():
        manifest = open_artifact(art).manifest
        assert manifest is not None, target
        assert manifest["target"], target


# ------------------------------------------------------------------- the rules, one by one


@pytest.mark.parametrize(
    ("rel", "phrase"),
    [
        ("", "is empty or not a string"),
        ("a\0b", "NUL byte"),
        ("a\\b", "backslash"),
        ("/etc/passwd", "absolute path"),
        ("C:x", "drive letter"),
        ("../x", "'..' component"),
        ("a/../../x", "'..' component"),
        ("a//b", "empty or '.' component"),
        ("./a", "empty or '.' component"),
        ("a/", "empty or '.' component"),
    ],
)
def test_lexically_unsafe_paths_are_refused(rel: str, phrase: str) -> None:
    with pytest.raises(PathError, match=re.escape(phrase)):
        check_rel(rel)


def test_plain_relative_paths_pass() -> None:
    for rel in ("model.safetensors", "kernels/index.json", "a.b/c-d_e"):
        assert check_rel(rel) == rel
    with pytest.raises(PathError):
        check_rel(3)


def test_a_symlinked_file_or_parent_is_refused_by_open_in(tmp_path: Path) -> None:
    (tmp_path / "real").mkdir()
    (tmp_path / "real" / "f.bin").write_bytes(b"x")
    (tmp_path / "link.bin").symlink_to(tmp_path / "real" / "f.bin")
    (tmp_path / "dir").symlink_to(tmp_path / "real", target_is_directory=True)
    for rel in ("link.bin", "dir/f.bin"):
        with pytest.raises(PathError, match="symbolic link") as e:
            open_in(tmp_path, rel)
        assert e.value.file == rel
    fh, st = open_in(tmp_path, "real/f.bin")
    with fh:
        assert fh.read() == b"x"
        assert st.st_size == 1


def test_a_fifo_or_a_directory_is_not_a_regular_file(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "pipe")
    (tmp_path / "sub").mkdir()
    for rel in ("pipe", "sub"):
        with pytest.raises(PathError, match="not a regular file"):
            open_in(tmp_path, rel)  # a FIFO is opened non-blocking: this returns instead of waiting
    with pytest.raises(PathError, match="not a regular file"):
        walk(tmp_path)


def test_a_missing_file_is_a_typed_error(tmp_path: Path) -> None:
    with pytest.raises(PathError, match="is missing"):
        open_in(tmp_path, "absent.bin")


def test_a_file_swapped_after_it_was_checked_is_refused_on_reopen(tmp_path: Path) -> None:
    path = tmp_path / "model.bin"
    path.write_bytes(b"checked bytes")
    fh, st = open_in(tmp_path, "model.bin")
    fh.close()
    identity = Identity.of(st)
    reopen(path, identity).close()  # the same file: fine
    (tmp_path / "other.bin").write_bytes(b"swapped bytes")
    os.replace(tmp_path / "other.bin", path)  # same size, another inode
    with pytest.raises(PathError, match="is not the file that was checked"):
        reopen(path, identity)


def test_walk_lists_plain_files_and_bounds_depth(tmp_path: Path) -> None:
    (tmp_path / "kernels").mkdir()
    (tmp_path / "kernels" / "index.json").write_text("{}")
    (tmp_path / "manifest.json").write_text("{}")
    assert sorted(walk(tmp_path)) == ["kernels/index.json", "manifest.json"]
    deep = tmp_path / "deep"
    deep.mkdir()
    for i in range(20):
        deep = deep / str(i)
    deep.mkdir(parents=True)
    (deep / "f").write_text("x")
    with pytest.raises(PathError, match="nested too deep"):
        walk(tmp_path)


def test_every_path_error_is_a_typed_qcompiler_error() -> None:
    with pytest.raises(QcError):
        check_rel("../x")


# ------------------------------------------------------------------- sources


def test_source_links_inside_the_directory_are_followed(tmp_path: Path) -> None:
    (tmp_path / "blobs").mkdir()
    (tmp_path / "blobs" / "abc").write_bytes(b"w")
    (tmp_path / "model.bin").symlink_to(Path("blobs") / "abc")
    os.link(tmp_path / "blobs" / "abc", tmp_path / "hard.bin")
    assert sorted(walk(tmp_path, SOURCE)) == ["blobs/abc", "hard.bin", "model.bin"]
    fh, _ = open_in(tmp_path, "model.bin", SOURCE)
    with fh:
        assert fh.read() == b"w"
    with pytest.raises(PathError, match="hard links"):
        walk(tmp_path, ARTIFACT)


def test_source_links_out_of_the_directory_are_refused(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (tmp_path / "secret.bin").write_bytes(b"s")
    (src / "model.bin").symlink_to(tmp_path / "secret.bin")
    with pytest.raises(PathError, match="resolves outside the source directory"):
        walk(src, SOURCE)
    with pytest.raises(PathError):
        open_in(src, "model.bin", SOURCE)


def test_an_hf_cache_snapshot_may_link_into_its_blobs(tmp_path: Path) -> None:
    repo = tmp_path / "models--org--tiny"
    (repo / "blobs").mkdir(parents=True)
    snap = repo / "snapshots" / "0123abcd"
    snap.mkdir(parents=True)
    (repo / "blobs" / "deadbeef").write_bytes(b"{}")
    (snap / "config.json").symlink_to(Path("..") / ".." / "blobs" / "deadbeef")
    assert list(walk(snap, SOURCE)) == ["config.json"]
    fh, _ = open_in(snap, "config.json", SOURCE)
    with fh:
        assert fh.read() == b"{}"


def test_compiling_a_source_whose_weights_link_outside_it_is_refused(tmp_path: Path) -> None:
    src = tmp_path / "src"
    tiny_llama_hf().save_pretrained(src)  # pyright: ignore[reportCallIssue]
    os.replace(src / "model.safetensors", tmp_path / "model.safetensors")
    (src / "model.safetensors").symlink_to(tmp_path / "model.safetensors")
    out = tmp_path / "out"
    r = run_cli("compile", str(src), "--scheme", "w4-g32", "--target", "safetensors", "-o", str(out))
    assert r.code == 1, r.err
    assert "Traceback" not in r.err
    assert "model.safetensors" in r.err, r.err
    assert "outside the source directory" in r.err, r.err
    assert not out.exists()
