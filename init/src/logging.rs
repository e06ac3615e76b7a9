//! keel's own log lines: `tracing` to stderr with a `keel:` prefix, filtered by `KEEL_LOG`,
//! optionally as JSON (`KEEL_LOG_FORMAT=json`). Service output never goes through here.

use tracing_subscriber::EnvFilter;

/// Installs the global subscriber once; later calls are no-ops.
pub fn init() {
    let filter = EnvFilter::try_from_env("KEEL_LOG").unwrap_or_else(|_| EnvFilter::new("info"));
    let json = std::env::var("KEEL_LOG_FORMAT")
        .map(|v| v == "json")
        .unwrap_or(false);
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(false)
        .with_target(false);
    let installed = if json {
        builder.json().try_init()
    } else {
        builder.without_time().event_format(KeelFormat).try_init()
    };
    if let (Ok(()), Some(at)) = (installed, die_at()) {
        tracing::warn!("{DIE_AT_ENV}={at} is set: keel kills itself when it gets there (a crash test's hook; never set it in production)");
    }
}

struct KeelFormat;

impl<S, N> tracing_subscriber::fmt::FormatEvent<S, N> for KeelFormat
where
    S: tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a>,
    N: for<'a> tracing_subscriber::fmt::FormatFields<'a> + 'static,
{
    fn format_event(
        &self,
        ctx: &tracing_subscriber::fmt::FmtContext<'_, S, N>,
        mut writer: tracing_subscriber::fmt::format::Writer<'_>,
        event: &tracing::Event<'_>,
    ) -> std::fmt::Result {
        let level = *event.metadata().level();
        if level == tracing::Level::INFO {
            write!(writer, "keel: ")?;
        } else {
            write!(writer, "keel: {}: ", level.as_str().to_lowercase())?;
        }
        ctx.field_format().format_fields(writer.by_ref(), event)?;
        writeln!(writer)
    }
}

/// Where a long operation (a checkpoint, gc, rollback, restore, fork, the start) has got: a
/// debug line `step OP STEP` on the target `keel::step` as it enters each step, and `step OP
/// end` when it returns, fails or unwinds (the guard's drop). Hidden by default (the filter
/// is `info`); `KEEL_LOG=info,keel::step=debug` shows them, so a crash test can tell inside
/// which step a kill landed (`ci/soak.py`). Disabled, each costs one filter check.
#[must_use = "the operation ends when the guard drops"]
pub struct Op(&'static str);

impl Op {
    pub fn start(op: &'static str) -> Op {
        step(op, "start");
        Op(op)
    }

    pub fn step(&self, step: &'static str) {
        self::step(self.0, step);
    }
}

impl Drop for Op {
    fn drop(&mut self) {
        step(self.0, "end");
    }
}

/// One step line (see [`Op`]).
pub fn step(op: &'static str, step: &'static str) {
    tracing::debug!(target: "keel::step", "step {op} {step}");
    if die_at().is_some_and(|at| at.split_once('/') == Some((op, step))) {
        die();
    }
}

/// `KEEL_DIE_AT=OP/STEP` (e.g. `rollback/renamed_body`): keel kills itself with SIGKILL as
/// it enters that step. A crash test's deterministic kill point where the
/// soak's random kills find a window only now and then; the environment is keel's own
/// (whoever starts keel), never the sandbox's. Read once.
fn die_at() -> Option<&'static str> {
    static AT: std::sync::OnceLock<Option<String>> = std::sync::OnceLock::new();
    AT.get_or_init(|| std::env::var(DIE_AT_ENV).ok().filter(|v| !v.is_empty()))
        .as_deref()
}

/// The variable of [`die_at`]; no process keel starts inherits it (a nested keel would die
/// at the same step).
pub const DIE_AT_ENV: &str = "KEEL_DIE_AT";

fn die() -> ! {
    tracing::warn!("KEEL_DIE_AT: killing keel here, as asked");
    // A PID 1 ignores its own SIGKILL; abort then ends it all the same.
    let _ = crate::sys::signal::send(std::process::id() as i32, libc::SIGKILL);
    std::process::abort()
}
