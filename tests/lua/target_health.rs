//! `lua/target_health.lua` raw, as any Redis client calls it: the transitions of
//! `redisched::targets::health::step` (open at the ratio, one probe claimed at a time,
//! a failed probe opens again, trips in a row disable, 410, enable), each change taken
//! once, and its errors.

use crate::common;

use redis::Value;
use redisched::store::SCRIPT_SOURCES;

fn call(keys: &[String; 2], args: &[&str]) -> redis::RedisResult<Value> {
    let source = SCRIPT_SOURCES
        .iter()
        .find(|(n, _)| *n == "target_health")
        .map(|(_, s)| *s)
        .expect("script exists");
    let script = redis::Script::new(source);
    let mut inv = script.prepare_invoke();
    inv.key(&keys[0]).key(&keys[1]);
    for a in args {
        inv.arg(*a);
    }
    inv.invoke(&mut common::raw_redis())
}

/// ratio 0.5, window 60 s, min 3 requests, open 200 ms, disabled at the 2nd trip.
fn op(keys: &[String; 2], args: &[&str]) -> (String, i64, Vec<String>) {
    let mut all = vec![args[0], "0.5", "60000", "3", "200", "2"];
    all.extend_from_slice(&args[1..]);
    let Value::Array(reply) = call(keys, &all).expect("script") else {
        panic!("an array");
    };
    let text = |v: &Value| match v {
        Value::BulkString(b) => String::from_utf8_lossy(b).into_owned(),
        Value::Int(n) => n.to_string(),
        other => format!("{other:?}"),
    };
    let claimed = match &reply[1] {
        Value::Int(n) => *n,
        _ => -1,
    };
    let events = match &reply[9] {
        Value::Array(e) => e.chunks(3).map(|c| text(&c[0])).collect(),
        _ => Vec::new(),
    };
    (text(&reply[0]), claimed, events)
}

fn keys() -> [String; 2] {
    let name = common::unique("th");
    [format!("{name}:health"), format!("{name}:events")]
}

fn cleanup(keys: &[String; 2]) {
    let _: () = redis::cmd("DEL")
        .arg(&keys[0])
        .arg(&keys[1])
        .query(&mut common::raw_redis())
        .expect("DEL");
}

#[test]
fn the_breaker_opens_probes_once_and_trips_in_a_row_disable() {
    let k = keys();
    assert_eq!(
        op(&k, &["sync", "1", "1", "0", ""]).0,
        "closed",
        "2 < min_requests"
    );
    let (state, _, events) = op(&k, &["sync", "0", "1", "0", ""]);
    assert_eq!((state.as_str(), events), ("open", vec!["open".to_owned()]));
    assert_eq!(
        op(&k, &["sync", "0", "0", "0", ""]).2,
        Vec::<String>::new(),
        "taken once"
    );
    std::thread::sleep(std::time::Duration::from_millis(250));
    // Two bridges ask: one claims the probe.
    let first = op(&k, &["sync", "0", "0", "5000", ""]);
    let second = op(&k, &["sync", "0", "0", "5000", ""]);
    assert_eq!((first.0.as_str(), first.1, second.1), ("half_open", 1, 0));
    assert_eq!(first.2, vec!["half_open".to_owned()]);
    let (state, _, events) = op(&k, &["probe", "fail", "", "", ""]);
    assert_eq!(
        (state.as_str(), events),
        ("disabled", vec!["disabled".to_owned()]),
        "2nd trip"
    );
    assert_eq!(
        op(&k, &["sync", "0", "9", "5000", ""]).0,
        "disabled",
        "stays"
    );
    // Enable by hand leaves its change for the next sync.
    let (state, _, events) = op(&k, &["enable", "", "", "", ""]);
    assert_eq!((state.as_str(), events.len()), ("closed", 0));
    assert_eq!(
        op(&k, &["sync", "0", "0", "0", ""]).2,
        vec!["enabled".to_owned()]
    );
    cleanup(&k);
}

#[test]
fn a_410_disables_and_a_good_probe_closes() {
    let k = keys();
    assert_eq!(
        op(&k, &["gone", "", "", "", "HTTP 410 Gone"]).2,
        vec!["disabled".to_owned()]
    );
    op(&k, &["enable", "", "", "", ""]);
    op(&k, &["sync", "0", "3", "0", ""]);
    std::thread::sleep(std::time::Duration::from_millis(250));
    assert_eq!(op(&k, &["sync", "0", "0", "5000", ""]).1, 1);
    let (state, _, events) = op(&k, &["probe", "ok", "", "", ""]);
    assert_eq!(state, "closed");
    assert_eq!(events, vec!["closed"], "the earlier syncs took theirs");
    cleanup(&k);
}

#[test]
fn bad_arguments_are_refused_by_name() {
    let k = keys();
    let err = |args: &[&str]| call(&k, args).unwrap_err().to_string();
    assert!(err(&["nap", "0.5", "1", "1", "1", "1"]).contains("op must be"));
    assert!(err(&["sync", "1.5", "1", "1", "1", "1"]).contains("failure_ratio"));
    assert!(err(&["sync", "0.5", "0", "1", "1", "1"]).contains("window_ms"));
    assert!(err(&["sync", "0.5", "1", "1", "1", "1", "-1", "0", "0"]).contains("successes"));
    assert!(err(&["probe", "0.5", "1", "1", "1", "1", "maybe"]).contains("probe outcome"));
    cleanup(&k);
}
