//! What goes into the store and what comes back: every request and reply type of the
//! typed script API, in one place. The values they carry (`Topic`, `JobId`, `Due`,
//! `PutMode`) are the shared vocabulary of `crate::job`.

use serde::Serialize;

use crate::job::{Due, JobId, PutMode, Topic};

/// Largest batch a script accepts in one call (`limit` of reserve, pull, requeue and
/// the pairs of release).
pub const MAX_BATCH: usize = 1000;

/// Limits enforced by the put script itself, so every client gets the same refusals.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    pub max_delay_ms: i64,
    pub max_body_bytes: usize,
}

/// A command to apply to the store, as decoded from AMQP, HTTP or the CLI.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Op {
    Put(PutRequest),
    Delete { topic: Topic, id: JobId },
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PutRequest {
    pub topic: Topic,
    pub id: JobId,
    pub body: Vec<u8>,
    /// Opaque bytes forwarded with the job; the bridge stores AMQP properties here.
    pub meta: Vec<u8>,
    pub due: Due,
    pub mode: PutMode,
}

impl Op {
    pub fn topic(&self) -> &Topic {
        match self {
            Op::Put(put) => &put.topic,
            Op::Delete { topic, .. } => topic,
        }
    }
}

/// What applying one [`Op`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Applied {
    Put(PutOutcome),
    Delete { removed: bool },
}

/// How a put ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum PutStatus {
    Scheduled,
    Replaced,
    Duplicate,
}

impl PutStatus {
    pub fn as_str(self) -> &'static str {
        match self {
            PutStatus::Scheduled => "scheduled",
            PutStatus::Replaced => "replaced",
            PutStatus::Duplicate => "duplicate",
        }
    }
}

/// The reply of a put: what happened and when the stored job is due (epoch ms).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct PutOutcome {
    pub status: PutStatus,
    pub due_at: i64,
}

/// A job handed out by `reserve` or `pull`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReservedJob {
    /// Kept as the raw string Redis holds: a job put by another client is delivered
    /// even if its id would not pass [`JobId::new`].
    pub id: String,
    pub due_at: i64,
    /// 1 on the first delivery attempt.
    pub attempt: u32,
    /// Proves this reservation to `release` and `retry`; 0 for pulled jobs.
    pub token: u64,
    /// Opaque bytes forwarded with the job (the bridge stores AMQP properties here).
    pub meta: Vec<u8>,
    pub body: Vec<u8>,
    /// The server's clock when this job was reserved (the reserve reply's `now`).
    pub reserved_at: i64,
    /// The schedule spec of a recurring job (`every:<ms>`, `cron:<expr>|<tz>`): release
    /// it with its next occurrence (`Store::release_delivered`). `None`: one-shot.
    ///
    /// `Store::release_delivered`: super::Store::release_delivered
    pub spec: Option<String>,
}

/// Where a job is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum JobState {
    Scheduled,
    Reserved,
    /// Set aside after `max_attempts` failed publishes; waits for a redrive.
    Parked,
    /// A record in neither sorted set: an invariant violation `redisched check` repairs.
    Unindexed,
}

/// The last failed publish recorded on a job.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct LastError {
    /// Short reason, e.g. `unroutable: NO_ROUTE`.
    pub reason: String,
    /// When it failed, epoch ms by the Redis server's clock.
    pub at: i64,
}

/// One job as `get` sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JobInfo {
    pub state: JobState,
    /// When it is due next (for a retried or requeued job, the new time).
    pub due_at: i64,
    pub attempts: u32,
    pub token: u64,
    /// When the current reservation expires; `None` unless reserved.
    pub deadline: Option<i64>,
    pub meta: Vec<u8>,
    pub body: Vec<u8>,
    /// The schedule spec of a recurring job, `None` for a one-shot job.
    pub spec: Option<String>,
    /// Failed publishes recorded (of this occurrence, for a series).
    pub failures: u32,
    pub last_error: Option<LastError>,
}

/// A topic's jobs counted by state.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize)]
pub struct TopicStats {
    pub now: i64,
    pub scheduled: u64,
    pub due_now: u64,
    pub reserved: u64,
    pub expired: u64,
    pub records: u64,
    /// Parked after too many failed publishes (not counted in `scheduled`).
    pub parked: u64,
    pub paused: bool,
    /// Jobs with a recorded failure (`last_error`), parked ones included.
    pub failing: u64,
    /// Entries in the topic's outcome history.
    pub history: u64,
    /// Due jobs its rate limit holds back now (0 without a limit).
    pub throttled: u64,
    /// The rate limit in force and where it comes from; `None`: unlimited.
    #[serde(skip)]
    pub rate_limit: Option<(crate::policy::RateLimit, RateSource)>,
}

/// Where the rate limit in force comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum RateSource {
    /// Set through the API or the CLI, stored in Redis: every bridge obeys it.
    Live,
    /// The configuration's `[[policies]]` entry for the topic.
    Policy,
}

/// A topic's rate limit in force, and what it holds back now.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RateState {
    pub limit: Option<(crate::policy::RateLimit, RateSource)>,
    pub throttled: u64,
    pub next_token: Option<i64>,
    pub now: i64,
}

/// The jobs one `reserve` or `pull` call took.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Batch {
    /// The Redis server's clock when the script ran, epoch ms.
    pub now: i64,
    /// Due time of the topic's earliest job still waiting.
    pub next_due: Option<i64>,
    pub jobs: Vec<ReservedJob>,
    /// Ids whose record was missing or unreadable; taken off the schedule.
    pub corrupt: Vec<String>,
    /// The topic is paused: nothing was taken (see `Store::pause`).
    pub paused: bool,
    /// Due jobs the topic's rate limit held back in this call.
    pub throttled: u64,
    /// When the rate limit lets the next job go (`None`: no limit applies); plan the
    /// topic for the later of this and `next_due`.
    pub next_token: Option<i64>,
}

/// What one `requeue` call did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Requeued {
    pub count: u64,
    pub next_deadline: Option<i64>,
}

/// A token-bearing reference to a reserved job, for `release`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lease {
    pub topic: Topic,
    pub id: String,
    pub token: u64,
}

// ---------------------------------------------------------------- scheduler features
// Recurring series, pause, failing and parked jobs, history (`lua/README.md`).

/// Default cap of each topic's history (`history.max_per_topic`).
pub const DEFAULT_HISTORY_MAX: u32 = 1000;
/// Longest spec `put.lua` stores.
const MAX_SPEC_BYTES: usize = 256;

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

/// What the apply path takes: a plain [`Op`], or a [`Command`].
pub(crate) trait StoreCommand {
    fn op(&self) -> &Op;
    /// The schedule a put gives its job (ignored for deletes).
    fn schedule(&self) -> Option<&ScheduleSpec> {
        None
    }
    /// The first occurrence's jitter bound (`put.lua`'s `jitter_ms`), 0 for none.
    fn jitter_ms(&self) -> u64 {
        0
    }
}

impl StoreCommand for Op {
    fn op(&self) -> &Op {
        self
    }
}

/// An [`Op`] with the scheduler features: a put with `Some(schedule)` stores a
/// recurring job (a replace with `None` makes it one-shot again).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Command {
    pub op: Op,
    pub schedule: Option<ScheduleSpec>,
    /// A jittered series: the bound its first occurrence's delay is taken modulo
    /// (`Schedule::jitter_bound` of the first due time; `put.lua` computes the delay
    /// once it has resolved that time). 0: none.
    pub jitter_ms: u64,
}

impl StoreCommand for Command {
    fn op(&self) -> &Op {
        &self.op
    }
    fn schedule(&self) -> Option<&ScheduleSpec> {
        self.schedule.as_ref()
    }
    fn jitter_ms(&self) -> u64 {
        self.jitter_ms
    }
}

impl From<Op> for Command {
    fn from(op: Op) -> Self {
        Self {
            op,
            schedule: None,
            jitter_ms: 0,
        }
    }
}

/// What releasing a delivered job does next.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NextDue {
    /// A one-shot job: delete it. (A recurring job released so is refused.)
    OneShot,
    /// A recurring job: its next occurrence, epoch ms, strictly after the server's now
    /// and after the delivered occurrence.
    At(i64),
    /// A recurring job whose series ends with this delivery.
    End,
    /// A jittered series: its next occurrence `at` (kept in the record, the series'
    /// grid) waits in `scheduled` until `at + delay_ms`.
    Jittered { at: i64, delay_ms: u64 },
}

impl NextDue {
    /// The `lease` argument of `release.lua`.
    pub(crate) fn lease_arg(self, token: u64) -> String {
        match self {
            NextDue::OneShot => token.to_string(),
            NextDue::At(next) => format!("{token}@{next}"),
            NextDue::End => format!("{token}@-1"),
            NextDue::Jittered { at, delay_ms: 0 } => format!("{token}@{at}"),
            NextDue::Jittered { at, delay_ms } => format!("{token}@{at}+{delay_ms}"),
        }
    }
}

/// What the release path takes: a plain [`Lease`] (one-shot), or [`Delivered`].
pub(crate) trait Releasable {
    fn lease(&self) -> &Lease;
    fn next_due(&self) -> NextDue {
        NextDue::OneShot
    }
    /// A note for the `dispatched` history entry (`release.lua`'s `;<note>`).
    fn note(&self) -> Option<&str> {
        None
    }
    /// Set aside as expired, not delivered: logged `expired` (`release.lua`'s
    /// `expired:` lease marker).
    fn expired(&self) -> bool {
        false
    }
}

impl Releasable for Lease {
    fn lease(&self) -> &Lease {
        self
    }
}

/// A delivered job and what comes after it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Delivered {
    pub lease: Lease,
    pub next_due: NextDue,
}

impl Releasable for Delivered {
    fn lease(&self) -> &Lease {
        &self.lease
    }
    fn next_due(&self) -> NextDue {
        self.next_due
    }
}

/// A delivered job with a note for its `dispatched` history entry (a webhook's
/// `HTTP 200`); at most 100 bytes, longer is cut.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Noted {
    pub delivered: Delivered,
    pub note: String,
}

impl Releasable for Noted {
    fn lease(&self) -> &Lease {
        &self.delivered.lease
    }
    fn next_due(&self) -> NextDue {
        self.delivered.next_due
    }
    fn note(&self) -> Option<&str> {
        Some(self.note.as_str()).filter(|n| !n.is_empty())
    }
}

/// A job that was not delivered by its due time + expires-after and was set aside (its
/// copy in the expired exchange confirmed): released like a delivered one (a one-shot
/// deleted, a series moved to its next occurrence), logged `expired` with the note.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Expired(pub Noted);

impl Releasable for Expired {
    fn lease(&self) -> &Lease {
        &self.0.delivered.lease
    }
    fn next_due(&self) -> NextDue {
        self.0.delivered.next_due
    }
    fn note(&self) -> Option<&str> {
        self.0.note()
    }
    fn expired(&self) -> bool {
        true
    }
}

/// What `Store::retry_failed` did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum RetryOutcome {
    /// Due again after the delay.
    Retried,
    /// Its failures reached `max_attempts`: parked until re-driven.
    Parked,
    /// No longer ours (released, replaced, deleted or requeued): nothing changed.
    Stale,
}

/// What one `Store::redrive_all` step did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Redriven {
    pub moved: u64,
    /// Parked jobs left in the topic.
    pub remaining: u64,
}

/// An outcome in a topic's history.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum Outcome {
    #[serde(rename = "dispatched")]
    Dispatched,
    #[serde(rename = "deleted")]
    Deleted,
    #[serde(rename = "replaced")]
    Replaced,
    #[serde(rename = "parked")]
    Parked,
    #[serde(rename = "re-driven")]
    Redriven,
    /// Not delivered by its due time + expires-after: set aside to the expired exchange.
    #[serde(rename = "expired")]
    Expired,
}

impl Outcome {
    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Dispatched => "dispatched",
            Outcome::Deleted => "deleted",
            Outcome::Replaced => "replaced",
            Outcome::Parked => "parked",
            Outcome::Redriven => "re-driven",
            Outcome::Expired => "expired",
        }
    }

    pub(crate) fn parse(name: &str) -> Option<Self> {
        Some(match name {
            "dispatched" => Outcome::Dispatched,
            "deleted" => Outcome::Deleted,
            "replaced" => Outcome::Replaced,
            "parked" => Outcome::Parked,
            "re-driven" => Outcome::Redriven,
            "expired" => Outcome::Expired,
            _ => return None,
        })
    }
}

/// One entry of a topic's history (`lua/history.lua`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct HistoryEntry {
    /// When it happened, epoch ms (Redis server clock).
    pub at: i64,
    pub outcome: Outcome,
    pub id: String,
    /// The job's attempts at that moment (of the occurrence, for a series).
    pub attempts: u32,
    /// The (occurrence's) due time; for `replaced` the new one.
    pub due_at: i64,
    /// The next due time for a dispatched occurrence of a series, the error for
    /// `parked`, else empty.
    pub detail: String,
}

/// Which jobs `Store::list_jobs` lists.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ListWhich {
    /// Waiting jobs, earliest first.
    Scheduled,
    /// Parked jobs, by id.
    Parked,
}

/// One job of `Store::list_jobs`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct JobSummary {
    pub id: String,
    pub due_at: i64,
    pub state: JobState,
    pub attempts: u32,
    pub spec: Option<String>,
    pub failures: u32,
    pub last_error: Option<LastError>,
}
