//! Compiles src/torch_memory.cpp (torch's view of the current CUDA allocator) against the
//! libtorch torch-sys found, and keeps libtorch_cuda.so linked.
use std::path::PathBuf;

fn main() {
    // torch-sys (links = "tch") exports the libtorch lib folder it linked.
    let lib = PathBuf::from(
        std::env::var("DEP_TCH_LIBTORCH_LIB")
            .expect("torch-sys did not export DEP_TCH_LIBTORCH_LIB"),
    );
    let root = match std::env::var_os("LIBTORCH_INCLUDE") {
        Some(dir) => PathBuf::from(dir),
        None => lib
            .parent()
            .expect("libtorch lib folder has a parent")
            .to_path_buf(),
    };
    let abi = std::env::var("LIBTORCH_CXX11_ABI").unwrap_or_else(|_| "1".to_string());
    println!("cargo:rerun-if-env-changed=LIBTORCH_CXX11_ABI");
    println!("cargo:rerun-if-env-changed=LIBTORCH_INCLUDE");
    println!("cargo:rerun-if-changed=src/torch_memory.cpp");
    cc::Build::new()
        .cpp(true)
        .pic(true)
        .std("c++17")
        .include(root.join("include"))
        .define("_GLIBCXX_USE_CXX11_ABI", abi.as_str())
        .warnings(false)
        .file("src/torch_memory.cpp")
        .compile("tch_train_memory");

    // Nothing in a tch program refers to libtorch_cuda.so's symbols, so the linker's default
    // --as-needed drops it and CUDA is missing at run time (no CUDA device, and no
    // libc10_cuda.so for gmlake to install into). Keep it.
    if std::env::var_os("CARGO_FEATURE_NO_CUDA_LINK").is_some() {
        // Smoke-test build: torch's CUDA allocator library only.
        println!("cargo:rustc-link-arg=-Wl,--no-as-needed");
        println!("cargo:rustc-link-arg=-lc10_cuda");
        println!("cargo:rustc-link-arg=-Wl,--as-needed");
    } else if lib.join("libtorch_cuda.so").exists() {
        println!("cargo:rustc-link-arg=-Wl,--no-as-needed");
        println!("cargo:rustc-link-arg=-ltorch_cuda");
        println!("cargo:rustc-link-arg=-ltorch");
        println!("cargo:rustc-link-arg=-Wl,--as-needed");
    } else {
        println!(
            "cargo:warning=no libtorch_cuda.so in {}: this build has no CUDA",
            lib.display()
        );
    }
    // The wheel's libtorch_cuda.so needs CUDA libraries (cuBLAS, cuDNN, NCCL, ...) that come
    // from separate nvidia-* wheels at run time; they need not exist where this is built.
    println!("cargo:rustc-link-arg=-Wl,--allow-shlib-undefined");
}
