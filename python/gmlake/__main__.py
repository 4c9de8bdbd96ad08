"""Zero-code-change launcher: ``python -m gmlake [options] script.py [args...]``.

Installs gmlake as PyTorch's CUDA allocator, then runs the script as ``__main__`` (as
``python script.py args...`` would). ``-m module`` runs a module instead. Configuration comes
from the environment (GMLake's variables, ``GMLAKE_CONF``) and ``--conf key:value,...``.
"""

from __future__ import annotations

import os
import runpy
import sys

USAGE = """usage: python -m gmlake [--conf KEY:VALUE,...] [--quiet] [--no-children]
                        [--metrics-port N [--metrics-addr ADDR]] script.py [args...]
       python -m gmlake [options] -m module [args...]
       python -m gmlake --check [--conf KEY:VALUE,...]
       python -m gmlake --version

Installs the gmlake allocator into PyTorch, then runs the program unchanged. Python processes
the program starts (torch.multiprocessing / DataLoader workers, subprocesses) install it too
when they import torch, unless --no-children.
Configuration: GMLake's variables (vmmDefragment, fragLimit, reuseLimit, defragLevel, autoGC),
GMLAKE_CONF=key:value,..., then --conf. The library is GMLAKE_LIBRARY or found next to the
package / in the build folders (see gmlake.library_path()).
--metrics-port N serves Prometheus metrics at http://ADDR:N/metrics (ADDR: --metrics-addr,
default 127.0.0.1) while the program runs (needs pip install 'gmlake[metrics]'); under
torchrun each rank serves on N + LOCAL_RANK.
"""


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    conf = ""
    quiet = False
    check = False
    children = True
    metrics_port = None
    metrics_addr = "127.0.0.1"
    while argv and argv[0].startswith("-") and argv[0] != "-m":
        opt = argv.pop(0)
        if opt in ("-h", "--help"):
            print(USAGE)
            return 0
        if opt == "--conf":
            if not argv:
                print("gmlake: --conf needs a value\n" + USAGE, file=sys.stderr)
                return 2
            conf = argv.pop(0)
        elif opt.startswith("--conf="):
            conf = opt[len("--conf="):]
        elif opt in ("-q", "--quiet"):
            quiet = True
        elif opt == "--check":
            check = True
        elif opt == "--no-children":
            children = False
        elif opt in ("--metrics-port", "--metrics-addr") or opt.startswith(("--metrics-port=", "--metrics-addr=")):
            name, eq, value = opt.partition("=")
            if not eq:
                if not argv:
                    print(f"gmlake: {name} needs a value\n" + USAGE, file=sys.stderr)
                    return 2
                value = argv.pop(0)
            if name == "--metrics-addr":
                metrics_addr = value
                continue
            from gmlake.metrics import _check_port

            try:
                metrics_port = _check_port(value)
            except ValueError as e:
                print(e, file=sys.stderr)
                return 2
        elif opt == "--version":
            import gmlake

            print(f"gmlake {gmlake.__version__}")
            return 0
        elif opt == "--":
            break
        else:
            print(f"gmlake: unknown option {opt}\n" + USAGE, file=sys.stderr)
            return 2

    import gmlake

    if check:
        try:
            gmlake.check_config(conf)
            print(f"gmlake: configuration ok; library {gmlake.library_path()}; build {gmlake.build_info()}")
            return 0
        except RuntimeError as e:
            print(e, file=sys.stderr)
            return 1

    if not argv:
        print(USAGE, file=sys.stderr)
        return 2

    try:
        gmlake.enable(conf)
    except RuntimeError as e:
        print(f"gmlake: {e}", file=sys.stderr)
        return 1
    if not quiet and os.environ.get("GMLAKE_QUIET", "") in ("", "0"):
        print(f"[gmlake] allocator installed ({gmlake.library_path()})", file=sys.stderr)
    if metrics_port is not None:
        port = metrics_port
        rank = os.environ.get("LOCAL_RANK", "")
        if port and rank.isdigit():
            port += int(rank)
        try:
            server = gmlake.serve_metrics(port=port, addr=metrics_addr)
        except (RuntimeError, ValueError) as e:
            print(e, file=sys.stderr)
            return 1
        print(f"[gmlake] metrics at {server.url}", file=sys.stderr)
    if children:
        from gmlake._autoenable import environment_for_children

        os.environ.update(environment_for_children(conf))
        os.environ.setdefault("GMLAKE_LIBRARY", gmlake.library_path())

    if argv[0] == "-m":
        if len(argv) < 2:
            print("gmlake: -m needs a module name\n" + USAGE, file=sys.stderr)
            return 2
        module = argv[1]
        sys.argv = [module] + argv[2:]
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        return 0

    script = argv[0]
    if not os.path.exists(script):
        print(f"gmlake: no such script: {script}", file=sys.stderr)
        return 2
    sys.argv = argv
    # As `python script.py`: the script's folder first on the path (in place of the current
    # folder that `python -m` put there).
    script_dir = os.path.dirname(os.path.abspath(script))
    if sys.path and sys.path[0] in ("", os.getcwd()):
        sys.path[0] = script_dir
    else:
        sys.path.insert(0, script_dir)
    runpy.run_path(script, run_name="__main__")
    return 0


if __name__ == "__main__":
    code = main()
    sys.exit(code)
