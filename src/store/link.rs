//! The Redis connection shared by every clone of a [`super::Store`], replaced when it
//! stops answering.
//!
//! `ConnectionManager` reconnects when a call reports the connection as broken (reset,
//! EOF), but a response timeout is not such an error. On a half-open connection (the
//! peer vanished without FIN or RST: a dead host, a NAT or firewall that dropped the
//! flow, a paused VM) every later call would time out on the same dead socket, forever:
//! ingest, dispatch and the requeue sweep all stalled while Redis itself was fine
//! (found by `tests/faults/bridge_faults.rs`, network test, "Redis connections frozen"). So after a
//! timeout this link opens a new connection in the background and swaps it in; the
//! dead one is dropped once the calls still using it have finished.

use std::future::Future;
use std::sync::{Arc, Mutex, MutexGuard};

use futures_util::future::BoxFuture;
use redis::aio::ConnectionLike;
use redis::{Cmd, Pipeline, RedisFuture, RedisResult, Value};

type Opener<C> = Arc<dyn Fn() -> BoxFuture<'static, RedisResult<C>> + Send + Sync>;

pub(crate) struct Link<C> {
    slot: Arc<Mutex<Slot<C>>>,
    open: Opener<C>,
}

struct Slot<C> {
    conn: C,
    /// Bumped at each replacement, so that many calls timing out on the same dead
    /// connection replace it once, not once each.
    generation: u64,
    reopening: bool,
}

impl<C> Clone for Link<C> {
    fn clone(&self) -> Self {
        Self {
            slot: self.slot.clone(),
            open: self.open.clone(),
        }
    }
}

impl<C> Link<C>
where
    C: ConnectionLike + Clone + Send + Sync + 'static,
{
    /// Opens the first connection with `open`, which is called again for each
    /// replacement.
    pub(crate) async fn open<F, Fut>(open: F) -> RedisResult<Self>
    where
        F: Fn() -> Fut + Send + Sync + 'static,
        Fut: Future<Output = RedisResult<C>> + Send + 'static,
    {
        let open: Opener<C> = Arc::new(move || Box::pin(open()));
        let conn = open().await?;
        Ok(Self {
            slot: Arc::new(Mutex::new(Slot {
                conn,
                generation: 0,
                reopening: false,
            })),
            open,
        })
    }

    fn lock(&self) -> MutexGuard<'_, Slot<C>> {
        // A poisoned lock still holds a usable connection.
        self.slot.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The connection in use now (for calls the `ConnectionLike` interface cannot
    /// express, such as a cluster command routed to every primary).
    pub(crate) fn current(&self) -> C {
        self.lock().conn.clone()
    }

    fn snapshot(&self) -> (u64, C) {
        let slot = self.lock();
        (slot.generation, slot.conn.clone())
    }

    /// Looks at the outcome of a call made on connection `generation`.
    fn after<T>(&self, generation: u64, result: &RedisResult<T>) {
        let Err(err) = result else { return };
        if !err.is_timeout() {
            return;
        }
        {
            let mut slot = self.lock();
            if slot.generation != generation || slot.reopening {
                return;
            }
            slot.reopening = true;
        }
        tracing::warn!("a Redis call timed out; opening a new connection in case this one is dead");
        let (slot, open) = (self.slot.clone(), self.open.clone());
        // Opening waits for the connect timeout at most; calls meanwhile keep using
        // the old connection (it may merely be slow).
        tokio::spawn(async move {
            let opened = open().await;
            let mut slot = slot.lock().unwrap_or_else(|e| e.into_inner());
            slot.reopening = false;
            match opened {
                Ok(conn) if slot.generation == generation => {
                    slot.conn = conn;
                    slot.generation += 1;
                }
                Ok(_) => {}
                Err(err) => {
                    tracing::warn!(error = %err, "cannot open a new Redis connection yet; the next timeout retries")
                }
            }
        });
    }
}

impl<C> ConnectionLike for Link<C>
where
    C: ConnectionLike + Clone + Send + Sync + 'static,
{
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        Box::pin(async move {
            let (generation, mut conn) = self.snapshot();
            let result = conn.req_packed_command(cmd).await;
            self.after(generation, &result);
            result
        })
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        Box::pin(async move {
            let (generation, mut conn) = self.snapshot();
            let result = conn.req_packed_commands(pipeline, offset, count).await;
            self.after(generation, &result);
            result
        })
    }

    fn get_db(&self) -> i64 {
        self.lock().conn.get_db()
    }
}
