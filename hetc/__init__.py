"""hetc: a declarative compiler for training LLMs on heterogeneous GPU clusters."""

import sys as _sys

# Note [grammar package]: the lark grammar lives in the top-level `grammar/`
# folder and installs as `hetc.grammar` (see pyproject.toml); when running
# from a source tree without installing, map it here.
if "hetc.grammar" not in _sys.modules:
    try:
        import hetc.grammar  # noqa: F401 - imported to see whether it is installed
    except ImportError:  # pragma: no cover - source tree without install
        import importlib.util as _util
        from pathlib import Path as _Path

        _init = _Path(__file__).resolve().parent.parent / "grammar" / "__init__.py"
        _specobj = _util.spec_from_file_location("hetc.grammar", _init)
        _mod = _util.module_from_spec(_specobj)
        _sys.modules["hetc.grammar"] = _mod
        _specobj.loader.exec_module(_mod)

__version__ = "0.1.0"
