"""The shared fixtures are in the repository's root ``conftest.py`` (every package's tests use them).

This file stays so that ``tests/`` is on ``sys.path`` for ``from testkit import ...``.
"""
