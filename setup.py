"""Package discovery (everything else is in pyproject.toml): ``qcompiler`` and its subpackages as
they are, and the top-level ``passes/`` and ``backends/`` folders installed as ``qcompiler.passes``
and ``qcompiler.backends`` with every subpackage found in them, so a new backend folder needs no
line here (only its entry point in pyproject.toml)."""

from setuptools import find_packages, setup


def under(prefix: str, folder: str) -> list[str]:
    return [prefix, *(f"{prefix}.{p}" for p in find_packages(folder))]


setup(
    packages=[
        *find_packages(include=["qcompiler", "qcompiler.*"]),
        *under("qcompiler.passes", "passes"),
        *under("qcompiler.backends", "backends"),
    ]
)
