//! Errors of the run-time install and of the accessors.

use std::fmt;
use std::path::PathBuf;

/// What went wrong. Every variant's message says what to do about it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Error {
    /// No `libc10_cuda.so` is loaded in this process: the program does not link a CUDA build
    /// of libtorch (or the linker dropped `libtorch_cuda.so`), so there is no CUDA allocator
    /// to replace. Loading libgmlake_torch.so now would pull in a second copy of torch.
    TorchCudaNotLoaded,
    /// libgmlake_torch.so was not found. `tried` lists the places looked at.
    LibraryNotFound { tried: Vec<String> },
    /// The library exists but the dynamic loader refused it (`detail` is its message:
    /// typically an undefined symbol, i.e. a library built for another torch version).
    LibraryLoad { path: PathBuf, detail: String },
    /// The library lacks a function of gmlake's C API: it is not libgmlake_torch, or an
    /// incompatible version of it.
    NotGmlake { path: PathBuf, missing: String },
    /// libgmlake_torch was already loaded from another path in this process.
    AlreadyLoaded { loaded: String, asked: PathBuf },
    /// CUDA (the current CUDA allocator) was already initialized: gmlake must be installed
    /// before the first CUDA tensor.
    TooLate(String),
    /// The library was built for another torch (minor) version than the one running.
    VersionMismatch(String),
    /// The library and the running torch use different C++ ABIs.
    AbiMismatch(String),
    /// An invalid configuration value (the message names the key and the value).
    Config(String),
    /// gmlake is already installed with another configuration.
    AlreadyInstalled(String),
    /// Any other refusal of `gmlake_install`.
    Install(String),
    /// gmlake is not PyTorch's current CUDA allocator (or not installed by this library).
    NotInstalled(String),
    /// The loaded library does not offer this function (an older libgmlake_torch).
    Unsupported {
        function: &'static str,
        what: &'static str,
    },
    /// A C function of the library reported an error.
    Call {
        function: &'static str,
        message: String,
    },
    /// The library returned text that does not parse.
    Parse {
        function: &'static str,
        detail: String,
    },
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::TorchCudaNotLoaded => write!(
                f,
                "gmlake: libc10_cuda.so is not loaded in this process, so there is no CUDA \
                 allocator to replace. Link a CUDA build of libtorch (tch: LIBTORCH pointing at \
                 a CUDA libtorch or torch install) and make sure libtorch_cuda.so stays linked \
                 (pass -Wl,--no-as-needed -ltorch_cuda, as examples/tch-train/build.rs does)"
            ),
            Error::LibraryNotFound { tried } => write!(
                f,
                "gmlake: libgmlake_torch.so not found (tried: {}). Set GMLAKE_LIBRARY to its \
                 path, or pass the path to gmlake_tch::install_from()",
                tried.join(", ")
            ),
            Error::LibraryLoad { path, detail } => write!(
                f,
                "gmlake: cannot load {}: {detail}. An undefined symbol usually means the \
                 library was built for another torch version than the one this program links",
                path.display()
            ),
            Error::NotGmlake { path, missing } => write!(
                f,
                "gmlake: {} is not a compatible libgmlake_torch (it has no `{missing}`)",
                path.display()
            ),
            Error::AlreadyLoaded { loaded, asked } => write!(
                f,
                "gmlake: libgmlake_torch is already loaded from {loaded}; cannot load {} too",
                asked.display()
            ),
            Error::TooLate(m) => write!(
                f,
                "{m}. In a tch program, call gmlake_tch::install() first thing in main(), \
                 before any CUDA tensor, module or VarStore is created"
            ),
            Error::VersionMismatch(m)
            | Error::AbiMismatch(m)
            | Error::Config(m)
            | Error::AlreadyInstalled(m)
            | Error::Install(m)
            | Error::NotInstalled(m) => f.write_str(m),
            Error::Unsupported { function, what } => write!(
                f,
                "gmlake: {what} is not supported by the loaded libgmlake_torch (it has no \
                 `{function}`); rebuild it from a newer gmlake"
            ),
            Error::Call { function, message } => write!(f, "gmlake: {function} failed: {message}"),
            Error::Parse { function, detail } => {
                write!(f, "gmlake: cannot parse the output of {function}: {detail}")
            }
        }
    }
}

impl std::error::Error for Error {}

/// Classifies a failure message of `gmlake_install` (the C API reports -1 plus text).
pub(crate) fn classify_install_error(message: String) -> Error {
    let m = message.as_str();
    if m.contains("already initialized") {
        // The library's hint is for Python users (gmlake.enable()); Display adds tch's.
        let core = match m.find(" Install gmlake before") {
            Some(i) => m[..i].trim_end_matches('.').to_string(),
            None => m.trim_end_matches('.').to_string(),
        };
        Error::TooLate(core)
    } else if m.contains("_GLIBCXX_USE_CXX11_ABI") {
        Error::AbiMismatch(message)
    } else if m.contains("was built for torch") {
        Error::VersionMismatch(message)
    } else if m.contains("already installed") {
        Error::AlreadyInstalled(message)
    } else if m.contains("configuration") {
        Error::Config(message)
    } else {
        Error::Install(message)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classifies_the_libraries_messages() {
        let late = "gmlake cannot be installed: CUDA is already initialized in this process (the \
                    current CUDA allocator, \"native\", has been used). Install gmlake before \
                    anything touches CUDA: call gmlake.enable() right after `import torch`.";
        let e = classify_install_error(late.to_string());
        let Error::TooLate(core) = &e else {
            panic!("{e:?}")
        };
        assert!(!core.contains("gmlake.enable"), "{core}");
        assert!(core.ends_with("has been used)"), "{core}");
        assert!(e.to_string().contains("gmlake_tch::install()"));

        let v = "gmlake cannot be installed: libgmlake_torch was built for torch 2.11.0 but torch \
                 2.10.1 is running (from /x/torch/version.py).";
        assert!(matches!(
            classify_install_error(v.into()),
            Error::VersionMismatch(_)
        ));
        let a = "gmlake cannot be installed: libgmlake_torch was built with \
                 _GLIBCXX_USE_CXX11_ABI=1 but the running torch uses 0.";
        assert!(matches!(
            classify_install_error(a.into()),
            Error::AbiMismatch(_)
        ));
        let c = "gmlake configuration: invalid value \"x\" for fragLimit";
        assert!(matches!(classify_install_error(c.into()), Error::Config(_)));
        let i = "gmlake is already installed (configuration \"\"); its configuration cannot \
                 change after installation (asked: \"autoGC:1\")";
        assert!(matches!(
            classify_install_error(i.into()),
            Error::AlreadyInstalled(_)
        ));
        assert!(matches!(
            classify_install_error("something else".into()),
            Error::Install(_)
        ));
    }
}
