//! The `gmlake` command-line tool. `gmlake replay` replays memory
//! snapshots recorded by PyTorch through the GMLake allocator on a simulated device and
//! reports the memory it would save.
//!
//! - [`trace`]: reading snapshot pickles into compact events;
//! - [`native`]: the native allocator's reserved memory, from the trace's segment events;
//! - [`replay`]: driving the allocator over the events and measuring;
//! - [`series`]: the downsampled memory-over-time series for charts;
//! - [`report`]: the table and JSON output; [`plot`]: the SVG chart;
//! - [`cli`], [`app`], [`progress`], [`clock`]: the command itself;
//! - [`tier`]: `gmlake tier-replay`, traces of host-tier operations (issue 16);
//! - [`ops`]: `gmlake ops`, a snapshot's allocations and frees as a list for timing allocators;
//! - [`waste`]: where held but unused memory sits at the replay's peak (`--waste-at-peak`);
//! - [`misses`]: the second half's allocations that took no kept window, and why (`--misses`);
//! - [`call_times`]: how long each allocation and free takes, as a distribution (`--call-times`).

pub mod app;
pub mod call_times;
pub mod cli;
pub mod clock;
pub use gmlake_core::cost;
pub mod misses;
pub mod native;
pub mod ops;
pub mod plot;
pub mod progress;
pub mod replay;
pub mod report;
pub mod series;
pub mod tier;
pub mod trace;
pub mod waste;
