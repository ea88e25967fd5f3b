"""qcompiler's version, in a module of the bottom layer: the manifest writer records it, and the
package root (``qcompiler/__init__.py``, the public facade on top) re-exports it."""

__version__ = "0.1.0"
