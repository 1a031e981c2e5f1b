//! The admin API served in-process on a free port, as the REST tests use it.

use std::sync::Arc;
use std::time::Duration;

use redisched::config::Config;
use redisched::feed::Feed;
use redisched::http::{self, AppState};
use redisched::metrics::Metrics;
use redisched::store::Store;
use tokio_util::sync::CancellationToken;

/// A running API: its address, a client (10-s timeout), the state it serves, and what
/// stops it (cancel `shutdown`; `task` then ends).
pub struct Served {
    pub base: String,
    pub client: reqwest::Client,
    pub state: AppState,
    pub shutdown: CancellationToken,
    pub task: tokio::task::JoinHandle<std::io::Result<()>>,
}

/// Serves the API over `store` with `config` (fresh metrics and event feed).
pub async fn serve(store: Store, config: Config) -> Served {
    let state = AppState {
        store,
        metrics: Arc::new(Metrics::new()),
        feed: Feed::new(),
        config: Arc::new(config),
    };
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let base = format!("http://{}", listener.local_addr().expect("addr"));
    let shutdown = CancellationToken::new();
    let task = tokio::spawn(http::serve(state.clone(), listener, shutdown.clone()));
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(10))
        .build()
        .expect("client");
    Served {
        base,
        client,
        state,
        shutdown,
        task,
    }
}
