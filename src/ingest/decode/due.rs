//! When a put is due: `x-delay` (ms from now, at most `limits.max_delay_ms`) or
//! `x-deliver-at` (epoch ms) as given, and its first occurrence: a series' one interval
//! from now unless given, a cron series' the first match on the Redis server's clock.

use lapin::types::AMQPValue;

use super::value::millis;
use super::{invalid, Invalid};
use crate::job::headers;
use crate::job::schedule::Schedule;
use crate::job::Due;
use crate::store::Limits;

/// The due time asked for: `x-delay` (at most `limits.max_delay_ms`) or `x-deliver-at`,
/// never both; `None` for neither.
pub(super) fn due_of(
    delay: Option<&AMQPValue>,
    deliver_at: Option<&AMQPValue>,
    limits: Limits,
) -> Result<Option<Due>, Invalid> {
    match (delay, deliver_at) {
        (Some(_), Some(_)) => Err(invalid(format!(
            "both {} and {} are set; give one",
            headers::DELAY,
            headers::DELIVER_AT
        ))),
        (Some(delay), None) => {
            let (ms, given) = millis(delay, headers::DELAY)?;
            let due = Due::delay(headers::DELAY, &given, ms).map_err(|e| invalid(e.to_string()))?;
            if ms > i128::from(limits.max_delay_ms) {
                return Err(invalid(format!(
                    "{} {given} ms exceeds the maximum delay of {} ms",
                    headers::DELAY,
                    limits.max_delay_ms
                )));
            }
            Ok(Some(due))
        }
        (None, Some(at)) => {
            let (ms, given) = millis(at, headers::DELIVER_AT)?;
            Due::at(headers::DELIVER_AT, &given, ms)
                .map(Some)
                .map_err(|e| invalid(e.to_string()))
        }
        (None, None) => Ok(None),
    }
}

/// A put's first occurrence: as given, else now; a series' as given, else one interval
/// from now; a cron series' the first match at or after the start given (after now
/// without one), on `now_ms`, the Redis server's clock as the batch read it before
/// decoding (`super::needs_clock`), the clock every due time refers to.
pub(super) fn first_due(
    schedule: Option<&Schedule>,
    given: Option<Due>,
    now_ms: Option<i64>,
) -> Result<Due, Invalid> {
    match (schedule, given) {
        (Some(Schedule::Every { ms }), None) => {
            Ok(Due::Delay(i64::try_from(*ms).unwrap_or(i64::MAX)))
        }
        (Some(cron @ Schedule::Cron { .. }), start) => {
            let now_ms = now_ms.ok_or_else(|| {
                invalid("internal: a cron series decoded without the Redis server's clock")
            })?;
            // The one rule of every face (`Schedule::first_due`): the first match at or
            // after the requested start, which is never before now.
            cron.first_due(start, now_ms).map_err(|_| {
                invalid(format!(
                    "{} {:?} has no occurrence after the requested start",
                    headers::CRON,
                    cron.cron_expr().unwrap_or_default()
                ))
            })
        }
        (_, given) => Ok(given.unwrap_or(Due::NOW)),
    }
}

#[cfg(test)]
mod tests {
    use lapin::types::AMQPValue;

    use super::super::fixtures::{due, s, series, NOW};
    use crate::job::Due;

    #[test]
    fn delays_in_every_accepted_form() {
        assert_eq!(due(&[]), Ok(Due::NOW));
        assert_eq!(
            due(&[("x-delay", AMQPValue::LongInt(1500))]),
            Ok(Due::Delay(1500))
        );
        assert_eq!(
            due(&[("x-delay", AMQPValue::ShortShortUInt(7))]),
            Ok(Due::Delay(7))
        );
        assert_eq!(due(&[("x-delay", s(" 250 "))]), Ok(Due::Delay(250)));
        assert_eq!(
            due(&[("x-delay", AMQPValue::Double(1.2))]),
            Ok(Due::Delay(2)),
            "rounded up"
        );
        assert_eq!(due(&[("x-delay", s("2.5"))]), Ok(Due::Delay(3)));
        assert_eq!(
            due(&[("x-delay", AMQPValue::LongInt(-40))]),
            Ok(Due::Delay(0))
        );
        assert_eq!(
            due(&[("x-deliver-at", AMQPValue::LongLongInt(1_700_000_000_000))]),
            Ok(Due::At(1_700_000_000_000))
        );
    }

    #[test]
    fn bad_delays_are_refused_with_a_reason() {
        for bad in [
            s("soon"),
            s("NaN"),
            s("inf"),
            AMQPValue::Double(f64::NAN),
            AMQPValue::Boolean(true),
        ] {
            let err = due(&[("x-delay", bad.clone())]).expect_err("refused");
            assert!(err.0.contains("x-delay"), "{err} for {bad:?}");
        }
        let err = due(&[("x-delay", AMQPValue::LongLongInt(86_400_001))]).expect_err("too long");
        assert!(err.0.contains("exceeds the maximum delay"), "{err}");
        let err = due(&[("x-delay", AMQPValue::Double(1e300))]).expect_err("too long");
        assert!(
            err.0.contains("out of range") || err.0.contains("exceeds"),
            "{err}"
        );
        let err = due(&[
            ("x-delay", AMQPValue::LongInt(5)),
            ("x-deliver-at", AMQPValue::LongInt(5)),
        ])
        .expect_err("both");
        assert!(err.0.contains("both"), "{err}");
    }

    #[test]
    fn cron_series_first_occurrence_on_the_server_clock() {
        // NOW is Tuesday 2026-12-01T00:00:00Z.
        let hour = 3_600_000;
        assert_eq!(
            series(&[("x-redisched-cron", s("0 9 * * *"))]),
            Ok((
                Due::At(NOW + 9 * hour),
                Some("cron:0 9 * * *|UTC".to_owned())
            ))
        );
        assert_eq!(
            series(&[
                ("x-redisched-cron", s("0 9 * * MON-FRI")),
                ("x-redisched-tz", s("Europe/Berlin")),
            ]),
            Ok((
                Due::At(NOW + 8 * hour),
                Some("cron:0 9 * * MON-FRI|Europe/Berlin".to_owned())
            ))
        );
        // Strictly after now without a start; at or after the start with one.
        assert_eq!(
            series(&[("x-redisched-cron", s("0 0 * * *"))]).map(|r| r.0),
            Ok(Due::At(NOW + 24 * hour))
        );
        assert_eq!(
            series(&[
                ("x-redisched-cron", s("0 0 * * *")),
                ("x-delay", AMQPValue::LongInt(0)),
            ])
            .map(|r| r.0),
            Ok(Due::At(NOW))
        );
        assert_eq!(
            series(&[
                ("x-redisched-cron", s("*/2 * * * * *")),
                ("x-delay", AMQPValue::LongInt(3_000)),
            ])
            .map(|r| r.0),
            Ok(Due::At(NOW + 4_000))
        );
        assert_eq!(
            series(&[
                ("x-redisched-cron", s("0 9 * * *")),
                ("x-deliver-at", AMQPValue::LongLongInt(NOW + 10 * hour)),
            ])
            .map(|r| r.0),
            Ok(Due::At(NOW + 33 * hour))
        );
        // A past start means now.
        assert_eq!(
            series(&[
                ("x-redisched-cron", s("0 9 * * *")),
                ("x-deliver-at", AMQPValue::LongLongInt(1_000)),
            ])
            .map(|r| r.0),
            Ok(Due::At(NOW + 9 * hour))
        );
    }
}
