//! `redisched check`: the store's fsck, one topic at a time, over `lua/check.lua`.

use serde::Serialize;

use crate::job::Topic;
use crate::store::reply::Reader;
use crate::store::scripts::Scripts;
use crate::store::{Store, StoreError};

/// Entries `check.lua` examines per call: small enough that one call never blocks
/// Redis for long, even with large bodies in the records it reads.
pub const CHECK_STEP: usize = 200;

/// One thing `check.lua` found wrong with a topic. `kind` is one of the kinds listed
/// in the script's header (`wrong_type`, `unreadable_record`, `unindexed`, `in_both`,
/// `orphan_scheduled`, `orphan_reserved`, `failing_unindexed`, `orphan_failing`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Problem {
    pub kind: String,
    /// The job id, or for `wrong_type` the key's name (`scheduled`, `jobs`, …).
    pub id: String,
    /// Fixed by this run (repair mode only).
    pub repaired: bool,
    pub detail: String,
}

/// What checking one topic found.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct CheckReport {
    pub topic: String,
    /// Records and set members looked at.
    pub examined: u64,
    pub problems: Vec<Problem>,
    /// Entries in the topic's `damaged` hash (what repairs set aside, now or before).
    pub damaged: u64,
}

impl CheckReport {
    /// Problems still there after this run (all of them in report mode).
    pub fn unrepaired(&self) -> usize {
        self.problems.iter().filter(|p| !p.repaired).count()
    }
}

impl Store {
    /// Verifies one topic's invariants, and with `repair` fixes what it finds (setting
    /// aside, never deleting, what it cannot fix). Walks the topic in steps of
    /// [`CHECK_STEP`] entries, each one atomic, so it is safe beside running bridges.
    /// See `lua/check.lua`.
    pub async fn check(&self, topic: &Topic, repair: bool) -> Result<CheckReport, StoreError> {
        // The full key list: also checks `paused`, `history` and the `failing` index.
        let keys = self.keys.all(topic);
        let mode = if repair { "repair" } else { "report" };
        let mut report = CheckReport {
            topic: topic.to_string(),
            examined: 0,
            problems: Vec::new(),
            damaged: 0,
        };
        let mut cursor = "0".to_string();
        loop {
            let call = Scripts::call_with_keys(&self.exec.scripts().check, topic, &keys)
                .arg(mode)
                .arg(&cursor)
                .arg(CHECK_STEP);
            let value = self.exec.run_one(call).await?;
            let mut reply = Reader::new("check", value)?;
            cursor = reply.string("cursor")?;
            report.examined += u64::try_from(reply.int("examined")?).unwrap_or(0);
            for mut found in reply.arrays("problems")? {
                let problem = Problem {
                    kind: found.string("kind")?,
                    id: String::from_utf8_lossy(&found.bytes("id")?).into_owned(),
                    repaired: found.int("repaired")? == 1,
                    detail: String::from_utf8_lossy(&found.bytes("detail")?).into_owned(),
                };
                // SCAN may return an entry twice; report it once.
                if !report.problems.contains(&problem) {
                    report.problems.push(problem);
                }
            }
            report.damaged = u64::try_from(reply.int("damaged")?).unwrap_or(0);
            if cursor == "0" {
                return Ok(report);
            }
        }
    }
}
