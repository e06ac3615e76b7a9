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
    if installed.is_ok() {
        install_panic_hook();
    }
    if let (Ok(()), Some(at)) = (installed, die_at()) {
        tracing::warn!("{DIE_AT_ENV}={at} is set: keel kills itself when it gets there (a crash test's hook; never set it in production)");
    }
}

/// A panic in any of keel's threads becomes one error line through the logger (a JSON
/// object under `KEEL_LOG_FORMAT=json`, like every other line), naming the thread and where,
/// before it unwinds; std's own report (and its backtrace) follows only when
/// `RUST_BACKTRACE` asks for one.
fn install_panic_hook() {
    let std_hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        let payload = info
            .payload()
            .downcast_ref::<&str>()
            .copied()
            .or_else(|| info.payload().downcast_ref::<String>().map(String::as_str));
        let thread = std::thread::current();
        let line = panic_line(thread.name(), info.location(), payload);
        if tracing::enabled!(tracing::Level::ERROR) {
            tracing::error!("{line}");
        } else {
            // KEEL_LOG filters errors out: a panic is still said.
            eprintln!("keel: error: {line}");
        }
        if std::env::var_os("RUST_BACKTRACE").is_some_and(|v| v != "0") {
            std_hook(info);
        }
    }));
}

/// The panic's line: `thread 'NAME' panicked at FILE:LINE: MESSAGE`, as std words it.
fn panic_line(
    thread: Option<&str>,
    at: Option<&std::panic::Location<'_>>,
    message: Option<&str>,
) -> String {
    format!(
        "thread '{}' panicked at {}: {}",
        thread.unwrap_or("<unnamed>"),
        at.map(|l| format!("{}:{}:{}", l.file(), l.line(), l.column()))
            .unwrap_or_else(|| "an unknown place".into()),
        message.unwrap_or("(a panic without a message)")
    )
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
    if let Some(at) = die_at() {
        let (point, panic) = match at.strip_suffix(":panic") {
            Some(point) => (point, true),
            None => (at, false),
        };
        if point.split_once('/') == Some((op, step)) {
            if panic {
                panic!("{DIE_AT_ENV}: panicking at {op}/{step}, as asked");
            }
            die();
        }
    }
}

/// `KEEL_DIE_AT=OP/STEP` (e.g. `rollback/renamed_body`): keel kills itself with SIGKILL as
/// it enters that step (`OP/STEP:panic`: panics there instead, in the thread at that step). A crash test's deterministic kill point where the
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

#[cfg(test)]
mod tests {
    use super::panic_line;

    #[test]
    fn a_panic_line_names_the_thread_the_place_and_the_message() {
        let here = std::panic::Location::caller();
        let line = panic_line(Some("checkpoint"), Some(here), Some("boom"));
        assert_eq!(
            line,
            format!(
                "thread 'checkpoint' panicked at {}:{}:{}: boom",
                here.file(),
                here.line(),
                here.column()
            )
        );
        assert_eq!(
            panic_line(None, None, None),
            "thread '<unnamed>' panicked at an unknown place: (a panic without a message)"
        );
    }
}
