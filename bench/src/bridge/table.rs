//! The printed summary: a header saying when, where and on what the run happened, then
//! one row per figure beside its same-run ceiling. It prints a single run's report or
//! the summary of `all --runs N` alike: a figure that is a spread prints as
//! `median (min–max)`.

use serde_json::Value;

/// The header lines: dates (UTC), commit, versions, machine and load average.
pub(super) fn print_header(report: &Value) {
    let c = &report["context"];
    let text = |v: &Value| v.as_str().unwrap_or("unknown").to_string();
    let loads = |v: &Value| {
        v.as_array()
            .map(|a| {
                a.iter()
                    .map(|x| x.to_string())
                    .collect::<Vec<_>>()
                    .join(" / ")
            })
            .unwrap_or_else(|| "unknown".into())
    };
    let m = &report["machine"];
    println!();
    println!(
        "redisched-bench, {} to {}, commit {}{}",
        text(&c["started_utc"]),
        text(&c["ended_utc"]),
        text(&c["git_commit"]),
        if c["git_dirty"].as_bool() == Some(true) {
            " (with uncommitted changes)"
        } else {
            ""
        }
    );
    println!(
        "Redis {}, RabbitMQ {}, {} CPUs ({}), load average (1/5/15 min) at start {}, at end {}",
        text(&c["versions"]["redis"]),
        text(&c["versions"]["rabbitmq"]),
        m["cpus"],
        text(&m["cpu_model"]),
        loads(&c["load_average"]["start"]),
        loads(&c["load_average"]["end"])
    );
    println!("command: {}", text(&report["command"]));
    if let Some(runs) = report["runs"].as_u64().filter(|r| *r > 1) {
        println!(
            "{runs} rounds, every scenario once per round; every figure is median (min–max) of the rounds"
        );
    }
    let took = &report["summary"]["scenario_seconds"];
    if let Some(scenarios) = took.as_object() {
        let each: Vec<String> = scenarios
            .iter()
            .map(|(name, s)| format!("{name} {} s", num(s)))
            .collect();
        println!("seconds per round: {}", each.join(", "));
    }
}

/// Formats a figure, or a spread of it as `median (min–max)` (just the value if the
/// rounds agree); `-` if absent.
pub(super) fn figure(v: &Value, format: impl Fn(f64) -> String) -> String {
    if let Some(x) = v.as_f64() {
        return format(x);
    }
    match (v["median"].as_f64(), v["min"].as_f64(), v["max"].as_f64()) {
        (Some(m), Some(lo), Some(hi)) if lo == hi => format(m),
        (Some(m), Some(lo), Some(hi)) => {
            format!("{} ({}–{})", format(m), format(lo), format(hi))
        }
        _ => "-".into(),
    }
}

pub(super) fn number(x: f64) -> String {
    if x.abs() >= 1_000.0 {
        let s = format!("{:.0}", x.abs());
        let mut out = String::from(if x < 0.0 { "-" } else { "" });
        for (i, c) in s.chars().enumerate() {
            if i > 0 && (s.len() - i).is_multiple_of(3) {
                out.push(',');
            }
            out.push(c);
        }
        out
    } else if x.fract() == 0.0 || x.abs() >= 100.0 {
        format!("{x:.0}")
    } else {
        format!("{x:.2}")
    }
}

/// A spread (or a plain figure) with `decimals` digits and no thousands separators.
fn spread_text(v: &Value, decimals: usize) -> String {
    figure(v, |x| format!("{x:.decimals$}"))
}

fn num(v: &Value) -> String {
    figure(v, number)
}

fn pct(v: &Value) -> String {
    figure(v, |x| format!("{:.0}%", x * 100.0))
}

fn kib_to_mib(v: &Value) -> String {
    figure(v, |k| format!("{:.1}", k / 1024.0))
}

/// `p50 / p99 / p99.9 / max` of a lateness figure.
fn percentiles(l: &Value) -> String {
    format!(
        "{} / {} / {} / {}",
        num(&l["p50_ms"]),
        num(&l["p99_ms"]),
        num(&l["p999_ms"]),
        num(&l["max_ms"])
    )
}

pub(super) fn print_table(r: &Value) {
    let mut rows: Vec<[String; 5]> = Vec::new();
    let st = &r["store"];
    if st.is_object() {
        rows.push([
            format!(
                "store: put, pipelined ({} jobs waiting; jobs/s)",
                num(&st["jobs"])
            ),
            num(&st["put_per_s"]),
            format!(
                "{} (ZADD+HSET script)",
                num(&st["ceilings"]["zadd_hset_script_per_s"])
            ),
            figure(&st["ratios"]["put_vs_zadd_hset"], |x| format!("{x:.2}")),
            ">= 0.6 (goal)".into(),
        ]);
        rows.push([
            "store: reserve+release, batches of 1000 (jobs/s)".into(),
            num(&st["reserve_release_per_s"]),
            format!(
                "{} (ZADD+HSET script)",
                num(&st["ceilings"]["zadd_hset_script_per_s"])
            ),
            figure(&st["ratios"]["reserve_release_vs_zadd_hset"], |x| {
                format!("{x:.2}")
            }),
            "-".into(),
        ]);
        if let Some(m) = st["memory"].as_array().and_then(|a| a.last()) {
            rows.push([
                format!(
                    "store: Redis bytes per waiting job at {} jobs (INFO delta; beyond body + id)",
                    num(&m["jobs"])
                ),
                format!(
                    "{} ({})",
                    num(&m["bytes_per_job"]),
                    num(&m["overhead_per_job"])
                ),
                "-".into(),
                "-".into(),
                "<= 200 beyond".into(),
            ]);
        }
    }
    let d = &r["dispatch"];
    if d.is_object() {
        rows.push([
            format!(
                "dispatch, {} due jobs of {} B (jobs/s)",
                num(&d["jobs"]),
                num(&d["body_bytes"])
            ),
            num(&d["bridge"]["jobs_per_s"]),
            format!(
                "{} (lapin confirmed publish, window {})",
                num(&d["ceiling"]["msgs_per_s"]),
                num(&d["window"])
            ),
            pct(&d["ratio"]),
            ">= 80%".into(),
        ]);
        let best = &d["best_publisher"];
        if best.is_object() {
            rows.push([
                "dispatch vs the broker's best confirmed persistent publisher (jobs/s)".into(),
                num(&d["bridge"]["jobs_per_s"]),
                format!(
                    "{} (best of 1, 2, 4, 8 publishers: {}, window {} each)",
                    num(&best["msgs_per_s"]),
                    num(&best["publishers"]),
                    num(&best["window_per_publisher"])
                ),
                pct(&d["ratio_to_best_publisher"]),
                "-".into(),
            ]);
        }
        rows.push([
            "bridge RSS while dispatching (peak / idle after)".into(),
            format!(
                "{} / {} MiB",
                kib_to_mib(&d["bridge_rss_kib"]["peak_while_dispatching"]),
                kib_to_mib(&d["bridge_rss_kib"]["idle_after"])
            ),
            "-".into(),
            "-".into(),
            "-".into(),
        ]);
        let h = &d["history"];
        for side in ["on", "off"] {
            let s = &h["sides"][side];
            if s.is_object() {
                rows.push([
                    format!(
                        "dispatch, history {side} (history.max_per_topic = {}), passes: {} (jobs/s)",
                        num(&s["history_max"]),
                        num(&s["jobs_per_s"]["runs"])
                    ),
                    spread_text(&s["jobs_per_s"], 0),
                    format!("{} (mean of before and after)", num(&d["ceiling"]["msgs_per_s"])),
                    spread_text(&s["vs_ceiling"], 2),
                    "-".into(),
                ]);
            }
        }
        if h["ratio_on_off"]["jobs_per_s"].is_object() {
            rows.push([
                "dispatch ratio history on / off, paired per round".into(),
                spread_text(&h["ratio_on_off"]["jobs_per_s"], 3),
                format!(
                    "after the first delivery: {}",
                    spread_text(&h["ratio_on_off"]["jobs_per_s_after_first_delivery"], 3)
                ),
                "-".into(),
                ">= 0.90 (goal)".into(),
            ]);
        }
    }
    let i = &r["ingest"];
    if i.is_object() {
        rows.push([
            format!("ingest, {} waiting puts (commands/s)", num(&i["commands"])),
            num(&i["bridge"]["commands_per_s"]),
            format!(
                "{} (consume + ack each, prefetch {}); {} with multiple-ack/100; {} with that and a bare ZADD+HSET script per command",
                num(&i["ceiling"]["one_ack_per_message_per_s"]),
                num(&i["prefetch"]),
                num(&i["ceiling"]["multiple_ack_per_100_per_s"]),
                num(&i["ceiling"]["multiple_ack_and_redis_per_100_per_s"])
            ),
            format!(
                "{} ({} of multiple-ack, {} of it with Redis writes)",
                pct(&i["ratio"]),
                pct(&i["ratio_to_multiple_ack"]),
                pct(&i["ratio_to_redis_ceiling"])
            ),
            ">= 80% of multiple-ack with Redis writes (goal)".into(),
        ]);
    }
    for rate in r["precision"]["rates"].as_array().into_iter().flatten() {
        let per_s = num(&rate["rate_per_s"]);
        let l = &rate["lateness_ms"];
        rows.push([
            format!(
                "lateness at {per_s}/s vs x-redisched-due-at (ms: p50 / p99 / p99.9 / max; early)"
            ),
            format!("{}; {} early", percentiles(l), num(&l["early"])),
            format!(
                "{} (one hop: timer -> publish -> consume)",
                percentiles(&rate["floor_lateness_ms"])
            ),
            "-".into(),
            "0 early".into(),
        ]);
        let p = &rate["lateness_producer_clock_ms"];
        if p.is_object() {
            rows.push([
                format!(
                    "lateness at {per_s}/s vs the producer's clock, publish + x-delay (ms: p50 / p99 / p99.9 / max; early)"
                ),
                format!("{}; {} early", percentiles(p), num(&p["early"])),
                format!(
                    "{} (two hops: publish -> queue -> timer -> publish -> consume, no Redis)",
                    percentiles(&rate["floor_two_hop_lateness_ms"])
                ),
                "-".into(),
                match rate["target_p99_ms"].is_null() {
                    false => format!("p99 <= {} ms, 0 early", num(&rate["target_p99_ms"])),
                    true => "0 early".into(),
                },
            ]);
        }
        let busy = |b: &Value| {
            format!(
                "{} / {} / {} / {}; machine idle {}, system {}",
                num(&b["bridge"]),
                num(&b["redis"]),
                num(&b["rabbitmq"]),
                num(&b["bench_process"]),
                pct(&b["machine_idle"]),
                pct(&b["machine_system"])
            )
        };
        if rate["cores_busy"].is_object() {
            rows.push([
                format!(
                    "cores busy during the {per_s}/s pass (bridge / Redis / RabbitMQ / bench process, of {}; the machine's idle and system time)",
                    num(&rate["cores_busy"]["machine_cores"])
                ),
                busy(&rate["cores_busy"]),
                format!("{} (the floor's pass; no bridge)", busy(&rate["floor_cores_busy"])),
                "-".into(),
                "-".into(),
            ]);
        }
    }
    let c = &r["cancel"];
    if c.is_object() {
        rows.push([
            "cancel via delete.lua, Store::apply batches (deletes/s)".into(),
            num(&c["lua"]["deletes_per_s"]),
            format!(
                "{} (raw ZREM+HDEL pipelined)",
                num(&c["lua"]["ceiling"]["deletes_per_s"])
            ),
            pct(&c["lua"]["ratio"]),
            "-".into(),
        ]);
        rows.push([
            "cancel via AMQP delete commands (deletes/s)".into(),
            num(&c["amqp"]["bridge"]["commands_per_s"]),
            format!(
                "{} (consume + ack each)",
                num(&c["amqp"]["ceiling"]["one_ack_per_message_per_s"])
            ),
            pct(&c["amqp"]["ratio"]),
            "-".into(),
        ]);
    }
    let k = &r["catchup"];
    if k.is_object() {
        rows.push([
            format!(
                "catch-up: {} jobs due at once over {} topic(s), drained (jobs/s)",
                num(&k["jobs"]),
                num(&k["topics"])
            ),
            num(&k["drain"]["jobs_per_s"]),
            format!(
                "{} (the dispatch ceiling, {} messages a run)",
                num(&k["ceiling"]["msgs_per_s"]),
                num(&k["ceiling"]["messages_per_run"])
            ),
            pct(&k["ratio"]),
            ">= 80%".into(),
        ]);
        let o = &k["on_time"];
        for (clock, key) in [
            ("x-redisched-due-at", "lateness_ms"),
            ("the producer's clock", "lateness_producer_clock_ms"),
        ] {
            rows.push([
                format!(
                    "catch-up: on-time topic ({}/s, delays 0-{} ms) while draining, {} jobs, vs {clock} (ms: p50 / p99 / p99.9 / max; early)",
                    num(&o["rate_per_s"]),
                    num(&o["max_delay_ms"]),
                    num(&o["measured"])
                ),
                format!("{}; {} early", percentiles(&o[key]), num(&o[key]["early"])),
                "-".into(),
                "-".into(),
                format!("p99 <= {} ms", num(&o["target_p99_ms"])),
            ]);
        }
    }
    let w = &r["webhook"];
    if w.is_object() {
        let t = &w["throughput"];
        rows.push([
            format!(
                "webhook: {} due jobs of {} B POSTed to a local receiver, max_in_flight {} (jobs/s; after the first delivery)",
                num(&w["jobs"]),
                num(&w["body_bytes"]),
                num(&w["max_in_flight"])
            ),
            format!(
                "{}; {}",
                num(&t["bridge_jobs_per_s"]),
                num(&t["bridge_jobs_per_s_after_first_delivery"])
            ),
            format!(
                "{} (plain reqwest client, {} at once, same receiver)",
                num(&t["plain_client_per_s"]),
                num(&w["max_in_flight"])
            ),
            format!(
                "{}; {}",
                pct(&t["ratio"]),
                pct(&t["ratio_after_first_delivery"])
            ),
            ">= 80%".into(),
        ]);
        rows.push([
            "webhook: the bookkeeping floor of the same rounds: the plain client's requests plus only the bare Redis commands per job (jobs/s)".into(),
            num(&t["bookkeeping_floor_per_s"]),
            format!("{} (the plain client above)", num(&t["plain_client_per_s"])),
            pct(&t["bookkeeping_floor_ratio"]),
            "- (what a Redis-backed dispatcher can reach here)".into(),
        ]);
        let l = &w["lateness"];
        let side = |s: &Value| {
            format!(
                "{} / {} / {}; {} early",
                num(&s["p50_ms"]),
                num(&s["p99_ms"]),
                num(&s["max_ms"]),
                num(&s["early"])
            )
        };
        rows.push([
            format!(
                "webhook: lateness at {}/s vs the producer's clock, {} s steady after a {} ms warm-up (ms: p50 / p99 / max)",
                num(&l["rate_per_s"]),
                num(&l["window_s"]),
                num(&l["warm_up_ms"])
            ),
            side(&l["bridge"]),
            format!("{} (one AMQP hop + one POST)", side(&l["floor"])),
            format!(
                "{} × the floor's p99",
                figure(&l["p99_vs_floor"], |x| format!("{x:.2}"))
            ),
            "p99 <= 2× floor, 0 early".into(),
        ]);
        let m = &w["memory"];
        rows.push([
            format!(
                "webhook: bridge RSS with {} requests held open {} ms by a slow receiver (MiB: idle / all open / peak; bytes per open request)",
                num(&m["in_flight"]),
                num(&m["hold_ms"])
            ),
            format!(
                "{} / {} / {}; {} B",
                kib_to_mib(&m["idle_kib"]),
                kib_to_mib(&m["all_in_flight_kib"]),
                kib_to_mib(&m["peak_kib"]),
                num(&m["bytes_per_request_in_flight"])
            ),
            format!("idle bridge, same run; {} open at most", num(&m["open_at_receiver_max"])),
            "-".into(),
            "-".into(),
        ]);
    }
    if !rows.is_empty() {
        println!("\n| scenario | redisched | ceiling (same run) | ratio | target |");
        println!("|---|---|---|---|---|");
        for row in &rows {
            println!("| {} |", row.join(" | "));
        }
    }
    print_peer(r);
}

fn print_peer(r: &Value) {
    let p = &r["peer"];
    if !p["add_remove_memory"].is_object() {
        return;
    }
    let (i, c) = (&r["ingest"], &r["cancel"]);
    let m = &p["add_remove_memory"];
    println!(
        "\n| peer, same Redis | redisched | BullMQ {} |",
        p["version"].as_str().unwrap_or("")
    );
    println!("|---|---|---|");
    println!(
        "| add (jobs/s) | {} via AMQP commands | {} (addBulk of 1,000) |",
        num(&i["bridge"]["commands_per_s"]),
        num(&m["add_per_s"])
    );
    println!(
        "| remove by id (jobs/s) | {} via delete.lua, {} via AMQP | {} (queue.remove) |",
        num(&c["lua"]["deletes_per_s"]),
        num(&c["amqp"]["bridge"]["commands_per_s"]),
        num(&m["remove_per_s"])
    );
    for rate in p["rates"].as_array().into_iter().flatten() {
        let ours = r["precision"]["rates"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|x| x["rate_per_s"] == rate["rate_per_s"]);
        let fmt = |l: &Value| {
            format!(
                "{} / {} / {}",
                num(&l["p50_ms"]),
                num(&l["p99_ms"]),
                num(&l["max_ms"])
            )
        };
        println!(
            "| lateness at {}/s (ms: p50 / p99 / max) | {} vs due-at, {} vs producer clock | {} |",
            num(&rate["rate_per_s"]),
            ours.map(|o| fmt(&o["lateness_ms"]))
                .unwrap_or_else(|| "-".into()),
            ours.map(|o| fmt(&o["lateness_producer_clock_ms"]))
                .unwrap_or_else(|| "-".into()),
            fmt(&rate["lateness_ms"])
        );
    }
    println!(
        "| Redis bytes per delayed job ({} B body, {} B id) | {} | {} (INFO delta), {} (MEMORY USAGE) |",
        num(&m["body_bytes"]),
        num(&m["id_bytes"]),
        r["store"]["memory"]
            .as_array()
            .and_then(|a| a.last())
            .map(|x| format!("{} (INFO delta at {} jobs)", num(&x["bytes_per_job"]), num(&x["jobs"])))
            .unwrap_or_else(|| "see the store bench".into()),
        num(&m["redis_bytes_per_job_info_delta"]),
        num(&m["redis_bytes_per_job_memory_usage"])
    );
}
