//! When a put is due and how it repeats: `x-delay` (ms from now, at most
//! `limits.max_delay_ms`) or `x-deliver-at` (epoch ms) as given; a series'
//! `x-redisched-every` (ms), or `x-redisched-cron` with `x-redisched-tz`, and
//! `x-redisched-jitter` (ms), read as every face reads them
//! ([`Schedule::from_parts`]); and its first occurrence: a series' one interval from
//! now unless given, a cron series' the first match on the Redis server's clock.

use lapin::types::{AMQPValue, FieldTable};

use super::value::{millis, show, text};
use super::{invalid, Invalid};
use crate::job::headers;
use crate::job::meta::integer;
use crate::job::schedule::{parse_jitter, PartsError, Schedule, ScheduleParts};
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

/// The schedule and jitter a put or replace asks for, if any: the headers' values as
/// text (an integer of any AMQP width for `every` and `jitter`), then every face's rule
/// ([`Schedule::from_parts`]), its refusals named in header terms.
pub(super) fn schedule(
    table: Option<&FieldTable>,
    min_interval_ms: u64,
) -> Result<Option<(Schedule, u64)>, Invalid> {
    let header = |name: &str| table.and_then(|t| t.inner().get(name));
    let millis_text = |name: &str| {
        match header(name) {
        None => Ok(None),
        Some(value) => match integer(value) {
            Some(ms) => Ok(Some(ms.to_string())),
            None => text(value).map(Some).ok_or_else(|| {
                invalid(format!(
                    "{name} must be an integer number of milliseconds (or a numeric string), got {}",
                    show(value)
                ))
            }),
        },
    }
    };
    let text_of = |name: &str, what: &str| match header(name) {
        None => Ok(None),
        Some(value) => text(value)
            .map(Some)
            .ok_or_else(|| invalid(format!("{name} must be a text {what}, got {}", show(value)))),
    };
    let every = millis_text(headers::EVERY)?;
    let cron = text_of(headers::CRON, "cron expression")?;
    let tz = text_of(headers::TZ, "IANA time zone name")?;
    let jitter = millis_text(headers::JITTER)?;
    let parts = ScheduleParts {
        every: every.as_deref(),
        cron: cron.as_deref(),
        tz: tz.as_deref(),
        jitter: jitter.as_deref(),
    };
    let named =
        |name: &str, e: crate::job::schedule::ScheduleError| invalid(format!("{name}: {e}"));
    match Schedule::from_parts(parts, min_interval_ms) {
        Ok(recurring) => Ok(recurring),
        Err(PartsError::BothEveryAndCron) => Err(invalid(format!(
            "both {} and {} are set; give one",
            headers::EVERY,
            headers::CRON
        ))),
        Err(PartsError::TzWithoutCron) => Err(invalid(format!(
            "{} is only used with {}",
            headers::TZ,
            headers::CRON
        ))),
        // Over AMQP a jitter of 0 on a one-shot job is accepted as none, as it always was.
        Err(PartsError::JitterWithoutSchedule) => {
            match parse_jitter(jitter.as_deref().unwrap_or_default()) {
                Ok(0) => Ok(None),
                Err(e) => Err(named(headers::JITTER, e)),
                Ok(_) => Err(invalid(format!(
                    "{} is only used with {} or {} (a one-shot job has no occurrences to spread)",
                    headers::JITTER,
                    headers::EVERY,
                    headers::CRON
                ))),
            }
        }
        Err(PartsError::Every(e)) => Err(named(headers::EVERY, e)),
        Err(PartsError::Cron(e)) => Err(named(headers::CRON, e)),
        Err(PartsError::Jitter(e)) => Err(named(headers::JITTER, e)),
    }
}

#[cfg(test)]
mod tests {
    use lapin::types::AMQPValue;

    use super::super::decode_parts;
    use super::super::fixtures::{due, props, refused, s, series, NOW, RULES};
    use crate::job::Due;
    use crate::store::Op;

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

    #[test]
    fn interval_series_in_every_integer_width_and_as_text() {
        let every = |v: AMQPValue| series(&[("x-redisched-every", v)]);
        let expect = Ok((Due::Delay(60_000), Some("every:60000".to_owned())));
        assert_eq!(every(AMQPValue::LongInt(60_000)), expect);
        assert_eq!(every(AMQPValue::LongUInt(60_000)), expect);
        assert_eq!(every(AMQPValue::LongLongInt(60_000)), expect);
        assert_eq!(every(s("60000")), expect);
        assert_eq!(every(s(" 1m ")), expect);
        assert_eq!(
            every(AMQPValue::ShortUInt(1000)),
            Ok((Due::Delay(1000), Some("every:1000".to_owned())))
        );
        // A first occurrence given explicitly wins over "one interval from now".
        assert_eq!(
            series(&[
                ("x-redisched-every", AMQPValue::LongInt(5000)),
                ("x-delay", AMQPValue::LongInt(10)),
            ]),
            Ok((Due::Delay(10), Some("every:5000".to_owned())))
        );
        assert_eq!(
            series(&[
                ("x-redisched-every", AMQPValue::LongInt(5000)),
                ("x-deliver-at", AMQPValue::LongLongInt(NOW + 7)),
            ]),
            Ok((Due::At(NOW + 7), Some("every:5000".to_owned())))
        );
    }

    #[test]
    fn bad_schedules_are_refused_with_a_reason() {
        let err = refused(&[
            ("x-redisched-every", AMQPValue::LongInt(5000)),
            ("x-redisched-cron", s("* * * * *")),
        ]);
        assert!(
            err.contains("both x-redisched-every and x-redisched-cron"),
            "{err}"
        );
        let err = refused(&[("x-redisched-tz", s("Europe/Berlin"))]);
        assert!(
            err.contains("x-redisched-tz is only used with x-redisched-cron"),
            "{err}"
        );
        let err = refused(&[
            ("x-redisched-every", AMQPValue::LongInt(5000)),
            ("x-redisched-tz", s("UTC")),
        ]);
        assert!(err.contains("only used with"), "{err}");
        let err = refused(&[("x-redisched-cron", s("0 25 * * *"))]);
        assert!(
            err.starts_with("x-redisched-cron:") && err.contains("invalid"),
            "{err}"
        );
        let err = refused(&[("x-redisched-cron", s("0 9 * *"))]);
        assert!(err.contains("expected 5"), "{err}");
        let err = refused(&[
            ("x-redisched-cron", s("0 9 * * *")),
            ("x-redisched-tz", s("Europe/Atlantis")),
        ]);
        assert!(
            err.contains("unknown time zone \"Europe/Atlantis\""),
            "{err}"
        );
        let err = refused(&[("x-redisched-cron", s("0 0 30 2 *"))]);
        assert!(err.contains("never fires"), "{err}");
        let err = refused(&[("x-redisched-every", AMQPValue::LongInt(999))]);
        assert!(err.contains("below the minimum of 1000 ms"), "{err}");
        let err = refused(&[("x-redisched-every", s("0"))]);
        assert!(err.contains("positive"), "{err}");
        let err = refused(&[("x-redisched-every", AMQPValue::LongInt(-5))]);
        assert!(err.contains("positive"), "{err}");
        let err = refused(&[("x-redisched-every", s("often"))]);
        assert!(
            err.contains("x-redisched-every") && err.contains("often"),
            "{err}"
        );
        let err = refused(&[("x-redisched-every", AMQPValue::Double(1500.0))]);
        assert!(err.contains("integer number of milliseconds"), "{err}");
        let err = refused(&[("x-redisched-cron", AMQPValue::LongInt(5))]);
        assert!(err.contains("text cron expression"), "{err}");
        let err = refused(&[
            ("x-redisched-cron", s("* * * * *")),
            ("x-redisched-tz", AMQPValue::Boolean(true)),
        ]);
        assert!(err.contains("text IANA time zone"), "{err}");
    }

    #[test]
    fn a_series_jitter_is_checked_kept_in_meta_and_bounded_for_its_first_occurrence() {
        let resolve = |headers: &[(&str, AMQPValue)]| {
            decode_parts("t", &props(headers), b"body", RULES, Some(NOW))
        };
        let every = resolve(&[
            ("x-redisched-every", AMQPValue::LongInt(1000)),
            ("x-redisched-jitter", AMQPValue::LongInt(500)),
        ])
        .expect("accepted");
        assert_eq!(every.jitter_ms, 500);
        let Op::Put(put) = &every.op else {
            panic!("not a put")
        };
        let stored = crate::job::meta::decode_meta(&put.meta).expect("meta");
        assert_eq!(
            crate::job::meta::jitter_of(&stored),
            500,
            "dispatch reads it there"
        );
        let text = resolve(&[
            ("x-redisched-every", AMQPValue::LongInt(1000)),
            ("x-redisched-jitter", s("250")),
        ])
        .expect("a numeric string");
        assert_eq!(text.jitter_ms, 250);
        // Cron: the first occurrence (09:00) is an hour before the next (10:00).
        let cron = resolve(&[
            ("x-redisched-cron", s("0 9,10 * * *")),
            ("x-redisched-jitter", AMQPValue::LongInt(7_200_000)),
        ])
        .expect("any jitter suits cron");
        assert_eq!(cron.jitter_ms, 3_600_000);

        let every_1s = |jitter: AMQPValue| {
            refused(&[
                ("x-redisched-every", AMQPValue::LongInt(1000)),
                ("x-redisched-jitter", jitter),
            ])
        };
        let err = every_1s(AMQPValue::LongInt(1000));
        assert!(
            err.contains("x-redisched-jitter") && err.contains("below the interval"),
            "{err}"
        );
        let err = every_1s(AMQPValue::LongInt(-5));
        assert!(
            err.contains("x-redisched-jitter") && err.contains("-5"),
            "{err}"
        );
        let err = every_1s(s("soon"));
        assert!(
            err.contains("not a number") && err.contains("soon"),
            "{err}"
        );
        let err = every_1s(AMQPValue::Double(1.5));
        assert!(err.contains("integer number of milliseconds"), "{err}");
        let err = refused(&[("x-redisched-jitter", AMQPValue::LongInt(500))]);
        assert!(err.contains("only used with"), "{err}");
    }
}
