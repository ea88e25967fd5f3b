"""Our safetensors writer and strict reader against the reference ``safetensors`` package, run in the
same process on the same synthetic fp16 tensors (2048x2048, seeded). Writes: ``serialize`` streamed with
``f.write`` vs ``safetensors.numpy.save_file``, and the transactional ``ArtifactWriter`` (fsync + sha256 +
manifest + atomic publish) vs ``save_file`` followed by an fsync. Reads (page cache warm): ``open_file`` +
``.array`` (mmap, strict gates) vs ``safe_open(path, "np")`` + ``get_tensor``, lazily and with every byte
touched, and the header open alone. Prints the best of ``--repeat`` runs, MB/s (10^6 bytes per second), the
speed ratio ours/peer (above 1: ours is faster), the RSS each reader still holds with its arrays alive, and
the process-wide peak RSS.

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

Arrays = dict[str, npt.NDArray[Any]]
OPENS = 200  # header-only opens per timed run: one is too short to time


def rss() -> int:
    """Resident bytes now (Linux), 0 where /proc is missing."""
    try:
        return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


def best(fn: Callable[[], object], setup: Callable[[], object], repeat: int) -> tuple[float, int]:
    """Best-of-``repeat`` seconds, and the RSS growth while the last run's result is still alive."""
    times: list[float] = []
    held = 0
    for _ in range(repeat):
        setup()
        before = rss()
        t0 = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - t0)
        held = rss() - before
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
    arrays: Arrays = {
        f"layers.{i}.weight": rng.standard_normal((2048, 2048), dtype=np.float32).astype(np.float16)
        for i in range(count)
    }
    total = sum(a.nbytes for a in arrays.values())

    def tensors() -> list[TensorBytes]:
        return [TensorBytes(k, "F16", a.shape, memoryview(a)) for k, a in arrays.items()]

    with tempfile.TemporaryDirectory() as tmp:
        peer_path, ours_path, dest = Path(tmp, "peer.safetensors"), Path(tmp, "ours.safetensors"), Path(tmp, "art")

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
                digest.update(memoryview(a).cast("B"))
            return digest.hexdigest()

        def ours_lazy() -> list[npt.NDArray[Any]]:
            st = open_file(peer_path)
            return [st.array(name) for name in st.tensors]

        def peer_lazy() -> list[npt.NDArray[Any]]:
            with safe_open(peer_path, "np") as f:
                return [f.get_tensor(name) for name in f.keys()]

        def ours_open() -> None:
            for _ in range(OPENS):
                open_file(peer_path)

        def peer_open() -> None:
            for _ in range(OPENS):
                with safe_open(peer_path, "np"):
                    pass

        def nothing() -> None:
            pass

        Pair = tuple[Callable[[], object], Callable[[], object] | None, Callable[[], object], int]
        rows: dict[str, Pair] = {
            "write, page cache (serialize + f.write | save_file)": (ours_write, lambda: save_file(arrays, peer_path), clean, 1),
            "write + fsync (ArtifactWriter: sha256, manifest, publish | save_file + fsync)": (ours_publish, peer_fsync, clean, 1),
            "sha256 of the tensor bytes alone (ArtifactWriter's hashing)": (sha256, None, nothing, 1),
            "read lazy (open_file + .array | safe_open + get_tensor)": (ours_lazy, peer_lazy, nothing, 1),
            "read + touch every byte": (lambda: touch(ours_lazy()), lambda: touch(peer_lazy()), nothing, 1),
            f"header open alone, per open, best of {OPENS} (open_file | safe_open)": (ours_open, peer_open, nothing, OPENS),
        }  # fmt: skip
        ours_write()
        save_file(arrays, peer_path)
        assert filecmp.cmp(ours_path, peer_path, shallow=False), "writers disagree: the comparison would be unfair"
        table = Table(
            title=f"safetensors I/O, {count} x 2048x2048 F16 = {total / 2**20:.0f} MiB, best of {args.repeat}"
        )
        for col in ("operation", "ours", "ours MB/s", "peer", "peer MB/s", "speed ours/peer", "RSS held ours | peer"):
            table.add_column(col, justify="left" if col == "operation" else "right")
        for label, (ours, peer, setup, per) in rows.items():
            t_ours, held_ours = best(ours, setup, args.repeat)
            t_peer, held_peer = best(peer, setup, args.repeat) if peer else (float("nan"), 0)
            unit = (1e6, "µs") if per > 1 else (1e3, "ms")
            rate = "" if per > 1 else f"{total / t_ours / 1e6:,.0f}"
            table.add_row(
                label,
                f"{t_ours / per * unit[0]:,.1f} {unit[1]}",
                rate,
                f"{t_peer / per * unit[0]:,.1f} {unit[1]}" if peer else "",
                "" if per > 1 or not peer else f"{total / t_peer / 1e6:,.0f}",
                f"{t_peer / t_ours:.2f}x" if peer else "",
                f"{held_ours / 2**20:.0f} | {held_peer / 2**20:.0f} MiB" if peer else "",
            )
    Console().print(table)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(
        f"peak RSS of this process: {peak:.0f} MiB (process-wide: includes the {total / 2**20:.0f} MiB of source arrays)"
    )


if __name__ == "__main__":
    main()
