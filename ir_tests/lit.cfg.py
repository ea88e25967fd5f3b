# lit configuration for the textual-IR tests. Run: lit -v ir_tests
# Each .qir file has `// RUN:` lines; `filecheck` (the Python FileCheck clone) checks the output.
import os
import shutil

import lit.formats

config.name = "qcompiler-ir"
config.test_format = lit.formats.ShTest()
config.suffixes = [".qir"]
config.excludes = ["data"]
config.test_source_root = os.path.dirname(__file__)

# The tools come from the environment qcompiler is installed in.
config.environment["PATH"] = os.environ.get("PATH", "")
for var in ("HOME", "VIRTUAL_ENV", "PYTHONPATH"):
    if var in os.environ:
        config.environment[var] = os.environ[var]

qc = shutil.which("qcompiler") or "qcompiler"
# %roundtrip: the file (comments kept) prints back byte for byte, and the canonical output is a
# fixed point of parse -> print. %roundtrip-split does the same per `// -----` case.
config.substitutions.append(
    ("%roundtrip-split", f"{qc} opt --split-input-file --keep-comments %s | diff %s - && "
     f"{qc} opt --split-input-file %s > %t && {qc} opt --split-input-file --verify-roundtrip %t | diff %t -")
)
config.substitutions.append(
    ("%roundtrip", f"{qc} opt --keep-comments %s | diff %s - && "
     f"{qc} opt %s > %t && {qc} opt --verify-roundtrip %t | diff %t -")
)
config.substitutions.append(("%qc", qc))
