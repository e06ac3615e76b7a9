//! The clock and the dates keel prints: [`now_ns`], the one reading of the wall clock that
//! stamps times (inode times, snapshots, leases, markers), and civil dates (proleptic
//! Gregorian, UTC) from a count of days since 1970-01-01 for the timestamps keel prints
//! without a date library: [`rfc3339`] (`/status`) and [`fmt_ns`] (snapshot listings, lease
//! holders). Pure arithmetic besides the clock.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// Now, in nanoseconds since the Unix epoch (0 for a clock set before it).
pub fn now_ns() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos() as i64)
        .unwrap_or(0)
}

/// `(year, month, day, hour, minute, second)` of `secs` seconds after the epoch (before it
/// when negative).
fn civil_time(secs: i64) -> (i64, u32, u32, i64, i64, i64) {
    let (days, rem) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    let (y, m, d) = civil_from_days(days);
    (y, m, d, rem / 3600, rem % 3600 / 60, rem % 60)
}

/// `2026-01-02T03:04:05.678Z` for `t` (UTC, milliseconds).
pub fn rfc3339(t: SystemTime) -> String {
    let d = t.duration_since(UNIX_EPOCH).unwrap_or(Duration::ZERO);
    let (year, month, day, h, min, s) = civil_time(d.as_secs() as i64);
    format!(
        "{year:04}-{month:02}-{day:02}T{h:02}:{min:02}:{s:02}.{:03}Z",
        d.subsec_millis()
    )
}

/// `YYYY-MM-DD HH:MM:SSZ` (UTC) of a time in nanoseconds since the epoch.
pub fn fmt_ns(ns: i64) -> String {
    let (y, m, d, h, min, s) = civil_time(ns.div_euclid(1_000_000_000));
    format!("{y:04}-{m:02}-{d:02} {h:02}:{min:02}:{s:02}Z")
}

/// `(year, month 1..=12, day 1..=31)` of the day `days` after 1970-01-01 (before it when
/// negative), by Howard Hinnant's `civil_from_days`.
pub fn civil_from_days(days: i64) -> (i64, u32, u32) {
    // Days since 0000-03-01, so that the leap day ends each 400-year era's year.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097); // day of the era, 0..=146_096
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365; // 0..=399
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100); // day of the March year, 0..=365
    let mp = (5 * doy + 2) / 153; // March = 0
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    // In range by construction: month 1..=12, day 1..=31.
    (year, month as u32, day as u32)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rfc3339_known_dates() {
        assert_eq!(rfc3339(UNIX_EPOCH), "1970-01-01T00:00:00.000Z");
        let leap = UNIX_EPOCH + Duration::from_secs(951_782_400); // 2000-02-29
        assert_eq!(rfc3339(leap), "2000-02-29T00:00:00.000Z");
        let t = UNIX_EPOCH + Duration::from_secs(4_102_444_799); // 2099-12-31T23:59:59
        assert_eq!(
            rfc3339(t + Duration::from_millis(999)),
            "2099-12-31T23:59:59.999Z"
        );
        let before = UNIX_EPOCH - Duration::from_secs(1);
        assert_eq!(rfc3339(before), "1970-01-01T00:00:00.000Z");
    }

    #[test]
    fn fmt_ns_known_times() {
        const S: i64 = 1_000_000_000;
        assert_eq!(fmt_ns(0), "1970-01-01 00:00:00Z");
        assert_eq!(fmt_ns(-1), "1969-12-31 23:59:59Z");
        assert_eq!(
            fmt_ns((951_782_400 + 3661) * S + 999),
            "2000-02-29 01:01:01Z"
        );
        assert_eq!(fmt_ns(4_102_444_799 * S), "2099-12-31 23:59:59Z");
    }

    #[test]
    fn known_days() {
        assert_eq!(civil_from_days(0), (1970, 1, 1));
        assert_eq!(civil_from_days(-1), (1969, 12, 31));
        assert_eq!(civil_from_days(59), (1970, 3, 1));
        assert_eq!(civil_from_days(11_016), (2000, 2, 29));
        assert_eq!(civil_from_days(11_017), (2000, 3, 1));
        assert_eq!(civil_from_days(47_481), (2099, 12, 31));
        assert_eq!(civil_from_days(-719_468), (0, 3, 1));
    }

    /// Day by day across four centuries, the date moves on by exactly one day.
    #[test]
    fn consecutive_days_are_consecutive_dates() {
        let leap = |y: i64| (y % 4 == 0 && y % 100 != 0) || y % 400 == 0;
        let len = |y: i64, m: u32| match m {
            2 if leap(y) => 29,
            2 => 28,
            4 | 6 | 9 | 11 => 30,
            _ => 31,
        };
        let mut prev = civil_from_days(-80_000);
        for d in -79_999..80_000 {
            let (y, m, day) = civil_from_days(d);
            let (py, pm, pd) = prev;
            let want = if pd < len(py, pm) {
                (py, pm, pd + 1)
            } else if pm < 12 {
                (py, pm + 1, 1)
            } else {
                (py + 1, 1, 1)
            };
            assert_eq!((y, m, day), want, "day {d}");
            prev = (y, m, day);
        }
    }
}
