"""Import a script of ``scripts/`` as a module (the folder is not a package)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def load_script(stem: str, module: str | None = None) -> ModuleType:
    """Import ``scripts/<stem>.py`` as ``module`` (default ``msd_<stem>``).

    The module is registered in ``sys.modules`` before it runs: its dataclasses
    (with postponed annotations) and a forked child look it up there.
    """
    if str(SCRIPTS) not in sys.path:  # (what a script imports of its folder: cli_types)
        sys.path.insert(0, str(SCRIPTS))
    name = module or f"msd_{stem}"
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{stem}.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod
