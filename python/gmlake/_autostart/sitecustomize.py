"""Put first on PYTHONPATH by ``python -m gmlake`` (unless ``--no-children``), so that the
Python processes a program starts (torch.multiprocessing and DataLoader workers with the
"spawn" start method, torchrun ranks, subprocesses) install gmlake too, the moment they import
torch, before they can touch CUDA. Nothing happens in a process that never imports torch.

Any other ``sitecustomize`` module on the path (a distribution's or a virtual environment's)
still runs: it is found and executed first. Nothing here may stop the interpreter from
starting: every error is reported on stderr and ignored.
"""

import os
import sys


def _chain_other_sitecustomize():
    here = os.path.dirname(os.path.abspath(__file__))
    for entry in sys.path:
        folder = os.path.abspath(entry or os.getcwd())
        if folder == here:
            continue
        path = os.path.join(folder, "sitecustomize.py")
        if os.path.isfile(path):
            import importlib.util

            spec = importlib.util.spec_from_file_location("_gmlake_chained_sitecustomize", path)
            module = importlib.util.module_from_spec(spec)
            sys.modules[spec.name] = module
            spec.loader.exec_module(module)
            return


try:
    _chain_other_sitecustomize()
except Exception as e:  # another sitecustomize failed: as Python itself does, report and go on
    print(f"gmlake: error in the chained sitecustomize: {e!r}", file=sys.stderr)

if "GMLAKE_AUTO_ENABLE" in os.environ:
    try:
        from gmlake._autoenable import install_import_hook

        install_import_hook(os.environ["GMLAKE_AUTO_ENABLE"])
    except Exception as e:
        print(f"gmlake: could not prepare the install in this process: {e!r}", file=sys.stderr)
