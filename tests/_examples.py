"""Loading a script of examples/ as a module, for the tests of its functions and of its main()."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def load_example(name: str, *, register: bool = False) -> ModuleType:
    """examples/<name>.py as module ``name``, run with argv holding the script alone (a script may
    read argv as it is imported). ``register``: also in sys.modules under that name (a dataclass of
    the script looks its module up there)."""
    path = EXAMPLES / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    if register:
        sys.modules[name] = module
    argv, sys.argv = sys.argv, [str(path)]
    try:
        spec.loader.exec_module(module)
    finally:
        sys.argv = argv
    return module
