//! `lua/delete.lua`: a delete's call (one command of a batch, `apply.rs`) and what its
//! reply says.

use redis::Value;

use crate::job::{JobId, Topic};
use crate::store::call::Call;
use crate::store::scripts::Scripts;
use crate::store::{Store, StoreError};

impl Store {
    /// The delete's call on `keys` (the topic's full or fenced key list), `epoch` being
    /// the fencing argument (`""`: unfenced).
    pub(super) fn delete_call(
        &self,
        topic: &Topic,
        id: &JobId,
        keys: &[String],
        epoch: &str,
    ) -> Call {
        Scripts::call_with_keys(&self.exec.scripts().delete, topic, keys)
            .arg(id.as_str())
            .arg(self.history_max)
            .arg(epoch)
    }
}

/// Whether there was a job to remove.
pub(super) fn decode(value: Value) -> Result<bool, StoreError> {
    match value {
        Value::Int(n) => Ok(n == 1),
        other => Err(StoreError::bad_reply("delete", format!("{other:?}"))),
    }
}
