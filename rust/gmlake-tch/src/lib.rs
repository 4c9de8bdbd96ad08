//! gmlake for tch (libtorch) programs.
//!
//! tch has no allocator API: no `empty_cache`, no memory statistics. This crate installs
//! gmlake as the CUDA allocator of the libtorch the program links, at run time, and reads its
//! statistics, through the C API of `libgmlake_torch.so` (the same library Python's
//! `gmlake.enable()` uses), loaded with `dlopen`. It does not depend on tch.
//!
//! ```no_run
//! fn main() -> Result<(), Box<dyn std::error::Error>> {
//!     // First thing, before any CUDA tensor exists.
//!     let gm = gmlake_tch::install("")?;
//!     // ... build the model on tch::Device::Cuda(0) and train ...
//!     let stats = gm.stats(0)?;
//!     println!("{stats}");
//!     println!("utilization {:?}", stats.utilization());
//!     Ok(())
//! }
//! ```
//!
//! Where the library comes from, in order: the process itself when it already exports the
//! C API (a libtorch built with gmlake, or a preloaded library); else the path given to
//! [`install_from`]; else `$GMLAKE_LIBRARY`; else `libgmlake_torch.so` on the dynamic
//! loader's search path (`LD_LIBRARY_PATH`, ...) and beside the executable. The library must
//! be built for the torch minor version the program runs (tch 0.24: torch 2.11); the
//! install checks it.

mod api;
mod error;
mod stats;

use std::ffi::{c_int, CString};
use std::path::Path;
use std::sync::Mutex;

pub use error::Error;
pub use stats::{GmlakeCounters, Stat, StatArray, Stats};

use api::{Api, Attempt, Loaded};

/// The environment variable naming libgmlake_torch.so's path.
pub const LIBRARY_ENV: &str = "GMLAKE_LIBRARY";
/// The library's file name.
pub const LIBRARY_NAME: &str = "libgmlake_torch.so";
/// The allocator's name as PyTorch reports it (`CUDAAllocator::name()`).
pub const BACKEND_NAME: &str = "gmlake";

/// What [`install`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// This call made gmlake PyTorch's CUDA allocator.
    Installed,
    /// gmlake was already installed with this configuration (an earlier call, or another
    /// component of the process).
    AlreadyInstalled,
    /// The libtorch in the process was built with gmlake as its allocator: nothing was
    /// installed; the call confirmed that the active CUDA allocator is gmlake.
    BuiltIn,
}

/// What libgmlake_torch was built against (`gmlake_build_info`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BuildInfo {
    /// torch's full version, e.g. `2.11.0`.
    pub torch_version: String,
    /// The minor version that fixes the allocator interface, e.g. `2.11`.
    pub torch_minor: String,
    /// The C++ ABI (`_GLIBCXX_USE_CXX11_ABI`), 1 or 0.
    pub cxx11_abi: i64,
    /// Whether the library has the CUDA backend (false: a test build on the simulated device).
    pub cuda_backend: bool,
    /// CUDART_VERSION of the headers it was compiled with, e.g. 13000.
    pub cudart_version: Option<i64>,
    /// The JSON text as the library returned it.
    pub json: String,
}

impl BuildInfo {
    fn parse(json: String) -> Result<BuildInfo, Error> {
        let err = |detail: String| Error::Parse {
            function: "gmlake_build_info",
            detail,
        };
        let v: serde_json::Value = serde_json::from_str(&json).map_err(|e| err(e.to_string()))?;
        let s = |k: &str| v.get(k).and_then(|x| x.as_str()).unwrap_or("").to_string();
        Ok(BuildInfo {
            torch_version: s("torch_version"),
            torch_minor: s("torch_minor"),
            cxx11_abi: v.get("cxx11_abi").and_then(|x| x.as_i64()).unwrap_or(-1),
            cuda_backend: v
                .get("cuda_backend")
                .and_then(|x| x.as_bool())
                .unwrap_or(false),
            cudart_version: v.get("cudart_version").and_then(|x| x.as_i64()),
            json,
        })
    }
}

/// The library this process loaded (one per process: it is never unloaded).
static LOADED: Mutex<Option<&'static Loaded>> = Mutex::new(None);

/// Installs gmlake as the CUDA allocator of the libtorch this program links, with the
/// configuration `conf` (`key:value,...`, over `GMLAKE_CONF` and GMLake's variables; `""`
/// for the defaults). Call it before the first CUDA tensor: afterwards it fails with
/// [`Error::TooLate`]. The library is found as the crate documentation says.
pub fn install(conf: &str) -> Result<Installed, Error> {
    install_impl(None, conf)
}

/// As [`install`], with libgmlake_torch.so at `library` (unless the process already exports
/// gmlake's C API).
pub fn install_from(library: impl AsRef<Path>, conf: &str) -> Result<Installed, Error> {
    install_impl(Some(library.as_ref()), conf)
}

/// The handle of an active gmlake, if [`install`] succeeded earlier in this process (or the
/// process exports gmlake's C API and gmlake is active). Loads nothing from disk.
pub fn installed() -> Option<Installed> {
    let mut guard = LOADED.lock().unwrap_or_else(|e| e.into_inner());
    if guard.is_none() && api::torch_cuda_loaded() {
        if let Some(l) = api::from_process() {
            *guard = Some(Box::leak(Box::new(l)));
        }
    }
    let loaded = (*guard)?;
    drop(guard);
    let h = Installed {
        loaded,
        mode: Mode::AlreadyInstalled,
    };
    if h.installed_here() {
        Some(h)
    } else if h.active_backend().ok().as_deref() == Some(BACKEND_NAME) {
        Some(Installed {
            mode: Mode::BuiltIn,
            ..h
        })
    } else {
        None
    }
}

fn install_impl(library: Option<&Path>, conf: &str) -> Result<Installed, Error> {
    if !api::torch_cuda_loaded() {
        return Err(Error::TorchCudaNotLoaded);
    }
    let loaded = load(library)?;
    install_with(loaded, conf)
}

/// Finds and loads the library (once per process).
fn load(library: Option<&Path>) -> Result<&'static Loaded, Error> {
    let mut guard = LOADED.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(l) = *guard {
        if let Some(asked) = library {
            let same = l.origin == "this process"
                || std::fs::canonicalize(&l.origin).ok() == std::fs::canonicalize(asked).ok();
            if !same {
                return Err(Error::AlreadyLoaded {
                    loaded: l.origin.clone(),
                    asked: asked.to_path_buf(),
                });
            }
        }
        return Ok(l);
    }
    let found = if let Some(l) = api::from_process() {
        l
    } else {
        let candidates = match (library, std::env::var_os(LIBRARY_ENV)) {
            (Some(p), _) => vec![p.to_path_buf()],
            (None, Some(p)) if !p.is_empty() => vec![p.into()],
            _ => api::default_candidates(),
        };
        let mut tried = Vec::new();
        let mut found = None;
        for c in &candidates {
            match api::open(c)? {
                Attempt::Loaded(l) => {
                    found = Some(l);
                    break;
                }
                Attempt::Missing(what) => tried.push(what),
            }
        }
        found.ok_or(Error::LibraryNotFound { tried })?
    };
    let l: &'static Loaded = Box::leak(Box::new(found));
    *guard = Some(l);
    Ok(l)
}

/// The install steps on a loaded API (separate from loading, for the tests' mock API).
fn install_with(loaded: &'static Loaded, conf: &str) -> Result<Installed, Error> {
    let h = Installed {
        loaded,
        mode: Mode::Installed,
    };
    let c_conf = CString::new(conf).map_err(|_| {
        Error::Config(format!(
            "gmlake configuration contains a NUL byte: {conf:?}"
        ))
    })?;
    if !h.installed_here() {
        if let Ok(name) = h.active_backend() {
            if name == BACKEND_NAME {
                // A libtorch built with gmlake: confirm only.
                if !conf.is_empty() {
                    return Err(Error::AlreadyInstalled(format!(
                        "gmlake is built into this libtorch and already active; its \
                         configuration comes from GMLAKE_CONF and GMLake's variables at startup \
                         and cannot be set by install({conf:?}). Call install(\"\") to confirm \
                         it is active"
                    )));
                }
                return Ok(Installed {
                    mode: Mode::BuiltIn,
                    ..h
                });
            }
        }
    }
    let was_installed = h.installed_here();
    // SAFETY: a NUL-terminated string that outlives the call.
    let rc = unsafe { (loaded.api.install)(c_conf.as_ptr()) };
    if rc != 0 {
        return Err(error::classify_install_error(h.last_error()));
    }
    if !h.installed_here() {
        return Err(Error::Install(format!(
            "gmlake: gmlake_install succeeded but gmlake is not the current CUDA allocator \
             (library: {})",
            loaded.origin
        )));
    }
    Ok(Installed {
        mode: if was_installed {
            Mode::AlreadyInstalled
        } else {
            Mode::Installed
        },
        ..h
    })
}

/// A handle on the installed (or built-in) gmlake: statistics, cache, settings. Cheap to
/// copy; valid for the life of the process.
#[derive(Clone, Copy)]
pub struct Installed {
    loaded: &'static Loaded,
    mode: Mode,
}

impl std::fmt::Debug for Installed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Installed")
            .field("mode", &self.mode)
            .field("library", &self.loaded.origin)
            .finish()
    }
}

impl Installed {
    fn api(&self) -> &Api {
        &self.loaded.api
    }

    fn last_error(&self) -> String {
        // SAFETY: returns a NUL-terminated string, copied at once.
        let m = api::text(unsafe { (self.api().last_error)() });
        if m.is_empty() {
            "gmlake: unknown error (gmlake_last_error is empty)".to_string()
        } else {
            m
        }
    }

    fn call_error(&self, function: &'static str) -> Error {
        let message = self.last_error();
        if message.contains("not installed") {
            Error::NotInstalled(format!("gmlake: {function}: {message}"))
        } else {
            Error::Call { function, message }
        }
    }

    fn installed_here(&self) -> bool {
        // SAFETY: no arguments; the C function catches everything.
        unsafe { (self.api().is_installed)() == 1 }
    }

    /// What [`install`] did.
    pub fn mode(&self) -> Mode {
        self.mode
    }

    /// Where the C API came from: the library's path, or "this process".
    pub fn library(&self) -> &str {
        &self.loaded.origin
    }

    /// Whether gmlake is PyTorch's current CUDA allocator now.
    pub fn is_active(&self) -> bool {
        self.installed_here() || self.active_backend().ok().as_deref() == Some(BACKEND_NAME)
    }

    /// The name of PyTorch's current CUDA allocator (`gmlake`, `native`, ...). Needs the
    /// library's `gmlake_active_backend`, except while gmlake itself is installed.
    pub fn active_backend(&self) -> Result<String, Error> {
        match self.api().active_backend {
            Some(f) => api::buffered(|b, l| {
                // SAFETY: `b` has `l` bytes (or is NULL with l = 0).
                unsafe { f(b, l) }
            })
            .map_err(|_| self.call_error("gmlake_active_backend")),
            None if self.installed_here() => Ok(BACKEND_NAME.to_string()),
            None => Err(Error::Unsupported {
                function: "gmlake_active_backend",
                what: "reading the active CUDA allocator's name",
            }),
        }
    }

    /// What the library was built against.
    pub fn build_info(&self) -> Result<BuildInfo, Error> {
        // SAFETY: no arguments; returns a NUL-terminated string, copied at once.
        BuildInfo::parse(api::text(unsafe { (self.api().build_info)() }))
    }

    /// The statistics of CUDA device `device` as the library's JSON text (the keys of
    /// `torch.cuda.memory_stats()` plus `gmlake.*`).
    /// `{}` while gmlake has no allocator for the device (CUDA not initialized yet).
    pub fn stats_json(&self, device: i32) -> Result<String, Error> {
        if device >= 0 && self.device_count().is_ok_and(|n| device >= n) {
            return Ok("{}".to_string());
        }
        let f = self.api().stats_json;
        api::buffered(|b, l| {
            // SAFETY: `b` has `l` bytes (or is NULL with l = 0).
            unsafe { f(device as c_int, b, l) }
        })
        .map_err(|_| self.call_error("gmlake_stats_json"))
    }

    /// The statistics of CUDA device `device`, with PyTorch's `DeviceStats` names.
    pub fn stats(&self, device: i32) -> Result<Stats, Error> {
        Stats::from_json(&self.stats_json(device)?)
    }

    /// gmlake's view of `device`'s memory as JSON: segments (mapped runs) with their blocks,
    /// stitched flags, pages, page size, configuration.
    pub fn snapshot_json(&self, device: i32) -> Result<String, Error> {
        let f = self.api().snapshot_json.ok_or(Error::Unsupported {
            function: "gmlake_snapshot_json",
            what: "the snapshot",
        })?;
        api::buffered(|b, l| {
            // SAFETY: `b` has `l` bytes (or is NULL with l = 0).
            unsafe { f(device as c_int, b, l) }
        })
        .map_err(|_| self.call_error("gmlake_snapshot_json"))
    }

    /// The effective configuration, `backend:gmlake,key:value,...`.
    pub fn settings(&self) -> Result<String, Error> {
        let f = self.api().settings.ok_or(Error::Unsupported {
            function: "gmlake_settings",
            what: "reading the settings",
        })?;
        api::buffered(|b, l| {
            // SAFETY: `b` has `l` bytes (or is NULL with l = 0).
            unsafe { f(b, l) }
        })
        .map_err(|_| self.call_error("gmlake_settings"))
    }

    /// The number of devices torch initialized the allocator for (0 before CUDA starts).
    pub fn device_count(&self) -> Result<i32, Error> {
        let f = self.api().device_count.ok_or(Error::Unsupported {
            function: "gmlake_device_count",
            what: "the device count",
        })?;
        // SAFETY: no arguments; the C function catches everything.
        let n = unsafe { f() };
        if n < 0 {
            Err(self.call_error("gmlake_device_count"))
        } else {
            Ok(n)
        }
    }

    /// Returns the cached free memory of every device to the GPU (PyTorch's
    /// `torch.cuda.empty_cache()`): the pages no live tensor uses are unmapped and released.
    pub fn empty_cache(&self) -> Result<(), Error> {
        let f = self.api().empty_cache.ok_or(Error::Unsupported {
            function: "gmlake_empty_cache",
            what: "empty_cache",
        })?;
        // SAFETY: no arguments; the C function catches everything.
        if unsafe { f() } != 0 {
            return Err(self.call_error("gmlake_empty_cache"));
        }
        Ok(())
    }

    /// Checks a configuration (over the environment) without installing: Ok, or
    /// [`Error::Config`] naming the key and the value.
    pub fn check_conf(&self, conf: &str) -> Result<(), Error> {
        let f = self.api().check_conf.ok_or(Error::Unsupported {
            function: "gmlake_check_conf",
            what: "checking a configuration",
        })?;
        let c = CString::new(conf).map_err(|_| {
            Error::Config(format!(
                "gmlake configuration contains a NUL byte: {conf:?}"
            ))
        })?;
        // SAFETY: a NUL-terminated string that outlives the call.
        if unsafe { f(c.as_ptr()) } != 0 {
            return Err(Error::Config(self.last_error()));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests;
