//! How far a long subcommand has got: a bar on a terminal (indicatif), else a plain line on
//! stderr every few seconds. The library reports through `keel::progress`.

use std::io::IsTerminal;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressStyle};
use keel::progress::{describe, Progress};

/// How often the plain lines come when stderr is not a terminal.
const LINE_EVERY: Duration = Duration::from_secs(5);

/// Runs `f`, showing the progress it reports under `label`.
pub fn show<T>(label: &'static str, f: impl FnOnce() -> T) -> T {
    let p: Arc<dyn Progress> = if std::io::stderr().is_terminal() {
        Arc::new(Bar::new(label))
    } else {
        Arc::new(Lines {
            label,
            state: Mutex::new((String::new(), None, Instant::now())),
        })
    };
    keel::progress::scope(p, f)
}

struct Bar {
    label: &'static str,
    bar: ProgressBar,
}

impl Bar {
    fn new(label: &'static str) -> Self {
        let bar = ProgressBar::hidden();
        Bar { label, bar }
    }
}

impl Progress for Bar {
    fn stage(&self, what: &str, total: Option<u64>) {
        let style = match total {
            Some(_) => ProgressStyle::with_template(
                "{prefix}: [{bar:30}] {pos}/{len} {msg} ({elapsed}, eta {eta})",
            ),
            None => ProgressStyle::with_template("{prefix}: {spinner} {pos} {msg} ({elapsed})"),
        }
        .expect("a valid template")
        .progress_chars("=> ");
        self.bar.set_style(style);
        self.bar.set_prefix(self.label);
        self.bar.set_message(what.to_string());
        self.bar.set_length(total.unwrap_or(0));
        self.bar.set_position(0);
        // Drawn from the first stage on (hidden before: nothing to show yet).
        self.bar
            .set_draw_target(indicatif::ProgressDrawTarget::stderr());
        self.bar.enable_steady_tick(Duration::from_millis(200));
    }

    fn set(&self, done: u64) {
        self.bar.set_position(done);
    }

    fn finish(&self) {
        self.bar.finish_and_clear();
    }
}

/// Plain lines: `keel: LABEL: done/total what`, at most every `LINE_EVERY`.
struct Lines {
    label: &'static str,
    state: Mutex<(String, Option<u64>, Instant)>,
}

impl Progress for Lines {
    fn stage(&self, what: &str, total: Option<u64>) {
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        *s = (what.to_string(), total, Instant::now());
    }

    fn set(&self, done: u64) {
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if s.2.elapsed() >= LINE_EVERY {
            s.2 = Instant::now();
            eprintln!("keel: {}: {}", self.label, describe(done, s.1, &s.0));
        }
    }

    fn finish(&self) {}
}
