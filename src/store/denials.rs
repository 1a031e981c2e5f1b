//! Calls Redis refuses for lack of permission: the Redis user's ACL lacks a command a
//! script runs (or the script, a key, the channel). Such a call fails the same way every
//! time until the ACL changes, so the bridge is not doing its work: readiness, the
//! `redisched_redis_acl_denied` gauge and the log say so (see `health.rs`).
//!
//! A refusal is kept per call (script and topic) until that call succeeds again or
//! [`DENIAL_WINDOW`] passes without it being refused again: the bridge's loops repeat
//! their calls every second or so, and a call made once (an HTTP read) must not keep the
//! process unready for ever.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use redis::{RedisError, RedisResult, Value};

/// How long a refusal counts after it was last seen.
pub const DENIAL_WINDOW: Duration = Duration::from_secs(30);

/// Redis refused the call for lack of permission: `NOPERM` (a command, key or channel
/// outside the user's ACL; also what Redis 7.2+ answers inside a script), or Redis 7.0's
/// `ERR The user executing the script can't …` for a script's own call.
pub(super) fn is_denied(err: &RedisError) -> bool {
    match err.code() {
        Some("NOPERM") => true,
        Some("ERR") => err
            .detail()
            .is_some_and(|d| d.contains("The user executing the script can't")),
        _ => false,
    }
}

/// What one call is, asked of the transport only when the health needs it.
#[derive(Debug, Clone, Default)]
pub(crate) struct CallFacts {
    /// A write Redis refuses under OOM, whose success shows that it accepts writes
    /// (`put.lua`, `INCR`).
    pub(crate) grows: bool,
    /// The bytes of its arguments.
    pub(crate) bytes: u64,
    /// What it is, for people: `reserve.lua on topic "emails"`, `time`.
    pub(crate) name: String,
}

#[derive(Debug)]
struct Denial {
    error: String,
    last: Instant,
}

/// The calls refused for lack of permission, by name.
#[derive(Debug, Default)]
pub(super) struct Denials {
    calls: BTreeMap<String, Denial>,
}

impl Denials {
    pub(super) fn is_empty(&self) -> bool {
        self.calls.is_empty()
    }

    /// Records the refusals among `replies` and forgets the calls that succeeded.
    pub(super) fn observe(
        &mut self,
        replies: &[RedisResult<Value>],
        facts: &dyn Fn(usize) -> CallFacts,
        now: Instant,
    ) {
        self.expire(now);
        if !self.calls.is_empty() {
            for (i, reply) in replies.iter().enumerate() {
                if reply.is_ok() {
                    let name = facts(i).name;
                    if self.calls.remove(&name).is_some() {
                        tracing::info!(call = %name, "Redis runs this call again (ACL fixed)");
                        if self.calls.is_empty() {
                            tracing::info!(
                                "no call refused for lack of permission; readiness restored"
                            );
                        }
                    }
                }
            }
        }
        for (i, reply) in replies.iter().enumerate() {
            let Err(err) = reply else { continue };
            if !is_denied(err) {
                continue;
            }
            let name = facts(i).name;
            // Redis's own words (the client's rendering varies with the error kind).
            let error = err.detail().unwrap_or_default().trim().to_string();
            if !self.calls.contains_key(&name) {
                tracing::error!(
                    call = %name,
                    error = %error,
                    "Redis refuses a call for lack of permission: the Redis user's ACL lacks a \
                     command this call needs (see docs/src/security.md, Least-privilege Redis user). Until it \
                     runs again /readyz answers 503 (\"redis\":\"refused: …\") and \
                     redisched_redis_acl_denied reads 1"
                );
            }
            self.calls.insert(name, Denial { error, last: now });
        }
    }

    /// Forgets refusals not seen again within [`DENIAL_WINDOW`].
    pub(super) fn expire(&mut self, now: Instant) {
        let before = self.calls.len();
        self.calls
            .retain(|_, d| now.saturating_duration_since(d.last) < DENIAL_WINDOW);
        if before > 0 && self.calls.is_empty() {
            tracing::info!(
                window = ?DENIAL_WINDOW,
                "no call refused for lack of permission within the window; readiness restored"
            );
        }
    }

    /// The latest refusal as readiness shows it (`NOPERM: <call>: <error>`, and how many
    /// other calls are refused), if any.
    pub(super) fn describe(&self) -> Option<String> {
        let (name, latest) = self.calls.iter().max_by_key(|(_, d)| d.last)?;
        let error = &latest.error;
        let others = match self.calls.len() - 1 {
            0 => String::new(),
            n => format!(" (and {n} other call(s))"),
        };
        Some(format!("NOPERM: {name}: {error}{others}"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A server error reply as Redis sends it (`-CODE detail`).
    fn reply(line: &str) -> RedisError {
        match redis::parse_redis_value(format!("-{line}\r\n").as_bytes()) {
            Ok(Value::ServerError(err)) => RedisError::from(err),
            other => panic!("not an error reply: {other:?}"),
        }
    }

    fn facts(name: &str) -> CallFacts {
        CallFacts {
            name: name.into(),
            ..CallFacts::default()
        }
    }

    #[test]
    fn permission_errors_are_told_from_others() {
        assert!(is_denied(&reply(
            "NOPERM this user has no permissions to run the 'evalsha' command"
        )));
        assert!(is_denied(&reply(
            "ERR The user executing the script can't run this command or subcommand script: ab, on @user_script:1."
        )));
        assert!(!is_denied(&reply("ERR user_script:1: Script attempted to access nonexistent global variable 'x' script: ab")));
        assert!(!is_denied(&reply(
            "OOM command not allowed when used memory > 'maxmemory'."
        )));
    }

    #[test]
    fn a_refusal_lasts_until_the_call_runs_or_the_window_passes() {
        let mut denials = Denials::default();
        let now = Instant::now();
        let refused: Vec<RedisResult<Value>> = vec![
            Ok(Value::Okay),
            Err(reply(
                "NOPERM User u has no permissions to run the 'hmget' command",
            )),
        ];
        let names = |i: usize| facts(["put.lua", "reserve.lua on topic \"t\""][i]);
        denials.observe(&refused, &names, now);
        let said = denials.describe().expect("refused");
        assert!(
            said.starts_with("NOPERM: reserve.lua on topic \"t\": User u has no permissions"),
            "{said}"
        );
        // Another call succeeding leaves it; the refused call succeeding clears it.
        denials.observe(&[Ok(Value::Okay)], &|_| facts("put.lua"), now);
        assert!(!denials.is_empty());
        denials.observe(
            &[Ok(Value::Okay)],
            &|_| facts("reserve.lua on topic \"t\""),
            now,
        );
        assert!(denials.is_empty(), "{:?}", denials.describe());
        // Not seen again within the window: forgotten.
        denials.observe(&refused, &names, now);
        denials.expire(now + DENIAL_WINDOW);
        assert_eq!(denials.describe(), None);
    }
}
