//! The layout study: bytes per job, put and reserve+release rates of today's
//! record layout beside a more compact one, in the same run, on a private Redis (it
//! changes `hash-max-listpack-value`, and `used_memory` must count this run alone).
//!
//! The candidate keeps the records in many small hashes ("buckets", the id's bucket
//! from its SHA-1) that Redis can keep as listpacks (one allocation holding the entries
//! back to back) instead of one big hash (a dict entry, a field and a value allocation
//! per job). The scripts are prototypes in `layout/` (not `lua/`): only the calls that
//! decide a layout's cost, the same script for both layouts (`buckets` = 0 is today's).
//!
//! Sides, taking turns every slice (the first side rotates by slice and by round):
//! - `today`: the prototype on today's layout, the comparison's baseline;
//! - `buckets`: the prototype with buckets, `hash-max-listpack-value` raised to
//!   `--listpack-value` while it writes (a record must fit for its bucket to stay a
//!   listpack);
//! - `buckets_default_config`: the same at Redis's default (64 bytes), which a 100-byte
//!   body exceeds, so each bucket becomes a real hash table at its first job;
//! - `buckets_time_slots`: records in buckets as `buckets`, and the schedule too in small
//!   ZSETs, one per time slot (listpacks up to 128 entries), under an index of slots;
//! - `store`: the product's scripts through `Store` (history on), for reference.

use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use futures_util::{stream, StreamExt};
use redis::Value as Reply;
use redisched::job::{Due, Topic};
use serde_json::{json, Value};

use crate::bridge::common::{load_average, spread_text, Spread};
use crate::{job_id, Bench, PUT_BATCH};

const PUT: &str = include_str!("layout/put.lua");
const RESERVE: &str = include_str!("layout/reserve.lua");
const RELEASE: &str = include_str!("layout/release.lua");
const PUT_TIMED: &str = include_str!("layout/put_timed.lua");
const RESERVE_TIMED: &str = include_str!("layout/reserve_timed.lua");

/// Redis's default `hash-max-listpack-value`.
const DEFAULT_LISTPACK_VALUE: u64 = 64;
/// Jobs a bucket holds on average; `hash-max-listpack-entries` (default 512) is the
/// most a listpack bucket may hold.
const JOBS_PER_BUCKET: u64 = 256;
/// Jobs a time slot holds on average when due times spread evenly over the hour the
/// waiting jobs span; `zset-max-listpack-entries` (default 128) is the most a listpack
/// slot may hold.
const JOBS_PER_SLOT: u64 = 64;
const SPAN_MS: u64 = 3_600_000;

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Side {
    Today,
    Buckets,
    BucketsDefaultConfig,
    BucketsTimeSlots,
    Store,
}

impl Side {
    const ALL: [Side; 5] = [
        Side::Today,
        Side::Buckets,
        Side::BucketsDefaultConfig,
        Side::BucketsTimeSlots,
        Side::Store,
    ];

    fn name(self) -> &'static str {
        match self {
            Side::Today => "today",
            Side::Buckets => "buckets",
            Side::BucketsDefaultConfig => "buckets_default_config",
            Side::BucketsTimeSlots => "buckets_time_slots",
            Side::Store => "store",
        }
    }

    fn bucketed(self) -> bool {
        matches!(
            self,
            Side::Buckets | Side::BucketsDefaultConfig | Side::BucketsTimeSlots
        )
    }
}

/// Buckets for a topic of `jobs`: a power of two near `jobs / JOBS_PER_BUCKET`.
fn buckets_for(jobs: u64) -> u64 {
    (jobs / JOBS_PER_BUCKET).max(1).next_power_of_two()
}

/// Slot width (ms) for `jobs` due over [`SPAN_MS`]. Jobs due at once (the due topic)
/// crowd one slot whatever the width: a burst is one big ZSET, as today.
fn slot_width_for(jobs: u64) -> u64 {
    (JOBS_PER_SLOT * SPAN_MS / jobs.max(1)).max(1)
}

struct Scripts {
    put: String,
    reserve: String,
    release: String,
    put_timed: String,
    reserve_timed: String,
}

struct Lane {
    side: Side,
    waiting: Topic,
    due: Topic,
    put: Duration,
    memory: i64,
    drain: Duration,
    moved: u64,
}

pub(crate) struct Study<'a> {
    pub bench: &'a Bench,
    pub jobs: u64,
    pub due_jobs: u64,
    pub slice: u64,
    pub rounds: usize,
    pub listpack_value: u64,
}

impl Study<'_> {
    pub(crate) async fn run(&self) -> Result<Value> {
        let bench = self.bench;
        let mut conn = bench.conn.clone();
        let load = |source: &str| {
            let mut cmd = redis::cmd("SCRIPT");
            cmd.arg("LOAD").arg(source);
            cmd
        };
        let scripts = Scripts {
            put: load(PUT).query_async(&mut conn).await?,
            reserve: load(RESERVE).query_async(&mut conn).await?,
            release: load(RELEASE).query_async(&mut conn).await?,
            put_timed: load(PUT_TIMED).query_async(&mut conn).await?,
            reserve_timed: load(RESERVE_TIMED).query_async(&mut conn).await?,
        };
        let load_before = load_average();
        let mut rounds = Vec::new();
        for round in 0..self.rounds.max(1) {
            eprintln!(
                "layout round {}/{}: {} waiting jobs per side, then {} due jobs reserved and released, slices of {}",
                round + 1,
                self.rounds,
                self.jobs,
                self.due_jobs,
                self.slice
            );
            rounds.push(self.round(round, &scripts).await?);
        }
        self.set_listpack_value(DEFAULT_LISTPACK_VALUE).await?;
        let load_after = load_average();
        Ok(self.summarize(rounds, (load_before, load_after)))
    }

    async fn round(&self, round: usize, scripts: &Scripts) -> Result<Value> {
        let mut lanes: Vec<Lane> = Side::ALL
            .iter()
            .map(|&side| {
                Ok(Lane {
                    side,
                    waiting: Topic::new(format!("layout.{}.{round}.waiting", side.name()))?,
                    due: Topic::new(format!("layout.{}.{round}.due", side.name()))?,
                    put: Duration::ZERO,
                    memory: 0,
                    drain: Duration::ZERO,
                    moved: 0,
                })
            })
            .collect::<Result<_>>()?;
        let later = |i: u64| 3_600_000 + ((i * 7_919) % 3_600_000) as i64;

        // Waiting jobs: put rate and memory, a slice per side in turn.
        let mut from = 0;
        let mut slice = 0usize;
        while from < self.jobs {
            let to = (from + self.slice).min(self.jobs);
            for k in 0..lanes.len() {
                let count = lanes.len();
                let lane = &mut lanes[(slice + round + k) % count];
                self.configure(lane.side).await?;
                let before = self.bench.used_memory().await?;
                let took = self
                    .put(
                        lane.side,
                        scripts,
                        &lane.waiting,
                        from,
                        to,
                        self.jobs,
                        later,
                    )
                    .await?;
                lane.memory += self.bench.used_memory().await? - before;
                lane.put += took;
            }
            from = to;
            slice += 1;
        }

        // Due jobs: reserve+release rate, a slice per side in turn.
        let mut from = 0;
        while from < self.due_jobs {
            let to = (from + self.slice).min(self.due_jobs);
            for k in 0..lanes.len() {
                let count = lanes.len();
                let lane = &mut lanes[(slice + round + k) % count];
                self.configure(lane.side).await?;
                self.put(
                    lane.side,
                    scripts,
                    &lane.due,
                    from,
                    to,
                    self.due_jobs,
                    |_| 0,
                )
                .await?;
                let started = Instant::now();
                let moved = self.drain(lane.side, scripts, &lane.due).await?;
                lane.drain += started.elapsed();
                lane.moved += moved;
                if moved != to - from {
                    bail!(
                        "{}: reserved and released {moved} of {}",
                        lane.side.name(),
                        to - from
                    );
                }
            }
            from = to;
            slice += 1;
        }

        let mut result = json!({ "round": round + 1 });
        for lane in &lanes {
            let keys = self.keys_of(&lane.waiting).await?;
            let mut usage = 0i64;
            let (mut listpacks, mut tables) = (0u64, 0u64);
            let (mut slots, mut big_slots) = (0u64, 0u64);
            let mut stored = 0u64;
            for key in &keys {
                usage += self.bench.memory_usage(key, self.jobs).await?;
                let is_bucket = key.contains(":jobs:");
                let is_slot = key.contains(":scheduled:");
                if is_bucket || is_slot {
                    let encoding: String = redis::cmd("OBJECT")
                        .arg("ENCODING")
                        .arg(key)
                        .query_async(&mut self.bench.conn.clone())
                        .await?;
                    let compact = encoding == "listpack";
                    match (is_bucket, compact) {
                        (true, true) => listpacks += 1,
                        (true, false) => tables += 1,
                        (false, compact) => {
                            slots += 1;
                            big_slots += u64::from(!compact);
                        }
                    }
                }
                if is_slot || (key.ends_with(":scheduled") && lane.side != Side::BucketsTimeSlots) {
                    stored += redis::cmd("ZCARD")
                        .arg(key)
                        .query_async::<u64>(&mut self.bench.conn.clone())
                        .await?;
                }
            }
            if stored != self.jobs {
                bail!(
                    "{}: {stored} of {} waiting jobs stored",
                    lane.side.name(),
                    self.jobs
                );
            }
            let per_job = lane.memory as f64 / self.jobs as f64;
            let id_and_body = (crate::ID_BYTES + self.bench.body.len()) as f64;
            result[lane.side.name()] = json!({
                "put_per_s": (self.jobs as f64 / lane.put.as_secs_f64().max(1e-9)).round(),
                "reserve_release_per_s": (lane.moved as f64 / lane.drain.as_secs_f64().max(1e-9)).round(),
                "bytes_per_job": per_job,
                "overhead_per_job": per_job - id_and_body,
                "memory_usage_bytes_per_job": usage as f64 / self.jobs as f64,
                "keys": keys.len(),
                "buckets": if lane.side.bucketed() { json!(buckets_for(self.jobs)) } else { Value::Null },
                "buckets_listpack": if lane.side.bucketed() { json!(listpacks) } else { Value::Null },
                "buckets_hashtable": if lane.side.bucketed() { json!(tables) } else { Value::Null },
                "time_slots": if lane.side == Side::BucketsTimeSlots { json!(slots) } else { Value::Null },
                "time_slots_skiplist": if lane.side == Side::BucketsTimeSlots { json!(big_slots) } else { Value::Null },
            });
            let mut all = keys;
            all.extend(self.keys_of(&lane.due).await?);
            for chunk in all.chunks(1000) {
                let _: u64 = redis::cmd("UNLINK")
                    .arg(chunk)
                    .query_async(&mut self.bench.conn.clone())
                    .await?;
            }
        }
        eprintln!(
            "  round {}: bytes/job today {:.1} buckets {:.1}; put/s today {} buckets {}; reserve+release/s today {} buckets {}",
            round + 1,
            result["today"]["bytes_per_job"].as_f64().unwrap_or(f64::NAN),
            result["buckets"]["bytes_per_job"].as_f64().unwrap_or(f64::NAN),
            result["today"]["put_per_s"],
            result["buckets"]["put_per_s"],
            result["today"]["reserve_release_per_s"],
            result["buckets"]["reserve_release_per_s"],
        );
        Ok(result)
    }

    /// The server setting the side writes under.
    async fn configure(&self, side: Side) -> Result<()> {
        let value = match side {
            Side::Buckets | Side::BucketsTimeSlots => self.listpack_value,
            _ => DEFAULT_LISTPACK_VALUE,
        };
        self.set_listpack_value(value).await
    }

    async fn set_listpack_value(&self, value: u64) -> Result<()> {
        let _: () = redis::cmd("CONFIG")
            .arg("SET")
            .arg("hash-max-listpack-value")
            .arg(value)
            .query_async(&mut self.bench.conn.clone())
            .await
            .context("CONFIG SET hash-max-listpack-value")?;
        Ok(())
    }

    fn buckets_arg(side: Side, topic_jobs: u64) -> u64 {
        if side.bucketed() {
            buckets_for(topic_jobs)
        } else {
            0
        }
    }

    /// Puts jobs `from..to` of a topic that will hold `topic_jobs`; returns the time of
    /// the calls alone (the prototypes' pipelines are built before the clock starts, the
    /// store builds its own while timed, as in the store bench).
    #[allow(clippy::too_many_arguments)]
    async fn put(
        &self,
        side: Side,
        scripts: &Scripts,
        topic: &Topic,
        from: u64,
        to: u64,
        topic_jobs: u64,
        delay: impl Fn(u64) -> i64,
    ) -> Result<Duration> {
        let bench = self.bench;
        if side == Side::Store {
            return bench
                .put_range(topic, "job", from, to, |n| Due::Delay(delay(n)))
                .await;
        }
        let keys = bench.store.keys().topic(topic).0;
        let buckets = Self::buckets_arg(side, topic_jobs);
        let (script, width) = match side {
            Side::BucketsTimeSlots => (&scripts.put_timed, slot_width_for(topic_jobs)),
            _ => (&scripts.put, 0),
        };
        let mut pipes = Vec::new();
        let mut start = from;
        while start < to {
            let end = (start + PUT_BATCH as u64).min(to);
            let mut pipe = redis::pipe();
            for n in start..end {
                pipe.cmd("EVALSHA")
                    .arg(script)
                    .arg(keys.len())
                    .arg(&keys[..])
                    .arg(job_id("job", n)?.as_str())
                    .arg(&bench.body[..])
                    .arg(delay(n))
                    .arg(buckets)
                    .arg(width);
            }
            pipes.push(pipe);
            start = end;
        }
        let started = Instant::now();
        let mut results = stream::iter(pipes.iter().map(|pipe| {
            let mut conn = bench.conn.clone();
            async move { pipe.query_async::<Vec<i64>>(&mut conn).await }
        }))
        .buffer_unordered(bench.in_flight);
        while let Some(result) = results.next().await {
            if result?.iter().any(|stored| *stored != 1) {
                bail!("{}: a put found its id taken", side.name());
            }
        }
        Ok(started.elapsed())
    }

    /// The bridge's loop, two workers: reserve up to 1000, release them, until nothing
    /// is due. Returns the jobs released.
    async fn drain(&self, side: Side, scripts: &Scripts, topic: &Topic) -> Result<u64> {
        let bench = self.bench;
        if side == Side::Store {
            let (moved, _) = bench.drain(topic, 2, 0).await?;
            return Ok(moved);
        }
        let keys = bench.store.keys().topic(topic).0;
        let buckets = Self::buckets_arg(side, self.due_jobs);
        let (reserve, width) = match side {
            Side::BucketsTimeSlots => (&scripts.reserve_timed, slot_width_for(self.due_jobs)),
            _ => (&scripts.reserve, 0),
        };
        let worker = |_| {
            let keys = &keys;
            async move {
                let mut conn = bench.conn.clone();
                let mut moved = 0u64;
                loop {
                    let taken: Vec<Vec<Reply>> = redis::cmd("EVALSHA")
                        .arg(reserve)
                        .arg(keys.len())
                        .arg(&keys[..])
                        .arg(600_000)
                        .arg(1000)
                        .arg(buckets)
                        .arg(width)
                        .query_async(&mut conn)
                        .await?;
                    if taken.is_empty() {
                        return Ok::<u64, anyhow::Error>(moved);
                    }
                    let mut release = redis::cmd("EVALSHA");
                    release
                        .arg(&scripts.release)
                        .arg(keys.len())
                        .arg(&keys[..])
                        .arg(buckets);
                    for job in &taken {
                        match (job.first(), job.get(3)) {
                            (Some(Reply::BulkString(id)), Some(Reply::Int(token))) => {
                                release.arg(&id[..]).arg(*token);
                            }
                            _ => bail!("reserve reply without id and token: {job:?}"),
                        }
                    }
                    let released: u64 = release.query_async(&mut conn).await?;
                    if released != taken.len() as u64 {
                        bail!("released {released} of {} reserved", taken.len());
                    }
                    moved += released;
                }
            }
        };
        let counts = futures_util::future::try_join_all((0..2).map(worker)).await?;
        Ok(counts.iter().sum())
    }

    /// Every key of a topic (the bucket hashes included).
    async fn keys_of(&self, topic: &Topic) -> Result<Vec<String>> {
        let base = &self.bench.store.keys().topic(topic).0[0];
        let pattern = match base.rfind(':') {
            Some(end) => format!("{}:*", &base[..end]),
            None => bail!("unexpected key name {base}"),
        };
        let mut keys = Vec::new();
        let mut cursor = 0u64;
        loop {
            let (next, batch): (u64, Vec<String>) = redis::cmd("SCAN")
                .arg(cursor)
                .arg("MATCH")
                .arg(&pattern)
                .arg("COUNT")
                .arg(1000)
                .query_async(&mut self.bench.conn.clone())
                .await?;
            keys.extend(batch);
            if next == 0 {
                return Ok(keys);
            }
            cursor = next;
        }
    }

    fn summarize(&self, rounds: Vec<Value>, (before, after): (Value, Value)) -> Value {
        let spread = |values: Vec<f64>, decimals: i32| {
            Spread::of(&values).map_or(Value::Null, |s| s.to_json(decimals))
        };
        let field = |side: &str, name: &str| -> Vec<f64> {
            rounds
                .iter()
                .filter_map(|r| r[side][name].as_f64())
                .collect()
        };
        let paired = |side: &str, name: &str| -> Vec<f64> {
            rounds
                .iter()
                .filter_map(|r| Some(r[side][name].as_f64()? / r["today"][name].as_f64()?))
                .collect()
        };
        let mut sides = json!({});
        let mut ratios = json!({});
        for side in Side::ALL {
            let n = side.name();
            sides[n] = json!({
                "put_per_s": spread(field(n, "put_per_s"), 0),
                "reserve_release_per_s": spread(field(n, "reserve_release_per_s"), 0),
                "bytes_per_job": spread(field(n, "bytes_per_job"), 1),
                "overhead_per_job": spread(field(n, "overhead_per_job"), 1),
                "memory_usage_bytes_per_job": spread(field(n, "memory_usage_bytes_per_job"), 1),
                "buckets_hashtable": spread(field(n, "buckets_hashtable"), 0),
                "time_slots": spread(field(n, "time_slots"), 0),
                "time_slots_skiplist": spread(field(n, "time_slots_skiplist"), 0),
            });
            ratios[n] = json!({
                "put": spread(paired(n, "put_per_s"), 3),
                "reserve_release": spread(paired(n, "reserve_release_per_s"), 3),
                "bytes": spread(paired(n, "bytes_per_job"), 3),
            });
        }
        // The bar: at least 25 % fewer bytes, at most 10 % less throughput.
        let median = |v: &Value| v["median"].as_f64().unwrap_or(f64::NAN);
        let mut verdicts = json!({});
        for side in [Side::Buckets, Side::BucketsTimeSlots] {
            let q = &ratios[side.name()];
            let saving = 1.0 - median(&q["bytes"]);
            verdicts[side.name()] = json!({
                "bytes_saved": saving,
                "meets_adoption_bar": saving >= 0.25
                    && median(&q["put"]) >= 0.9
                    && median(&q["reserve_release"]) >= 0.9,
            });
        }
        json!({
            "jobs_per_side": self.jobs,
            "due_jobs_per_side": self.due_jobs,
            "slice_jobs": self.slice,
            "runs": rounds.len(),
            "body_bytes": self.bench.body.len(),
            "id_bytes": crate::ID_BYTES,
            "buckets_waiting": buckets_for(self.jobs),
            "buckets_due": buckets_for(self.due_jobs),
            "slot_width_ms_waiting": slot_width_for(self.jobs),
            "slot_width_ms_due": slot_width_for(self.due_jobs),
            "listpack_value": self.listpack_value,
            "sides": sides,
            "ratios_vs_today": ratios,
            "verdicts": verdicts,
            "load_average": { "before": before, "after": after },
            "rounds": rounds,
        })
    }
}

pub(crate) fn print_table(r: &Value) {
    println!();
    println!(
        "layout study: {} rounds, {} waiting + {} due jobs per side and round, {}-byte bodies, {}-byte ids; buckets {} (waiting) / {} (due); time slots of {} ms (waiting) / {} ms (due); hash-max-listpack-value {} for the compact sides; load average before {} after {}",
        r["runs"], r["jobs_per_side"], r["due_jobs_per_side"], r["body_bytes"], r["id_bytes"],
        r["buckets_waiting"], r["buckets_due"], r["slot_width_ms_waiting"], r["slot_width_ms_due"],
        r["listpack_value"], r["load_average"]["before"], r["load_average"]["after"]
    );
    let sides = [
        "today",
        "buckets",
        "buckets_default_config",
        "buckets_time_slots",
        "store",
    ];
    println!("median (min–max) | today (prototype) | buckets | buckets, default config | buckets + time slots | store (product) |");
    println!("|---|---:|---:|---:|---:|---:|");
    let s = &r["sides"];
    let q = &r["ratios_vs_today"];
    for (label, name, decimals) in [
        ("bytes/job (INFO used_memory delta)", "bytes_per_job", 1),
        ("beyond body + id", "overhead_per_job", 1),
        (
            "MEMORY USAGE of the keys / jobs",
            "memory_usage_bytes_per_job",
            1,
        ),
        (
            "record buckets that became hash tables",
            "buckets_hashtable",
            0,
        ),
        ("time slots / of them skip lists", "time_slots", 0),
        ("put, jobs/s", "put_per_s", 0),
        ("reserve+release, jobs/s", "reserve_release_per_s", 0),
    ] {
        let cells: Vec<String> = sides
            .iter()
            .map(|side| {
                let text = spread_text(&s[*side][name], decimals);
                if name == "time_slots" && s[*side][name].is_object() {
                    format!(
                        "{text} / {}",
                        spread_text(&s[*side]["time_slots_skiplist"], 0)
                    )
                } else {
                    text
                }
            })
            .collect();
        println!("| {label} | {} |", cells.join(" | "));
    }
    for (label, name) in [
        ("bytes / today (paired per round)", "bytes"),
        ("put rate / today", "put"),
        ("reserve+release rate / today", "reserve_release"),
    ] {
        let cells: Vec<String> = sides
            .iter()
            .map(|side| spread_text(&q[*side][name], 3))
            .collect();
        println!("| {label} | {} |", cells.join(" | "));
    }
    for side in ["buckets", "buckets_time_slots"] {
        let v = &r["verdicts"][side];
        println!(
            "{side}: {:.1} % of bytes per job saved; adoption bar (>= 25 % saved, <= 10 % slower): {}",
            100.0 * v["bytes_saved"].as_f64().unwrap_or(f64::NAN),
            if v["meets_adoption_bar"].as_bool() == Some(true) {
                "met"
            } else {
                "not met"
            }
        );
    }
}
