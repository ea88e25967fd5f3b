"""Debug switches read from the environment, all in one table (also in docs/env_vars.md).

| variable | values | effect |
|---|---|---|
| ``QC_DEBUG`` | 0 (default) .. 2 | 1: show Python tracebacks behind typed errors; 2: also print IR after every pass |
| ``QC_VERIFY`` | 1 (default) / 0 | 0 turns off the verifier between passes (same as ``--no-verify``) |
| ``QC_DUMP_DIR`` | a directory | dump IR after every pass there (same as ``--dump-ir DIR``) |
| ``QC_WRITER_PAUSE_AT`` | a writer step | tests: the artifact writer prints its temp dir and sleeps at that step |
"""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class EnvVar:
    name: str
    default: str
    help: str

    def get(self) -> str:
        return os.environ.get(self.name, self.default)

    def level(self) -> int:
        raw = self.get()
        return int(raw) if raw.isdigit() else 0


QC_DEBUG = EnvVar("QC_DEBUG", "0", "debug level: 1 tracebacks, 2 IR after every pass")
QC_VERIFY = EnvVar("QC_VERIFY", "1", "0 disables verification between passes")
QC_DUMP_DIR = EnvVar("QC_DUMP_DIR", "", "dump IR after every pass into this directory")
QC_WRITER_PAUSE_AT = EnvVar("QC_WRITER_PAUSE_AT", "", "tests: pause the artifact writer at this step")

ALL = (QC_DEBUG, QC_VERIFY, QC_DUMP_DIR, QC_WRITER_PAUSE_AT)
