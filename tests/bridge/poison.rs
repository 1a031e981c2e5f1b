//! One command must never crash or stall the bridge's ingest: a header nested deeper than
//! the AMQP codec's recursion can take, and a message the client library cannot even
//! parse (a `message_id` that is not UTF-8), against a real `redisched run` process. The
//! commands are published with pika (lapin can send neither) and read back with it.

use crate::common;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::bridge::{test_config, Broker, ChildBridge};
use redisched::config::Config;
use redisched::job::{JobId, Topic};

const PIKA: &str = r#"
import sys, json, threading, pika
sys.setrecursionlimit(1_000_000)
threading.stack_size(1 << 29)

def deep(kind, depth):
    d = {'leaf': 'x'} if kind == 'table' else []
    for _ in range(depth):
        d = {'a': d} if kind == 'table' else [d]
    return d

def props(kind, depth, mid):
    return pika.BasicProperties(message_id=mid, headers={'x-delay': 3600000, 'x-deep': deep(kind, depth)})

def fits(kind, depth, mid):
    # One content header frame of at most frame_max (131072): 8 bytes of frame, 12 of
    # class, weight and body size, then the properties.
    return 8 + 12 + len(b''.join(props(kind, depth, mid).encode())) <= 131072

def deepest(kind, mid):
    lo, hi = 1, 40000
    while lo < hi:
        mid_depth = (lo + hi + 1) // 2
        lo, hi = (mid_depth, hi) if fits(kind, mid_depth, mid) else (lo, mid_depth - 1)
    return lo

def main():
    url, cmd = sys.argv[1], sys.argv[2]
    ch = pika.BlockingConnection(pika.URLParameters(url)).channel()
    out = {}
    if cmd == 'publish':
        exchange = sys.argv[3]
        ch.confirm_delivery()
        for spec in json.loads(sys.argv[4]):
            if spec['kind'] == 'raw-id':
                p = pika.BasicProperties(message_id=spec['id'].encode('latin-1'))
            elif spec['kind'] == 'plain':
                p = pika.BasicProperties(message_id=spec['id'])
            else:
                depth = spec['depth'] if spec['depth'] > 0 else deepest(spec['kind'], spec['id'])
                out[spec['id']] = depth
                p = props(spec['kind'], depth, spec['id'])
            ch.basic_publish(exchange, spec.get('topic', 'p'), b'body', p)
    else:
        reasons = []
        while True:
            method, p, body = ch.basic_get(sys.argv[3], auto_ack=True)
            if method is None:
                break
            h = p.headers or {}
            death = (h.get('x-death') or [{}])[0].get('reason')
            mid = p.message_id
            reasons.append({
                'id': mid.decode('latin-1') if isinstance(mid, bytes) else mid,
                'error': h.get('x-redisched-error') or '',
                'death': (death.decode() if isinstance(death, bytes) else death) or '',
                'body': body.decode('latin-1'),
                'deep': 'x-deep' in h,
            })
        out = reasons
    print(json.dumps(out))

t = threading.Thread(target=main)
t.start()
t.join()
"#;

/// Runs the pika helper; its JSON output.
fn pika(config: &Config, args: &[&str]) -> serde_json::Value {
    let has_pika = Command::new("python3")
        .args(["-c", "import pika"])
        .status()
        .is_ok_and(|s| s.success());
    assert!(
        has_pika,
        "python3 with pika is needed: pip install pika (scripts/test.sh does it)"
    );
    let out = Command::new("python3")
        .args(["-c", PIKA, &config.amqp.url])
        .args(args)
        .output()
        .expect("run python3");
    assert!(
        out.status.success(),
        "pika: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("pika output")
}

fn publish(config: &Config, specs: serde_json::Value) -> serde_json::Value {
    pika(
        config,
        &[
            "publish",
            &config.amqp.commands_exchange,
            &specs.to_string(),
        ],
    )
}

/// Everything in the invalid queue (read and removed), after waiting for `count`.
async fn invalid(config: &Config, count: usize, within: Duration) -> Vec<serde_json::Value> {
    let deadline = Instant::now() + within;
    let mut got = Vec::new();
    while got.len() < count && Instant::now() < deadline {
        if let serde_json::Value::Array(more) = pika(config, &["read", &config.amqp.invalid_queue])
        {
            got.extend(more);
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    got
}

/// Waits until every `ids` of topic `p` is in the store; how long it took.
async fn applied(config: &Config, ids: &[String], within: Duration) -> Option<Duration> {
    let store = common::test_store_named(&config.redis.prefix).await;
    let topic = Topic::new("p").unwrap();
    let started = Instant::now();
    while started.elapsed() < within {
        let mut all = true;
        for id in ids {
            let job = store.get(&topic, &JobId::new(id).unwrap()).await.unwrap();
            all &= job.is_some();
        }
        if all {
            return Some(started.elapsed());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    None
}

fn puts(prefix: &str, n: usize) -> (Vec<String>, Vec<serde_json::Value>) {
    let ids: Vec<String> = (0..n).map(|i| format!("{prefix}-{i}")).collect();
    let specs = ids
        .iter()
        .map(|id| serde_json::json!({"kind": "plain", "id": id}))
        .collect();
    (ids, specs)
}

fn alive(bridge: &mut ChildBridge, pid: u32) {
    assert_eq!(bridge.pid(), pid);
    assert!(
        matches!(bridge.child.try_wait(), Ok(None)),
        "the bridge process exited: {:?}",
        bridge.child.try_wait()
    );
}

fn bridge_config(label: &str) -> Config {
    let mut config = test_config(label);
    // Long delays: nothing is dispatched while the test looks at the store.
    config.dispatch.poll_interval_ms = 250;
    config
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "slow: bash scripts/test.sh runs it"]
async fn deeply_nested_headers_are_set_aside_and_the_bridge_stays_up() {
    let _shared = common::timed::shared().await;
    let config = bridge_config("deep");
    let broker = Broker::new(&config).await;
    let mut bridge = ChildBridge::start_logging(&config, Stdio::null(), Stdio::inherit());
    let pid = bridge.pid();
    let (warmup, warmup_specs) = puts("warm", 1);
    publish(&config, serde_json::Value::Array(warmup_specs));
    assert!(applied(&config, &warmup, Duration::from_secs(60))
        .await
        .is_some());

    let (ids, valid) = puts("after", 5);
    let mut specs = vec![
        serde_json::json!({"kind": "table", "id": "deep-2000", "depth": 2000}),
        serde_json::json!({"kind": "table", "id": "deepest-table", "depth": 0}),
        serde_json::json!({"kind": "array", "id": "deepest-array", "depth": 0}),
        serde_json::json!({"kind": "table", "id": "at-limit", "depth": 63}),
    ];
    specs.extend(valid);
    let depths = publish(&config, serde_json::Value::Array(specs));
    println!("published depths: {depths}");
    let took = applied(&config, &ids, Duration::from_secs(120)).await;
    assert!(
        took.is_some(),
        "the valid commands behind them were applied"
    );
    alive(&mut bridge, pid);
    // 63 nested tables under x-deep plus the leaf table: 64 levels, the limit itself.
    let at_limit = vec!["at-limit".to_string()];
    assert!(applied(&config, &at_limit, Duration::from_secs(5))
        .await
        .is_some());

    let aside = invalid(&config, 3, Duration::from_secs(60)).await;
    println!(
        "set aside: {:?}",
        aside
            .iter()
            .map(|m| (&m["id"], &m["error"], &m["death"]))
            .collect::<Vec<_>>()
    );
    let find = |id: &str| aside.iter().find(|m| m["id"] == id).cloned();
    let deep = find("deep-2000").expect("the 2,000-level command set aside");
    assert_eq!(deep["error"], "header x-deep nests deeper than 64 levels");
    assert_eq!(deep["body"], "body", "body intact");
    assert_eq!(deep["deep"], true, "headers intact");
    for id in ["deepest-table", "deepest-array"] {
        let msg = find(id).unwrap_or_else(|| panic!("{id} set aside: {aside:?}"));
        // Filling a whole frame, its copy with the reason added no longer fits in one:
        // the broker refuses the set-aside publish, and dead-letters the command itself
        // at the delivery limit.
        let reason = (msg["error"].as_str(), msg["death"].as_str());
        assert!(
            reason == (Some("header x-deep nests deeper than 64 levels"), Some(""))
                || reason == (Some(""), Some("delivery_limit")),
            "{id}: {reason:?}"
        );
    }
    alive(&mut bridge, pid);
    let (status, _) = bridge.terminate();
    assert!(status.success(), "{status:?}");
    broker.cleanup().await;
}

/// `ahead` valid commands are published before the unparseable one, 20 after it.
async fn non_utf8_message_id(label: &str, bridge_first: bool, partitions: u16, ahead: usize) {
    let mut config = bridge_config(label);
    config.amqp.command_partitions = partitions;
    let broker = Broker::new(&config).await;
    let mut bridge = None;
    if bridge_first {
        let child = ChildBridge::start_logging(&config, Stdio::null(), Stdio::inherit());
        let (warmup, warmup_specs) = puts("warm", 1);
        publish(&config, serde_json::Value::Array(warmup_specs));
        assert!(applied(&config, &warmup, Duration::from_secs(60))
            .await
            .is_some());
        bridge = Some(child);
    }
    let (mut ids, mut specs) = puts("ahead", ahead);
    specs.push(serde_json::json!({"kind": "raw-id", "id": "bad-\u{ff}\u{fe}-id"}));
    let (after, valid) = puts("after", 20);
    ids.extend(after);
    specs.extend(valid);
    publish(&config, serde_json::Value::Array(specs));
    let started = Instant::now();
    let mut bridge = bridge
        .unwrap_or_else(|| ChildBridge::start_logging(&config, Stdio::null(), Stdio::inherit()));
    let pid = bridge.pid();
    let took = applied(&config, &ids, Duration::from_secs(120)).await;
    assert!(took.is_some(), "all {} valid commands applied", ids.len());
    let aside = invalid(&config, 1, Duration::from_secs(60)).await;
    println!(
        "{label}: 20 valid applied after {:?}; the unparseable one set aside after {:?}: {aside:?}",
        took,
        started.elapsed()
    );
    assert_eq!(
        aside.len(),
        1,
        "only the unparseable one set aside: {aside:?}"
    );
    assert_eq!(aside[0]["id"], "bad-\u{ff}\u{fe}-id");
    assert_eq!(aside[0]["death"], "delivery_limit");
    alive(&mut bridge, pid);
    // Back at the normal prefetch, and still applying.
    let (more, more_specs) = puts("later", 3);
    publish(&config, serde_json::Value::Array(more_specs));
    assert!(applied(&config, &more, Duration::from_secs(30))
        .await
        .is_some());
    alive(&mut bridge, pid);
    let (status, _) = bridge.terminate();
    assert!(status.success(), "{status:?}");
    broker.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unparseable_command_sent_while_the_bridge_was_stopped_does_not_sink_the_ones_behind_it()
{
    let _shared = common::timed::shared().await;
    non_utf8_message_id("utf8stopped", false, 1, 0).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unparseable_command_sent_to_a_consuming_bridge_does_not_sink_the_ones_behind_it() {
    let _shared = common::timed::shared().await;
    non_utf8_message_id("utf8live", true, 1, 0).await;
}

/// Partitioned: such a message stops at the router (the route queue's consumer), which
/// isolates it the same way; what the router forwards, the lanes can parse.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unparseable_command_does_not_sink_the_ones_behind_it_at_the_router() {
    let _shared = common::timed::shared().await;
    non_utf8_message_id("utf8routed", false, 4, 0).await;
}

/// Valid commands ahead of the unparseable one in the same window: the session applying
/// them meets the connection's end inside the batch (the channel closed under the apply,
/// or the ack, or a set-aside), not at the next delivery. That end must isolate the message
/// too: ending as a plain lost connection reopened the full window each time, and every
/// valid command in it reached the delivery limit along with the unparseable one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unparseable_command_behind_valid_ones_in_one_window_does_not_sink_them() {
    let _shared = common::timed::shared().await;
    non_utf8_message_id("utf8ahead", false, 1, 300).await;
}
