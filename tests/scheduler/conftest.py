"""Scheduler tests: pure policy, no etcd. Builders live in ``sched_helpers.py`` (importable as a module)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

#: the shared traces, relative to the repository root (``../shared/traces``).
TRACES = Path(__file__).parents[2].parent / "shared" / "traces"
