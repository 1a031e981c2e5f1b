//! A webhook target's circuit breaker (`lua/target_health.lua`), its state in Redis so
//! that every bridge shares it; the policy it runs is `crate::targets::health::step`.
//!
//! Cost: a bridge counts its requests' outcomes in memory and sends them in one `sync`
//! call per target about once a second (at once while failures are pending, and
//! every 100 ms while the target is held), so a healthy target's jobs cost no round
//! trip of their own; `probe` and `gone` are sent as they happen (rare). The faces read
//! every target's state at once ([`Store::targets_health`]): `get` calls, one round trip.

use redis::Value;

use crate::store::call::Call;
use crate::store::reply::Reader;
use crate::store::{Store, StoreError};
use crate::targets::health::{Change, State};
use crate::targets::{BreakerConfig, TargetConfig};

/// One call of `target_health.lua`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HealthOp {
    /// Outcomes counted since the last sync; `lease_ms` > 0 claims a due probe.
    Sync {
        successes: u64,
        failures: u64,
        lease_ms: u64,
        reason: String,
    },
    Probe {
        ok: bool,
        reason: String,
    },
    Gone {
        reason: String,
    },
    Enable,
    Disable,
    Get,
}

/// What the script answered: the target's state and the changes this call took.
#[derive(Debug, Clone, PartialEq)]
pub struct TargetHealth {
    pub state: State,
    /// Whether this call claimed the half-open probe.
    pub claimed: bool,
    pub reason: String,
    /// When the state last changed (epoch ms; 0: never).
    pub changed_at: i64,
    pub requests: u64,
    pub failures: u64,
    pub trips: u64,
    pub opened_at: i64,
    pub now: i64,
    /// Changes waiting to be announced, taken by this call (`target` filled in).
    pub changes: Vec<Change>,
}

impl Store {
    /// Runs one op of the target's breaker with its settings.
    pub async fn target_health(
        &self,
        target: &str,
        breaker: &BreakerConfig,
        op: HealthOp,
    ) -> Result<TargetHealth, StoreError> {
        let value = self
            .exec
            .run_one(self.health_call(target, breaker, op))
            .await?;
        decode(target, value)
    }

    /// Every target's breaker as Redis holds it, in the order of `targets`: a `get` of
    /// each (which changes nothing and leaves the changes to announce for the next
    /// sync), all in one round trip on a standalone Redis (on a cluster each target's
    /// keys have a slot of their own: one call per target, all at once). A target no
    /// bridge has written yet reads as closed. No targets, no round trip.
    pub async fn targets_health(
        &self,
        targets: &[TargetConfig],
    ) -> Result<Vec<(String, TargetHealth)>, StoreError> {
        let calls: Vec<Call> = targets
            .iter()
            .map(|t| self.health_call(&t.name, &t.breaker, HealthOp::Get))
            .collect();
        let replies = self.exec.run(&calls).await?;
        targets
            .iter()
            .zip(replies)
            .map(|(t, reply)| Ok((t.name.clone(), decode(&t.name, reply?)?)))
            .collect()
    }

    fn health_call(&self, target: &str, breaker: &BreakerConfig, op: HealthOp) -> Call {
        let [health, events] = self.keys.target_health(target);
        let mut cmd = redis::cmd("EVALSHA");
        cmd.arg(self.exec.scripts().target_health.get_hash())
            .arg(2)
            .arg(health)
            .arg(events);
        let (name, a, b, c, reason) = match op {
            HealthOp::Sync {
                successes,
                failures,
                lease_ms,
                reason,
            } => (
                "sync",
                successes.to_string(),
                failures.to_string(),
                lease_ms,
                reason,
            ),
            HealthOp::Probe { ok, reason } => {
                let outcome = if ok { "ok" } else { "fail" };
                ("probe", outcome.to_owned(), String::new(), 0, reason)
            }
            HealthOp::Gone { reason } => ("gone", String::new(), String::new(), 0, reason),
            HealthOp::Enable => ("enable", String::new(), String::new(), 0, String::new()),
            HealthOp::Disable => ("disable", String::new(), String::new(), 0, String::new()),
            HealthOp::Get => ("get", String::new(), String::new(), 0, String::new()),
        };
        cmd.arg(name)
            .arg(breaker.failure_ratio.to_string())
            .arg(breaker.window_ms)
            .arg(breaker.min_requests)
            .arg(breaker.open_ms)
            .arg(breaker.disable_after_trips)
            .arg(a)
            .arg(b)
            .arg(c)
            .arg(reason);
        Call::global(cmd)
    }
}

fn decode(target: &str, value: Value) -> Result<TargetHealth, StoreError> {
    let mut reply = Reader::new("target_health", value)?;
    let state = reply.string("state")?;
    let state = State::parse(&state)
        .ok_or_else(|| StoreError::bad_reply("target_health", format!("state {state:?}")))?;
    let count = |n: i64| u64::try_from(n).unwrap_or(0);
    let claimed = reply.int("claimed")? == 1;
    let reason = reply.string("reason")?;
    let changed_at = reply.int("changed_at")?;
    let requests = count(reply.int("requests")?);
    let failures = count(reply.int("failures")?);
    let trips = count(reply.int("trips")?);
    let opened_at = reply.int("opened_at")?;
    let now = reply.int("now")?;
    let mut events = reply.array("events")?;
    let mut changes = Vec::new();
    while events.remaining() >= 3 {
        let to = events.string("to")?;
        let reason = events.string("reason")?;
        let at = events.int("at")?;
        changes.push(Change {
            target: target.to_owned(),
            to,
            reason,
            at: rfc3339(at),
        });
    }
    Ok(TargetHealth {
        state,
        claimed,
        reason,
        changed_at,
        requests,
        failures,
        trips,
        opened_at,
        now,
        changes,
    })
}

fn rfc3339(ms: i64) -> String {
    let at =
        std::time::UNIX_EPOCH + std::time::Duration::from_millis(u64::try_from(ms).unwrap_or(0));
    humantime::format_rfc3339_millis(at).to_string()
}
