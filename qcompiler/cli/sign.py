"""qcompiler sign PATH --key PRIVATE.pem [--json]: sign an artifact that passes every reader gate, writing
manifest.sig (an Ed25519 signature over manifest.json's exact bytes, which list every file by sha256).
qcompiler keygen --out-private P --out-public Q [--force]: make an Ed25519 key pair (private key PKCS8
PEM, mode 0600; public key SubjectPublicKeyInfo PEM). Check with: qcompiler verify PATH --trusted-key Q.
See docs/signing.md."""

from __future__ import annotations

import argparse
import json
import sys

KEYGEN = "keygen"


def add_arguments(p: argparse.ArgumentParser) -> None:
    """``sign`` and ``keygen`` share this module; the parser's name says which one is being built."""
    if p.prog.rsplit(" ", 1)[-1] == KEYGEN:
        p.add_argument("--out-private", required=True, help="where to write the private key (PEM, mode 0600)")
        p.add_argument("--out-public", required=True, help="where to write the public key (PEM)")
        p.add_argument("--force", action="store_true", help="replace existing key files")
        return
    p.add_argument("path", help="artifact directory")
    p.add_argument("--key", required=True, help="Ed25519 private key (PEM, from qcompiler keygen)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")


def run(args: argparse.Namespace) -> int:
    """Run ``sign`` or ``keygen`` (``args.command``); errors are typed and printed by the entry point."""
    from qcompiler.artifact.signing import generate_keys, sign_artifact

    if args.command == KEYGEN:
        kid = generate_keys(args.out_private, args.out_public, force=args.force)
        sys.stdout.write(f"wrote private key {args.out_private} (keep it secret) and public key {args.out_public}\n")
        sys.stdout.write(f"key id {kid}\n")
        return 0
    result = sign_artifact(args.path, args.key)
    if args.json:
        sys.stdout.write(json.dumps(result, indent=2) + "\n")
    else:
        sys.stdout.write(f"signed {result['path']} with key {result['key_id']}\n")
        sys.stdout.write(f"manifest.json sha256 {result['manifest_sha256']}\n")
    return 0
