"""Byte-level and file-level mutators of ``bench/fuzz.py``: flips, overwrites, truncations and
insertions in any file; deleting a file, adding an unlisted one, replacing one by a symbolic or hard
link to a file outside the artifact, a directory link, a FIFO, an empty directory."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from fuzz_mutators import MANIFEST, Ctx, Mutation, files_of, write_text

INTERESTING_BYTES = [
    b"\x00",
    b"\xff",
    b"\x7f",
    b"\x80",
    b"\x00" * 8,
    b"\xff" * 8,
    (2**63).to_bytes(8, "little"),
    (2**31).to_bytes(4, "little"),
    b"\x01\x00\x00\x00",
    b"{",
    b'"',
    b"\n",
]


def pick_file(ctx: Ctx, with_manifest: bool = False) -> str:
    """A file to mutate, the containers twice as likely as the rest."""
    files = [f for f in files_of(ctx.root) if with_manifest or f != MANIFEST]
    heavy = [f for f in files if f.endswith((".safetensors", ".gguf", ".onnx", ".data"))]
    return ctx.rng.choice(files + heavy)


def offset_in(ctx: Ctx, size: int) -> int:
    """A byte offset, biased to the first 4 KiB (headers, metadata, tensor infos)."""
    if size <= 1:
        return 0
    if ctx.rng.random() < 0.6:
        return ctx.rng.randrange(min(size, 4096))
    return ctx.rng.randrange(size)


def bytes_mutator(ctx: Ctx) -> Mutation:
    """One raw edit of any file but the manifest: bit flip, overwrite, truncate, insert, append, empty."""
    rel = pick_file(ctx)
    path = ctx.root / rel
    data = bytearray(path.read_bytes())
    rng = ctx.rng
    op = rng.choice(["flip", "flip", "overwrite", "truncate", "insert", "append", "zero", "empty"])
    at = offset_in(ctx, len(data))
    region = region_of(rel, bytes(data), at)
    if op == "flip" and data:
        bit = rng.randrange(8)
        data[at] ^= 1 << bit
        detail = f"bit {bit} of byte {at} flipped"
    elif op == "overwrite" and data:
        new = rng.choice(INTERESTING_BYTES)
        data[at : at + len(new)] = new
        detail = f"bytes {at}..{at + len(new)} := {new.hex()}"
    elif op == "truncate":
        keep = rng.choice([at, len(data) - 1, len(data) - rng.randrange(1, 64), 8])
        keep = max(0, min(len(data), keep))
        detail, region = f"truncated to {keep} of {len(data)} bytes", region_of(rel, bytes(data), keep)
        del data[keep:]
    elif op == "insert":
        new = rng.choice(INTERESTING_BYTES)
        data[at:at] = new
        detail = f"{new.hex()} inserted at {at}"
    elif op == "append":
        new = rng.choice([b"\x00", b"\x00" * 32, os.urandom(0) + bytes(rng.randrange(256) for _ in range(17))])
        data += new
        detail, region = f"{len(new)} bytes appended", "end"
    elif op == "zero" and data:
        n = rng.choice([1, 16, 256, 4096])
        data[at : at + n] = bytes(len(data[at : at + n]))
        detail = f"{n} bytes zeroed at {at}"
    else:
        data = bytearray()
        detail, region = "emptied", "whole file"
    path.write_bytes(bytes(data))
    return Mutation("bytes", rel, f"{rel} {op} in {region}", detail)


def region_of(rel: str, data: bytes, at: int) -> str:
    """Which part of a container an offset falls in: a header, a tensor's data, padding."""
    if rel.endswith(".safetensors") and len(data) >= 8:
        n = int.from_bytes(data[:8], "little")
        if at < 8:
            return "header length"
        return "header JSON" if at < 8 + n else "tensor data"
    if rel.endswith(".gguf"):
        from fuzz_formats import gguf_region

        return gguf_region(data, at)
    if rel.endswith(".onnx"):
        return "protobuf"
    if rel.endswith(".data"):
        return "external data"
    return "text"


UNLISTED = [
    "extra.bin",
    "kernels/extra.py",
    "model.safetensors.index.json",
    "model-00002-of-00002.safetensors",
    "manifest.sig",
    ".hidden",
    "sub/dir/file.txt",
    "graph.qir.bak",
    "Graph.qir",
    "manifest.json.tmp",
]


def file_mutator(ctx: Ctx) -> Mutation:
    """One file-level change to the artifact directory."""
    rng = ctx.rng
    op = rng.choice(["delete", "add", "add", "symlink", "symlink", "hardlink", "dirlink", "fifo", "emptydir", "rename"])
    files = [f for f in files_of(ctx.root) if f != MANIFEST]
    rel = rng.choice(files)
    path = ctx.root / rel
    ctx.outside.mkdir(parents=True, exist_ok=True)
    if op == "delete":
        rel = rng.choice([*files, MANIFEST])
        (ctx.root / rel).unlink()
        return Mutation("file", rel, f"delete {kind_of(rel)}", f"{rel} deleted")
    if op == "add":
        name = rng.choice(UNLISTED)
        (ctx.root / name).parent.mkdir(parents=True, exist_ok=True)
        content = rng.choice([b"", b"{}", path.read_bytes(), b"\x00" * 64])
        (ctx.root / name).write_bytes(content)
        return Mutation("file", name, "add a file no reader expects", f"{name} added ({len(content)} bytes)")
    if op == "symlink":
        same = rng.random() < 0.5
        outside = ctx.outside / Path(rel).name
        data = path.read_bytes()
        outside.write_bytes(data if same else data[::-1])
        path.unlink()
        depth = len(Path(rel).parts)
        os.symlink(os.path.join(*[".."] * depth, ctx.outside.name, outside.name), path)
        what = "same" if same else "other"
        return Mutation("file", rel, f"symlink outside ({what} bytes)", f"{rel} -> outside copy ({what} bytes)")
    if op == "hardlink":
        outside = ctx.outside / Path(rel).name
        shutil.copyfile(path, outside)
        path.unlink()
        os.link(outside, path)
        return Mutation("file", rel, "hard link to outside", f"{rel} hard-linked to a file outside (same bytes)")
    if op == "dirlink":
        return dirlink(ctx, rel)
    if op == "fifo":
        path.unlink()
        os.mkfifo(path)
        return Mutation("file", rel, f"fifo replaces {kind_of(rel)}", f"{rel} replaced by a FIFO")
    if op == "emptydir":
        name = rng.choice(["empty", "kernels/sub", "graph.qir.d"])
        (ctx.root / name).mkdir(parents=True, exist_ok=True)
        return Mutation("file", name, "add empty directory", f"{name}/ added")
    new = str(Path(rel).with_name(path.name.upper() if rng.random() < 0.5 else path.name + " "))
    path.rename(ctx.root / new)
    return Mutation("file", rel, f"rename {kind_of(rel)}", f"{rel} renamed to {new!r}")


def dirlink(ctx: Ctx, rel: str) -> Mutation:
    """``kernels/`` (or a new folder) as a link to a copy of it outside the artifact."""
    kernels = ctx.root / "kernels"
    if kernels.is_dir() and ctx.rng.random() < 0.7:
        shutil.copytree(kernels, ctx.outside / "kernels")
        shutil.rmtree(kernels)
        os.symlink(os.path.join("..", ctx.outside.name, "kernels"), kernels)
        return Mutation("file", "kernels", "kernels/ is a directory link", "kernels/ -> outside copy")
    (ctx.outside / "d").mkdir(exist_ok=True)
    shutil.copyfile(ctx.root / rel, ctx.outside / "d" / Path(rel).name)
    os.symlink(os.path.join("..", ctx.outside.name, "d"), ctx.root / "linked")
    return Mutation("file", "linked", "directory link to outside", f"linked/ -> outside folder holding {rel}")


def kind_of(rel: str) -> str:
    return "kernel source" if rel.startswith("kernels/") and rel.endswith(".py") else rel


def kernel_source_mutator(ctx: Ctx) -> Mutation:
    """An edit of a generated triton kernel's source (the reader compares it with the codegen)."""
    rng = ctx.rng
    rel = rng.choice([f for f in files_of(ctx.root) if f.startswith("kernels/") and f.endswith(".py")])
    path = ctx.root / rel
    text = path.read_text()
    lines = text.split("\n")
    i = rng.randrange(len(lines))
    op = rng.choice(["append", "constant", "delete", "whitespace", "bom"])
    if op == "append":
        text += rng.choice(["\nimport os\n", "\n# comment\n", "\n"])
    elif op == "constant":
        text = text.replace("32", "16", 1) if "32" in text else text + " "
    elif op == "delete":
        del lines[i]
        text = "\n".join(lines)
    elif op == "whitespace":
        text = text.replace("\n", "\r\n", 1)
    else:
        text = "\ufeff" + text
    write_text(path, text)
    return Mutation("kernel-src", rel, f"kernel source {op}", f"{rel}: {op} (line {i + 1})")
