// Compiles the C++ side of the cxx bridge (the shims that C++ callers link against) into the
// staticlib. The generated header lands in $CARGO_TARGET_DIR/cxxbridge/gmlake-ffi/src/lib.rs.h
// and cxx's own header in $CARGO_TARGET_DIR/cxxbridge/rust/cxx.h: cmake/GmlakeRust.cmake adds
// that folder to the include path.
//
// CXXFLAGS from the environment are honoured by cxx-build (through the cc crate): the torch
// build passes -D_GLIBCXX_USE_CXX11_ABI=<0|1> there so the shims match torch's C++ ABI.
fn main() {
    cxx_build::bridge("src/lib.rs")
        .std("c++17")
        .flag_if_supported("-fvisibility=hidden")
        .compile("gmlake-ffi-bridge");
    println!("cargo:rerun-if-changed=src/lib.rs");
    println!("cargo:rerun-if-env-changed=CXXFLAGS");
}
