"""Third-party noise off, and the last line of defence against a raw traceback.

``quiet()`` runs before any command module is imported: transformers', huggingface_hub's and
tqdm's progress bars and warnings, torch's and torchao's import-time log lines, and Python warnings
raised from inside those libraries do not reach a qcompiler user (qcompiler reports what matters
itself). ``QC_DEBUG=1`` leaves them on.

``internal_error(command, exc)`` is what the CLI prints for an exception that is not a ``QcError``:
by design there is none (every gate raises a typed error), so one reaching the user is a qcompiler
bug, reported in one paragraph with how to get the traceback.
"""

from __future__ import annotations

import logging
import os
import traceback
import warnings

NOISY = ("torch", "torchao", "transformers", "huggingface_hub", "compressed_tensors", "onnx", "onnxruntime", "triton")
"""Libraries whose loggers and warnings are turned down to errors."""
ENV = {
    "TRANSFORMERS_VERBOSITY": "error",
    "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1",
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    "TQDM_DISABLE": "1",
    "TORCHINDUCTOR_COMPILE_THREADS": "1",
}


def quiet() -> None:
    """Turn third-party progress bars, log lines and warnings down (see the module docstring)."""
    from qcompiler.env import QC_DEBUG

    if QC_DEBUG.level() >= 1:
        return
    for key, value in ENV.items():
        os.environ.setdefault(key, value)
    import torch  # noqa: F401  # pyright: ignore[reportUnusedImport]  (torch sets its loggers' levels when imported: set ours after it)

    for name in NOISY:
        logging.getLogger(name).setLevel(logging.ERROR)
    pattern = r"^(" + "|".join(NOISY) + r")(\.|$)"
    warnings.filterwarnings("ignore", module=pattern)
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=DeprecationWarning)


def internal_error(argv: list[str], exc: BaseException) -> str:
    """The message for an untyped exception: where it came from and how to see the traceback."""
    frames = traceback.extract_tb(exc.__traceback__)
    ours = [f for f in frames if "/qcompiler/" in f.filename.replace("\\", "/")]
    where = ""
    if frames:
        last = frames[-1]
        where = f" at {os.path.basename(last.filename)}:{last.lineno} ({last.name})"
        if ours and ours[-1] is not last:
            where += f", from {os.path.basename(ours[-1].filename)}:{ours[-1].lineno}"
    text = (str(exc).strip().splitlines() or [""])[0][:300]
    command = " ".join(["qcompiler", *argv])
    return (
        f"error: internal error: {type(exc).__name__}{where}: {text}\n"
        "qcompiler did not expect this (every failure it knows is reported as a typed error); please report it.\n"
        "Rerun with QC_DEBUG=1 for the traceback:\n"
        f"  QC_DEBUG=1 {command}"
    )
