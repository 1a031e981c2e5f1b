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
        Ok(self.paused_value(topic).await?.is_some())
    }

    /// Since when a topic is paused, epoch ms on Redis's clock (what `lua/pause.lua`
    /// wrote); `None` while it runs, or if another client wrote something else there.
    pub async fn paused_at(&self, topic: &Topic) -> Result<Option<i64>, StoreError> {
        Ok(self
            .paused_value(topic)
            .await?
            .and_then(|at| at.parse().ok()))
    }

    async fn paused_value(&self, topic: &Topic) -> Result<Option<String>, StoreError> {
        let [.., paused, _, _] = self.keys.all(topic);
        // GET rather than EXISTS: the least-privilege ACL already allows it.
        self.exec.query(redis::cmd("GET").arg(paused)).await
    }
}
