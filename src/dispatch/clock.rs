//! The Redis server's clock, as seen from this process: every due time refers to it,
//! so sleeping "until a job is due" must too, whatever the local clock says.

use std::sync::Mutex;
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
        if let Ok(mut reading) = self.reading.lock() {
            *reading = (server_ms, Instant::now());
        }
    }

    /// The server's clock now, estimated, epoch ms.
    pub fn now(&self) -> i64 {
        self.reading
            .lock()
            .map(|r| r.0 + r.1.elapsed().as_millis() as i64)
            .unwrap_or(0)
    }
}

impl Default for ServerClock {
    fn default() -> Self {
        Self::new()
    }
}
