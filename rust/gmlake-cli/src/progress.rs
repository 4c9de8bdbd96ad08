//! A progress bar on standard error, shown only when it is a terminal.

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use std::io::IsTerminal;
use std::time::Duration;

/// Progress of reading and replaying traces; does nothing unless standard error is a terminal.
pub struct Progress {
    enabled: bool,
    bar: Option<ProgressBar>,
}

impl Progress {
    pub fn new() -> Progress {
        Progress {
            enabled: std::io::stderr().is_terminal(),
            bar: None,
        }
    }

    /// A spinner while `what` is read.
    pub fn reading(&mut self, what: &str) {
        self.clear();
        if !self.enabled {
            return;
        }
        let bar = ProgressBar::with_draw_target(None, ProgressDrawTarget::stderr());
        bar.set_style(
            ProgressStyle::with_template("{spinner} reading {msg}")
                .unwrap_or_else(|_| ProgressStyle::default_spinner()),
        );
        bar.set_message(what.to_string());
        bar.enable_steady_tick(Duration::from_millis(100));
        self.bar = Some(bar);
    }

    /// A bar over `total` events being replayed.
    pub fn replaying(&mut self, what: &str, total: usize) {
        self.clear();
        if !self.enabled {
            return;
        }
        let bar = ProgressBar::with_draw_target(Some(total as u64), ProgressDrawTarget::stderr());
        bar.set_style(
            ProgressStyle::with_template(
                "{msg} [{bar:40}] {human_pos}/{human_len} events ({per_sec}, {eta})",
            )
            .map(|s| s.progress_chars("=> "))
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
        );
        bar.set_message(what.to_string());
        self.bar = Some(bar);
    }

    /// Events replayed so far.
    pub fn set(&self, done: usize) {
        if let Some(bar) = &self.bar {
            bar.set_position(done as u64);
        }
    }

    /// Removes the bar from the terminal.
    pub fn clear(&mut self) {
        if let Some(bar) = self.bar.take() {
            bar.finish_and_clear();
        }
    }
}

impl Default for Progress {
    fn default() -> Self {
        Progress::new()
    }
}

impl Drop for Progress {
    fn drop(&mut self) {
        self.clear();
    }
}
