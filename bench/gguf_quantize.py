"""GGUF quantize, pack and write: ours against gguf-py and llama.cpp's C, in the same process on the same
float32 tensors (``--count`` N(0,1) matrices of ``--n`` x ``--n``, seeded), for Q8_0, Q4_0, Q4_K, Q6_K.

- ours: ``get_codec(t).quantize`` alone, and then ``serialize`` (our GGUF writer) streamed to a file;
- gguf-py: ``gguf.quants.quantize`` alone, and then ``GGUFWriter`` (Q8_0 and Q4_0: no K-quant quantizer);
- C: ``ggml_quantize_chunk`` from llama-cpp-python's ``libggml-base`` (one thread, quantize only), and
  ``llama_model_quantize`` (1 and 2 threads, ``pure``: every weight in the type asked, Q4_K from the
  Q4_K_M ftype) on an F32 llama-shaped GGUF written by our writer: one layer per 4 matrices (GQA k/v of
  n/4 rows, n_ff n/2), so its weights hold ``--count`` x n x n floats, plus a 256-token ``token_embd``.

MB/s is 10^6 bytes per second of float32 input (for ``llama_model_quantize``: of the tensors it quantized).
Ratios are peer time / our time (above 1: ours is faster): ours/gguf-py compares the +write paths, ours/C
the quantizers alone. Best of ``--repeat``. Our bytes are compared with ggml's, gguf-py's and
``llama_model_quantize``'s (on the tensors placed in its model); a mismatch fails after the table.

    python bench/gguf_quantize.py [--n 2048] [--count 4] [--repeat 3]
"""

from __future__ import annotations

import argparse
import ctypes
import resource
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import llama_cpp
import numpy as np
import numpy.typing as npt
from gguf import quants
from rich.console import Console
from rich.table import Table

from qcompiler.backends.gguf.codecs import get_codec
from qcompiler.backends.gguf.ggml_types import GGMLType, row_bytes
from qcompiler.backends.gguf.writer import KV, TensorPayload, serialize

Array = npt.NDArray[Any]
TYPES = (GGMLType.Q8_0, GGMLType.Q4_0, GGMLType.Q4_K, GGMLType.Q6_K)
GGUF_PY = (GGMLType.Q8_0, GGMLType.Q4_0)
FTYPE: dict[GGMLType, int] = {t: getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{t.name}") for t in GGUF_PY + TYPES[3:]}
FTYPE[GGMLType.Q4_K] = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M  # with pure=True: every weight Q4_K, no Q6_K mix
VOCAB = 256


def ggml_base() -> ctypes.CDLL:
    lib = ctypes.CDLL(str(Path(llama_cpp.__file__).parent / "lib" / "libggml-base.so"))
    lib.ggml_quantize_chunk.restype = ctypes.c_size_t
    lib.ggml_quantize_chunk.argtypes = [ctypes.c_int, *[ctypes.c_void_p] * 2, *[ctypes.c_int64] * 3, ctypes.c_void_p]
    return lib


def c_chunk(lib: ctypes.CDLL, t: GGMLType, x: Array) -> Array:
    dst = np.empty((x.shape[0], row_bytes(t, x.shape[1])), dtype=np.uint8)
    size = lib.ggml_quantize_chunk(int(t), x.ctypes.data, dst.ctypes.data, 0, x.shape[0], x.shape[1], None)
    assert size == dst.size
    return dst


def write(path: Path, kvs: list[KV], tensors: list[TensorPayload]) -> None:
    with path.open("wb") as f:
        for chunk in serialize(kvs, tensors):
            f.write(chunk)


def llama_f32(xs: list[Array], n: int, rng: np.random.Generator) -> tuple[list[KV], list[TensorPayload], list[str]]:
    """An F32 llama GGUF whose first attn_q/attn_output are the bench tensors, and the names they got."""
    layers, heads = max(1, len(xs) // 4), max(4, n // 128)
    u32 = {"context_length": 2048, "embedding_length": n, "block_count": layers, "feed_forward_length": n // 2}
    u32 |= {"attention.head_count": heads, "attention.head_count_kv": heads // 4, "vocab_size": VOCAB}
    kvs = [KV.string("general.architecture", "llama"), *[KV.u32(f"llama.{k}", v) for k, v in u32.items()]]
    kvs += [KV.f32("llama.attention.layer_norm_rms_epsilon", 1e-5), KV.string("tokenizer.ggml.model", "none")]
    mats, placed = iter(xs), list[str]()

    def w(name: str, shape: tuple[int, ...], a: Array | None = None) -> TensorPayload:
        a = np.ones(shape, np.float32) if len(shape) == 1 else a
        placed.extend([name] if a is not None and len(shape) == 2 else [])
        a = rng.standard_normal(shape, dtype=np.float32) if a is None else a
        return TensorPayload(name, shape, int(GGMLType.F32), a.data)

    tensors = [w("token_embd.weight", (VOCAB, n)), w("output_norm.weight", (n,))]
    for i in range(layers):
        tensors += [w(f"blk.{i}.attn_{p}.weight", (n, n), next(mats, None)) for p in ("q", "output")]
        tensors += [w(f"blk.{i}.attn_k.weight", (n // 4, n)), w(f"blk.{i}.attn_v.weight", (n // 4, n))]
        tensors += [w(f"blk.{i}.ffn_{p}.weight", (n // 2, n)) for p in ("gate", "up")]
        tensors += [w(f"blk.{i}.ffn_down.weight", (n, n // 2))]
        tensors += [w(f"blk.{i}.{p}_norm.weight", (n,)) for p in ("attn", "ffn")]
    return kvs, tensors, placed


@dataclass(frozen=True)
class Bench:
    xs: list[Array]
    repeat: int
    lib: ctypes.CDLL
    tmp: Path
    placed: list[str]

    def time(self, fn: Callable[[], object], clean: bool = False) -> float:
        """Best-of-``repeat`` seconds; with ``clean``, the output files are removed first (untimed)."""
        times: list[float] = []
        for _ in range(self.repeat):
            for out in self.tmp.glob("out-*.gguf") if clean else []:
                out.unlink()
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return min(times)

    def ours_write(self, t: GGMLType) -> None:
        codec = get_codec(t)
        ts = [TensorPayload(f"w.{i}", x.shape, int(t), codec.quantize(x).data) for i, x in enumerate(self.xs)]
        write(self.tmp / "out-ours.gguf", [KV.string("general.architecture", "llama")], ts)

    def peer_write(self, qt: gguf.GGMLQuantizationType) -> None:
        w = gguf.GGUFWriter(str(self.tmp / "out-peer.gguf"), "llama")
        for i, x in enumerate(self.xs):
            w.add_tensor(f"w.{i}", quants.quantize(x, qt), raw_dtype=qt)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()

    def llama(self, t: GGMLType, threads: int) -> None:
        params = llama_cpp.llama_model_quantize_default_params()
        params.nthread, params.ftype, params.pure = threads, FTYPE[t], True
        src, dst = bytes(self.tmp / "f32.gguf"), bytes(self.tmp / "out-llama.gguf")
        assert llama_cpp.llama_model_quantize(src, dst, ctypes.pointer(params)) == 0, "llama_model_quantize failed"

    def row(self, t: GGMLType) -> tuple[list[str], str]:
        """The table row of ``t`` and its byte-identity verdict."""
        xs, codec, qt = self.xs, get_codec(t), gguf.GGMLQuantizationType(int(t))
        mb = sum(x.nbytes for x in xs) / 1e6
        ours = [codec.quantize(x) for x in xs]
        t_q = self.time(lambda: [codec.quantize(x) for x in xs])
        t_w = self.time(lambda: self.ours_write(t), clean=True)
        t_c = self.time(lambda: [c_chunk(self.lib, t, x) for x in xs])
        same = {"C": all(np.array_equal(o, c_chunk(self.lib, t, x)) for o, x in zip(ours, xs, strict=True))}
        gp, vs_gp = "n/a", "n/a"
        if t in GGUF_PY:
            same["gguf-py"] = all(np.array_equal(o, quants.quantize(x, qt)) for o, x in zip(ours, xs, strict=True))
            t_gq = self.time(lambda: [quants.quantize(x, qt) for x in xs])
            t_p = self.time(lambda: self.peer_write(qt), clean=True)
            gp, vs_gp = f"{mb / t_gq:,.0f} / {mb / t_p:,.0f}", f"{t_p / t_w:.2f}x"
        t_l1, t_l2 = (self.time(lambda k=k: self.llama(t, k), clean=True) for k in (1, 2))
        out = gguf.GGUFReader(self.tmp / "out-llama.gguf")
        quantized = [r for r in out.tensors if r.tensor_type != gguf.GGMLQuantizationType.F32]
        assert {r.tensor_type for r in quantized} == {qt}, "llama_model_quantize mixed types"
        l_mb = sum(int(r.n_elements) * 4 for r in quantized) / 1e6
        got = {r.name: r.data for r in out.tensors}
        same["llama_model_quantize"] = all(np.array_equal(o, got[k]) for o, k in zip(ours, self.placed, strict=False))
        yes = "yes" if all(same.values()) else "no"
        pairs = ", ".join(f"{k}: {'same' if v else 'DIFFERS'}" for k, v in same.items())
        cells = [t.name, f"{mb / t_q:,.0f}", f"{mb / t_w:,.0f}", gp, f"{mb / t_c:,.0f}"]
        cells += [f"{l_mb / t_l1:,.0f} / {l_mb / t_l2:,.0f}", vs_gp, f"{t_c / t_q:.2f}x", yes]
        return cells, f"{t.name} byte-identical: {yes} ({pairs})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=2048, help="rows = columns, a multiple of 512 (default 2048)")
    parser.add_argument("--count", type=int, default=4, help="tensors (default 4)")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    n, count = args.n, max(1, args.count)
    if n <= 0 or n % 512:
        parser.error("--n must be a positive multiple of 512 (K-quant rows of n/2)")
    rng = np.random.default_rng(0)
    xs = [rng.standard_normal((n, n), dtype=np.float32) for _ in range(count)]
    total = sum(x.nbytes for x in xs)
    quiet = llama_cpp.llama_log_callback(lambda level, text, data: None)  # pyright: ignore[reportUnknownLambdaType]
    llama_cpp.llama_log_set(quiet, ctypes.c_void_p(0))
    table = Table(title=f"{count} x {n}x{n} float32 = {total / 1e6:.1f} MB, best of {args.repeat}")
    head = ["type", "ours quantize MB/s", "ours +pack+write MB/s", "gguf-py quantize / +write MB/s"]
    head += ["C chunk 1-thread MB/s", "llama_model_quantize 1t / 2t MB/s", "ours/gguf-py", "ours/C", "byte-identical"]
    for col in head:
        table.add_column(col, justify="left" if col == "type" else "right")
    verdicts: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        kvs, tensors, placed = llama_f32(xs, n, rng)
        write(Path(tmp, "f32.gguf"), kvs, tensors)
        bench = Bench(xs, args.repeat, ggml_base(), Path(tmp), placed)
        for t in TYPES:
            cells, verdict = bench.row(t)
            table.add_row(*cells)
            verdicts.append(verdict)
    Console(width=160).print(table)
    print("\n".join(verdicts))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"peak RSS, process-wide (includes the {total / 2**20:.0f} MiB of source tensors): {peak:.0f} MiB")
    assert all(v.split(": ")[1].startswith("yes") for v in verdicts), "our bytes differ from a peer's: see above"


if __name__ == "__main__":
    main()
