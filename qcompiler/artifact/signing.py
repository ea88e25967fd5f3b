"""Signed provenance: an Ed25519 signature over ``manifest.json``'s exact bytes, in ``manifest.sig``.

The manifest lists every other file with its size and sha256, so a signature over the manifest's
bytes covers every byte of the artifact. The hashes alone prove identity (these bytes, and nothing
else); the signature adds origin (the holder of this private key published exactly these bytes).
See docs/signing.md for the threat model.

    key_id = generate_keys(Path("key.pem"), Path("key.pub.pem"))    # PKCS8 (0600) + SubjectPublicKeyInfo
    sign_artifact("out/m", "key.pem")                               # only an artifact that verifies
    check_signature("out/m", "key.pub.pem")["status"]               # "valid", "invalid", "unsigned", ...

``manifest.sig`` is strict JSON with exactly these keys (``FIELDS``)::

    {"algorithm": "ed25519", "format": 1, "key_id": "<sha256 hex of the raw 32-byte public key>",
     "manifest_sha256": "<sha256 hex of manifest.json's bytes>", "signature": "<base64, 64 bytes>"}

Every refusal is a ``SignatureError`` naming the file (``manifest.sig`` or the key file) and the field.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import os
import re
import uuid
from pathlib import Path
from typing import Any

from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from qcompiler.artifact.reader import MAX_JSON_BYTES, open_artifact, read_json
from qcompiler.artifact.writer import MANIFEST, SIGNATURE, fsync_dir
from qcompiler.errors import FileError, QcError
from qcompiler.paths import CLOEXEC, NOFOLLOW, PathError, read_bounded

ALGORITHM = "ed25519"
FORMAT = 1
FIELDS = frozenset({"algorithm", "format", "key_id", "manifest_sha256", "signature"})
"""The exact key set of ``manifest.sig``."""
MAX_SIGNATURE_BYTES = 4096
"""Largest ``manifest.sig`` a reader parses (a real one is about 300 bytes)."""
MAX_KEY_BYTES = 64 * 1024
"""Largest PEM key file read."""
SIGNATURE_LEN = 64
_HEX64 = re.compile(r"^[0-9a-f]{64}$")


class SignatureError(FileError):
    """A signature or key file is missing, malformed, or does not check. ``str(e)`` reads
    ``FILE: FIELD: message (expected E, found F)``."""


def key_id(public_key: Ed25519PublicKey) -> str:
    """sha256 hex of the raw 32-byte public key: the name a signature gives its key."""
    raw = public_key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return hashlib.sha256(raw).hexdigest()


# --------------------------------------------------------------------------- keys


def generate_keys(private_path: Path | str, public_path: Path | str, *, force: bool = False) -> str:
    """Write a new Ed25519 key pair: the private key as unencrypted PKCS8 PEM (mode 0600), the public
    key as SubjectPublicKeyInfo PEM. Refuses existing files unless ``force``. Returns the key id."""
    private_path, public_path = Path(private_path), Path(public_path)
    if os.path.abspath(private_path) == os.path.abspath(public_path):
        raise SignatureError("the private and the public key must be two files", file=str(public_path), field="path")
    if not force:
        for path in (private_path, public_path):
            if os.path.lexists(path):
                raise SignatureError(
                    "already exists (pass --force to replace it)",
                    file=str(path),
                    field="path",
                    expected="no file",
                    found="an existing file",
                )
    key = Ed25519PrivateKey.generate()
    private_pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    public_pem = key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    write_atomic(private_path, private_pem, private=True, replace=force)
    write_atomic(public_path, public_pem, replace=force)
    return key_id(key.public_key())


def _read_key_file(path: Path, what: str) -> bytes:
    try:
        fd = os.open(path, os.O_RDONLY | CLOEXEC)
    except OSError as e:
        raise SignatureError(
            f"cannot read the {what}", file=str(path), field="path", found=e.strerror or type(e).__name__
        ) from None
    with os.fdopen(fd, "rb") as fh:
        data = fh.read(MAX_KEY_BYTES + 1)
    if len(data) > MAX_KEY_BYTES:
        raise SignatureError(
            f"too large for a {what}",
            file=str(path),
            field="size",
            expected=f"<= {MAX_KEY_BYTES} bytes",
            found=f"> {MAX_KEY_BYTES} bytes",
        )
    return data


def load_private_key(path: Path | str) -> Ed25519PrivateKey:
    """An unencrypted Ed25519 private key from a PEM file (PKCS8, as ``qcompiler keygen`` writes)."""
    path = Path(path)
    data = _read_key_file(path, "private key")
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError, UnsupportedAlgorithm) as e:
        raise SignatureError(
            "not a readable unencrypted PEM private key", file=str(path), field="key", expected="PKCS8 PEM", found=e
        ) from None
    if not isinstance(key, Ed25519PrivateKey):
        raise SignatureError(
            "wrong key type", file=str(path), field="key", expected=ALGORITHM, found=type(key).__name__
        )
    return key


def load_public_key(path: Path | str) -> Ed25519PublicKey:
    """An Ed25519 public key from a PEM file (SubjectPublicKeyInfo, as ``qcompiler keygen`` writes)."""
    path = Path(path)
    data = _read_key_file(path, "public key")
    try:
        key = serialization.load_pem_public_key(data)
    except (ValueError, TypeError, UnsupportedAlgorithm) as e:
        raise SignatureError(
            "not a readable PEM public key", file=str(path), field="key", expected="SubjectPublicKeyInfo PEM", found=e
        ) from None
    if not isinstance(key, Ed25519PublicKey):
        raise SignatureError(
            "wrong key type", file=str(path), field="key", expected=ALGORITHM, found=type(key).__name__
        )
    return key


# --------------------------------------------------------------------------- files


def write_atomic(
    dest: Path, data: bytes, *, private: bool = False, replace: bool = True, tmp_dir: Path | None = None
) -> None:
    """Write ``data`` to ``dest`` through a temp file in ``tmp_dir`` (default: ``dest``'s directory,
    which must be on the same filesystem): fsync, rename into place (or, without ``replace``, link
    into place so an existing file is never overwritten), fsync the directory."""
    prefix = dest.name if tmp_dir is None else f"{dest.parent.name}.{dest.name}"
    tmp = (tmp_dir or dest.parent) / f".{prefix}.tmp-{uuid.uuid4().hex[:12]}"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | NOFOLLOW | CLOEXEC, 0o600 if private else 0o644)
        try:
            if private:  # whatever the umask
                os.fchmod(fd, 0o600)
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        if replace:
            os.replace(tmp, dest)
        else:
            os.link(tmp, dest)
            os.unlink(tmp)
        fsync_dir(dest.parent)
    except FileExistsError:
        raise SignatureError("already exists (pass --force to replace it)", file=str(dest), field="path") from None
    except OSError as e:
        raise SignatureError("cannot be written", file=str(dest), field="path", found=e.strerror or str(e)) from None
    finally:
        if os.path.lexists(tmp):
            os.unlink(tmp)


def manifest_bytes(root: Path) -> bytes:
    """The exact bytes of ``root/manifest.json``, read under the artifact path policy."""
    try:
        return read_bounded(root, MANIFEST, MAX_JSON_BYTES)
    except PathError as e:
        raise SignatureError(e.message, file=e.file, field=e.field, expected=e.expected, found=e.found) from None


def has_signature(root: Path) -> bool:
    """Whether ``manifest.sig`` is present at all (a link or anything else counts: the reader judges it)."""
    return os.path.lexists(root / SIGNATURE)


def _fail(message: str, field: str, expected: object = "", found: object = "") -> SignatureError:
    return SignatureError(message, file=SIGNATURE, field=field, expected=expected, found=found)


def _hex64(record: dict[str, Any], field: str) -> str:
    value = record[field]
    if not isinstance(value, str) or not _HEX64.match(value):
        raise _fail("must be 64 lowercase hex digits", field, "a sha256 hex string", repr(value)[:80])
    return value


def read_signature(root: Path | str) -> dict[str, Any]:
    """``manifest.sig`` parsed and checked field by field (see the module docstring); the
    ``signature`` field is returned decoded, as 64 bytes."""
    root = Path(root)
    try:
        record = read_json(root, SIGNATURE, limit=MAX_SIGNATURE_BYTES)
    except FileError as e:
        raise SignatureError(e.message, file=e.file, field=e.field, expected=e.expected, found=e.found) from None
    if not isinstance(record, dict):
        raise _fail("must be a JSON object", "", "{" + ", ".join(sorted(FIELDS)) + "}", type(record).__name__)
    keys = frozenset(record)
    if keys != FIELDS:
        extra, missing = sorted(keys - FIELDS), sorted(FIELDS - keys)
        field = (extra or missing)[0]
        raise _fail("unknown field" if extra else "missing field", field, sorted(FIELDS), sorted(keys))
    fmt = record["format"]
    if not isinstance(fmt, int) or isinstance(fmt, bool) or fmt != FORMAT:
        raise _fail("unknown signature format", "format", FORMAT, repr(fmt))
    if record["algorithm"] != ALGORITHM:
        raise _fail("unknown algorithm", "algorithm", ALGORITHM, repr(record["algorithm"])[:80])
    encoded = record["signature"]
    if not isinstance(encoded, str):
        raise _fail("must be a base64 string", "signature", "base64 of 64 bytes", type(encoded).__name__)
    try:
        raw = base64.b64decode(encoded, validate=True)
    except (binascii.Error, ValueError):
        raise _fail("is not valid base64", "signature", "base64 of 64 bytes", repr(encoded)[:100]) from None
    if len(raw) != SIGNATURE_LEN:
        raise _fail("wrong length", "signature", f"{SIGNATURE_LEN} bytes", f"{len(raw)} bytes")
    if base64.b64encode(raw).decode() != encoded:
        raise _fail("is not canonical base64", "signature", base64.b64encode(raw).decode(), encoded)
    return {
        "algorithm": ALGORITHM,
        "format": FORMAT,
        "key_id": _hex64(record, "key_id"),
        "manifest_sha256": _hex64(record, "manifest_sha256"),
        "signature": raw,
    }


# --------------------------------------------------------------------------- sign and check


def sign_artifact(path: Path | str, private_key_path: Path | str) -> dict[str, Any]:
    """Sign an artifact that passes every reader gate: write ``manifest.sig`` (replacing an old one)
    over the exact bytes of its ``manifest.json``. Returns what was signed."""
    root = Path(path)
    key = load_private_key(private_key_path)
    if not root.is_dir():
        raise SignatureError("not an artifact directory", file=str(root))
    from qcompiler.artifact.output import OutputLock

    with OutputLock(root):  # no compile may swap the artifact while it is verified and signed
        return _sign_locked(root, key)


def _sign_locked(root: Path, key: Ed25519PrivateKey) -> dict[str, Any]:
    before = manifest_bytes(root)
    open_artifact(root)
    data = manifest_bytes(root)
    if data != before:
        raise SignatureError("changed while the artifact was verified; nothing was signed", file=MANIFEST)
    record = {
        "algorithm": ALGORITHM,
        "format": FORMAT,
        "key_id": key_id(key.public_key()),
        "manifest_sha256": hashlib.sha256(data).hexdigest(),
        "signature": base64.b64encode(key.sign(data)).decode(),
    }
    text = (json.dumps(record, indent=2, sort_keys=True) + "\n").encode()
    # The temp file goes beside the artifact: the reader refuses any unlisted file inside it.
    write_atomic(root / SIGNATURE, text, tmp_dir=root.resolve().parent)
    return {"path": str(root), "signature": SIGNATURE, **{k: record[k] for k in ("key_id", "manifest_sha256")}}


def check_signature(path: Path | str, public_key_path: Path | str) -> dict[str, Any]:
    """Check ``manifest.sig`` against a trusted public key. Returns a JSON-able dict whose ``status``
    is ``valid``, ``invalid`` (malformed, another manifest, or a bad signature), ``unsigned`` or
    ``untrusted-key`` (signed by another key), with ``ok`` and, unless valid, ``error``. A key
    file that cannot be used raises ``SignatureError``."""
    root = Path(path)
    trusted = load_public_key(public_key_path)
    out: dict[str, Any] = {"status": "invalid", "key_id": None, "trusted_key_id": key_id(trusted), "ok": False}
    try:
        if not root.is_dir():
            raise SignatureError("not an artifact directory", file=str(root))
        if not has_signature(root):
            out["status"] = "unsigned"
            raise _fail("missing: the artifact is unsigned", "path", "a signature by the trusted key", "no file")
        record = read_signature(root)
        out["key_id"] = record["key_id"]
        if record["key_id"] != out["trusted_key_id"]:
            out["status"] = "untrusted-key"
            raise _fail("signed by another key", "key_id", out["trusted_key_id"], record["key_id"])
        data = manifest_bytes(root)
        digest = hashlib.sha256(data).hexdigest()
        out["manifest_sha256"] = digest
        if record["manifest_sha256"] != digest:
            raise _fail(f"signed another {MANIFEST}", "manifest_sha256", record["manifest_sha256"], digest)
        try:
            trusted.verify(record["signature"], data)
        except InvalidSignature:
            raise _fail(f"does not verify over {MANIFEST} with the trusted key", "signature") from None
    except QcError as e:
        out["error"] = str(e)
        return out
    out.update(status="valid", ok=True)
    return out


def describe_signature(path: Path | str) -> dict[str, Any]:
    """Without a trusted key nothing cryptographic is checked: ``unsigned``, or ``unchecked`` (signed
    by the key ``key_id``, not checked), or ``invalid`` when ``manifest.sig`` is malformed."""
    root = Path(path)
    if not has_signature(root):
        return {"status": "unsigned", "key_id": None, "ok": True, "note": "unsigned"}
    try:
        record = read_signature(root)
    except SignatureError as e:
        return {"status": "invalid", "key_id": None, "ok": False, "error": str(e)}
    note = f"signed by key {record['key_id']}, not checked (no --trusted-key)"
    return {"status": "unchecked", "key_id": record["key_id"], "ok": True, "note": note}


def signature_report(path: Path | str, trusted_key: Path | str | None = None) -> dict[str, Any]:
    """What ``verify`` reports under ``signature``: ``check_signature`` with a key, else ``describe_signature``."""
    return describe_signature(path) if trusted_key is None else check_signature(path, trusted_key)
