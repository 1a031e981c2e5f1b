//! The bridge sees Redis eviction and Redis OOM, on private `redis-server`s: an evicting
//! `maxmemory-policy` stops it at start (or, when allowed, is warned about and shown);
//! `check` reports it; an ACL without `INFO`/`CONFIG` leaves it "unknown", said once;
//! a full Redis makes `/readyz` answer 503 `"redis":"oom"` (the metric agrees) until
//! memory is raised, and the commands that waited meanwhile are all applied; at the OOM
//! boundary readiness stays `oom` until `INFO memory` shows room (or, without `INFO`,
//! until a write as large as the refused one is taken); a user whose ACL lacks a command
//! the scripts need makes it answer 503 `"redis":"refused: NOPERM: …"` until it is fixed.

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

/// `SET`s 100 KB values on `redis` (as its default user) until Redis refuses one for
/// memory: the keys written. (While Redis decides, a value's own query buffer counts, so
/// smaller writes may still fit: see [`put_until_refused`].)
fn fill(redis: &PrivateRedis) -> Vec<String> {
    let mut conn = redis.connection();
    let filler = vec![b'x'; 100_000];
    let mut keys = Vec::new();
    for i in 0..1_000 {
        let key = format!("filler:{i}");
        let set: redis::RedisResult<()> = redis::cmd("SET").arg(&key).arg(&filler).query(&mut conn);
        match set {
            Ok(()) => keys.push(key),
            Err(err) => {
                assert_eq!(err.code(), Some("OOM"), "{err}");
                return keys;
            }
        }
    }
    panic!("Redis never ran out of memory");
}

/// `PUT`s 20 KB jobs through the bridge (ids `big-0000`, `big-0001`…) until Redis
/// refuses one for memory (503), as producers do until progress stalls.
async fn put_until_refused(config: &Config) {
    for n in 0..1_000 {
        match put_sized(config, &format!("big-{n:04}"), 20_000).await {
            201 => continue,
            503 => return,
            other => panic!("PUT answered {other}"),
        }
    }
    panic!("Redis never refused a put");
}

fn used_memory(redis: &PrivateRedis) -> u64 {
    redis
        .info_field("memory", "used_memory")
        .and_then(|v| v.parse().ok())
        .expect("used_memory")
}

/// `PUT`s a job of `body_bytes` due in an hour: the status.
async fn put_sized(config: &Config, id: &str, body_bytes: usize) -> u16 {
    reqwest::Client::new()
        .put(format!(
            "http://{}/v1/topics/oom-edge/jobs/{id}?delay_ms=3600000",
            config.http.listen
        ))
        .body(vec![b'b'; body_bytes])
        .send()
        .await
        .expect("PUT")
        .status()
        .as_u16()
}

/// `/readyz` answers 503 `"redis":"oom"` on every look for `during`; the last body.
async fn stays_oom(config: &Config, bridge: &Bridge, during: Duration) -> Value {
    let deadline = Instant::now() + during;
    loop {
        let (status, body) = readyz(config).await;
        assert!(
            status == 503 && body["redis"] == "oom",
            "readiness left oom at the boundary: {status} {body}\nbridge log:\n{}",
            bridge.log()
        );
        let text = metrics(config).await;
        assert_eq!(
            sample(&text, "redisched_redis_oom").as_deref(),
            Some("1"),
            "{text}"
        );
        if Instant::now() >= deadline {
            return body;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn at_the_oom_boundary_readiness_stays_oom_until_info_shows_room() {
    const MAX: u64 = 20 * 1024 * 1024;
    let redis = PrivateRedis::start();
    config_set(&redis, "maxmemory", "20mb");
    config_set(&redis, "maxmemory-policy", "noeviction");
    let config = config_on("oom-edge", &redis);
    let dir = TempDir::new("oom-edge");
    let bridge = Bridge::start(&config, &[], &dir.path().join("bridge.log"));
    wait_readyz(&config, &bridge, |status, _| status == 200).await;

    let mut keys = fill(&redis);
    put_until_refused(&config).await;

    // The boundary: free a little at a time until Redis takes a 20 KB put again.
    let mut accepted = false;
    for n in 0..20 {
        let key = keys.pop().expect("a filler key");
        let _: () = redis::cmd("DEL")
            .arg(&key)
            .query(&mut redis.connection())
            .expect("DEL");
        if put_sized(&config, &format!("edge-{n}"), 20_000).await == 201 {
            accepted = true;
            break;
        }
    }
    assert!(accepted, "Redis never took a write again");
    let used = used_memory(&redis);
    assert!(
        used * 100 > MAX * 90,
        "not at the boundary: {used} of {MAX}"
    );
    // Writes go through, but a few more and Redis is full again: still not ready.
    let body = stays_oom(&config, &bridge, 3 * SECOND).await;
    assert!(
        body["redis_health"]["oom_until"]
            .as_str()
            .is_some_and(|until| until.contains("INFO memory") && until.contains("90 %")),
        "{body}"
    );
    assert!(
        body["error"]
            .as_str()
            .unwrap_or_default()
            .contains("ready again when INFO memory shows"),
        "{body}"
    );

    // Real room (below 80 %): ready within a probe interval.
    while used_memory(&redis) * 100 > MAX * 80 {
        let key = keys.pop().expect("a filler key");
        let _: () = redis::cmd("DEL")
            .arg(&key)
            .query(&mut redis.connection())
            .expect("DEL");
    }
    let deadline = Instant::now() + redisched::store::HEALTH_PROBE_INTERVAL;
    loop {
        let text = metrics(&config).await;
        let (status, body) = readyz(&config).await;
        if status == 200 && sample(&text, "redisched_redis_oom").as_deref() == Some("0") {
            assert_eq!(body["redis"], "ok", "{body}");
            break;
        }
        assert!(
            Instant::now() < deadline,
            "not ready within a probe interval after room: {status} {body}\n{}",
            bridge.log()
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    let log = bridge.log();
    assert!(
        log.contains("Redis refuses writes: out of memory")
            && log
                .contains("Redis accepts writes again (INFO memory shows used_memory at most 90 %"),
        "{log}"
    );
    drop(bridge);
    Broker::new(&config).await.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_info_an_oom_lasts_until_a_write_as_large_as_the_refused_one_is_accepted() {
    let redis = PrivateRedis::start();
    config_set(&redis, "maxmemory", "20mb");
    let _: () = redis::cmd("ACL")
        .arg("SETUSER")
        .arg("noinfo")
        .arg(&["on", ">secret", "~*", "&*", "+@all", "-info", "-config"])
        .query(&mut redis.connection())
        .expect("ACL SETUSER");
    let mut config = config_on("oom-noinfo", &redis);
    config.redis.url = format!("redis://noinfo:secret@127.0.0.1:{}/0", redis.port);
    let dir = TempDir::new("oom-noinfo");
    let bridge = Bridge::start(&config, &[], &dir.path().join("bridge.log"));
    wait_readyz(&config, &bridge, |status, _| status == 200).await;

    let mut keys = fill(&redis);
    put_until_refused(&config).await;
    wait_readyz(&config, &bridge, |status, body| {
        status == 503 && body["redis"] == "oom"
    })
    .await;

    // Room for a small write: it is taken, but proves nothing about the refused one.
    for _ in 0..3 {
        let key = keys.pop().expect("a filler key");
        let _: () = redis::cmd("DEL")
            .arg(&key)
            .query(&mut redis.connection())
            .expect("DEL");
    }
    assert_eq!(put_sized(&config, "small", 100).await, 201);
    let body = stays_oom(&config, &bridge, 2 * SECOND).await;
    let until = body["redis_health"]["oom_until"]
        .as_str()
        .unwrap_or_default();
    assert!(
        until.contains("a write of at least") && until.contains("INFO memory is not readable"),
        "{body}"
    );

    // A write as large as the refused one (same id length, same body) is taken: ready.
    assert_eq!(put_sized(&config, "big-9999", 20_000).await, 201);
    let body = wait_readyz(&config, &bridge, |status, _| status == 200).await;
    assert_eq!(body["redis"], "ok", "{body}");
    assert!(
        bridge
            .log()
            .contains("Redis accepts writes again (a write of at least"),
        "{}",
        bridge.log()
    );
    drop(bridge);
    Broker::new(&config).await.cleanup().await;
}

/// README's least-privilege list before the rate limiter needed `+hmget +pexpire
/// +persist`: `reserve.lua` runs `HMGET`, so every reserve is refused.
const OLDER_ACL: &str = "-@all +ping +time +info +evalsha +script|load \
    +sadd +smembers +sscan +zrange +subscribe \
    +hget +hset +hsetnx +hdel +hexists +hlen +hscan +zadd +zrem +zscore +zrangebyscore \
    +zcard +zcount +zscan +zrank +incr +incrby +publish +type +dump +del +set +get \
    +lpush +ltrim +lrange +llen";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_user_without_a_command_the_scripts_need_is_not_ready_until_the_acl_is_fixed() {
    let redis = PrivateRedis::start();
    let mut config = config_on("acl-denied", &redis);
    let mut args: Vec<String> = ["SETUSER", "bridge", "reset", "on", ">secret"]
        .map(String::from)
        .to_vec();
    args.push(format!("~{}:*", config.redis.prefix));
    args.push(format!("&{}:notify", config.redis.prefix));
    args.extend(OLDER_ACL.split_whitespace().map(String::from));
    let _: () = redis::cmd("ACL")
        .arg(&args)
        .query(&mut redis.connection())
        .expect("ACL SETUSER");
    config.redis.url = format!("redis://bridge:secret@127.0.0.1:{}/0", redis.port);
    let broker = Broker::new(&config).await;
    let mut ready = broker.consume_ready("#").await;
    let dir = TempDir::new("acl-denied");
    let bridge = Bridge::start(&config, &[], &dir.path().join("bridge.log"));
    // Before anything is due, nothing is refused.
    wait_readyz(&config, &bridge, |status, _| status == 200).await;

    let put = reqwest::Client::new()
        .put(format!(
            "http://{}/v1/topics/acl.t/jobs/due-now",
            config.http.listen
        ))
        .body("hello")
        .send()
        .await
        .expect("PUT");
    assert_eq!(put.status().as_u16(), 201);
    let body = wait_readyz(&config, &bridge, |status, _| status == 503).await;
    let redis_status = body["redis"].as_str().unwrap_or_default();
    assert!(
        redis_status.starts_with("refused: NOPERM: reserve.lua on topic \"acl.t\""),
        "{body}"
    );
    assert!(
        body["error"].as_str().unwrap_or_default().contains("ACL"),
        "{body}"
    );
    // The gauge and the log agree, on every look while it lasts.
    for _ in 0..4 {
        let text = metrics(&config).await;
        assert_eq!(
            sample(&text, "redisched_redis_acl_denied").as_deref(),
            Some("1"),
            "{text}"
        );
        assert_eq!(
            sample(&text, "redisched_redis_up").as_deref(),
            Some("1"),
            "{text}"
        );
        let (status, body) = readyz(&config).await;
        assert_eq!(status, 503, "{body}");
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let log = bridge.log();
    // Once per refused call (reserve, and the rate limiter's check before it), while
    // the bridge retries every tick.
    let said: Vec<&str> = log
        .lines()
        .filter(|line| line.contains("Redis refuses a call for lack of permission"))
        .collect();
    assert_eq!(
        said.iter()
            .filter(|line| line.contains("call=reserve.lua on topic \"acl.t\""))
            .count(),
        1,
        "said once:\n{log}"
    );
    assert!(said.iter().all(|line| line.contains("ERROR")), "{said:#?}");
    assert!(
        ready.next(Duration::from_millis(200)).await.is_none(),
        "delivered while refused"
    );

    // Fixed: ready within a probe interval, and the job is delivered.
    let _: () = redis::cmd("ACL")
        .arg(&["SETUSER", "bridge", "+hmget", "+pexpire", "+persist"])
        .query(&mut redis.connection())
        .expect("ACL SETUSER");
    // Scraped as Prometheus does: the scrape's own calls (the topic's stats and rate
    // limit) run again too.
    let deadline = Instant::now() + redisched::store::HEALTH_PROBE_INTERVAL;
    loop {
        metrics(&config).await;
        let (status, body) = readyz(&config).await;
        if status == 200 {
            assert_eq!(body["redis"], "ok", "{body}");
            break;
        }
        assert!(
            Instant::now() < deadline,
            "still not ready a probe interval after the fix: {body}\n{}",
            bridge.log()
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    let text = metrics(&config).await;
    assert_eq!(
        sample(&text, "redisched_redis_acl_denied").as_deref(),
        Some("0"),
        "{text}"
    );
    let delivered = ready.next(20 * SECOND).await;
    assert!(
        delivered.is_some(),
        "not delivered after the fix:\n{}",
        bridge.log()
    );
    assert!(
        bridge.log().contains("Redis runs this call again"),
        "{}",
        bridge.log()
    );
    drop(bridge);
    broker.cleanup().await;
}
