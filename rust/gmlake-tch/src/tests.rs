//! The install logic and the accessors on a mock of the C API (no torch, no GPU).

use super::*;
use std::ffi::{c_char, c_longlong, CStr};
use std::sync::MutexGuard;

/// The mock's state; one test at a time (SERIAL).
struct Mock {
    /// Whether torch's allocator was initialized (CUDA used) before the install.
    cuda_initialized: bool,
    /// The active allocator's name.
    backend: String,
    /// gmlake installed by this (mock) library, with this configuration.
    installed_conf: Option<String>,
    stats: String,
    error: CString,
    empty_cache_calls: usize,
}

static MOCK: Mutex<Option<Mock>> = Mutex::new(None);
static SERIAL: Mutex<()> = Mutex::new(());

fn with<R>(f: impl FnOnce(&mut Mock) -> R) -> R {
    f(MOCK.lock().unwrap().as_mut().expect("mock not set up"))
}

fn fail(m: &mut Mock, msg: &str) -> c_int {
    m.error = CString::new(msg).unwrap();
    -1
}

fn copy_out(s: &str, buf: *mut c_char, len: usize) -> c_longlong {
    if !buf.is_null() && len > s.len() {
        // SAFETY: the caller gives `len` bytes.
        unsafe {
            std::ptr::copy_nonoverlapping(s.as_ptr(), buf.cast(), s.len());
            *buf.add(s.len()) = 0;
        }
    }
    s.len() as c_longlong
}

unsafe extern "C" fn m_install(conf: *const c_char) -> c_int {
    // SAFETY: the caller passes a C string.
    let conf = unsafe { CStr::from_ptr(conf) }
        .to_str()
        .unwrap()
        .to_string();
    with(|m| {
        if let Some(c) = &m.installed_conf {
            if *c == conf {
                return 0;
            }
            let msg = format!("gmlake is already installed (configuration \"{c}\"); its configuration cannot change after installation (asked: \"{conf}\")");
            return fail(m, &msg);
        }
        if m.cuda_initialized {
            let msg = format!("gmlake cannot be installed: CUDA is already initialized in this process (the current CUDA allocator, \"{}\", has been used). Install gmlake before anything touches CUDA: call gmlake.enable() right after `import torch`, or start the program with `python -m gmlake script.py`.", m.backend);
            return fail(m, &msg);
        }
        if conf.contains("fragLimit:x") {
            return fail(m, "gmlake configuration: invalid value \"x\" for fragLimit");
        }
        m.installed_conf = Some(conf);
        m.backend = "gmlake".into();
        0
    })
}

unsafe extern "C" fn m_is_installed() -> c_int {
    with(|m| c_int::from(m.installed_conf.is_some()))
}

unsafe extern "C" fn m_last_error() -> *const c_char {
    // The CString lives in the static mock until the next failure.
    with(|m| m.error.as_ptr())
}

unsafe extern "C" fn m_build_info() -> *const c_char {
    c"{\"torch_version\":\"2.11.0\",\"torch_minor\":\"2.11\",\"cxx11_abi\":1,\"cuda_backend\":true,\"cudart_version\":13000}".as_ptr()
}

unsafe extern "C" fn m_stats_json(device: c_int, buf: *mut c_char, len: usize) -> c_longlong {
    with(|m| {
        if m.installed_conf.is_none() {
            return c_longlong::from(fail(m, "gmlake is not installed"));
        }
        if device != 0 {
            return copy_out("{}", buf, len);
        }
        copy_out(&m.stats, buf, len)
    })
}

unsafe extern "C" fn m_empty_cache() -> c_int {
    with(|m| {
        if m.installed_conf.is_none() {
            return fail(m, "gmlake is not installed");
        }
        m.empty_cache_calls += 1;
        0
    })
}

unsafe extern "C" fn m_active_backend(buf: *mut c_char, len: usize) -> c_longlong {
    with(|m| copy_out(&m.backend.clone(), buf, len))
}

/// A mock library: optional functions as given.
fn mock(
    cuda_initialized: bool,
    backend: &str,
    empty_cache: bool,
    active_backend: bool,
) -> (&'static Loaded, MutexGuard<'static, ()>) {
    let serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    *MOCK.lock().unwrap() = Some(Mock {
        cuda_initialized,
        backend: backend.into(),
        installed_conf: None,
        stats: r#"{"allocation.all.allocated":7,"reserved_bytes.all.peak":4194304,"active_bytes.all.peak":3145728,"gmlake.stitches":2,"gmlake.driver_ns":125000}"#.into(),
        error: CString::default(),
        empty_cache_calls: 0,
    });
    let api = Api {
        install: m_install,
        is_installed: m_is_installed,
        last_error: m_last_error,
        build_info: m_build_info,
        stats_json: m_stats_json,
        snapshot_json: None,
        settings: None,
        device_count: None,
        check_conf: None,
        empty_cache: empty_cache.then_some(m_empty_cache as api::IntFn),
        active_backend: active_backend.then_some(m_active_backend as api::BufFn),
    };
    let loaded = Box::leak(Box::new(Loaded {
        api,
        origin: "mock".into(),
    }));
    (loaded, serial)
}

#[test]
fn installs_reads_stats_and_empties_the_cache() {
    let (l, _s) = mock(false, "native", true, true);
    let gm = install_with(l, "").unwrap();
    assert_eq!(gm.mode(), Mode::Installed);
    assert!(gm.is_active());
    assert_eq!(gm.active_backend().unwrap(), "gmlake");
    assert_eq!(gm.library(), "mock");
    let s = gm.stats(0).unwrap();
    assert!(s.initialized);
    assert_eq!(s.allocation.all.allocated, 7);
    assert_eq!(s.gmlake.stitches, 2);
    assert_eq!(s.gmlake.driver_ns, 125_000);
    assert_eq!(s.utilization(), Some(0.75));
    assert!(!gm.stats(1).unwrap().initialized);
    gm.empty_cache().unwrap();
    assert_eq!(with(|m| m.empty_cache_calls), 1);
    let b = gm.build_info().unwrap();
    assert_eq!(b.torch_minor, "2.11");
    assert_eq!(b.cxx11_abi, 1);
    assert!(b.cuda_backend);
    assert_eq!(b.cudart_version, Some(13000));
    // Optional functions the mock lacks.
    assert!(matches!(
        gm.snapshot_json(0),
        Err(Error::Unsupported {
            function: "gmlake_snapshot_json",
            ..
        })
    ));
    assert!(matches!(gm.settings(), Err(Error::Unsupported { .. })));
    assert!(matches!(gm.device_count(), Err(Error::Unsupported { .. })));

    // A second install with the same configuration confirms; another one is refused.
    assert_eq!(install_with(l, "").unwrap().mode(), Mode::AlreadyInstalled);
    let e = install_with(l, "autoGC:1").unwrap_err();
    assert!(matches!(e, Error::AlreadyInstalled(_)), "{e}");
}

#[test]
fn too_late_once_cuda_is_initialized() {
    let (l, _s) = mock(true, "native", true, true);
    let e = install_with(l, "").unwrap_err();
    assert!(matches!(e, Error::TooLate(_)), "{e:?}");
    let msg = e.to_string();
    assert!(msg.contains("CUDA is already initialized"), "{msg}");
    assert!(msg.contains("\"native\""), "{msg}");
    assert!(msg.contains("gmlake_tch::install()"), "{msg}");
    assert!(!msg.contains("gmlake.enable"), "{msg}");
    // Without gmlake installed, the accessors say so.
    let h = Installed {
        loaded: l,
        mode: Mode::Installed,
    };
    assert!(!h.is_active());
    assert_eq!(h.active_backend().unwrap(), "native");
    assert!(matches!(h.stats(0), Err(Error::NotInstalled(_))));
    assert!(matches!(h.empty_cache(), Err(Error::NotInstalled(_))));
}

#[test]
fn configuration_errors_name_the_value() {
    let (l, _s) = mock(false, "native", false, false);
    let e = install_with(l, "fragLimit:x").unwrap_err();
    assert!(matches!(e, Error::Config(_)), "{e:?}");
    assert!(e.to_string().contains("\"x\""));
    let e = install_with(l, "a\0b").unwrap_err();
    assert!(matches!(e, Error::Config(_)), "{e:?}");
}

#[test]
fn built_in_gmlake_is_only_confirmed() {
    // A libtorch built with gmlake: the active backend is "gmlake" although this library
    // installed nothing (and CUDA may be initialized already).
    let (l, _s) = mock(true, "gmlake", true, true);
    let gm = install_with(l, "").unwrap();
    assert_eq!(gm.mode(), Mode::BuiltIn);
    assert!(gm.is_active());
    assert_eq!(
        with(|m| m.installed_conf.clone()),
        None,
        "installed over it"
    );
    // A configuration cannot be applied there.
    let e = install_with(l, "autoGC:1").unwrap_err();
    assert!(matches!(e, Error::AlreadyInstalled(_)), "{e:?}");
    assert!(e.to_string().contains("built into this libtorch"));
}

#[test]
fn missing_optional_functions_are_reported_not_faked() {
    let (l, _s) = mock(false, "native", false, false);
    let gm = install_with(l, "").unwrap();
    let e = gm.empty_cache().unwrap_err();
    assert!(
        matches!(
            e,
            Error::Unsupported {
                function: "gmlake_empty_cache",
                ..
            }
        ),
        "{e:?}"
    );
    assert!(e.to_string().contains("gmlake_empty_cache"));
    // The backend name is known while gmlake itself is installed.
    assert_eq!(gm.active_backend().unwrap(), "gmlake");
    assert_eq!(with(|m| m.empty_cache_calls), 0);
}

#[test]
fn install_without_torch_in_the_process_is_refused() {
    // This test binary links no torch.
    let e = install("").unwrap_err();
    assert_eq!(e, Error::TorchCudaNotLoaded);
    assert!(e.to_string().contains("libc10_cuda.so"));
    assert!(installed().is_none());
}
