//! `lua/release.lua`: ending delivered reservations, token-fenced: a one-shot job
//! deleted, a recurring one moved to its next occurrence (or its series ended), a job
//! set aside as expired logged so. Every `release_*` method, what it takes, and the
//! one-by-one retry of a call Redis refused.

use std::collections::BTreeMap;

use redis::Value;

use crate::job::Topic;
use crate::store::call::Call;
use crate::store::error::Rejection;
use crate::store::scripts::Scripts;
use crate::store::types::{Lease, MAX_BATCH};
use crate::store::{Store, StoreError};

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

impl Store {
    /// Deletes delivered jobs whose reservation is still current; returns how many.
    /// One round trip for any number of topics. Releasing twice is harmless (the second
    /// finds nothing), so the executor's rerun after `NOSCRIPT` is safe. A recurring job
    /// needs [`Store::release_delivered`]: `release.lua` refuses to end a series
    /// silently; such a refused job is logged and stays reserved (redelivered after its
    /// time-to-run), and the other jobs of the call are released one by one.
    pub async fn release(&self, leases: &[Lease]) -> Result<u64, StoreError> {
        self.release_any(leases).await
    }

    /// Releases delivered jobs whose reservation is still current: deletes one-shot
    /// jobs, and moves recurring ones to their next occurrence (or ends their series)
    /// in the same atomic step, token-fenced; returns how many.
    pub async fn release_delivered(&self, delivered: &[Delivered]) -> Result<u64, StoreError> {
        self.release_any(delivered).await
    }

    /// [`Store::release_delivered`] with a note on each `dispatched` history entry.
    pub async fn release_noted(&self, delivered: &[Noted]) -> Result<u64, StoreError> {
        self.release_any(delivered).await
    }

    /// Releases jobs set aside as expired (their copy in the expired exchange was
    /// confirmed): exactly as [`Store::release_noted`], logged `expired`.
    pub async fn release_expired(&self, expired: &[Expired]) -> Result<u64, StoreError> {
        self.release_any(expired).await
    }

    async fn release_any<R: Releasable>(&self, leases: &[R]) -> Result<u64, StoreError> {
        let mut by_topic: BTreeMap<&Topic, Vec<&R>> = BTreeMap::new();
        for item in leases {
            by_topic.entry(&item.lease().topic).or_default().push(item);
        }
        let chunks: Vec<&[&R]> = by_topic
            .values()
            .flat_map(|items| items.chunks(MAX_BATCH))
            .collect();
        let calls: Vec<Call> = chunks
            .iter()
            .map(|chunk| self.release_call(chunk))
            .collect();
        let mut total = 0;
        let mut refused: Vec<&R> = Vec::new();
        for (chunk, reply) in chunks.iter().zip(self.exec.run(&calls).await?) {
            match released(reply)? {
                Ok(count) => total += count,
                // Redis refused the call as a whole (nothing in it changed): a recurring
                // job released without its next due time, or damaged data. Retried one
                // by one below, so the one refused entry keeps no other job reserved.
                Err(_) if chunk.len() > 1 => refused.extend(chunk.iter().copied()),
                Err(rejection) => log_refused_release(chunk[0], &rejection),
            }
        }
        if !refused.is_empty() {
            let calls: Vec<Call> = refused
                .iter()
                .map(|item| self.release_call(std::slice::from_ref(item)))
                .collect();
            for (item, reply) in refused.iter().zip(self.exec.run(&calls).await?) {
                match released(reply)? {
                    Ok(count) => total += count,
                    Err(rejection) => log_refused_release(*item, &rejection),
                }
            }
        }
        Ok(total)
    }

    fn release_call<R: Releasable>(&self, items: &[&R]) -> Call {
        let topic = &items[0].lease().topic;
        let mut call = Scripts::call(&self.exec.scripts().release, topic, &self.keys);
        for item in items {
            let lease = item.lease();
            let mut arg = match item.note() {
                None => item.next_due().lease_arg(lease.token),
                Some(note) => format!(
                    "{};{}",
                    item.next_due().lease_arg(lease.token),
                    short_note(note)
                ),
            };
            if item.expired() {
                arg.insert_str(0, "expired:");
            }
            call = call.arg(lease.id.as_str()).arg(arg);
        }
        // An odd argument count: the last one is history_max.
        call.arg(self.history_max)
    }
}

/// A release call's count, or Redis's refusal of it; an unavailable Redis is an error.
fn released(reply: redis::RedisResult<Value>) -> Result<Result<u64, Rejection>, StoreError> {
    match reply {
        Ok(value) => Ok(Ok(redis::from_redis_value::<u64>(value).unwrap_or(0))),
        Err(err) => match StoreError::from(err) {
            StoreError::Rejected(rejection) => Ok(Err(rejection)),
            other => Err(other),
        },
    }
}

/// A release note cut to what `release.lua` takes (100 bytes, on a char boundary).
fn short_note(note: &str) -> &str {
    let mut end = note.len().min(100);
    while !note.is_char_boundary(end) {
        end -= 1;
    }
    &note[..end]
}

/// The job stays reserved, so it is delivered again after its time-to-run.
fn log_refused_release<R: Releasable>(item: &R, rejection: &Rejection) {
    let lease = item.lease();
    tracing::error!(topic = %lease.topic, id = %lease.id, %rejection, "release refused; the job stays reserved and is delivered again after its time-to-run (a recurring job needs its next due time)");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn leases_carry_the_next_due_time_as_release_lua_reads_it() {
        assert_eq!(NextDue::OneShot.lease_arg(17), "17");
        assert_eq!(NextDue::At(1_000).lease_arg(17), "17@1000");
        assert_eq!(NextDue::End.lease_arg(17), "17@-1");
    }
}
