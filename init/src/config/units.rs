//! Human-friendly units in the config file: durations ("250ms", "6s", "15m") and byte
//! sizes ("512KiB", "4MiB", "1GiB"). Pure parsing, no I/O.

use std::time::Duration;

/// Why a duration or size in the config (or on the command line) is not one.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum UnitError {
    #[error("`{0}` is not a duration (expected e.g. \"500ms\", \"6s\", \"2m\")")]
    NotADuration(String),
    #[error("`{input}`: unknown duration unit `{unit}` (use ms, s, m, h or d)")]
    DurationUnit { input: String, unit: String },
    #[error("`{0}` is not a size (expected e.g. \"512KiB\", \"4MiB\")")]
    NotASize(String),
    #[error("`{input}`: unknown size unit `{unit}` (use KiB, MiB, GiB)")]
    SizeUnit { input: String, unit: String },
    #[error("`{0}` is out of range")]
    OutOfRange(String),
}

/// Parses a duration such as `"500ms"`, `"6s"`, `"2m"`, `"1h"`, `"7d"` or a bare number of
/// seconds.
pub fn parse_duration(s: &str) -> Result<Duration, UnitError> {
    let t = s.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: f64 = num
        .parse()
        .map_err(|_| UnitError::NotADuration(s.to_string()))?;
    let secs = match unit.trim() {
        "" | "s" | "sec" | "secs" => n,
        "ms" => n / 1000.0,
        "us" | "µs" => n / 1_000_000.0,
        "m" | "min" => n * 60.0,
        "h" => n * 3600.0,
        "d" => n * 86400.0,
        other => {
            return Err(UnitError::DurationUnit {
                input: s.to_string(),
                unit: other.to_string(),
            })
        }
    };
    if !secs.is_finite() || !(0.0..=1e9).contains(&secs) {
        return Err(UnitError::OutOfRange(s.to_string()));
    }
    Ok(Duration::from_secs_f64(secs))
}

/// Parses a byte size such as `"512KiB"`, `"4MiB"`, `"1GiB"`, `"4096"`.
pub fn parse_size(s: &str) -> Result<u64, UnitError> {
    let t = s.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: u64 = num
        .parse()
        .map_err(|_| UnitError::NotASize(s.to_string()))?;
    let mult: u64 = match unit.trim() {
        "" | "B" => 1,
        "K" | "KiB" | "k" => 1 << 10,
        "M" | "MiB" => 1 << 20,
        "G" | "GiB" => 1 << 30,
        "T" | "TiB" => 1 << 40,
        other => {
            return Err(UnitError::SizeUnit {
                input: s.to_string(),
                unit: other.to_string(),
            })
        }
    };
    n.checked_mul(mult)
        .ok_or_else(|| UnitError::OutOfRange(s.to_string()))
}

/// serde helpers so config structs can hold `Duration` written as strings.
pub mod duration_str {
    use serde::{Deserialize, Deserializer};
    use std::time::Duration;

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
        let s = String::deserialize(d)?;
        super::parse_duration(&s).map_err(serde::de::Error::custom)
    }
}

/// serde helper for an optional duration written as a string (absent: `None`).
pub mod opt_duration_str {
    use serde::Deserializer;
    use std::time::Duration;

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Duration>, D::Error> {
        super::duration_str::deserialize(d).map(Some)
    }
}

/// serde helper for an optional byte size written as a string or an integer (absent: `None`).
pub mod opt_size_str {
    use serde::Deserializer;

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
        super::size_str::deserialize(d).map(Some)
    }
}

/// serde helper for byte sizes written as strings or integers.
pub mod size_str {
    use serde::{Deserialize, Deserializer};

    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Raw {
        N(u64),
        S(String),
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<u64, D::Error> {
        match Raw::deserialize(d)? {
            Raw::N(n) => Ok(n),
            Raw::S(s) => super::parse_size(&s).map_err(serde::de::Error::custom),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations() {
        assert_eq!(parse_duration("500ms").unwrap(), Duration::from_millis(500));
        assert_eq!(parse_duration("6s").unwrap(), Duration::from_secs(6));
        assert_eq!(parse_duration("2m").unwrap(), Duration::from_secs(120));
        assert_eq!(
            parse_duration("7d").unwrap(),
            Duration::from_secs(7 * 86400)
        );
        assert_eq!(parse_duration("1.5").unwrap(), Duration::from_millis(1500));
        assert!(parse_duration("6 parsecs").is_err());
        assert!(parse_duration("").is_err());
    }

    #[test]
    fn sizes() {
        assert_eq!(parse_size("512KiB").unwrap(), 512 * 1024);
        assert_eq!(parse_size("4MiB").unwrap(), 4 << 20);
        assert_eq!(parse_size("4096").unwrap(), 4096);
        assert!(parse_size("4XB").is_err());
        assert!(parse_size("99999999999TiB").is_err());
    }
}
