//! `lua/pause.lua` and `lua/resume.lua`: a paused topic has nothing reserved or pulled
//! until it is resumed.

use redis::Value;

use crate::job::Topic;
use crate::store::scripts::Scripts;
use crate::store::{Store, StoreError};

impl Store {
    /// Pauses a topic (jobs or not): nothing of it is reserved or pulled until
    /// [`Store::resume`]; `false` if it was paused already. Registers the topic, so a
    /// topic paused before its first job is listed. See `lua/pause.lua`.
    pub async fn pause(&self, topic: &Topic) -> Result<bool, StoreError> {
        self.register_now(&[topic]).await?;
        let call = Scripts::call(&self.exec.scripts().pause, topic, &self.keys);
        Ok(self.exec.run_one(call).await? == Value::Int(1))
    }

    /// Resumes a paused topic and wakes the dispatchers (Pub/Sub on the notify channel);
    /// `false` if it was not paused. See `lua/resume.lua`.
    pub async fn resume(&self, topic: &Topic) -> Result<bool, StoreError> {
        let call = Scripts::call(&self.exec.scripts().resume, topic, &self.keys)
            .arg(self.keys.notify_channel());
        Ok(self.exec.run_one(call).await? == Value::Int(1))
    }

    pub async fn is_paused(&self, topic: &Topic) -> Result<bool, StoreError> {
        let [.., paused, _, _] = self.keys.all(topic);
        // GET rather than EXISTS: the least-privilege ACL already allows it.
        let since: Option<String> = self.exec.query(redis::cmd("GET").arg(paused)).await?;
        Ok(since.is_some())
    }
}
