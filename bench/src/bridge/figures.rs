//! The figures of record, each beside the reference measured in the same round: what
//! `report` puts in the performance page's first table and what `compare` sets side by
//! side. Each is read from one round's report as a round of `all` holds it
//! (`{"dispatch": …, "precision": …, "peer": …, "store": …}`); a figure that is
//! already a spread (a scenario's own passes) counts with its median.

use serde_json::Value;

use super::table;

/// Reads one number from a round; `None` if the round did not measure it.
pub(super) type Read = Box<dyn Fn(&Value) -> Option<f64>>;

/// A measured quantity: its name (with its unit) and where a round holds it.
pub(super) struct Measure {
    pub label: String,
    pub read: Read,
    /// Fixed digits (lateness in ms), or 0: rounded as `table::number` does.
    pub decimals: usize,
}

impl Measure {
    /// A value, or a spread as `median (min–max)`, in this measure's digits.
    pub(super) fn show(&self, spread: &Value) -> String {
        show(spread, self.decimals)
    }
}

/// A value, or a spread as `median (min–max)`, with `decimals` fixed digits below 100
/// (0: as `table::number` rounds); from 100 on, whole numbers with thousands separators.
pub(super) fn show(spread: &Value, decimals: usize) -> String {
    table::figure(spread, |x| {
        if decimals == 0 || x.abs() >= 100.0 {
            table::number(x)
        } else {
            format!("{x:.decimals$}")
        }
    })
}

impl std::fmt::Debug for Measure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.label)
    }
}

/// redisched's figure beside its same-round reference (ceiling, floor or peer).
#[derive(Debug)]
pub(super) struct Figure {
    /// Names the figure across runs whose sizes (and so labels) differ.
    pub key: String,
    /// The report key of the scenario that measures redisched's side.
    pub scenario: &'static str,
    pub ours: Measure,
    pub reference: Measure,
}

impl Figure {
    /// redisched ÷ the reference in `round`, if both were measured.
    pub(super) fn ratio(&self, round: &Value) -> Option<f64> {
        let (ours, reference) = ((self.ours.read)(round)?, (self.reference.read)(round)?);
        (reference > 0.0).then(|| ours / reference)
    }
}

/// A number, or the median of a spread (`{median, min, max, runs}`).
pub(super) fn number(v: &Value) -> Option<f64> {
    v.as_f64().or_else(|| v.get("median")?.as_f64())
}

/// The number at `path` in `round`.
fn at(round: &Value, path: &[&str]) -> Option<f64> {
    number(path.iter().fold(round, |v, key| &v[*key]))
}

/// The item of `list` (one per rate) whose `rate_per_s` is `rate`.
fn at_rate(list: &Value, rate: u64) -> Option<&Value> {
    list.as_array()?
        .iter()
        .find(|item| number(&item["rate_per_s"]) == Some(rate as f64))
}

fn measure(label: impl Into<String>, path: &'static [&'static str]) -> Measure {
    Measure {
        label: label.into(),
        read: Box::new(move |round| at(round, path)),
        decimals: 0,
    }
}

/// The p99 (ms) of the lateness figure `key` at `rate` in the list at `list`.
fn p99_at(label: String, list: &'static [&'static str], rate: u64, key: &'static str) -> Measure {
    Measure {
        label,
        read: Box::new(move |round| {
            let item = at_rate(list.iter().fold(round, |v, k| &v[*k]), rate)?;
            number(&item[key]["p99_ms"])
        }),
        decimals: 2,
    }
}

/// The first of `rounds` that holds `path`, as text: sizes for the labels.
fn shown(rounds: &[Value], path: &[&str]) -> String {
    rounds
        .iter()
        .find_map(|r| at(r, path))
        .map_or_else(|| "?".into(), table::number)
}

/// The rates measured by `precision` in any of `rounds`, ascending.
fn precision_rates(rounds: &[Value]) -> Vec<u64> {
    let mut rates: Vec<u64> = rounds
        .iter()
        .flat_map(|r| {
            r["precision"]["rates"]
                .as_array()
                .cloned()
                .unwrap_or_default()
        })
        .filter_map(|item| number(&item["rate_per_s"]).map(|r| r as u64))
        .collect();
    rates.sort_unstable();
    rates.dedup();
    rates
}

/// Every figure of record, labelled with the sizes `rounds` used: throughput, lateness
/// and memory beside a ceiling, a floor or BullMQ on the same Redis; lateness beside
/// the broker's own two hops at 1,000/s only, so the page's table stays short.
pub(super) fn of_record(rounds: &[Value]) -> Vec<Figure> {
    let mut figures = throughput(rounds);
    figures.extend(lateness(rounds, Some(1000)));
    figures.push(bytes_per_job(rounds));
    figures.extend(webhook(rounds));
    figures
}

/// The figures `scenario` measures (its report key), lateness beside the two hops at
/// every rate measured: what `compare` sets side by side.
pub(super) fn of_scenario(scenario: &str, rounds: &[Value]) -> Vec<Figure> {
    let mut figures = throughput(rounds);
    figures.extend(lateness(rounds, None));
    figures.push(bytes_per_job(rounds));
    figures.extend(webhook(rounds));
    figures.retain(|f| f.scenario == scenario);
    figures
}

fn throughput(rounds: &[Value]) -> Vec<Figure> {
    let s = |path: &[&str]| shown(rounds, path);
    let dispatch = || {
        measure(
            format!(
                "dispatch: {} due jobs of {} B published with confirms and released (jobs/s)",
                s(&["dispatch", "jobs"]),
                s(&["dispatch", "body_bytes"])
            ),
            &["dispatch", "bridge", "jobs_per_s"],
        )
    };
    vec![
        Figure {
            key: "dispatch-vs-publisher".into(),
            scenario: "dispatch",
            ours: dispatch(),
            reference: measure(
                format!(
                    "a lapin publisher, persistent and confirmed, window {} (msgs/s)",
                    s(&["dispatch", "window"])
                ),
                &["dispatch", "ceiling", "msgs_per_s"],
            ),
        },
        Figure {
            key: "dispatch-vs-best-publisher".into(),
            scenario: "dispatch",
            ours: dispatch(),
            reference: measure(
                "the best of 1, 2, 4 or 8 such publishers (msgs/s)",
                &["dispatch", "best_publisher", "msgs_per_s"],
            ),
        },
        Figure {
            key: "ingest".into(),
            scenario: "ingest",
            ours: measure(
                format!(
                    "ingest: {} put commands applied and acked (commands/s)",
                    s(&["ingest", "commands"])
                ),
                &["ingest", "bridge", "commands_per_s"],
            ),
            reference: measure(
                "a lapin consumer acking per 100, with a bare ZADD+HSET script per command (msgs/s)",
                &["ingest", "ceiling", "multiple_ack_and_redis_per_100_per_s"],
            ),
        },
        Figure {
            key: "cancel".into(),
            scenario: "cancel",
            ours: measure(
                "cancel by id through delete.lua, batched (deletes/s)",
                &["cancel", "lua", "deletes_per_s"],
            ),
            reference: measure(
                "raw ZREM + HDEL, pipelined the same way (deletes/s)",
                &["cancel", "lua", "ceiling", "deletes_per_s"],
            ),
        },
        Figure {
            key: "catchup".into(),
            scenario: "catchup",
            ours: measure(
                format!(
                    "catch-up: {} jobs due at once, drained (jobs/s)",
                    s(&["catchup", "jobs"])
                ),
                &["catchup", "drain", "jobs_per_s"],
            ),
            reference: measure(
                "the dispatch ceiling's publisher (msgs/s)",
                &["catchup", "ceiling", "msgs_per_s"],
            ),
        },
    ]
}

/// Lateness beside BullMQ where it ran at the rate, and beside the two hops at
/// `two_hops_at` (every rate if `None`).
fn lateness(rounds: &[Value], two_hops_at: Option<u64>) -> Vec<Figure> {
    const RATES: &[&str] = &["precision", "rates"];
    let ours = |rate: u64| {
        p99_at(
            format!(
                "lateness p99 at {}/s, delays 0–{} ms, vs the producer's clock (ms)",
                table::number(rate as f64),
                shown(rounds, &["precision", "max_delay_ms"])
            ),
            RATES,
            rate,
            "lateness_producer_clock_ms",
        )
    };
    let mut figures = Vec::new();
    for rate in precision_rates(rounds) {
        let with_peer = rounds
            .iter()
            .any(|r| at_rate(&r["peer"]["rates"], rate).is_some());
        if with_peer {
            figures.push(Figure {
                key: format!("lateness-{rate}-vs-bullmq"),
                scenario: "precision",
                ours: ours(rate),
                reference: p99_at(
                    format!(
                        "BullMQ {}, same Redis, same schedule (ms)",
                        peer_version(rounds)
                    ),
                    &["peer", "rates"],
                    rate,
                    "lateness_ms",
                ),
            });
        }
        if two_hops_at.is_none_or(|at| at == rate) {
            figures.push(Figure {
                key: format!("lateness-{rate}-vs-two-hops"),
                scenario: "precision",
                ours: ours(rate),
                reference: p99_at(
                    "two broker hops and a timer, no Redis (ms)".into(),
                    RATES,
                    rate,
                    "floor_two_hop_lateness_ms",
                ),
            });
        }
    }
    figures
}

/// Redis memory per waiting job: the store's largest size beside BullMQ's.
fn bytes_per_job(rounds: &[Value]) -> Figure {
    Figure {
        key: "bytes-per-job-vs-bullmq".into(),
        scenario: "store",
        ours: Measure {
            label: format!(
                "Redis bytes per waiting job, {} B body, {} waiting (INFO delta)",
                shown(rounds, &["store", "body_bytes"]),
                rounds
                    .iter()
                    .find_map(|r| r["store"]["memory"]
                        .as_array()?
                        .last()
                        .and_then(|m| number(&m["jobs"])))
                    .map_or_else(|| "?".into(), table::number)
            ),
            read: Box::new(|round| {
                number(&round["store"]["memory"].as_array()?.last()?["bytes_per_job"])
            }),
            decimals: 0,
        },
        reference: measure(
            format!(
                "BullMQ {}, {} delayed jobs (INFO delta)",
                peer_version(rounds),
                shown(rounds, &["peer", "add_remove_memory", "jobs"])
            ),
            &[
                "peer",
                "add_remove_memory",
                "redis_bytes_per_job_info_delta",
            ],
        ),
    }
}

fn peer_version(rounds: &[Value]) -> String {
    rounds
        .iter()
        .find_map(|r| r["peer"]["version"].as_str())
        .unwrap_or("?")
        .to_string()
}

fn webhook(rounds: &[Value]) -> Vec<Figure> {
    let s = |path: &[&str]| shown(rounds, path);
    let posts = || {
        measure(
            format!(
                "webhook: {} due jobs POSTed, max_in_flight {} (jobs/s)",
                s(&["webhook", "jobs"]),
                s(&["webhook", "max_in_flight"])
            ),
            &["webhook", "throughput", "bridge_jobs_per_s"],
        )
    };
    vec![
        Figure {
            key: "webhook-vs-plain-client".into(),
            scenario: "webhook",
            ours: posts(),
            reference: measure(
                "a plain reqwest client, as many at once (requests/s)",
                &["webhook", "throughput", "plain_client_per_s"],
            ),
        },
        Figure {
            key: "webhook-vs-floor".into(),
            scenario: "webhook",
            ours: posts(),
            reference: measure(
                "that client plus only the bare Redis commands per job (jobs/s)",
                &["webhook", "throughput", "bookkeeping_floor_per_s"],
            ),
        },
        Figure {
            key: "webhook-lateness".into(),
            scenario: "webhook",
            ours: Measure {
                label: format!(
                    "webhook lateness p99 at {}/s vs the producer's clock (ms)",
                    s(&["webhook", "lateness", "rate_per_s"])
                ),
                read: Box::new(|r| at(r, &["webhook", "lateness", "bridge", "p99_ms"])),
                decimals: 2,
            },
            reference: Measure {
                label: "one AMQP hop and one POST (ms)".into(),
                read: Box::new(|r| at(r, &["webhook", "lateness", "floor", "p99_ms"])),
                decimals: 2,
            },
        },
    ]
}
