# Fetching and unpacking PyPI wheels, for the scripts that build against torch and CUDA without
# installing them (sourced: `source scripts/lib/wheels.sh`; needs python3).
#
#   wheels_pip_download DEST REQ...          whole wheels (cp312, manylinux x86_64, --no-deps) into DEST
#   wheels_torch_wheel DL VERSION            the torch==VERSION cp312 wheel in DL (downloaded when missing); prints its path
#   wheels_extract WHEEL DEST PATTERN...     members matching glob PATTERNs (a leading ! excludes) into DEST
#   wheels_extract_files DEST NAME -- WHEEL...   members named NAME (any folder) of the wheels, flat into DEST
#   wheels_cuda_headers SERIES CU DEST      CUDA runtime + crt headers and libcudart under DEST/nvidia
#   wheels_fetch REQ DEST PATTERN...         only the matching members of REQ's wheel (HTTP range requests,
#                                            scripts/wheel-extract.py; REQ: PACKAGE==VERSION, VERSION may end in .*)

_wheels_dir="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

wheels_pip_download() { # dest req...
  local dest="$1"; shift
  local plats=()
  for p in manylinux_2_28 manylinux_2_27 manylinux_2_25 manylinux_2_24 manylinux_2_17 manylinux2014; do
    plats+=(--platform "${p}_x86_64")
  done
  mkdir -p "$dest"
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp "${plats[@]}" -d "$dest" "$@"
}

wheels_torch_wheel() { # dl version -> path
  local dl="$1" version="$2" whl
  whl=$(ls "$dl"/torch-"$version"-cp312-*manylinux*x86_64.whl 2>/dev/null | head -1 || true)
  if [ -z "$whl" ]; then
    echo "[wheels] downloading torch==$version (cp312, manylinux_2_28; ~530 MB, cached in $dl)" >&2
    wheels_pip_download "$dl" "torch==$version" >&2
    whl=$(ls "$dl"/torch-"$version"-cp312-*manylinux*x86_64.whl | head -1)
  fi
  echo "$whl"
}

wheels_extract() { # wheel dest pattern...
  local whl="$1" dest="$2"; shift 2
  mkdir -p "$dest"
  case " $* " in
    *" !"*) ;;
    *) if command -v unzip >/dev/null 2>&1; then unzip -q -o "$whl" "$@" -d "$dest"; return; fi ;;
  esac
  python3 - "$whl" "$dest" "$@" <<'PY'
import fnmatch, sys, zipfile
whl, dest, pats = sys.argv[1], sys.argv[2], sys.argv[3:]
inc = [p for p in pats if not p.startswith("!")]
exc = [p[1:] for p in pats if p.startswith("!")]
with zipfile.ZipFile(whl) as z:
    for n in z.namelist():
        if any(fnmatch.fnmatch(n, p) for p in inc) and not any(fnmatch.fnmatch(n, p) for p in exc):
            z.extract(n, dest)
PY
}

wheels_extract_files() { # dest name... -- wheel...
  local dest="$1"; shift
  mkdir -p "$dest"
  python3 - "$dest" "$@" <<'PY'
import os, sys, zipfile
dest, rest = sys.argv[1], sys.argv[2:]
names, wheels = rest[:rest.index("--")], rest[rest.index("--") + 1:]
for w in wheels:
    with zipfile.ZipFile(w) as z:
        for n in z.namelist():
            if os.path.basename(n) in names:
                with open(os.path.join(dest, os.path.basename(n)), "wb") as f:
                    f.write(z.read(n))
PY
}

wheels_fetch() { # req dest pattern...
  python3 "$_wheels_dir/wheel-extract.py" "$@"
}

# CUDA runtime headers and libcudart (nvidia-cuda-runtime-CU) and crt/ headers (from
# nvidia-cuda-nvcc-CU) of the newest SERIES release, under DEST/nvidia, unless there already.
wheels_cuda_headers() { # series cu dest
  local series="$1" cu="$2" dest="$3"
  if [ ! -f "$dest/nvidia/cuda_runtime/include/cuda_runtime_api.h" ] \
     || [ ! -f "$dest/nvidia/cuda_nvcc/include/crt/host_config.h" ]; then
    echo "[wheels] fetching nvidia-cuda-runtime-$cu==$series.* and the headers of nvidia-cuda-nvcc-$cu" >&2
    wheels_fetch "nvidia-cuda-runtime-$cu==$series.*" "$dest" 'nvidia/*'
    wheels_fetch "nvidia-cuda-nvcc-$cu==$series.*" "$dest" 'nvidia/cuda_nvcc/include/*'
  fi
}
