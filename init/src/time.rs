//! Civil dates (proleptic Gregorian, UTC) from a count of days since 1970-01-01, for the
//! timestamps keel prints without a date library: `control::status::rfc3339` (`/status`)
//! and `persist::ops::fmt_time` (snapshot listings, lease holders). Pure arithmetic.

/// `2026-01-02T03:04:05.678Z` for `t` (UTC, milliseconds).
pub fn rfc3339(t: std::time::SystemTime) -> String {
    let d = t
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or(std::time::Duration::ZERO);
    let secs = d.as_secs();
    let (days, rem) = (secs / 86_400, secs % 86_400);
    let (year, month, day) = civil_from_days(days as i64);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{:03}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60,
        d.subsec_millis()
    )
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
    use super::civil_from_days;

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
