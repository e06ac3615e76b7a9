//! The `[shutdown]` table: how long services get to stop after the stop signal before they
//! are killed, how long the workspace gets to flush, and which signals mean "stop".

use super::BadKey;
use serde::Deserialize;
use std::time::Duration;

use super::init::check_signal;
use super::units::duration_str;

#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ShutdownConfig {
    /// Time from the stop signal until whatever still runs is SIGKILLed.
    #[serde(with = "duration_str")]
    pub grace: Duration,
    /// Time budget for flushing and unmounting the workspace after everything stopped.
    #[serde(with = "duration_str")]
    pub flush_timeout: Duration,
    /// Signals that make keel shut down (forwarded as-is to the main service first).
    pub on: Vec<String>,
    /// Signal sent to the main service's group when it must stop for another reason
    /// (and to leftover processes); services use their own `stop_signal`.
    pub signal: String,
}

impl Default for ShutdownConfig {
    fn default() -> Self {
        Self {
            grace: Duration::from_secs(6),
            flush_timeout: Duration::from_secs(3),
            on: vec!["SIGTERM".into(), "SIGINT".into()],
            signal: "SIGTERM".into(),
        }
    }
}

impl ShutdownConfig {
    pub fn validate(&self) -> Result<(), BadKey> {
        for s in &self.on {
            check_signal("shutdown.on", s)?;
            if matches!(super::signal_name(s), Some(9) | Some(19) | Some(17)) {
                return Err(BadKey::new(
                    "shutdown.on".into(),
                    format!("`{s}` cannot be caught or is used for reaping"),
                ));
            }
        }
        check_signal("shutdown.signal", &self.signal)?;
        Ok(())
    }
}
