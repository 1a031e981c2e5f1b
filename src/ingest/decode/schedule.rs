//! A series' headers: `x-redisched-every` (ms), or `x-redisched-cron` with
//! `x-redisched-tz`, and `x-redisched-jitter` (ms), read as every face reads them
//! ([`Schedule::from_parts`]); and whether a delivery's batch must read the Redis
//! server's clock before it is decoded ([`needs_clock`]).

use lapin::types::FieldTable;
use lapin::BasicProperties;

use super::value::{show, text};
use super::{invalid, Invalid};
use crate::job::headers;
use crate::job::meta::integer;
use crate::job::schedule::{parse_jitter, PartsError, Schedule, ScheduleParts};

/// Whether decoding this delivery may need the Redis server's clock: a put or replace
/// (`x-redisched-op` absent, `put` or `replace`) naming `x-redisched-cron`, whose first
/// occurrence is a cron match on that clock. Asked of each delivery of a batch before
/// it is decoded, so a batch reads `TIME` once, and only when it has a cron series. It
/// may say yes of a command that then turns out invalid, never no of a cron series.
pub fn needs_clock(props: &BasicProperties) -> bool {
    let Some(table) = props.headers().as_ref() else {
        return false;
    };
    let put = match table.inner().get(headers::OP) {
        None => true,
        Some(op) => matches!(text(op).as_deref(), Some("put" | "replace")),
    };
    put && table.inner().contains_key(headers::CRON)
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

    use super::super::fixtures::{props, refused, s, series, NOW, RULES};
    use super::super::{decode_parts, invalid};
    use super::needs_clock;
    use crate::job::Due;
    use crate::store::Op;

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

    #[test]
    fn a_batch_reads_the_clock_only_for_a_put_or_replace_naming_a_cron() {
        let cron = || ("x-redisched-cron", s("0 9 * * *"));
        assert!(needs_clock(&props(&[cron()])));
        assert!(needs_clock(&props(&[("x-redisched-op", s("put")), cron()])));
        assert!(needs_clock(&props(&[
            ("x-redisched-op", s("replace")),
            cron()
        ])));
        assert!(!needs_clock(&props(&[
            ("x-redisched-op", s("delete")),
            cron()
        ])));
        assert!(!needs_clock(&props(&[
            ("x-redisched-op", s("upsert")),
            cron()
        ])));
        let every = || ("x-redisched-every", AMQPValue::LongInt(5000));
        assert!(!needs_clock(&props(&[every()])));
        assert!(!needs_clock(&props(&[])));
        assert!(!needs_clock(&lapin::BasicProperties::default()));
        // Without the clock a cron series could not be placed: never no of one.
        let err = decode_parts("t", &props(&[cron()]), b"", RULES, None).expect_err("no clock");
        assert_eq!(
            err,
            invalid("internal: a cron series decoded without the Redis server's clock")
        );
        // Anything else decodes without it, as it would with it.
        for headers in [
            vec![every()],
            vec![],
            vec![("x-delay", AMQPValue::LongInt(5))],
        ] {
            let without = decode_parts("t", &props(&headers), b"", RULES, None);
            let with = decode_parts("t", &props(&headers), b"", RULES, Some(NOW));
            assert_eq!(without, with);
            assert!(matches!(without.map(|c| c.op), Ok(Op::Put(_))));
        }
        assert!(matches!(
            series(&[cron()]).map(|(due, _)| due),
            Ok(Due::At(at)) if at > NOW
        ));
    }
}
