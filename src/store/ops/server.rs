//! The server itself: its clock (the one every due time refers to) and `PING`.

use crate::store::{Store, StoreError};

impl Store {
    /// The Redis server's clock, epoch ms: the one clock every due time refers to.
    pub async fn server_time(&self) -> Result<i64, StoreError> {
        let (secs, micros): (i64, i64) = self.exec.query(&redis::cmd("TIME")).await?;
        Ok(secs * 1000 + micros / 1000)
    }

    /// `PING`, for readiness checks.
    pub async fn ping(&self) -> Result<(), StoreError> {
        let _: String = self.exec.query(&redis::cmd("PING")).await?;
        Ok(())
    }
}
