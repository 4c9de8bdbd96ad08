//! One contract suite for every device (issue 19), after RAPIDS RMM's parameterised tests run
//! against every memory resource.
//!
//! [`device`] checks the driver rules of [`crate::device`] (pages, virtual ranges, map / unmap,
//! access, events, host memory) and [`allocator`] the allocator's behaviour (cache hits,
//! stitching, out of memory, `empty_cache`, statistics, streams, graph pools, threads). Each
//! case is a function generic over a [`Target`], a factory of devices of one kind; [`run`]
//! runs a list of cases against one target and reports each as passed, failed (with a
//! message) or skipped (with the reason).
//!
//! The same cases run on [`SimDevice`](crate::SimDevice) (synchronous and asynchronous, in
//! `tests/contract.rs`), on `gmlake-cuda`'s `CudaDevice` over its mock driver (its
//! `tests/mock_driver.rs`) and on a real GPU (`gmlake-cuda`'s `examples/contract.rs`,
//! `scripts/contract-gpu.sh`).
//!
//! Streams: the cases use streams 0, 1 and 2 only, valid on every CUDA device without creating
//! any: the legacy default stream and the special handles `CU_STREAM_LEGACY` (0x1) and
//! `CU_STREAM_PER_THREAD` (0x2). The allocator treats them as three streams.
//!
//! Cases whose misuse of the driver is undefined behaviour in the real CUDA driver (using a
//! released handle, releasing a handle twice) or that the real driver is documented to allow
//! (releasing a mapped handle, which it defers) are marked [`Only::Models`] with the reason,
//! and skipped on a target that is not a model. Cases that need events to stay pending until
//! the test completes the device's work are [`Only::HeldEvents`].

pub mod allocator;
pub mod device;

use crate::device::{Device, DeviceResult};
use std::fmt;

/// A kind of device the suite runs against: opens fresh devices of that kind.
pub trait Target: Sync {
    type Dev: Device + 'static;

    /// A name for reports ("sim", "sim-async", "cuda-mock", "cuda:0").
    fn name(&self) -> String;

    /// A device to run one case on. Each case opens its own (on a GPU, the same GPU again) and
    /// gives back what it made before returning when it passes.
    fn open(&self) -> DeviceResult<Self::Dev>;

    /// True for models of the driver (the simulated device, a mock driver): every case runs.
    /// False for a real driver: cases marked [`Only::Models`] are skipped.
    fn is_model(&self) -> bool;

    /// True when a recorded event stays pending until [`Target::complete_all`] completes the
    /// device's work (the asynchronous simulated device): cases of [`Only::HeldEvents`] run.
    fn holds_events(&self) -> bool {
        false
    }

    /// Completes all work queued on the device (all pending events complete).
    fn complete_all(&self, dev: &Self::Dev) -> DeviceResult<()> {
        dev.synchronize()
    }

    /// The driver resources the device holds now, where the implementation can count them.
    fn census(&self, dev: &Self::Dev) -> Option<Census> {
        let _ = dev;
        None
    }
}

/// Driver resources held: what a case compares before and after to find leaks.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Census {
    pub handles: usize,
    pub mappings: usize,
    pub reservations: usize,
    pub events: usize,
}

/// Where a case may run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Only {
    /// Every target.
    Any,
    /// Models only (simulated device, mock driver); the reason it is not run on a real driver.
    Models(&'static str),
    /// Targets whose events stay pending until their work is completed explicitly.
    HeldEvents,
}

/// Why a case did not pass.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Fail {
    Failed(String),
    /// The case does not apply to this device (e.g. it has no host memory calls).
    Skipped(String),
}

impl From<String> for Fail {
    fn from(m: String) -> Fail {
        Fail::Failed(m)
    }
}

impl From<&str> for Fail {
    fn from(m: &str) -> Fail {
        Fail::Failed(m.to_string())
    }
}

pub type CaseResult = Result<(), Fail>;

/// One case of the suite.
pub struct Case<T: Target> {
    pub name: &'static str,
    pub only: Only,
    pub run: fn(&T) -> CaseResult,
}

impl<T: Target> Clone for Case<T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T: Target> Copy for Case<T> {}

/// The outcome of one case.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    Passed,
    Failed(String),
    Skipped(String),
}

/// The outcomes of a run, in the order of the cases.
#[derive(Clone, Debug)]
pub struct Report {
    pub target: String,
    pub results: Vec<(&'static str, Outcome)>,
}

impl Report {
    pub fn passed(&self) -> usize {
        self.count(|o| matches!(o, Outcome::Passed))
    }
    pub fn failed(&self) -> usize {
        self.count(|o| matches!(o, Outcome::Failed(_)))
    }
    pub fn skipped(&self) -> usize {
        self.count(|o| matches!(o, Outcome::Skipped(_)))
    }
    fn count(&self, f: impl Fn(&Outcome) -> bool) -> usize {
        self.results.iter().filter(|(_, o)| f(o)).count()
    }
    pub fn ok(&self) -> bool {
        self.failed() == 0
    }
    /// One line per case (`PASS name`, `FAIL name: message`, `SKIP name: reason`).
    pub fn lines(&self) -> Vec<String> {
        self.results
            .iter()
            .map(|(name, o)| match o {
                Outcome::Passed => format!("PASS {}/{name}", self.target),
                Outcome::Failed(m) => format!("FAIL {}/{name}: {m}", self.target),
                Outcome::Skipped(m) => format!("SKIP {}/{name}: {m}", self.target),
            })
            .collect()
    }
    /// `target: N passed, N failed, N skipped (of N)`.
    pub fn summary(&self) -> String {
        format!(
            "{}: {} passed, {} failed, {} skipped (of {})",
            self.target,
            self.passed(),
            self.failed(),
            self.skipped(),
            self.results.len()
        )
    }
    /// Panics listing every failed case (for `#[test]`s).
    pub fn assert_ok(&self) {
        if !self.ok() {
            let failed: Vec<String> = self
                .lines()
                .into_iter()
                .filter(|l| l.starts_with("FAIL"))
                .collect();
            panic!("{}\n{}", self.summary(), failed.join("\n"));
        }
    }
    /// The outcome of case `name`.
    pub fn outcome(&self, name: &str) -> Option<&Outcome> {
        self.results
            .iter()
            .find(|(n, _)| *n == name)
            .map(|(_, o)| o)
    }
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for l in self.lines() {
            writeln!(f, "{l}")?;
        }
        write!(f, "{}", self.summary())
    }
}

/// Runs `cases` against `target`, each behind `catch_unwind` (a panic is a failure), calling
/// `progress` with each case's line as it finishes.
pub fn run_with<T: Target>(
    target: &T,
    cases: &[Case<T>],
    mut progress: impl FnMut(&str),
) -> Report {
    let mut report = Report {
        target: target.name(),
        results: Vec::new(),
    };
    for case in cases {
        let outcome = match case.only {
            Only::Models(why) if !target.is_model() => {
                Outcome::Skipped(format!("models only: {why}"))
            }
            Only::HeldEvents if !target.holds_events() => Outcome::Skipped(
                "needs events that stay pending until the test completes the work".into(),
            ),
            _ => {
                let r =
                    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| (case.run)(target)));
                match r {
                    Ok(Ok(())) => Outcome::Passed,
                    Ok(Err(Fail::Failed(m))) => Outcome::Failed(m),
                    Ok(Err(Fail::Skipped(m))) => Outcome::Skipped(m),
                    Err(p) => {
                        let m = p
                            .downcast_ref::<String>()
                            .cloned()
                            .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                            .unwrap_or_default();
                        Outcome::Failed(format!("panicked: {m}"))
                    }
                }
            }
        };
        report.results.push((case.name, outcome));
        if let Some(l) = report.lines().last() {
            progress(l);
        }
    }
    report
}

/// Runs `cases` against `target` quietly.
pub fn run<T: Target>(target: &T, cases: &[Case<T>]) -> Report {
    run_with(target, cases, |_| {})
}

/// Every case of both suites: the driver rules, then the allocator's behaviour.
pub fn all_cases<T: Target>() -> Vec<Case<T>> {
    let mut v = device::cases();
    v.extend(allocator::cases());
    v
}

/// `Err` with a message unless `cond` holds.
pub fn ensure(cond: bool, msg: impl FnOnce() -> String) -> CaseResult {
    if cond {
        Ok(())
    } else {
        Err(Fail::Failed(msg()))
    }
}

/// Turns any error into a failure naming the step that failed.
pub trait Step<T> {
    fn step(self, what: &str) -> Result<T, Fail>;
}

impl<T, E: fmt::Debug> Step<T> for Result<T, E> {
    fn step(self, what: &str) -> Result<T, Fail> {
        self.map_err(|e| Fail::Failed(format!("{what}: {e:?}")))
    }
}

/// Fails unless `r` is an error (a call that broke a rule must be refused).
pub fn refused<T: fmt::Debug, E>(r: Result<T, E>, what: &str) -> CaseResult {
    match r {
        Err(_) => Ok(()),
        Ok(v) => Err(Fail::Failed(format!(
            "{what} succeeded (returned {v:?}); it must be refused"
        ))),
    }
}

/// The census now, when the target can count.
pub fn census<T: Target>(t: &T, dev: &T::Dev) -> Option<Census> {
    t.census(dev)
}

/// Fails if the device holds other resources than `before` (where the target can count).
pub fn same_census<T: Target>(
    t: &T,
    dev: &T::Dev,
    before: Option<Census>,
    when: &str,
) -> CaseResult {
    match (before, t.census(dev)) {
        (Some(b), Some(a)) if a != b => Err(Fail::Failed(format!(
            "{when}: the device holds {a:?}, expected {b:?}"
        ))),
        _ => Ok(()),
    }
}
