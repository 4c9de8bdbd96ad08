//! Statistics and snapshots as JSON text, for the C accessors Python reads with ctypes.
//! Hand-written (flat, numeric, ASCII keys) to keep the staticlib free of extra dependencies.

use gmlake_core::{DeviceStats, Snapshot, Stat, StatArray};
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
    stat_array(&mut o, "allocation", &s.allocation);
    stat_array(&mut o, "segment", &s.segment);
    stat_array(&mut o, "active", &s.active);
    stat_array(&mut o, "inactive_split", &s.inactive_split);
    stat_array(&mut o, "allocated_bytes", &s.allocated_bytes);
    stat_array(&mut o, "reserved_bytes", &s.reserved_bytes);
    stat_array(&mut o, "active_bytes", &s.active_bytes);
    stat_array(&mut o, "inactive_split_bytes", &s.inactive_split_bytes);
    stat_array(&mut o, "requested_bytes", &s.requested_bytes);
    o.num("num_alloc_retries", s.num_alloc_retries);
    o.num("num_ooms", s.num_ooms);
    stat(&mut o, "oversize_allocations", &s.oversize_allocations);
    stat(&mut o, "oversize_segments", &s.oversize_segments);
    o.num("num_sync_all_streams", s.num_sync_all_streams);
    o.num("num_device_alloc", s.num_device_alloc);
    o.num("num_device_free", s.num_device_free);
    o.num("max_split_size", s.max_split_size);
    o.num("gmlake.stitches", s.stitches);
    o.num("gmlake.pages_stitched", s.pages_stitched);
    o.num("gmlake.stitch_reuses", s.stitch_reuses);
    o.num("gmlake.pages_reused", s.pages_reused);
    o.num("gmlake.alias_evictions", s.alias_evictions);
    o.num("gmlake.aliases_replaced", s.aliases_replaced);
    o.num("gmlake.aliased_bytes", s.aliased_bytes);
    o.num("gmlake.cached_bytes", s.cached_bytes);
    o.num("gmlake.retired_bytes", s.retired_bytes);
    o.num("gmlake.pending_frees", s.pending_frees);
    o.num("gmlake.unknown_frees", s.unknown_frees);
    o.num("gmlake.ipc_shares", s.ipc_shares);
    o.num("gmlake.ipc_imports", s.ipc_imports);
    o.num("gmlake.ipc_imported_bytes", s.ipc_imported_bytes);
    o.num("gmlake.debug_guarded", s.debug_guarded);
    o.num("gmlake.debug_guard_bytes", s.debug_guard_bytes);
    o.num("gmlake.debug_quarantine_blocks", s.debug_quarantine_blocks);
    o.num("gmlake.debug_quarantine_bytes", s.debug_quarantine_bytes);
    o.num("gmlake.debug_canary_errors", s.debug_canary_errors);
    o.num("gmlake.debug_pages", s.debug_pages);
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
pub fn snapshot(s: &Snapshot) -> String {
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
    {
        let segs = o.key("segments");
        segs.push('[');
        for (i, seg) in s.segments.iter().enumerate() {
            if i > 0 {
                segs.push(',');
            }
            let mut so = Obj::new(segs);
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
            {
                let bl = so.key("blocks");
                bl.push('[');
                for (j, b) in seg.blocks.iter().enumerate() {
                    if j > 0 {
                        bl.push(',');
                    }
                    let mut bo = Obj::new(bl);
                    bo.num("address", b.address);
                    bo.num("size", b.size);
                    bo.num("requested_size", b.requested_size);
                    bo.str("state", b.state.torch_name());
                    bo.boolean("stitched", b.stitched);
                    bo.end();
                }
                bl.push(']');
            }
            so.end();
        }
        segs.push(']');
    }
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
