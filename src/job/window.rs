//! Times as an operator writes them, and a window of them: the one rule of every face
//! that takes a past time (`--since`/`--until` and `since`/`until` of a re-drive by
//! target, a signing secret's `expires_at`). A time is epoch milliseconds (digits only)
//! or RFC 3339 (`2030-01-01T09:00:00Z`, an offset such as `+02:00`, or no zone = UTC).

use serde::Serialize;

use super::MAX_TIME_MS;

/// Epoch ms of an RFC 3339 time (`Z`, an offset, or no zone = UTC); the reason in the
/// parser's words when it is not one, or lies before 1970 or beyond [`MAX_TIME_MS`].
pub fn rfc3339_ms(raw: &str) -> Result<i64, String> {
    let ms = match chrono::DateTime::parse_from_rfc3339(raw) {
        Ok(time) => time.timestamp_millis(),
        // No zone (and the space separator): what `--at` accepts, read as UTC.
        Err(_) => match humantime::parse_rfc3339_weak(raw) {
            Ok(time) => match time.duration_since(std::time::UNIX_EPOCH) {
                Ok(since) => i64::try_from(since.as_millis()).unwrap_or(i64::MAX),
                Err(_) => -1,
            },
            // The parser has no years before 1970 and calls them "out of range".
            Err(_) if raw.len() > 4 && raw.as_bytes()[4] == b'-' && &raw[..4] < "1970" => -1,
            Err(err) => return Err(err.to_string()),
        },
    };
    if ms < 0 {
        return Err("it is before 1970-01-01T00:00:00Z".into());
    }
    if ms > MAX_TIME_MS {
        return Err(format!("it is beyond {MAX_TIME_MS} ms since 1970"));
    }
    Ok(ms)
}

/// A time a user wrote: epoch ms (digits only) or RFC 3339. `field` names it in the
/// error (`--since`, `until`).
pub fn time_ms(field: &str, raw: &str) -> Result<i64, WindowError> {
    let raw = raw.trim();
    if !raw.is_empty() && raw.bytes().all(|b| b.is_ascii_digit()) {
        return match raw.parse::<i64>() {
            Ok(ms) if ms <= MAX_TIME_MS => Ok(ms),
            _ => Err(WindowError(format!(
                "{field} {raw} is out of range: at most {MAX_TIME_MS} ms since 1970"
            ))),
        };
    }
    rfc3339_ms(raw).map_err(|why| {
        WindowError(format!(
            "{field} must be epoch milliseconds or an RFC 3339 time (2030-01-01T09:00:00Z), got {raw:?}: {why}"
        ))
    })
}

/// Why a window was refused, in the user's terms.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct WindowError(pub String);

/// A window of past times, epoch ms, both ends included: which parked jobs a re-drive
/// by target takes (those whose last failure falls in it).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct FailureWindow {
    pub since: i64,
    pub until: i64,
}

/// The names a face gives the two ends (`("since", "until")`, `("--since", "--until")`).
pub type WindowFields<'a> = (&'a str, &'a str);

impl FailureWindow {
    /// The window the user asked for. `since` defaults to 0 (the beginning), `until` to
    /// `now` (the Redis server's clock); an `until` later than `now` is `now`, as nothing
    /// can have failed later and a loop over the window must end. Refused: a value that
    /// is not a time, and a `since` after the `until`.
    pub fn parse(
        fields: WindowFields<'_>,
        since: Option<&str>,
        until: Option<&str>,
        now: i64,
    ) -> Result<Self, WindowError> {
        let (since_field, until_field) = fields;
        let since_ms = since.map_or(Ok(0), |raw| time_ms(since_field, raw))?;
        let asked_until = until.map_or(Ok(now), |raw| time_ms(until_field, raw))?;
        let until_ms = asked_until.min(now);
        if since_ms > until_ms {
            let until_said = if until.is_none() || asked_until > now {
                let at = std::time::UNIX_EPOCH + std::time::Duration::from_millis(now as u64);
                format!("now ({})", humantime::format_rfc3339_millis(at))
            } else {
                format!("{until_field} {}", until.unwrap_or_default())
            };
            return Err(WindowError(format!(
                "{since_field} {} is after {until_said}: no failure can fall in that window",
                since.unwrap_or_default()
            )));
        }
        Ok(Self {
            since: since_ms,
            until: until_ms,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const FIELDS: WindowFields<'static> = ("--since", "--until");

    #[test]
    fn times_are_epoch_ms_or_rfc3339() {
        assert_eq!(time_ms("since", "0"), Ok(0));
        assert_eq!(time_ms("since", "1767225600000"), Ok(1_767_225_600_000));
        assert_eq!(
            time_ms("since", "2026-01-01T00:00:00Z"),
            Ok(1_767_225_600_000)
        );
        assert_eq!(
            time_ms("since", "2026-01-01T01:00:00+01:00"),
            Ok(1_767_225_600_000)
        );
        assert_eq!(
            time_ms("since", "2026-01-01T00:00:00.250Z"),
            Ok(1_767_225_600_250)
        );
        assert_eq!(
            time_ms("since", "2026-01-01T00:00:00"),
            Ok(1_767_225_600_000),
            "no zone is UTC"
        );
        let err = time_ms("--since", "yesterday").unwrap_err().0;
        assert!(
            err.starts_with(
                "--since must be epoch milliseconds or an RFC 3339 time (2030-01-01T09:00:00Z), got \"yesterday\""
            ),
            "{err}"
        );
        let err = time_ms("since", "1969-12-31T23:59:59Z").unwrap_err().0;
        assert!(err.ends_with("it is before 1970-01-01T00:00:00Z"), "{err}");
        let err = time_ms("until", "99999999999999999").unwrap_err().0;
        assert!(
            err.starts_with("until 99999999999999999 is out of range"),
            "{err}"
        );
        assert!(time_ms("since", "-5").is_err(), "a sign is not digits");
        assert!(time_ms("since", "").is_err());
    }

    #[test]
    fn a_window_defaults_to_everything_until_now_and_is_checked() {
        let now = 1_767_225_600_000;
        let window = FailureWindow::parse(FIELDS, None, None, now).unwrap();
        assert_eq!(
            window,
            FailureWindow {
                since: 0,
                until: now
            }
        );
        let window = FailureWindow::parse(FIELDS, Some("1000"), Some("2000"), now).unwrap();
        assert_eq!(
            window,
            FailureWindow {
                since: 1000,
                until: 2000
            }
        );
        // A future end is now.
        let window = FailureWindow::parse(FIELDS, None, Some("2100-01-01T00:00:00Z"), now);
        assert_eq!(window.unwrap().until, now);
        let err = FailureWindow::parse(FIELDS, Some("2000"), Some("1000"), now)
            .unwrap_err()
            .0;
        assert_eq!(
            err,
            "--since 2000 is after --until 1000: no failure can fall in that window"
        );
        let err = FailureWindow::parse(("since", "until"), Some("2100-01-01T00:00:00Z"), None, now)
            .unwrap_err()
            .0;
        assert_eq!(
            err,
            "since 2100-01-01T00:00:00Z is after now (2026-01-01T00:00:00.000Z): no failure can fall in that window"
        );
        let err = FailureWindow::parse(("since", "until"), None, Some("soon"), now)
            .unwrap_err()
            .0;
        assert!(err.starts_with("until must be epoch milliseconds"), "{err}");
    }
}
