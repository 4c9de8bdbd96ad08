//! Configuration: GMLake's environment variables with their meanings, plus one `GMLAKE_CONF`
//! list of `key:value` pairs in the style of `PYTORCH_CUDA_ALLOC_CONF`.
//!
//! Precedence: defaults, then GMLake's variables (`vmmDefragment`, `fragLimit`, `reuseLimit`,
//! `defragLevel`, `autoGC`), then `GMLAKE_CONF`, then explicit [`Config::set`] calls. Every
//! rejected value is an [`Error::InvalidConfig`] naming the variable and the value.

use crate::error::{Error, Result};

/// How the pages for a stitch are chosen among cached free blocks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StitchStrategy {
    /// Smallest cached block that covers the whole shortfall; otherwise the largest blocks
    /// first, so a stitch takes as few pieces as possible and leaves larger blocks whole.
    BestFit,
    /// GMLake's choice: the largest cached free blocks first.
    LargestFirst,
    /// The least recently freed cached blocks first.
    Lru,
}

impl StitchStrategy {
    pub fn name(self) -> &'static str {
        match self {
            StitchStrategy::BestFit => "best_fit",
            StitchStrategy::LargestFirst => "largest_first",
            StitchStrategy::Lru => "lru",
        }
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct Config {
    /// `vmmDefragment`: stitch free pages into new ranges. Off: a request that no cached block
    /// fits always gets new physical memory (cached pages are returned only on OOM).
    pub vmm_defragment: bool,
    /// `fragLimit`: stitch only for requests of at least this many bytes.
    pub frag_limit: u64,
    /// `reuseLimit`: reuse a cached free block directly only if its size is at most
    /// request x reuseLimit; larger blocks are drawn on page by page. `inf` disables the check.
    pub reuse_limit: f64,
    /// `defragLevel`: 0 stitch before creating physical memory; 1 only after creating failed;
    /// 2 only after returning cached memory and retrying failed; >= 5 never.
    pub defrag_level: u32,
    /// `autoGC` (GiB): after a stitch, if more than this many bytes sit cached in free mapped
    /// blocks, return the least recently used cached pages to the device until below it.
    pub auto_gc_bytes: Option<u64>,
    /// `stitch_strategy`: best_fit (default), largest_first (GMLake), lru.
    pub stitch_strategy: StitchStrategy,
    /// `page_size`: physical page size; 0 means the device's granularity. Must be a multiple
    /// of the granularity.
    pub page_size: u64,
    /// `small_size`: requests up to this many bytes go to the small pool (PyTorch: 1 MiB).
    pub small_size: u64,
    /// `memory_fraction`: cap reserved memory at this fraction of the device (0 < f <= 1).
    pub memory_fraction: Option<f64>,
    /// `limit`: cap reserved memory at this many bytes.
    pub limit_bytes: Option<u64>,
    /// `max_aliases`: how many old mappings of stitched pages are kept for reuse, as a
    /// multiple of the pages held (at least 8 GiB worth of pages when not 0). Kept mappings
    /// cost virtual addresses only, and let a periodic job reuse last step's stitched ranges
    /// with no driver call; beyond the bound the oldest are unmapped. 0 unmaps every old
    /// mapping once its stream is done with it.
    pub max_aliases: f64,
    /// `util_target`: when a miss needs pages, create new memory before stitching as long as
    /// the pages held stay within (active bytes + the request) / util_target; stitch beyond
    /// that. Trades a bounded share of utilization for fewer driver calls where lifetimes
    /// are random (a stitch maps every page it moves, on every miss). None (`off`, the
    /// default): stitch first, as `defragLevel` says.
    pub util_target: Option<f64>,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            vmm_defragment: true,
            frag_limit: 0,
            reuse_limit: f64::INFINITY,
            defrag_level: 0,
            auto_gc_bytes: None,
            stitch_strategy: StitchStrategy::BestFit,
            page_size: 0,
            small_size: 1 << 20,
            memory_fraction: None,
            limit_bytes: None,
            max_aliases: 4.0,
            util_target: None,
        }
    }
}

/// The keys [`Config::set`] accepts, with GMLake's spellings first.
pub const CONFIG_KEYS: &[&str] = &[
    "vmmDefragment",
    "fragLimit",
    "reuseLimit",
    "defragLevel",
    "autoGC",
    "stitch_strategy",
    "page_size",
    "small_size",
    "memory_fraction",
    "limit",
    "max_aliases",
    "util_target",
];

/// GMLake's environment variables, read by [`Config::from_env`].
pub const GMLAKE_ENV_VARS: &[&str] = &[
    "vmmDefragment",
    "fragLimit",
    "reuseLimit",
    "defragLevel",
    "autoGC",
];

fn invalid(key: &str, value: &str, reason: impl Into<String>) -> Error {
    Error::InvalidConfig {
        key: key.to_string(),
        value: value.to_string(),
        reason: reason.into(),
    }
}

/// Parses a byte count: a plain integer or a number with a unit (B, KB, KiB, MB, MiB, GB, GiB,
/// TB, TiB; as in PyTorch, KB/MB/GB are binary units). Fractions are allowed with a unit.
pub fn parse_size(text: &str) -> std::result::Result<u64, String> {
    let t = text.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.' || c == '_'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let num = num.replace('_', "");
    if num.is_empty() {
        return Err("expected a number of bytes such as 1073741824 or 40GiB".into());
    }
    let mult: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kb" | "kib" => 1 << 10,
        "m" | "mb" | "mib" => 1 << 20,
        "g" | "gb" | "gib" => 1 << 30,
        "t" | "tb" | "tib" => 1 << 40,
        other => return Err(format!("unknown unit {other:?}")),
    };
    if let Ok(n) = num.parse::<u64>() {
        return n
            .checked_mul(mult)
            .ok_or_else(|| "size overflows 64 bits".to_string());
    }
    let f: f64 = num
        .parse()
        .map_err(|_| format!("{num:?} is not a number"))?;
    let bytes = f * mult as f64;
    if !bytes.is_finite() || bytes < 0.0 || bytes >= u64::MAX as f64 {
        return Err("size out of range".into());
    }
    Ok(bytes.round() as u64)
}

fn parse_bool(key: &str, value: &str) -> Result<bool> {
    match value.trim().to_ascii_lowercase().as_str() {
        "1" | "true" | "on" | "yes" => Ok(true),
        "0" | "false" | "off" | "no" => Ok(false),
        v => match v.parse::<i64>() {
            // GMLake reads vmmDefragment as an integer: > 0 is on.
            Ok(n) => Ok(n > 0),
            Err(_) => Err(invalid(key, value, "expected 1/0, true/false or on/off")),
        },
    }
}

impl Config {
    /// Sets one key (GMLake's names, or this project's snake_case names; case-insensitive).
    pub fn set(&mut self, key: &str, value: &str) -> Result<()> {
        let v = value.trim();
        let size = |k: &str| parse_size(v).map_err(|r| invalid(k, value, r));
        match key.trim().to_ascii_lowercase().as_str() {
            "vmmdefragment" | "vmm_defragment" => self.vmm_defragment = parse_bool(key, v)?,
            "fraglimit" | "frag_limit" => self.frag_limit = size(key)?,
            "reuselimit" | "reuse_limit" => {
                let f: f64 = v
                    .parse()
                    .map_err(|_| invalid(key, value, "expected a number >= 1 or inf"))?;
                if f.is_nan() || f < 1.0 {
                    return Err(invalid(key, value, "expected a number >= 1 or inf"));
                }
                self.reuse_limit = f;
            }
            "defraglevel" | "defrag_level" => {
                self.defrag_level = v
                    .parse()
                    .map_err(|_| invalid(key, value, "expected an integer >= 0"))?
            }
            "autogc" | "auto_gc" => {
                let g: f64 = v
                    .parse()
                    .map_err(|_| invalid(key, value, "expected a number of GiB >= 0"))?;
                if g.is_nan() || g < 0.0 {
                    return Err(invalid(key, value, "expected a number of GiB >= 0"));
                }
                self.auto_gc_bytes = if g.is_infinite() {
                    None
                } else {
                    Some((g * (1u64 << 30) as f64) as u64)
                };
            }
            "stitch_strategy" | "stitchstrategy" => {
                self.stitch_strategy = match v.to_ascii_lowercase().replace('-', "_").as_str() {
                    "best_fit" | "bestfit" => StitchStrategy::BestFit,
                    "largest_first" | "largest" | "gmlake" => StitchStrategy::LargestFirst,
                    "lru" => StitchStrategy::Lru,
                    _ => {
                        return Err(invalid(
                            key,
                            value,
                            "expected best_fit, largest_first or lru",
                        ))
                    }
                }
            }
            "page_size" | "pagesize" => {
                let p = size(key)?;
                if p != 0 && !p.is_power_of_two() {
                    return Err(invalid(key, value, "expected 0 or a power of two"));
                }
                self.page_size = p;
            }
            "max_aliases" | "maxaliases" => {
                let f: f64 = v
                    .parse()
                    .map_err(|_| invalid(key, value, "expected a number >= 0"))?;
                if !(f >= 0.0 && f.is_finite()) {
                    return Err(invalid(key, value, "expected a finite number >= 0"));
                }
                self.max_aliases = f;
            }
            "util_target" | "utiltarget" => {
                let why = "expected a fraction in (0, 1] or off";
                self.util_target = match v.to_ascii_lowercase().as_str() {
                    "off" | "none" => None,
                    _ => {
                        let f: f64 = v.parse().map_err(|_| invalid(key, value, why))?;
                        if !(f > 0.0 && f <= 1.0) {
                            return Err(invalid(key, value, why));
                        }
                        Some(f)
                    }
                };
            }
            "small_size" | "smallsize" => {
                let s = size(key)?;
                if s == 0 || s > 1 << 30 {
                    return Err(invalid(key, value, "expected 1 byte to 1 GiB"));
                }
                self.small_size = s;
            }
            "memory_fraction" | "memoryfraction" | "fraction" => {
                let f: f64 = v
                    .parse()
                    .map_err(|_| invalid(key, value, "expected a fraction in (0, 1]"))?;
                if !(f > 0.0 && f <= 1.0) {
                    return Err(invalid(key, value, "expected a fraction in (0, 1]"));
                }
                self.memory_fraction = Some(f);
            }
            "limit" | "limit_bytes" => {
                let l = size(key)?;
                self.limit_bytes = if l == 0 { None } else { Some(l) };
            }
            _ => {
                return Err(invalid(
                    key,
                    value,
                    format!("unknown key; known keys: {}", CONFIG_KEYS.join(", ")),
                ))
            }
        }
        Ok(())
    }

    /// Applies a `key:value,key:value` list (`=` is accepted in place of `:`).
    pub fn apply_conf(&mut self, conf: &str) -> Result<()> {
        for item in conf.split(',').map(str::trim).filter(|s| !s.is_empty()) {
            let (k, v) = item
                .split_once(':')
                .or_else(|| item.split_once('='))
                .ok_or_else(|| invalid("GMLAKE_CONF", item, "expected key:value"))?;
            self.set(k, v)?;
        }
        Ok(())
    }

    /// Defaults overridden by GMLake's variables and then `GMLAKE_CONF`, read through `get`
    /// (so tests need not touch the process environment).
    pub fn from_lookup(get: impl Fn(&str) -> Option<String>) -> Result<Config> {
        let mut c = Config::default();
        for var in GMLAKE_ENV_VARS {
            if let Some(v) = get(var) {
                if !v.trim().is_empty() {
                    c.set(var, &v)?;
                }
            }
        }
        if let Some(conf) = get("GMLAKE_CONF") {
            c.apply_conf(&conf)?;
        }
        Ok(c)
    }

    /// [`Config::from_lookup`] over the process environment.
    pub fn from_env() -> Result<Config> {
        Config::from_lookup(|k| std::env::var(k).ok())
    }

    /// Whether a request of `size` bytes may be served by stitching.
    pub(crate) fn may_stitch(&self, size: u64) -> bool {
        self.vmm_defragment && self.defrag_level < 5 && size >= self.frag_limit
    }

    /// The configuration as `key:value` pairs, for snapshots' config metadata.
    pub fn to_pairs(&self) -> Vec<(&'static str, String)> {
        let opt = |o: Option<u64>| o.map_or("none".to_string(), |v| v.to_string());
        vec![
            ("vmmDefragment", (self.vmm_defragment as u8).to_string()),
            ("fragLimit", self.frag_limit.to_string()),
            ("reuseLimit", self.reuse_limit.to_string()),
            ("defragLevel", self.defrag_level.to_string()),
            (
                "autoGC",
                self.auto_gc_bytes.map_or("inf".to_string(), |b| {
                    (b as f64 / (1u64 << 30) as f64).to_string()
                }),
            ),
            ("stitch_strategy", self.stitch_strategy.name().to_string()),
            ("page_size", self.page_size.to_string()),
            ("small_size", self.small_size.to_string()),
            ("max_aliases", self.max_aliases.to_string()),
            (
                "util_target",
                self.util_target
                    .map_or("off".to_string(), |f| f.to_string()),
            ),
            (
                "memory_fraction",
                self.memory_fraction
                    .map_or("none".to_string(), |f| f.to_string()),
            ),
            ("limit", opt(self.limit_bytes)),
        ]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_with_units() {
        assert_eq!(parse_size("1073741824"), Ok(1 << 30));
        assert_eq!(parse_size("40GiB"), Ok(40 << 30));
        assert_eq!(parse_size("512MB"), Ok(512 << 20));
        assert_eq!(parse_size("1.5 GiB"), Ok(3 << 29));
        assert!(parse_size("12 parsecs").is_err());
        assert!(parse_size("").is_err());
        assert!(parse_size("99999999999999999999").is_err());
    }

    #[test]
    fn gmlake_variables_then_conf() {
        let env = |k: &str| match k {
            "vmmDefragment" => Some("1".to_string()),
            "fragLimit" => Some("1073741824".to_string()),
            "reuseLimit" => Some("10".to_string()),
            "defragLevel" => Some("1".to_string()),
            "autoGC" => Some("80".to_string()),
            "GMLAKE_CONF" => Some("stitch_strategy:largest_first, fragLimit:2MiB".to_string()),
            _ => None,
        };
        let c = Config::from_lookup(env).unwrap();
        assert!(c.vmm_defragment);
        assert_eq!(c.frag_limit, 2 << 20, "GMLAKE_CONF overrides the variable");
        assert_eq!(c.reuse_limit, 10.0);
        assert_eq!(c.defrag_level, 1);
        assert_eq!(c.auto_gc_bytes, Some(80 << 30));
        assert_eq!(c.stitch_strategy, StitchStrategy::LargestFirst);
    }

    #[test]
    fn invalid_values_name_the_variable_and_value() {
        let env = |k: &str| (k == "defragLevel").then(|| "high".to_string());
        match Config::from_lookup(env) {
            Err(Error::InvalidConfig { key, value, .. }) => {
                assert_eq!(key, "defragLevel");
                assert_eq!(value, "high");
            }
            other => panic!("expected InvalidConfig, got {other:?}"),
        }
        let mut c = Config::default();
        let e = c.set("reuseLimit", "0.5").unwrap_err();
        assert!(e.to_string().contains("reuseLimit") && e.to_string().contains("0.5"));
        assert!(c.apply_conf("fragLimit").is_err());
        assert!(c
            .set("nonsense", "1")
            .unwrap_err()
            .to_string()
            .contains("nonsense"));
        assert!(c.set("memory_fraction", "1.5").is_err());
        assert!(c.set("page_size", "3MiB").is_err());
        for bad in ["0", "1.5", "-0.5", "nan", "high"] {
            let e = c.set("util_target", bad).unwrap_err();
            assert!(
                e.to_string().contains("util_target") && e.to_string().contains(bad),
                "{e}"
            );
        }
        c.set("util_target", "0.95").unwrap();
        assert_eq!(c.util_target, Some(0.95));
        c.set("util_target", "off").unwrap();
        assert_eq!(c.util_target, None);
    }
}
