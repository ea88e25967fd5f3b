"""Artifacts: directories published transactionally, with ``manifest.json`` as the root of reachability."""

from qcompiler.artifact.writer import ArtifactWriteError, ArtifactWriter, verify_published

__all__ = ["ArtifactWriteError", "ArtifactWriter", "verify_published"]
