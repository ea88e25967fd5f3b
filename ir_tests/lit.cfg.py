# lit configuration for the textual-IR tests. Run: lit -v ir_tests
# Each .qir file has `// RUN:` lines; `filecheck` (the Python FileCheck clone) checks the output.
import os
import shutil

import lit.formats

config.name = "qcompiler-ir"
config.test_format = lit.formats.ShTest(execute_external=True)
config.suffixes = [".qir"]
config.excludes = ["data"]
config.test_source_root = os.path.dirname(__file__)

# The tools come from the environment qcompiler is installed in.
config.environment["PATH"] = os.environ.get("PATH", "")
for var in ("HOME", "VIRTUAL_ENV", "PYTHONPATH"):
    if var in os.environ:
        config.environment[var] = os.environ[var]

qc = shutil.which("qcompiler") or "qcompiler"
# %roundtrip: the file (comments kept) prints back byte for byte, and canonical output is a fixed point.
config.substitutions.append(
    ("%roundtrip", f"{qc} opt --keep-comments %s | diff %s - && {qc} opt %s | {qc} opt - --verify-roundtrip | diff <({qc} opt %s) -")
)
