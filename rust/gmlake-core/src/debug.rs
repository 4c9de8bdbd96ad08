//! Memory debugging mode (`GMLAKE_CONF=debug:guard+canary+poison`): its configuration.
//!
//! Off by default; when off the allocator does one predictable branch more per allocation and
//! free. What each part does (the allocator's side is in `allocator/debug.rs`; canaries and
//! poison are written and checked by the C++ layer, which can launch work on streams):
//! - `guard`: each request of at least `debug_guard_min` bytes (default: one page) gets its
//!   own virtual range, its own pages, and an unmapped page right after them (virtual only, no
//!   physical memory). The block is placed at the end of its mapped pages, so a write past the
//!   rounded size faults at once. `guard_front` adds an unmapped page before the start too.
//! - `canary`: requests that are not guarded get `debug_canary_bytes` (default 64) more bytes,
//!   rounded to 512 with the request; the bytes after the request are filled with a pattern
//!   and checked when the block is freed.
//! - `poison`: freed blocks are filled with 0xFF bytes (a NaN in fp32, fp16 and bf16).
//! - `quarantine` / `debug_quarantine`: freed blocks are held back from reuse (guarded ones
//!   unmapped) for a number of later frees (a plain integer) or bytes (a size with a unit).

use crate::config::parse_size;
use crate::error::{Error, Result};

/// Quarantine length of `debug:all` and `debug:quarantine` when `debug_quarantine` is not set.
pub const DEFAULT_QUARANTINE_COUNT: u64 = 256;
/// Canary bytes added to requests that are not guarded, by default.
pub const DEFAULT_CANARY_BYTES: u64 = 64;

/// The debug mode's settings. `Default` is off.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DebugConfig {
    /// Guard pages after (and with `guard_front` before) large allocations.
    pub guard: bool,
    pub guard_front: bool,
    /// Canary bytes after each request, checked at free (by the C++ layer).
    pub canary: bool,
    /// Freed blocks filled with 0xFF (by the C++ layer).
    pub poison: bool,
    /// Freed blocks held back from reuse: at most this many (0: no bound by count)...
    pub quarantine_count: u64,
    /// ...and at most this many bytes (0: no bound by bytes). Both 0: no quarantine.
    pub quarantine_bytes: u64,
    /// Smallest request given guard pages; 0 means one physical page.
    pub guard_min: u64,
    /// Canary bytes added to requests that are not guarded (with `canary`).
    pub canary_bytes: u64,
}

impl Default for DebugConfig {
    fn default() -> Self {
        DebugConfig {
            guard: false,
            guard_front: false,
            canary: false,
            poison: false,
            quarantine_count: 0,
            quarantine_bytes: 0,
            guard_min: 0,
            canary_bytes: DEFAULT_CANARY_BYTES,
        }
    }
}

/// The `debug*` keys [`crate::Config::set`] accepts.
pub const DEBUG_KEYS: &[&str] = &[
    "debug",
    "debug_quarantine",
    "debug_guard_min",
    "debug_canary_bytes",
];

fn invalid(key: &str, value: &str, reason: impl Into<String>) -> Error {
    Error::InvalidConfig {
        key: key.to_string(),
        value: value.to_string(),
        reason: reason.into(),
    }
}

impl DebugConfig {
    /// Whether any part of the mode is on.
    pub fn enabled(&self) -> bool {
        self.guard || self.canary || self.poison || self.quarantine()
    }

    /// Whether freed blocks are held back.
    pub fn quarantine(&self) -> bool {
        self.quarantine_count > 0 || self.quarantine_bytes > 0
    }

    /// What C++ reads: bit 0 guard, 1 canary, 2 poison, 3 quarantine, 4 guard_front.
    pub fn mode_bits(&self) -> u32 {
        (self.guard as u32)
            | (self.canary as u32) << 1
            | (self.poison as u32) << 2
            | (self.quarantine() as u32) << 3
            | (self.guard_front as u32) << 4
    }

    /// Sets a `debug*` key; `Ok(false)` when `key` is not one of them.
    pub fn set(&mut self, key: &str, value: &str) -> Result<bool> {
        let v = value.trim();
        match key.trim().to_ascii_lowercase().as_str() {
            "debug" => {
                let mut d = DebugConfig {
                    quarantine_count: self.quarantine_count,
                    quarantine_bytes: self.quarantine_bytes,
                    guard_min: self.guard_min,
                    canary_bytes: self.canary_bytes,
                    ..DebugConfig::default()
                };
                let mut quarantine = false;
                for part in v
                    .split(['+', '|', ' '])
                    .map(|p| p.trim().to_ascii_lowercase().replace('-', "_"))
                    .filter(|p| !p.is_empty())
                {
                    match part.as_str() {
                        "off" | "none" | "0" | "false" => {}
                        "guard" | "guards" => d.guard = true,
                        "guard_front" | "front" => {
                            d.guard = true;
                            d.guard_front = true;
                        }
                        "canary" | "canaries" => d.canary = true,
                        "poison" => d.poison = true,
                        "quarantine" => quarantine = true,
                        "all" | "on" | "1" | "true" => {
                            d.guard = true;
                            d.canary = true;
                            d.poison = true;
                            quarantine = true;
                        }
                        other => {
                            return Err(invalid(
                                key,
                                value,
                                format!(
                                    "unknown debug mode {other:?}; expected off, all, or guard, \
                                     guard_front, canary, poison, quarantine joined by +"
                                ),
                            ))
                        }
                    }
                }
                if quarantine && !d.quarantine() {
                    d.quarantine_count = DEFAULT_QUARANTINE_COUNT;
                }
                if !(quarantine || d.guard || d.canary || d.poison) {
                    // `debug:off` turns everything off, a set quarantine included.
                    d.quarantine_count = 0;
                    d.quarantine_bytes = 0;
                }
                *self = d;
            }
            "debug_quarantine" => {
                let lower = v.to_ascii_lowercase();
                if lower == "off" || lower == "none" {
                    self.quarantine_count = 0;
                    self.quarantine_bytes = 0;
                } else if let Ok(n) = v.replace('_', "").parse::<u64>() {
                    self.quarantine_count = n;
                    self.quarantine_bytes = 0;
                } else {
                    let b = parse_size(v).map_err(|r| {
                        invalid(
                            key,
                            value,
                            format!("{r}; expected a count of frees (256) or bytes (1GiB)"),
                        )
                    })?;
                    self.quarantine_bytes = b;
                    self.quarantine_count = 0;
                }
            }
            "debug_guard_min" => {
                self.guard_min = parse_size(v).map_err(|r| invalid(key, value, r))?;
            }
            "debug_canary_bytes" => {
                let b = parse_size(v).map_err(|r| invalid(key, value, r))?;
                if b > 4096 {
                    return Err(invalid(key, value, "expected 0 to 4096 bytes"));
                }
                self.canary_bytes = b;
            }
            _ => return Ok(false),
        }
        Ok(true)
    }

    /// The settings as `key:value` pairs (only when on, so the settings of a run without the
    /// mode are unchanged).
    pub fn to_pairs(&self) -> Vec<(&'static str, String)> {
        if !self.enabled() {
            return Vec::new();
        }
        let mut modes: Vec<&str> = Vec::new();
        if self.guard_front {
            modes.push("guard_front");
        } else if self.guard {
            modes.push("guard");
        }
        if self.canary {
            modes.push("canary");
        }
        if self.poison {
            modes.push("poison");
        }
        if self.quarantine() {
            modes.push("quarantine");
        }
        let q = if self.quarantine_bytes > 0 {
            format!("{}B", self.quarantine_bytes)
        } else {
            self.quarantine_count.to_string()
        };
        vec![
            ("debug", modes.join("+")),
            ("debug_quarantine", q),
            ("debug_guard_min", self.guard_min.to_string()),
            ("debug_canary_bytes", self.canary_bytes.to_string()),
        ]
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;

    #[test]
    fn modes_parse_and_combine() {
        let mut c = Config::default();
        assert!(!c.debug.enabled());
        assert!(c.debug.to_pairs().is_empty());
        c.apply_conf("debug:guard").unwrap();
        assert!(c.debug.guard && !c.debug.canary && !c.debug.quarantine());
        c.apply_conf("debug:guard+canary+poison").unwrap();
        assert!(c.debug.guard && c.debug.canary && c.debug.poison && !c.debug.quarantine());
        assert_eq!(c.debug.canary_bytes, DEFAULT_CANARY_BYTES);
        c.apply_conf("debug:all").unwrap();
        assert_eq!(c.debug.quarantine_count, DEFAULT_QUARANTINE_COUNT);
        assert_eq!(c.debug.mode_bits(), 0b1111);
        c.apply_conf("debug:guard_front").unwrap();
        assert!(c.debug.guard && c.debug.guard_front);
        c.apply_conf("debug:off").unwrap();
        assert!(!c.debug.enabled());
    }

    #[test]
    fn quarantine_counts_or_bytes() {
        let mut c = Config::default();
        c.apply_conf("debug_quarantine:100,debug:poison").unwrap();
        assert_eq!(
            (c.debug.quarantine_count, c.debug.quarantine_bytes),
            (100, 0)
        );
        assert!(c.debug.poison && c.debug.quarantine());
        c.apply_conf("debug_quarantine:1GiB").unwrap();
        assert_eq!(
            (c.debug.quarantine_count, c.debug.quarantine_bytes),
            (0, 1 << 30)
        );
        c.apply_conf("debug:quarantine").unwrap();
        assert_eq!(c.debug.quarantine_bytes, 1 << 30, "an explicit bound stays");
        c.apply_conf("debug_quarantine:off").unwrap();
        assert!(!c.debug.quarantine());
    }

    #[test]
    fn bad_values_are_named() {
        let mut c = Config::default();
        for (k, v) in [
            ("debug", "guard+sparkles"),
            ("debug_quarantine", "lots"),
            ("debug_guard_min", "big"),
            ("debug_canary_bytes", "1MiB"),
        ] {
            match c.set(k, v) {
                Err(Error::InvalidConfig { key, value, .. }) => {
                    assert_eq!((key.as_str(), value.as_str()), (k, v));
                }
                other => panic!("{k}:{v} gave {other:?}"),
            }
        }
        let e = c.set("debug", "guard+sparkles").unwrap_err().to_string();
        assert!(e.contains("sparkles"), "{e}");
    }
}
