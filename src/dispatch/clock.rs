//! The Redis server's clock, as seen from this process: every due time refers to it,
//! so sleeping "until a job is due" must too, whatever the local clock says.

use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::Instant;

#[derive(Debug)]
pub struct ServerClock {
    /// A server reading (epoch ms) and the local instant it arrived.
    reading: Mutex<(i64, Instant)>,
}

impl ServerClock {
    /// Starts from the local clock until the first server reading arrives.
    pub fn new() -> Self {
        let local_ms = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_millis() as i64)
            .unwrap_or(0);
        Self {
            reading: Mutex::new((local_ms, Instant::now())),
        }
    }

    /// A reading taken by the server before we got it, so `now()` can only lag the
    /// server by the reply's transit time: we may wake a hair late, never early.
    pub fn observe(&self, server_ms: i64) {
        *self.reading() = (server_ms, Instant::now());
    }

    /// The server's clock now, estimated, epoch ms.
    pub fn now(&self) -> i64 {
        let (server_ms, at) = *self.reading();
        server_ms + at.elapsed().as_millis() as i64
    }

    /// The reading, also after a thread panicked while holding the lock: the pair is
    /// always whole (it is written in one assignment), so the last reading stands. (A
    /// poisoned lock once made `now()` answer 0, the epoch: every due time "in the
    /// future", a silent dispatch stall.)
    fn reading(&self) -> MutexGuard<'_, (i64, Instant)> {
        self.reading.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl Default for ServerClock {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_poisoned_lock_keeps_the_last_reading() {
        let clock = std::sync::Arc::new(ServerClock::new());
        clock.observe(1_000_000);
        let held = clock.clone();
        let panicked = std::thread::spawn(move || {
            let _guard = held.reading.lock();
            panic!("poison the clock's lock");
        })
        .join();
        assert!(panicked.is_err(), "the thread panicked holding the lock");
        assert!(clock.reading.is_poisoned());
        let now = clock.now();
        assert!((1_000_000..1_010_000).contains(&now), "{now}");
        clock.observe(2_000_000);
        assert!(clock.now() >= 2_000_000);
    }
}
