//! libgmlake_torch.so's C API (cpp/gmlake_torch.cpp), resolved at run time.
//!
//! The library is never unloaded: PyTorch keeps calling the allocator it installed until the
//! process exits, so the handle is leaked and the function pointers stay valid.

use std::ffi::{c_char, c_int, c_longlong, CStr};
use std::path::{Path, PathBuf};

use libloading::os::unix::{Library, RTLD_LOCAL, RTLD_NOW};

use crate::Error;

/// glibc's RTLD_NOLOAD (not exported by libloading).
const RTLD_NOLOAD: c_int = 0x0004;

pub(crate) type InstallFn = unsafe extern "C" fn(*const c_char) -> c_int;
pub(crate) type IntFn = unsafe extern "C" fn() -> c_int;
pub(crate) type TextFn = unsafe extern "C" fn() -> *const c_char;
pub(crate) type DeviceBufFn = unsafe extern "C" fn(c_int, *mut c_char, usize) -> c_longlong;
pub(crate) type BufFn = unsafe extern "C" fn(*mut c_char, usize) -> c_longlong;

/// The functions of the C API. Required ones first; `None`: the library predates the function.
#[derive(Clone, Copy)]
pub(crate) struct Api {
    pub install: InstallFn,
    pub is_installed: IntFn,
    pub last_error: TextFn,
    pub build_info: TextFn,
    pub stats_json: DeviceBufFn,
    pub snapshot_json: Option<DeviceBufFn>,
    pub settings: Option<BufFn>,
    pub device_count: Option<IntFn>,
    pub check_conf: Option<InstallFn>,
    /// `int gmlake_empty_cache(void)`: 0, or -1 with gmlake_last_error().
    pub empty_cache: Option<IntFn>,
    /// `long long gmlake_active_backend(char*, size_t)`: the name of PyTorch's current CUDA
    /// allocator (`native`, `cudaMallocAsync`, `gmlake`), whoever installed it.
    pub active_backend: Option<BufFn>,
}

/// The C API and where it came from.
pub(crate) struct Loaded {
    pub api: Api,
    /// The library's path, or "this process" when the process already exports the API
    /// (a libtorch built with gmlake, or a preloaded library).
    pub origin: String,
}

/// The names of the C API's functions.
pub(crate) const REQUIRED: [&str; 5] = [
    "gmlake_install",
    "gmlake_is_installed",
    "gmlake_last_error",
    "gmlake_build_info",
    "gmlake_stats_json",
];

/// Resolves the API in `lib`; Err(name) for the first missing required function.
fn resolve(lib: &Library) -> Result<Api, &'static str> {
    // SAFETY (both): the types are those of cpp/gmlake_torch.cpp's extern "C" declarations,
    // and the library is never unloaded (see the module's comment).
    fn req<T: Copy>(lib: &Library, name: &'static str) -> Result<T, &'static str> {
        unsafe { lib.get::<T>(name).map(|s| *s).map_err(|_| name) }
    }
    fn opt<T: Copy>(lib: &Library, name: &str) -> Option<T> {
        unsafe { lib.get::<T>(name).ok().map(|s| *s) }
    }
    Ok(Api {
        install: req(lib, REQUIRED[0])?,
        is_installed: req(lib, REQUIRED[1])?,
        last_error: req(lib, REQUIRED[2])?,
        build_info: req(lib, REQUIRED[3])?,
        stats_json: req(lib, REQUIRED[4])?,
        snapshot_json: opt(lib, "gmlake_snapshot_json"),
        settings: opt(lib, "gmlake_settings"),
        device_count: opt(lib, "gmlake_device_count"),
        check_conf: opt(lib, "gmlake_check_conf"),
        empty_cache: opt(lib, "gmlake_empty_cache"),
        active_backend: opt(lib, "gmlake_active_backend"),
    })
}

/// Whether torch's CUDA library is loaded in this process (by its soname).
pub(crate) fn torch_cuda_loaded() -> bool {
    // SAFETY: RTLD_NOLOAD loads nothing (no initializers run); dropping the handle only
    // releases the reference this call took.
    unsafe { Library::open(Some("libc10_cuda.so"), RTLD_NOW | RTLD_NOLOAD).is_ok() }
}

/// The API when the process already exports it (global scope).
pub(crate) fn from_process() -> Option<Loaded> {
    let this = Library::this();
    let api = resolve(&this).ok()?;
    std::mem::forget(this);
    Some(Loaded {
        api,
        origin: "this process".to_string(),
    })
}

/// The outcome of one dlopen attempt.
pub(crate) enum Attempt {
    Loaded(Loaded),
    /// Nothing at that name (the next candidate may be tried).
    Missing(String),
}

/// Loads `name` (a path, or a bare file name searched by the dynamic loader).
pub(crate) fn open(name: &Path) -> Result<Attempt, Error> {
    let has_dir = name.as_os_str().to_string_lossy().contains('/');
    if has_dir && !name.exists() {
        return Ok(Attempt::Missing(name.display().to_string()));
    }
    // SAFETY: loading runs the library's initializers; libgmlake_torch's only register
    // nothing with torch (installation is an explicit call).
    let lib = match unsafe { Library::open(Some(name), RTLD_NOW | RTLD_LOCAL) } {
        Ok(lib) => lib,
        Err(e) => {
            // libloading's Display is "dlopen failed"; dlerror()'s text is the source.
            let detail =
                std::error::Error::source(&e).map_or_else(|| e.to_string(), |s| s.to_string());
            if !has_dir && detail.contains("No such file") {
                return Ok(Attempt::Missing(format!(
                    "{} (dynamic loader search path)",
                    name.display()
                )));
            }
            return Err(Error::LibraryLoad {
                path: name.to_path_buf(),
                detail,
            });
        }
    };
    let api = resolve(&lib).map_err(|missing| Error::NotGmlake {
        path: name.to_path_buf(),
        missing: missing.to_string(),
    })?;
    std::mem::forget(lib); // never unloaded
    Ok(Attempt::Loaded(Loaded {
        api,
        origin: name.display().to_string(),
    }))
}

/// The places searched when no path is given and GMLAKE_LIBRARY is unset.
pub(crate) fn default_candidates() -> Vec<PathBuf> {
    let mut v = vec![PathBuf::from(crate::LIBRARY_NAME)];
    if let Some(dir) = std::env::current_exe()
        .ok()
        .and_then(|e| e.parent().map(Path::to_path_buf))
    {
        v.push(dir.join(crate::LIBRARY_NAME));
    }
    v
}

/// Copies a C string (NULL: empty).
pub(crate) fn text(p: *const c_char) -> String {
    if p.is_null() {
        return String::new();
    }
    // SAFETY: the C API returns NUL-terminated strings valid until the next call from this
    // thread; this copies at once.
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

/// Calls a "length first, then copy" function of the C API: returns its text, or the
/// negative return value.
pub(crate) fn buffered(
    mut call: impl FnMut(*mut c_char, usize) -> c_longlong,
) -> Result<String, c_longlong> {
    let mut len = call(std::ptr::null_mut(), 0);
    // The text can grow between the two calls (statistics move): retry with the new length.
    for _ in 0..8 {
        if len < 0 {
            return Err(len);
        }
        let cap = len as usize + 1 + 256;
        let mut buf = vec![0u8; cap];
        let n = call(buf.as_mut_ptr().cast(), cap);
        if n < 0 {
            return Err(n);
        }
        if (n as usize) < cap {
            buf.truncate(n as usize);
            return Ok(String::from_utf8_lossy(&buf).into_owned());
        }
        len = n;
    }
    Err(-1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffered_retries_when_the_text_grows() {
        let texts = ["short", &"x".repeat(1000)];
        let mut calls = 0;
        let out = buffered(|buf, len| {
            // The first (length) call sees the short text, later ones the long one.
            let t = texts[usize::from(calls > 0)];
            calls += 1;
            if !buf.is_null() && len > t.len() {
                // SAFETY: `buf` has `len` bytes.
                unsafe {
                    std::ptr::copy_nonoverlapping(t.as_ptr(), buf.cast(), t.len());
                    *buf.add(t.len()) = 0;
                }
            }
            t.len() as c_longlong
        })
        .unwrap();
        assert_eq!(out.len(), 1000);
        assert_eq!(calls, 3);
        assert_eq!(buffered(|_, _| -1), Err(-1));
    }

    #[test]
    fn missing_paths_and_non_libraries() {
        let p = Path::new("/nonexistent/libgmlake_torch.so");
        assert!(matches!(open(p), Ok(Attempt::Missing(_))));
        assert!(matches!(
            open(Path::new("libgmlake_torch_surely_absent.so")),
            Ok(Attempt::Missing(_))
        ));
        // A real library without the API: libc.
        let libc = Path::new("libc.so.6");
        match open(libc) {
            Err(Error::NotGmlake { missing, .. }) => assert_eq!(missing, "gmlake_install"),
            Err(e) => panic!("{e}"),
            Ok(_) => panic!("libc taken for libgmlake_torch"),
        }
        // A file that is no library.
        let dir = std::env::temp_dir().join(format!("gmlake-tch-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let junk = dir.join("libjunk.so");
        std::fs::write(&junk, b"not an ELF file").unwrap();
        assert!(matches!(open(&junk), Err(Error::LibraryLoad { .. })));
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn this_test_binary_has_no_torch() {
        assert!(!torch_cuda_loaded());
        assert!(from_process().is_none());
    }
}
