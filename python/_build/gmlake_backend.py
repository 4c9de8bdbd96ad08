"""gmlake's PEP 517 build backend: scikit-build-core over the repository's CMake (cpp/), after
finding the torch to build against.

Before any hook runs, it finds torch (``GMLAKE_TORCH_DIR``, else the ``torch`` package of the
interpreter that runs pip, even under build isolation), reads its version and CUDA version
from ``torch/version.py``, checks that cargo (Rust) and the repository's sources are there, and
writes ``gmlake/_build_info.py``: the wheel's version with the local tag
``+torch<major><minor>.cu<cuda>`` (e.g. ``0.1.0+torch211.cu130``) and what the library is
built for, which :func:`gmlake.enable` checks against the torch it runs with. It passes the
torch folder to CMake through ``GMLAKE_TORCH_DIR``. Each problem is one clear error.

Environment: GMLAKE_TORCH_DIR (a torch package folder with include/ and lib/, e.g. one
unpacked from a wheel), GMLAKE_TORCH_VERSION / GMLAKE_CUDA_VERSION (when that folder has no
version.py), GMLAKE_RUST_STATICLIB (a prebuilt staticlib: no cargo needed), CMAKE_ARGS (more
CMake definitions, e.g. -DCUDA_INCLUDE_DIR=... -DCUDART_LIBRARY=...).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent  # python/_build
PYDIR = HERE.parent  # python/
BUILD_INFO = PYDIR / "gmlake" / "_build_info.py"

_FIND_TORCH = (
    "import importlib.util as u; s = u.find_spec('torch'); "
    "print(s.submodule_search_locations[0] if s and s.submodule_search_locations else '')"
)


class BuildError(SystemExit):
    def __init__(self, msg: str):
        super().__init__("\ngmlake build error: " + msg + "\n")


def repo_root() -> Path:
    root = Path(os.environ.get("GMLAKE_SOURCE_DIR", PYDIR.parent)).resolve()
    if not (root / "cpp" / "CMakeLists.txt").is_file() or not (root / "Cargo.toml").is_file():
        raise BuildError(
            f"the gmlake repository (cpp/CMakeLists.txt, Cargo.toml) is not at {root}: build from "
            "a checkout of the repository (pip install <checkout>/python --no-build-isolation), "
            "not from an sdist, or set GMLAKE_SOURCE_DIR to the checkout"
        )
    return root


def find_torch_dir() -> Path:
    env = os.environ.get("GMLAKE_TORCH_DIR")
    if env:
        d = Path(os.path.abspath(env))
        if not d.is_dir():
            raise BuildError(f"GMLAKE_TORCH_DIR={env} is not a folder")
        return d
    # The interpreter running pip: as it is (no build isolation), then without the
    # environment variables pip's build isolation sets (-E), which hide its site-packages.
    for flags in ([], ["-E"]):
        try:
            r = subprocess.run([sys.executable, *flags, "-c", _FIND_TORCH],
                               capture_output=True, text=True, timeout=120)
        except (OSError, subprocess.TimeoutExpired):
            continue
        out = r.stdout.strip()
        if r.returncode == 0 and out:
            # Not resolved: a linked torch/ keeps its site-packages (CUDA is looked for beside it).
            return Path(os.path.abspath(out))
    raise BuildError(
        f"torch not found for {sys.executable}: gmlake's library is built against the torch "
        "it will run with. Install torch first (pip install torch), then "
        "pip install ./python --no-build-isolation; or set GMLAKE_TORCH_DIR to a torch "
        "package folder (include/, lib/)"
    )


def torch_info(torch_dir: Path) -> dict:
    hdr = torch_dir / "include" / "c10" / "cuda" / "CUDACachingAllocator.h"
    if not hdr.is_file():
        raise BuildError(
            f"{torch_dir} has no include/c10/cuda/CUDACachingAllocator.h: gmlake needs a CUDA "
            "build of torch with its C++ headers"
        )
    version = os.environ.get("GMLAKE_TORCH_VERSION", "")
    cuda = os.environ.get("GMLAKE_CUDA_VERSION", "")
    vpy = torch_dir / "version.py"
    if vpy.is_file():
        text = vpy.read_text()
        m = re.search(r"^__version__\s*=\s*['\"]([^'\"]+)['\"]", text, re.M)
        if m and not version:
            version = m.group(1)
        m = re.search(r"^cuda(?:\s*:[^=]+)?\s*=\s*['\"]([0-9.]+)['\"]", text, re.M)
        if m and not cuda:
            cuda = m.group(1)
    if not version:
        raise BuildError(f"{vpy} not found: set GMLAKE_TORCH_VERSION (e.g. 2.11.0)")
    if not cuda:
        raise BuildError(
            f"torch {version} at {torch_dir} was built without CUDA (version.py: cuda = None): "
            "gmlake is a CUDA allocator; install a CUDA build of torch (or set GMLAKE_CUDA_VERSION)"
        )
    m = re.match(r"(\d+)\.(\d+)", version)
    c = re.match(r"(\d+)\.(\d+)", cuda)
    if not m or not c:
        raise BuildError(f"cannot read torch version {version!r} / CUDA version {cuda!r}")
    return {
        "torch_dir": str(torch_dir),
        "torch_version": version,
        "torch_major_minor": (int(m.group(1)), int(m.group(2))),
        "cuda_version": cuda,
        "local": f"torch{m.group(1)}{m.group(2)}.cu{c.group(1)}{c.group(2)}",
    }


def check_cargo() -> None:
    if os.environ.get("GMLAKE_RUST_STATICLIB"):
        return
    homes = [os.environ.get("CARGO_HOME", ""), os.path.expanduser("~/.cargo")]
    if shutil.which("cargo") or any(h and os.access(os.path.join(h, "bin", "cargo"), os.X_OK) for h in homes):
        return
    raise BuildError(
        "cargo (Rust) not found on PATH or in ~/.cargo/bin: gmlake's allocator core is Rust. "
        "Install a toolchain with rustup (https://rustup.rs: curl --proto '=https' -sSf "
        "https://sh.rustup.rs | sh, then rustup toolchain install stable) and run pip again"
    )


def base_version() -> str:
    text = (PYDIR / "gmlake" / "__init__.py").read_text()
    m = re.search(r"^_BASE_VERSION\s*=\s*['\"]([^'\"]+)['\"]", text, re.M)
    if not m:
        raise BuildError("python/gmlake/__init__.py has no _BASE_VERSION")
    return m.group(1)


def prepare() -> dict:
    repo_root()
    check_cargo()
    info = torch_info(find_torch_dir())
    version = f"{base_version()}+{info['local']}"
    text = (
        "# Generated when the wheel was built (python/_build/gmlake_backend.py): what its\n"
        "# libgmlake_torch.so was built for. gmlake.enable() checks the running torch against it.\n"
        f"__version__ = {version!r}\n"
        f"TORCH_VERSION = {info['torch_version']!r}\n"
        f"TORCH_MAJOR_MINOR = {info['torch_major_minor']!r}\n"
        f"CUDA_VERSION = {info['cuda_version']!r}\n"
    )
    if not BUILD_INFO.is_file() or BUILD_INFO.read_text() != text:
        BUILD_INFO.write_text(text)
    os.environ["GMLAKE_TORCH_DIR"] = info["torch_dir"]
    print(f"gmlake: building {version} against torch {info['torch_version']} "
          f"(CUDA {info['cuda_version']}) at {info['torch_dir']}", file=sys.stderr)
    return info


def _skb():
    try:
        from scikit_build_core import build
    except ImportError as e:  # --no-build-isolation without the backend installed
        raise BuildError(
            f"scikit-build-core is not installed ({e}): with --no-build-isolation, first "
            "pip install 'scikit-build-core>=0.10'"
        ) from None
    return build


def _wrap(name):
    def hook(*args, **kwargs):
        prepare()
        return getattr(_skb(), name)(*args, **kwargs)

    hook.__name__ = name
    return hook


build_wheel = _wrap("build_wheel")
build_editable = _wrap("build_editable")
get_requires_for_build_wheel = _wrap("get_requires_for_build_wheel")
get_requires_for_build_editable = _wrap("get_requires_for_build_editable")
prepare_metadata_for_build_wheel = _wrap("prepare_metadata_for_build_wheel")
prepare_metadata_for_build_editable = _wrap("prepare_metadata_for_build_editable")


def get_requires_for_build_sdist(config_settings=None):
    return []


def build_sdist(sdist_directory, config_settings=None):
    raise BuildError(
        "gmlake has no sdist: its build needs the whole repository (the Rust workspace and "
        "cpp/). Build the wheel from a checkout: pip wheel ./python --no-build-isolation"
    )
