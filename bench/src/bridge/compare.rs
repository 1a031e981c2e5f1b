//! `redisched-bench compare`: one scenario with two `redisched` binaries, before and
//! after a change, in interleaved rounds on the same machine: A B, then B A, then A B…
//! (the side that goes first alternates, so a drift of the shared machine favours
//! neither). Each round is the scenario as a round of `all` runs it, ceilings and
//! floors included. Printed per figure: both sides' median (min–max) of the rounds, and
//! whether the candidate's median lies within the baseline's min–max, the test of
//! "paired runs before and after stay within their spread".
//!
//! ```text
//! git worktree add /tmp/before <commit> && cargo build --release --manifest-path /tmp/before/Cargo.toml --bin redisched
//! target/release/redisched-bench compare --baseline-bin /tmp/before/target/release/redisched dispatch --runs 3 --history on
//! target/release/redisched-bench compare --baseline-bin old --bridge-bin new precision --rates 1000 --runs 5
//! ```

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::Args;
use serde_json::{json, Value};

use super::common::{self, Spread};
use super::figures::{self, Measure};
use super::{report, results, scenario_round, table, RunArgs, Scenario};

#[derive(Args, Clone, Debug)]
pub(crate) struct CompareArgs {
    /// The `redisched` binary before the change (side A).
    #[arg(long)]
    pub baseline_bin: PathBuf,
    /// The scenario run with each binary. The candidate (side B) is `--bridge-bin`
    /// [default: the `redisched` beside this executable]; rounds per side: `--runs`
    /// [default: 3].
    #[arg(value_enum)]
    pub scenario: Scenario,
    #[command(flatten)]
    pub run: RunArgs,
}

const DEFAULT_ROUNDS: usize = 3;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Side {
    Baseline,
    Candidate,
}

impl Side {
    fn name(self) -> &'static str {
        match self {
            Side::Baseline => "baseline",
            Side::Candidate => "candidate",
        }
    }

    /// The sides of round `round` (0-based), in order: A B, B A, A B…
    fn order(round: usize) -> [Side; 2] {
        if round.is_multiple_of(2) {
            [Side::Baseline, Side::Candidate]
        } else {
            [Side::Candidate, Side::Baseline]
        }
    }
}

pub(crate) async fn run(args: CompareArgs) -> Result<()> {
    let started = Instant::now();
    let a = &args.run;
    let scenario = args.scenario;
    let rounds = a.runs.unwrap_or(DEFAULT_ROUNDS).max(1);
    let candidate = a.env()?;
    let mut baseline_args = a.clone();
    baseline_args.bridge_bin = Some(args.baseline_bin.clone());
    let baseline = baseline_args.env()?;
    if baseline.bridge_bin == candidate.bridge_bin {
        bail!(
            "the baseline and the candidate are the same binary ({}): pass --bridge-bin",
            baseline.bridge_bin.display()
        );
    }
    let context = report::RunContext::start(&a.redis_url, &a.amqp_url).await;
    eprintln!(
        "compare {}: {rounds} rounds per side, interleaved; baseline {}, candidate {}",
        scenario.name(),
        baseline.bridge_bin.display(),
        candidate.bridge_bin.display()
    );
    let (mut of_baseline, mut of_candidate) = (Vec::new(), Vec::new());
    for round in 0..rounds {
        for side in Side::order(round) {
            eprintln!("== round {}/{rounds}: {}", round + 1, side.name());
            let (env, into) = match side {
                Side::Baseline => (&baseline, &mut of_baseline),
                Side::Candidate => (&candidate, &mut of_candidate),
            };
            let value = scenario_round(scenario, env, a)
                .await
                .with_context(|| format!("round {} of the {}", round + 1, side.name()))?;
            into.push(json!({ scenario.name(): value }));
        }
    }
    let lines = lines(scenario.name(), &of_baseline, &of_candidate);
    let mut report = json!({
        "date": super::now_utc(),
        "machine": super::machine(),
        "command": std::env::args().collect::<Vec<_>>().join(" "),
        "scenario": scenario.name(),
        "rounds_per_side": rounds,
        "order": "interleaved: round 1 baseline then candidate, round 2 candidate then baseline, and so on",
        "baseline_bin": baseline.bridge_bin.display().to_string(),
        "candidate_bin": candidate.bridge_bin.display().to_string(),
        "figures": lines.iter().map(Line::to_json).collect::<Vec<_>>(),
        "rounds": {
            "baseline": of_baseline.iter().map(results::slim).collect::<Vec<_>>(),
            "candidate": of_candidate.iter().map(results::slim).collect::<Vec<_>>(),
        },
    });
    report["context"] = context.finish();
    report["total_seconds"] = json!(common::round2(started.elapsed().as_secs_f64()));
    table::print_header(&report);
    print!("{}", markdown(&lines, rounds));
    let out = a.out.clone().unwrap_or_else(|| {
        PathBuf::from(format!("artifacts/bench-compare-{}.json", scenario.name()))
    });
    if let Some(parent) = out.parent() {
        std::fs::create_dir_all(parent).with_context(|| format!("create {}", parent.display()))?;
    }
    std::fs::write(&out, serde_json::to_string_pretty(&report)?)
        .with_context(|| format!("write {}", out.display()))?;
    println!(
        "\nwrote {} ({:.1} s)",
        out.display(),
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

/// One compared quantity: both sides over their rounds.
#[derive(Debug)]
struct Line {
    label: String,
    baseline: Option<Spread>,
    candidate: Option<Spread>,
    /// Fixed digits (ratios, ms), or 0: rounded as `table::number` does.
    decimals: usize,
}

impl Line {
    /// Whether the candidate's median lies within the baseline's min–max.
    fn within(&self) -> Option<bool> {
        let (b, c) = (self.baseline?, self.candidate?);
        Some(b.min <= c.median && c.median <= b.max)
    }

    fn to_json(&self) -> Value {
        let spread = |s: Option<Spread>| s.map_or(Value::Null, |s| s.to_json(3));
        json!({
            "figure": self.label,
            "baseline": spread(self.baseline),
            "candidate": spread(self.candidate),
            "candidate_median_within_baseline_range": self.within(),
        })
    }
}

/// Every figure of `scenario`, its reference and their ratio, each once, over both
/// sides' rounds; lines neither side measured are left out.
fn lines(scenario: &str, baseline: &[Value], candidate: &[Value]) -> Vec<Line> {
    let every: Vec<Value> = baseline.iter().chain(candidate).cloned().collect();
    let of = |rounds: &[Value], read: &dyn Fn(&Value) -> Option<f64>| {
        let values: Vec<f64> = rounds.iter().filter_map(read).collect();
        Spread::of(&values)
    };
    let mut out: Vec<Line> = Vec::new();
    let mut add = |label: String, read: &dyn Fn(&Value) -> Option<f64>, decimals: usize| {
        if out.iter().any(|l| l.label == label) {
            return;
        }
        let line = Line {
            label,
            baseline: of(baseline, read),
            candidate: of(candidate, read),
            decimals,
        };
        if line.baseline.is_some() || line.candidate.is_some() {
            out.push(line);
        }
    };
    for figure in figures::of_scenario(scenario, &every) {
        for measure in [&figure.ours, &figure.reference] {
            let Measure {
                label,
                read,
                decimals,
            } = measure;
            add(label.clone(), read, *decimals);
        }
        add(
            format!("redisched ÷ {}", without_unit(&figure.reference.label)),
            &|round| figure.ratio(round),
            2,
        );
    }
    out
}

/// `label` without its closing `(unit)`: a ratio has none.
fn without_unit(label: &str) -> &str {
    match label.rfind(" (") {
        Some(at) if label.ends_with(')') => &label[..at],
        _ => label,
    }
}

fn markdown(lines: &[Line], rounds: usize) -> String {
    let mut out = String::from(
        "\n| figure | baseline | candidate | candidate ÷ baseline (medians) | candidate's median within the baseline's min–max |\n|---|---|---|---|---|\n",
    );
    for line in lines {
        let show = |s: Option<Spread>| {
            s.map_or_else(
                || "-".into(),
                |s| figures::show(&s.to_json(3), line.decimals),
            )
        };
        let change = match (line.baseline, line.candidate) {
            (Some(b), Some(c)) if b.median != 0.0 => format!("{:.3}", c.median / b.median),
            _ => "-".into(),
        };
        let within = match line.within() {
            Some(true) => "yes",
            Some(false) => "no",
            None => "-",
        };
        out.push_str(&format!(
            "| {} | {} | {} | {change} | {within} |\n",
            line.label,
            show(line.baseline),
            show(line.candidate)
        ));
    }
    if rounds < 3 {
        out.push_str(&format!(
            "\n{rounds} round(s) per side: a spread needs at least 3 (`--runs 3`) to say anything.\n"
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dispatch(bridge: f64, ceiling: f64) -> Value {
        json!({"dispatch": {"jobs": 1000, "body_bytes": 200, "window": 1000,
                            "bridge": {"jobs_per_s": bridge},
                            "ceiling": {"msgs_per_s": ceiling},
                            "best_publisher": {"msgs_per_s": ceiling * 1.25}}})
    }

    #[test]
    fn the_rounds_alternate_which_side_goes_first() {
        assert_eq!(Side::order(0), [Side::Baseline, Side::Candidate]);
        assert_eq!(Side::order(1), [Side::Candidate, Side::Baseline]);
        assert_eq!(Side::order(2), [Side::Baseline, Side::Candidate]);
    }

    #[test]
    fn each_figure_says_whether_the_candidate_stays_within_the_baseline_spread() {
        let baseline = [
            dispatch(20_000.0, 40_000.0),
            dispatch(24_000.0, 40_000.0),
            dispatch(30_000.0, 40_000.0),
        ];
        let candidate = [
            dispatch(26_000.0, 40_000.0),
            dispatch(40_000.0, 40_000.0),
            dispatch(27_000.0, 50_000.0),
        ];
        let lines = lines("dispatch", &baseline, &candidate);
        let line = |start: &str| {
            lines
                .iter()
                .find(|l| l.label.starts_with(start))
                .unwrap_or_else(|| panic!("no line {start:?} in {lines:?}"))
        };
        let bridge = line("dispatch:");
        assert_eq!(bridge.candidate.map(|s| s.median), Some(27_000.0));
        assert_eq!(bridge.within(), Some(true));
        // The ratio to the ceiling, paired per round: 0.5 0.6 0.75 vs 0.65 1.0 0.54.
        let ratio = line("redisched ÷ a lapin publisher");
        assert!(ratio.label.ends_with("window 1,000"), "{}", ratio.label);
        assert_eq!(ratio.baseline.map(|s| s.median), Some(0.6));
        assert_eq!(ratio.candidate.map(|s| s.median), Some(0.65));
        assert_eq!(ratio.within(), Some(true));
        // The references are compared too: here they stayed where they were.
        let ceiling = line("a lapin publisher");
        assert_eq!(ceiling.within(), Some(true));
        let best = line("the best of");
        assert_eq!(best.within(), Some(true));
        // Each quantity once, though two figures share redisched's side.
        assert_eq!(
            lines
                .iter()
                .filter(|l| l.label.starts_with("dispatch:"))
                .count(),
            1
        );
        let text = markdown(&lines, 3);
        assert!(
            text.contains("| 24,000 (20,000–30,000) | 27,000 (26,000–40,000) | 1.125 | yes |"),
            "{text}"
        );
    }

    #[test]
    fn a_candidate_outside_the_baseline_spread_is_flagged() {
        let baseline = [
            dispatch(20_000.0, 40_000.0),
            dispatch(21_000.0, 40_000.0),
            dispatch(22_000.0, 40_000.0),
        ];
        let candidate = [
            dispatch(15_000.0, 40_000.0),
            dispatch(16_000.0, 40_000.0),
            dispatch(17_000.0, 40_000.0),
        ];
        let lines = lines("dispatch", &baseline, &candidate);
        let bridge = lines
            .iter()
            .find(|l| l.label.starts_with("dispatch:"))
            .expect("line");
        assert_eq!(bridge.within(), Some(false));
        assert!(markdown(&lines, 3).contains("| 0.762 | no |"));
        assert!(markdown(&lines, 1).contains("a spread needs at least 3"));
    }
}
