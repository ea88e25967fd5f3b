"""torch.export runs beside the weight reading, on stand-ins for the quantized modules: each real
module must trace as its stand-in, and where one would not the capture exports again (same IR)."""

from __future__ import annotations

from pathlib import Path

import pytest

from qcompiler.api import capture_source
from qcompiler.examples import tiny_llama_hf
from qcompiler.frontend import stream
from qcompiler.frontend.stand_ins import same_module
from qcompiler.ir import print_module


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("stand-ins") / "src"
    tiny_llama_hf().save_pretrained(path)  # pyright: ignore[reportCallIssue]
    return path


@pytest.mark.parametrize(
    ("scheme", "scales"), [("w4-g32", "source"), ("w8-channel-asym", "f32"), ("q8_0", "f32"), ("q4_k_m", "f32")]
)
def test_every_quantized_module_traces_as_its_stand_in(llama_dir: Path, scheme: str, scales: str) -> None:
    p = stream.prepare_hf_dir(llama_dir, scheme, scales=scales, stand_ins=True)
    assert p.stand_ins
    assert set(p.stand_ins) == set(p.plan)
    s = stream.stream_prepared(p, jobs=2, swap=False)
    assert s.stand_ins_held
    assert set(s.modules) == set(p.plan)
    for fqn, real in s.modules.items():
        assert same_module(p.stand_ins[fqn], real), fqn


def test_a_module_unlike_its_stand_in_is_exported_again(llama_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with_stand_ins = print_module(capture_source(str(llama_dir), scheme="w4-g32", jobs=2).module)
    monkeypatch.setattr(stream, "same_module", lambda stand, real: False)  # pyright: ignore[reportUnknownLambdaType]
    again = print_module(capture_source(str(llama_dir), scheme="w4-g32", jobs=2).module)
    assert again == with_stand_ins


def test_an_error_while_reading_ends_the_capture_beside_it(
    llama_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A shard truncated after its gates passed: the reading thread's typed error reaches the caller
    once the export beside it is done, and nothing is left running."""
    import shutil
    import threading

    from qcompiler import api
    from qcompiler.errors import QcError

    src = tmp_path / "src"
    shutil.copytree(llama_dir, src)
    prepare = stream.prepare_hf_dir

    def then_truncate(*args: object, **kwargs: object) -> stream.Prepared:
        p = prepare(*args, **kwargs)  # pyright: ignore[reportArgumentType]
        shard = next(src.glob("*.safetensors"))
        shard.write_bytes(shard.read_bytes()[:-4096])
        return p

    monkeypatch.setattr(api, "prepare_hf_dir", then_truncate)
    with pytest.raises(QcError, match="truncated"):
        api.capture_streamed(str(src), "w4-g32", False, 2, None, "f32")
    assert not [t for t in threading.enumerate() if t.name.startswith("qc-stream")]
