//! The command line: `redisched run` (the bridge) and the operator commands, which work
//! straight on Redis through the same Lua scripts as the bridge (via [`Store`]).
//!
//! Output is for people by default and JSON with `--json`; the exit code says what
//! happened (see [`exit`]).

use std::io::Read;
use std::path::{Path, PathBuf};
use std::time::Duration;

use clap::{Args, Parser, Subcommand, ValueEnum};
use serde_json::{json, Value};

use crate::config::{Config, ConfigError};
use crate::job::{Due, JobId, PutMode, Topic};
use crate::store::{PutRequest, Rejection, Store, StoreError, MAX_BATCH};
use crate::view::{self, rfc3339, DeleteView, JobView, ListView, PutView, TopicsView};

/// Exit codes of every command.
pub mod exit {
    pub const OK: u8 = 0;
    /// `get` or `delete` of a job that does not exist.
    pub const NOT_FOUND: u8 = 1;
    /// Bad arguments or a bad configuration value.
    pub const USAGE: u8 = 2;
    /// Redis could not be reached (or timed out).
    pub const UNAVAILABLE: u8 = 3;
    /// The store refused the request (body too large, delay too long, …).
    pub const REFUSED: u8 = 4;
    /// Anything else: an unexpected reply, or the bridge stopped with an error.
    pub const FAILED: u8 = 5;
    /// `check` found problems it did not repair.
    pub const PROBLEMS: u8 = 6;
}

const EXIT_CODES_HELP: &str = "\
Exit codes:
  0  ok
  1  not found (get/delete of a job that does not exist)
  2  usage or configuration error (the message names the bad key)
  3  Redis unreachable
  4  refused by the store (e.g. body too large, delay too long)
  5  unexpected failure
  6  `check` found problems it did not repair

Configuration: built-in defaults < --config FILE (TOML) < REDISCHED_* environment
variables, with `__` between levels (REDISCHED_REDIS__URL, REDISCHED_DISPATCH__TTR_MS, …).
See `redisched check-config`.";

#[derive(Debug, Parser)]
#[command(
    name = "redisched",
    version,
    about = "Schedule jobs for later delivery with ids you choose; cancel or replace them by id.",
    long_about = "Schedule jobs for later delivery with ids you choose; cancel or replace them by id.\n\n\
        `redisched run` runs the RabbitMQ bridge and the HTTP admin API. The other commands \
        work straight on Redis, through the same Lua scripts as the bridge.",
    after_help = EXIT_CODES_HELP
)]
pub struct Cli {
    /// TOML config file, merged over the built-in defaults (REDISCHED_* env vars win over it)
    #[arg(long, short = 'c', global = true, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// Print JSON (results on stdout, errors as {"error": ...}) instead of text
    #[arg(long, global = true)]
    pub json: bool,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the bridge: consume commands from RabbitMQ, publish due jobs, serve HTTP
    Run,
    /// Schedule a job (keeps an existing job with the same id unless --replace)
    #[command(after_help = "Examples:\n  \
        redisched put emails welcome-42 '{\"to\":\"ann\"}' --delay 3d\n  \
        redisched put emails welcome-42 --body-file mail.json --at 2030-01-01T09:00:00Z --replace\n  \
        echo hello | redisched put emails hello-1 - --delay 250ms")]
    Put(PutArgs),
    /// Cancel a job by id, wherever it is (exit 1 if there was none)
    Delete(JobRef),
    /// Show one job: state, due time, attempts, body (exit 1 if there is none)
    Get(JobRef),
    /// List the next scheduled jobs of a topic, earliest first
    List {
        topic: Topic,
        /// How many jobs to show (1..=1000)
        #[arg(long, short = 'n', default_value_t = 20)]
        limit: usize,
        /// Skip this many jobs first
        #[arg(long, default_value_t = 0)]
        offset: usize,
    },
    /// Count jobs per topic: scheduled, due now, reserved (all topics when none is given)
    Stats { topic: Option<Topic> },
    /// Verify the store's invariants (fsck) for one topic or all; --repair fixes them
    #[command(
        after_help = "Reports (and with --repair fixes) keys of the wrong type, unreadable \
        records, records in neither or both of scheduled/reserved, and set members without a \
        record. Repair never deletes data: what it cannot fix goes to <prefix>:{topic}:damaged. \
        Safe to run beside live bridges. Exit code 6 when problems were found and not repaired."
    )]
    Check {
        /// The topic to check (all known topics when omitted)
        topic: Option<Topic>,
        /// Fix what is found instead of only reporting it
        #[arg(long)]
        repair: bool,
    },
    /// Print the merged configuration with secrets redacted; fail naming a bad key
    CheckConfig {
        /// Output format (--json implies json)
        #[arg(long, value_enum, default_value_t = ConfigFormat::Toml)]
        format: ConfigFormat,
    },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum ConfigFormat {
    Toml,
    Json,
}

#[derive(Debug, Args)]
pub struct JobRef {
    pub topic: Topic,
    pub id: JobId,
}

#[derive(Debug, Args)]
pub struct PutArgs {
    pub topic: Topic,
    pub id: JobId,
    /// Job body; `-` reads it from stdin; empty when omitted
    #[arg(conflicts_with = "body_file")]
    pub body: Option<String>,
    /// Read the body from this file (`-` for stdin)
    #[arg(long, value_name = "FILE")]
    pub body_file: Option<PathBuf>,
    /// Due after this delay: 250ms, 90s, 15m, 3d, "1h 30m"
    #[arg(long, value_parser = parse_delay, conflicts_with = "at")]
    pub delay: Option<Due>,
    /// Due at this time, RFC 3339 (2030-01-01T09:00:00Z; no zone means UTC)
    #[arg(long, value_parser = parse_at, value_name = "TIME")]
    pub at: Option<Due>,
    /// Overwrite an existing job with this id (body and due time)
    #[arg(long)]
    pub replace: bool,
}

fn parse_delay(raw: &str) -> Result<Due, String> {
    let delay =
        humantime::parse_duration(raw).map_err(|e| format!("{e} (examples: 250ms, 90s, 3d)"))?;
    Due::delay("--delay", raw, delay.as_millis() as i128).map_err(|e| e.to_string())
}

fn parse_at(raw: &str) -> Result<Due, String> {
    Due::at_rfc3339("--at", raw).map_err(|e| e.to_string())
}

/// Why a command failed; each kind has its exit code.
#[derive(Debug, thiserror::Error)]
pub enum CliError {
    #[error("{0}")]
    Usage(String),
    #[error("{}", describe_config_error(.0))]
    Config(#[from] ConfigError),
    #[error("{0}")]
    NotFound(String),
    #[error("{0}")]
    Unavailable(String),
    #[error("refused by the store: {0}")]
    Refused(Rejection),
    #[error("{0}")]
    Failed(String),
    /// `check` found problems it did not repair; the report is printed as the error.
    #[error("{}", .0.human)]
    Problems(Box<Output>),
}

impl CliError {
    pub fn exit_code(&self) -> u8 {
        match self {
            CliError::Usage(_) | CliError::Config(_) => exit::USAGE,
            CliError::NotFound(_) => exit::NOT_FOUND,
            CliError::Unavailable(_) => exit::UNAVAILABLE,
            CliError::Refused(_) => exit::REFUSED,
            CliError::Failed(_) => exit::FAILED,
            CliError::Problems(_) => exit::PROBLEMS,
        }
    }

    /// The error as `--json` prints it.
    pub fn to_json(&self) -> Value {
        if let CliError::Problems(output) = self {
            let mut value = output.json.clone();
            value["error"] = json!("problems found and not repaired");
            value["kind"] = json!("problems");
            return value;
        }
        let kind = match self {
            CliError::Usage(_) => "usage",
            CliError::Config(_) => "config",
            CliError::NotFound(_) => "not_found",
            CliError::Unavailable(_) => "unavailable",
            CliError::Refused(_) => "refused",
            CliError::Failed(_) => "failed",
            CliError::Problems(_) => "problems",
        };
        let mut value = json!({ "error": self.to_string(), "kind": kind });
        match self {
            CliError::Config(err) => {
                if let Some(key) = config_key(err) {
                    value["key"] = json!(key);
                }
            }
            CliError::Refused(rejection) => value["code"] = json!(rejection.code.as_str()),
            _ => {}
        }
        value
    }
}

/// The dotted config key an error is about, when it is known.
pub fn config_key(err: &ConfigError) -> Option<String> {
    match err {
        ConfigError::Invalid { key, .. } => Some((*key).to_string()),
        ConfigError::Load(err) => Some(err.path.join(".")).filter(|k| !k.is_empty()),
    }
}

/// A config error that always names its key as `config key `a.b`: …`, also for values
/// of the wrong type (figment itself quotes the key as the env var spelled it).
pub fn describe_config_error(err: &ConfigError) -> String {
    match (err, config_key(err)) {
        (ConfigError::Load(inner), Some(key)) => format!("config key `{key}`: {inner}"),
        _ => err.to_string(),
    }
}

impl From<StoreError> for CliError {
    fn from(err: StoreError) -> Self {
        match err {
            StoreError::Unavailable(_) => CliError::Unavailable(err.to_string()),
            StoreError::Rejected(rejection) => CliError::Refused(rejection),
            StoreError::BadReply { .. } => CliError::Failed(err.to_string()),
        }
    }
}

/// What a successful command prints.
#[derive(Debug, Clone)]
pub struct Output {
    pub json: Value,
    pub human: String,
}

impl Output {
    pub fn render(&self, as_json: bool) -> String {
        if as_json {
            // Serializing a `Value` cannot fail.
            serde_json::to_string_pretty(&self.json).unwrap_or_default()
        } else {
            self.human.clone()
        }
    }
}

/// Runs an operator command (everything but `run`).
pub async fn execute(cli: &Cli) -> Result<Output, CliError> {
    if let Command::CheckConfig { format } = &cli.command {
        return check_config(
            cli.config.as_deref(),
            cli.json || *format == ConfigFormat::Json,
        );
    }
    let config = Config::load(cli.config.as_deref())?;
    match &cli.command {
        Command::Run | Command::CheckConfig { .. } => Err(CliError::Usage(
            "`run` is handled by the binary's main, not by cli::execute".into(),
        )),
        Command::Put(args) => {
            let body = read_body(args)?;
            let store = connect(&config).await?;
            put(&store, args, body).await
        }
        Command::Delete(job) => delete(&connect(&config).await?, job).await,
        Command::Get(job) => get(&connect(&config).await?, job).await,
        Command::List {
            topic,
            limit,
            offset,
        } => list(&connect(&config).await?, topic, *limit, *offset).await,
        Command::Stats { topic } => stats(&connect(&config).await?, topic.as_ref()).await,
        Command::Check { topic, repair } => {
            check(&connect(&config).await?, topic.as_ref(), *repair).await
        }
    }
}

async fn connect(config: &Config) -> Result<Store, CliError> {
    Store::connect(&config.connect_options(), config.limits())
        .await
        .map_err(|err| match err {
            StoreError::Unavailable(e) => CliError::Unavailable(format!(
                "cannot reach Redis at {}: {e}",
                crate::config::redact_url(&config.redis.url)
            )),
            other => other.into(),
        })
}

fn check_config(file: Option<&Path>, as_json: bool) -> Result<Output, CliError> {
    let config = Config::load(file)?.redacted();
    let json = serde_json::to_value(&config).map_err(|e| CliError::Failed(e.to_string()))?;
    let human = if as_json {
        serde_json::to_string_pretty(&json).map_err(|e| CliError::Failed(e.to_string()))?
    } else {
        toml::to_string_pretty(&config).map_err(|e| CliError::Failed(e.to_string()))?
    };
    Ok(Output { json, human })
}

fn read_body(args: &PutArgs) -> Result<Vec<u8>, CliError> {
    let read_stdin = || {
        let mut body = Vec::new();
        std::io::stdin()
            .lock()
            .read_to_end(&mut body)
            .map_err(|e| CliError::Usage(format!("cannot read the body from stdin: {e}")))?;
        Ok(body)
    };
    match (&args.body, &args.body_file) {
        (Some(body), _) if body == "-" => read_stdin(),
        (Some(body), _) => Ok(body.clone().into_bytes()),
        (None, Some(path)) if path.as_os_str() == "-" => read_stdin(),
        (None, Some(path)) => std::fs::read(path).map_err(|e| {
            CliError::Usage(format!("cannot read --body-file {}: {e}", path.display()))
        }),
        (None, None) => Ok(Vec::new()),
    }
}

async fn put(store: &Store, args: &PutArgs, body: Vec<u8>) -> Result<Output, CliError> {
    let due = args.delay.or(args.at).unwrap_or(Due::NOW);
    let mode = if args.replace {
        PutMode::Replace
    } else {
        PutMode::Keep
    };
    let size = body.len();
    let outcome = store
        .put(PutRequest {
            topic: args.topic.clone(),
            id: args.id.clone(),
            body,
            meta: Vec::new(),
            due,
            mode,
        })
        .await?;
    let now = store.server_time().await?;
    let json = view::to_json(&PutView::new(
        args.topic.as_str(),
        args.id.as_str(),
        &outcome,
        size,
    ));
    let human = format!(
        "{} {}/{} due {} ({})",
        outcome.status.as_str(),
        args.topic,
        args.id,
        rfc3339(outcome.due_at),
        relative(outcome.due_at, now)
    );
    Ok(Output { json, human })
}

async fn delete(store: &Store, job: &JobRef) -> Result<Output, CliError> {
    if store.delete(&job.topic, &job.id).await? {
        Ok(Output {
            json: view::to_json(&DeleteView::deleted(job.topic.as_str(), job.id.as_str())),
            human: format!("deleted {}/{}", job.topic, job.id),
        })
    } else {
        Err(CliError::NotFound(view::no_such_job(&job.topic, &job.id)))
    }
}

async fn get(store: &Store, job: &JobRef) -> Result<Output, CliError> {
    let info = store
        .get(&job.topic, &job.id)
        .await?
        .ok_or_else(|| CliError::NotFound(view::no_such_job(&job.topic, &job.id)))?;
    let now = store.server_time().await?;
    let json = view::to_json(&JobView::new(&job.topic, job.id.as_str(), &info));
    let mut human = format!(
        "topic     {}\nid        {}\nstate     {}\ndue at    {} ({})\nattempts  {}\n",
        job.topic,
        job.id,
        json["state"].as_str().unwrap_or("?"),
        rfc3339(info.due_at),
        relative(info.due_at, now),
        info.attempts,
    );
    if let Some(deadline) = info.deadline {
        human.push_str(&format!(
            "deadline  {} ({})\n",
            rfc3339(deadline),
            relative(deadline, now)
        ));
    }
    match std::str::from_utf8(&info.body) {
        Ok(text) => human.push_str(&format!("body      ({} bytes)\n{text}", info.body.len())),
        Err(_) => human.push_str(&format!(
            "body      ({} bytes, not UTF-8, base64)\n{}",
            info.body.len(),
            json["body"].as_str().unwrap_or("")
        )),
    }
    Ok(Output {
        json,
        human: human.trim_end().to_string(),
    })
}

async fn list(
    store: &Store,
    topic: &Topic,
    limit: usize,
    offset: usize,
) -> Result<Output, CliError> {
    if !(1..=MAX_BATCH).contains(&limit) {
        return Err(CliError::Usage(format!(
            "--limit must be 1..={MAX_BATCH}, got {limit}"
        )));
    }
    let jobs = store.list(topic, limit, offset).await?;
    let now = store.server_time().await?;
    let json = view::to_json(&ListView::new(topic, now, &jobs));
    let human = if jobs.is_empty() {
        format!("no scheduled jobs in topic {topic}")
    } else {
        let width = jobs
            .iter()
            .map(|(id, _)| id.len())
            .max()
            .unwrap_or(2)
            .max(2);
        let mut out = format!("{:<width$}  {:<24}  IN\n", "ID", "DUE AT");
        for (id, due_at) in &jobs {
            out.push_str(&format!(
                "{id:<width$}  {:<24}  {}\n",
                rfc3339(*due_at),
                relative(*due_at, now)
            ));
        }
        out.trim_end().to_string()
    };
    Ok(Output { json, human })
}

async fn stats(store: &Store, topic: Option<&Topic>) -> Result<Output, CliError> {
    let topics = match topic {
        Some(topic) => vec![topic.clone()],
        None => store.topics().await?,
    };
    let mut rows = Vec::with_capacity(topics.len());
    for topic in topics {
        let stats = store.stats(&topic).await?;
        rows.push((topic, stats));
    }
    let json = view::to_json(&TopicsView::new(&rows));
    let human = if rows.is_empty() {
        "no topics yet".to_string()
    } else {
        let width = rows
            .iter()
            .map(|(t, _)| t.as_str().len())
            .max()
            .unwrap_or(5)
            .max(5);
        let mut out = format!(
            "{:<width$}  {:>10}  {:>10}  {:>10}\n",
            "TOPIC", "SCHEDULED", "DUE NOW", "RESERVED"
        );
        for (topic, s) in &rows {
            out.push_str(&format!(
                "{:<width$}  {:>10}  {:>10}  {:>10}\n",
                topic.as_str(),
                s.scheduled,
                s.due_now,
                s.reserved
            ));
        }
        out.trim_end().to_string()
    };
    Ok(Output { json, human })
}

async fn check(store: &Store, topic: Option<&Topic>, repair: bool) -> Result<Output, CliError> {
    let topics = match topic {
        Some(topic) => vec![topic.clone()],
        None => store.topics().await?,
    };
    let mut reports = Vec::with_capacity(topics.len());
    for topic in &topics {
        reports.push(store.check(topic, repair).await?);
    }
    let found: usize = reports.iter().map(|r| r.problems.len()).sum();
    let unrepaired: usize = reports.iter().map(|r| r.unrepaired()).sum();
    let examined: u64 = reports.iter().map(|r| r.examined).sum();
    let json = json!({
        "repair": repair,
        "topics": reports,
        "examined": examined,
        "problems": found,
        "unrepaired": unrepaired,
    });
    let mut human = String::new();
    for report in &reports {
        human.push_str(&format!(
            "{}: {} entries, {} problem(s){}\n",
            report.topic,
            report.examined,
            report.problems.len(),
            if report.damaged > 0 {
                format!(", {} entries set aside in its damaged hash", report.damaged)
            } else {
                String::new()
            }
        ));
        for p in &report.problems {
            human.push_str(&format!(
                "  {:<17} {:<24} {}{}\n",
                p.kind,
                p.id,
                p.detail,
                if p.repaired { "  [repaired]" } else { "" }
            ));
        }
    }
    human.push_str(&format!(
        "{} topic(s), {examined} entries checked: {}",
        reports.len(),
        match (found, unrepaired) {
            (0, _) => "the store is sound".to_string(),
            (n, 0) => format!("{n} problem(s), all repaired"),
            (n, u) if repair => format!("{n} problem(s), {u} not repaired"),
            (n, _) => format!("{n} problem(s); run with --repair to fix them"),
        }
    ));
    let output = Output { json, human };
    if unrepaired > 0 {
        return Err(CliError::Problems(Box::new(output)));
    }
    Ok(output)
}

/// `in 3days 2h`, `12s ago`, `now`: seconds precision is enough for people.
fn relative(at: i64, now: i64) -> String {
    let diff = at - now;
    let rounded = Duration::from_secs(diff.unsigned_abs() / 1000);
    if rounded.is_zero() {
        "now".into()
    } else if diff > 0 {
        format!("in {}", humantime::format_duration(rounded))
    } else {
        format!("{} ago", humantime::format_duration(rounded))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn the_command_line_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn delays_and_times_parse() {
        assert_eq!(parse_delay("250ms"), Ok(Due::Delay(250)));
        assert_eq!(parse_delay("3d"), Ok(Due::Delay(3 * 86_400_000)));
        assert!(parse_delay("soon").is_err());
        assert_eq!(parse_at("1970-01-01T00:00:01Z"), Ok(Due::At(1000)));
        assert_eq!(
            parse_at("2001-09-09T01:46:40"),
            Ok(Due::At(1_000_000_000_000))
        );
        assert!(parse_at("tomorrow").is_err());
        let before = parse_at("1969-12-31T23:59:59Z").unwrap_err();
        assert!(
            before.contains("--at 1969-12-31T23:59:59Z is before 1970"),
            "{before}"
        );
        assert_eq!(rfc3339(1000), "1970-01-01T00:00:01.000Z");
        assert_eq!(relative(10_500, 0), "in 10s");
        assert_eq!(relative(0, 61_000), "1m 1s ago");
        assert_eq!(relative(400, 0), "now");
    }
}
