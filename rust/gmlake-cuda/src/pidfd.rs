//! Descriptors across processes for CUDA IPC: duplicating another process's descriptor with
//! `pidfd_open` + `pidfd_getfd` (Linux 5.6+), as PyTorch does for expandable segments, so no
//! socket is needed between the processes.

use gmlake_core::{DeviceError, DeviceResult};

/// A descriptor owned here, closed on drop.
pub(crate) struct LocalFd(i32);

impl LocalFd {
    pub(crate) fn raw(&self) -> i32 {
        self.0
    }
}

impl Drop for LocalFd {
    fn drop(&mut self) {
        close_fd(self.0);
    }
}

/// Closes a descriptor this crate owns (errors ignored: nothing to do about them).
pub(crate) fn close_fd(fd: i32) {
    // SAFETY: close(2) takes any integer; callers pass descriptors they own and never use
    // again (a LocalFd's, or a cached export removed from its map first).
    unsafe {
        libc::close(fd);
    }
}

fn errno_text() -> (i32, String) {
    let e = std::io::Error::last_os_error();
    (e.raw_os_error().unwrap_or(0), e.to_string())
}

fn refused(call: &str, pid: i32, fd: i32) -> DeviceError {
    let (code, text) = errno_text();
    let hint = match code {
        libc::ENOSYS => {
            " (the kernel lacks it: CUDA IPC of page-mapped memory needs Linux 5.6 or later)"
        }
        libc::EPERM => {
            " (the receiving process may not duplicate the sender's descriptors: run both as \
             the same user with /proc/sys/kernel/yama/ptrace_scope set to 0, or as root)"
        }
        libc::ESRCH => " (the sending process has exited)",
        libc::EBADF => " (the sender no longer has that page: it was freed and released)",
        _ => "",
    };
    DeviceError::Unavailable(format!(
        "{call} for descriptor {fd} of process {pid} failed: {text}{hint}"
    ))
}

/// Duplicates descriptor `fd` of process `pid` into this process.
pub(crate) fn dup_from_process(pid: i32, fd: i32) -> DeviceResult<LocalFd> {
    if pid <= 0 || fd < 0 {
        return Err(DeviceError::InvalidArgument(format!(
            "descriptor {fd} of process {pid}"
        )));
    }
    // SAFETY: pidfd_open takes a pid and flags (0) and returns a new descriptor or -1; no
    // memory is passed.
    let pidfd =
        unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::c_long, 0 as libc::c_long) };
    if pidfd < 0 {
        return Err(refused("pidfd_open", pid, fd));
    }
    let pidfd = LocalFd(pidfd as i32);
    // SAFETY: pidfd_getfd takes a pidfd we own, a descriptor number in that process and flags
    // (0); it returns a new descriptor or -1; no memory is passed.
    let local = unsafe {
        libc::syscall(
            libc::SYS_pidfd_getfd,
            pidfd.raw() as libc::c_long,
            fd as libc::c_long,
            0 as libc::c_long,
        )
    };
    if local < 0 {
        return Err(refused("pidfd_getfd", pid, fd));
    }
    Ok(LocalFd(local as i32))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn duplicates_a_descriptor_of_this_process() {
        let file = std::fs::File::open("/proc/self/stat").unwrap();
        use std::os::fd::AsRawFd;
        let pid = std::process::id() as i32;
        match dup_from_process(pid, file.as_raw_fd()) {
            Ok(fd) => assert!(fd.raw() >= 0 && fd.raw() != file.as_raw_fd()),
            // Only an old kernel (ENOSYS) or a sandbox refusing ptrace access (EPERM) may stand
            // in for success, and the error must say which.
            Err(e) => {
                let m = e.to_string();
                assert!(m.contains("Linux 5.6") || m.contains("ptrace_scope"), "{m}");
            }
        }
    }

    #[test]
    fn bad_descriptors_are_named() {
        let pid = std::process::id() as i32;
        let e = dup_from_process(pid, 1_000_000).err().unwrap().to_string();
        assert!(e.contains("1000000") && e.contains(&pid.to_string()), "{e}");
        assert!(dup_from_process(0, 3).is_err());
    }
}
