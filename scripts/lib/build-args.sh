# The settings and arguments the scripts that build against PyPI's torch share (sourced by
# scripts/build-torch-ext.sh and scripts/build-wheel.sh after `cd` to the repository root).
#
#   source scripts/lib/build-args.sh
#   build_args NAME HELP_LAST_LINE ALLOW_TEST "$@"
#
# Sets ROOT, TORCH_VERSION (2.11.0), CUDA_SERIES (13.0), CUDA_MAJOR, ART (GMLAKE_ARTIFACTS,
# default .artifacts); build_args reads --out DIR / --out=DIR into OUT, --test into TEST=1 (only
# where ALLOW_TEST is 1), prints the script's header comment (lines 2..HELP_LAST_LINE) for -h,
# and refuses anything else naming the script. log prints a line prefixed with [NAME].
ROOT=$PWD
TORCH_VERSION="${TORCH_VERSION:-2.11.0}"
CUDA_SERIES="${CUDA_SERIES:-13.0}"
CUDA_MAJOR="${CUDA_SERIES%%.*}"
ART="${GMLAKE_ARTIFACTS:-$ROOT/.artifacts}"
_build_name=build

build_args() {
  _build_name=$1
  local help=$2 allow_test=$3
  shift 3
  while [ $# -gt 0 ]; do
    case "$1" in
      --test)
        [ "$allow_test" = 1 ] || { echo "$_build_name: unknown argument $1" >&2; exit 2; }
        TEST=1; shift ;;
      --out) OUT="$2"; shift 2 ;;
      --out=*) OUT="${1#--out=}"; shift ;;
      -h|--help) sed -n "2,${help}p" "$0"; exit 0 ;;
      *) echo "$_build_name: unknown argument $1" >&2; exit 2 ;;
    esac
  done
}

log() { printf '[%s] %s\n' "$_build_name" "$*"; }
