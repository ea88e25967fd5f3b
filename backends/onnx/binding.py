"""Gate ``binding``: every byte onnxruntime reads is what this backend lowers the artifact's ``graph.qir`` to.

The models are lowered again from the reopened ``graph.qir`` module, with the form, accuracy level and
attention form the manifest records (``versions.onnx_form``, ``provenance.accuracy_level``,
``provenance.onnx_attention``), the way ``emit`` lowers
them: ``build_model`` into ``StreamedInitializers`` (the layout ``externalize`` writes, each piece
compared with the data file as it is lowered; a causal LM's ``model.onnx`` is its KV-cache decoder
graph) and, when the manifest records ``provenance.no_cache_graph``, the no-cache graph sharing those
pieces (same names, same sha256). Then:

| file | must be |
|---|---|
| ``model.onnx.data`` | the lowered initializers at their offsets, zero padding between, nothing after |
| ``model.onnx`` | byte for byte the serialized lowered model (external-data entries included) |
| ``model_no_cache.onnx`` | present exactly when the manifest records ``no_cache_graph: true``, then byte for byte |

A file that differs is refused with the first differing field, found by ``protodiff``: the
initializer (name, ``data_type``, ``dims``, ``raw_data``, ``external_data.offset`` ...), the node
(``op_type``, an input, an attribute), a graph input or output, ``ir_version`` or ``opset_import``.

Cost: every weight is read once more, through ``graph.qir``'s own locations (the container parsed by
the earlier gates is reused through ``open_cached``), lowered (twice with the no-cache graph), and
compared with the data file in ``CHUNK``-sized reads. Memory is one lowered
initializer at a time plus one chunk, as in ``emit``: neither the blob nor a model's initializers
are ever assembled.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO, NamedTuple, TypeVar

import onnx

from qcompiler.artifact.reader import GRAPH, ArtifactError, as_artifact
from qcompiler.artifact.writer import MANIFEST
from qcompiler.backends.onnx.blobs import MAX_MODEL_BYTES
from qcompiler.backends.onnx.emit import DATA_FILE, build_model, is_causal_lm, no_cache_of
from qcompiler.backends.onnx.external import StreamedInitializers
from qcompiler.backends.onnx.kv_cache import ATTENTIONS, DECOMPOSED
from qcompiler.backends.onnx.plan import FORMS
from qcompiler.backends.onnx.protodiff import first_byte, first_difference, show
from qcompiler.backends.onnx.weights import MODEL_FILE, NO_CACHE_FILE
from qcompiler.errors import QcError
from qcompiler.ir.core import Module
from qcompiler.paths import PathError, open_in

ACCURACY_LEVELS = range(5)
"""MatMulNBits ``accuracy_level`` values (0: the kernel's default, 1: fp32 ... 4: int8 activations)."""
CHUNK = 16 * 2**20
"""Bytes of the data file read at a time."""
T = TypeVar("T")


class EmitOptions(NamedTuple):
    """What ``emit`` lowered with, as the manifest records it."""

    form: str
    accuracy: int
    no_cache: bool
    attention: str = DECOMPOSED


def emit_options(manifest: dict[str, Any], form: str | None) -> EmitOptions:
    """The form, accuracy level, whether the no-cache graph was written and the decoder graph's
    attention form, as the manifest records them; ``form``: the one the target implies."""
    versions, prov = manifest.get("versions"), manifest.get("provenance")
    recorded = versions.get("onnx_form") if isinstance(versions, dict) else None
    if not isinstance(recorded, str) or recorded not in FORMS or (form is not None and recorded != form):
        raise ArtifactError(
            "the recorded ONNX form is not the target's",
            file=MANIFEST,
            field="versions.onnx_form",
            expected=form or " | ".join(FORMS),
            found=repr(recorded),
        )
    level = prov.get("accuracy_level") if isinstance(prov, dict) else None
    if not isinstance(level, int) or isinstance(level, bool) or level not in ACCURACY_LEVELS:
        raise ArtifactError(
            "must be a MatMulNBits accuracy level",
            file=MANIFEST,
            field="provenance.accuracy_level",
            expected="an integer 0..4",
            found=repr(level),
        )
    no_cache = prov.get("no_cache_graph") if isinstance(prov, dict) else None
    if not isinstance(no_cache, bool):
        raise ArtifactError(
            f"must say whether {NO_CACHE_FILE} was written",
            file=MANIFEST,
            field="provenance.no_cache_graph",
            expected="true | false",
            found=repr(no_cache),
        )
    attention = prov.get("onnx_attention") if isinstance(prov, dict) else None
    if not isinstance(attention, str) or attention not in ATTENTIONS:
        raise ArtifactError(
            "must name the decoder graph's attention form",
            file=MANIFEST,
            field="provenance.onnx_attention",
            expected=" | ".join(sorted(ATTENTIONS)),
            found=repr(attention),
        )
    return EmitOptions(str(recorded), level, no_cache, attention)


def check_binding(root: Path, module: Module, options: EmitOptions, no_cache_present: bool) -> None:
    """Refuse the artifact unless its ONNX files are exactly what ``module`` lowers to (module docstring);
    ``options``: what ``emit_options`` read from the manifest."""
    form, accuracy, no_cache, attention = options
    how = f"{form}, accuracy_level {accuracy}, attention {attention}"
    if no_cache and not is_causal_lm(module):
        raise ArtifactError(
            "graph.qir is not a causal LM graph, so there is no no-cache graph beside model.onnx",
            file=MANIFEST,
            field="provenance.no_cache_graph",
            expected="false",
            found="true",
        )
    if no_cache != no_cache_present:
        raise ArtifactError(
            f"the manifest records provenance.no_cache_graph = {str(no_cache).lower()}",
            file=NO_CACHE_FILE,
            expected="present" if no_cache else "absent",
            found="present" if no_cache_present else "missing",
        )
    try:
        fh, st = open_in(root, DATA_FILE, field="external_data.location")
    except PathError as e:
        raise as_artifact(e) from None
    with fh:

        def place(t: onnx.TensorProto, end: int, offset: int, raw: bytes) -> None:
            check_piece(fh, st.st_size, t, end, offset, raw, how)  # compared as lowered, then dropped

        checked = StreamedInitializers(DATA_FILE, place)
        model = lowered(lambda: build_model(module, form, accuracy, initializers=checked, attention=attention)[0])
        if st.st_size != checked.end:
            raise ArtifactError(
                "size differs from the lowered initializers' layout",
                file=DATA_FILE,
                field="size",
                expected=checked.end,
                found=st.st_size,
            )
    check_model(root, MODEL_FILE, model, how)
    del model
    if no_cache:
        check_model(root, NO_CACHE_FILE, lowered(lambda: no_cache_of(module, form, accuracy, checked)), how)


LOWERING_ERRORS = (QcError, ArithmeticError, ValueError, TypeError, IndexError, KeyError)
"""What lowering a verified but crafted ``graph.qir`` may raise: a ``LowerError``, or numpy and Python
refusing a value no emitted graph holds (a dim past int64, a group with no block)."""


def lowered(build: Callable[[], T]) -> T:
    """``build()``, a lowering failure of the reopened graph refused as the graph's."""
    try:
        return build()
    except ArtifactError:
        raise  # a file found different while lowering (``check_piece``)
    except LOWERING_ERRORS as e:
        what = "" if isinstance(e, QcError) else f"{type(e).__name__}: "
        raise ArtifactError(f"does not lower to ONNX as it was emitted: {what}{e}", file=GRAPH) from None


def check_piece(fh: BinaryIO, size: int, t: onnx.TensorProto, end: int, offset: int, raw: bytes, how: str) -> None:
    """One lowered initializer against ``model.onnx.data`` (read on from ``end``, the end of the
    previous one): zero padding up to ``offset``, then ``raw``, in ``CHUNK`` reads."""
    gap = fh.read(offset - end)
    if gap.strip(b"\0"):
        raise ArtifactError(
            "padding before an initializer is not zero",
            file=DATA_FILE,
            tensor=t.name,
            field=f"bytes {end}..{offset}",
            expected="zeros",
            found=f"a non-zero byte at {end + first_byte(gap, bytes(len(gap)))}",
        )
    for at in range(0, len(raw), CHUNK):
        want = raw[at : at + CHUNK]
        got = fh.read(len(want))
        if len(got) < len(want):
            raise ArtifactError(
                "the file ends inside an initializer",
                file=DATA_FILE,
                tensor=t.name,
                field="size",
                expected=f">= {offset + len(raw)} bytes",
                found=size,
            )
        if got != want:
            raise ArtifactError(
                f"differs from what graph.qir lowers to ({how})",
                file=DATA_FILE,
                tensor=t.name,
                field=f"bytes {offset}..{offset + len(raw)}",
                expected=show(raw),
                found=f"a difference at byte {offset + at + first_byte(want, got)}",
            )


def check_model(root: Path, name: str, want: onnx.ModelProto, how: str) -> None:
    """The file ``name`` byte for byte against the serialized ``want``; else its first differing field."""
    try:
        fh, st = open_in(root, name)
    except PathError as e:
        raise as_artifact(e) from None
    with fh:
        if st.st_size > MAX_MODEL_BYTES:
            raise ArtifactError("larger than a protobuf can be", file=name, field="size", found=st.st_size)
        data = fh.read(st.st_size + 1)
    expected = want.SerializeToString()
    if data == expected:
        return
    found = onnx.ModelProto()
    try:
        found.ParseFromString(data)
    except Exception as e:  # protobuf's DecodeError (and others) on malformed input
        raise ArtifactError(f"not a valid ONNX model ({type(e).__name__})", file=name) from None
    d = first_difference(want, found)
    if d is None:
        raise ArtifactError(
            "serialization differs from the lowered model's, though every field is equal (unknown fields or a "
            "non-canonical encoding)",
            file=name,
            field="bytes",
            expected=f"{len(expected)} bytes",
            found=f"{len(data)} bytes, first difference at byte {first_byte(expected, data)}",
        )
    raise ArtifactError(
        f"differs from what graph.qir lowers to ({how})",
        file=name,
        tensor=d.tensor,
        field=d.field,
        expected=d.expected,
        found=d.found,
    )
