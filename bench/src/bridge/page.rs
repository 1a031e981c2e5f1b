//! `redisched-bench report`: the performance page's first table, rebuilt from the
//! results `all` saved (`bench/results/*.json`) instead of by hand. One row per figure
//! of record (`figures.rs`): redisched's value and its same-run reference as median
//! (min–max) of the run's rounds, their ratio taken round by round, and the date,
//! commit and command of the run it comes from. The table replaces what stands between
//! the page's `<!-- report:begin -->` and `<!-- report:end -->` lines.
//!
//! ```text
//! target/release/redisched-bench all --runs 3          # saves bench/results/<start>-<commit>.json
//! target/release/redisched-bench report                # rewrites docs/src/performance.md's table
//! target/release/redisched-bench report --stdout       # prints it
//! ```

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use clap::Args;
use serde_json::Value;

use super::common::Spread;
use super::figures::{self, Figure};
use super::results::{self, Results};
use super::table;

pub(crate) const BEGIN: &str = "<!-- report:begin -->";
pub(crate) const END: &str = "<!-- report:end -->";

#[derive(Args, Clone, Debug)]
pub(crate) struct ReportArgs {
    /// Results files of `all` (repeatable); each row comes from the newest one that
    /// measured it [default: every full run in bench/results].
    #[arg(long = "results", value_name = "FILE")]
    pub results: Vec<PathBuf>,
    /// The page whose text between `<!-- report:begin -->` and `<!-- report:end -->`
    /// is replaced by the table.
    #[arg(long, default_value = "docs/src/performance.md")]
    pub page: PathBuf,
    /// Print the table instead of writing the page.
    #[arg(long)]
    pub stdout: bool,
}

pub(crate) fn run(args: &ReportArgs) -> Result<()> {
    let mut found = if args.results.is_empty() {
        results::in_dir(&results::default_dir())?
    } else {
        args.results
            .iter()
            .map(|path| Results::read(path))
            .collect::<Result<Vec<_>>>()?
    };
    if found.is_empty() {
        bail!("no results to report: run `target/release/redisched-bench all --runs 3` first");
    }
    results::newest_first(&mut found);
    let (table, left_out) = markdown(&found);
    for figure in &left_out {
        eprintln!("report: left out (not measured with its reference in these results): {figure}");
    }
    if args.stdout {
        print!("{table}");
        return Ok(());
    }
    let page = std::fs::read_to_string(&args.page)
        .with_context(|| format!("read {} (or pass --page, or --stdout)", args.page.display()))?;
    let updated = replace_between_markers(&page, &table)
        .with_context(|| format!("update {}", args.page.display()))?;
    std::fs::write(&args.page, updated)
        .with_context(|| format!("write {}", args.page.display()))?;
    eprintln!("report: wrote the table into {}", args.page.display());
    Ok(())
}

/// One row: a figure measured with its reference in every round that has both.
#[derive(Debug)]
struct Row {
    figure: String,
    ours: String,
    reference_label: String,
    reference: String,
    ratio: Spread,
    source: usize,
}

impl Row {
    /// `None` unless some round of `results` measured both sides.
    fn of(figure: &Figure, results: &Results, source: usize) -> Option<Self> {
        let rounds = results.rounds();
        let both: Vec<&Value> = rounds
            .iter()
            .filter(|r| figure.ratio(r).is_some())
            .collect();
        let values =
            |read: &figures::Read| -> Vec<f64> { both.iter().filter_map(|r| read(r)).collect() };
        let ratios: Vec<f64> = both.iter().filter_map(|r| figure.ratio(r)).collect();
        let ours = Spread::of(&values(&figure.ours.read))?.to_json(3);
        let reference = Spread::of(&values(&figure.reference.read))?.to_json(3);
        Some(Self {
            figure: figure.ours.label.clone(),
            ours: figure.ours.show(&ours),
            reference_label: figure.reference.label.clone(),
            reference: figure.reference.show(&reference),
            ratio: Spread::of(&ratios)?,
            source,
        })
    }
}

/// The table (with its source lines), and the figures no results file measured beside
/// their reference. `found` is newest first; each row comes from the first that has it.
fn markdown(found: &[Results]) -> (String, Vec<String>) {
    let per_file: Vec<Vec<Figure>> = found
        .iter()
        .map(|r| figures::of_record(r.rounds()))
        .collect();
    let every_round: Vec<Value> = found
        .iter()
        .flat_map(|r| r.rounds().iter().cloned())
        .collect();
    let mut rows = Vec::new();
    let mut left_out = Vec::new();
    for wanted in figures::of_record(&every_round) {
        let row = per_file.iter().enumerate().find_map(|(source, list)| {
            let figure = list.iter().find(|f| f.key == wanted.key)?;
            Row::of(figure, &found[source], source)
        });
        match row {
            Some(row) => rows.push(row),
            None => left_out.push(format!(
                "{} beside {}",
                wanted.ours.label, wanted.reference.label
            )),
        }
    }
    let mut out = String::from(
        "| figure | redisched | reference measured in the same run | redisched ÷ reference | date | commit | command |\n|---|---|---|---|---|---|---|\n",
    );
    for row in &rows {
        let run = &found[row.source].value;
        out.push_str(&format!(
            "| {} | {} | {}: {} | {} | {} | {} | `{}` |\n",
            row.figure,
            row.ours,
            row.reference_label,
            row.reference,
            table::figure(&row.ratio.to_json(3), |x| format!("{x:.2}")),
            date(run),
            commit(run),
            command(run),
        ));
    }
    out.push_str(
        "\nEach figure is the median (min–max) of one run's rounds; the ratio is taken in each round, then its median (min–max).\n",
    );
    let mut used: Vec<usize> = rows.iter().map(|r| r.source).collect();
    used.sort_unstable();
    used.dedup();
    for source in used {
        out.push_str(&format!("{}\n", source_line(&found[source])));
    }
    out.push_str("Regenerated by `target/release/redisched-bench report` from those files.\n");
    (out, left_out)
}

fn date(run: &Value) -> String {
    run["context"]["started_utc"]
        .as_str()
        .map_or("unknown", |t| t.get(..10).unwrap_or(t))
        .to_string()
}

fn commit(run: &Value) -> String {
    let context = &run["context"];
    let commit = context["git_commit"].as_str().unwrap_or("unknown");
    if context["git_dirty"].as_bool() == Some(true) {
        format!("{commit} with uncommitted changes")
    } else {
        commit.to_string()
    }
}

/// The command as recorded, the binary's path from the build's `target/` on (the rest
/// of the path is the machine's, not the command's).
fn command(run: &Value) -> String {
    let recorded = run["command"].as_str().unwrap_or("");
    let (binary, args) = recorded.split_once(' ').unwrap_or((recorded, ""));
    let binary = match binary.find("target/") {
        Some(at) => &binary[at..],
        None => binary,
    };
    format!("{binary} {args}").trim_end().to_string()
}

/// Where a file's rows come from: its path, rounds, load and versions.
fn source_line(results: &Results) -> String {
    let run = &results.value;
    let c = &run["context"];
    let loads = |v: &Value| v.as_array().and_then(|a| a.first()).and_then(Value::as_f64);
    let load = match (
        loads(&c["load_average"]["start"]),
        loads(&c["load_average"]["end"]),
    ) {
        (Some(a), Some(b)) => format!("load average {a:.1} at start, {b:.1} at end"),
        _ => "load average unknown".into(),
    };
    let text = |v: &Value| v.as_str().unwrap_or("unknown").to_string();
    format!(
        "Source: `{}`: {} rounds, {} to {}; {load}; Redis {}, RabbitMQ {}, {} CPUs shared with the bench.",
        display_path(&results.path),
        results.rounds().len(),
        text(&c["started_utc"]),
        text(&c["ended_utc"]),
        text(&c["versions"]["redis"]),
        text(&c["versions"]["rabbitmq"]),
        run["machine"]["cpus"].as_u64().map_or("?".into(), |n| n.to_string()),
    )
}

/// The path from the repository's root when it is inside it (`bench/results/…`).
fn display_path(path: &Path) -> String {
    let text = path.display().to_string();
    match text.find("bench/results/") {
        Some(at) => text[at..].to_string(),
        None => text,
    }
}

/// `page` with the text between its markers (each on a line of its own) replaced by
/// `table`; the markers stay.
pub(crate) fn replace_between_markers(page: &str, table: &str) -> Result<String> {
    let begin = page
        .find(BEGIN)
        .with_context(|| format!("no {BEGIN} line in the page"))?;
    let after_begin = begin + BEGIN.len();
    let end = page[after_begin..]
        .find(END)
        .map(|at| after_begin + at)
        .with_context(|| format!("no {END} line after {BEGIN}"))?;
    if page[end + END.len()..].contains(BEGIN) {
        bail!("more than one {BEGIN} in the page");
    }
    let mut out = String::with_capacity(page.len() + table.len());
    out.push_str(&page[..after_begin]);
    out.push_str("\n\n");
    out.push_str(table.trim_end());
    out.push_str("\n\n");
    out.push_str(&page[end..]);
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fixture() -> Results {
        Results {
            path: PathBuf::from("/repo/bench/results/2026-12-05T10-34Z-45b44b4.json"),
            value: serde_json::from_str(include_str!("page_fixture.json")).expect("fixture"),
        }
    }

    fn row<'a>(table: &'a str, starts: &str) -> &'a str {
        table
            .lines()
            .find(|l| l.starts_with(&format!("| {starts}")))
            .unwrap_or_else(|| panic!("no row starting {starts:?} in\n{table}"))
    }

    #[test]
    fn the_table_shows_each_figure_beside_its_reference_with_the_ratio_per_round() {
        let (table, left_out) = markdown(&[fixture()]);
        // Dispatch: 20,000 / 40,000, 30,000 / 40,000, 24,000 / 30,000 per round.
        let dispatch = row(&table, "dispatch:");
        assert!(
            dispatch.contains("| 24,000 (20,000–30,000) |"),
            "{dispatch}"
        );
        assert!(
            dispatch.contains("window 1,000 (msgs/s): 40,000 (30,000–40,000) |"),
            "{dispatch}"
        );
        assert!(dispatch.contains("| 0.75 (0.50–0.80) |"), "{dispatch}");
        assert!(
            dispatch.contains(
                "| 2026-12-05 | 45b44b4 | `target/release/redisched-bench all --runs 3` |"
            ),
            "{dispatch}"
        );
        // Lateness beside BullMQ: 6.5 / 13, 8.25 / 10.3125, 5.75 / 23 ms.
        let bullmq = row(&table, "lateness p99 at 1,000/s");
        assert!(bullmq.contains("BullMQ 5.1.0"), "{bullmq}");
        assert!(bullmq.contains("| 6.50 (5.75–8.25) |"), "{bullmq}");
        assert!(bullmq.contains("| 0.50 (0.25–0.80) |"), "{bullmq}");
        // The same figure beside the broker's two hops, and at 5,000/s beside BullMQ.
        assert_eq!(table.matches("| lateness p99 at 1,000/s").count(), 2);
        assert!(table.contains("| lateness p99 at 5,000/s"));
        // Bytes per job: the store's largest size beside BullMQ's, measured once a round.
        let bytes = row(&table, "Redis bytes per waiting job");
        assert!(bytes.contains("1,000,000 waiting"), "{bytes}");
        assert!(
            bytes.contains("| 240 (230–250) |") && bytes.contains("| 0.40 (0.38–0.42) |"),
            "{bytes}"
        );
        // The webhook throughput beside the plain client and the floor.
        assert!(row(&table, "webhook: 100,000").contains("0.60"));
        // A figure the run did not measure (ingest) is left out, not invented.
        assert!(
            left_out.iter().any(|f| f.starts_with("ingest")),
            "{left_out:?}"
        );
        assert!(!table.contains("| ingest"));
        assert!(table.contains("Source: `bench/results/2026-12-05T10-34Z-45b44b4.json`: 3 rounds"));
        assert!(!table.contains('✅') && !table.contains('❌'));
        assert!(table.lines().filter(|l| l.starts_with("| ")).count() <= 13);
    }

    #[test]
    fn each_row_comes_from_the_newest_run_that_measured_it() {
        let older = fixture();
        let mut newer = fixture();
        newer.value["context"]["started_utc"] = "2026-12-06T09:00:00Z".into();
        newer.value["context"]["git_commit"] = "fedcba9".into();
        for round in newer.value["rounds"].as_array_mut().into_iter().flatten() {
            round["dispatch"]["bridge"]["jobs_per_s"] = 36_000.0.into();
            round["peer"] = Value::Null;
        }
        let (table, _) = markdown(&[newer, older]);
        let dispatch = row(&table, "dispatch:");
        assert!(
            dispatch.contains("| 36,000 |") && dispatch.contains("| fedcba9 |"),
            "{dispatch}"
        );
        // BullMQ did not run in the newer run: its rows keep the older run's date and commit.
        let bullmq = row(&table, "lateness p99 at 5,000/s");
        assert!(bullmq.contains("| 2026-12-05 | 45b44b4 |"), "{bullmq}");
    }

    #[test]
    fn only_the_text_between_the_markers_is_replaced() {
        let page = format!("# Performance\n\nintro\n{BEGIN}\nold table\n{END}\n\n## Older\n");
        let updated = replace_between_markers(&page, "| new |\n").expect("markers");
        assert_eq!(
            updated,
            format!("# Performance\n\nintro\n{BEGIN}\n\n| new |\n\n{END}\n\n## Older\n")
        );
        // Idempotent: a second run gives the same page.
        assert_eq!(
            replace_between_markers(&updated, "| new |\n").expect("again"),
            updated
        );
        assert!(replace_between_markers("# no markers\n", "x").is_err());
        assert!(replace_between_markers(&format!("{END}\n{BEGIN}\n"), "x").is_err());
    }
}
