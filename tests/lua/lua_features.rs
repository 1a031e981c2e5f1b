//! The scheduler features of the Lua store layer and its format versioning
//!, driven straight through EVALSHA with the sources of `lua/`, as any
//! other client would: recurring series, pause/resume, failing and parked jobs,
//! redrive, the capped history, format-1 and format-2 fixtures, and the rolling-upgrade
//! behaviour of the previous release's scripts (`tests/fixtures/lua_v1/`).

use crate::common;

use std::collections::HashMap;
use std::time::Duration;

use redis::{Commands, Value};
use redisched::store::{RejectCode, StoreError};

// ------------------------------------------------------------------ harness

const SCRIPTS: [(&str, &str); 16] = [
    ("put", include_str!("../../lua/put.lua")),
    ("delete", include_str!("../../lua/delete.lua")),
    ("reserve", include_str!("../../lua/reserve.lua")),
    ("pull", include_str!("../../lua/pull.lua")),
    ("release", include_str!("../../lua/release.lua")),
    ("retry", include_str!("../../lua/retry.lua")),
    ("requeue", include_str!("../../lua/requeue.lua")),
    ("get", include_str!("../../lua/get.lua")),
    ("stats", include_str!("../../lua/stats.lua")),
    ("list", include_str!("../../lua/list.lua")),
    ("check", include_str!("../../lua/check.lua")),
    ("pause", include_str!("../../lua/pause.lua")),
    ("resume", include_str!("../../lua/resume.lua")),
    ("redrive", include_str!("../../lua/redrive.lua")),
    (
        "redrive_window",
        include_str!("../../lua/redrive_window.lua"),
    ),
    ("history", include_str!("../../lua/history.lua")),
];

/// The scripts of the release before format 2, as a bridge not yet upgraded runs them.
const V1_SCRIPTS: [(&str, &str); 6] = [
    ("put", include_str!("../fixtures/lua_v1/put.lua")),
    ("reserve", include_str!("../fixtures/lua_v1/reserve.lua")),
    ("release", include_str!("../fixtures/lua_v1/release.lua")),
    ("retry", include_str!("../fixtures/lua_v1/retry.lua")),
    ("get", include_str!("../fixtures/lua_v1/get.lua")),
    ("check", include_str!("../fixtures/lua_v1/check.lua")),
];

const SHARED: &str = include_str!("../../lua/shared.lua");
const PARKED: i64 = 100_000_000_000_000_000;

fn source(table: &[(&str, &'static str)], name: &str) -> &'static str {
    table
        .iter()
        .find(|(n, _)| *n == name)
        .map(|(_, s)| *s)
        .unwrap_or_else(|| panic!("no script {name}"))
}

/// One topic under a private prefix; every key of the prefix is deleted on drop.
struct Topic {
    prefix: String,
    name: String,
    conn: redis::Connection,
}

impl Drop for Topic {
    fn drop(&mut self) {
        common::delete_prefix(&self.prefix);
    }
}

impl Topic {
    fn new(name: &str) -> Self {
        Self::under(common::unique("luaf"), name)
    }

    fn under(prefix: String, name: &str) -> Self {
        Self {
            prefix,
            name: name.to_string(),
            conn: common::raw_redis(),
        }
    }

    fn key(&self, kind: &str) -> String {
        format!("{}:{{{}}}:{kind}", self.prefix, self.name)
    }

    /// The full key list of lua/README.md, in order.
    fn keys(&self) -> Vec<String> {
        common::topic_keys(&self.prefix, &self.name, common::FULL_KEY_NAMES)
    }

    /// The four keys of the version-1 contract.
    fn keys4(&self) -> Vec<String> {
        self.keys()[..4].to_vec()
    }

    fn channel(&self) -> String {
        format!("{}:notify", self.prefix)
    }

    fn run_with(
        &mut self,
        table: &[(&str, &'static str)],
        name: &str,
        keys: &[String],
        args: &[&[u8]],
    ) -> Result<Value, StoreError> {
        let script = redis::Script::new(source(table, name));
        let mut inv = script.prepare_invoke();
        for key in keys {
            inv.key(key);
        }
        for arg in args {
            inv.arg(*arg);
        }
        inv.invoke::<Value>(&mut self.conn)
            .map_err(StoreError::from)
    }

    /// Runs a script of `lua/` with the full key list.
    fn run(&mut self, name: &str, args: &[&str]) -> Value {
        let keys = self.keys();
        let args: Vec<&[u8]> = args.iter().map(|a| a.as_bytes()).collect();
        self.run_with(&SCRIPTS, name, &keys, &args)
            .unwrap_or_else(|e| panic!("{name} {args:?}: {e}"))
    }

    fn refused(&mut self, name: &str, keys: &[String], args: &[&str]) -> String {
        let args: Vec<&[u8]> = args.iter().map(|a| a.as_bytes()).collect();
        match self.run_with(&SCRIPTS, name, keys, &args) {
            Err(StoreError::Rejected(r)) => {
                assert_eq!(r.code, RejectCode::InvalidArgument, "{name} {args:?}: {r}");
                assert!(
                    !r.message.contains("user_script"),
                    "a clean message: {}",
                    r.message
                );
                r.message
            }
            other => panic!("{name} {args:?}: expected INVALID_ARGUMENT, got {other:?}"),
        }
    }

    fn put(&mut self, id: &str, body: &str, when_ms: i64, spec: &str) -> i64 {
        let when = when_ms.to_string();
        let reply = self.run(
            "put",
            &[
                id,
                body,
                "",
                "nx",
                "at",
                &when,
                "31622400000",
                "1048576",
                "",
                spec,
            ],
        );
        let reply = arr(&reply);
        assert_eq!(text(&reply[0]), "scheduled", "{reply:?}");
        int(&reply[1])
    }

    fn now(&mut self) -> i64 {
        let (s, us): (i64, i64) = redis::cmd("TIME").query(&mut self.conn).unwrap();
        s * 1000 + us / 1000
    }

    /// reserve.lua with the full key list: (next_due, jobs, paused).
    fn reserve(&mut self, limit: usize) -> (i64, Vec<Job>, i64) {
        let reply = self.run("reserve", &["60000", &limit.to_string()]);
        let reply = arr(&reply);
        assert!(arr(&reply[3]).is_empty(), "no corrupt ids: {reply:?}");
        (
            int(&reply[1]),
            arr(&reply[2]).iter().map(Job::from).collect(),
            int(&reply[4]),
        )
    }

    fn record(&mut self, id: &str) -> Option<Vec<u8>> {
        let key = self.key("jobs");
        self.conn.hget(key, id).unwrap()
    }

    fn score(&mut self, set: &str, id: &str) -> Option<i64> {
        let key = self.key(set);
        let score: Option<f64> = self.conn.zscore(key, id).unwrap();
        score.map(|s| s as i64)
    }

    fn get(&mut self, id: &str) -> HashMap<&'static str, Value> {
        let reply = self.run("get", &[id]);
        let fields = [
            "state",
            "due_at",
            "attempts",
            "token",
            "deadline",
            "meta",
            "body",
            "spec",
            "failures",
            "last_error",
            "last_error_at",
        ];
        let values = arr(&reply);
        assert_eq!(values.len(), fields.len(), "{reply:?}");
        fields.into_iter().zip(values.iter().cloned()).collect()
    }

    fn stats(&mut self) -> HashMap<&'static str, i64> {
        let reply = self.run("stats", &[]);
        let fields = [
            "now",
            "scheduled",
            "due_now",
            "reserved",
            "expired",
            "records",
            "parked",
            "paused",
            "failing",
            "history",
        ];
        fields
            .into_iter()
            .zip(arr(&reply).iter().map(int))
            .collect()
    }

    /// history.lua: (outcome, id, attempts, due_at, detail), newest first.
    fn history(&mut self, limit: usize, id: &str) -> Vec<(String, String, i64, i64, String)> {
        let reply = self.run("history", &[&limit.to_string(), id]);
        arr(&reply)
            .iter()
            .map(|e| {
                let e = arr(e);
                (
                    text(&e[1]),
                    text(&e[2]),
                    int(&e[3]),
                    int(&e[4]),
                    text(&e[5]),
                )
            })
            .collect()
    }

    /// check.lua over the whole topic: (kind, id, repaired) of every problem.
    fn check(&mut self, mode: &str, keys: &[String]) -> Vec<(String, String, i64)> {
        let mut cursor = "0".to_string();
        let mut problems = Vec::new();
        loop {
            let args: [&[u8]; 3] = [mode.as_bytes(), cursor.as_bytes(), b"1000"];
            let reply = self.run_with(&SCRIPTS, "check", keys, &args).unwrap();
            let reply = arr(&reply);
            for p in arr(&reply[2]) {
                let p = arr(p);
                problems.push((text(&p[0]), text(&p[1]), int(&p[2])));
            }
            cursor = text(&reply[0]);
            if cursor == "0" {
                return problems;
            }
        }
    }

    fn assert_sound(&mut self) {
        let keys = self.keys();
        let problems = self.check("report", &keys);
        assert!(problems.is_empty(), "store not sound: {problems:?}");
    }
}

#[derive(Debug, Clone)]
struct Job {
    id: String,
    due_at: i64,
    attempt: i64,
    token: i64,
    body: String,
    spec: String,
}

impl From<&Value> for Job {
    fn from(value: &Value) -> Self {
        let v = arr(value);
        assert_eq!(v.len(), 7, "reserve job entry: {v:?}");
        Job {
            id: text(&v[0]),
            due_at: int(&v[1]),
            attempt: int(&v[2]),
            token: int(&v[3]),
            body: text(&v[5]),
            spec: text(&v[6]),
        }
    }
}

fn arr(value: &Value) -> &Vec<Value> {
    match value {
        Value::Array(items) => items,
        other => panic!("expected an array, got {other:?}"),
    }
}

fn int(value: &Value) -> i64 {
    match value {
        Value::Int(n) => *n,
        other => panic!("expected an integer, got {other:?}"),
    }
}

fn text(value: &Value) -> String {
    match value {
        Value::BulkString(b) => String::from_utf8(b.clone()).expect("utf-8"),
        Value::SimpleString(s) => s.clone(),
        other => panic!("expected a string, got {other:?}"),
    }
}

fn lease(job: &Job, next_due: Option<i64>) -> String {
    match next_due {
        Some(next) => format!("{}@{next}", job.token),
        None => job.token.to_string(),
    }
}

// ------------------------------------------------------------ hygiene (12.7)

#[test]
fn every_script_carries_the_shared_helpers_verbatim() {
    let block_start = SHARED.lines().next().expect("shared.lua has a first line");
    // Every script the store loads, so a new one cannot be forgotten here.
    for &(name, src) in redisched::store::SCRIPT_SOURCES {
        let start = src
            .find(block_start)
            .unwrap_or_else(|| panic!("{name}.lua lacks the shared block"));
        let end = src[start..]
            .find("-- <<< shared <<<\n")
            .unwrap_or_else(|| panic!("{name}.lua: shared block not closed"))
            + start
            + "-- <<< shared <<<\n".len();
        assert_eq!(
            &src[start..end],
            SHARED,
            "{name}.lua: shared block differs from lua/shared.lua; run lua/sync-shared.sh"
        );
    }
}

#[test]
fn every_header_names_keys_argv_reply_and_every_error() {
    for (name, src) in SCRIPTS {
        let header = &src[..src.find("]]").expect("header comment")];
        for part in ["KEYS", "ARGV", "Reply", "Errors:"] {
            assert!(header.contains(part), "{name}.lua header lacks {part}");
        }
        let errors = &header[header.find("Errors:").unwrap()..];
        assert!(
            errors.contains("INVALID_ARGUMENT"),
            "{name}.lua: Errors must list INVALID_ARGUMENT"
        );
        // Every code the body can return is listed in the header.
        let body = &src[src.find("]]").unwrap()..];
        for code in ["BODY_TOO_LARGE", "DELAY_TOO_LONG", "CORRUPT_RECORD"] {
            if body.contains(&format!("'{code}")) {
                assert!(errors.contains(code), "{name}.lua returns {code}");
            }
        }
    }
}

// ---------------------------------------------------------------- formats (13.3)

#[test]
fn a_one_shot_job_keeps_the_format_1_bytes() {
    let mut t = Topic::new("fmt.one");
    let now = t.now();
    let due = t.put("a", "body", now + 60_000, "");
    assert_eq!(
        t.record("a").unwrap(),
        format!("1|{due}|0|0|0|body").into_bytes()
    );
    // The four-key (version-1) call writes the same bytes.
    let keys4 = t.keys4();
    let args: Vec<&[u8]> = vec![
        b"b", b"xyz", b"mm", b"nx", b"at", b"0", b"1000000", b"100", b"",
    ];
    t.run_with(&SCRIPTS, "put", &keys4, &args).unwrap();
    let rec = t.record("b").unwrap();
    assert!(rec.starts_with(b"1|") && rec.ends_with(b"|0|0|2|mmxyz"));
    // A reservation keeps format 1.
    let (_, jobs, _) = t.reserve(10);
    assert_eq!(jobs.len(), 1);
    let rec = String::from_utf8(t.record("b").unwrap()).unwrap();
    assert!(
        rec.starts_with(&format!("1|{}|1|{}|2|", jobs[0].due_at, jobs[0].token)),
        "{rec}"
    );
}

#[test]
fn a_format_1_fixture_is_read_dispatched_deleted_and_checked() {
    let mut t = Topic::new("fmt.v1");
    let now = t.now();
    let past = now - 5_000;
    // Written raw, exactly as the release before format 2 stored them.
    let (jobs, scheduled, reserved) = (t.key("jobs"), t.key("scheduled"), t.key("reserved"));
    let records = [
        ("due", format!("1|{past}|0|0|4|metabody-1")),
        ("later", format!("1|{}|2|7|0|body-2", now + 60_000)),
        ("gone", format!("1|{past}|0|0|0|body-3")),
        ("held", format!("1|{past}|1|9|0|body-4")),
    ];
    for (id, rec) in &records {
        let _: () = t.conn.hset(&jobs, id, rec).unwrap();
    }
    let _: () = t.conn.zadd(&scheduled, "due", past).unwrap();
    let _: () = t.conn.zadd(&scheduled, "later", now + 60_000).unwrap();
    let _: () = t.conn.zadd(&scheduled, "gone", past).unwrap();
    let _: () = t.conn.zadd(&reserved, "held", now + 60_000).unwrap();
    t.assert_sound();

    let got = t.get("later");
    assert_eq!(text(&got["state"]), "scheduled");
    assert_eq!(int(&got["attempts"]), 2);
    assert_eq!(int(&got["token"]), 7);
    assert_eq!(text(&got["spec"]), "");
    assert_eq!(int(&got["failures"]), 0);
    assert_eq!(int(&got["last_error_at"]), -1);
    let got = t.get("held");
    assert_eq!(text(&got["state"]), "reserved");

    // Deleted by the new delete, logged.
    assert_eq!(int(&t.run("delete", &["gone"])), 1);
    // Dispatched: reserved (meta and body split as format 1 says), released by token.
    let (_, taken, _) = t.reserve(10);
    assert_eq!(taken.len(), 1, "{taken:?}");
    assert_eq!(
        (taken[0].id.as_str(), taken[0].body.as_str()),
        ("due", "body-1")
    );
    assert_eq!(taken[0].attempt, 1);
    let reply = t.run("reserve", &["60000", "10"]);
    assert!(arr(&arr(&reply)[2]).is_empty());
    let l = lease(&taken[0], None);
    assert_eq!(int(&t.run("release", &["due", &l])), 1);
    // The reserved fixture is released with its stored token.
    assert_eq!(int(&t.run("release", &["held", "9"])), 1);
    assert!(t.record("due").is_none() && t.record("held").is_none());
    let outcomes: Vec<(String, String)> = t
        .history(10, "")
        .into_iter()
        .map(|(o, id, ..)| (o, id))
        .collect();
    assert_eq!(
        outcomes,
        [
            ("dispatched".to_string(), "held".to_string()),
            ("dispatched".into(), "due".into()),
            ("deleted".into(), "gone".into()),
        ]
    );
    t.assert_sound();
    let stats = t.stats();
    assert_eq!((stats["records"], stats["scheduled"]), (1, 1));
}

#[test]
fn a_format_2_fixture_is_read_reserved_listed_and_checked() {
    let mut t = Topic::new("fmt.v2");
    let now = t.now();
    let past = now - 1_000;
    let spec = "cron:0 9 * * MON-FRI|Europe/Berlin";
    let err = "unroutable: NO_ROUTE";
    // due|attempts|token|failures|error_at|spec len|error len|meta len|spec error meta body
    let rec = format!(
        "2|{past}|1|4|1|{}|{}|{}|2|{spec}{err}mmthe body",
        now - 500,
        spec.len(),
        err.len()
    );
    let (jobs, scheduled, failing) = (t.key("jobs"), t.key("scheduled"), t.key("failing"));
    let _: () = t.conn.hset(&jobs, "series", &rec).unwrap();
    let _: () = t.conn.zadd(&scheduled, "series", past).unwrap();
    let _: () = t.conn.zadd(&failing, "series", now - 500).unwrap();
    t.assert_sound();

    let got = t.get("series");
    assert_eq!(text(&got["spec"]), spec);
    assert_eq!(text(&got["last_error"]), err);
    assert_eq!(int(&got["last_error_at"]), now - 500);
    assert_eq!(int(&got["failures"]), 1);
    assert_eq!(text(&got["meta"]), "mm");
    assert_eq!(text(&got["body"]), "the body");
    let listed = t.run("list", &["10", "0", "scheduled", "1"]);
    let entry = arr(&arr(&listed)[0]);
    assert_eq!(text(&entry[4]), spec);
    assert_eq!(text(&entry[6]), err);
    assert_eq!(t.stats()["failing"], 1);

    let (_, taken, _) = t.reserve(10);
    assert_eq!(taken.len(), 1);
    assert_eq!(
        (
            taken[0].attempt,
            taken[0].spec.as_str(),
            taken[0].body.as_str()
        ),
        (2, spec, "the body")
    );
    // The record stays format 2 with everything but attempts and token kept.
    let after = String::from_utf8(t.record("series").unwrap()).unwrap();
    assert_eq!(
        after,
        rec.replacen("|1|4|1|", &format!("|2|{}|1|", taken[0].token), 1)
    );
    t.assert_sound();
}

// ---------------------------------------------------------- recurring series

#[test]
fn a_recurring_release_is_token_fenced_and_reschedules_with_attempts_reset() {
    let mut t = Topic::new("series");
    let now = t.now();
    let spec = "every:60000";
    t.put("s", "tick", now - 10, spec);
    let rec = String::from_utf8(t.record("s").unwrap()).unwrap();
    assert!(rec.starts_with("2|"), "a series needs format 2: {rec}");

    // First reservation fails (recorded), the second is delivered.
    let (_, first, _) = t.reserve(10);
    assert_eq!(first[0].spec, spec);
    assert_eq!(
        int(&t.run("retry", &["s", &first[0].token.to_string(), "0", "nack"])),
        1
    );
    let (_, second, _) = t.reserve(10);
    let occ = &second[0];
    assert_eq!(occ.attempt, 2);
    let next = t.now() + 60_000;

    // A stale token does nothing, with or without a next due time.
    let stale = lease(&first[0], Some(next));
    assert_eq!(int(&t.run("release", &["s", &stale])), 0);
    assert_eq!(int(&t.run("release", &["s", "999"])), 0);
    assert!(t.score("reserved", "s").is_some());

    // The current token without a next due time is refused, and changes nothing, not
    // even the other job of the batch.
    t.put("one", "x", now - 10, "");
    let (_, more, _) = t.reserve(10);
    let one = more.iter().find(|j| j.id == "one").unwrap().clone();
    let l_one = lease(&one, None);
    let l_bare = lease(occ, None);
    let all = t.keys();
    let msg = t.refused("release", &all, &["one", &l_one, "s", &l_bare]);
    assert!(msg.contains("recurring"), "{msg}");
    let l_back = lease(occ, Some(occ.due_at));
    let msg = t.refused("release", &all, &["s", &l_back]);
    assert!(msg.contains("not later"), "{msg}");
    assert!(t.score("reserved", "one").is_some() && t.score("reserved", "s").is_some());

    // One batch: the one-shot job is deleted, the series moves on atomically.
    let l_next = lease(occ, Some(next));
    assert_eq!(int(&t.run("release", &["one", &l_one, "s", &l_next])), 2);
    assert!(t.record("one").is_none());
    assert_eq!(t.score("scheduled", "s"), Some(next));
    assert_eq!(t.score("reserved", "s"), None);
    let got = t.get("s");
    assert_eq!(text(&got["state"]), "scheduled");
    assert_eq!(int(&got["due_at"]), next);
    assert_eq!(int(&got["attempts"]), 0, "attempts reset per occurrence");
    assert_eq!(int(&got["failures"]), 0);
    assert_eq!(text(&got["last_error"]), "");
    assert_eq!(text(&got["spec"]), spec);
    assert_eq!(
        t.stats()["failing"],
        0,
        "a delivered occurrence is no longer failing"
    );

    // The same lease again (a duplicate confirm, a second bridge) does not double it.
    assert_eq!(int(&t.run("release", &["s", &l_next])), 0);
    assert_eq!(t.score("scheduled", "s"), Some(next));
    let h = t.history(10, "s");
    assert_eq!(h.len(), 1, "{h:?}");
    assert_eq!(h[0].0, "dispatched");
    assert_eq!((h[0].2, h[0].3), (2, occ.due_at));
    assert_eq!(h[0].4, next.to_string(), "detail names the next occurrence");
    t.assert_sound();
}

#[test]
fn an_interval_series_is_driven_for_several_occurrences_never_early() {
    let mut t = Topic::new("series.drive");
    let every = 150;
    let first = t.now() + every;
    t.put("beat", "b", first, &format!("every:{every}"));
    let mut seen = Vec::new();
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while seen.len() < 4 && std::time::Instant::now() < deadline {
        let (_, jobs, _) = t.reserve(10);
        for job in jobs {
            let now = t.now();
            assert!(now >= job.due_at, "never early: {now} < {}", job.due_at);
            // The coalescing rule: the first occurrence strictly after the server's now.
            let mut next = job.due_at + every;
            while next <= now {
                next += every;
            }
            let l = lease(&job, Some(next));
            assert_eq!(int(&t.run("release", &["beat", &l])), 1);
            seen.push(job.due_at);
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(seen.len(), 4, "{seen:?}");
    for pair in seen.windows(2) {
        assert_eq!((pair[1] - pair[0]) % every, 0, "{seen:?}");
        assert!(pair[1] > pair[0]);
    }
    assert_eq!(seen[0], first);
    assert_eq!(t.stats()["records"], 1, "exactly one chain");
}

#[test]
fn replace_changes_a_series_put_answers_duplicate_and_delete_ends_it() {
    let mut t = Topic::new("series.edit");
    let now = t.now();
    let due = t.put("s", "v1", now + 1_000, "every:1000");
    let reply = t.run(
        "put",
        &[
            "s", "other", "", "nx", "delay", "0", "1000000", "100", "", "every:5",
        ],
    );
    assert_eq!(text(&arr(&reply)[0]), "duplicate");
    assert_eq!(int(&arr(&reply)[1]), due);
    assert_eq!(text(&t.get("s")["body"]), "v1");

    let spec = "cron:0 9 * * *|Europe/Berlin";
    let reply = t.run(
        "put",
        &[
            "s", "v2", "", "replace", "delay", "5000", "1000000", "100", "", spec,
        ],
    );
    assert_eq!(text(&arr(&reply)[0]), "replaced");
    let got = t.get("s");
    assert_eq!(
        (text(&got["spec"]), text(&got["body"])),
        (spec.into(), "v2".into())
    );
    // Replaced by a one-shot job: back to format 1, series over.
    let reply = t.run(
        "put",
        &["s", "v3", "", "replace", "delay", "0", "1000000", "100", ""],
    );
    assert_eq!(text(&arr(&reply)[0]), "replaced");
    assert!(t.record("s").unwrap().starts_with(b"1|"));
    t.run(
        "put",
        &[
            "s",
            "v4",
            "",
            "replace",
            "delay",
            "0",
            "1000000",
            "100",
            "",
            "every:1000",
        ],
    );
    // A reserved occurrence deleted: its late release finds nothing, no next occurrence.
    let (_, jobs, _) = t.reserve(10);
    assert_eq!(int(&t.run("delete", &["s"])), 1);
    let l = lease(&jobs[0], Some(t.now() + 1_000));
    assert_eq!(int(&t.run("release", &["s", &l])), 0);
    assert!(t.record("s").is_none() && t.score("scheduled", "s").is_none());
    // `<token>@-1` ends a series on purpose.
    t.put("t", "x", now - 1, "every:1000");
    let (_, jobs, _) = t.reserve(10);
    assert_eq!(
        int(&t.run("release", &["t", &format!("{}@-1", jobs[0].token)])),
        1
    );
    assert!(t.record("t").is_none());
    let outcomes: Vec<String> = t.history(10, "s").into_iter().map(|h| h.0).collect();
    assert_eq!(outcomes, ["deleted", "replaced", "replaced", "replaced"]);
    t.assert_sound();
}

#[test]
fn a_replaced_series_is_safe_from_the_old_occurrences_release() {
    let mut t = Topic::new("series.replace.reserved");
    let now = t.now();
    t.put("s", "old", now - 1, "every:1000");
    let (_, jobs, _) = t.reserve(10);
    t.run(
        "put",
        &[
            "s",
            "new",
            "",
            "replace",
            "delay",
            "60000",
            "1000000",
            "100",
            "",
            "every:2000",
        ],
    );
    let l = lease(&jobs[0], Some(now + 1_000));
    assert_eq!(int(&t.run("release", &["s", &l])), 0);
    let got = t.get("s");
    assert_eq!(text(&got["body"]), "new");
    assert!(
        int(&got["due_at"]) >= now + 60_000,
        "the new schedule stands"
    );
}

// ------------------------------------------------------------- pause / resume

#[test]
fn pause_and_resume_a_topic() {
    let mut t = Topic::new("pause.a");
    // A topic with no jobs can be paused; the state is a key that survives restarts.
    assert_eq!(int(&t.run("pause", &[])), 1);
    assert_eq!(int(&t.run("pause", &[])), 0);
    let paused_at: i64 = t.conn.get(t.key("paused")).unwrap();
    assert!(paused_at > 0);
    assert_eq!(t.stats()["paused"], 1);

    // Commands are still applied while paused; nothing is taken.
    let now = t.now();
    let a_due = t.put("a", "x", now, "");
    t.put("b", "x", now, "");
    assert_eq!(int(&t.run("delete", &["b"])), 1);
    let (next_due, jobs, paused) = t.reserve(10);
    assert!(jobs.is_empty());
    assert_eq!((next_due, paused), (-1, 1));
    let pulled = t.run("pull", &["10"]);
    assert!(arr(&arr(&pulled)[2]).is_empty());
    assert_eq!(int(&arr(&pulled)[4]), 1);
    assert_eq!(t.stats()["due_now"], 1);

    // Resume wakes the dispatchers with the head's due time.
    let client = redis::Client::open(common::redis_url()).unwrap();
    let mut sub = client.get_connection().unwrap();
    let mut pubsub = sub.as_pubsub();
    pubsub.subscribe(t.channel()).unwrap();
    pubsub
        .set_read_timeout(Some(Duration::from_secs(5)))
        .unwrap();
    let channel = t.channel();
    assert_eq!(int(&t.run("resume", &[&channel])), 1);
    let msg: String = pubsub.get_message().unwrap().get_payload().unwrap();
    assert_eq!(msg, format!("{a_due}|pause.a"));
    assert_eq!(int(&t.run("resume", &[&channel])), 0, "not paused any more");
    assert_eq!(t.stats()["paused"], 0);
    let (_, jobs, paused) = t.reserve(10);
    assert_eq!((jobs.len(), paused), (1, 0));
}

#[test]
fn a_multi_topic_reserve_skips_paused_topics_without_failing() {
    let prefix = common::unique("luaf");
    let mut a = Topic::under(prefix.clone(), "multi.paused");
    let b = Topic::under(prefix, "multi.running");
    let now = a.now();
    a.put("a1", "x", now - 1, "");
    let mut b = b;
    b.put("b1", "x", now - 1, "");
    a.run("pause", &[]);

    // One pipeline over both topics, as Store::reserve_many sends it.
    let script = redis::Script::new(source(&SCRIPTS, "reserve"));
    let mut pipe = redis::pipe();
    for topic in [&a, &b] {
        let mut inv = script.prepare_invoke();
        for key in topic.keys() {
            inv.key(key);
        }
        inv.arg(60_000).arg(10);
        pipe.invoke_script(&inv);
    }
    let mut conn = common::raw_redis();
    // Load first: a pipeline does not fall back from NOSCRIPT.
    let _: String = script.prepare_invoke().load(&mut conn).unwrap();
    let replies: Vec<Value> = pipe.query(&mut conn).unwrap();
    let paused = arr(&replies[0]);
    let running = arr(&replies[1]);
    assert!(arr(&paused[2]).is_empty() && int(&paused[4]) == 1);
    assert_eq!(arr(&running[2]).len(), 1);
    assert_eq!(int(&running[4]), 0);
    // The v1 contract (four keys) does not know pauses: documented, and unchanged.
    let keys4 = a.keys4();
    let reply = a
        .run_with(&SCRIPTS, "reserve", &keys4, &[b"60000", b"10"])
        .unwrap();
    assert_eq!(arr(&arr(&reply)[2]).len(), 1);
}

// ------------------------------------------------------- failing and parked

#[test]
fn retry_records_the_last_error_and_parks_at_max_attempts() {
    let mut t = Topic::new("park");
    let now = t.now();
    let p_due = t.put("p", "body", now, "");
    t.put("q", "other", now + 60_000, "");
    let max = "3";
    for attempt in 1..=3 {
        let (_, jobs, _) = t.reserve(10);
        assert_eq!(jobs.len(), 1, "attempt {attempt}");
        assert_eq!(jobs[0].attempt, attempt);
        let before = t.now();
        let reason = format!("unroutable: NO_ROUTE #{attempt}");
        let token = jobs[0].token.to_string();
        let reply = int(&t.run("retry", &["p", &token, "0", &reason, max, "100"]));
        let got = t.get("p");
        assert_eq!(text(&got["last_error"]), reason);
        let at = int(&got["last_error_at"]);
        assert!(at >= before && at <= t.now(), "server ms: {at}");
        assert_eq!(int(&got["failures"]), attempt);
        assert_eq!(t.stats()["failing"], 1);
        if attempt < 3 {
            assert_eq!(reply, 1);
            assert_eq!(text(&got["state"]), "scheduled");
        } else {
            assert_eq!(reply, 2, "parked at max_attempts");
            assert_eq!(text(&got["state"]), "parked");
            assert_eq!(text(&got["body"]), "body", "kept with its body");
        }
    }
    assert_eq!(t.score("scheduled", "p"), Some(PARKED));
    // Never reserved, pulled, requeued or listed as waiting while parked.
    let (next_due, jobs, _) = t.reserve(10);
    assert!(jobs.is_empty());
    assert_eq!(
        next_due,
        t.score("scheduled", "q").unwrap(),
        "parked jobs are not the head"
    );
    let pulled = t.run("pull", &["10"]);
    assert!(arr(&arr(&pulled)[2]).is_empty());
    assert_eq!(int(&arr(&t.run("requeue", &["10", ""]))[0]), 0);
    let waiting = t.run("list", &["10"]);
    assert_eq!(arr(&waiting).len(), 2, "only q: {waiting:?}");
    let parked = t.run("list", &["10", "0", "parked"]);
    assert_eq!(text(&arr(&parked)[0]), "p");
    assert_eq!(
        int(&arr(&parked)[1]),
        p_due,
        "a parked job lists its record's due time"
    );
    let stats = t.stats();
    assert_eq!(
        (
            stats["scheduled"],
            stats["parked"],
            stats["records"],
            stats["failing"]
        ),
        (1, 1, 2, 1)
    );
    // A duplicate put sees the parked job's own due time, not the parking score.
    let reply = t.run(
        "put",
        &["p", "x", "", "nx", "delay", "0", "1000000", "100", ""],
    );
    assert_eq!(int(&arr(&reply)[1]), p_due);
    let h = t.history(10, "p");
    assert_eq!(h[0].0, "parked");
    assert_eq!(h[0].4, "unroutable: NO_ROUTE #3");
    t.assert_sound();

    // Re-driven: due now, attempts and failures kept; one more failure parks again.
    let channel = t.channel();
    let reply = t.run("redrive", &["p", "", &channel]);
    assert_eq!((int(&arr(&reply)[0]), int(&arr(&reply)[1])), (1, 0));
    let got = t.get("p");
    assert_eq!(text(&got["state"]), "scheduled");
    assert!(int(&got["due_at"]) <= t.now());
    assert_eq!(int(&got["attempts"]), 3);
    let (_, jobs, _) = t.reserve(10);
    assert_eq!(jobs[0].attempt, 4);
    let token = jobs[0].token.to_string();
    assert_eq!(int(&t.run("retry", &["p", &token, "0", "nack", max])), 2);
    // Deleting a parked job works like deleting any job.
    assert_eq!(int(&t.run("delete", &["p"])), 1);
    assert_eq!(t.stats()["failing"], 0);
    let outcomes: Vec<String> = t.history(10, "p").into_iter().map(|h| h.0).collect();
    assert_eq!(outcomes, ["deleted", "parked", "re-driven", "parked"]);
    t.assert_sound();
}

#[test]
fn max_attempts_zero_retries_forever_and_the_v1_retry_records_nothing() {
    let mut t = Topic::new("park.never");
    let now = t.now();
    t.put("f", "x", now - 1, "");
    for _ in 0..5 {
        let (_, jobs, _) = t.reserve(10);
        let token = jobs[0].token.to_string();
        assert_eq!(int(&t.run("retry", &["f", &token, "0", "nack", "0"])), 1);
    }
    assert_eq!(int(&t.get("f")["failures"]), 5);
    // Three arguments: today's behaviour, the record is not touched.
    t.put("g", "x", now - 1, "");
    let (_, jobs, _) = t.reserve(10);
    let g = jobs.iter().find(|j| j.id == "g").unwrap();
    let before = t.record("g").unwrap();
    assert_eq!(int(&t.run("retry", &["g", &g.token.to_string(), "0"])), 1);
    assert_eq!(t.record("g").unwrap(), before);
    assert!(before.starts_with(b"1|"));
}

#[test]
fn redrive_all_moves_parked_jobs_in_bounded_batches() {
    let mut t = Topic::new("redrive.all");
    let now = t.now();
    for i in 0..5 {
        let id = format!("j{i}");
        t.put(&id, "x", now - 1, "");
    }
    let (_, jobs, _) = t.reserve(10);
    for job in &jobs {
        let token = job.token.to_string();
        assert_eq!(
            int(&t.run("retry", &[&job.id, &token, "0", "boom", "1"])),
            2
        );
    }
    assert_eq!(t.stats()["parked"], 5);
    // Not parked: not moved.
    t.put("free", "x", now + 60_000, "");
    let reply = t.run("redrive", &["free"]);
    assert_eq!(int(&arr(&reply)[0]), 0);
    assert_eq!(t.score("scheduled", "free"), Some(now + 60_000));
    let mut rounds = 0;
    loop {
        let reply = t.run("redrive", &["", "2", "", "0"]);
        let (moved, remaining) = (int(&arr(&reply)[0]), int(&arr(&reply)[1]));
        rounds += 1;
        assert!(moved <= 2);
        if remaining == 0 {
            break;
        }
    }
    assert_eq!(rounds, 3);
    assert_eq!(t.stats()["parked"], 0);
    assert_eq!(t.stats()["due_now"], 5);
    assert_eq!(t.stats()["history"], 5, "history_max 0 logged no redrive");
    t.assert_sound();
}

/// A parked job written raw: a format-2 record whose last failure was at `error_at`, in
/// `failing` at that time and in `scheduled` at the parking score.
fn park_raw(t: &mut Topic, id: &str, error_at: i64) {
    let err = "http 503";
    let rec = format!(
        "2|1000|3|7|3|{error_at}|0|{}|0|{err}body of {id}",
        err.len()
    );
    let (jobs, scheduled, failing) = (t.key("jobs"), t.key("scheduled"), t.key("failing"));
    let _: () = t.conn.hset(&jobs, id, &rec).unwrap();
    let _: () = t.conn.zadd(&scheduled, id, PARKED).unwrap();
    let _: () = t.conn.zadd(&failing, id, error_at).unwrap();
}

/// redrive_window.lua in steps of `count` until its cursor is ''; (moved, steps).
fn redrive_window_all(t: &mut Topic, since: &str, until: &str, count: &str) -> (i64, usize) {
    let (mut moved, mut steps, mut cursor) = (0, 0, String::new());
    loop {
        let reply = t.run("redrive_window", &[since, until, &cursor, count, "", ""]);
        let reply = arr(&reply);
        let scanned = int(&reply[1]);
        assert!(
            scanned <= count.parse::<i64>().unwrap(),
            "a step is bounded: {reply:?}"
        );
        moved += int(&reply[0]);
        steps += 1;
        cursor = text(&reply[2]);
        if cursor.is_empty() {
            return (moved, steps);
        }
        assert!(steps < 1000, "the walk ends");
    }
}

#[test]
fn redrive_window_moves_the_parked_jobs_that_last_failed_in_the_window() {
    let mut t = Topic::new("redrive.window");
    for (id, at) in [
        ("early", 1_000),
        ("a", 5_000),
        ("b", 6_000),
        ("c", 7_000),
        ("late", 9_000),
    ] {
        park_raw(&mut t, id, at);
    }
    // Failing in the window but waiting for its retry, not parked: passed over.
    let rec = "2|4000|1|2|1|6500|0|4|0|nackbody";
    let (jobs, scheduled, failing) = (t.key("jobs"), t.key("scheduled"), t.key("failing"));
    let _: () = t.conn.hset(&jobs, "retrying", rec).unwrap();
    let _: () = t.conn.zadd(&scheduled, "retrying", 4_000).unwrap();
    let _: () = t.conn.zadd(&failing, "retrying", 6_500).unwrap();
    t.assert_sound();

    let channel = t.channel();
    let mut sub = common::raw_redis();
    let mut pubsub = sub.as_pubsub();
    pubsub.subscribe(&channel).unwrap();
    pubsub
        .set_read_timeout(Some(Duration::from_secs(5)))
        .unwrap();

    // Steps of 2 over [5000, 7000]: a, b, then retrying, c; the cursor ends it.
    let reply = t.run("redrive_window", &["5000", "7000", "", "2", &channel]);
    let reply = arr(&reply);
    assert_eq!((int(&reply[0]), int(&reply[1])), (2, 2));
    assert_eq!(text(&reply[2]), "6000:b");
    let message = pubsub.get_message().unwrap();
    let payload: String = message.get_payload().unwrap();
    assert!(payload.ends_with("|redrive.window"), "{payload}");
    let reply = t.run("redrive_window", &["5000", "7000", "6000:b", "2"]);
    let reply = arr(&reply);
    assert_eq!(
        (int(&reply[0]), int(&reply[1])),
        (1, 2),
        "c moved, retrying passed over"
    );
    assert_eq!(text(&reply[2]), "7000:c");
    let reply = t.run("redrive_window", &["5000", "7000", "7000:c", "2"]);
    assert_eq!(
        (
            int(&arr(&reply)[0]),
            int(&arr(&reply)[1]),
            text(&arr(&reply)[2])
        ),
        (0, 0, String::new()),
        "late lies beyond the window: done"
    );

    let now = t.now();
    for id in ["a", "b", "c"] {
        let got = t.get(id);
        assert_eq!(text(&got["state"]), "scheduled", "{id}");
        let due = int(&got["due_at"]);
        assert!(due > 1000 && due <= now, "{id} due now: {due}");
        assert_eq!(int(&got["attempts"]), 3, "attempts kept");
        assert_eq!(int(&got["failures"]), 3, "failures kept");
        assert_eq!(text(&got["last_error"]), "http 503");
        assert!(t.score("failing", id).is_some(), "{id} stays failing");
    }
    for id in ["early", "late"] {
        assert_eq!(text(&t.get(id)["state"]), "parked", "{id}");
    }
    assert_eq!(t.score("scheduled", "retrying"), Some(4_000), "not moved");
    let logged: Vec<(String, String)> = t.history(10, "").into_iter().map(|h| (h.0, h.1)).collect();
    assert_eq!(
        logged,
        [("re-driven", "c"), ("re-driven", "b"), ("re-driven", "a")]
            .map(|(o, id)| (o.to_string(), id.to_string()))
    );
    // Again over the same window (a client retry): nothing left to move.
    assert_eq!(redrive_window_all(&mut t, "5000", "7000", "2").0, 0);
    // The defaults: from 0 to the server's now takes the rest.
    assert_eq!(redrive_window_all(&mut t, "0", "", "100").0, 2);
    assert_eq!(t.stats()["parked"], 0);
    t.assert_sound();
}

#[test]
fn redrive_window_resumes_after_its_cursor_among_equal_times_when_entries_move() {
    let mut t = Topic::new("redrive.ties");
    // Twelve jobs parked in the same millisecond: ordered by id, as Redis orders ties.
    let ids: Vec<String> = (0..12).map(|i| format!("tie-{i:02}")).collect();
    for id in &ids {
        park_raw(&mut t, id, 5_000);
    }
    park_raw(&mut t, "after", 5_001);
    let reply = t.run("redrive_window", &["5000", "5001", "", "3"]);
    let reply = arr(&reply);
    assert_eq!(int(&reply[0]), 3);
    assert_eq!(text(&reply[2]), "5000:tie-02");
    // The cursor's own job is deleted, the next one fails again later (leaves the
    // window), and one parked behind the cursor is re-driven by hand: the walk goes on
    // right after tie-02 all the same, never again over tie-00..02.
    assert_eq!(int(&t.run("delete", &["tie-02"])), 1);
    let failing = t.key("failing");
    let _: () = t.conn.zadd(&failing, "tie-03", 8_000).unwrap();
    let reply = t.run("redrive_window", &["5000", "5001", "5000:tie-02", "3"]);
    let reply = arr(&reply);
    assert_eq!(int(&reply[0]), 3, "tie-04, tie-05, tie-06: {reply:?}");
    assert_eq!(text(&reply[2]), "5000:tie-06");
    // A cursor naming an id that never existed resumes by order too.
    let reply = t.run("redrive_window", &["5000", "5001", "5000:tie-06x", "3"]);
    assert_eq!(int(&arr(&reply)[0]), 3, "tie-07..09: {reply:?}");
    let (rest, _) = redrive_window_all(&mut t, "5000", "5001", "3");
    assert_eq!(
        rest, 3,
        "tie-10, tie-11 and after; the first ones are no longer parked"
    );
    let parked: Vec<String> = {
        let scheduled = t.key("scheduled");
        t.conn.zrangebyscore(scheduled, PARKED, "+inf").unwrap()
    };
    assert_eq!(
        parked,
        ["tie-03"],
        "only the job that left the window is still parked"
    );
    t.assert_sound();
}

// ------------------------------------------------------------------- history

#[test]
fn history_is_capped_filtered_and_off_at_zero() {
    let mut t = Topic::new("history");
    let now = t.now();
    for i in 0..6 {
        let id = format!("h{}", i % 2);
        let reply = t.run(
            "put",
            &[
                &id,
                "x",
                "",
                "replace",
                "at",
                &now.to_string(),
                "1000000",
                "100",
                "",
                "",
                "4",
            ],
        );
        assert!(matches!(
            text(&arr(&reply)[0]).as_str(),
            "scheduled" | "replaced"
        ));
    }
    // 4 replaces happened, capped at 4 by the put's history_max.
    assert_eq!(t.stats()["history"], 4);
    t.run("delete", &["h0", "3"]);
    assert_eq!(t.stats()["history"], 3, "trimmed to the latest history_max");
    let all = t.history(10, "");
    assert_eq!(all[0].0, "deleted");
    assert_eq!(all[0].1, "h0");
    let only: Vec<String> = t.history(10, "h1").into_iter().map(|h| h.1).collect();
    assert!(only.iter().all(|id| id == "h1") && !only.is_empty());
    assert_eq!(t.history(1, "").len(), 1, "limit");
    // 0 disables: the outcome happens, nothing is logged.
    t.run("delete", &["h1", "0"]);
    assert_eq!(t.stats()["history"], 3);
    assert!(t.record("h1").is_none());
    // An id with the separator in it reads back whole.
    t.put("a|b", "x", now - 1, "");
    let (_, jobs, _) = t.reserve(10);
    let l = lease(&jobs[0], None);
    t.run("release", &["a|b", &l, "10"]);
    let h = t.history(1, "a|b");
    assert_eq!(
        (h[0].0.as_str(), h[0].1.as_str(), h[0].2),
        ("dispatched", "a|b", 1)
    );
    // The four-key calls write no history.
    let keys4 = t.keys4();
    t.run_with(
        &SCRIPTS,
        "put",
        &keys4,
        &[b"z", b"x", b"", b"nx", b"delay", b"0", b"1000", b"10", b""],
    )
    .unwrap();
    t.run_with(&SCRIPTS, "delete", &keys4, &[b"z"]).unwrap();
    assert_eq!(t.history(10, "z").len(), 0);
}

// ------------------------------------------------------------------- check

#[test]
fn check_knows_parked_jobs_and_repairs_the_failing_index() {
    let mut t = Topic::new("check.failing");
    let now = t.now();
    t.put("a", "x", now - 1, "");
    let (_, jobs, _) = t.reserve(10);
    t.run("retry", &["a", &jobs[0].token.to_string(), "0", "e", "1"]);
    t.assert_sound();
    // The five-key form (today's `redisched check`) finds parked jobs sound too.
    let five = t.keys()[..5].to_vec();
    assert!(t.check("report", &five).is_empty());

    let all = t.keys();
    let failing = t.key("failing");
    let _: () = t.conn.zrem(&failing, "a").unwrap();
    let _: () = t.conn.zadd(&failing, "ghost", 1).unwrap();
    let problems = t.check("report", &all);
    let kinds: Vec<(&str, &str)> = problems
        .iter()
        .map(|(k, id, _)| (k.as_str(), id.as_str()))
        .collect();
    assert_eq!(
        kinds,
        [("failing_unindexed", "a"), ("orphan_failing", "ghost")]
    );
    let repaired = t.check("repair", &all);
    assert!(repaired.iter().all(|p| p.2 == 1), "{repaired:?}");
    t.assert_sound();
    assert_eq!(t.stats()["failing"], 1);

    let paused = t.key("paused");
    let _: () = t.conn.lpush(&paused, "x").unwrap();
    let problems = t.check("report", &all);
    assert_eq!(problems[0].0, "wrong_type");
    assert_eq!(problems[0].1, "paused");
}

// ------------------------------------------------------------- arguments

#[test]
fn new_arguments_are_refused_with_invalid_argument_and_write_nothing() {
    let mut t = Topic::new("args");
    let all = t.keys();
    let four = t.keys4();
    let three = all[..3].to_vec();
    let long = "e".repeat(257);
    let ctl = "every:\n1";
    #[rustfmt::skip]
    let cases: Vec<(&str, Vec<String>, Vec<&str>)> = vec![
        ("put", all.clone(), vec!["id", "b", "", "nx", "delay", "0", "1000", "10", "", ctl]),
        ("put", all.clone(), vec!["id", "b", "", "nx", "delay", "0", "1000", "10", "", &long]),
        ("put", all.clone(), vec!["id", "b", "", "nx", "delay", "0", "1000", "10", "", "", "-1"]),
        ("put", all.clone(), vec!["id", "b", "", "nx", "delay", "0", "1000", "10", "", "", "x"]),
        ("put", all[..5].to_vec(), vec!["id", "b", "", "nx", "delay", "0", "1000", "10", ""]),
        ("delete", all.clone(), vec!["id", "many"]),
        ("reserve", all.clone(), vec!["1000", "10", "soon"]),
        ("reserve", all.clone(), vec!["1000", "10", "", "", "", "json"]),
        ("reserve", all.clone(), vec!["1000", "10", "", "", "", "", "-1"]),
        ("reserve", all.clone(), vec!["1000", "10", "", "", "", "", "1001"]),
        ("reserve", all.clone(), vec!["1000", "10", "", "", "", "", "two"]),
        ("reserve", four.clone(), vec!["1000", "10", "", "", "", "", "1"]),
        ("pull", all.clone(), vec!["10", "1.5"]),
        ("release", all.clone(), vec!["id", "1@soon"]),
        ("release", all.clone(), vec!["id", "1@-2"]),
        ("release", all.clone(), vec!["id", "x1"]),
        ("release", all.clone(), vec!["id", "1", "many"]),
        ("retry", all.clone(), vec!["id", "1", "0", &long]),
        ("retry", four.clone(), vec!["id", "1", "0", "e"]),
        ("retry", all.clone(), vec!["id", "1", "0", "e", "-1"]),
        ("retry", all.clone(), vec!["id", "1", "0", "e", "two"]),
        ("retry", all.clone(), vec!["id", "1", "0", "e", "1", "x"]),
        ("list", all.clone(), vec!["10", "0", "reserved"]),
        ("list", all.clone(), vec!["10", "0", "parked", "yes"]),
        ("check", all.clone(), vec!["report", "x0", "10"]),
        ("check", all[..5].to_vec(), vec!["report", "f0", "10"]),
        ("check", four.clone(), vec!["report", "0", "10"]),
        ("pause", four.clone(), vec![]),
        ("resume", four.clone(), vec![""]),
        ("redrive", four.clone(), vec![""]),
        ("redrive", all.clone(), vec!["", "0"]),
        ("redrive", all.clone(), vec!["", "1001"]),
        ("redrive", all.clone(), vec!["", "10", "", "x"]),
        ("redrive_window", four.clone(), vec!["0"]),
        ("redrive_window", all.clone(), vec![]),
        ("redrive_window", all.clone(), vec!["-1"]),
        ("redrive_window", all.clone(), vec!["soon"]),
        ("redrive_window", all.clone(), vec!["0", "99999999999999999"]),
        ("redrive_window", all.clone(), vec!["0", "later"]),
        ("redrive_window", all.clone(), vec!["2000", "1000"]),
        ("redrive_window", all.clone(), vec!["0", "", "7"]),
        ("redrive_window", all.clone(), vec!["0", "", "x:id"]),
        ("redrive_window", all.clone(), vec!["0", "", "", "0"]),
        ("redrive_window", all.clone(), vec!["0", "", "", "1001"]),
        ("redrive_window", all.clone(), vec!["0", "", "", "10", "", "x"]),
        ("history", four.clone(), vec!["10"]),
        ("history", all.clone(), vec!["0"]),
        ("history", all.clone(), vec!["1001"]),
        ("history", all.clone(), vec![]),
        ("stats", three.clone(), vec![]),
        ("requeue", three.clone(), vec!["10", ""]),
        ("get", all[..6].to_vec(), vec!["id"]),
    ];
    for (script, keys, args) in &cases {
        t.refused(script, keys, args);
    }
    let existing: i64 = t.conn.exists(&all).unwrap();
    assert_eq!(existing, 0, "no refused call wrote anything");
}

/// A MessagePack value (as Redis's cmsgpack writes one) read back as the RESP value
/// the same script answers without ARGV 6: arrays, byte strings, integers.
fn from_msgpack(input: &mut &[u8]) -> Value {
    use rmp::Marker;
    let marker = rmp::decode::read_marker(input).expect("a msgpack marker");
    let len = |input: &mut &[u8], bytes: usize| -> usize {
        let (head, rest) = input.split_at(bytes);
        *input = rest;
        head.iter().fold(0usize, |n, b| n << 8 | usize::from(*b))
    };
    let array =
        |input: &mut &[u8], n: usize| Value::Array((0..n).map(|_| from_msgpack(input)).collect());
    let string = |input: &mut &[u8], n: usize| {
        let (bytes, rest) = input.split_at(n);
        *input = rest;
        Value::BulkString(bytes.to_vec())
    };
    let int = |input: &mut &[u8], bytes: usize, signed: bool| {
        let n = len(input, bytes) as u64;
        let shift = 64 - 8 * bytes as u32;
        Value::Int(if signed {
            ((n << shift) as i64) >> shift
        } else {
            n as i64
        })
    };
    match marker {
        Marker::FixArray(n) => array(input, usize::from(n)),
        Marker::Array16 => {
            let n = len(input, 2);
            array(input, n)
        }
        Marker::Array32 => {
            let n = len(input, 4);
            array(input, n)
        }
        Marker::FixStr(n) => string(input, usize::from(n)),
        Marker::Str8 | Marker::Bin8 => {
            let n = len(input, 1);
            string(input, n)
        }
        Marker::Str16 | Marker::Bin16 => {
            let n = len(input, 2);
            string(input, n)
        }
        Marker::Str32 | Marker::Bin32 => {
            let n = len(input, 4);
            string(input, n)
        }
        Marker::FixPos(n) => Value::Int(i64::from(n)),
        Marker::FixNeg(n) => Value::Int(i64::from(n)),
        Marker::U8 => int(input, 1, false),
        Marker::U16 => int(input, 2, false),
        Marker::U32 => int(input, 4, false),
        Marker::U64 => int(input, 8, false),
        Marker::I8 => int(input, 1, true),
        Marker::I16 => int(input, 2, true),
        Marker::I32 => int(input, 4, true),
        Marker::I64 => int(input, 8, true),
        other => panic!("unexpected msgpack marker {other:?}"),
    }
}

/// A reply for a failure message: long strings by length and a checksum.
fn brief(value: &Value) -> String {
    match value {
        Value::Array(items) => {
            let items: Vec<String> = items.iter().map(brief).collect();
            format!("[{}]", items.join(", "))
        }
        Value::BulkString(b) if b.len() > 16 => format!(
            "<{} bytes, sum {}>",
            b.len(),
            b.iter().map(|&x| u64::from(x)).sum::<u64>()
        ),
        Value::BulkString(b) => format!("{:?}", String::from_utf8_lossy(b)),
        other => format!("{other:?}"),
    }
}

#[test]
fn reserve_packs_its_jobs_as_msgpack_on_request_with_the_same_content() {
    // Two topics with the same jobs, one reserved each way: same reply, field for field.
    let prefix = common::unique("luaf");
    let mut plain = Topic::under(prefix.clone(), "pack.plain");
    let mut packed = Topic::under(prefix, "pack.packed");
    let now = plain.now();
    let body: Vec<u8> = (0..=255u8).cycle().take(70_000).collect();
    let long_id = "i".repeat(250);
    // In the future, so both topics hold the same due times (a past one becomes "now").
    let at = (now + 300).to_string();
    for t in [&mut plain, &mut packed] {
        for (id, body, spec) in [
            (long_id.as_bytes(), body.as_slice(), &b""[..]),
            (b"short", b"", &b"every:60000"[..]),
            ("\u{e9}t\u{e9}".as_bytes(), b"x", &b""[..]),
        ] {
            let args: [&[u8]; 10] = [
                id,
                body,
                b"meta",
                b"nx",
                b"at",
                at.as_bytes(),
                b"31622400000",
                b"1048576",
                b"",
                spec,
            ];
            let keys = t.keys();
            t.run_with(&SCRIPTS, "put", &keys, &args).expect("put");
        }
    }
    std::thread::sleep(Duration::from_millis(400));
    let mut plain_reply = arr(&plain.run("reserve", &["60000", "10"])).clone();
    let mut packed_reply =
        arr(&packed.run("reserve", &["60000", "10", "", "", "", "msgpack"])).clone();
    let Value::BulkString(bytes) = packed_reply[2].clone() else {
        panic!("jobs as one string: {:?}", packed_reply[2]);
    };
    let mut input = bytes.as_slice();
    packed_reply[2] = from_msgpack(&mut input);
    assert!(input.is_empty(), "nothing after the packed jobs");
    assert_eq!(arr(&plain_reply[2]).len(), 3, "{plain_reply:?}");
    // The clocks may differ by a millisecond.
    plain_reply[0] = Value::Int(0);
    packed_reply[0] = Value::Int(0);
    assert!(
        packed_reply == plain_reply,
        "packed {} vs plain {}",
        brief(&Value::Array(packed_reply.clone())),
        brief(&Value::Array(plain_reply.clone()))
    );
    // Nothing due: an empty packed list.
    let empty = packed.run("reserve", &["60000", "10", "", "", "", "msgpack"]);
    assert_eq!(arr(&empty)[2], Value::BulkString(vec![0x90]));
}

#[test]
fn reserve_honours_its_max_argument() {
    let mut t = Topic::new("reserve.max");
    let now = t.now();
    t.put("early", "x", now, "");
    t.put("late", "x", now, "");
    // Earlier due times than a put accepts (it makes a past time now).
    let scheduled = t.key("scheduled");
    let _: () = t.conn.zadd(&scheduled, "early", now - 2_000).unwrap();
    let _: () = t.conn.zadd(&scheduled, "late", now - 10).unwrap();
    let max = (now - 1_000).to_string();
    let reply = t.run("reserve", &["60000", "10", &max]);
    let jobs: Vec<Job> = arr(&arr(&reply)[2]).iter().map(Job::from).collect();
    assert_eq!(jobs.len(), 1);
    assert_eq!(jobs[0].id, "early");
    assert_eq!(int(&arr(&reply)[1]), now - 10, "next_due is the one left");
    // Empty means none.
    let reply = t.run("reserve", &["60000", "10", ""]);
    assert_eq!(arr(&arr(&reply)[2]).len(), 1);
}

/// reserve.lua with `retry_cap`: (ids taken with their attempt, held, unseen, reply
/// length).
fn reserve_capped(t: &mut Topic, limit: usize, cap: &str) -> (Vec<(String, i64)>, i64, i64, usize) {
    let reply = t.run(
        "reserve",
        &["60000", &limit.to_string(), "", "", "", "", cap],
    );
    let reply = arr(&reply);
    let jobs: Vec<Job> = arr(&reply[2]).iter().map(Job::from).collect();
    let taken = jobs.into_iter().map(|j| (j.id, j.attempt)).collect();
    (taken, int(&reply[7]), int(&reply[8]), reply.len())
}

#[test]
fn reserve_with_a_retry_cap_skips_retries_past_it_to_reach_first_attempts() {
    let mut t = Topic::new("reserve.lanes");
    let now = t.now();
    // Six retries (reserved once, handed back due at once) due before three first attempts.
    for i in 0..6 {
        t.put(&format!("r{i}"), "x", now, "");
    }
    let (_, taken, _) = t.reserve(10);
    for job in &taken {
        t.run(
            "retry",
            &[&job.id, &job.token.to_string(), "0", "HTTP 500", "10"],
        );
    }
    let scheduled = t.key("scheduled");
    for i in 0..6 {
        let _: () = t
            .conn
            .zadd(&scheduled, format!("r{i}"), now - 100 + i)
            .unwrap();
    }
    for i in 0..3 {
        t.put(&format!("f{i}"), "x", now, "");
    }
    // Without a cap: earliest first, the retries (the reply shape of eight keys).
    let plain = t.run("reserve", &["60000", "2", "", "", "", ""]);
    assert_eq!(arr(&plain).len(), 5, "no cap: the reply keeps its shape");
    let ids: Vec<String> = arr(&arr(&plain)[2])
        .iter()
        .map(|j| Job::from(j).id)
        .collect();
    assert_eq!(ids, ["r0", "r1"]);

    let (taken, held, unseen, len) = reserve_capped(&mut t, 4, "1");
    assert_eq!(len, 9, "with a cap: nine fields");
    assert_eq!(
        taken,
        [
            ("r2".into(), 2),
            ("f0".into(), 1),
            ("f1".into(), 1),
            ("f2".into(), 1)
        ],
        "one retry, then the first attempts behind the others, earliest first"
    );
    assert_eq!(
        (held, unseen),
        (3, 0),
        "r3..r5 held; every due job was seen"
    );
    assert_eq!(
        t.score("scheduled", "r3"),
        Some(now - 97),
        "a held retry stays scheduled"
    );

    // Nothing but retries due: a cap of 0 takes none and says no first attempt waits.
    let (taken, held, unseen, _) = reserve_capped(&mut t, 10, "0");
    assert!(taken.is_empty());
    assert_eq!((held, unseen), (3, 0));
    // Limit reached before the end: due jobs may be unseen.
    t.put("f3", "x", now, "");
    let (taken, _, unseen, _) = reserve_capped(&mut t, 1, "0");
    assert_eq!(taken, [("f3".into(), 1)]);
    assert_eq!(unseen, 1, "stopped at its limit");
    let (taken, held, _, _) = reserve_capped(&mut t, 10, "5");
    assert_eq!(taken.len(), 3, "under the cap retries are taken as usual");
    assert_eq!(held, 0);
    t.assert_sound();
}

#[test]
fn a_capped_reserve_scans_at_most_a_thousand_retries_past_its_limit() {
    let mut t = Topic::new("reserve.lanes.bound");
    let now = t.now();
    let (scheduled, jobs) = (t.key("scheduled"), t.key("jobs"));
    // 1,100 retries (format 1, one reservation so far) due before one first attempt.
    let mut pipe = redis::pipe();
    for i in 0..1_100 {
        let id = format!("r{i:04}");
        pipe.hset(&jobs, &id, format!("1|{now}|1|{i}|0|x"));
        pipe.zadd(&scheduled, &id, now - 5_000 + i);
    }
    let _: () = pipe.query(&mut t.conn).unwrap();
    t.put("fresh", "x", now, "");
    let (taken, held, unseen, _) = reserve_capped(&mut t, 2, "0");
    assert!(
        taken.is_empty(),
        "the first attempt lies beyond the bound: {taken:?}"
    );
    assert_eq!(held, 1_002, "limit + 1000 looked at");
    assert_eq!(unseen, 1, "stopped at its bound");
    // Reached once fewer retries are ahead of it.
    let (_, ahead, _) = t.reserve(200);
    assert_eq!(ahead.len(), 200);
    let (taken, _, unseen, _) = reserve_capped(&mut t, 2, "0");
    assert_eq!(taken, [("fresh".into(), 1)]);
    assert_eq!(unseen, 0);
}

// ----------------------------------------------------------- rolling upgrade

#[test]
fn a_bridge_of_the_previous_release_cannot_corrupt_format_2_records() {
    let mut t = Topic::new("upgrade");
    let keys4 = t.keys4();
    let now = t.now();
    t.put("series", "s", now - 1, "every:1000");
    t.put("plain", "p", now - 1, "");
    let series_before = t.record("series").unwrap();

    // The old reserve delivers the format-1 job and leaves the format-2 record
    // untouched: it reports it corrupt and takes it off the schedule (never delivered
    // as a one-shot job, never deleted).
    let reply = t
        .run_with(&V1_SCRIPTS, "reserve", &keys4, &[b"60000", b"10"])
        .unwrap();
    let reply = arr(&reply);
    let taken: Vec<String> = arr(&reply[2]).iter().map(|j| text(&arr(j)[0])).collect();
    let corrupt: Vec<String> = arr(&reply[3]).iter().map(text).collect();
    assert_eq!(taken, ["plain"]);
    assert_eq!(corrupt, ["series"]);
    assert_eq!(t.record("series").unwrap(), series_before);
    // The old put refuses a duplicate without writing; the old get refuses to read.
    let dup = t.run_with(
        &V1_SCRIPTS,
        "put",
        &keys4,
        &[
            b"series", b"x", b"", b"nx", b"delay", b"0", b"1000", b"10", b"",
        ],
    );
    assert!(matches!(dup, Err(StoreError::Rejected(ref r)) if r.code == RejectCode::CorruptRecord));
    let old_get = t.run_with(&V1_SCRIPTS, "get", &keys4, &[b"series"]);
    assert!(
        matches!(old_get, Err(StoreError::Rejected(ref r)) if r.code == RejectCode::CorruptRecord)
    );
    assert_eq!(t.record("series").unwrap(), series_before);

    // A new `check --repair` puts it back on the schedule at its own due time.
    let all = t.keys();
    let problems = t.check("repair", &all);
    assert_eq!(problems.len(), 1);
    assert_eq!(
        (
            problems[0].0.as_str(),
            problems[0].1.as_str(),
            problems[0].2
        ),
        ("unindexed", "series", 1)
    );
    let (_, jobs, _) = t.reserve(10);
    assert_eq!(
        jobs.iter().map(|j| j.id.as_str()).collect::<Vec<_>>(),
        ["series"]
    );
    let series = jobs[0].clone();

    // Old release and retry cannot move a format-2 job reserved by a new bridge.
    let token = series.token.to_string();
    let released = t
        .run_with(
            &V1_SCRIPTS,
            "release",
            &keys4,
            &[b"series", token.as_bytes()],
        )
        .unwrap();
    assert_eq!(int(&released), 0);
    let retried = t
        .run_with(
            &V1_SCRIPTS,
            "retry",
            &keys4,
            &[b"series", token.as_bytes(), b"0"],
        )
        .unwrap();
    assert_eq!(int(&retried), 0);
    assert!(t.score("reserved", "series").is_some());
    // The new release moves the series on.
    let l = lease(&series, Some(t.now() + 1_000));
    assert_eq!(int(&t.run("release", &["series", &l])), 1);

    // Format-1 records written by old bridges are dispatched by new ones, and a
    // reservation taken by an old bridge is released by the new release script.
    let old_put = t
        .run_with(
            &V1_SCRIPTS,
            "put",
            &keys4,
            &[
                b"legacy", b"l", b"", b"nx", b"delay", b"0", b"1000", b"10", b"",
            ],
        )
        .unwrap();
    assert_eq!(text(&arr(&old_put)[0]), "scheduled");
    let reply = t
        .run_with(&V1_SCRIPTS, "reserve", &keys4, &[b"60000", b"10"])
        .unwrap();
    let legacy = Job::from(&{
        let mut entry = arr(&arr(&arr(&reply)[2])[0]).clone();
        entry.push(Value::BulkString(Vec::new()));
        Value::Array(entry)
    });
    let l = lease(&legacy, None);
    assert_eq!(int(&t.run("release", &["legacy", &l])), 1);
    let plain = t.record("plain");
    assert!(plain.is_some(), "still reserved by the old bridge");
    t.assert_sound();
}

#[test]
fn four_key_calls_keep_the_version_1_reply_shapes() {
    let mut t = Topic::new("v1.shapes");
    let keys4 = t.keys4();
    let now = t.now();
    t.put("s", "x", now, "every:1000");
    t.put("p", "x", now, "");
    let reply = t
        .run_with(&SCRIPTS, "reserve", &keys4, &[b"60000", b"1"])
        .unwrap();
    let reply = arr(&reply);
    assert_eq!(reply.len(), 4, "{reply:?}");
    let job = arr(&arr(&reply[2])[0]);
    assert_eq!(job.len(), 6, "{job:?}");
    let stats = t.run_with(&SCRIPTS, "stats", &keys4, &[]).unwrap();
    assert_eq!(arr(&stats).len(), 6);
    // Park p with the full list; a version-1 get sees it where version 1 would.
    let (_, jobs, _) = t.reserve(10);
    let token = jobs[0].token.to_string();
    assert_eq!(
        int(&t.run("retry", &[&jobs[0].id, &token, "0", "e", "1"])),
        2
    );
    let parked_id = jobs[0].id.clone();
    let got = t
        .run_with(&SCRIPTS, "get", &keys4, &[parked_id.as_bytes()])
        .unwrap();
    let got = arr(&got);
    assert_eq!(got.len(), 7);
    assert_eq!(
        (text(&got[0]).as_str(), int(&got[1])),
        ("scheduled", PARKED)
    );
    let stats = t.run_with(&SCRIPTS, "stats", &keys4, &[]).unwrap();
    let stats: Vec<i64> = arr(&stats).iter().map(int).collect();
    assert_eq!(
        stats[5],
        stats[1] + stats[3],
        "records = scheduled + reserved"
    );
    let pulled = t.run_with(&SCRIPTS, "pull", &keys4, &[b"10"]).unwrap();
    assert_eq!(arr(&pulled).len(), 4);
}

// ------------------------------------------------------------ the typed Store

mod typed {
    use super::common;
    use redisched::job::spec::ScheduleSpec;
    use redisched::job::{Due, JobId, PutMode, Topic};
    use redisched::store::{
        Delivered, JobState, Lease, ListWhich, NextDue, Outcome, PutRequest, RetryOutcome,
    };
    use std::time::Duration;

    fn request(topic: &Topic, id: &str, due: Due, mode: PutMode) -> PutRequest {
        PutRequest {
            topic: topic.clone(),
            id: JobId::new(id).unwrap(),
            body: b"body".to_vec(),
            meta: Vec::new(),
            due,
            mode,
        }
    }

    #[tokio::test]
    async fn the_store_drives_series_failures_pauses_and_history() {
        let store = common::test_store().await;
        let t = Topic::new("typed").unwrap();
        let other = Topic::new("typed.other").unwrap();
        let spec = ScheduleSpec::every(60_000);
        store
            .put_recurring(request(&t, "s", Due::NOW, PutMode::Keep), spec.clone())
            .await
            .unwrap();
        store
            .put(request(&t, "o", Due::NOW, PutMode::Keep))
            .await
            .unwrap();
        store
            .put(request(&t, "p", Due::NOW, PutMode::Keep))
            .await
            .unwrap();
        store
            .put(request(&other, "x", Due::NOW, PutMode::Keep))
            .await
            .unwrap();

        // Paused: a multi-topic reserve skips the topic and takes the other's job.
        assert!(store.pause(&t).await.unwrap());
        assert!(store.is_paused(&t).await.unwrap());
        assert!(store.topics().await.unwrap().contains(&t));
        let ttr = Duration::from_secs(60);
        let batches = store
            .reserve_many(&[t.clone(), other.clone()], ttr, 10)
            .await
            .unwrap();
        assert!(batches[0].paused && batches[0].jobs.is_empty());
        assert_eq!(batches[1].jobs.len(), 1);
        assert!(store.stats(&t).await.unwrap().paused);
        assert!(store.resume(&t).await.unwrap());
        assert!(!store.is_paused(&t).await.unwrap());

        let batch = store.reserve(&t, ttr, 10).await.unwrap();
        let series = batch.jobs.iter().find(|j| j.id == "s").unwrap();
        let one = batch.jobs.iter().find(|j| j.id == "o").unwrap();
        assert_eq!(series.spec.as_deref(), Some(spec.as_str()));
        assert_eq!(one.spec, None);
        let lease = |id: &str, token| Lease {
            topic: t.clone(),
            id: id.to_string(),
            token,
        };
        // A series through the plain release is refused (it stays reserved); the
        // one-shot job of the same call is released all the same.
        let plain = batch.jobs.iter().find(|j| j.id == "p").unwrap();
        let released = store
            .release(&[lease("p", plain.token), lease("s", series.token)])
            .await
            .unwrap();
        assert_eq!(released, 1);
        let info = store
            .get(&t, &JobId::new("s").unwrap())
            .await
            .unwrap()
            .unwrap();
        assert_eq!(info.state, JobState::Reserved);
        assert!(store
            .get(&t, &JobId::new("p").unwrap())
            .await
            .unwrap()
            .is_none());
        // The one-shot job fails and parks (max 1); the series moves on.
        let parked = store
            .retry_failed(&lease("o", one.token), Duration::ZERO, "nack", 1)
            .await
            .unwrap();
        assert_eq!(parked, RetryOutcome::Parked);
        let next = batch.now + 60_000;
        let released = store
            .release_delivered(&[Delivered {
                lease: lease("s", series.token),
                next_due: NextDue::At(next),
            }])
            .await
            .unwrap();
        assert_eq!(released, 1);
        let info = store
            .get(&t, &JobId::new("s").unwrap())
            .await
            .unwrap()
            .unwrap();
        assert_eq!(
            (info.state, info.due_at, info.attempts),
            (JobState::Scheduled, next, 0)
        );
        let info = store
            .get(&t, &JobId::new("o").unwrap())
            .await
            .unwrap()
            .unwrap();
        assert_eq!(info.state, JobState::Parked);
        assert_eq!(
            info.last_error.as_ref().map(|e| e.reason.as_str()),
            Some("nack")
        );

        let parked_list = store.list_jobs(&t, ListWhich::Parked, 10, 0).await.unwrap();
        assert_eq!(parked_list.len(), 1);
        assert_eq!(
            (parked_list[0].id.as_str(), parked_list[0].failures),
            ("o", 1)
        );
        let waiting = store
            .list_jobs(&t, ListWhich::Scheduled, 10, 0)
            .await
            .unwrap();
        assert_eq!(waiting.len(), 1);
        assert_eq!(waiting[0].spec.as_deref(), Some(spec.as_str()));
        let stats = store.stats(&t).await.unwrap();
        assert_eq!((stats.parked, stats.failing, stats.scheduled), (1, 1, 1));
        assert_eq!(
            store
                .next_due_times(std::slice::from_ref(&t))
                .await
                .unwrap(),
            [Some(next)]
        );

        let step = store.redrive_step(&t, 10).await.unwrap();
        assert_eq!((step.moved, step.remaining), (1, 0));
        let history = store.history(&t, None, 10).await.unwrap();
        let outcomes: Vec<(Outcome, &str)> =
            history.iter().map(|h| (h.outcome, h.id.as_str())).collect();
        assert_eq!(
            outcomes,
            [
                (Outcome::Redriven, "o"),
                (Outcome::Dispatched, "s"),
                (Outcome::Parked, "o"),
                (Outcome::Dispatched, "p"),
            ]
        );
        assert_eq!(history[1].detail, next.to_string());
        let of_s = store
            .history(&t, Some(&JobId::new("s").unwrap()), 10)
            .await
            .unwrap();
        assert_eq!(of_s.len(), 1);

        // history_max 0: outcomes happen, nothing is logged.
        let quiet = common::test_store().await;
        let quiet_store = quiet.store.clone().with_history_max(0);
        quiet_store
            .put(request(&t, "q", Due::NOW, PutMode::Keep))
            .await
            .unwrap();
        assert!(quiet_store
            .delete(&t, &JobId::new("q").unwrap())
            .await
            .unwrap());
        assert!(quiet_store.history(&t, None, 10).await.unwrap().is_empty());
    }
}
