//! The schedule of a recurring job: an interval (`every`) or a cron expression in an IANA
//! time zone (`cron` + `tz`), and when its occurrences fall.
//!
//! Cron expressions are parsed and evaluated by the `croner` crate, zones come from
//! `chrono-tz` (the IANA database compiled in). An expression has 5 fields (minute hour
//! day-of-month month day-of-week) or 6 (a leading seconds field); ranges, lists, steps,
//! `*`, month names (`JAN`..`DEC`) and day names (`SUN`..`SAT`) are accepted. When both
//! day-of-month and day-of-week are restricted, a day matching either fires (Vixie cron).
//!
//! # Time zones and daylight saving time
//!
//! An expression is matched against the **local wall clock** of its zone, so
//! `0 9 * * *` in `Europe/Berlin` fires at 09:00 local time on both sides of a change
//! (07:00 UTC in summer, 08:00 UTC in winter).
//!
//! - **Skipped local times** (spring forward, e.g. 02:00–02:59 in Berlin on the last
//!   Sunday of March): a schedule at one fixed time of day (single second, minute and
//!   hour, e.g. `30 2 * * *`) fires once at the first instant after the gap (03:00 local);
//!   a schedule with wildcards or steps in the time fields (e.g. `*/15 * * * *`) simply
//!   has no occurrences in the missing hour.
//! - **Repeated local times** (fall back, e.g. 02:00–02:59 twice in Berlin on the last
//!   Sunday of October): a fixed-time schedule fires once, at the first (summer time)
//!   instant; a schedule with wildcards or steps fires in both passes of the hour.
//!
//! An interval (`every`) ignores zones: occurrences are exactly `ms` apart.
//!
//! # Spec strings
//!
//! [`Schedule::to_spec`] writes the opaque spec the store keeps with a series
//! (lua/README.md, *Recurring series*): `every:<ms>` or `cron:<expr>|<tz>`; the zone is
//! always written (`UTC` by default). [`Schedule::from_spec`] reads it back.
use std::str::FromStr;

use chrono::{DateTime, TimeZone, Utc};
use chrono_tz::Tz;
use croner::parser::{CronParser, Seconds, Year};

use super::spec::{ScheduleSpec, MAX_SPEC_BYTES};
use crate::job::Due;

/// Zone of a cron schedule given without one.
pub const DEFAULT_TZ: &str = "UTC";
/// Longest interval: 100 years, far beyond any `max_delay_ms`, and safe from overflow.
const MAX_INTERVAL_MS: u64 = 100 * 366 * 24 * 3_600_000;

/// A bad schedule, in the terms of the user who wrote it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ScheduleError {
    #[error("interval must be a positive number of milliseconds, got {0}")]
    NotPositive(i64),
    #[error(
        "interval {interval_ms} ms is below the minimum of {min_ms} ms (limits.min_interval_ms)"
    )]
    BelowMinimum { interval_ms: u64, min_ms: u64 },
    #[error("interval {0} ms is too long (at most {MAX_INTERVAL_MS} ms)")]
    TooLong(u64),
    #[error(
        "interval {text:?} is neither milliseconds nor a duration like 15m or 1h30m: {reason}"
    )]
    BadInterval { text: String, reason: String },
    #[error("cron expression {expr:?} has {fields} fields; expected 5 (minute hour day-of-month month day-of-week) or 6 (a leading seconds field)")]
    FieldCount { expr: String, fields: usize },
    #[error("cron expression {expr:?} is invalid: {reason}")]
    BadCron { expr: String, reason: String },
    #[error("cron expression {0:?} never fires")]
    NeverFires(String),
    #[error("unknown time zone {0:?}; use an IANA name such as Europe/Berlin or UTC")]
    UnknownZone(String),
    #[error("schedule is too long: at most {MAX_SPEC_BYTES} bytes with its time zone")]
    SpecTooLong,
    #[error("unrecognised schedule spec {0:?} (expected every:<ms> or cron:<expr>|<tz>)")]
    BadSpec(String),
    #[error("jitter {text:?} is not a number of milliseconds >= 0")]
    BadJitter { text: String },
    #[error("jitter {jitter_ms} ms must be below the interval of {interval_ms} ms (every occurrence before the next one)")]
    JitterNotBelowInterval { jitter_ms: u64, interval_ms: u64 },
    #[error("jitter {0} ms is too long (at most {MAX_INTERVAL_MS} ms)")]
    JitterTooLong(u64),
}

/// A jitter in ms as given (integer, or a numeric string such as `"500"`): refused when
/// negative or not a number. `0` means none.
pub fn parse_jitter(text: &str) -> Result<u64, ScheduleError> {
    let trimmed = text.trim();
    let ms: u64 = if !trimmed.is_empty() && trimmed.bytes().all(|b| b.is_ascii_digit()) {
        trimmed.parse().map_err(|_| ScheduleError::BadJitter {
            text: text.to_owned(),
        })?
    } else {
        return Err(ScheduleError::BadJitter {
            text: text.to_owned(),
        });
    };
    if ms > MAX_INTERVAL_MS {
        return Err(ScheduleError::JitterTooLong(ms));
    }
    Ok(ms)
}

/// FNV-1a, 32 bits: offset basis 2166136261, prime 16777619 (`lua/put.lua` computes the
/// same in Lua).
fn fnv1a32(parts: &[&[u8]]) -> u32 {
    let mut hash: u32 = 2_166_136_261;
    for part in parts {
        for &byte in *part {
            hash ^= u32::from(byte);
            hash = hash.wrapping_mul(16_777_619);
        }
    }
    hash
}

/// The delay of the occurrence of series `id` in `topic` scheduled at `scheduled_ms`,
/// for a jitter bound of `bound_ms` (see [`Schedule::jitter_bound`]): FNV-1a-32 of
/// `topic \0 id \0 scheduled_ms` (decimal) mod `bound_ms`, 0 without a bound. The same on
/// every bridge, after every restart, and in any client (lua/README.md, *Jitter*).
pub fn jitter_delay(topic: &str, id: &str, scheduled_ms: i64, bound_ms: u64) -> u64 {
    if bound_ms == 0 {
        return 0;
    }
    let scheduled = scheduled_ms.to_string();
    let hash = fnv1a32(&[
        topic.as_bytes(),
        b"\0",
        id.as_bytes(),
        b"\0",
        scheduled.as_bytes(),
    ]);
    u64::from(hash) % bound_ms
}

/// The schedule fields of one put as a face received them, as text (a face whose values
/// can be typed, AMQP's integers, renders them first). `None`: not given.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ScheduleParts<'a> {
    /// An interval: milliseconds or a duration (`15m`).
    pub every: Option<&'a str>,
    /// A cron expression ...
    pub cron: Option<&'a str>,
    /// ... in this IANA zone (default [`DEFAULT_TZ`]).
    pub tz: Option<&'a str>,
    /// Milliseconds each occurrence may be delayed by.
    pub jitter: Option<&'a str>,
}

/// Why [`Schedule::from_parts`] refused a put's schedule fields. Typed, so that each face
/// names the fields in its own terms (`x-redisched-every`, `every`, `--every`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PartsError {
    /// `every` and `cron` both given.
    BothEveryAndCron,
    /// `tz` given without `cron`.
    TzWithoutCron,
    /// `jitter` given for a one-shot job (checked before its value is read).
    JitterWithoutSchedule,
    /// A bad `every` value.
    Every(ScheduleError),
    /// A bad `cron` expression or `tz`.
    Cron(ScheduleError),
    /// A bad `jitter` value, or one not below the `every` interval.
    Jitter(ScheduleError),
}

/// When a recurring job's occurrences fall.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Schedule {
    /// Occurrences `ms` apart, counted from the first due time.
    Every { ms: u64 },
    /// A cron expression (whitespace normalised) evaluated in the IANA zone `tz`.
    Cron { expr: String, tz: String },
}

impl Schedule {
    /// An interval of `ms` milliseconds, at least `min_interval_ms`.
    pub fn every(ms: i64, min_interval_ms: u64) -> Result<Schedule, ScheduleError> {
        let ms = u64::try_from(ms)
            .ok()
            .filter(|&ms| ms > 0)
            .ok_or(ScheduleError::NotPositive(ms))?;
        if ms < min_interval_ms {
            return Err(ScheduleError::BelowMinimum {
                interval_ms: ms,
                min_ms: min_interval_ms,
            });
        }
        if ms > MAX_INTERVAL_MS {
            return Err(ScheduleError::TooLong(ms));
        }
        Ok(Schedule::Every { ms })
    }

    /// An interval written as milliseconds (`900000`) or a duration (`15m`, `1h30m`).
    pub fn parse_every(text: &str, min_interval_ms: u64) -> Result<Schedule, ScheduleError> {
        let trimmed = text.trim();
        let bad = |reason: String| ScheduleError::BadInterval {
            text: text.to_owned(),
            reason,
        };
        let ms: i64 = if !trimmed.is_empty()
            && trimmed
                .strip_prefix('-')
                .unwrap_or(trimmed)
                .bytes()
                .all(|b| b.is_ascii_digit())
        {
            trimmed
                .parse()
                .map_err(|_| bad("number out of range".to_owned()))?
        } else {
            let duration = humantime::parse_duration(trimmed).map_err(|e| bad(e.to_string()))?;
            i64::try_from(duration.as_millis()).map_err(|_| ScheduleError::TooLong(u64::MAX))?
        };
        Schedule::every(ms, min_interval_ms)
    }

    /// A cron expression (5 fields, or 6 with leading seconds) in the IANA zone `tz`
    /// (default `UTC`). Refused: another field count, a field croner cannot parse, an
    /// unknown zone, an expression that never fires.
    pub fn cron(expr: &str, tz: Option<&str>) -> Result<Schedule, ScheduleError> {
        let fields: Vec<&str> = expr.split_whitespace().collect();
        if fields.len() != 5 && fields.len() != 6 {
            return Err(ScheduleError::FieldCount {
                expr: expr.to_owned(),
                fields: fields.len(),
            });
        }
        let expr = fields.join(" ");
        let tz_name = tz.map(str::trim).unwrap_or(DEFAULT_TZ);
        let zone = parse_zone(tz_name)?;
        let parsed = parse_cron(&expr)?;
        // Without a year field a pattern that fires at all fires within 28 years (the
        // calendar repeats); croner gives up after its search limit, so one search from a
        // fixed point tells "never" reliably and the same way on every machine.
        let reference = zone.timestamp_opt(946_684_800, 0).single(); // 2000-01-01T00:00Z
        let fires =
            reference.is_some_and(|start| parsed.find_next_occurrence(&start, false).is_ok());
        if !fires {
            return Err(ScheduleError::NeverFires(expr));
        }
        let schedule = Schedule::Cron {
            expr,
            tz: zone.name().to_owned(),
        };
        if schedule.to_spec().len() > MAX_SPEC_BYTES {
            return Err(ScheduleError::SpecTooLong);
        }
        Ok(schedule)
    }

    /// The one rule of every face for a put's schedule fields: `every`, or `cron` with an
    /// optional `tz`, never both, and `tz` only with `cron`; `jitter` only on a recurring
    /// job, below an `every` interval (any jitter suits cron: it is clamped to each gap).
    /// `Ok(None)`: a one-shot job; otherwise the schedule with its jitter (ms, 0 for none).
    /// Checked in this order: the combination, the schedule, the jitter.
    pub fn from_parts(
        parts: ScheduleParts<'_>,
        min_interval_ms: u64,
    ) -> Result<Option<(Schedule, u64)>, PartsError> {
        let schedule = match (parts.every, parts.cron, parts.tz) {
            (Some(_), Some(_), _) => return Err(PartsError::BothEveryAndCron),
            (_, None, Some(_)) => return Err(PartsError::TzWithoutCron),
            (Some(every), None, None) => {
                Schedule::parse_every(every, min_interval_ms).map_err(PartsError::Every)?
            }
            (None, Some(cron), tz) => Schedule::cron(cron, tz).map_err(PartsError::Cron)?,
            (None, None, None) => {
                return match parts.jitter {
                    Some(_) => Err(PartsError::JitterWithoutSchedule),
                    None => Ok(None),
                };
            }
        };
        let jitter_ms = match parts.jitter {
            None => 0,
            Some(text) => parse_jitter(text)
                .and_then(|ms| schedule.check_jitter(ms))
                .map_err(PartsError::Jitter)?,
        };
        Ok(Some((schedule, jitter_ms)))
    }

    /// Reads a spec written by [`Schedule::to_spec`] (or any client following the
    /// convention). An interval is not held to today's minimum: it was accepted when put.
    pub fn from_spec(spec: &str) -> Result<Schedule, ScheduleError> {
        if let Some(ms) = spec.strip_prefix("every:") {
            let ms: i64 = ms
                .parse()
                .map_err(|_| ScheduleError::BadSpec(spec.to_owned()))?;
            return Schedule::every(ms, 1);
        }
        if let Some((expr, tz)) = spec.strip_prefix("cron:").and_then(|c| c.rsplit_once('|')) {
            return Schedule::cron(expr, Some(tz));
        }
        Err(ScheduleError::BadSpec(spec.to_owned()))
    }

    /// The opaque spec string the store keeps: `every:<ms>` or `cron:<expr>|<tz>`.
    pub fn to_spec(&self) -> String {
        match self {
            Schedule::Every { ms } => format!("every:{ms}"),
            Schedule::Cron { expr, tz } => format!("cron:{expr}|{tz}"),
        }
    }

    /// The spec as the store's type (valid by construction of `Schedule`).
    pub fn store_spec(&self) -> Result<ScheduleSpec, ScheduleError> {
        ScheduleSpec::new(self.to_spec()).map_err(|_| ScheduleError::SpecTooLong)
    }

    pub fn every_ms(&self) -> Option<u64> {
        match self {
            Schedule::Every { ms } => Some(*ms),
            Schedule::Cron { .. } => None,
        }
    }

    pub fn cron_expr(&self) -> Option<&str> {
        match self {
            Schedule::Cron { expr, .. } => Some(expr),
            Schedule::Every { .. } => None,
        }
    }

    pub fn tz(&self) -> Option<&str> {
        match self {
            Schedule::Cron { tz, .. } => Some(tz),
            Schedule::Every { .. } => None,
        }
    }

    /// The first occurrence strictly after `after_ms` (epoch ms). For an interval that is
    /// `after_ms + ms`; for cron the next match (whole seconds). `None` if there is none
    /// representable (out of range) or the spec no longer evaluates.
    pub fn next_after(&self, after_ms: i64) -> Option<i64> {
        match self {
            Schedule::Every { ms } => after_ms.checked_add(i64::try_from(*ms).ok()?),
            Schedule::Cron { expr, tz } => cron_next(expr, tz, after_ms, false),
        }
    }

    /// The first occurrence at or after `ms`: `ms` itself for an interval (a series may
    /// start at any instant), the first cron match at or after it.
    pub fn first_at_or_after(&self, ms: i64) -> Option<i64> {
        match self {
            Schedule::Every { .. } => Some(ms),
            Schedule::Cron { expr, tz } => cron_next(expr, tz, ms, true),
        }
    }

    /// The occurrence to schedule when the occurrence due at `due_ms` is released at
    /// `now_ms`: the first one strictly after both (missed occurrences are coalesced).
    /// An interval stays on its grid (`due + k·ms`), so its phase never drifts.
    pub fn next_occurrence(&self, due_ms: i64, now_ms: i64) -> Option<i64> {
        match self {
            Schedule::Every { ms } => {
                let ms = i64::try_from(*ms).ok()?;
                let behind = now_ms.saturating_sub(due_ms).max(0);
                let steps = behind / ms + 1;
                due_ms.checked_add(steps.checked_mul(ms)?)
            }
            Schedule::Cron { .. } => self.next_after(due_ms.max(now_ms)),
        }
    }
}

impl Schedule {
    /// Checks a jitter for this schedule: below the interval of an `every` series (so
    /// an occurrence never passes the next one). Any jitter suits a cron schedule: it
    /// is clamped to each gap ([`Schedule::jitter_bound`]).
    pub fn check_jitter(&self, jitter_ms: u64) -> Result<u64, ScheduleError> {
        if jitter_ms > MAX_INTERVAL_MS {
            return Err(ScheduleError::JitterTooLong(jitter_ms));
        }
        match self {
            Schedule::Every { ms } if jitter_ms >= *ms => {
                Err(ScheduleError::JitterNotBelowInterval {
                    jitter_ms,
                    interval_ms: *ms,
                })
            }
            _ => Ok(jitter_ms),
        }
    }

    /// The bound the delay of the occurrence scheduled at `scheduled_ms` is taken
    /// modulo: `jitter_ms`, clamped to the gap to the next occurrence (a cron schedule
    /// with irregular gaps), so a jittered occurrence is always strictly before the
    /// next scheduled one. 0: no jitter.
    pub fn jitter_bound(&self, scheduled_ms: i64, jitter_ms: u64) -> u64 {
        if jitter_ms == 0 {
            return 0;
        }
        match self.next_after(scheduled_ms) {
            Some(next) => jitter_ms.min(u64::try_from(next - scheduled_ms).unwrap_or(0)),
            None => jitter_ms,
        }
    }

    /// The occurrence to schedule when a jittered series' occurrence scheduled at
    /// `scheduled_ms` is released at `now_ms`, with its delay: the first one after it
    /// whose **jittered** time is still ahead (so an occurrence whose scheduled time has
    /// passed but whose jittered one has not is not coalesced away; those whose jittered
    /// time passed are, as [`Schedule::next_occurrence`] does without jitter).
    pub fn next_jittered(
        &self,
        topic: &str,
        id: &str,
        scheduled_ms: i64,
        now_ms: i64,
        jitter_ms: u64,
    ) -> Option<(i64, u64)> {
        let jitter = i64::try_from(jitter_ms).ok()?;
        // Every delay is below `jitter_ms`: an occurrence scheduled at or before
        // now - jitter is overdue whatever its delay.
        let mut next = self.next_occurrence(scheduled_ms, now_ms.saturating_sub(jitter))?;
        for _ in 0..1000 {
            let delay = self.occurrence_delay(topic, id, next, jitter_ms);
            if next.saturating_add(i64::try_from(delay).ok()?) > now_ms {
                return Some((next, delay));
            }
            next = self.next_after(next)?;
        }
        let next = self.next_occurrence(scheduled_ms, now_ms)?;
        Some((next, self.occurrence_delay(topic, id, next, jitter_ms)))
    }

    /// The delay of the occurrence of `topic`/`id` scheduled at `scheduled_ms` under a
    /// jitter of `jitter_ms`.
    pub fn occurrence_delay(
        &self,
        topic: &str,
        id: &str,
        scheduled_ms: i64,
        jitter_ms: u64,
    ) -> u64 {
        jitter_delay(
            topic,
            id,
            scheduled_ms,
            self.jitter_bound(scheduled_ms, jitter_ms),
        )
    }
}

impl std::fmt::Display for Schedule {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Schedule::Every { ms } => {
                let text = humantime::format_duration(std::time::Duration::from_millis(*ms));
                write!(f, "every {text}")
            }
            Schedule::Cron { expr, tz } => write!(f, "cron '{expr}' ({tz})"),
        }
    }
}

fn parse_zone(name: &str) -> Result<Tz, ScheduleError> {
    if name.is_empty() || name.contains('|') {
        return Err(ScheduleError::UnknownZone(name.to_owned()));
    }
    Tz::from_str(name).map_err(|_| ScheduleError::UnknownZone(name.to_owned()))
}

fn parse_cron(expr: &str) -> Result<croner::Cron, ScheduleError> {
    if expr.contains(['|', '@']) {
        return Err(ScheduleError::BadCron {
            expr: expr.to_owned(),
            reason: "'|' and '@' are not allowed".to_owned(),
        });
    }
    CronParser::builder()
        .seconds(Seconds::Optional)
        .year(Year::Disallowed)
        .build()
        .parse(expr)
        .map_err(|e| ScheduleError::BadCron {
            expr: expr.to_owned(),
            reason: e.to_string(),
        })
}

/// Next match of `expr` in `tz` after (or, `inclusive`, at) `ms`. Croner works in whole
/// seconds: an inclusive search starts at the next whole second so it never returns a time
/// before `ms`.
fn cron_next(expr: &str, tz: &str, ms: i64, inclusive: bool) -> Option<i64> {
    let zone = parse_zone(tz).ok()?;
    let cron = parse_cron(expr).ok()?;
    let start_ms = if inclusive {
        ms.checked_add(999)?.div_euclid(1000) * 1000
    } else {
        ms
    };
    let start: DateTime<Tz> = Utc
        .timestamp_millis_opt(start_ms)
        .single()?
        .with_timezone(&zone);
    let next = cron.find_next_occurrence(&start, inclusive).ok()?;
    let next_ms = next.timestamp_millis();
    // Croner compares whole seconds; keep "strictly after" / "at or after" exact.
    let ok = if inclusive {
        next_ms >= ms
    } else {
        next_ms > ms
    };
    if ok {
        Some(next_ms)
    } else {
        cron_next(expr, tz, next_ms, false)
    }
}

impl Schedule {
    /// The first occurrence of a series: `explicit` (`--delay`/`--at`, `delay_ms=`/`at=`)
    /// if given (for cron: the first match at or after it, a start in the past meaning
    /// now), else one interval from now or the next cron match after now. `now` is the
    /// Redis server's clock, which every due time refers to. The one rule of ingest, the
    /// CLI and the REST API.
    pub fn first_due(&self, explicit: Option<Due>, now: i64) -> Result<Due, String> {
        let start = match explicit {
            None => {
                return match self.every_ms() {
                    Some(ms) => Ok(Due::Delay(i64::try_from(ms).unwrap_or(i64::MAX))),
                    None => self
                        .next_after(now)
                        .map(Due::At)
                        .ok_or_else(|| format!("{self} has no occurrence after now")),
                }
            }
            // An interval starts exactly when asked; the store resolves a delay itself.
            Some(due) if self.every_ms().is_some() => return Ok(due),
            // A start in the past means now, as for every due time.
            Some(Due::Delay(ms)) => now.saturating_add(ms.max(0)),
            Some(Due::At(at)) => at.max(now),
        };
        self.first_at_or_after(start).map(Due::At).ok_or_else(|| {
            let when = DateTime::from_timestamp_millis(start)
                .map(|t| t.to_rfc3339_opts(chrono::SecondsFormat::Millis, true))
                .unwrap_or_else(|| format!("{start} ms"));
            format!("{self} has no occurrence at or after {when}")
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_parts_of_a_put_follow_one_rule() {
        let parts = |every, cron, tz, jitter| {
            Schedule::from_parts(
                ScheduleParts {
                    every,
                    cron,
                    tz,
                    jitter,
                },
                1000,
            )
        };
        assert_eq!(parts(None, None, None, None), Ok(None));
        assert_eq!(
            parts(Some("1s"), None, None, Some("500")),
            Ok(Some((Schedule::Every { ms: 1000 }, 500)))
        );
        assert_eq!(
            parts(Some("1s"), Some("* * * * *"), None, None),
            Err(PartsError::BothEveryAndCron)
        );
        assert_eq!(
            parts(Some("1s"), None, Some("UTC"), None),
            Err(PartsError::TzWithoutCron)
        );
        assert_eq!(
            parts(None, None, None, Some("0")),
            Err(PartsError::JitterWithoutSchedule)
        );
        assert!(matches!(
            parts(Some("1s"), None, None, Some("1000")),
            Err(PartsError::Jitter(
                ScheduleError::JitterNotBelowInterval { .. }
            ))
        ));
        assert!(matches!(
            parts(None, Some("0 9 * * *"), Some("Mars/Olympus"), None),
            Err(PartsError::Cron(ScheduleError::UnknownZone(_)))
        ));
        assert!(matches!(
            parts(Some("999"), None, None, None),
            Err(PartsError::Every(ScheduleError::BelowMinimum { .. }))
        ));
    }

    fn ms(rfc3339: &str) -> i64 {
        DateTime::parse_from_rfc3339(rfc3339)
            .unwrap()
            .timestamp_millis()
    }

    fn berlin_nine() -> Schedule {
        Schedule::cron("0 9 * * *", Some("Europe/Berlin")).unwrap()
    }

    #[test]
    fn intervals() {
        assert_eq!(
            Schedule::every(900_000, 1000),
            Ok(Schedule::Every { ms: 900_000 })
        );
        assert_eq!(
            Schedule::every(999, 1000),
            Err(ScheduleError::BelowMinimum {
                interval_ms: 999,
                min_ms: 1000
            })
        );
        assert_eq!(Schedule::every(0, 0), Err(ScheduleError::NotPositive(0)));
        assert_eq!(Schedule::every(-5, 0), Err(ScheduleError::NotPositive(-5)));
        assert!(matches!(
            Schedule::every(i64::MAX, 0),
            Err(ScheduleError::TooLong(_))
        ));
        assert_eq!(
            Schedule::parse_every("900000", 1000),
            Ok(Schedule::Every { ms: 900_000 })
        );
        assert_eq!(
            Schedule::parse_every("15m", 1000),
            Ok(Schedule::Every { ms: 900_000 })
        );
        assert_eq!(
            Schedule::parse_every("1h30m", 1000),
            Ok(Schedule::Every { ms: 5_400_000 })
        );
        assert!(matches!(
            Schedule::parse_every("soon", 1000),
            Err(ScheduleError::BadInterval { .. })
        ));
        assert!(matches!(
            Schedule::parse_every("-1", 1000),
            Err(ScheduleError::NotPositive(-1))
        ));
        assert!(matches!(
            Schedule::parse_every("500ms", 1000),
            Err(ScheduleError::BelowMinimum { .. })
        ));
        let every = Schedule::Every { ms: 1000 };
        assert_eq!(every.next_after(5_000), Some(6_000));
        assert_eq!(every.first_at_or_after(5_123), Some(5_123));
        assert_eq!(every.to_string(), "every 1s");
    }

    #[test]
    fn interval_next_occurrence_keeps_the_grid_and_coalesces() {
        let every = Schedule::Every { ms: 1000 };
        // Released on time: the next grid point.
        assert_eq!(every.next_occurrence(10_000, 10_000), Some(11_000));
        assert_eq!(every.next_occurrence(10_000, 10_400), Some(11_000));
        // Released late by 3.5 intervals: missed occurrences collapse into one, and the
        // next one is the first grid point in the future.
        assert_eq!(every.next_occurrence(10_000, 13_500), Some(14_000));
        assert_eq!(every.next_occurrence(10_000, 13_000), Some(14_000));
        // A clock behind the due time still moves forward.
        assert_eq!(every.next_occurrence(10_000, 9_000), Some(11_000));
    }

    #[test]
    fn the_jitter_hash_is_fnv1a_32() {
        // Reference vectors of FNV-1a 32 (the hash lua/README.md names).
        assert_eq!(fnv1a32(&[b""]), 0x811c_9dc5);
        assert_eq!(fnv1a32(&[b"a"]), 0xe40c_292c);
        assert_eq!(fnv1a32(&[b"foo", b"bar"]), 0xbf9c_f968);
        // topic \0 id \0 scheduled_ms, mod the bound.
        let whole = fnv1a32(&[b"mail\0user-1\x001764590400000"]);
        assert_eq!(
            jitter_delay("mail", "user-1", 1_764_590_400_000, 500),
            u64::from(whole) % 500
        );
        assert_eq!(jitter_delay("mail", "user-1", 1_764_590_400_000, 0), 0);
        // Deterministic, and different occurrences get different delays.
        let delays: std::collections::HashSet<u64> = (0..50)
            .map(|k| jitter_delay("mail", "user-1", 1_764_590_400_000 + k * 1000, 500))
            .collect();
        assert!(delays.len() > 30, "{delays:?}");
        assert!(delays.iter().all(|&d| d < 500));
    }

    #[test]
    fn jitter_values_are_checked_against_the_schedule() {
        assert_eq!(parse_jitter("500"), Ok(500));
        assert_eq!(parse_jitter(" 0 "), Ok(0));
        for bad in ["-1", "", "soon", "1.5", "5e2"] {
            assert!(
                matches!(parse_jitter(bad), Err(ScheduleError::BadJitter { .. })),
                "{bad}"
            );
        }
        let every = Schedule::Every { ms: 1000 };
        assert_eq!(every.check_jitter(999), Ok(999));
        let err = every.check_jitter(1000).unwrap_err();
        assert_eq!(
            err,
            ScheduleError::JitterNotBelowInterval {
                jitter_ms: 1000,
                interval_ms: 1000
            }
        );
        assert!(err.to_string().contains("below the interval"), "{err}");
        // Cron: any jitter, clamped to each gap.
        let cron = Schedule::cron("* * * * * *", None).unwrap();
        assert_eq!(cron.check_jitter(5000), Ok(5000));
        assert!(matches!(
            cron.check_jitter(u64::MAX),
            Err(ScheduleError::JitterTooLong(_))
        ));
    }

    #[test]
    fn a_cron_jitter_is_clamped_to_the_gap_to_the_next_occurrence() {
        // 09:00, 10:00 and 18:00: gaps of 1 h, 8 h and 15 h.
        let cron = Schedule::cron("0 9,10,18 * * *", None).unwrap();
        let two_hours = 2 * 3_600_000;
        let nine = ms("2026-12-01T09:00:00Z");
        let ten = ms("2026-12-01T10:00:00Z");
        assert_eq!(cron.jitter_bound(nine, two_hours), 3_600_000);
        assert_eq!(cron.jitter_bound(ten, two_hours), two_hours);
        assert_eq!(cron.jitter_bound(ten, 0), 0);
        // Every occurrence stays strictly before the next one.
        let mut at = nine;
        for _ in 0..12 {
            let next = cron.next_after(at).unwrap();
            let delay = cron.occurrence_delay("t", "id", at, 10 * 3_600_000);
            assert!(at + (delay as i64) < next, "{at} + {delay} >= {next}");
            at = next;
        }
        // An interval's bound is its jitter (always below the interval).
        let every = Schedule::Every { ms: 1000 };
        assert_eq!(every.jitter_bound(nine, 500), 500);
    }

    #[test]
    fn a_jittered_occurrence_still_ahead_is_not_coalesced() {
        let every = Schedule::Every { ms: 1000 };
        let (topic, s) = ("t", 1_764_590_400_000_i64);
        // An id whose next occurrence has a delay of at least 300 ms.
        let id = (0..)
            .map(|n| format!("id-{n}"))
            .find(|id| jitter_delay(topic, id, s + 1000, 900) >= 300)
            .unwrap();
        let d1 = jitter_delay(topic, &id, s + 1000, 900);
        // Released after the next scheduled time, before its jittered one: kept.
        assert_eq!(
            every.next_jittered(topic, &id, s, s + 1000 + 100, 900),
            Some((s + 1000, d1))
        );
        // Released after its jittered time too: coalesced to the one after.
        let (next, delay) = every
            .next_jittered(topic, &id, s, s + 1000 + d1 as i64, 900)
            .unwrap();
        assert_eq!(next, s + 2000);
        assert_eq!(delay, jitter_delay(topic, &id, s + 2000, 900));
        // On time: simply the next one.
        assert_eq!(
            every.next_jittered(topic, &id, s, s + 200, 900),
            Some((s + 1000, d1))
        );
        // Late by many intervals: the first one whose jittered time is ahead.
        let now = s + 10_500;
        let (next, delay) = every.next_jittered(topic, &id, s, now, 900).unwrap();
        assert!(
            next + delay as i64 > now,
            "{next} + {delay} is ahead of {now}"
        );
        let before = next - 1000;
        assert!(
            before + jitter_delay(topic, &id, before, 900) as i64 <= now,
            "the one before {next} was overdue"
        );
    }

    #[test]
    fn specs_round_trip() {
        let every = Schedule::Every { ms: 900_000 };
        assert_eq!(every.to_spec(), "every:900000");
        assert_eq!(Schedule::from_spec("every:900000"), Ok(every));
        let cron = Schedule::cron("0  9 * *   MON-FRI", Some("Europe/Berlin")).unwrap();
        assert_eq!(cron.to_spec(), "cron:0 9 * * MON-FRI|Europe/Berlin");
        assert_eq!(Schedule::from_spec(&cron.to_spec()), Ok(cron.clone()));
        assert_eq!(cron.cron_expr(), Some("0 9 * * MON-FRI"));
        assert_eq!(cron.tz(), Some("Europe/Berlin"));
        assert_eq!(cron.every_ms(), None);
        assert_eq!(cron.store_spec().unwrap().as_str(), cron.to_spec());
        assert_eq!(
            Schedule::cron("* * * * *", None).unwrap().to_spec(),
            "cron:* * * * *|UTC"
        );
        assert!(matches!(
            Schedule::from_spec("weekly"),
            Err(ScheduleError::BadSpec(_))
        ));
        assert!(matches!(
            Schedule::from_spec("every:x"),
            Err(ScheduleError::BadSpec(_))
        ));
    }

    #[test]
    fn a_first_occurrence_is_never_before_now() {
        // Every 10 s on the clock; "now" is 12:00:05.
        let cron = Schedule::cron("*/10 * * * * *", None).unwrap();
        let now = 1_796_126_405_000;
        assert_eq!(cron.first_due(None, now), Ok(Due::At(now + 5_000)));
        // A start in the past means now: the next match from now, not a past one.
        assert_eq!(
            cron.first_due(Some(Due::At(now - 60_000)), now),
            Ok(Due::At(now + 5_000))
        );
        assert_eq!(
            cron.first_due(Some(Due::Delay(-60_000)), now),
            Ok(Due::At(now + 5_000))
        );
        // A start in the future: the first match at or after it.
        assert_eq!(
            cron.first_due(Some(Due::Delay(15_000)), now),
            Ok(Due::At(now + 15_000))
        );
        assert_eq!(
            cron.first_due(Some(Due::At(now + 15_001)), now),
            Ok(Due::At(now + 25_000))
        );
        // An interval starts exactly when asked.
        let every = Schedule::Every { ms: 60_000 };
        assert_eq!(every.first_due(None, now), Ok(Due::Delay(60_000)));
        assert_eq!(
            every.first_due(Some(Due::At(now + 1)), now),
            Ok(Due::At(now + 1))
        );
    }

    #[test]
    fn cron_errors_are_clear() {
        let err = Schedule::cron("0 9 * *", None).unwrap_err();
        assert!(matches!(err, ScheduleError::FieldCount { fields: 4, .. }));
        assert!(err.to_string().contains("expected 5"));
        assert!(matches!(
            Schedule::cron("0 0 0 9 * * * 2030", None),
            Err(ScheduleError::FieldCount { fields: 8, .. })
        ));
        assert!(matches!(
            Schedule::cron("@daily", None),
            Err(ScheduleError::FieldCount { .. })
        ));
        assert!(matches!(
            Schedule::cron("61 * * * *", None),
            Err(ScheduleError::BadCron { .. })
        ));
        assert!(matches!(
            Schedule::cron("0 9 * * FUNDAY", None),
            Err(ScheduleError::BadCron { .. })
        ));
        let err = Schedule::cron("0 9 * * *", Some("Mars/Olympus")).unwrap_err();
        assert_eq!(err, ScheduleError::UnknownZone("Mars/Olympus".into()));
        assert!(err.to_string().contains("IANA"));
        assert!(matches!(
            Schedule::cron("0 9 * * *", Some("")),
            Err(ScheduleError::UnknownZone(_))
        ));
        let err = Schedule::cron("0 0 30 2 *", None).unwrap_err();
        assert_eq!(err, ScheduleError::NeverFires("0 0 30 2 *".into()));
        assert!(err.to_string().contains("never fires"));
        assert!(matches!(
            Schedule::cron("0 0 31 4,6,9,11 *", None),
            Err(ScheduleError::NeverFires(_))
        ));
    }

    #[test]
    fn cron_names_ranges_lists_steps() {
        let weekdays = Schedule::cron("0 9 * * MON-FRI", None).unwrap();
        // 2026-12-04 is a Friday: next is Monday 2026-12-07 09:00 UTC.
        assert_eq!(
            weekdays.next_after(ms("2026-12-04T10:00:00Z")),
            Some(ms("2026-12-07T09:00:00Z"))
        );
        let months = Schedule::cron("30 6 1 jan,jul *", None).unwrap();
        assert_eq!(
            months.next_after(ms("2026-02-01T00:00:00Z")),
            Some(ms("2026-07-01T06:30:00Z"))
        );
        let steps = Schedule::cron("*/15 8-9 * * *", None).unwrap();
        assert_eq!(
            steps.next_after(ms("2026-12-01T09:45:00Z")),
            Some(ms("2026-12-02T08:00:00Z"))
        );
        assert_eq!(
            steps.next_after(ms("2026-12-01T08:14:59.999Z")),
            Some(ms("2026-12-01T08:15:00Z"))
        );
    }

    #[test]
    fn six_fields_even_seconds() {
        let even = Schedule::cron("*/2 * * * * *", None).unwrap();
        let start = ms("2026-12-01T00:00:00Z");
        let mut at = start;
        for step in 1..=5 {
            at = even.next_after(at).unwrap();
            assert_eq!(at, start + step * 2000);
        }
        // Strictly after, also from inside a second.
        assert_eq!(even.next_after(start + 500), Some(start + 2000));
        assert_eq!(even.first_at_or_after(start), Some(start));
        assert_eq!(even.first_at_or_after(start + 1), Some(start + 2000));
        assert_eq!(even.first_at_or_after(start + 1500), Some(start + 2000));
    }

    #[test]
    fn berlin_nine_across_dst() {
        let nine = berlin_nine();
        // Spring forward on Sunday 2027-03-28: 09:00 CET = 08:00Z on Saturday, 09:00 CEST
        // = 07:00Z on Sunday and after.
        let sat = ms("2027-03-27T08:00:00Z");
        assert_eq!(nine.next_after(ms("2027-03-26T08:00:00Z")), Some(sat));
        let sun = nine.next_after(sat).unwrap();
        assert_eq!(sun, ms("2027-03-28T07:00:00Z"));
        assert_eq!(sun - sat, 23 * 3_600_000);
        // Fall back on Sunday 2027-10-31.
        let sat = nine.next_after(ms("2027-10-30T00:00:00Z")).unwrap();
        assert_eq!(sat, ms("2027-10-30T07:00:00Z"));
        let sun = nine.next_after(sat).unwrap();
        assert_eq!(sun, ms("2027-10-31T08:00:00Z"));
        assert_eq!(sun - sat, 25 * 3_600_000);
        // Coalescing a release late by days lands on the next 09:00 local after now.
        assert_eq!(
            nine.next_occurrence(ms("2027-03-20T08:00:00Z"), ms("2027-03-28T12:00:00Z")),
            Some(ms("2027-03-29T07:00:00Z"))
        );
    }

    #[test]
    fn berlin_skipped_and_repeated_local_times() {
        // 02:30 does not exist on 2027-03-28 in Berlin: a fixed time fires at 03:00 CEST.
        let half_past_two = Schedule::cron("30 2 * * *", Some("Europe/Berlin")).unwrap();
        assert_eq!(
            half_past_two.next_after(ms("2027-03-27T12:00:00Z")),
            Some(ms("2027-03-28T01:00:00Z"))
        );
        // 02:30 happens twice on 2027-10-31: a fixed time fires once, in summer time.
        let first = half_past_two
            .next_after(ms("2027-10-30T12:00:00Z"))
            .unwrap();
        assert_eq!(first, ms("2027-10-31T00:30:00Z"));
        assert_eq!(
            half_past_two.next_after(first),
            Some(ms("2027-11-01T01:30:00Z"))
        );
        // A stepped schedule has no occurrences in the skipped hour ...
        let quarter = Schedule::cron("*/15 2 * * *", Some("Europe/Berlin")).unwrap();
        assert_eq!(
            quarter.next_after(ms("2027-03-28T00:50:00Z")),
            Some(ms("2027-03-29T00:00:00Z"))
        );
        // ... and fires in both passes of the repeated one.
        let last_summer = quarter.next_after(ms("2027-10-31T00:40:00Z")).unwrap();
        assert_eq!(last_summer, ms("2027-10-31T00:45:00Z"));
        assert_eq!(
            quarter.next_after(last_summer),
            Some(ms("2027-10-31T01:00:00Z"))
        );
    }
}
