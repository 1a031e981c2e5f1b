//! The key schema: the only place that spells Redis key names.
//!
//! ```text
//! <prefix>:{<topic>}:scheduled  ZSET  id -> due time, epoch ms
//! <prefix>:{<topic>}:reserved   ZSET  id -> reservation deadline, epoch ms
//! <prefix>:{<topic>}:jobs       HASH  id -> job record
//! <prefix>:{<topic>}:seq        STRING reservation token counter
//! <prefix>:{<topic>}:damaged    HASH  what `redisched check --repair` set aside (check.lua only)
//! <prefix>:{<topic>}:paused     STRING exists while the topic is paused (epoch ms)
//! <prefix>:{<topic>}:history    LIST  capped outcome log, newest first
//! <prefix>:{<topic>}:failing    ZSET  id -> last_error_at of jobs with a recorded failure
//! <prefix>:{<topic>}:rate       HASH  live rate limit (max_per_second, burst) and its state (tat)
//! <prefix>:{<topic>}:fence      STRING highest ingest epoch that wrote the topic (one commands queue)
//! <prefix>:{<topic>}:fence:<k>  STRING the same, per command partition k (amqp.command_partitions > 1)
//! <prefix>:topics               SET   known topics (own slot; never touched by scripts)
//! <prefix>:command-partitions   STRING the partition count ingest last switched to (absent: one commands queue)
//! <prefix>:ingest-members       ZSET  bridges consuming command partitions -> announcement expiry, epoch ms
//! <prefix>:notify               Pub/Sub channel: '<due_at>|<topic>' when a topic's head moves earlier
//! ```

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use crate::job::Topic;

/// Key names of one deployment, derived from its prefix.
#[derive(Debug, Clone)]
pub struct KeySpace {
    prefix: String,
    /// The fence's name under the topic's tag: `fence`, or `fence:<k>` for the
    /// ingest of command partition k (each partition's sessions fence one another,
    /// never another partition's: two partitions write one topic at once).
    fence: String,
    /// Topics' key lists as spelled lately, shared by the clones of this key space:
    /// dispatch calls two scripts per batch on the same few topics, and spelling nine
    /// names each time was a visible share of a dispatched job's instructions.
    spelled: Arc<Mutex<HashMap<Topic, Arc<KeyLists>>>>,
}

/// The most topics whose key lists [`KeySpace::lists`] keeps; past it, it starts over
/// (a deployment with more busy topics than this only spells names more often).
const SPELLED_TOPICS: usize = 1024;

/// One topic's key lists, spelled once (see [`KeySpace::lists`]).
#[derive(Debug)]
pub struct KeyLists([String; 9]);

impl KeyLists {
    /// [`KeySpace::all`].
    pub fn all(&self) -> &[String] {
        &self.0[..8]
    }

    /// [`KeySpace::limited`].
    pub fn limited(&self) -> &[String] {
        &self.0
    }
}

/// The four keys of the version-1 script contract, in `KEYS` order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TopicKeys(pub [String; 4]);

/// Names of the full key list, in `KEYS` order (`lua/README.md`, "Key schema").
pub(super) const FULL_KEY_NAMES: [&str; 8] = [
    "scheduled",
    "reserved",
    "jobs",
    "seq",
    "damaged",
    "paused",
    "history",
    "failing",
];

impl KeySpace {
    /// `prefix` must not contain braces (it would capture the hash tag); config
    /// validation refuses it earlier, this is the last line of defence.
    pub fn new(prefix: impl Into<String>) -> Self {
        let prefix: String = prefix.into();
        debug_assert!(!prefix.contains(['{', '}']));
        Self {
            prefix,
            fence: "fence".into(),
            spelled: Arc::default(),
        }
    }

    /// The same key space whose fenced writes use command partition `k`'s fence.
    pub fn for_partition(&self, k: u16) -> Self {
        Self {
            prefix: self.prefix.clone(),
            fence: format!("fence:{k}"),
            spelled: self.spelled.clone(),
        }
    }

    /// `topic`'s full and limited key lists, spelled once and then shared.
    pub fn lists(&self, topic: &Topic) -> Arc<KeyLists> {
        // A poisoned lock still holds whole entries: each is inserted complete.
        let mut spelled = self.spelled.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(lists) = spelled.get(topic) {
            return lists.clone();
        }
        if spelled.len() >= SPELLED_TOPICS {
            spelled.clear();
        }
        let [a, b, c, d, e, f, g, h] = self.all(topic);
        let rate = format!("{}:{{{}}}:rate", self.prefix, topic.as_str());
        let lists = Arc::new(KeyLists([a, b, c, d, e, f, g, h, rate]));
        spelled.insert(topic.clone(), lists.clone());
        lists
    }

    pub fn topic(&self, topic: &Topic) -> TopicKeys {
        let base = format!("{}:{{{}}}", self.prefix, topic.as_str());
        TopicKeys([
            format!("{base}:scheduled"),
            format!("{base}:reserved"),
            format!("{base}:jobs"),
            format!("{base}:seq"),
        ])
    }

    /// The full key list every script accepts (and pause, resume, redrive and history
    /// require): the four of [`KeySpace::topic`], then `damaged`, `paused`, `history`,
    /// `failing`, all under the topic's hash tag.
    pub fn all(&self, topic: &Topic) -> [String; 8] {
        let base = format!("{}:{{{}}}", self.prefix, topic.as_str());
        FULL_KEY_NAMES.map(|name| format!("{base}:{name}"))
    }

    /// The full list plus the topic's ingest fence (the highest ingest epoch that
    /// wrote it), for fenced puts and deletes.
    pub fn fenced(&self, topic: &Topic) -> Vec<String> {
        let mut keys = self.all(topic).to_vec();
        keys.push(format!(
            "{}:{{{}}}:{}",
            self.prefix,
            topic.as_str(),
            self.fence
        ));
        keys
    }

    /// The full list plus the topic's rate limit and its state: what `reserve.lua`
    /// takes to obey a limit, and `rate_limit.lua` requires.
    pub fn limited(&self, topic: &Topic) -> Vec<String> {
        let mut keys = self.all(topic).to_vec();
        keys.push(format!("{}:{{{}}}:rate", self.prefix, topic.as_str()));
        keys
    }

    /// The counter ingest sessions take their epochs from (its own slot).
    pub fn ingest_epoch(&self) -> String {
        format!("{}:ingest-epoch", self.prefix)
    }

    /// The bridges whose ingest consumes command partitions: member -> expiry (epoch ms,
    /// Redis clock); own slot, never touched by a script.
    pub fn ingest_members(&self) -> String {
        format!("{}:ingest-members", self.prefix)
    }

    /// The command partition count the deployment's ingest last switched to (absent:
    /// one commands queue); own slot, never touched by a script.
    pub fn command_partitions(&self) -> String {
        format!("{}:command-partitions", self.prefix)
    }

    /// Where `check.lua` sets aside what it cannot repair; same hash tag as the
    /// topic's other keys.
    pub fn damaged(&self, topic: &Topic) -> String {
        format!("{}:{{{}}}:damaged", self.prefix, topic.as_str())
    }

    /// A webhook target's health hash and its list of unannounced changes
    /// (`lua/target_health.lua`), under one hash tag of their own.
    pub fn target_health(&self, target: &str) -> [String; 2] {
        [
            format!("{}:target:{{{target}}}:health", self.prefix),
            format!("{}:target:{{{target}}}:events", self.prefix),
        ]
    }

    pub fn topics(&self) -> String {
        format!("{}:topics", self.prefix)
    }

    pub fn notify_channel(&self) -> String {
        format!("{}:notify", self.prefix)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn all_keys_of_a_topic_share_one_hash_tag() {
        let keys = KeySpace::new("rs").topic(&Topic::new("mail.welcome").unwrap());
        for key in &keys.0 {
            assert!(key.starts_with("rs:{mail.welcome}:"), "{key}");
        }
        assert_eq!(keys.0[0], "rs:{mail.welcome}:scheduled");
        let all = KeySpace::new("rs").all(&Topic::new("mail.welcome").unwrap());
        assert_eq!(all[..4], keys.0[..]);
        assert_eq!(all[4], "rs:{mail.welcome}:damaged");
        assert_eq!(all[7], "rs:{mail.welcome}:failing");
        let limited = KeySpace::new("rs").limited(&Topic::new("mail.welcome").unwrap());
        assert_eq!(limited[..8], all[..]);
        assert_eq!(limited[8], "rs:{mail.welcome}:rate");
    }

    #[test]
    fn spelled_lists_are_the_spelled_out_ones_whatever_the_cache_holds() {
        let space = KeySpace::new("rs");
        let partition = space.for_partition(3);
        for round in 0..3 {
            for n in 0..(SPELLED_TOPICS + 10) {
                let topic = Topic::new(format!("t{n}")).unwrap();
                let lists = if round == 1 {
                    partition.lists(&topic)
                } else {
                    space.lists(&topic)
                };
                assert_eq!(lists.all(), &space.all(&topic)[..]);
                assert_eq!(lists.limited(), &space.limited(&topic)[..]);
            }
        }
        assert!(space.spelled.lock().unwrap().len() <= SPELLED_TOPICS);
    }
}
