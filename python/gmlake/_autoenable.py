"""Installing gmlake in processes started by a program run with ``python -m gmlake``: an
import hook that calls :func:`gmlake.enable` right after ``torch`` is imported (see
``_autostart/sitecustomize.py``, and ``environment_for_children`` for what the parent sets)."""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys
from typing import Dict

ENV = "GMLAKE_AUTO_ENABLE"
AUTOSTART_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_autostart")
PACKAGE_PARENT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def environment_for_children(conf: str, environ=None) -> Dict[str, str]:
    """The variables that make child processes install gmlake with `conf`: GMLAKE_AUTO_ENABLE,
    and PYTHONPATH with the autostart folder and this package's parent in front."""
    environ = os.environ if environ is None else environ
    parts = [AUTOSTART_DIR, PACKAGE_PARENT]
    old = environ.get("PYTHONPATH", "")
    parts += [p for p in old.split(os.pathsep) if p and p not in parts]
    return {ENV: conf, "PYTHONPATH": os.pathsep.join(parts)}


def _enable(conf: str) -> None:
    try:
        import gmlake

        if not gmlake.is_enabled():
            gmlake.enable(conf)
    except Exception as e:  # the process goes on with PyTorch's allocator
        print(f"gmlake: not installed in process {os.getpid()}: {e}", file=sys.stderr)


class _TorchImportHook(importlib.abc.MetaPathFinder):
    """Finds `torch` through the other finders and runs `_enable` once its module has been
    executed. Removes itself at the first `torch` lookup."""

    def __init__(self, conf: str):
        self.conf = conf

    def find_spec(self, name, path=None, target=None):
        if name != "torch":
            return None
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        loader, conf = spec.loader, self.conf
        original = loader.exec_module

        # Wraps the method on this loader instance only (made for this lookup), and removes
        # the wrapper once it ran: torch keeps its own loader (get_source, resources, ...).
        def exec_module(module):
            try:
                original(module)
            finally:
                try:
                    del loader.exec_module
                except AttributeError:
                    pass
            _enable(conf)

        loader.exec_module = exec_module
        return spec


def install_import_hook(conf: str) -> None:
    """Enables gmlake now if torch is already imported, else when it is."""
    if "torch" in sys.modules:
        _enable(conf)
        return
    if not any(isinstance(f, _TorchImportHook) for f in sys.meta_path):
        sys.meta_path.insert(0, _TorchImportHook(conf))
