//! `redisched run`: wires the stages together and owns the shutdown token.
//!
//! Redis-side tasks (the requeue sweep, the notification listener, the health probe, the
//! HTTP API) live for the whole process, and so does the loop of every sink beside AMQP
//! (the webhook targets, and a library user's own sinks given to [`run_with`]).
//! AMQP-side work (ingest and dispatch to the ready exchange) runs in *sessions*: one
//! connection each; when the broker goes away the session ends, and a new one is
//! opened with backoff, re-declaring the topology. Nothing is lost in between:
//! unacked commands are redelivered by the broker and unreleased jobs stay in Redis.

use std::sync::Arc;
use std::time::{Duration, Instant};

use lapin::Connection;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::amqp::{self, AmqpError};
use crate::config::Config;
use crate::dispatch::{self, Dispatcher, Plan, ServerClock, SetAside, Sink};
use crate::feed::Feed;
use crate::http::{self, AppState};
use crate::ingest::Ingest;
use crate::log_throttle::{self, LogThrottle};
use crate::metrics::{Metrics, Stage};
use crate::requeue;
use crate::store::{DueHints, Eviction, RedisHealth, Store, HEALTH_PROBE_INTERVAL};

#[derive(Debug, thiserror::Error)]
pub enum AppError {
    #[error("cannot listen for HTTP on {addr}: {source}")]
    Listen {
        addr: String,
        #[source]
        source: std::io::Error,
    },
    #[error("refusing to run: Redis may evict scheduled jobs under memory pressure (maxmemory-policy {policy}); set maxmemory-policy noeviction (or a volatile-* policy: redisched keys carry no TTL) on every Redis primary, or set redis.allow_eviction = true (REDISCHED_REDIS__ALLOW_EVICTION=true) to run anyway")]
    EvictingRedis { policy: String },
    #[error("webhook targets: {0}")]
    Targets(String),
}

/// Runs the bridge until `shutdown` is cancelled, then stops intake, drains in-flight
/// confirms (bounded by `dispatch.shutdown_grace_ms`) and returns.
///
/// The wiring in start order: the HTTP port, Redis, the HTTP API, the Redis-side
/// background tasks, then the stages (the loops of the sinks beside AMQP, and the AMQP
/// sessions of ingest and dispatch).
pub async fn run(config: Config, shutdown: CancellationToken) -> Result<(), AppError> {
    run_with(config, Vec::new(), shutdown).await
}

/// [`run`], with `sinks` of the caller's own beside AMQP and the webhook targets: each
/// gets the topics it serves that no target serves (`dispatch::routes`), and a loop of
/// its own for the whole process.
pub async fn run_with(
    config: Config,
    sinks: Vec<Arc<dyn Sink>>,
    shutdown: CancellationToken,
) -> Result<(), AppError> {
    let config = Arc::new(config);
    // The targets' state changes, published to `redisched.events` by a task of its own.
    let (events, changes) = crate::events::queue();
    let routes =
        Arc::new(dispatch::routes(&config, sinks, Some(events)).map_err(AppError::Targets)?);
    let metrics = Arc::new(Metrics::new());
    let feed = Feed::new();
    let hints = Arc::new(DueHints::new());
    // One view of Redis's health for every store of this process: readiness, metrics
    // and logs read it.
    let health = Arc::new(RedisHealth::new());
    health.set_allow_eviction(config.redis.allow_eviction);
    // Each sink beside AMQP is dispatched by a loop of its own, on a copy of the hints.
    let sink_hints: Vec<Arc<DueHints>> = routes.sinks().iter().map(|_| hints.tee()).collect();

    let listener = bind_http(&config).await?;
    let Some(store) = connect_store(&config, &health, &shutdown).await else {
        return Ok(());
    };
    check_eviction(&config, &store).await?;
    let tasks = TaskTracker::new();
    if let Some(listener) = listener {
        let Some(http_store) = writing_store(&config, &health, &shutdown, &store).await else {
            return Ok(());
        };
        let state = AppState {
            store: http_store,
            metrics: metrics.clone(),
            feed: feed.clone(),
            config: config.clone(),
        };
        let token = shutdown.clone();
        tasks.spawn(async move {
            if let Err(err) = http::serve(state, listener, token).await {
                tracing::error!(error = %err, "HTTP server stopped");
            }
        });
    }
    if !config.targets.is_empty() {
        let (amqp, shutdown) = (config.amqp.clone(), shutdown.clone());
        tasks.spawn(crate::events::publish_events(amqp, changes, shutdown));
    }
    let warnings = Arc::new(LogThrottle::default());
    spawn_background(
        &tasks, &store, &hints, &metrics, &warnings, &config, &shutdown,
    );
    tasks.close();
    let Some(ingest_store) = writing_store(&config, &health, &shutdown, &store).await else {
        return Ok(());
    };
    let ingest = Ingest {
        store: ingest_store,
        config: config.clone(),
        metrics: metrics.clone(),
        feed: feed.clone(),
        hints: hints.clone(),
        warnings: warnings.clone(),
        isolation: Default::default(),
    };
    let dispatcher = Dispatcher {
        store,
        config: config.clone(),
        metrics: metrics.clone(),
        feed,
        hints,
        clock: Arc::new(ServerClock::new()),
        warnings,
        routes,
        set_aside: Arc::new(SetAside::new(&config)),
    };
    for (index, hints) in sink_hints.into_iter().enumerate() {
        // It needs no broker: it runs for the whole process, beside the AMQP sessions.
        let beside = sharing(&dispatcher, hints);
        let shutdown = shutdown.clone();
        tasks.spawn(async move { beside.run_sink(index, shutdown).await });
    }
    run_sessions(ingest, dispatcher, &config, &metrics, &shutdown).await;
    tracing::info!("shutting down");
    let stop = crate::shutdown::BACKGROUND_TASKS;
    if tokio::time::timeout(stop, tasks.wait()).await.is_err() {
        tracing::warn!(timeout = ?stop, "background tasks did not stop in time");
    }
    Ok(())
}

/// Binds the HTTP port (if the API is enabled) before anything else: a port conflict is
/// a configuration error worth failing on at once.
async fn bind_http(config: &Config) -> Result<Option<tokio::net::TcpListener>, AppError> {
    if !config.http.enabled {
        return Ok(None);
    }
    let addr = config.http.listen.clone();
    tokio::net::TcpListener::bind(&addr)
        .await
        .map(Some)
        .map_err(|source| AppError::Listen { addr, source })
}

/// The Redis-side tasks that live for the whole process: the notification listener,
/// the requeue sweep, the log throttle's summaries and the health probe.
fn spawn_background(
    tasks: &TaskTracker,
    store: &Store,
    hints: &Arc<DueHints>,
    metrics: &Arc<Metrics>,
    warnings: &Arc<LogThrottle>,
    config: &Config,
    shutdown: &CancellationToken,
) {
    {
        let (store, hints, shutdown) = (store.clone(), hints.clone(), shutdown.clone());
        tasks.spawn(async move { store.follow_notifications(hints, shutdown).await });
    }
    tasks.spawn(requeue::run(
        store.clone(),
        metrics.clone(),
        Duration::from_millis(config.dispatch.requeue_interval_ms),
        shutdown.clone(),
    ));
    {
        let (warnings, shutdown) = (warnings.clone(), shutdown.clone());
        tasks.spawn(async move {
            let mut every = tokio::time::interval(log_throttle::WINDOW);
            while crate::shutdown::next_tick(&mut every, &shutdown).await {
                warnings.log_summaries();
            }
            warnings.log_remaining();
        });
    }
    {
        let (store, metrics, shutdown) = (store.clone(), metrics.clone(), shutdown.clone());
        tasks.spawn(async move { probe_health(store, metrics, shutdown).await });
    }
}

/// A dispatcher on `hints` that shares everything else with `base` (the loop of a sink
/// beside the AMQP one: same store, clock, routes and set-aside).
fn sharing(base: &Dispatcher, hints: Arc<DueHints>) -> Dispatcher {
    Dispatcher {
        store: base.store.clone(),
        config: base.config.clone(),
        metrics: base.metrics.clone(),
        feed: base.feed.clone(),
        hints,
        clock: base.clock.clone(),
        warnings: base.warnings.clone(),
        routes: base.routes.clone(),
        set_aside: base.set_aside.clone(),
    }
}

/// Runs ingest and dispatch over AMQP until shutdown.
async fn run_sessions(
    ingest: Ingest,
    dispatcher: Dispatcher,
    config: &Config,
    metrics: &Metrics,
    shutdown: &CancellationToken,
) {
    // Ingest and dispatch each get their own connection: a command the client library
    // cannot even parse (which drops the connection) must not interrupt deliveries,
    // and a blocked publisher must not stall intake.
    let (ingest, dispatcher) = (Arc::new(ingest), Arc::new(dispatcher));
    // Dispatch keeps its plan (when each topic is next due) across reconnects.
    let plan = Arc::new(tokio::sync::Mutex::new(Plan::default()));
    tokio::join!(
        supervise(
            Stage::Ingest,
            config,
            metrics,
            shutdown,
            move |connection, end| {
                let ingest = ingest.clone();
                Box::pin(async move { ingest.run(connection, end).await })
            },
        ),
        supervise(
            Stage::Dispatch,
            config,
            metrics,
            shutdown,
            move |connection, end| {
                let (dispatcher, plan) = (dispatcher.clone(), plan.clone());
                Box::pin(async move {
                    let mut plan = plan.lock().await;
                    dispatcher.run_session(&mut plan, connection, end).await
                })
            },
        ),
    );
}

/// Refuses to run on a Redis whose eviction policy may delete jobs, unless
/// `redis.allow_eviction` (then the probe warns). An unreadable policy (ACL) is said
/// once by the probe and is no reason to stop; nor is a failed probe (retried later).
async fn check_eviction(config: &Config, store: &Store) -> Result<(), AppError> {
    match store.probe_health().await {
        Ok(probe) => match probe.eviction() {
            Eviction::Evicting(policy) if !config.redis.allow_eviction => {
                Err(AppError::EvictingRedis { policy })
            }
            _ => Ok(()),
        },
        Err(err) => {
            tracing::warn!(error = %err, retry_in = ?HEALTH_PROBE_INTERVAL, "cannot read Redis's eviction policy and memory yet");
            Ok(())
        }
    }
}

/// Probes Redis's health every [`HEALTH_PROBE_INTERVAL`] (the store logs what changed)
/// and keeps the Redis gauges current.
async fn probe_health(store: Store, metrics: Arc<Metrics>, shutdown: CancellationToken) {
    let mut every = tokio::time::interval(HEALTH_PROBE_INTERVAL);
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    while crate::shutdown::next_tick(&mut every, &shutdown).await {
        let Some(probed) = crate::shutdown::unless_shutdown(&shutdown, store.probe_health()).await
        else {
            return;
        };
        if let Err(err) = probed {
            tracing::debug!(error = %err, "Redis health probe failed");
        }
        metrics.set_redis_health(&store.health().view());
    }
}

/// Waits for Redis (with backoff) instead of exiting: a bridge started before its
/// Redis, or during a Redis restart, must not crash-loop. `None` on shutdown.
async fn connect_store(
    config: &Config,
    health: &Arc<RedisHealth>,
    shutdown: &CancellationToken,
) -> Option<Store> {
    let mut backoff = Duration::from_millis(200);
    loop {
        match Store::connect(&config.connect_options(), config.limits()).await {
            Ok(store) => {
                // `validate()` compiled the policies at load: this cannot fail here.
                let store = store
                    .with_history_max(config.history.max_per_topic)
                    .with_health(health.clone())
                    .with_policies(config.compiled_policies().unwrap_or_default());
                tracing::info!(url = %crate::urls::redact_url(&config.redis.url), prefix = %config.redis.prefix, "connected to Redis");
                return Some(store);
            }
            Err(err) => {
                tracing::warn!(error = %err, retry_in = ?backoff, "cannot reach Redis yet");
            }
        }
        tokio::select! {
            _ = shutdown.cancelled() => return None,
            _ = tokio::time::sleep(backoff) => {}
        }
        backoff = (backoff * 2).min(Duration::from_secs(10));
    }
}

/// The store for a face that answers for its writes (ingest acks, the HTTP API replies):
/// `store` itself, or with `redis.wait_replicas` > 0 a store on a connection of its own
/// that waits for the replicas. A `WAIT` holds up every call behind it on its
/// connection, and dispatch must not queue behind one. `None` on shutdown.
async fn writing_store(
    config: &Config,
    health: &Arc<RedisHealth>,
    shutdown: &CancellationToken,
    store: &Store,
) -> Option<Store> {
    let Some(durability) = config.durability() else {
        return Some(store.clone());
    };
    let own = connect_store(config, health, shutdown).await?;
    Some(own.with_durability(Some(durability)))
}

/// One run of a stage over a connection, until the token ends it or the connection
/// fails.
type StageRun<'c> = futures_util::future::BoxFuture<'c, Result<(), AmqpError>>;

/// Runs one stage over AMQP until shutdown: opens a connection, declares the topology,
/// runs the stage (`run`, given the connection and a token that ends it), and when the connection or the stage fails, starts over with backoff.
async fn supervise(
    stage: Stage,
    config: &Config,
    metrics: &Metrics,
    shutdown: &CancellationToken,
    mut run: impl for<'c> FnMut(&'c Connection, CancellationToken) -> StageRun<'c>,
) {
    let min_backoff = Duration::from_millis(config.amqp.reconnect_min_ms);
    let mut backoff = min_backoff;
    // Counts sessions: each one starts with the next broker of `amqp.url` (if it lists
    // several), so after a node loss the first attempt goes to another node.
    let mut attempt = 0;
    while !shutdown.is_cancelled() {
        let started = Instant::now();
        let result = session(stage, config, metrics, shutdown, &mut run, attempt).await;
        attempt += 1;
        match result {
            Ok(()) => return,
            // A message the client cannot parse ended the session: the broker is fine, so
            // reconnect after the shortest pause, until the broker dead-letters the message
            // at the delivery limit. Without a delivery limit it is redelivered forever:
            // the usual backoff then spares the broker a reconnect loop.
            Err(err)
                if err.is_unparseable()
                    && config.amqp.quorum_queues
                    && config.amqp.delivery_limit > 0 =>
            {
                backoff = min_backoff;
                tracing::info!(stage = stage.name(), error = %err, retry_in = ?backoff, "AMQP session ended on a message the client cannot parse; reconnecting");
                tokio::select! {
                    _ = shutdown.cancelled() => return,
                    _ = tokio::time::sleep(backoff) => {}
                }
            }
            Err(err) => {
                if started.elapsed() > Duration::from_secs(30) {
                    backoff = min_backoff;
                }
                tracing::warn!(stage = stage.name(), error = %err, retry_in = ?backoff, "AMQP session ended; reconnecting");
                tokio::select! {
                    _ = shutdown.cancelled() => return,
                    _ = tokio::time::sleep(backoff) => {}
                }
                backoff = (backoff * 2).min(Duration::from_millis(config.amqp.reconnect_max_ms));
            }
        }
    }
}

/// How long a stage may go on once its connection is lost (`amqp::while_connected`).
const LOST_GRACE: Duration = Duration::from_secs(10);

/// One AMQP connection for one stage. Ends `Ok` only on shutdown.
async fn session(
    stage: Stage,
    config: &Config,
    metrics: &Metrics,
    shutdown: &CancellationToken,
    run: &mut impl for<'c> FnMut(&'c Connection, CancellationToken) -> StageRun<'c>,
    attempt: usize,
) -> Result<(), AmqpError> {
    let name = format!(
        "redisched {} {} pid {}",
        env!("CARGO_PKG_VERSION"),
        stage.name(),
        std::process::id()
    );
    // 20 s for each broker listed: `amqp::connect` tries them in turn.
    let brokers = crate::urls::amqp_urls(&config.amqp.url).len().max(1) as u32;
    let open = async {
        let (connection, url) = tokio::time::timeout(
            Duration::from_secs(20) * brokers,
            amqp::connect(&config.amqp, &name, attempt),
        )
        .await
        .map_err(|_| AmqpError::Timeout("connection attempt timed out after 20 s per broker"))??;
        let setup = connection.create_channel().await?;
        amqp::declare_topology(&setup, &config.amqp).await?;
        amqp::close_quietly(
            "setup channel",
            setup.close(200, "topology declared".into()),
        )
        .await;
        Ok::<_, AmqpError>((connection, url))
    };
    // A broker that accepts the TCP connection and then hangs must not hold up a
    // shutdown until the heartbeat timeout.
    let (connection, url) = tokio::select! {
        _ = shutdown.cancelled() => return Ok(()),
        opened = open => opened?,
    };
    metrics.set_stage_ready(stage, true);
    tracing::info!(stage = stage.name(), %url, "connected to AMQP; topology declared");
    let stop = shutdown.child_token();
    let result =
        amqp::while_connected(&connection, run(&connection, stop.clone()), LOST_GRACE).await;
    // Whatever the stage spawned and still runs on this connection ends with it.
    stop.cancel();
    metrics.set_stage_ready(stage, false);
    amqp::close_quietly("connection", connection.close(200, "bye".into())).await;
    result?;
    if shutdown.is_cancelled() {
        Ok(())
    } else {
        Err(AmqpError::Ended)
    }
}
