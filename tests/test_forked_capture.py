"""The export of a streamed model in a forked child (``frontend/forked.py``): the module it hands back,
bound to the stream's references, is the in-process capture's; a failing child falls back to the
export in this process; a placeholder the stream filled otherwise is refused; the child is reaped."""

from __future__ import annotations

import gc
import importlib
import os
from pathlib import Path

import pytest

from qcompiler import api
from qcompiler.api import capture_source
from qcompiler.examples import tiny_llama_hf
from qcompiler.frontend import forked
from qcompiler.frontend.forked import bind, placeholder
from qcompiler.ir import print_module
from qcompiler.ir.blobs import spilled
from qcompiler.ir.core import BlobRef, Module, TensorDecl
from qcompiler.ir.dtypes import DTYPES


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("forked") / "src"
    tiny_llama_hf().save_pretrained(path)  # pyright: ignore[reportCallIssue]
    return path


@pytest.fixture(scope="module")
def in_process(llama_dir: Path) -> str:
    """The module captured with no spill directory: no child, the export runs in this process."""
    return print_module(capture_source(str(llama_dir), scheme="w4-g32", jobs=2).module)


def children(monkeypatch: pytest.MonkeyPatch) -> list[forked.ForkedCapture]:
    made: list[forked.ForkedCapture] = []
    init = forked.ForkedCapture.__init__

    def spy(self: forked.ForkedCapture, pid: int, fd: int) -> None:
        init(self, pid, fd)
        made.append(self)

    monkeypatch.setattr(forked.ForkedCapture, "__init__", spy)
    return made


def test_the_child_module_is_the_in_process_one(
    llama_dir: Path, in_process: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    made = children(monkeypatch)
    exported_here: list[object] = []
    monkeypatch.setattr(api, "export_program", lambda *a, **k: exported_here.append(a))  # pyright: ignore[reportUnknownLambdaType]
    with spilled(tmp_path / "spill"):
        got = print_module(capture_source(str(llama_dir), scheme="w4-g32", jobs=2).module)
    assert got == in_process
    assert len(made) == 1
    assert made[0].status == 0  # the child ran, exited cleanly and was reaped
    assert not exported_here  # nothing was exported in this process
    with pytest.raises(ChildProcessError):
        os.waitpid(made[0].pid, os.WNOHANG)
    assert gc.get_freeze_count() == 0  # what was frozen for the child's lifetime is collectable again


def test_a_failing_child_falls_back_to_the_export_here(
    llama_dir: Path, in_process: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    made = children(monkeypatch)

    def broken(*args: object, **kwargs: object) -> Module:
        raise RuntimeError("the child cannot capture")

    capture_module = importlib.import_module("qcompiler.frontend.capture")
    monkeypatch.setattr(capture_module, "capture", broken)  # the child's capture; api holds its own name
    with spilled(tmp_path / "spill"):
        got = print_module(capture_source(str(llama_dir), scheme="w4-g32", jobs=2).module)
    assert got == in_process
    assert [c.status for c in made] == [1]
    assert gc.get_freeze_count() == 0


def test_a_placeholder_filled_otherwise_is_not_bound() -> None:
    hole = placeholder("w.codes", "i8", (4, 8))
    m = Module("m")
    m.tensors["w.codes"] = TensorDecl("w.codes", hole)
    right = BlobRef(DTYPES["i8"], (4, 8), "a" * 64, "mem")
    assert bind(m, {"w.codes": hole}, {"w.codes": right}) is m
    assert m.tensors["w.codes"].blob == right
    for wrong in (BlobRef(DTYPES["u8"], (4, 8), "a" * 64, "mem"), BlobRef(DTYPES["i8"], (8, 4), "a" * 64, "mem")):
        m.tensors["w.codes"] = TensorDecl("w.codes", hole)
        assert bind(m, {"w.codes": hole}, {"w.codes": wrong}) is None
    m.tensors["w.codes"] = TensorDecl("w.codes", hole)
    assert bind(m, {"w.codes": hole}, {}) is None
