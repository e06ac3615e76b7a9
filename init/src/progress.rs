//! How far long work has got (restore, fsck, gc, checkpoint, fork). The work reports stages
//! and counts to the `Progress` of the current thread, set with `scope`; nothing is reported
//! outside a scope. The command line shows a bar or plain lines, `keel run` logs (`Logged`);
//! this module knows neither a terminal nor a bar.

use std::cell::RefCell;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Where long work reports how far it has got.
pub trait Progress: Send + Sync {
    /// A stage of `total` units (`None`: unknown) begins; `what` names the units
    /// ("chunks fetched").
    fn stage(&self, what: &str, total: Option<u64>);
    /// `done` units of the current stage are finished.
    fn set(&self, done: u64);
    /// The scope ended (the work finished or failed).
    fn finish(&self);
}

thread_local! {
    static CURRENT: RefCell<Option<Arc<dyn Progress>>> = const { RefCell::new(None) };
}

/// Runs `f` with `p` receiving this thread's progress reports; `p.finish()` at the end.
pub fn scope<T>(p: Arc<dyn Progress>, f: impl FnOnce() -> T) -> T {
    let before = CURRENT.with(|c| c.replace(Some(p.clone())));
    struct Restore(Option<Option<Arc<dyn Progress>>>);
    impl Drop for Restore {
        fn drop(&mut self) {
            let before = self.0.take().flatten();
            if let Some(p) = CURRENT.with(|c| c.replace(before)) {
                p.finish();
            }
        }
    }
    let _restore = Restore(Some(before));
    f()
}

/// Reports the start of a stage to the current scope, if any.
pub fn stage(what: &str, total: Option<u64>) {
    CURRENT.with(|c| {
        if let Some(p) = c.borrow().as_ref() {
            p.stage(what, total);
        }
    });
}

/// Reports `done` units of the current stage to the current scope, if any.
pub fn set(done: u64) {
    CURRENT.with(|c| {
        if let Some(p) = c.borrow().as_ref() {
            p.set(done);
        }
    });
}

/// Progress as log lines (`keel run`, `keel mount`): the start of each stage, then how far it
/// has got at most every `every`.
pub struct Logged {
    label: &'static str,
    every: Duration,
    state: Mutex<LogState>,
}

struct LogState {
    what: String,
    total: Option<u64>,
    last: Instant,
}

impl Logged {
    pub fn new(label: &'static str, every: Duration) -> Arc<Self> {
        Arc::new(Logged {
            label,
            every,
            state: Mutex::new(LogState {
                what: String::new(),
                total: None,
                last: Instant::now(),
            }),
        })
    }
}

/// `done/total what` (or `done what` when the total is unknown).
pub fn describe(done: u64, total: Option<u64>, what: &str) -> String {
    match total {
        Some(t) => format!("{done}/{t} {what}"),
        None => format!("{done} {what}"),
    }
}

impl Progress for Logged {
    fn stage(&self, what: &str, total: Option<u64>) {
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        s.what = what.to_string();
        s.total = total;
        s.last = Instant::now();
    }

    fn set(&self, done: u64) {
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if s.last.elapsed() >= self.every {
            s.last = Instant::now();
            tracing::info!("{}: {}", self.label, describe(done, s.total, &s.what));
        }
    }

    fn finish(&self) {}
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Default)]
    struct Recorder(Mutex<Vec<String>>);

    impl Progress for Recorder {
        fn stage(&self, what: &str, total: Option<u64>) {
            self.0
                .lock()
                .unwrap()
                .push(format!("stage {what} {total:?}"));
        }
        fn set(&self, done: u64) {
            self.0.lock().unwrap().push(format!("set {done}"));
        }
        fn finish(&self) {
            self.0.lock().unwrap().push("finish".into());
        }
    }

    #[test]
    fn reports_reach_the_scope_and_nothing_outside_it() {
        let r = Arc::new(Recorder::default());
        set(1); // no scope: dropped
        let v = scope(r.clone(), || {
            stage("chunks", Some(3));
            set(2);
            7
        });
        set(3);
        assert_eq!(v, 7);
        assert_eq!(
            *r.0.lock().unwrap(),
            ["stage chunks Some(3)", "set 2", "finish"]
        );
        assert_eq!(describe(2, Some(3), "chunks"), "2/3 chunks");
        assert_eq!(describe(2, None, "objects"), "2 objects");
    }
}
