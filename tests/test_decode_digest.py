"""Rung 2's decode digests: BLAKE3 in artifacts of schema 2 (what compiles write), sha256 in those of
schema 1, which still verify; each schema holds its own field and no other."""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import blake3
import numpy as np
import pytest

from qcompiler.artifact.manifest import ARTIFACT_SCHEMA
from qcompiler.artifact.manifest_schema import DECODE_FIELDS
from qcompiler.artifact.reader import open_artifact
from qcompiler.artifact.writer import SELF_DIGEST, manifest_digest
from qcompiler.decode_digest import DECODE_DIGEST, DIGESTS
from qcompiler.ladder import ladder
from qcompiler.parity import decoded, weights
from qcompiler.parity_rows import DecodeEvidence
from qcompiler.testing import run_cli

LLAMA = "qcompiler.examples:tiny_llama_hf"


@pytest.fixture(scope="module")
def artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("art") / "tiny"
    r = run_cli("compile", LLAMA, "--scheme", "w4-g32", "--target", "safetensors", "-o", str(out))
    assert r.code == 0, r.err
    return out


def rewritten(artifact: Path, dest: Path, edit: Callable[[dict[str, Any]], None]) -> Path:
    """A copy of ``artifact`` whose manifest ``edit`` changed (its own digest recomputed)."""
    shutil.copytree(artifact, dest)
    manifest = json.loads((dest / "manifest.json").read_text())
    edit(manifest)
    manifest[SELF_DIGEST] = manifest_digest(manifest)
    (dest / "manifest.json").write_text(json.dumps(manifest))
    return dest


def as_schema_1(artifact: Path) -> Callable[[dict[str, Any]], None]:
    """The manifest an earlier compiler wrote for the same bytes: schema 1, sha256 decode digests."""
    sha = ladder(open_artifact(artifact).module, None, digest="decode_sha256").decode_digests

    def edit(manifest: dict[str, Any]) -> None:
        manifest["versions"]["artifact_schema"] = 1
        rung2 = manifest["parity"]["rung2_reconstruction"]
        del rung2["decode_blake3"]
        rung2["decode_sha256"] = sha

    return edit


def verified(path: Path) -> dict[str, Any]:
    r = run_cli("verify", str(path), "--json")
    assert "Traceback" not in r.out + r.err
    return json.loads(r.out)


def test_compiles_record_blake3_of_each_decode(artifact: Path) -> None:
    """The recorded digest is BLAKE3 of the decode's float32 little-endian bytes, for every weight."""
    assert DECODE_FIELDS[ARTIFACT_SCHEMA] == DECODE_DIGEST == "decode_blake3"
    manifest = json.loads((artifact / "manifest.json").read_text())
    assert manifest["versions"]["artifact_schema"] == 2
    recorded = manifest["parity"]["rung2_reconstruction"]["decode_blake3"]
    m = open_artifact(artifact).module
    names = [name for name, _, _ in weights(m)]
    assert sorted(recorded) == sorted(names)
    assert names
    for name, op, t in weights(m):
        got = np.ascontiguousarray(decoded(m, op, t), "<f4")
        assert recorded[name] == blake3.blake3(got.tobytes()).hexdigest()
    assert verified(artifact)["ok"]


def test_the_digest_is_the_same_fed_by_row_blocks() -> None:
    """``DecodeEvidence`` fed a decode in blocks of rows gives the digest of the whole bytes."""
    w = np.random.default_rng(0).standard_normal((37, 16)).astype(np.float32)
    for field, new in DIGESTS.items():
        ev = DecodeEvidence(None, 37, None, field)
        for r0 in range(0, 37, 10):
            ev.add(r0, min(37, r0 + 10), w[r0 : r0 + 10])
        whole = new()
        whole.update(w.tobytes())
        assert ev.digest() == whole.hexdigest()
    assert DIGESTS["decode_sha256"]().hexdigest() == hashlib.sha256().hexdigest()


def test_a_schema_1_artifact_still_verifies(artifact: Path, tmp_path: Path) -> None:
    """An artifact written before BLAKE3 (schema 1, sha256 digests) is verified with sha256."""
    old = rewritten(artifact, tmp_path / "old", as_schema_1(artifact))
    report = verified(old)
    assert report["ok"], report.get("error")
    rung2 = report["rungs"]["2_reconstruction"]
    assert rung2["failed"] == []
    assert rung2["weights"] > 0
    assert "decode_sha256" in rung2["reference"]


def test_a_changed_sha256_digest_fails_rung_2(artifact: Path, tmp_path: Path) -> None:
    to_old = as_schema_1(artifact)
    first = sorted(
        json.loads((artifact / "manifest.json").read_text())["parity"]["rung2_reconstruction"]["decode_blake3"]
    )[0]

    def edit(manifest: dict[str, Any]) -> None:
        to_old(manifest)
        manifest["parity"]["rung2_reconstruction"]["decode_sha256"][first] = "0" * 64

    report = verified(rewritten(artifact, tmp_path / "bad", edit))
    assert not report["ok"]
    assert report["rungs"]["2_reconstruction"]["failed"] == [first]


@pytest.mark.parametrize(
    ("schema", "field", "message"),
    [
        (2, "decode_sha256", "decode_blake3: missing"),  # schema 2 holds BLAKE3 digests only
        (1, "decode_blake3", "decode_sha256: missing"),
        (3, "decode_blake3", "unknown artifact schema"),
        (True, "decode_sha256", "unknown artifact schema"),
    ],
)
def test_a_digest_field_of_another_schema_is_refused(
    artifact: Path, tmp_path: Path, schema: object, field: str, message: str
) -> None:
    def edit(manifest: dict[str, Any]) -> None:
        manifest["versions"]["artifact_schema"] = schema
        rung2 = manifest["parity"]["rung2_reconstruction"]
        rung2[field] = rung2.pop("decode_blake3")

    r = run_cli("verify", str(rewritten(artifact, tmp_path / "x", edit)), "--json")
    assert r.code == 1
    assert message in r.out + r.err
    assert "manifest.json" in r.out + r.err
    assert "Traceback" not in r.out + r.err
