//! One connection type for a standalone Redis and a Redis Cluster.
//!
//! Cluster mode is chosen by the URL scheme `redis-cluster://host:port[,host:port…]`
//! (seed nodes). Every script names all its keys in KEYS under one hash tag, so the
//! cluster client can route each call to the one node that owns the topic.

use std::time::Duration;

use super::ConnectOptions;
use redis::aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig};
use redis::cluster::ClusterClientBuilder;
use redis::cluster_async::ClusterConnection;
use redis::{Cmd, Pipeline, RedisFuture, RedisResult, Value};

pub(super) const CLUSTER_SCHEME: &str = "redis-cluster://";

#[derive(Clone)]
pub(super) enum Conn {
    Single(ConnectionManager),
    Cluster(ClusterConnection),
}

/// The seed node URLs of a `redis-cluster://` URL, or `None` for a standalone URL.
pub fn cluster_seeds(url: &str) -> Option<Vec<String>> {
    let rest = url.strip_prefix(CLUSTER_SCHEME)?;
    let (auth, hosts) = match rest.rsplit_once('@') {
        Some((auth, hosts)) => (format!("{auth}@"), hosts),
        None => (String::new(), rest),
    };
    let hosts = hosts.trim_end_matches('/');
    Some(
        hosts
            .split(',')
            .filter(|h| !h.is_empty())
            .map(|h| format!("redis://{auth}{h}"))
            .collect(),
    )
}

impl Conn {
    pub(super) async fn open(options: &ConnectOptions) -> RedisResult<Self> {
        let (connect_timeout, response_timeout) =
            (options.connect_timeout, options.response_timeout);
        if let Some(seeds) = cluster_seeds(&options.url) {
            let client = ClusterClientBuilder::new(seeds)
                .connection_timeout(connect_timeout)
                .response_timeout(response_timeout)
                .retries(2)
                .build()?;
            return Ok(Conn::Cluster(client.get_async_connection().await?));
        }
        let client = crate::tls::redis_client(&options.url, options.tls_ca_file.as_deref())?;
        let config = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(connect_timeout))
            .set_response_timeout(Some(response_timeout))
            .set_number_of_retries(1)
            .set_max_delay(Duration::from_secs(2));
        Ok(Conn::Single(
            ConnectionManager::new_with_config(client, config).await?,
        ))
    }
}

impl Conn {
    /// `cmd` on every primary: on a cluster a map of each primary's address to its reply
    /// (a refusal as [`Value::ServerError`]); on a standalone Redis its one reply.
    pub(super) async fn on_primaries(&mut self, cmd: &Cmd) -> RedisResult<Value> {
        use redis::cluster_routing::{MultipleNodeRoutingInfo, RoutingInfo};
        match self {
            Conn::Single(c) => cmd.query_async(c).await,
            Conn::Cluster(c) => {
                let every = RoutingInfo::MultiNode((MultipleNodeRoutingInfo::AllMasters, None));
                c.route_command(cmd.clone(), every).await
            }
        }
    }
}

impl ConnectionLike for Conn {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            Conn::Single(c) => c.req_packed_command(cmd),
            Conn::Cluster(c) => c.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match self {
            Conn::Single(c) => c.req_packed_commands(pipeline, offset, count),
            Conn::Cluster(c) => c.req_packed_commands(pipeline, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Conn::Single(c) => c.get_db(),
            Conn::Cluster(c) => c.get_db(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cluster_urls_list_their_seeds() {
        assert_eq!(cluster_seeds("redis://h:1/0"), None);
        assert_eq!(
            cluster_seeds("redis-cluster://:pw@a:7000,b:7001/"),
            Some(vec![
                "redis://:pw@a:7000".to_string(),
                "redis://:pw@b:7001".to_string()
            ])
        );
    }
}
