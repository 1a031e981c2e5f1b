//! `Store::targets_health` against a real Redis: every target's breaker read in one call,
//! as `lua/target_health.lua` wrote it (open, half_open, disabled, and closed for a
//! target no bridge has written), in the order of the targets; the same answer as one
//! `target_health` `get` per target; reading writes nothing and leaves the changes to
//! announce for the next sync; a damaged key is an error, not a closed target.

use crate::common;

use std::time::Duration;

use redis::Commands;
use redisched::store::{HealthOp, KeySpace, Store, TargetHealth};
use redisched::targets::health::State;
use redisched::targets::{BreakerConfig, TargetConfig};

/// Opens at 3 failures of 3; `open_ms` as given.
fn target(name: &str, open_ms: u64) -> TargetConfig {
    TargetConfig {
        name: name.into(),
        topics: vec![format!("{name}.#")],
        url: "http://127.0.0.1:9/hook".into(),
        breaker: BreakerConfig {
            failure_ratio: 0.5,
            window_ms: 60_000,
            min_requests: 3,
            open_ms,
            disable_after_trips: 100,
        },
        ..TargetConfig::default()
    }
}

async fn run(store: &Store, t: &TargetConfig, op: HealthOp) -> TargetHealth {
    store
        .target_health(&t.name, &t.breaker, op)
        .await
        .expect("target_health")
}

fn failures(n: u64) -> HealthOp {
    HealthOp::Sync {
        successes: 0,
        failures: n,
        lease_ms: 0,
        reason: String::new(),
    }
}

/// What a read shows of a target (not the server's `now`, nor the changes taken).
fn shown(h: &TargetHealth) -> (State, String, i64, u64, u64, u64) {
    (
        h.state,
        h.reason.clone(),
        h.changed_at,
        h.trips,
        h.requests,
        h.failures,
    )
}

#[tokio::test]
async fn every_targets_breaker_reads_back_in_one_call_as_the_script_wrote_it() {
    let store = common::test_store().await;
    let targets = [
        target("billing", 600_000),
        target("mail", 600_000),
        target("ledger", 1),
        target("quiet", 600_000),
    ];
    let [billing, mail, ledger, quiet] = &targets;
    assert_eq!(run(&store, billing, failures(3)).await.state, State::Open);
    assert_eq!(
        run(&store, mail, HealthOp::Disable).await.state,
        State::Disabled
    );
    run(&store, ledger, failures(3)).await;
    tokio::time::sleep(Duration::from_millis(10)).await;
    assert_eq!(
        run(&store, ledger, failures(0)).await.state,
        State::HalfOpen,
        "open_ms passed"
    );

    let health = store
        .targets_health(&targets)
        .await
        .expect("targets_health");
    let names: Vec<&str> = health.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names, ["billing", "mail", "ledger", "quiet"], "in order");
    let states: Vec<State> = health.iter().map(|(_, h)| h.state).collect();
    assert_eq!(
        states,
        [State::Open, State::Disabled, State::HalfOpen, State::Closed]
    );
    let (_, b) = &health[0];
    assert_eq!(
        (b.reason.as_str(), b.trips, b.requests, b.failures),
        ("3 of 3 requests failed in the window", 1, 3, 3)
    );
    assert!(b.changed_at > 0, "{b:?}");
    assert_eq!(health[1].1.reason, "disabled by hand");
    assert_eq!(
        health[2].1.reason,
        "open_ms passed: one probe request decides"
    );
    let (_, q) = &health[3];
    assert_eq!(
        shown(q),
        (State::Closed, String::new(), 0, 0, 0, 0),
        "never written: closed, no reason, never changed"
    );
    assert!(health
        .iter()
        .all(|(_, h)| h.changes.is_empty() && !h.claimed));

    // The same as one `get` per target.
    for (t, (_, read)) in targets.iter().zip(&health) {
        let one = run(&store, t, HealthOp::Get).await;
        assert_eq!(shown(&one), shown(read), "{}", t.name);
    }
    // A read writes nothing: the target never written still has no key.
    let [quiet_health, _] = KeySpace::new(store.prefix.clone()).target_health(&quiet.name);
    let exists: bool = common::raw_redis().exists(&quiet_health).expect("EXISTS");
    assert!(!exists, "{quiet_health} was created by a read");
}

#[tokio::test]
async fn a_read_leaves_the_changes_for_the_next_sync_to_announce() {
    let store = common::test_store().await;
    let targets = [target("billing", 600_000)];
    let [billing] = &targets;
    run(&store, billing, HealthOp::Disable).await;
    for _ in 0..2 {
        let health = store.targets_health(&targets).await.expect("read");
        assert_eq!(health[0].1.state, State::Disabled);
        assert!(health[0].1.changes.is_empty(), "a read takes no change");
    }
    let synced = run(&store, billing, failures(0)).await;
    let announced: Vec<&str> = synced.changes.iter().map(|c| c.to.as_str()).collect();
    assert_eq!(announced, ["disabled"], "still there for the sync");
    run(&store, billing, HealthOp::Enable).await;
    let health = store.targets_health(&targets).await.expect("read");
    assert_eq!(
        (health[0].1.state, health[0].1.reason.as_str()),
        (State::Closed, "enabled by hand")
    );
}

#[tokio::test]
async fn no_targets_read_nothing_and_a_damaged_key_is_an_error_not_closed() {
    let store = common::test_store().await;
    assert!(store.targets_health(&[]).await.expect("read").is_empty());
    let targets = [target("billing", 600_000), target("mail", 600_000)];
    let [mail_health, _] = KeySpace::new(store.prefix.clone()).target_health("mail");
    let _: () = common::raw_redis()
        .set(&mail_health, "not a hash")
        .expect("SET");
    let err = store
        .targets_health(&targets)
        .await
        .expect_err("a string where the hash should be");
    assert!(err.to_string().contains("wrong kind of value"), "{err}");
}
