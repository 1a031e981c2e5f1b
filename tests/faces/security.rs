//! Security: credentials never appear in logs or in `check-config`, and the bridge
//! runs as a least-privilege Redis ACL user (the list documented in the README), while
//! a command outside that list is refused.

use crate::common;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::bridge::{env_for, message_id, test_config, Broker, InProcess};
use common::{raw_redis, unique};

const SECOND: Duration = Duration::from_secs(1);

/// What the bridge (and `redisched check`) needs from Redis, besides its keys
/// (`~<prefix>:*`) and its channel (`&<prefix>:notify`). Everything else is refused.
/// Commands the Lua scripts call are checked against the ACL too, so they are listed.
/// `+info` lets the bridge see the eviction policy and memory (without it they read
/// "unknown": `tests/store/redis_health.rs`).
const BRIDGE_COMMANDS: &str = "-@all +ping +time +info +evalsha +script|load \
    +sadd +smembers +sscan +zrange +subscribe \
    +hget +hset +hsetnx +hdel +hexists +hlen +hscan +zadd +zrem +zscore +zrangebyscore \
    +zcard +zcount +zscan +zrank +incr +incrby +publish +type +dump +del +set +get \
    +lpush +ltrim +lrange +llen +hmget +pexpire +persist";

/// A Redis ACL user deleted on drop.
struct AclUser {
    name: String,
    password: String,
}

impl AclUser {
    fn create(prefix: &str) -> Self {
        let user = Self {
            name: unique("acl"),
            password: unique("pw-secret"),
        };
        let mut args: Vec<String> = vec![
            "SETUSER".into(),
            user.name.clone(),
            "reset".into(),
            "on".into(),
            format!(">{}", user.password),
            format!("~{prefix}:*"),
            format!("&{prefix}:notify"),
        ];
        args.extend(BRIDGE_COMMANDS.split_whitespace().map(String::from));
        let _: () = redis::cmd("ACL")
            .arg(&args)
            .query(&mut raw_redis())
            .expect("ACL SETUSER");
        user
    }

    fn url(&self) -> String {
        format!("redis://{}:{}@127.0.0.1:6379/0", self.name, self.password)
    }

    /// Entries of `ACL LOG` (denials) for this user.
    fn denials(&self) -> Vec<String> {
        let log: Vec<Vec<redis::Value>> = redis::cmd("ACL")
            .arg("LOG")
            .arg(128)
            .query(&mut raw_redis())
            .unwrap_or_default();
        log.into_iter()
            .map(|entry| format!("{entry:?}"))
            .filter(|e| e.contains(&self.name))
            .collect()
    }
}

impl Drop for AclUser {
    fn drop(&mut self) {
        let _: redis::RedisResult<()> = redis::cmd("ACL")
            .arg("DELUSER")
            .arg(&self.name)
            .query(&mut raw_redis());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_bridge_runs_as_a_least_privilege_redis_user() {
    if common::redis_url() != "redis://127.0.0.1:6379/0" {
        eprintln!("skipped: needs the default local Redis to create an ACL user");
        return;
    }
    let mut config = test_config("acl");
    config.dispatch.ttr_ms = 1_000;
    let user = AclUser::create(&config.redis.prefix);
    config.redis.url = user.url();
    let broker = Broker::new(&config).await;
    let mut ready = broker.consume_ready("#").await;
    let bridge = InProcess::start(&config);

    broker
        .put(
            "acl.t",
            "first",
            b"hello",
            &[("x-delay", lapin::types::AMQPValue::LongInt(300))],
        )
        .await;
    broker
        .put(
            "acl.t",
            "gone",
            b"x",
            &[("x-delay", lapin::types::AMQPValue::LongInt(60_000))],
        )
        .await;
    broker
        .put(
            "acl.t",
            "gone",
            b"",
            &[("x-redisched-op", common::bridge::text("delete"))],
        )
        .await;
    broker
        .put(
            "acl.u",
            "replaced",
            b"v2",
            &[("x-redisched-op", common::bridge::text("replace"))],
        )
        .await;
    let got = ready.collect(2, 20 * SECOND).await;
    let mut ids: Vec<String> = got.iter().map(|(_, d)| message_id(d)).collect();
    ids.sort();
    assert_eq!(
        ids,
        ["first", "replaced"],
        "put -> delivered as the restricted user"
    );

    // `redisched check` and `stats` as the same user.
    for args in [["check", "--repair"], ["stats", "--json"]] {
        let out = Command::new(env!("CARGO_BIN_EXE_redisched"))
            .args(args)
            .env("REDISCHED_REDIS__URL", user.url())
            .env("REDISCHED_REDIS__PREFIX", &config.redis.prefix)
            .output()
            .expect("run redisched");
        assert!(
            out.status.success(),
            "{args:?}: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    bridge.stop().await;
    assert!(
        user.denials().is_empty(),
        "the bridge needed more than the list: {:#?}",
        user.denials()
    );

    // Outside the list: refused (NOPERM), for commands and for other keys.
    let mut conn = redis::Client::open(user.url())
        .unwrap()
        .get_connection()
        .expect("connect as the user");
    for cmd in [
        redis::cmd("FLUSHALL"),
        redis::cmd("KEYS").arg("*").clone(),
        redis::cmd("CONFIG").arg("GET").arg("*").clone(),
    ] {
        let err = cmd.query::<redis::Value>(&mut conn).expect_err("refused");
        assert!(
            err.to_string().contains("NOPERM")
                || err.to_string().to_lowercase().contains("permission"),
            "{err}"
        );
    }
    let err = redis::cmd("HGET")
        .arg("someone-else:{x}:jobs")
        .arg("id")
        .query::<redis::Value>(&mut conn)
        .expect_err("other keys refused");
    assert!(
        err.to_string().contains("NOPERM") || err.to_string().contains("permission"),
        "{err}"
    );
    let err = redis::cmd("EVAL")
        .arg("return 1")
        .arg(0)
        .query::<redis::Value>(&mut conn)
        .expect_err("EVAL refused");
    assert!(
        err.to_string().contains("NOPERM") || err.to_string().contains("permission"),
        "{err}"
    );
    broker.cleanup().await;
}

/// Runs `redisched <args>` with `env` (and nothing else from REDISCHED_*), for at most
/// `run_for` (then SIGTERM), returning stdout + stderr.
fn run_binary(args: &[&str], env: &[(String, String)], run_for: Duration) -> String {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_redisched"));
    for (k, _) in std::env::vars() {
        if k.starts_with("REDISCHED_") || k == "RUST_LOG" {
            cmd.env_remove(k);
        }
    }
    let out_path = std::env::temp_dir().join(unique("sec-out"));
    let out = std::fs::File::create(&out_path).expect("output file");
    let err = out.try_clone().expect("output file");
    let mut child = cmd
        .args(args)
        .envs(env.iter().cloned())
        .stdin(Stdio::null())
        .stdout(out)
        .stderr(err)
        .spawn()
        .expect("spawn redisched");
    let deadline = Instant::now() + run_for;
    while Instant::now() < deadline {
        if let Ok(Some(_)) = child.try_wait() {
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    if let Ok(None) = child.try_wait() {
        let _ = Command::new("kill")
            .args(["-TERM", &child.id().to_string()])
            .status();
        let deadline = Instant::now() + 15 * SECOND;
        while matches!(child.try_wait(), Ok(None)) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(100));
        }
        let _ = child.kill();
        let _ = child.wait();
    }
    let text = std::fs::read_to_string(&out_path).unwrap_or_default();
    let _ = std::fs::remove_file(&out_path);
    text
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn passwords_never_appear_in_logs_or_check_config() {
    let config = test_config("redact");
    let user = AclUser::create(&config.redis.prefix);
    let amqp_password = unique("amqp-secret");
    let wrong_redis_password = unique("redis-wrong-secret");
    let amqp_url = format!("amqp://guest:{amqp_password}@127.0.0.1:5672/%2f");
    let with = |redis_url: &str| -> Vec<(String, String)> {
        let mut env = env_for(&config);
        env.retain(|(k, _)| k != "REDISCHED_LOG__LEVEL");
        env.push(("REDISCHED_REDIS__URL".into(), redis_url.into()));
        env.push(("REDISCHED_AMQP__URL".into(), amqp_url.clone()));
        env.push(("REDISCHED_LOG__FORMAT".into(), "json".into()));
        env.push(("REDISCHED_LOG__LEVEL".into(), "debug".into()));
        env.push(("REDISCHED_HTTP__TOKEN".into(), "http-token-secret".into()));
        env
    };
    let good = with(&user.url());
    let bad = with(&format!(
        "redis://{}:{wrong_redis_password}@127.0.0.1:6379/0",
        user.name
    ));
    let secrets = [
        user.password.as_str(),
        amqp_password.as_str(),
        wrong_redis_password.as_str(),
        "http-token-secret",
    ];

    let mut outputs = Vec::new();
    for args in [
        &["check-config"][..],
        &["check-config", "--json"],
        &["check-config", "--format", "json"],
    ] {
        let out = run_binary(args, &good, 10 * SECOND);
        assert!(out.contains("***"), "{args:?} masks: {out}");
        outputs.push((format!("{args:?}"), out));
    }
    // Redis accepts the user, the broker refuses the AMQP password: the bridge logs
    // its retries (with the URL) as JSON at debug level.
    outputs.push((
        "run (amqp auth fails)".into(),
        run_binary(&["run"], &good, 6 * SECOND),
    ));
    // Redis refuses the password.
    outputs.push((
        "run (redis auth fails)".into(),
        run_binary(&["run"], &bad, 6 * SECOND),
    ));
    outputs.push((
        "stats (redis auth fails)".into(),
        run_binary(&["stats"], &bad, 10 * SECOND),
    ));
    outputs.push((
        "check (redis auth fails)".into(),
        run_binary(&["check", "--json"], &bad, 10 * SECOND),
    ));

    for (what, out) in &outputs {
        for secret in secrets {
            assert!(!out.contains(secret), "{what} printed a secret:\n{out}");
        }
    }
    let run_log = &outputs[3].1;
    assert!(
        run_log.lines().any(|l| l.starts_with('{')),
        "JSON logs: {run_log}"
    );
    assert!(
        run_log.contains(&format!("{}:***@", user.name)),
        "the Redis URL is logged, masked: {run_log}"
    );
    common::delete_prefix(&config.redis.prefix);
}
