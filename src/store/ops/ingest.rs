//! What ingest keeps in Redis besides jobs: the epoch counter that fences its sessions'
//! writes (`apply.rs`), the members sharing the command partitions out, and the
//! partition count it last switched to. Plain commands; no script.

use redis::Value;

use crate::store::call::Call;
use crate::store::{Store, StoreError};

const ROUTED: &str = "routed:";

/// The commands topology recorded in the store (`<prefix>:command-partitions`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RecordedPartitions {
    /// No record: one commands queue.
    One,
    /// `<N>`: partitioned by the release before, through RabbitMQ's consistent-hash
    /// exchange.
    Hashed(u16),
    /// `routed:<N>`: partitioned by the bridges' router.
    Routed(u16),
}

impl RecordedPartitions {
    fn parse(value: Option<&str>) -> Option<Self> {
        let Some(value) = value else {
            return Some(Self::One);
        };
        match value.strip_prefix(ROUTED) {
            Some(n) => n.parse().ok().map(Self::Routed),
            None => value.parse().ok().map(Self::Hashed),
        }
    }

    /// The partition count, 1 for one commands queue.
    pub fn count(self) -> u16 {
        match self {
            Self::One => 1,
            Self::Hashed(n) | Self::Routed(n) => n,
        }
    }
}

impl Store {
    /// A new ingest epoch, greater than every one handed out before. With durability
    /// set, the increment waits for the replicas like any write
    /// ([`StoreError::NotReplicated`] when they fall short): a counter lost at a failover
    /// could hand the same epoch to two sessions, and fencing could not tell them apart.
    pub async fn next_ingest_epoch(&self) -> Result<u64, StoreError> {
        let mut incr = redis::cmd("INCR");
        incr.arg(self.keys.ingest_epoch());
        let Some(want) = self.durability else {
            return self.exec.query(&incr).await;
        };
        let value = self
            .write_waiting("redis", Call::global(incr), want)
            .await?;
        redis::from_redis_value(value).map_err(|e| StoreError::bad_reply("redis", e.to_string()))
    }

    /// The commands topology the deployment's ingest last switched to: what tells a
    /// starting bridge that the broker holds another topology's queues to drain before
    /// its own.
    pub async fn command_partitions(&self) -> Result<RecordedPartitions, StoreError> {
        let mut get = redis::cmd("GET");
        get.arg(self.keys.command_partitions());
        let value: Option<String> = self.exec.query(&get).await?;
        RecordedPartitions::parse(value.as_deref()).ok_or_else(|| {
            StoreError::bad_reply(
                "redis",
                format!("{value:?} is not a command partition record"),
            )
        })
    }

    /// Records the partition count ingest switched to (1 deletes the record). Written
    /// as `routed:<N>`, which a bridge of the release before cannot read: it refuses to
    /// start ingest instead of binding its own topology beside this one.
    pub async fn set_command_partitions(&self, partitions: u16) -> Result<(), StoreError> {
        let call = if partitions > 1 {
            let mut set = redis::cmd("SET");
            set.arg(self.keys.command_partitions())
                .arg(format!("{ROUTED}{partitions}"));
            set
        } else {
            let mut del = redis::cmd("DEL");
            del.arg(self.keys.command_partitions());
            del
        };
        let _: Value = self.exec.query(&call).await?;
        Ok(())
    }

    /// Announces the ingest `member` for `ttl_ms` (Redis clock) and returns every member
    /// whose announcement has not expired, sorted: the bridges consuming command
    /// partitions, among which the partitions are shared out.
    pub async fn ingest_members(
        &self,
        member: &str,
        ttl_ms: u64,
    ) -> Result<Vec<String>, StoreError> {
        let now = self.server_time().await?;
        let key = self.keys.ingest_members();
        let mut add = redis::cmd("ZADD");
        add.arg(&key)
            .arg(now.saturating_add(i64::try_from(ttl_ms).unwrap_or(i64::MAX)))
            .arg(member);
        let _: Value = self.exec.query(&add).await?;
        let mut prune = redis::cmd("ZREMRANGEBYSCORE");
        prune.arg(&key).arg("-inf").arg(now);
        let _: Value = self.exec.query(&prune).await?;
        let mut range = redis::cmd("ZRANGE");
        range.arg(&key).arg(0).arg(-1);
        let mut members: Vec<String> = self.exec.query(&range).await?;
        members.sort();
        Ok(members)
    }

    /// Withdraws the ingest `member`'s announcement (on shutdown), so the others take
    /// its partitions over at once instead of when it expires.
    pub async fn leave_ingest(&self, member: &str) -> Result<(), StoreError> {
        let mut rem = redis::cmd("ZREM");
        rem.arg(self.keys.ingest_members()).arg(member);
        let _: Value = self.exec.query(&rem).await?;
        Ok(())
    }
}
