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
    let _ = if json {
        builder.json().try_init()
    } else {
        builder.without_time().event_format(KeelFormat).try_init()
    };
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
