//! What the bridge knows about the Redis servers' health: are they answering, do they
//! refuse writes for lack of memory (OOM), and may they evict keys.
//!
//! One [`RedisHealth`] is shared by every store of a process (see [`Store::with_health`]),
//! so readiness, the metrics and the logs read one source of truth. It is fed by
//! - every call the transport makes (`exec.rs`): a reply, even an error reply, means
//!   Redis answers; an `OOM` error means Redis refuses writes; a permission error means
//!   the user's ACL lacks a command a call needs (`denials.rs`);
//! - the probe ([`Store::probe_health`]): `INFO memory` and `INFO stats` of every primary
//!   (`maxmemory_policy`, `used_memory` against `maxmemory`, `evicted_keys`), with
//!   `CONFIG GET maxmemory-policy` when `INFO` is refused. Both may be forbidden by an
//!   ACL: the probe is best effort, says so once, and the policy reads "unknown".
//!
//! OOM has hysteresis, so that readiness does not flap at the boundary (where Redis takes
//! a write whenever a little was freed and refuses the next): once Redis refused a write
//! for memory, the state holds until `INFO memory` shows room, `used_memory` (as Redis
//! counts it against the limit) at most [`ROOM_PERCENT`] % of `maxmemory` on every
//! primary (or no limit). Where `INFO` is not allowed, it holds until a write Redis would
//! refuse under OOM (`lua/put.lua`, `INCR`) at least as large as the largest one it refused
//! meanwhile is accepted (commands that waited come back: the largest one will too). Readiness says which of the two it waits for.
//!
//! Eviction: redisched keys never carry a TTL, so `noeviction` and the `volatile-*`
//! policies (which only evict keys with a TTL) never delete a job; they make Redis refuse
//! writes at `maxmemory` instead, which is the OOM state above. `allkeys-*` policies may
//! delete any key, scheduled jobs included.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use redis::{RedisError, RedisResult, Value};
use serde::Serialize;

use super::denials::{CallFacts, Denials};
use super::{Store, StoreError};

/// How often `redisched run` probes Redis besides the probes of `/readyz` and `/metrics`.
pub const HEALTH_PROBE_INTERVAL: Duration = Duration::from_secs(30);

/// Out of memory ends when every primary uses at most this share of its `maxmemory`
/// (see the module docs): 10 % of room, far more than one write needs, so that the
/// next writes do not put Redis back at its limit at once.
pub const ROOM_PERCENT: u64 = 90;

/// Does `policy` (a `maxmemory-policy` value) keep redisched's keys? They carry no TTL,
/// so only the `allkeys-*` policies may evict them.
pub fn policy_keeps_jobs(policy: &str) -> bool {
    policy == "noeviction" || policy.starts_with("volatile-")
}

/// What one primary told the probe.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct NodeHealth {
    /// `host:port` on a cluster; empty on a standalone Redis.
    pub node: String,
    pub eviction_policy: Option<String>,
    pub used_memory: Option<u64>,
    /// 0 = no limit.
    pub maxmemory: Option<u64>,
    pub evicted_keys: Option<u64>,
    /// Above `maxmemory` (by Redis's own account): writes are refused.
    pub over_maxmemory: bool,
    /// At most [`ROOM_PERCENT`] % of `maxmemory` (by Redis's own account), or no limit.
    #[serde(skip)]
    pub has_room: bool,
}

/// The eviction verdict over every primary.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Eviction {
    /// Every primary's policy keeps jobs.
    Safe(String),
    /// Some primary may evict jobs: `policy` (with its node on a cluster).
    Evicting(String),
    /// The policy could not be read (why).
    Unknown(String),
}

impl Eviction {
    /// The policy as `/readyz` and `check` show it ("unknown" when unreadable).
    pub fn policy(&self) -> &str {
        match self {
            Eviction::Safe(p) | Eviction::Evicting(p) => p,
            Eviction::Unknown(_) => "unknown",
        }
    }

    /// `Some(true)` keeps jobs, `Some(false)` may evict them, `None` unknown.
    pub fn keeps_jobs(&self) -> Option<bool> {
        match self {
            Eviction::Safe(_) => Some(true),
            Eviction::Evicting(_) => Some(false),
            Eviction::Unknown(_) => None,
        }
    }
}

/// What the probe found on every primary.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Probe {
    pub nodes: Vec<NodeHealth>,
    /// Why `INFO` (and `CONFIG GET`) could not be read, if they could not.
    pub unreadable: Option<String>,
}

impl Probe {
    pub fn eviction(&self) -> Eviction {
        let policies: Vec<(&str, &str)> = self
            .nodes
            .iter()
            .filter_map(|n| n.eviction_policy.as_deref().map(|p| (n.node.as_str(), p)))
            .collect();
        if policies.len() < self.nodes.len() || policies.is_empty() {
            return Eviction::Unknown(
                self.unreadable
                    .clone()
                    .unwrap_or_else(|| "maxmemory-policy not reported".into()),
            );
        }
        let describe = |list: &[(&str, &str)]| {
            let mut names: Vec<String> = list
                .iter()
                .map(|(node, p)| {
                    if node.is_empty() {
                        p.to_string()
                    } else {
                        format!("{p} on {node}")
                    }
                })
                .collect();
            // One policy on every primary reads as that policy; otherwise name the nodes.
            let first = list[0].1;
            if list.len() == self.nodes.len() && list.iter().all(|(_, p)| *p == first) {
                return first.to_string();
            }
            names.sort();
            names.join(", ")
        };
        let evicting: Vec<(&str, &str)> = policies
            .iter()
            .copied()
            .filter(|(_, p)| !policy_keeps_jobs(p))
            .collect();
        if evicting.is_empty() {
            Eviction::Safe(describe(&policies))
        } else {
            Eviction::Evicting(describe(&evicting))
        }
    }

    /// `evicted_keys` summed over the primaries, when every one reported it.
    pub fn evicted_keys(&self) -> Option<u64> {
        self.nodes.iter().map(|n| n.evicted_keys).sum()
    }

    pub fn over_maxmemory(&self) -> bool {
        self.nodes.iter().any(|n| n.over_maxmemory)
    }

    /// Every primary's memory figures were read.
    pub fn memory_readable(&self) -> bool {
        self.unreadable.is_none()
            && !self.nodes.is_empty()
            && self
                .nodes
                .iter()
                .all(|n| n.used_memory.is_some() && n.maxmemory.is_some())
    }

    /// Every primary has room ([`ROOM_PERCENT`]): an OOM state may end.
    pub fn has_room(&self) -> bool {
        self.memory_readable() && self.nodes.iter().all(|n| n.has_room)
    }

    /// The memory figures of the fullest primary (`used_memory`, `maxmemory`), if read.
    fn memory(&self) -> Option<(u64, u64)> {
        self.nodes
            .iter()
            .filter_map(|n| Some((n.used_memory?, n.maxmemory?)))
            .max_by_key(|(used, max)| (*max > 0 && used > max, *used))
    }
}

/// The health as readiness, metrics and `check` show it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct HealthView {
    /// The last call on any store connection got an answer (even an error reply).
    pub reachable: bool,
    /// Redis refuses writes for lack of memory: the error or the figures that said so.
    pub oom: Option<String>,
    /// While `oom`: what ends it (room in `INFO memory`, or, where `INFO` is not allowed,
    /// an accepted write as large as the largest refused one).
    pub oom_until: Option<String>,
    /// Redis refuses a call for lack of permission (the user's ACL): the latest one.
    pub refused: Option<String>,
    /// The `maxmemory-policy` ("unknown" when `INFO` and `CONFIG` are forbidden).
    pub eviction_policy: String,
    /// `true` keeps jobs, `false` may evict them, `null` unknown.
    pub eviction_policy_ok: Option<bool>,
    /// Keys Redis evicted since it started (every primary), if readable.
    pub evicted_keys: Option<u64>,
    pub used_memory: Option<u64>,
    pub maxmemory: Option<u64>,
    /// Why the probe could not read the server's settings, if it could not.
    pub unknown_reason: Option<String>,
    /// What each primary said at the last probe.
    pub nodes: Vec<NodeHealth>,
}

/// Redis refused a write for memory.
#[derive(Debug)]
struct Oom {
    why: String,
    /// The size of the largest write refused since the state began (its arguments), 0
    /// when only the figures said so.
    refused_bytes: u64,
}

#[derive(Debug, Default)]
struct State {
    reachable: Option<bool>,
    oom: Option<Oom>,
    denials: Denials,
    probe: Option<Probe>,
    /// What was last logged about the eviction policy, so a verdict is logged once.
    logged_eviction: Option<Eviction>,
    allow_eviction: bool,
}

/// The health of the Redis servers behind a process's stores; see the module docs.
#[derive(Debug, Default)]
pub struct RedisHealth {
    state: Mutex<State>,
}

impl RedisHealth {
    pub fn new() -> Self {
        Self::default()
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Whether an evicting policy was allowed (`redis.allow_eviction`): changes how a
    /// policy is logged (a warning instead of an error).
    pub fn set_allow_eviction(&self, allowed: bool) {
        self.state().allow_eviction = allowed;
    }

    /// A round trip failed as a whole: `err` tells whether Redis answered at all.
    pub(super) fn observe_error(&self, err: &RedisError) {
        let mut state = self.state();
        state.reachable = Some(answered(err));
        if is_oom(err) {
            Self::refused(&mut state, err.to_string(), None);
        }
    }

    /// Redis answered a call outside the job calls (`INFO`, `CONFIG GET`).
    pub(super) fn observe_answer(&self) {
        self.state().reachable = Some(true);
    }

    /// A round trip got its replies: Redis answers. An `OOM` reply starts the OOM state;
    /// where `INFO` cannot tell, an accepted write that Redis would refuse under OOM, as
    /// large as the largest refused one, ends it. Permission refusals go to the denials.
    /// `facts(i)` describes call `i`; it is asked only when one of these matters.
    pub(super) fn observe_replies(
        &self,
        replies: &[RedisResult<Value>],
        facts: &dyn Fn(usize) -> CallFacts,
    ) {
        let mut state = self.state();
        state.reachable = Some(true);
        let denied = replies
            .iter()
            .any(|r| matches!(r, Err(err) if super::denials::is_denied(err)));
        if denied || !state.denials.is_empty() {
            state.denials.observe(replies, facts, Instant::now());
        }
        // The largest write refused: a pipeline may carry small writes before it.
        let refused = replies
            .iter()
            .enumerate()
            .filter_map(|(i, r)| match r {
                Err(err) if is_oom(err) => Some((facts(i).bytes, err)),
                _ => None,
            })
            .max_by_key(|(bytes, _)| *bytes);
        if let Some((bytes, err)) = refused {
            Self::refused(&mut state, err.to_string(), Some(bytes));
            return;
        }
        let Some(oom) = &state.oom else { return };
        // With the figures readable, only they end it (a small write at the boundary
        // proves nothing).
        if state.probe.as_ref().is_some_and(Probe::memory_readable) {
            return;
        }
        let wanted = oom.refused_bytes;
        let accepted = replies.iter().enumerate().any(|(i, reply)| {
            reply.is_ok() && {
                let call = facts(i);
                call.grows && call.bytes >= wanted
            }
        });
        if accepted {
            Self::accepted(
                &mut state,
                &format!("a write of at least {wanted} bytes succeeded"),
            );
        }
    }

    /// Starts (or renews) the OOM state; `bytes`: the size of the refused write.
    fn refused(state: &mut State, why: String, bytes: Option<u64>) {
        let refused_bytes = bytes
            .unwrap_or(0)
            .max(state.oom.as_ref().map_or(0, |o| o.refused_bytes));
        if state.oom.is_none() {
            tracing::error!(
                error = %why,
                "Redis refuses writes: out of memory (maxmemory reached and its policy evicts nothing). \
                 Commands wait unacked in RabbitMQ, HTTP writes answer 503, /readyz answers 503 \
                 (\"redis\":\"oom\"). Raise maxmemory or free memory on the Redis server"
            );
        }
        state.oom = Some(Oom { why, refused_bytes });
    }

    fn accepted(state: &mut State, how: &str) {
        if state.oom.take().is_some() {
            tracing::info!("Redis accepts writes again ({how}); readiness restored");
        }
    }

    /// Records what [`Store::probe_health`] found, and logs what changed: a policy that
    /// may evict jobs (error, or warning when allowed), an unreadable one (once), keys
    /// evicted since the last probe, memory full or no longer full.
    fn record_probe(&self, probe: Probe) {
        let mut state = self.state();
        state.reachable = Some(true);
        let eviction = probe.eviction();
        let changed = match &state.logged_eviction {
            // "Unknown" is said once, whatever the reason given later.
            Some(Eviction::Unknown(_)) => !matches!(eviction, Eviction::Unknown(_)),
            Some(last) => *last != eviction,
            None => true,
        };
        if changed {
            match &eviction {
                Eviction::Safe(policy) => {
                    tracing::info!(maxmemory_policy = %policy, "Redis eviction policy keeps jobs")
                }
                Eviction::Evicting(policy) if state.allow_eviction => tracing::warn!(
                    maxmemory_policy = %policy,
                    "Redis may EVICT scheduled jobs under memory pressure (maxmemory-policy {policy}); \
                     running anyway because redis.allow_eviction = true. Set maxmemory-policy \
                     noeviction to keep every job"
                ),
                Eviction::Evicting(policy) => tracing::error!(
                    maxmemory_policy = %policy,
                    "Redis may evict scheduled jobs under memory pressure (maxmemory-policy {policy}); \
                     set maxmemory-policy noeviction, or redis.allow_eviction = true to accept the risk"
                ),
                Eviction::Unknown(why) => tracing::warn!(
                    reason = %why,
                    "Redis eviction policy and memory unknown: INFO and CONFIG GET are not allowed \
                     for this user. redisched cannot tell whether Redis may evict jobs; make sure \
                     maxmemory-policy is noeviction (metrics and /readyz show \"unknown\")"
                ),
            }
            state.logged_eviction = Some(eviction);
        }
        if let (Some(before), Some(now)) = (
            state.probe.as_ref().and_then(Probe::evicted_keys),
            probe.evicted_keys(),
        ) {
            if now > before {
                tracing::error!(
                    evicted = now - before,
                    evicted_keys = now,
                    "Redis evicted keys since the last check: scheduled jobs may be lost"
                );
            }
        }
        // Only the figures can tell (no write may come while the bridge is idle); between
        // the limit and room, the state stays as it is.
        if probe.memory_readable() {
            if probe.over_maxmemory() {
                if let Some((used, max)) = probe.memory() {
                    Self::refused(
                        &mut state,
                        format!("used_memory {used} > maxmemory {max} with a policy that evicts nothing"),
                        None,
                    );
                }
            } else if state.oom.is_some() && probe.has_room() {
                Self::accepted(
                    &mut state,
                    &format!("INFO memory shows used_memory at most {ROOM_PERCENT} % of maxmemory"),
                );
            }
        }
        state.probe = Some(probe);
    }

    /// The latest state.
    pub fn view(&self) -> HealthView {
        let mut state = self.state();
        state.denials.expire(Instant::now());
        let eviction = state.probe.as_ref().map(Probe::eviction);
        let memory = state.probe.as_ref().and_then(Probe::memory);
        let oom_until = state.oom.as_ref().map(|oom| {
            if state.probe.as_ref().is_some_and(Probe::memory_readable) {
                let now = memory
                    .map(|(used, max)| format!(" (now {used} of {max} bytes)"))
                    .unwrap_or_default();
                format!("INFO memory shows used_memory at most {ROOM_PERCENT} % of maxmemory{now}")
            } else {
                format!(
                    "a write of at least {} bytes is accepted (INFO memory is not readable for this user)",
                    oom.refused_bytes
                )
            }
        });
        HealthView {
            reachable: state.reachable.unwrap_or(false),
            oom: state.oom.as_ref().map(|o| o.why.clone()),
            oom_until,
            refused: state.denials.describe(),
            eviction_policy: eviction
                .as_ref()
                .map_or("unknown", Eviction::policy)
                .to_string(),
            eviction_policy_ok: eviction.as_ref().and_then(Eviction::keeps_jobs),
            evicted_keys: state.probe.as_ref().and_then(Probe::evicted_keys),
            used_memory: memory.map(|m| m.0),
            maxmemory: memory.map(|m| m.1),
            unknown_reason: match eviction {
                Some(Eviction::Unknown(why)) => Some(why),
                None => Some("not probed yet".into()),
                _ => None,
            },
            nodes: state
                .probe
                .as_ref()
                .map(|p| p.nodes.clone())
                .unwrap_or_default(),
        }
    }

    /// The latest eviction verdict (`None` before the first probe).
    pub fn eviction(&self) -> Option<Eviction> {
        self.state().probe.as_ref().map(Probe::eviction)
    }
}

/// Redis answered (with an error reply), as opposed to a lost or timed-out connection.
fn answered(err: &RedisError) -> bool {
    err.code().is_some()
}

fn is_oom(err: &RedisError) -> bool {
    err.code() == Some("OOM")
}

/// One `field:value` line of an `INFO` text.
fn info_field<'a>(info: &'a str, field: &str) -> Option<&'a str> {
    info.lines().find_map(|line| {
        line.strip_prefix(field)
            .and_then(|rest| rest.strip_prefix(':'))
            .map(str::trim)
    })
}

fn info_u64(info: &str, field: &str) -> Option<u64> {
    info_field(info, field).and_then(|v| v.parse().ok())
}

/// A node's health from its `INFO memory` + `INFO stats` text (the policy may come
/// from `CONFIG GET` instead when given).
fn node_from_info(node: String, info: &str) -> NodeHealth {
    let used = info_u64(info, "used_memory");
    let max = info_u64(info, "maxmemory");
    let not_counted = info_u64(info, "mem_not_counted_for_evict").unwrap_or(0);
    let policy = info_field(info, "maxmemory_policy").map(str::to_string);
    // Redis refuses a write when the memory it counts exceeds maxmemory and its policy
    // found nothing to evict: with a policy that keeps jobs, that is the OOM state.
    let over = match (used, max) {
        (Some(used), Some(max)) => {
            max > 0
                && used.saturating_sub(not_counted) > max
                && policy.as_deref().is_some_and(policy_keeps_jobs)
        }
        _ => false,
    };
    let has_room = match (used, max) {
        (Some(used), Some(max)) => {
            max == 0
                || u128::from(used.saturating_sub(not_counted)) * 100
                    <= u128::from(max) * u128::from(ROOM_PERCENT)
        }
        _ => false,
    };
    NodeHealth {
        node,
        eviction_policy: policy,
        used_memory: used,
        maxmemory: max,
        evicted_keys: info_u64(info, "evicted_keys"),
        over_maxmemory: over,
        has_room,
    }
}

/// The text of one node's reply, or its error.
fn text_of(value: Value) -> Result<String, RedisError> {
    match value {
        Value::ServerError(err) => Err(RedisError::from(err)),
        value => redis::from_redis_value(value).map_err(RedisError::from),
    }
}

/// A `CONFIG GET maxmemory-policy` reply (RESP2 array or RESP3 map): the policy.
fn policy_of(value: Value) -> Result<Option<String>, RedisError> {
    let pairs: Vec<(String, String)> = match value {
        Value::ServerError(err) => return Err(RedisError::from(err)),
        Value::Map(pairs) => pairs
            .into_iter()
            .map(|(k, v)| Ok((redis::from_redis_value(k)?, redis::from_redis_value(v)?)))
            .collect::<Result<_, redis::ParsingError>>()?,
        value => {
            let flat: Vec<String> = redis::from_redis_value(value)?;
            flat.chunks(2)
                .filter_map(|c| Some((c.first()?.clone(), c.get(1)?.clone())))
                .collect()
        }
    };
    Ok(pairs
        .into_iter()
        .find(|(k, _)| k == "maxmemory-policy")
        .map(|(_, v)| v))
}

impl Store {
    /// The health shared by this store's clones (and the stores given it with
    /// [`Store::with_health`]).
    pub fn health(&self) -> &std::sync::Arc<RedisHealth> {
        self.exec.health()
    }

    /// Feeds `health` (shared with the process's other stores) from now on.
    pub fn with_health(mut self, health: std::sync::Arc<RedisHealth>) -> Self {
        self.exec.set_health(health);
        self
    }

    /// Reads every primary's `INFO memory` and `INFO stats` (or, when `INFO` is refused,
    /// `CONFIG GET maxmemory-policy`), records the result in [`Store::health`] and
    /// returns it. An ACL that forbids both leaves the policy unknown (not an error);
    /// an unreachable Redis is the error.
    pub async fn probe_health(&self) -> Result<Probe, StoreError> {
        let mut info = redis::cmd("INFO");
        info.arg("memory").arg("stats");
        let probe = match self.exec.query_primaries(&info).await? {
            Ok(replies) => {
                let mut nodes = Vec::new();
                let mut refused = None;
                for (node, reply) in replies {
                    match text_of(reply) {
                        Ok(text) => nodes.push(node_from_info(node, &text)),
                        Err(err) if answered(&err) => {
                            refused = Some(err.to_string());
                            nodes.push(unread(node));
                        }
                        Err(err) => return Err(StoreError::Unavailable(err)),
                    }
                }
                match refused {
                    None => Probe {
                        nodes,
                        unreadable: None,
                    },
                    Some(why) => self.probe_config(why).await?,
                }
            }
            Err(err) => self.probe_config(err.to_string()).await?,
        };
        self.health().record_probe(probe.clone());
        Ok(probe)
    }

    /// The fallback when `INFO` was refused (`why`): the policy from `CONFIG GET`.
    async fn probe_config(&self, why: String) -> Result<Probe, StoreError> {
        let mut get = redis::cmd("CONFIG");
        get.arg("GET").arg("maxmemory-policy");
        let replies = match self.exec.query_primaries(&get).await? {
            Ok(replies) => replies,
            Err(err) => {
                return Ok(Probe {
                    nodes: vec![unread(String::new())],
                    unreadable: Some(format!("INFO: {why}; CONFIG GET: {err}")),
                })
            }
        };
        let mut nodes = Vec::new();
        let mut unreadable = format!("INFO: {why}");
        for (node, reply) in replies {
            let mut health = unread(node);
            match policy_of(reply) {
                Ok(policy) => health.eviction_policy = policy,
                Err(err) if answered(&err) => {
                    unreadable = format!("INFO: {why}; CONFIG GET: {err}");
                }
                Err(err) => return Err(StoreError::Unavailable(err)),
            }
            nodes.push(health);
        }
        Ok(Probe {
            nodes,
            unreadable: Some(unreadable),
        })
    }
}

fn unread(node: String) -> NodeHealth {
    NodeHealth {
        node,
        eviction_policy: None,
        used_memory: None,
        maxmemory: None,
        evicted_keys: None,
        over_maxmemory: false,
        has_room: false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(name: &str, policy: Option<&str>) -> NodeHealth {
        NodeHealth {
            eviction_policy: policy.map(str::to_string),
            ..unread(name.into())
        }
    }

    #[test]
    fn only_allkeys_policies_evict_jobs() {
        assert!(policy_keeps_jobs("noeviction"));
        assert!(policy_keeps_jobs("volatile-lru"));
        assert!(policy_keeps_jobs("volatile-ttl"));
        assert!(!policy_keeps_jobs("allkeys-lru"));
        assert!(!policy_keeps_jobs("allkeys-random"));
    }

    #[test]
    fn one_evicting_primary_makes_the_verdict() {
        let probe = Probe {
            nodes: vec![
                node("a:1", Some("noeviction")),
                node("b:2", Some("allkeys-lfu")),
            ],
            unreadable: None,
        };
        assert_eq!(
            probe.eviction(),
            Eviction::Evicting("allkeys-lfu on b:2".into()),
            "{probe:?}"
        );
        let probe = Probe {
            nodes: vec![node("a:1", Some("noeviction")), node("b:2", None)],
            unreadable: Some("NOPERM".into()),
        };
        assert_eq!(probe.eviction(), Eviction::Unknown("NOPERM".into()));
    }

    #[test]
    fn info_text_gives_memory_and_policy() {
        let info = "# Memory\r\nused_memory:2000\r\nmaxmemory:1000\r\nmaxmemory_policy:noeviction\r\nmem_not_counted_for_evict:0\r\n# Stats\r\nevicted_keys:7\r\n";
        let health = node_from_info(String::new(), info);
        assert_eq!(health.eviction_policy.as_deref(), Some("noeviction"));
        assert_eq!(
            (health.used_memory, health.maxmemory, health.evicted_keys),
            (Some(2000), Some(1000), Some(7))
        );
        assert!(health.over_maxmemory);
        assert!(!health.has_room);
        let unlimited = info.replace("maxmemory:1000", "maxmemory:0");
        assert!(!node_from_info(String::new(), &unlimited).over_maxmemory);
        assert!(node_from_info(String::new(), &unlimited).has_room);
        // Room: at most 90 % of the limit, as Redis counts it.
        let at = |used: u64| {
            node_from_info(
                String::new(),
                &info.replace("used_memory:2000", &format!("used_memory:{used}")),
            )
        };
        assert!(!at(950).over_maxmemory && !at(950).has_room);
        assert!(at(900).has_room);
    }

    fn memory_probe(used: u64, max: u64) -> Probe {
        let info = format!("used_memory:{used}\r\nmaxmemory:{max}\r\nmaxmemory_policy:noeviction\r\nevicted_keys:0\r\n");
        Probe {
            nodes: vec![node_from_info(String::new(), &info)],
            unreadable: None,
        }
    }

    fn oom_reply() -> RedisResult<Value> {
        match redis::parse_redis_value(
            b"-OOM command not allowed when used memory > 'maxmemory'.\r\n",
        ) {
            Ok(Value::ServerError(err)) => Err(RedisError::from(err)),
            other => panic!("{other:?}"),
        }
    }

    fn write(bytes: u64) -> impl Fn(usize) -> CallFacts {
        move |_| CallFacts {
            grows: true,
            bytes,
            name: "put.lua".into(),
        }
    }

    #[test]
    fn with_info_only_room_in_the_figures_ends_an_oom() {
        let health = RedisHealth::new();
        health.record_probe(memory_probe(990, 1000));
        health.observe_replies(&[oom_reply()], &write(500));
        assert!(health.view().oom.is_some());
        // At the boundary Redis takes a write again: still out of memory.
        health.observe_replies(&[Ok(Value::Okay)], &write(5_000));
        health.record_probe(memory_probe(950, 1000));
        let view = health.view();
        assert!(view.oom.is_some(), "{view:?}");
        let until = view.oom_until.unwrap_or_default();
        assert!(
            until.contains("INFO memory") && until.contains("90 %"),
            "{until}"
        );
        health.record_probe(memory_probe(900, 1000));
        assert_eq!(health.view().oom, None);
        assert_eq!(health.view().oom_until, None);
    }

    #[test]
    fn without_info_a_write_as_large_as_the_refused_one_ends_an_oom() {
        let health = RedisHealth::new();
        health.record_probe(Probe {
            nodes: vec![unread(String::new())],
            unreadable: Some("NOPERM info".into()),
        });
        health.observe_replies(&[oom_reply()], &write(500));
        let until = health.view().oom_until.unwrap_or_default();
        assert!(until.contains("at least 500 bytes"), "{until}");
        health.observe_replies(&[Ok(Value::Okay)], &write(499));
        health.observe_replies(&[Ok(Value::Okay)], &|_| CallFacts {
            grows: false,
            bytes: 10_000,
            name: "release.lua".into(),
        });
        assert!(health.view().oom.is_some());
        health.observe_replies(&[Ok(Value::Okay)], &write(500));
        assert_eq!(health.view().oom, None);
    }
}
