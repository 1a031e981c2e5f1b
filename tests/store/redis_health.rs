//! The bridge sees Redis eviction and Redis OOM, on private `redis-server`s: an evicting
//! `maxmemory-policy` stops it at start (or, when allowed, is warned about and shown);
//! `check` reports it; an ACL without `INFO`/`CONFIG` leaves it "unknown", said once;
//! a full Redis makes `/readyz` answer 503 `"redis":"oom"` (the metric agrees) until
//! memory is raised, and the commands that waited meanwhile are all applied.

use crate::common;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use common::bridge::{test_config, Broker};
use common::faults::{free_port, queue_depth, PrivateRedis, TempDir};
use lapin::types::AMQPValue;
use redisched::config::Config;
use redisched::job::{JobId, Topic};
use serde_json::Value;

const SECOND: Duration = Duration::from_secs(1);

/// A `redisched run` child logging to a file; killed on drop.
struct Bridge {
    child: Child,
    log: PathBuf,
}

impl Bridge {
    /// Starts `redisched run` with `config` plus `extra` env vars.
    fn start(config: &Config, extra: &[(&str, &str)], log: &Path) -> Self {
        let out = std::fs::File::create(log).expect("bridge log");
        let err = out.try_clone().expect("bridge log");
        let mut config = config.clone();
        config.log.level = "redisched=info,lapin=error".into();
        let child = Command::new(env!("CARGO_BIN_EXE_redisched"))
            .arg("run")
            .envs(config.to_env())
            .envs(extra.iter().copied())
            .stdout(Stdio::from(out))
            .stderr(Stdio::from(err))
            .spawn()
            .expect("spawn redisched run");
        Self {
            child,
            log: log.to_path_buf(),
        }
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// The exit status if it exits within `within`.
    fn exited_within(&mut self, within: Duration) -> Option<ExitStatus> {
        let deadline = Instant::now() + within;
        while Instant::now() < deadline {
            if let Some(status) = self.child.try_wait().expect("try_wait") {
                return Some(status);
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        None
    }
}

impl Drop for Bridge {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A config on `redis` with HTTP on a free port.
fn config_on(label: &str, redis: &PrivateRedis) -> Config {
    let mut config = test_config(label);
    config.redis.url = redis.url();
    config.redis.response_timeout_ms = 2_000;
    config.http.enabled = true;
    config.http.listen = format!("127.0.0.1:{}", free_port());
    config
}

fn config_set(redis: &PrivateRedis, key: &str, value: &str) {
    let _: () = redis::cmd("CONFIG")
        .arg("SET")
        .arg(key)
        .arg(value)
        .query(&mut redis.connection())
        .expect("CONFIG SET");
}

async fn get(url: &str) -> (u16, String) {
    let response = reqwest::get(url).await.expect("GET");
    let status = response.status().as_u16();
    (status, response.text().await.expect("body"))
}

async fn readyz(config: &Config) -> (u16, Value) {
    let (status, body) = get(&format!("http://{}/readyz", config.http.listen)).await;
    (status, serde_json::from_str(&body).expect("readyz JSON"))
}

async fn metrics(config: &Config) -> String {
    get(&format!("http://{}/metrics", config.http.listen))
        .await
        .1
}

/// The value of a metric line `name value`.
fn sample(text: &str, name: &str) -> Option<String> {
    text.lines()
        .find_map(|line| line.strip_prefix(&format!("{name} ")))
        .map(str::to_string)
}

/// Polls `/readyz` until `want(status, body)`; the last answer otherwise (panics).
async fn wait_readyz(
    config: &Config,
    bridge: &Bridge,
    want: impl Fn(u16, &Value) -> bool,
) -> Value {
    let deadline = Instant::now() + 30 * SECOND;
    let mut last = None;
    while Instant::now() < deadline {
        if let Ok(response) = reqwest::get(format!("http://{}/readyz", config.http.listen)).await {
            let status = response.status().as_u16();
            let body: Value = response.json().await.unwrap_or(Value::Null);
            if want(status, &body) {
                return body;
            }
            last = Some((status, body));
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    panic!(
        "readiness not as expected within 30 s; last: {last:?}\nbridge log:\n{}",
        bridge.log()
    );
}

/// `redisched check --json` against `config` (+ `extra` env): exit code and output.
fn check(config: &Config, extra: &[(&str, &str)]) -> (i32, String) {
    let output = Command::new(env!("CARGO_BIN_EXE_redisched"))
        .args(["check", "--json"])
        .envs(config.to_env())
        .envs(extra.iter().copied())
        .output()
        .expect("run redisched check");
    (
        output.status.code().unwrap_or(-1),
        format!(
            "{}{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        ),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_evicting_policy_stops_the_bridge_and_fails_check_naming_policy_and_key() {
    let redis = PrivateRedis::start();
    config_set(&redis, "maxmemory-policy", "allkeys-lru");
    let config = config_on("evict-refused", &redis);
    let dir = TempDir::new("evict-refused");
    let mut bridge = Bridge::start(&config, &[], &dir.path().join("bridge.log"));
    let status = bridge.exited_within(30 * SECOND);
    let log = bridge.log();
    let status = status.unwrap_or_else(|| panic!("the bridge kept running on allkeys-lru:\n{log}"));
    assert!(!status.success(), "exit {status}:\n{log}");
    assert!(
        log.contains("maxmemory-policy allkeys-lru") && log.contains("redis.allow_eviction"),
        "{log}"
    );

    // `check` fails like for any problem it cannot repair (exit 6) and says why.
    let (code, out) = check(&config, &[]);
    assert_eq!(code, 6, "{out}");
    assert!(
        out.contains("allkeys-lru") && out.contains("redis.allow_eviction"),
        "{out}"
    );

    // A volatile-* policy only evicts keys with a TTL; redisched sets none: sound.
    config_set(&redis, "maxmemory-policy", "volatile-lru");
    let (code, out) = check(&config, &[]);
    assert_eq!(code, 0, "{out}");
    let json: Value = serde_json::from_str(&out).expect("check --json");
    assert_eq!(json["redis"]["eviction_policy"], "volatile-lru", "{out}");
    assert_eq!(json["redis"]["eviction_policy_ok"], true, "{out}");
    let broker = Broker::new(&config).await;
    broker.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_allowed_evicting_policy_runs_warns_and_shows_in_metrics_readiness_and_check() {
    let redis = PrivateRedis::start();
    config_set(&redis, "maxmemory-policy", "allkeys-lru");
    let config = config_on("evict-allowed", &redis);
    let allow = [("REDISCHED_REDIS__ALLOW_EVICTION", "true")];
    let dir = TempDir::new("evict-allowed");
    let bridge = Bridge::start(&config, &allow, &dir.path().join("bridge.log"));
    let body = wait_readyz(&config, &bridge, |status, _| status == 200).await;
    assert_eq!(body["redis"], "ok", "{body}");
    assert_eq!(
        body["redis_health"]["eviction_policy"], "allkeys-lru",
        "{body}"
    );
    assert_eq!(body["redis_health"]["eviction_policy_ok"], false, "{body}");
    assert_eq!(body["redis_health"]["eviction_allowed"], true, "{body}");
    assert_eq!(body["redis_health"]["evicted_keys"], 0, "{body}");
    let text = metrics(&config).await;
    assert_eq!(
        sample(&text, "redisched_redis_eviction_policy_ok").as_deref(),
        Some("0"),
        "{text}"
    );
    assert_eq!(
        sample(&text, "redisched_redis_evicted_keys").as_deref(),
        Some("0"),
        "{text}"
    );
    let log = bridge.log();
    assert!(
        log.contains("WARN")
            && log.contains("EVICT")
            && log.contains("redis.allow_eviction = true"),
        "{log}"
    );

    // `check` with the same setting reports it and passes.
    let (code, out) = check(&config, &allow);
    assert_eq!(code, 0, "{out}");
    let json: Value = serde_json::from_str(&out).expect("check --json");
    assert_eq!(json["redis"]["eviction_policy"], "allkeys-lru", "{out}");
    assert_eq!(json["redis"]["eviction_allowed"], true, "{out}");
    drop(bridge);
    let broker = Broker::new(&config).await;
    broker.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_info_and_config_the_bridge_runs_and_says_unknown_once() {
    let redis = PrivateRedis::start();
    let _: () = redis::cmd("ACL")
        .arg("SETUSER")
        .arg("limited")
        .arg(&["on", ">secret", "~*", "&*", "+@all", "-info", "-config"])
        .query(&mut redis.connection())
        .expect("ACL SETUSER");
    let mut config = config_on("acl-unknown", &redis);
    config.redis.url = format!("redis://limited:secret@127.0.0.1:{}/0", redis.port);
    let dir = TempDir::new("acl-unknown");
    let bridge = Bridge::start(&config, &[], &dir.path().join("bridge.log"));
    let body = wait_readyz(&config, &bridge, |status, _| status == 200).await;
    assert_eq!(body["redis_health"]["eviction_policy"], "unknown", "{body}");
    assert_eq!(
        body["redis_health"]["eviction_policy_ok"],
        Value::Null,
        "{body}"
    );
    let reason = body["redis_health"]["unknown_reason"]
        .as_str()
        .unwrap_or_default();
    assert!(
        reason.contains("'info'") && reason.contains("no permissions"),
        "{body}"
    );
    // Every readiness check and scrape probes again; the log says it once.
    for _ in 0..5 {
        readyz(&config).await;
        let text = metrics(&config).await;
        assert_eq!(
            sample(&text, "redisched_redis_eviction_policy_ok").as_deref(),
            Some("-1"),
            "{text}"
        );
        assert_eq!(
            sample(&text, "redisched_redis_evicted_keys").as_deref(),
            Some("-1"),
            "{text}"
        );
    }
    let log = bridge.log();
    assert_eq!(
        log.matches("eviction policy and memory unknown").count(),
        1,
        "{log}"
    );
    let (code, out) = check(&config, &[]);
    assert_eq!(code, 0, "{out}");
    let json: Value = serde_json::from_str(&out).expect("check --json");
    assert_eq!(json["redis"]["eviction_policy"], "unknown", "{out}");
    drop(bridge);
    let broker = Broker::new(&config).await;
    broker.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_redis_makes_readiness_fail_and_its_waiting_commands_land_once_memory_is_raised() {
    let redis = PrivateRedis::start();
    let config = config_on("oom", &redis);
    let broker = Broker::new(&config).await;
    let dir = TempDir::new("oom");
    let bridge = Bridge::start(&config, &[], &dir.path().join("bridge.log"));
    wait_readyz(&config, &bridge, |status, _| status == 200).await;

    // Fill it: maxmemory a little above what it uses, then filler until Redis says OOM.
    let used: u64 = redis
        .info_field("memory", "used_memory")
        .and_then(|v| v.parse().ok())
        .expect("used_memory");
    config_set(&redis, "maxmemory", &(used + 2_000_000).to_string());
    let mut conn = redis.connection();
    let filler = vec![b'x'; 100_000];
    let mut full = false;
    for i in 0..1_000 {
        let set: redis::RedisResult<()> = redis::cmd("SET")
            .arg(format!("filler:{i}"))
            .arg(&filler)
            .query(&mut conn);
        if let Err(err) = set {
            assert_eq!(err.code(), Some("OOM"), "{err}");
            full = true;
            break;
        }
    }
    assert!(full, "Redis never ran out of memory");
    // Right at the limit, Redis takes a write again whenever a buffer is freed: squeeze
    // the limit 1 MB below what the data uses, so it stays full until raised.
    let used: u64 = redis
        .info_field("memory", "used_memory")
        .and_then(|v| v.parse().ok())
        .expect("used_memory");
    config_set(&redis, "maxmemory", &(used - 1_000_000).to_string());

    // Commands published now wait, unacked.
    let topic = "oom-topic";
    let ids: Vec<String> = (0..20).map(|i| format!("job-{i}")).collect();
    for id in &ids {
        broker
            .put(
                topic,
                id,
                b"body",
                &[("x-delay", AMQPValue::LongInt(3_600_000))],
            )
            .await;
    }
    let client = reqwest::Client::new();
    let put = client
        .put(format!(
            "http://{}/v1/topics/{topic}/jobs/http-1",
            config.http.listen
        ))
        .body("body")
        .send()
        .await
        .expect("PUT");
    assert_eq!(put.status().as_u16(), 503);

    let body = wait_readyz(&config, &bridge, |status, body| {
        status == 503 && body["redis"] == "oom"
    })
    .await;
    assert_eq!(body["ready"], false, "{body}");
    assert_eq!(body["redis_health"]["oom"], true, "{body}");
    assert!(
        body["error"]
            .as_str()
            .unwrap_or_default()
            .contains("out of memory"),
        "{body}"
    );
    // The metrics agree, every time (the flapping redis_up gauge is gone).
    for _ in 0..5 {
        let text = metrics(&config).await;
        assert_eq!(
            sample(&text, "redisched_redis_oom").as_deref(),
            Some("1"),
            "{text}"
        );
        assert_eq!(
            sample(&text, "redisched_redis_up").as_deref(),
            Some("1"),
            "{text}"
        );
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    assert!(
        bridge.log().contains("Redis refuses writes: out of memory"),
        "{}",
        bridge.log()
    );
    let store = redisched::store::Store::connect(&config.connect_options(), config.limits())
        .await
        .expect("store on the private redis");
    let topic_name = Topic::new(topic).expect("topic");
    for id in &ids {
        let job = store
            .get(&topic_name, &JobId::new(id.as_str()).expect("id"))
            .await
            .expect("get");
        assert!(job.is_none(), "{id} applied while Redis was full");
    }

    // Room again: ready again, and every command that waited is applied (0 lost).
    config_set(&redis, "maxmemory", "0");
    let body = wait_readyz(&config, &bridge, |status, _| status == 200).await;
    assert_eq!(body["redis"], "ok", "{body}");
    assert_eq!(body["redis_health"]["oom"], false, "{body}");
    let deadline = Instant::now() + 30 * SECOND;
    loop {
        let mut missing = Vec::new();
        for id in &ids {
            let id = JobId::new(id.as_str()).expect("id");
            if store.get(&topic_name, &id).await.expect("get").is_none() {
                missing.push(id.to_string());
            }
        }
        if missing.is_empty() {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "not applied after memory was raised: {missing:?}\n{}",
            bridge.log()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let depth = queue_depth(&broker.channel, &config.amqp.commands_queue).await;
    assert_eq!(depth, Some(0), "commands left in the queue");
    let text = metrics(&config).await;
    assert_eq!(
        sample(&text, "redisched_redis_oom").as_deref(),
        Some("0"),
        "{text}"
    );
    drop(bridge);
    broker.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_a_cluster_every_primary_is_checked() {
    let cluster = common::cluster::Cluster::start(3);
    let masters = cluster.masters();
    assert_eq!(masters.len(), 3, "{masters:?}");
    // One primary of three evicts: that is enough to lose the jobs of its topics.
    let odd = *masters.last().expect("a primary");
    let _: () = redis::cmd("CONFIG")
        .arg("SET")
        .arg("maxmemory-policy")
        .arg("allkeys-random")
        .query(
            &mut redis::Client::open(format!("redis://127.0.0.1:{odd}/"))
                .and_then(|c| c.get_connection())
                .expect("connect to a primary"),
        )
        .expect("CONFIG SET");
    let mut config = test_config("cluster-evict");
    config.redis.url = cluster.url();
    config.redis.response_timeout_ms = 2_000;
    let (code, out) = check(&config, &[]);
    assert_eq!(code, 6, "{out}");
    assert!(
        out.contains(&format!("allkeys-random on 127.0.0.1:{odd}")),
        "{out}"
    );
    let dir = TempDir::new("cluster-evict");
    let mut bridge = Bridge::start(&config, &[], &dir.path().join("bridge.log"));
    let status = bridge.exited_within(30 * SECOND);
    let log = bridge.log();
    let status = status.unwrap_or_else(|| panic!("the bridge kept running:\n{log}"));
    assert!(!status.success(), "{log}");
    assert!(
        log.contains(&format!("allkeys-random on 127.0.0.1:{odd}")),
        "{log}"
    );
    let broker = Broker::new(&config).await;
    broker.cleanup().await;
}
