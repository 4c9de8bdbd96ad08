# Builds a Rust staticlib with cargo and makes it an imported CMake target.
#
#   include(GmlakeRust)
#   gmlake_rust_staticlib(
#     TARGET   gmlake_ffi            # the CMake target to create
#     PACKAGE  gmlake-ffi            # the cargo package (crate-type includes "staticlib")
#     WORKSPACE <dir>                # the cargo workspace root (holds Cargo.toml)
#     [CXX11_ABI 0|1])               # _GLIBCXX_USE_CXX11_ABI for the cxx shims (torch's ABI)
#
# Link it PRIVATE and hide its symbols:
#   target_link_libraries(mylib PRIVATE gmlake_ffi)
#   target_link_options(mylib PRIVATE -Wl,--exclude-libs,ALL)
#
# The target carries the include directory of the cxx bridge headers
# (<target-dir>/cxxbridge: "rust/cxx.h" and "<package>/src/lib.rs.h") and the system
# libraries Rust's std needs.
#
# Prebuilt mode (machines without a Rust toolchain): set GMLAKE_RUST_STATICLIB to the .a and
# GMLAKE_CXXBRIDGE_DIR to a copy of <target-dir>/cxxbridge (symlinks resolved); cargo is not
# run then.
#
# Cargo options: GMLAKE_CARGO (the cargo program), GMLAKE_CARGO_TARGET_DIR (default:
# <workspace>/target, shared with the rest of the workspace), GMLAKE_CARGO_PROFILE (release).

set(GMLAKE_RUST_STATICLIB "" CACHE FILEPATH "Prebuilt Rust staticlib (skips cargo)")
set(GMLAKE_CXXBRIDGE_DIR "" CACHE PATH "cxxbridge include folder of the prebuilt staticlib")
set(GMLAKE_CARGO_PROFILE "release" CACHE STRING "Cargo profile for the Rust staticlib")

function(gmlake_rust_staticlib)
  cmake_parse_arguments(ARG "" "TARGET;PACKAGE;WORKSPACE;CXX11_ABI" "" ${ARGN})
  if(NOT ARG_TARGET OR NOT ARG_PACKAGE OR NOT ARG_WORKSPACE)
    message(FATAL_ERROR "gmlake_rust_staticlib: TARGET, PACKAGE and WORKSPACE are required")
  endif()
  string(REPLACE "-" "_" crate "${ARG_PACKAGE}")

  if(GMLAKE_RUST_STATICLIB)
    if(NOT EXISTS "${GMLAKE_RUST_STATICLIB}")
      message(FATAL_ERROR "GMLAKE_RUST_STATICLIB=${GMLAKE_RUST_STATICLIB} does not exist")
    endif()
    if(NOT GMLAKE_CXXBRIDGE_DIR OR NOT EXISTS "${GMLAKE_CXXBRIDGE_DIR}/rust/cxx.h")
      message(FATAL_ERROR "GMLAKE_CXXBRIDGE_DIR must point at a cxxbridge folder holding rust/cxx.h")
    endif()
    set(lib "${GMLAKE_RUST_STATICLIB}")
    set(bridge_dir "${GMLAKE_CXXBRIDGE_DIR}")
    message(STATUS "gmlake: using the prebuilt Rust staticlib ${lib}")
  else()
    if(NOT GMLAKE_CARGO)
      find_program(GMLAKE_CARGO cargo HINTS "$ENV{HOME}/.cargo/bin" "$ENV{CARGO_HOME}/bin")
    endif()
    if(NOT GMLAKE_CARGO)
      message(FATAL_ERROR
        "cargo not found (looked on PATH, in ~/.cargo/bin and $CARGO_HOME/bin): install Rust with "
        "rustup (https://rustup.rs, then `rustup toolchain install stable`), or set "
        "GMLAKE_RUST_STATICLIB and GMLAKE_CXXBRIDGE_DIR to a staticlib built elsewhere")
    endif()
    if(NOT GMLAKE_CARGO_TARGET_DIR)
      set(GMLAKE_CARGO_TARGET_DIR "${ARG_WORKSPACE}/target")
    endif()
    if(GMLAKE_CARGO_PROFILE STREQUAL "dev")
      set(profile_dir debug)
    else()
      set(profile_dir "${GMLAKE_CARGO_PROFILE}")
    endif()
    set(lib "${GMLAKE_CARGO_TARGET_DIR}/${profile_dir}/lib${crate}.a")
    set(bridge_dir "${GMLAKE_CARGO_TARGET_DIR}/cxxbridge")
    set(env_cxxflags "$ENV{CXXFLAGS}")
    if(DEFINED ARG_CXX11_ABI AND NOT ARG_CXX11_ABI STREQUAL "")
      set(env_cxxflags "${env_cxxflags} -D_GLIBCXX_USE_CXX11_ABI=${ARG_CXX11_ABI}")
    endif()
    # Always run cargo (it is quick when nothing changed and knows the Rust dependencies).
    add_custom_target(${ARG_TARGET}_cargo ALL
      COMMAND ${CMAKE_COMMAND} -E env
              "CARGO_TARGET_DIR=${GMLAKE_CARGO_TARGET_DIR}"
              "CXXFLAGS=${env_cxxflags}"
              "${GMLAKE_CARGO}" build --profile "${GMLAKE_CARGO_PROFILE}"
              -p "${ARG_PACKAGE}" --manifest-path "${ARG_WORKSPACE}/Cargo.toml"
      BYPRODUCTS "${lib}"
      WORKING_DIRECTORY "${ARG_WORKSPACE}"
      USES_TERMINAL
      COMMENT "cargo build ${ARG_PACKAGE} (${GMLAKE_CARGO_PROFILE})")
    # The include folder must exist at configure time for the imported target.
    file(MAKE_DIRECTORY "${bridge_dir}")
  endif()

  add_library(${ARG_TARGET} STATIC IMPORTED GLOBAL)
  set_target_properties(${ARG_TARGET} PROPERTIES
    IMPORTED_LOCATION "${lib}"
    INTERFACE_INCLUDE_DIRECTORIES "${bridge_dir}")
  find_package(Threads REQUIRED)
  # What Rust's std needs from the system (cargo rustc -- --print native-static-libs).
  target_link_libraries(${ARG_TARGET} INTERFACE Threads::Threads ${CMAKE_DL_LIBS} m rt util gcc_s)
  if(TARGET ${ARG_TARGET}_cargo)
    add_dependencies(${ARG_TARGET} ${ARG_TARGET}_cargo)
  endif()
endfunction()
