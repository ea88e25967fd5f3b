"""Our safetensors writer and strict reader against the reference ``safetensors`` package, run in the
same process on the same synthetic fp16 tensors (2048x2048, seeded). Writes: ``serialize`` streamed with
``f.write`` vs ``safetensors.numpy.save_file``, and the transactional ``ArtifactWriter`` (fsync + sha256 +
manifest + atomic publish) vs ``save_file`` followed by an fsync. Reads (page cache warm): ``open_file`` +
``.array`` (mmap, strict gates) vs ``safe_open(path, "np")`` + ``get_tensor``, lazily and with every byte
touched, and the header open alone. Prints the best of ``--repeat`` runs, MB/s (10^6 bytes per second), the
speed ratio ours/peer (above 1: ours is faster), the heap bytes each reader's arrays hold (tracemalloc: mmap'd
file pages are not heap), and the process-wide peak RSS.

    python bench/safetensors_io.py [--mib 256] [--repeat 3]
"""

from __future__ import annotations

import argparse
import filecmp
import hashlib
import os
import resource
import shutil
import tempfile
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
from rich.console import Console
from rich.table import Table
from safetensors import safe_open
from safetensors.numpy import save_file

from qcompiler.artifact.writer import ArtifactWriter
from qcompiler.backends.safetensors.container import open_file
from qcompiler.backends.safetensors.container_write import TensorBytes, serialize

Row = tuple[str, Callable[[], object], Callable[[], object] | None, Callable[[], object], int]
OPENS = 200  # header-only opens per timed run: one is too short to time


def best(fn: Callable[[], object], setup: Callable[[], object], repeat: int, heap: bool) -> tuple[float, int]:
    """Best-of-``repeat`` seconds; with ``heap``, the Python-heap bytes one more run's result holds."""
    times: list[float] = []
    for _ in range(repeat):
        setup()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    if not heap:
        return min(times), 0
    tracemalloc.start()  # sees numpy and bytearray allocations, not mmap'd file pages
    result = fn()
    held = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    del result
    return min(times), held


def touch(arrays: list[npt.NDArray[Any]]) -> list[npt.NDArray[Any]]:
    for a in arrays:
        int(a.view(np.uint8).max())  # reads every byte
    return arrays


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=int, default=256, help="total size, in 8 MiB tensors (default 256)")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    count = max(1, args.mib // 8)
    arrays: dict[str, npt.NDArray[Any]] = {
        f"layers.{i}.weight": rng.standard_normal((2048, 2048), dtype=np.float32).astype(np.float16)
        for i in range(count)
    }
    total = sum(a.nbytes for a in arrays.values())

    def tensors() -> list[TensorBytes]:
        return [TensorBytes(k, "F16", a.shape, a.data) for k, a in arrays.items()]

    with tempfile.TemporaryDirectory() as tmp:
        peer_path, ours_path, dest = Path(tmp, "peer.safetensors"), Path(tmp, "ours.safetensors"), Path(tmp, "art")
        read_path = Path(tmp, "read.safetensors")  # written once by the peer, read by both readers

        def clean() -> None:  # outside the timing: no old file to truncate, no dirty pages left behind
            peer_path.unlink(missing_ok=True)
            ours_path.unlink(missing_ok=True)
            shutil.rmtree(dest, ignore_errors=True)
            os.sync()

        def ours_write() -> None:
            with ours_path.open("wb") as f:
                for chunk in serialize(tensors()):
                    f.write(chunk)

        def ours_publish() -> None:
            with ArtifactWriter(dest) as w:
                w.write_file("model.safetensors", serialize(tensors()))
                w.publish({"schema": 1})

        def peer_fsync() -> None:
            save_file(arrays, peer_path)
            with peer_path.open("rb") as f:
                os.fsync(f.fileno())

        def sha256() -> str:
            digest = hashlib.sha256()
            for a in arrays.values():
                digest.update(a.data)
            return digest.hexdigest()

        def ours_lazy() -> list[npt.NDArray[Any]]:
            st = open_file(read_path)
            return [st.array(name) for name in st.tensors]

        def peer_lazy() -> list[npt.NDArray[Any]]:
            with safe_open(read_path, "np") as f:
                return [f.get_tensor(name) for name in f.keys()]  # noqa: SIM118 (safe_open is not a dict)

        def ours_open() -> None:
            for _ in range(OPENS):
                open_file(read_path)

        def peer_open() -> None:
            for _ in range(OPENS):
                with safe_open(read_path, "np"):
                    pass

        def nothing() -> None:
            pass

        rows: list[Row] = [
            ("write, no fsync", ours_write, lambda: save_file(arrays, peer_path), clean, 1),
            ("write + fsync (ours: + sha256, publish)", ours_publish, peer_fsync, clean, 1),
            ("sha256 of the bytes alone", sha256, None, nothing, 1),
            ("read lazy", ours_lazy, peer_lazy, nothing, 1),
            ("read + touch every byte", lambda: touch(ours_lazy()), lambda: touch(peer_lazy()), nothing, 1),
            ("open header alone, per open", ours_open, peer_open, nothing, OPENS),
        ]
        ours_write()
        save_file(arrays, read_path)
        assert filecmp.cmp(ours_path, read_path, shallow=False), "writers disagree: the comparison would be unfair"
        table = Table(title=f"{count} x 2048x2048 F16 = {total / 2**20:.0f} MiB, best of {args.repeat}")
        for col in ("operation", "ours", "ours MB/s", "peer", "peer MB/s", "speed ours/peer", "heap held ours | peer"):
            table.add_column(col, justify="left" if col == "operation" else "right")
        for label, ours, peer, setup, per in rows:
            heap = label.startswith("read")
            t_ours, h_ours = best(ours, setup, args.repeat, heap)
            t_peer, h_peer = best(peer, setup, args.repeat, heap) if peer else (float("nan"), 0)
            scale, unit = (1e6, "µs") if per > 1 else (1e3, "ms")
            table.add_row(
                label,
                f"{t_ours / per * scale:,.1f} {unit}",
                "" if per > 1 else f"{total / t_ours / 1e6:,.0f}",
                f"{t_peer / per * scale:,.1f} {unit}" if peer else "",
                "" if per > 1 or not peer else f"{total / t_peer / 1e6:,.0f}",
                f"{t_peer / t_ours:.2f}x" if peer else "",
                f"{h_ours / 2**20:.0f} | {h_peer / 2**20:.0f} MiB" if heap else "",
            )
    Console(width=132).print(table)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"peak RSS, process-wide (includes the {total / 2**20:.0f} MiB of source arrays): {peak:.0f} MiB")


if __name__ == "__main__":
    main()
