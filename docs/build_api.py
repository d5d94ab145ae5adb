"""Build the API reference of gpupool-sdk from its docstrings (pdoc).

    python docs/build_api.py [OUT_DIR]        # default build/api; open OUT_DIR/index.html

Every public module of ``gpupool_sdk`` gets a page (modules whose name has a part starting with
``_`` are private). The tests build it (tests/deploy/test_api_reference.py) and fail on a module
that does not import or a docstring pdoc cannot render. Needs ``pip install pdoc``.
"""

from __future__ import annotations

import pkgutil
import sys
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def public_modules() -> list[str]:
    """Names of the public modules of ``gpupool_sdk``, the package first."""
    import gpupool_sdk

    names = [
        m.name
        for m in pkgutil.walk_packages(gpupool_sdk.__path__, "gpupool_sdk.")
        if not any(part.startswith("_") for part in m.name.split("."))
    ]
    return ["gpupool_sdk", *sorted(names)]


def build(out: Path) -> tuple[list[str], list[str]]:
    """Write the HTML reference under ``out``; returns (modules documented, warnings pdoc gave)."""
    import pdoc
    import pdoc.render

    modules = public_modules()
    pdoc.render.configure(docformat="google", footer_text="gpupool-sdk API reference")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        # Every module by name: a package's __all__ would hide its submodules from pdoc.
        pdoc.pdoc(*modules, output_directory=out)
    # A package without __all__ also adds its submodules: the repeats are harmless.
    return modules, [str(w.message) for w in caught if "has already been added" not in str(w.message)]


if __name__ == "__main__":
    target = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "build" / "api"
    mods, warns = build(target)
    for w in warns:
        print(f"warning: {w}", file=sys.stderr)
    print(f"{len(mods)} modules documented in {target}/index.html")
