"""Refusing hostile headers: our strict readers against their peers on the same bytes, in the same process.

The files claim huge counts or sizes, as in the tests that check we refuse them without allocating
(``test_gguf_reader.py``, ``test_safetensors_container.py``); how fast is measured here, never in a test.
Ours: ``open_gguf``, ``open_file`` (each must raise its typed error; a valid file is the baseline row).
Peers: gguf-py's ``GGUFReader``, ``safetensors``' ``safe_open(path, "np")``: an exception is caught and
named, a call still running after ``--limit`` s is stopped. Per open: best of ``--repeat`` x ``--opens``;
speed ours/peer is the peer's time over ours (above 1: ours is faster).

    python bench/reject_huge_headers.py [--opens 200] [--repeat 5] [--limit 5]
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import struct
import tempfile
from collections.abc import Callable
from pathlib import Path
from types import FrameType

import gguf
from rich.console import Console
from rich.table import Table
from safetensors import safe_open
from safetensors_io import best  # bench/ is sys.path[0] when run as a script

from qcompiler.backends.gguf.reader import GGUFError, open_gguf
from qcompiler.backends.safetensors.container import ContainerError, open_file

V = gguf.GGUFValueType


u32, u64 = struct.Struct("<I").pack, struct.Struct("<Q").pack


def gstr(text: str) -> bytes:
    return u64(len(text)) + text.encode()


def kv(key: str, vtype: int, payload: bytes) -> bytes:
    return gstr(key) + u32(vtype) + payload


ARCH = kv("general.architecture", V.STRING, gstr("llama"))
INFO = gstr("a") + u32(1) + u64(8) + u32(0) + u64(0)  # F32 tensor "a" of 8 elements at offset 0


def gguf_file(tensors: int = 1, kvs: int = 1, body: bytes = ARCH + INFO) -> bytes:
    """A GGUF v3 file: header, ``body`` (key-values then tensor infos), padding to 32, 32 data bytes."""
    head = b"GGUF" + u32(3) + u64(tensors) + u64(kvs) + body
    return head + bytes(-len(head) % 32) + bytes(32)


def st_file(header: bytes, data: bytes = bytes(4), n: int | None = None) -> bytes:
    return u64(len(header) if n is None else n) + header + data


ST_ENTRY = '{"t":{"dtype":"F32","shape":%s,"data_offsets":[0,4]}}'
GGUF_CASES = {
    "valid (baseline)": gguf_file(),
    "tensor count 2^62": gguf_file(tensors=2**62),
    "kv count 2^62": gguf_file(kvs=2**62),
    "key length 2^62": gguf_file(body=u64(2**62) + b"k"),
    "string array 2^30": gguf_file(kvs=2, body=ARCH + kv("x.a", V.ARRAY, u32(V.STRING) + u64(2**30)) + INFO),
    "tensor name length 2^62": gguf_file(body=ARCH + u64(2**62) + b"a"),
}
ST_CASES = {
    "valid (baseline)": st_file((ST_ENTRY % "[1]").encode()),
    "header length 2^63": st_file(b"{}", b"", n=2**63),
    "shape 2^40 x 2^40": st_file((ST_ENTRY % f"[{2**40},{2**40}]").encode()),
}


def verdict(fn: Callable[[], object], limit: float) -> str:
    """What one call does: ``accepted``, the exception's type name, or ``stopped`` after ``limit`` s."""

    def stop(signum: int, frame: FrameType | None) -> None:
        raise TimeoutError  # gguf-py is Python: the signal lands between its bytecodes

    previous = signal.signal(signal.SIGALRM, stop)
    signal.setitimer(signal.ITIMER_REAL, limit)
    try:
        fn()
    except TimeoutError:
        return "stopped"
    except Exception as e:
        return type(e).__name__
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    return "accepted"


def per_open(fn: Callable[[], object], opens: int, repeat: int) -> float:
    """Best-of-``repeat`` seconds for one call, timed over ``opens`` calls (one is too short to time)."""

    def many() -> None:
        for _ in range(opens):
            with contextlib.suppress(Exception):  # the refusal is the work being timed
                fn()

    return best(many, lambda: None, repeat, heap=False)[0] / opens


Reader = tuple[str, dict[str, bytes], Callable[[Path], object], Callable[[Path], object], type[Exception]]
READERS: list[Reader] = [
    ("gguf", GGUF_CASES, open_gguf, gguf.GGUFReader, GGUFError),
    ("safetensors", ST_CASES, open_file, lambda p: safe_open(p, "np"), ContainerError),  # dropped: closed
]


def row(reader: Reader, name: str, path: Path, args: argparse.Namespace) -> tuple[str, ...]:
    """One table row; fails if our reader does not do what the case expects (refuse, or accept the baseline)."""
    fmt, _, ours, peer, refusal = reader
    ours_says, peer_says = verdict(lambda: ours(path), args.limit), verdict(lambda: peer(path), args.limit)
    expected = "accepted" if name.startswith("valid") else refusal.__name__
    assert ours_says == expected, f"{fmt} {name}: ours says {ours_says}, expected {expected}"
    t_ours = per_open(lambda: ours(path), args.opens, args.repeat)
    t_peer = float("nan") if peer_says == "stopped" else per_open(lambda: peer(path), args.opens, args.repeat)
    peer_time = f"> {args.limit:g} s" if peer_says == "stopped" else f"{t_peer * 1e6:,.1f} µs"
    ratio = "-" if peer_says == "stopped" else f"{t_peer / t_ours:.2f}x"
    return fmt, name, f"{t_ours * 1e6:,.1f} µs", ours_says, peer_time, peer_says, ratio


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--opens", type=int, default=200)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--limit", type=float, default=5.0, help="seconds before a peer call is stopped")
    args = parser.parse_args()
    table = Table(title=f"refusing hostile headers, per open, best of {args.repeat} x {args.opens} opens")
    for col in ("format", "file", "ours", "ours says", "peer", "peer says", "speed ours/peer"):
        table.add_column(col, justify="left" if col in ("format", "file") else "right")
    with tempfile.TemporaryDirectory() as tmp:
        for reader in READERS:
            for i, (name, data) in enumerate(reader[1].items()):
                path = Path(tmp, f"{reader[0]}-{i}")
                path.write_bytes(data)
                table.add_row(*row(reader, name, path, args))
    Console(width=132).print(table)


if __name__ == "__main__":
    main()
