//! How many waiting jobs of a topic fall due in each slice of a coming window, counted
//! inside Redis (`lua/due_histogram.lua`): the dashboard's "due in the next hour / day".

use crate::job::Topic;
use crate::store::reply::Reader;
use crate::store::scripts::Scripts;
use crate::store::{Store, StoreError};

/// Widest window `due_histogram.lua` accepts (about 31.7 years), so that every bucket
/// edge stays an exact integer in a Lua number.
pub const MAX_HISTOGRAM_WINDOW_MS: u64 = 1_000_000_000_000;
/// Most buckets `due_histogram.lua` accepts (one `ZCOUNT` each).
pub const MAX_HISTOGRAM_BUCKETS: usize = 1000;

/// The reply of [`Store::due_histogram`]. Parked jobs are in no count, so
/// `due_now + counts.sum() + later` equals [`crate::store::TopicStats::scheduled`] at `now`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DueHistogram {
    /// The server's clock (epoch ms) the window starts at.
    pub now: i64,
    pub window_ms: u64,
    /// Jobs due at or before `now` (the backlog).
    pub due_now: u64,
    /// Jobs due in each bucket, earliest first; see [`DueHistogram::bucket_edges`].
    pub counts: Vec<u64>,
    /// Jobs due after the window (not parked).
    pub later: u64,
}

impl DueHistogram {
    /// `(from, to]` in epoch ms of each bucket, as the script cut them: equal slices of
    /// the window, edges rounded down to whole milliseconds.
    pub fn bucket_edges(&self) -> Vec<(i64, i64)> {
        let buckets = self.counts.len() as u128;
        let window = u128::from(self.window_ms);
        let edge = |i: u128| {
            // window <= 10^12 and i <= 1000: no overflow, and the offset fits an i64.
            self.now + i64::try_from(window * i / buckets.max(1)).unwrap_or(i64::MAX)
        };
        (0..buckets).map(|i| (edge(i), edge(i + 1))).collect()
    }
}

fn count(reply: &mut Reader, what: &str) -> Result<u64, StoreError> {
    let n = reply.int(what)?;
    u64::try_from(n).map_err(|_| StoreError::bad_reply("due_histogram", format!("{what} {n}")))
}

impl Store {
    /// Counts `topic`'s waiting jobs by due time over the `window_ms` after the server's
    /// now, in `buckets` equal slices (1..=[`MAX_HISTOGRAM_WINDOW_MS`],
    /// 1..=[`MAX_HISTOGRAM_BUCKETS`]; outside them the script refuses the call). One
    /// script call: the counts are one consistent snapshot.
    pub async fn due_histogram(
        &self,
        topic: &Topic,
        window_ms: u64,
        buckets: usize,
    ) -> Result<DueHistogram, StoreError> {
        let call = Scripts::call(&self.exec.scripts().due_histogram, topic, &self.keys)
            .arg(window_ms)
            .arg(buckets);
        let mut reply = Reader::new("due_histogram", self.exec.run_one(call).await?)?;
        let now = reply.int("now")?;
        let due_now = count(&mut reply, "due_now")?;
        let later = count(&mut reply, "later")?;
        let mut counts = Vec::with_capacity(reply.remaining());
        while reply.remaining() > 0 {
            counts.push(count(&mut reply, "bucket count")?);
        }
        if counts.len() != buckets {
            return Err(StoreError::bad_reply(
                "due_histogram",
                format!("{} buckets for {buckets} asked", counts.len()),
            ));
        }
        Ok(DueHistogram {
            now,
            window_ms,
            due_now,
            counts,
            later,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bucket_edges_slice_the_window_as_the_script_does() {
        let histogram = DueHistogram {
            now: 1_000,
            window_ms: 10,
            due_now: 0,
            counts: vec![0; 3],
            later: 0,
        };
        // Lua: now + floor(10 * i / 3) for i = 1..3.
        assert_eq!(
            histogram.bucket_edges(),
            vec![(1_000, 1_003), (1_003, 1_006), (1_006, 1_010)]
        );
        let widest = DueHistogram {
            window_ms: MAX_HISTOGRAM_WINDOW_MS,
            counts: vec![0; MAX_HISTOGRAM_BUCKETS],
            ..histogram
        };
        let edges = widest.bucket_edges();
        assert_eq!(
            edges.last(),
            Some(&(
                1_000 + 999_000_000_000,
                1_000 + MAX_HISTOGRAM_WINDOW_MS as i64
            ))
        );
    }
}
