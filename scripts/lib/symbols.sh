# Checks of a shared library's dynamic symbols and dependencies (sourced:
# `source scripts/lib/symbols.sh`; needs binutils).
#
#   symbols_exported LIB        the names of the symbols LIB exports, one a line
#   symbols_needed LIB          LIB's NEEDED libraries, on one line
#   symbols_links_libcuda LIB   true when libcuda is in LIB's NEEDED (the driver is loaded at run time)
#   symbols_unexpected LIB      what libgmlake_torch.so exports beyond its C API (gmlake_*) and torch's
#                               CUDAAllocatorConfig instance (a GNU unique symbol bound to libc10_cuda's:
#                               see cpp/gmlake_torch.map), one a line
#   symbols_missing LIB SYM...  the SYMs LIB does not export, one a line

symbols_exported() { # lib
  nm -D --defined-only "$1" | awk '{print $3}'
}

symbols_needed() { # lib
  readelf -d "$1" | sed -n 's/.*Shared library: \[\(.*\)\]/\1/p' | tr '\n' ' '
}

symbols_links_libcuda() { # lib
  readelf -d "$1" | grep -q 'libcuda\.so'
}

symbols_unexpected() { # lib
  symbols_exported "$1" | grep -v '^gmlake_' | grep -v 'CUDAAllocatorConfig8instanceEvE10s_instance$' || true
}

symbols_missing() { # lib sym...
  local lib="$1"; shift
  local exported
  exported=" $(symbols_exported "$lib" | tr '\n' ' ') "
  for sym in "$@"; do
    case "$exported" in *" $sym "*) ;; *) echo "$sym" ;; esac
  done
}
