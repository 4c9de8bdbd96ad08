//! Statistics and snapshots as JSON text, for the C accessors Python reads with ctypes.
//! Hand-written (flat, numeric, ASCII keys) to keep the staticlib free of extra dependencies.

use gmlake_core::{DeviceStats, Snapshot, Stat, StatArray, StatValue};
use std::fmt::Write;

/// Appends `s` as a JSON string literal.
fn string(out: &mut String, s: &str) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

/// Appends a JSON array of `items`, each written by `each`.
fn array<T>(
    out: &mut String,
    items: impl IntoIterator<Item = T>,
    mut each: impl FnMut(&mut String, T),
) {
    out.push('[');
    for (i, item) in items.into_iter().enumerate() {
        if i > 0 {
            out.push(',');
        }
        each(out, item);
    }
    out.push(']');
}

struct Obj<'a> {
    out: &'a mut String,
    first: bool,
}

impl<'a> Obj<'a> {
    fn new(out: &'a mut String) -> Self {
        out.push('{');
        Obj { out, first: true }
    }
    fn key(&mut self, k: &str) -> &mut String {
        if !self.first {
            self.out.push(',');
        }
        self.first = false;
        string(self.out, k);
        self.out.push(':');
        self.out
    }
    fn num(&mut self, k: &str, v: impl std::fmt::Display) {
        let _ = write!(self.key(k), "{v}");
    }
    fn boolean(&mut self, k: &str, v: bool) {
        self.key(k).push_str(if v { "true" } else { "false" });
    }
    fn str(&mut self, k: &str, v: &str) {
        let out = self.key(k);
        string(out, v);
    }
    fn end(self) {
        self.out.push('}');
    }
}

const POOLS: [&str; 3] = ["all", "small_pool", "large_pool"];

/// `name.{all,small_pool,large_pool}.{current,peak,allocated,freed}`, as the keys of
/// `torch.cuda.memory_stats()`.
fn stat_array(o: &mut Obj, name: &str, a: &StatArray) {
    for (pool, s) in POOLS.iter().zip(a.0.iter()) {
        stat(o, &format!("{name}.{pool}"), s);
    }
}

fn stat(o: &mut Obj, prefix: &str, s: &Stat) {
    o.num(&format!("{prefix}.current"), s.current);
    o.num(&format!("{prefix}.peak"), s.peak);
    o.num(&format!("{prefix}.allocated"), s.allocated);
    o.num(&format!("{prefix}.freed"), s.freed);
}

/// A flat object: PyTorch's `memory_stats()` keys for the `DeviceStats` fields, then
/// gmlake's counters under `gmlake.` and the driver calls under `gmlake.driver_calls.`.
pub fn stats(s: &DeviceStats, extra: &[(&str, u64)]) -> String {
    let mut out = String::with_capacity(4096);
    let mut o = Obj::new(&mut out);
    for (name, v) in s.fields() {
        match v {
            StatValue::Array(a) => stat_array(&mut o, name, a),
            StatValue::Stat(st) => stat(&mut o, name, st),
            StatValue::Int(n) => o.num(name, n),
            StatValue::Count(n) => o.num(name, n),
        }
    }
    for (name, n) in s.counters() {
        o.num(&format!("gmlake.{name}"), n);
    }
    o.num("gmlake.driver_calls", s.driver_calls.total());
    for (name, n) in s.driver_calls.as_pairs() {
        o.num(&format!("gmlake.driver_calls.{name}"), n);
    }
    for (k, v) in extra {
        o.num(&format!("gmlake.{k}"), v);
    }
    o.end();
    out
}

/// The core's snapshot with gmlake's own fields (stitched flags, pages, page size, config).
/// An allocation or free that took at least 50 µs (`host_timing`): when it began (Unix
/// time), how long it took, the request's size (0 for a free), and where the time went
/// (`gmlake_core::calltime`: the wait for the allocator's lock, the driver calls, the
/// slowest of them; the rest is the core's own work).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SlowCall {
    pub start_unix_ns: u64,
    pub ns: u64,
    pub alloc: bool,
    pub size: u64,
    pub time: gmlake_core::calltime::CallTime,
}

/// gmlake's view of a device's memory; with `host_timing`, also its slow calls
/// (`slow_calls`: `start_unix_ns`, `ns`, `op` ("alloc" or "free"), `size`, `lock_wait_ns`,
/// `driver_ns`, `driver_calls`, `slowest_driver` (a kind of `driver_calls`, "" if none),
/// `slowest_driver_ns`).
pub fn snapshot(s: &Snapshot, slow: &[SlowCall]) -> String {
    let mut out = String::with_capacity(256 + 256 * s.segments.len());
    let mut o = Obj::new(&mut out);
    o.num("page_size", s.page_size);
    {
        let cfg = o.key("config");
        let mut c = Obj::new(cfg);
        for (k, v) in &s.config {
            c.str(k, v);
        }
        c.end();
    }
    array(o.key("segments"), &s.segments, |out, seg| {
        let mut so = Obj::new(out);
        so.num("address", seg.address);
        so.num("total_size", seg.total_size);
        so.num("allocated_size", seg.allocated_size);
        so.num("active_size", seg.active_size);
        so.num("requested_size", seg.requested_size);
        so.num("stream", seg.stream);
        so.str(
            "segment_type",
            if seg.pool == gmlake_core::PoolKind::Large {
                "large"
            } else {
                "small"
            },
        );
        {
            let p = so.key("segment_pool_id");
            let _ = write!(p, "[{},{}]", seg.graph_pool.0, seg.graph_pool.1);
        }
        so.boolean("stitched", seg.stitched);
        so.num("pages", seg.pages);
        array(so.key("blocks"), &seg.blocks, |out, b| {
            let mut bo = Obj::new(out);
            bo.num("address", b.address);
            bo.num("size", b.size);
            bo.num("requested_size", b.requested_size);
            bo.str("state", b.state.torch_name());
            bo.boolean("stitched", b.stitched);
            bo.end();
        });
        so.end();
    });
    array(o.key("slow_calls"), slow, |out, c| {
        let mut co = Obj::new(out);
        co.num("start_unix_ns", c.start_unix_ns);
        co.num("ns", c.ns);
        co.str("op", if c.alloc { "alloc" } else { "free" });
        co.num("size", c.size);
        co.num("lock_wait_ns", c.time.lock_wait_ns);
        co.num("driver_ns", c.time.driver_ns);
        co.num("driver_calls", c.time.driver_calls);
        co.str("slowest_driver", c.time.slowest_driver);
        co.num("slowest_driver_ns", c.time.slowest_driver_ns);
        co.end();
    });
    o.end();
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strings_are_escaped() {
        let mut s = String::new();
        string(&mut s, "a\"b\\c\nd\u{1}");
        assert_eq!(s, r#""a\"b\\c\nd\u0001""#);
    }

    #[test]
    fn stats_have_torch_keys() {
        let mut d = DeviceStats::default();
        d.allocated_bytes
            .increase(gmlake_core::PoolKind::Large, 4096);
        d.stitches = 3;
        let j = stats(&d, &[("page_size", 2 << 20)]);
        assert!(j.starts_with('{') && j.ends_with('}'));
        assert!(j.contains(r#""allocated_bytes.all.current":4096"#));
        assert!(j.contains(r#""allocated_bytes.large_pool.peak":4096"#));
        assert!(j.contains(r#""gmlake.stitches":3"#));
        assert!(j.contains(r#""gmlake.page_size":2097152"#));
        assert!(j.contains(r#""gmlake.driver_calls.map":0"#));
    }
}
