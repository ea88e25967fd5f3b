"""Signed provenance (``qcompiler keygen``, ``sign``, ``verify --trusted-key``): the hashes in the
manifest prove identity, not origin. An artifact whose tensor bytes were changed and every hash
recomputed passes the files gate, but not ``verify --trusted-key``; every malformed ``manifest.sig``
is a typed failure naming the file and field; re-signing replaces the signature."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from qcompiler.artifact.reader import check_files, read_manifest
from qcompiler.artifact.signing import MAX_SIGNATURE_BYTES, check_signature, key_id, load_public_key
from qcompiler.artifact.writer import MANIFEST, SIGNATURE
from qcompiler.testing import rehash, run_cli

LLAMA = "qcompiler.examples:tiny_llama_hf"
COMPILE = ("compile", LLAMA, "--scheme", "w4-g32", "--target", "safetensors", "-o")


@pytest.fixture(scope="module")
def unsigned(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("unsigned") / "art"
    r = run_cli(*COMPILE, str(out))
    assert r.code == 0, r.err
    return out


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Two key pairs: ``trusted`` (the publisher's) and ``other``."""
    d = tmp_path_factory.mktemp("keys")
    out: dict[str, Path] = {}
    for name in ("trusted", "other"):
        r = run_cli("keygen", "--out-private", str(d / f"{name}.pem"), "--out-public", str(d / f"{name}.pub.pem"))
        assert r.code == 0, r.err
        out[name], out[f"{name}.pub"] = d / f"{name}.pem", d / f"{name}.pub.pem"
    return out


@pytest.fixture(scope="module")
def signed(unsigned: Path, keys: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("signed") / "art"
    shutil.copytree(unsigned, out)
    r = run_cli("sign", str(out), "--key", str(keys["trusted"]))
    assert r.code == 0, r.err
    return out


def copy(src: Path, tmp_path: Path) -> Path:
    dest = tmp_path / "copy"
    shutil.copytree(src, dest, symlinks=True)
    return dest


def kid(keys: dict[str, Path], name: str) -> str:
    return key_id(load_public_key(keys[f"{name}.pub"]))


def verify(path: Path, *args: str) -> tuple[int, dict[str, Any]]:
    r = run_cli("verify", str(path), "--json", *args)
    assert "Traceback" not in r.err
    return r.code, json.loads(r.out)


def trusted_failure(path: Path, keys: dict[str, Path]) -> tuple[str, str]:
    """``verify --trusted-key``'s failure on ``path``: (signature status, error)."""
    code, result = verify(path, "--trusted-key", str(keys["trusted.pub"]))
    assert code == 1
    assert result["ok"] is False
    assert result["error"] == result["signature"]["error"]
    return result["signature"]["status"], result["error"]


def flip_tensor_byte(path: Path) -> str:
    """Flip one byte in the middle of a tensor's data in ``model.safetensors``; returns the tensor's name."""
    data = bytearray(path.read_bytes())
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + n])
    name = next(t for t in sorted(header) if t.endswith("weight_packed"))
    begin, end = header[name]["data_offsets"]
    data[8 + n + (begin + end) // 2] ^= 0x10
    path.write_bytes(bytes(data))
    return name


def sig(path: Path) -> dict[str, Any]:
    return json.loads((path / SIGNATURE).read_text())


def write_sig(path: Path, record: object) -> None:
    (path / SIGNATURE).write_text(json.dumps(record, indent=2))


# --------------------------------------------------------------------------- the key scenario


def test_rehashed_tensor_bytes_pass_the_hashes_but_fail_the_signature(
    signed: Path, keys: dict[str, Path], tmp_path: Path
) -> None:
    art = copy(signed, tmp_path)
    flip_tensor_byte(art / "model.safetensors")
    rehash(art)
    check_files(art, read_manifest(art))  # every sha256 in the manifest agrees with the changed bytes
    code, plain = verify(art)  # other gates may or may not notice; the signature is not checked here
    assert plain["signature"]["status"] == "unchecked"
    assert code == (0 if plain["ok"] else 1)
    status, error = trusted_failure(art, keys)
    assert status == "invalid"
    digest = hashlib.sha256((art / MANIFEST).read_bytes()).hexdigest()
    assert error == (
        f"{SIGNATURE}: manifest_sha256: signed another {MANIFEST} (expected {sig(art)['manifest_sha256']}, "
        f"found {digest})"
    )
    write_sig(art, {**sig(art), "manifest_sha256": digest})  # the attacker updates the digest too
    assert trusted_failure(art, keys) == (
        "invalid",
        f"{SIGNATURE}: signature: does not verify over {MANIFEST} with the trusted key",
    )


def test_valid_signature_passes(signed: Path, keys: dict[str, Path]) -> None:
    code, result = verify(signed, "--trusted-key", str(keys["trusted.pub"]))
    assert code == 0, result
    assert result["ok"] is True
    s = result["signature"]
    assert s["status"] == "valid"
    assert s["key_id"] == s["trusted_key_id"] == kid(keys, "trusted")
    assert s["manifest_sha256"] == hashlib.sha256((signed / MANIFEST).read_bytes()).hexdigest()
    assert result["gates"][:2] == ["manifest", "files"]
    assert set(sig(signed)) == {"algorithm", "format", "key_id", "manifest_sha256", "signature"}
    table = run_cli("verify", str(signed), "--trusted-key", str(keys["trusted.pub"]))
    assert table.code == 0
    assert "signature" in table.out
    assert "valid" in table.out
    assert json.loads(json.dumps(check_signature(signed, keys["trusted.pub"]))) == s


def test_another_key_is_untrusted(signed: Path, keys: dict[str, Path], tmp_path: Path) -> None:
    code, result = verify(signed, "--trusted-key", str(keys["other.pub"]))
    assert code == 1
    assert result["signature"]["status"] == "untrusted-key"
    assert result["error"] == (
        f"{SIGNATURE}: key_id: signed by another key (expected {kid(keys, 'other')}, found {kid(keys, 'trusted')})"
    )
    assert result["gates"] == []  # nothing else ran for an artifact the key holder did not publish
    art = copy(signed, tmp_path)  # signed by the other key, claiming to be the trusted key's
    assert run_cli("sign", str(art), "--key", str(keys["other"])).code == 0
    write_sig(art, {**sig(art), "key_id": kid(keys, "trusted")})
    assert trusted_failure(art, keys)[0] == "invalid"


def test_unsigned_without_a_key_is_reported_and_with_a_key_fails(unsigned: Path, keys: dict[str, Path]) -> None:
    code, result = verify(unsigned)
    assert code == 0
    assert result["signature"] == {"status": "unsigned", "key_id": None, "ok": True, "note": "unsigned"}
    table = run_cli("verify", str(unsigned))
    assert table.code == 0
    assert "unsigned" in table.out
    status, error = trusted_failure(unsigned, keys)
    assert status == "unsigned"
    assert error.startswith(f"{SIGNATURE}: path: missing: the artifact is unsigned")


def test_signed_without_a_key_says_it_was_not_checked(signed: Path, keys: dict[str, Path]) -> None:
    code, result = verify(signed)
    assert code == 0
    note = f"signed by key {kid(keys, 'trusted')}, not checked (no --trusted-key)"
    assert result["signature"] == {"status": "unchecked", "key_id": kid(keys, "trusted"), "ok": True, "note": note}


# --------------------------------------------------------------------------- malformed manifest.sig


def _set(field: str, value: object) -> Callable[[Path], object]:
    return lambda art: write_sig(art, {**sig(art), field: value})


def _flip_b64(art: Path) -> None:
    s = sig(art)["signature"]
    _set("signature", ("B" if s[0] == "A" else "A") + s[1:])(art)


def _huge(art: Path) -> None:
    (art / SIGNATURE).write_text(json.dumps(sig(art)) + " " * MAX_SIGNATURE_BYTES)


def _symlink(art: Path) -> None:
    outside = art.parent / "elsewhere.sig"
    (art / SIGNATURE).rename(outside)
    (art / SIGNATURE).symlink_to(outside)


def _hardlink(art: Path) -> None:
    os.link(art / SIGNATURE, art.parent / "elsewhere.sig")


def _text(text: str) -> Callable[[Path], object]:
    return lambda art: (art / SIGNATURE).write_text(text)


SIXTY_THREE = base64.b64encode(bytes(63)).decode()
# (id, change, status with the trusted key, error prefix, still passes without a key)
CASES: list[tuple[str, Callable[[Path], object], str, str, bool]] = [
    ("flipped-base64-char", _flip_b64, "invalid", "signature: does not verify", True),
    ("wrong-manifest-sha256", _set("manifest_sha256", "0" * 64), "invalid", "manifest_sha256: signed another", True),
    ("wrong-key-id", _set("key_id", "ab" * 32), "untrusted-key", "key_id: signed by another key", True),
    (
        "bad-base64-char",
        lambda a: _set("signature", "!" + sig(a)["signature"][1:])(a),
        "invalid",
        "signature: is not valid base64",
        False,
    ),
    ("short-signature", _set("signature", SIXTY_THREE), "invalid", "signature: wrong length (expected 64 bytes", False),
    (
        "non-canonical-base64",
        lambda a: _set("signature", sig(a)["signature"][:-3] + "B==")(a),
        "invalid",
        "signature: is not canonical base64",
        False,
    ),
    ("signature-not-a-string", _set("signature", 7), "invalid", "signature: must be a base64 string", False),
    (
        "uppercase-key-id",
        lambda a: _set("key_id", sig(a)["key_id"].upper())(a),
        "invalid",
        "key_id: must be 64 lowercase hex digits",
        False,
    ),
    ("short-manifest-sha256", _set("manifest_sha256", "ab"), "invalid", "manifest_sha256: must be 64 lowercase", False),
    ("extra-field", _set("comment", "hi"), "invalid", "comment: unknown field", False),
    (
        "missing-field",
        lambda a: write_sig(a, {k: v for k, v in sig(a).items() if k != "format"}),
        "invalid",
        "format: missing field",
        False,
    ),
    ("format-2", _set("format", 2), "invalid", "format: unknown signature format (expected 1, found 2)", False),
    ("format-true", _set("format", True), "invalid", "format: unknown signature format", False),
    ("algorithm", _set("algorithm", "rsa"), "invalid", "algorithm: unknown algorithm", False),
    ("not-json", _text("signed, honestly"), "invalid", "invalid JSON", False),
    ("not-an-object", _text("[1, 2]"), "invalid", "must be a JSON object", False),
    ("duplicate-key", _text('{"format": 1, "format": 1}'), "invalid", "invalid JSON: duplicate key 'format'", False),
    ("not-utf8", lambda a: (a / SIGNATURE).write_bytes(b"\xff\xfe{}"), "invalid", "not UTF-8", False),
    ("huge", _huge, "invalid", f"size: too large (expected <= {MAX_SIGNATURE_BYTES} bytes", False),
    ("symlink", _symlink, "invalid", "path: is a symbolic link", False),
    ("hard-link", _hardlink, "invalid", "path: has 2 hard links", False),
]


@pytest.mark.parametrize(("change", "status", "prefix", "plain_ok"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_signature_file_is_a_typed_failure(
    signed: Path,
    keys: dict[str, Path],
    tmp_path: Path,
    change: Callable[[Path], object],
    status: str,
    prefix: str,
    plain_ok: bool,
) -> None:
    art = copy(signed, tmp_path)
    change(art)
    found_status, error = trusted_failure(art, keys)
    assert found_status == status
    assert error.startswith(f"{SIGNATURE}: {prefix}"), error
    code, plain = verify(art)
    if plain_ok:  # well-formed: without a key nothing cryptographic is checked
        assert code == 0
        assert plain["signature"]["status"] == "unchecked"
    else:
        assert code == 1
        assert plain["signature"]["status"] == "invalid"
        assert plain["error"].startswith(f"{SIGNATURE}: {prefix}"), plain["error"]


# --------------------------------------------------------------------------- sign and keygen


def test_resigning_after_a_legitimate_recompile(signed: Path, keys: dict[str, Path], tmp_path: Path) -> None:
    art = copy(signed, tmp_path)
    assert run_cli(*COMPILE, str(art)).code == 0  # a recompile publishes a new directory, unsigned
    assert not (art / SIGNATURE).exists()
    assert trusted_failure(art, keys)[0] == "unsigned"
    r = run_cli("sign", str(art), "--key", str(keys["trusted"]), "--json")
    assert r.code == 0, r.err
    assert json.loads(r.out)["key_id"] == kid(keys, "trusted")
    assert verify(art, "--trusted-key", str(keys["trusted.pub"]))[0] == 0
    assert run_cli("sign", str(art), "--key", str(keys["other"])).code == 0  # re-signing replaces it
    assert verify(art, "--trusted-key", str(keys["other.pub"]))[0] == 0
    assert trusted_failure(art, keys)[0] == "untrusted-key"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["copy"]  # no temp file left beside it
    assert SIGNATURE in {p.name for p in art.iterdir()}
    assert not [p for p in art.iterdir() if p.name.startswith(".")]


def test_sign_refuses_an_artifact_that_does_not_verify(unsigned: Path, keys: dict[str, Path], tmp_path: Path) -> None:
    art = copy(unsigned, tmp_path)
    flip_tensor_byte(art / "model.safetensors")
    r = run_cli("sign", str(art), "--key", str(keys["trusted"]))
    assert r.code == 1
    assert r.err.startswith("error: model.safetensors: sha256: content differs from the manifest")
    assert not (art / SIGNATURE).exists()
    r = run_cli("sign", str(tmp_path / "nothing"), "--key", str(keys["trusted"]))
    assert (r.code, r.err) == (1, f"error: {tmp_path / 'nothing'}: not an artifact directory\n")


def test_sign_refuses_keys_it_cannot_use(unsigned: Path, keys: dict[str, Path], tmp_path: Path) -> None:
    art = copy(unsigned, tmp_path)
    encrypted = tmp_path / "encrypted.pem"
    encrypted.write_bytes(
        Ed25519PrivateKey.generate().private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.BestAvailableEncryption(b"secret"),
        )
    )
    ec_key = tmp_path / "ec.pem"
    ec_key.write_bytes(
        ec.generate_private_key(ec.SECP256R1()).private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    for key, message in (
        (keys["trusted.pub"], "key: not a readable unencrypted PEM private key"),
        (encrypted, "key: not a readable unencrypted PEM private key"),
        (ec_key, "key: wrong key type (expected ed25519"),
        (tmp_path / "missing.pem", "path: cannot read the private key"),
    ):
        r = run_cli("sign", str(art), "--key", str(key))
        assert r.code == 1
        assert r.err.startswith(f"error: {key}: {message}"), r.err
    assert not (art / SIGNATURE).exists()
    r = run_cli("verify", str(art), "--trusted-key", str(keys["trusted"]))  # a private key is not a public key
    assert r.code == 1
    assert r.err.startswith(f"error: {keys['trusted']}: key: not a readable PEM public key")


def test_keygen_writes_pem_keys_and_refuses_to_overwrite(tmp_path: Path) -> None:
    private, public = tmp_path / "k.pem", tmp_path / "k.pub.pem"
    r = run_cli("keygen", "--out-private", str(private), "--out-public", str(public))
    assert r.code == 0, r.err
    assert private.stat().st_mode & 0o777 == 0o600
    assert private.read_text().startswith("-----BEGIN PRIVATE KEY-----\n")
    assert public.read_text().startswith("-----BEGIN PUBLIC KEY-----\n")
    assert f"key id {key_id(load_public_key(public))}" in r.out
    before = private.read_bytes(), public.read_bytes()
    r = run_cli("keygen", "--out-private", str(private), "--out-public", str(public))
    assert r.code == 1
    assert r.err == f"error: {private}: path: already exists (pass --force to replace it) " + (
        "(expected no file, found an existing file)\n"
    )
    assert (private.read_bytes(), public.read_bytes()) == before
    fresh = tmp_path / "fresh.pem"  # one existing file refuses both: nothing is written
    assert run_cli("keygen", "--out-private", str(fresh), "--out-public", str(public)).code == 1
    assert not fresh.exists()
    r = run_cli("keygen", "--out-private", str(private), "--out-public", str(public), "--force")
    assert r.code == 0, r.err
    assert (private.read_bytes(), public.read_bytes()) != before
    assert private.stat().st_mode & 0o777 == 0o600
    assert sorted(p.name for p in tmp_path.iterdir()) == ["k.pem", "k.pub.pem"]


def test_console_script_signs_and_refuses_tampering_without_traceback(
    unsigned: Path, keys: dict[str, Path], tmp_path: Path
) -> None:
    exe = shutil.which("qcompiler")
    assert exe is not None, "the qcompiler console script is installed"
    art = copy(unsigned, tmp_path)
    r = subprocess.run([exe, "sign", str(art), "--key", str(keys["trusted"])], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert f"signed {art} with key {kid(keys, 'trusted')}" in r.stdout
    flip_tensor_byte(art / "model.safetensors")
    rehash(art)
    cmd = [exe, "verify", str(art), "--trusted-key", str(keys["trusted.pub"])]
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 1
    assert "Traceback" not in r.stderr + r.stdout
    assert f"{SIGNATURE}: manifest_sha256: signed another {MANIFEST}" in " ".join(r.stdout.split())
