//! The crate against a real libgmlake_torch.so and torch's libraries, on a machine without a
//! GPU: the install succeeds (CUDA is never initialized here), the accessors answer.
//!
//! Runs only when GMLAKE_TCH_TEST_LIBRARY names the library and GMLAKE_TCH_TEST_TORCH_LIB the
//! torch/lib folder it was built against (and GMLAKE_TCH_TEST_CUDART, the folder holding
//! libcudart.so.N, when torch/lib lacks it); scripts/build-tch-example.sh sets them.
//! Otherwise it passes with a note.

use std::path::PathBuf;

fn env_path(name: &str) -> Option<PathBuf> {
    std::env::var_os(name)
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
}

/// Runs `f` on a thread and fails the test if it takes longer than a minute (a deadlock in
/// the library would otherwise hang the test run).
fn within<T: Send + 'static>(what: &str, f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(std::time::Duration::from_secs(60))
        .unwrap_or_else(|_| panic!("{what}: no answer within 60 s (deadlock in the library?)"))
}

/// Loads `path` with RTLD_GLOBAL and keeps it, as a tch program's startup would.
fn preload(path: &std::path::Path) {
    use libloading::os::unix::{Library, RTLD_GLOBAL, RTLD_NOW};
    // SAFETY: torch's libraries and the CUDA runtime; their initializers need no GPU.
    let lib = unsafe { Library::open(Some(path), RTLD_NOW | RTLD_GLOBAL) }
        .unwrap_or_else(|e| panic!("cannot preload {}: {e:?}", path.display()));
    std::mem::forget(lib);
}

#[test]
fn installs_into_torch_without_a_gpu() {
    let (Some(library), Some(torch_lib)) = (
        env_path("GMLAKE_TCH_TEST_LIBRARY"),
        env_path("GMLAKE_TCH_TEST_TORCH_LIB"),
    ) else {
        eprintln!(
            "note: GMLAKE_TCH_TEST_LIBRARY / GMLAKE_TCH_TEST_TORCH_LIB unset: real-library test \
             skipped"
        );
        return;
    };

    // Before torch is loaded, the install is refused.
    assert_eq!(
        gmlake_tch::install_from(&library, "").unwrap_err(),
        gmlake_tch::Error::TorchCudaNotLoaded
    );

    if let Some(cudart_dir) = env_path("GMLAKE_TCH_TEST_CUDART") {
        let cudart = std::fs::read_dir(&cudart_dir)
            .unwrap()
            .filter_map(|e| e.ok().map(|e| e.path()))
            .find(|p| {
                p.file_name()
                    .is_some_and(|n| n.to_string_lossy().starts_with("libcudart.so."))
            })
            .expect("no libcudart.so.N in GMLAKE_TCH_TEST_CUDART");
        preload(&cudart);
    }
    preload(&torch_lib.join("libc10.so"));
    preload(&torch_lib.join("libc10_cuda.so"));

    // A configuration error names the key and the value, and installs nothing.
    let lib = library.clone();
    let e = within("install with a bad configuration", move || {
        gmlake_tch::install_from(&lib, "fragLimit:lots")
    })
    .unwrap_err();
    assert!(matches!(e, gmlake_tch::Error::Config(_)), "{e:?}");
    assert!(e.to_string().contains("lots"), "{e}");

    let lib = library.clone();
    let gm = within("install", move || gmlake_tch::install_from(&lib, "")).expect("install");
    assert_eq!(gm.mode(), gmlake_tch::Mode::Installed);
    assert!(gm.is_active());
    assert_eq!(gm.active_backend().unwrap(), "gmlake");
    let info = gm.build_info().unwrap();
    assert_eq!(info.torch_minor, "2.11", "{}", info.json);
    assert_eq!(info.cxx11_abi, 1);
    eprintln!("build info: {}", info.json);
    let settings = gm.settings().unwrap();
    assert!(settings.starts_with("backend:gmlake"), "{settings}");
    assert_eq!(
        gm.device_count().unwrap(),
        0,
        "CUDA initialized on a CPU machine?"
    );
    // No device was initialized: the statistics are empty.
    let s = gm.stats(0).unwrap();
    assert!(!s.initialized, "{s:?}");
    assert_eq!(s, gmlake_tch::Stats::default());
    match gm.empty_cache() {
        Ok(()) => eprintln!("empty_cache: ok"),
        Err(e) => eprintln!("empty_cache: {e}"),
    }

    // Again with the same configuration: confirmed; with another: refused.
    let again = within("second install", move || {
        gmlake_tch::install_from(&library, "")
    })
    .unwrap();
    assert_eq!(again.mode(), gmlake_tch::Mode::AlreadyInstalled);
    let e = within("install with another configuration", || {
        gmlake_tch::install("autoGC:1")
    })
    .unwrap_err();
    assert!(matches!(e, gmlake_tch::Error::AlreadyInstalled(_)), "{e:?}");
    assert!(gmlake_tch::installed().is_some());
}
