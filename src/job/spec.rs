//! The schedule spec a recurring job is stored with: an opaque string to the store
//! (`lua/README.md`, *Recurring series*), `every:<ms>` or `cron:<expr>|<tz>` by the
//! convention every client follows. [`crate::job::schedule`] writes and reads it.

/// Longest spec `put.lua` stores (and so the longest schedule `crate::job::schedule` writes).
pub const MAX_SPEC_BYTES: usize = 256;

/// The schedule of a recurring job, stored with it and handed back by `reserve`.
/// Opaque to the store; the convention every client follows is `every:<ms>` or
/// `cron:<expr>|<tz>` (see [`ScheduleSpec::every`], [`ScheduleSpec::cron`]).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ScheduleSpec(String);

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SpecError {
    #[error("a schedule spec must be 1 to {MAX_SPEC_BYTES} bytes, got {0}")]
    Length(usize),
    #[error("a schedule spec must not contain control characters")]
    Control,
    #[error("a time zone name must not contain '|'")]
    Zone,
}

/// A spec read back in the bridge's convention.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SpecKind<'a> {
    Every {
        interval_ms: u64,
    },
    Cron {
        expr: &'a str,
        tz: &'a str,
    },
    /// Written by another client in a convention of its own.
    Other(&'a str),
}

impl ScheduleSpec {
    pub fn new(spec: impl Into<String>) -> Result<Self, SpecError> {
        let spec = spec.into();
        if spec.is_empty() || spec.len() > MAX_SPEC_BYTES {
            return Err(SpecError::Length(spec.len()));
        }
        if spec.chars().any(char::is_control) {
            return Err(SpecError::Control);
        }
        Ok(Self(spec))
    }

    /// `every:<ms>`: occurrences `interval_ms` apart.
    pub fn every(interval_ms: u64) -> Self {
        Self(format!("every:{interval_ms}"))
    }

    /// `cron:<expr>|<tz>`: a cron expression in an IANA zone (validated by the caller).
    pub fn cron(expr: &str, tz: &str) -> Result<Self, SpecError> {
        if tz.contains('|') {
            return Err(SpecError::Zone);
        }
        Self::new(format!("cron:{expr}|{tz}"))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }

    pub fn kind(&self) -> SpecKind<'_> {
        if let Some(Ok(interval_ms)) = self.0.strip_prefix("every:").map(str::parse) {
            return SpecKind::Every { interval_ms };
        }
        if let Some((expr, tz)) = self
            .0
            .strip_prefix("cron:")
            .and_then(|c| c.rsplit_once('|'))
        {
            return SpecKind::Cron { expr, tz };
        }
        SpecKind::Other(&self.0)
    }
}

impl std::fmt::Display for ScheduleSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn specs_follow_the_convention_and_refuse_what_put_lua_refuses() {
        assert_eq!(ScheduleSpec::every(900_000).as_str(), "every:900000");
        assert_eq!(
            ScheduleSpec::every(5).kind(),
            SpecKind::Every { interval_ms: 5 }
        );
        let cron = ScheduleSpec::cron("0 9 * * MON-FRI", "Europe/Berlin").unwrap();
        assert_eq!(cron.as_str(), "cron:0 9 * * MON-FRI|Europe/Berlin");
        assert_eq!(
            cron.kind(),
            SpecKind::Cron {
                expr: "0 9 * * MON-FRI",
                tz: "Europe/Berlin"
            }
        );
        assert_eq!(
            ScheduleSpec::new("weekly").unwrap().kind(),
            SpecKind::Other("weekly")
        );
        assert_eq!(ScheduleSpec::new(""), Err(SpecError::Length(0)));
        assert_eq!(
            ScheduleSpec::new("a".repeat(257)),
            Err(SpecError::Length(257))
        );
        assert_eq!(ScheduleSpec::new("every:\n5"), Err(SpecError::Control));
        assert_eq!(ScheduleSpec::cron("* * * * *", "a|b"), Err(SpecError::Zone));
    }
}
