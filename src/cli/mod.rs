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
use crate::job::{Due, IdPrefix, JobId, PutMode, Topic};
use crate::policy::RateLimit;
use crate::schedule::Schedule;
use crate::store::{
    CheckReport, HealthView, JobState, ListWhich, PutRequest, RateSource, Rejection, Store,
    StoreError, MAX_BATCH,
};
use crate::view::{
    self, rfc3339, DeleteView, HistoryView, JobView, ListView, PauseView, PrefixDeleteView,
    PutView, RateLimitView, RedriveView, ScheduleFields, TopicsView,
};

/// Exit codes of every command.
pub mod exit {
    pub const OK: u8 = 0;
    /// `get`, `delete` or `redrive` of a job that does not exist (or is not parked).
    pub const NOT_FOUND: u8 = 1;
    /// Bad arguments or a bad configuration value.
    pub const USAGE: u8 = 2;
    /// Redis could not be reached (or timed out), or a write was applied but not confirmed
    /// by `redis.wait_replicas` replicas in time.
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
  1  not found (get/delete of a job that does not exist, redrive of one not parked)
  2  usage or configuration error (the message names the bad key)
  3  Redis unreachable (or, with redis.wait_replicas, a write not replicated in time)
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
        echo hello | redisched put emails hello-1 - --delay 250ms\n  \
        redisched put reports hourly '{}' --every 1h\n  \
        redisched put digests user-42 '{}' --every 1h --jitter 600000   # spread over 10 min\n  \
        redisched put reports standup '{}' --cron '0 9 * * MON-FRI' --tz Europe/Berlin\n\n\
        A recurring job (--every or --cron) is first due at --delay/--at if given (for --cron: the \
        first match at or after it), else one interval from now or the next cron match.")]
    Put(PutArgs),
    /// Cancel a job by id, wherever it is (exit 1 if there was none); or, with
    /// `--id-prefix`, every job of the topic (or of all topics) whose id starts with it
    #[command(override_usage = "redisched delete <TOPIC> <ID>\n       \
        redisched delete <TOPIC> --id-prefix <PREFIX> [--force]\n       \
        redisched delete --id-prefix <PREFIX> --all-topics [--force]")]
    Delete(DeleteArgs),
    /// Show one job: state, schedule, due time, attempts, last error, body (exit 1 if there
    /// is none)
    Get(JobRef),
    /// List the next scheduled jobs of a topic, earliest first (or its parked jobs)
    List {
        topic: Topic,
        /// How many jobs to show (1..=1000)
        #[arg(long, short = 'n', default_value_t = 20)]
        limit: usize,
        /// Skip this many jobs first
        #[arg(long, default_value_t = 0)]
        offset: usize,
        /// List the parked jobs (by id) instead of the scheduled ones
        #[arg(long)]
        parked: bool,
    },
    /// Count jobs per topic: scheduled, due now, reserved, parked, failing, and whether it
    /// is paused (all topics when none is given)
    Stats { topic: Option<Topic> },
    /// Pause dispatch of a topic: commands are still applied, due jobs wait (works before
    /// the topic's first job too)
    Pause { topic: Topic },
    /// Resume dispatch of a paused topic; its backlog is dispatched
    Resume { topic: Topic },
    /// Show, set or remove a topic's live rate limit (obeyed by every bridge at once)
    #[command(after_help = "Examples:\n  \
        redisched rate-limit emails 200/s --burst 20\n  \
        redisched rate-limit reports 0.5/s       # one job every 2 s\n  \
        redisched rate-limit emails              # the limit in force, and what it holds back\n  \
        redisched rate-limit emails off          # remove the live limit\n\n\
        The limit holds for all bridges together: at most burst + n * w jobs in any w seconds, \
        in due-time order. A live limit overrides the configuration's [[policies]] for the \
        topic; `off` returns to the policy's limit (if any). 0/s is refused: pause the topic \
        to stop it. --burst defaults to 100 ms worth (n / 10, rounded up, at least 1).")]
    RateLimit {
        topic: Topic,
        /// `<n>/s` (jobs per second, fractions allowed), or `off`; omitted: show
        #[arg(allow_hyphen_values = true)]
        rate: Option<String>,
        /// Jobs that may go at once after an idle spell (a whole number >= 1)
        #[arg(long, value_name = "K")]
        burst: Option<String>,
    },
    /// Make parked jobs due now (attempts kept): the one ID, or every parked job of the
    /// topic (exit 1 if ID is not parked)
    Redrive { topic: Topic, id: Option<JobId> },
    /// Show a topic's latest outcomes, newest first: dispatched, deleted, replaced,
    /// parked, re-driven
    History {
        topic: Topic,
        /// Only this job's outcomes
        id: Option<JobId>,
        /// How many entries to show (1..=1000)
        #[arg(long, short = 'n', default_value_t = 20)]
        limit: usize,
    },
    /// List the webhook targets of the configuration with their topics, URL and limits,
    /// and what Redis holds for them across every bridge: jobs scheduled, due, in flight,
    /// failing, parked (a running bridge's `GET /v1/targets` adds its own requests' last
    /// status and failure counts)
    Targets,
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
#[command(group(clap::ArgGroup::new("target").args(["id", "id_prefix"]).required(true)))]
pub struct DeleteArgs {
    /// The topic (omit it with `--id-prefix ... --all-topics`)
    #[arg(required_unless_present = "all_topics")]
    pub topic: Option<Topic>,
    /// The job's id
    pub id: Option<JobId>,
    /// Instead of one id: every job whose id starts with this (e.g. `user_42_` when the
    /// user deletes their account); prints how many went
    #[arg(long, value_name = "PREFIX")]
    pub id_prefix: Option<String>,
    /// With `--id-prefix`: in every known topic, not one
    #[arg(long, requires = "id_prefix", conflicts_with = "topic")]
    pub all_topics: bool,
    /// With `--id-prefix`: accept a prefix shorter than 3 characters
    #[arg(long, requires = "id_prefix")]
    pub force: bool,
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
    /// Overwrite an existing job with this id (body, due time and schedule)
    #[arg(long)]
    pub replace: bool,
    /// Recurring: every INTERVAL (milliseconds, or 15m, 1h, "1h 30m"), at least
    /// `limits.min_interval_ms`
    #[arg(long, value_name = "INTERVAL", conflicts_with = "cron")]
    pub every: Option<String>,
    /// Recurring: on a cron expression, 5 fields (minute hour day-of-month month
    /// day-of-week) or 6 (leading seconds)
    #[arg(long, value_name = "EXPR")]
    pub cron: Option<String>,
    /// The IANA time zone of --cron (default UTC)
    #[arg(long, value_name = "ZONE", requires = "cron")]
    pub tz: Option<String>,
    /// Recurring: delay each occurrence by a deterministic amount in [0, MS) from topic,
    /// id and its scheduled time (below the --every interval; clamped to each cron gap).
    /// Delivered as x-redisched-due-at, the unjittered time as x-redisched-scheduled-at
    #[arg(long, value_name = "MS")]
    pub jitter: Option<String>,
    /// POST the job to this URL instead of its webhook target's (must start with one of
    /// the target's allowed_url_prefixes)
    #[arg(long, value_name = "URL")]
    pub url: Option<String>,
    /// Expire the job this many ms after its due time: not delivered by then, it is set
    /// aside to the expired exchange instead (0 = never; default: the topic's
    /// [[policies]] expires_after_ms, else never)
    #[arg(long, value_name = "MS", value_parser = parse_expires_after, allow_hyphen_values = true)]
    pub expires_after: Option<u64>,
}

fn parse_expires_after(raw: &str) -> Result<u64, String> {
    crate::expiry::parse_ms("--expires-after", raw).map_err(|e| e.0)
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
        ConfigError::Invalid { key, .. } => Some(key.clone()),
        ConfigError::Target { key, .. } => Some(key.clone()),
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
            StoreError::Unavailable(_) | StoreError::NotReplicated { .. } => {
                CliError::Unavailable(err.to_string())
            }
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
            let schedule = schedule_of(args, config.limits.min_interval_ms)?;
            let body = read_body(args)?;
            if let Some(url) = &args.url {
                crate::targets::check_job_url_for(&config.targets, args.topic.as_str(), url)
                    .map_err(|reason| CliError::Usage(format!("--url: {reason}")))?;
            }
            let store = connect(&config).await?;
            put(&store, args, body, schedule).await
        }
        Command::Delete(args) => delete(&connect(&config).await?, args).await,
        Command::Get(job) => get(&connect(&config).await?, job).await,
        Command::List {
            topic,
            limit,
            offset,
            parked,
        } => {
            let which = if *parked {
                ListWhich::Parked
            } else {
                ListWhich::Scheduled
            };
            list(&connect(&config).await?, topic, *limit, *offset, which).await
        }
        Command::Stats { topic } => {
            stats(&connect(&config).await?, topic.as_ref(), &config.targets).await
        }
        Command::Targets => targets(&connect(&config).await?, &config.targets).await,
        Command::Pause { topic } => pause(&connect(&config).await?, topic, true).await,
        Command::Resume { topic } => pause(&connect(&config).await?, topic, false).await,
        Command::RateLimit { topic, rate, burst } => {
            let change = rate_change(rate.as_deref(), burst.as_deref())?;
            rate_limit(&connect(&config).await?, topic, change).await
        }
        Command::Redrive { topic, id } => {
            redrive(&connect(&config).await?, topic, id.as_ref()).await
        }
        Command::History { topic, id, limit } => {
            history(&connect(&config).await?, topic, id.as_ref(), *limit).await
        }
        Command::Check { topic, repair } => {
            check(
                &connect(&config).await?,
                topic.as_ref(),
                *repair,
                config.redis.allow_eviction,
            )
            .await
        }
    }
}

async fn connect(config: &Config) -> Result<Store, CliError> {
    Store::connect(&config.connect_options(), config.limits())
        .await
        .map(|store| {
            store
                .with_history_max(config.history.max_per_topic)
                .with_durability(config.durability())
                // `validate()` compiled the policies at load: this cannot fail here.
                .with_policies(config.compiled_policies().unwrap_or_default())
        })
        .map_err(|err| match err {
            StoreError::Unavailable(e) => CliError::Unavailable(format!(
                "cannot reach Redis at {}: {e}",
                crate::urls::redact_url(&config.redis.url)
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

/// The schedule `--every` or `--cron` (+ `--tz`) asks for, if any.
fn schedule_of(args: &PutArgs, min_interval_ms: u64) -> Result<Option<Schedule>, CliError> {
    match (&args.every, &args.cron) {
        (Some(every), _) => Schedule::parse_every(every, min_interval_ms)
            .map(Some)
            .map_err(|e| CliError::Usage(format!("--every {every}: {e}"))),
        (None, Some(cron)) => Schedule::cron(cron, args.tz.as_deref())
            .map(Some)
            .map_err(|e| CliError::Usage(format!("--cron: {e}"))),
        (None, None) => Ok(None),
    }
}

/// `--jitter MS`: only with a schedule, below an --every interval.
fn jitter_of(args: &PutArgs, schedule: Option<&Schedule>) -> Result<u64, CliError> {
    let Some(text) = &args.jitter else {
        return Ok(0);
    };
    let Some(schedule) = schedule else {
        return Err(CliError::Usage(
            "--jitter is only for a recurring job (give --every or --cron): a one-shot job has no occurrences to spread".into(),
        ));
    };
    crate::schedule::parse_jitter(text)
        .and_then(|ms| schedule.check_jitter(ms))
        .map_err(|e| CliError::Usage(format!("--jitter {text}: {e}")))
}

async fn put(
    store: &Store,
    args: &PutArgs,
    body: Vec<u8>,
    schedule: Option<Schedule>,
) -> Result<Output, CliError> {
    let explicit = args.delay.or(args.at);
    let mode = if args.replace {
        PutMode::Replace
    } else {
        PutMode::Keep
    };
    let size = body.len();
    let jitter_ms = jitter_of(args, schedule.as_ref())?;
    let mut request = PutRequest {
        topic: args.topic.clone(),
        id: args.id.clone(),
        body,
        meta: crate::expiry::meta_with_expiry(
            crate::webhook::job_meta(args.url.as_deref(), jitter_ms),
            args.expires_after,
        ),
        due: explicit.unwrap_or(Due::NOW),
        mode,
    };
    let outcome = match &schedule {
        None => store.put(request).await?,
        Some(schedule) => {
            let now = store.server_time().await?;
            request.due = schedule.first_due(explicit, now).map_err(CliError::Usage)?;
            let spec = schedule
                .store_spec()
                .map_err(|e| CliError::Usage(e.to_string()))?;
            let bound = match request.due {
                Due::At(first) => schedule.jitter_bound(first, jitter_ms),
                Due::Delay(_) => jitter_ms,
            };
            store.put_jittered(request, spec, bound).await?
        }
    };
    let now = store.server_time().await?;
    let json = view::to_json(&PutView::new(
        args.topic.as_str(),
        args.id.as_str(),
        &outcome,
        size,
    ));
    let recurring = schedule
        .as_ref()
        .and_then(|s| ScheduleFields::of(Some(&s.to_spec())).describe())
        .map(|s| format!(", {s}"))
        .unwrap_or_default();
    let human = format!(
        "{} {}/{} due {} ({}){recurring}",
        outcome.status.as_str(),
        args.topic,
        args.id,
        rfc3339(outcome.due_at),
        relative(outcome.due_at, now)
    );
    Ok(Output { json, human })
}

async fn delete(store: &Store, args: &DeleteArgs) -> Result<Output, CliError> {
    if let Some(prefix) = &args.id_prefix {
        let prefix = IdPrefix::new(prefix.as_str(), args.force)
            .map_err(|err| CliError::Usage(err.to_string()))?;
        let deleted = match &args.topic {
            Some(topic) if !args.all_topics => {
                let n = store.delete_prefix(topic, &prefix, None).await?;
                vec![(topic.clone(), n)]
            }
            _ => store.delete_prefix_everywhere(&prefix).await?,
        };
        let answer = PrefixDeleteView::new(&prefix, args.all_topics, &deleted);
        let human = match args.topic.as_ref().filter(|_| !args.all_topics) {
            Some(topic) => format!(
                "deleted {} job(s) of topic {topic} whose id starts with \"{prefix}\"",
                answer.deleted
            ),
            None => format!(
                "deleted {} job(s) whose id starts with \"{prefix}\", in {} topic(s)",
                answer.deleted,
                answer.topics.len()
            ),
        };
        return Ok(Output {
            json: view::to_json(&answer),
            human,
        });
    }
    let (Some(topic), Some(id)) = (&args.topic, &args.id) else {
        return Err(CliError::Usage(
            "delete needs TOPIC ID, or --id-prefix PREFIX with TOPIC or --all-topics".into(),
        ));
    };
    if store.delete(topic, id).await? {
        Ok(Output {
            json: view::to_json(&DeleteView::deleted(topic.as_str(), id.as_str())),
            human: format!("deleted {topic}/{id}"),
        })
    } else {
        Err(CliError::NotFound(view::no_such_job(topic, id)))
    }
}

async fn get(store: &Store, job: &JobRef) -> Result<Output, CliError> {
    let info = store
        .get(&job.topic, &job.id)
        .await?
        .ok_or_else(|| CliError::NotFound(view::no_such_job(&job.topic, &job.id)))?;
    let now = store.server_time().await?;
    let job_view = JobView::new(&job.topic, job.id.as_str(), &info);
    let json = view::to_json(&job_view);
    let state = json["state"].as_str().unwrap_or("?");
    let mut human = String::new();
    // A failing or parked job leads with it, so it cannot be missed.
    if info.state == JobState::Parked {
        human.push_str(&format!(
            "!! PARKED after {} failed publish(es); `redisched redrive {} {}` makes it due now\n",
            info.failures, job.topic, job.id
        ));
    } else if let Some(error) = &info.last_error {
        human.push_str(&format!(
            "!! FAILING: {} failed publish(es), last {} ({})\n",
            info.failures,
            error.reason,
            relative(error.at, now)
        ));
    }
    human.push_str(&format!(
        "topic     {}\nid        {}\nstate     {state}\n",
        job.topic, job.id
    ));
    if let Some(schedule) = job_view.schedule.describe() {
        human.push_str(&format!("schedule  {schedule}\n"));
    }
    let due_label = if info.spec.is_some() {
        "next due"
    } else {
        "due at"
    };
    human.push_str(&format!(
        "{due_label:<10}{} ({})\nattempts  {}\n",
        rfc3339(info.due_at),
        relative(info.due_at, now),
        info.attempts,
    ));
    if let Some(deadline) = info.deadline {
        human.push_str(&format!(
            "deadline  {} ({})\n",
            rfc3339(deadline),
            relative(deadline, now)
        ));
    }
    if let Some(error) = &info.last_error {
        human.push_str(&format!(
            "failures  {}\nlast error {} at {} ({})\n",
            info.failures,
            error.reason,
            rfc3339(error.at),
            relative(error.at, now)
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
    which: ListWhich,
) -> Result<Output, CliError> {
    check_limit(limit)?;
    let jobs = store.list_jobs(topic, which, limit, offset).await?;
    let now = store.server_time().await?;
    let view = ListView::new(topic, now, &jobs);
    let json = view::to_json(&view);
    let human = if view.jobs.is_empty() {
        match which {
            ListWhich::Scheduled => format!("no scheduled jobs in topic {topic}"),
            ListWhich::Parked => format!("no parked jobs in topic {topic}"),
        }
    } else {
        let width = view
            .jobs
            .iter()
            .map(|job| job.id.len())
            .max()
            .unwrap_or(2)
            .max(2);
        let schedules: Vec<String> = view
            .jobs
            .iter()
            .map(|job| job.schedule.describe().unwrap_or_else(|| "-".into()))
            .collect();
        let swidth = schedules.iter().map(String::len).max().unwrap_or(8).max(8);
        let mut out = format!(
            "{:<width$}  {:<24}  {:<14}  {:<9}  {:>8}  {:<swidth$}  LAST ERROR\n",
            "ID", "DUE AT", "IN", "STATE", "ATTEMPTS", "SCHEDULE"
        );
        for (job, schedule) in view.jobs.iter().zip(&schedules) {
            let state = view::to_json(&job.state);
            // A job whose last publish failed (parked ones too) is marked `!!`.
            let error = match (&job.failure.last_error, job.failure.last_error_at) {
                (Some(reason), Some(at)) => format!(
                    "!! {reason} ({} failure(s), last {})",
                    job.failure.failures,
                    relative(at, now)
                ),
                _ => String::new(),
            };
            let line = format!(
                "{:<width$}  {:<24}  {:<14}  {:<9}  {:>8}  {schedule:<swidth$}  {error}",
                job.id,
                job.due_at_rfc3339,
                relative(job.due_at, now),
                state.as_str().unwrap_or("?"),
                job.attempts,
            );
            out.push_str(line.trim_end());
            out.push('\n');
        }
        out.trim_end().to_string()
    };
    Ok(Output { json, human })
}

fn check_limit(limit: usize) -> Result<(), CliError> {
    if (1..=MAX_BATCH).contains(&limit) {
        Ok(())
    } else {
        Err(CliError::Usage(format!(
            "--limit must be 1..={MAX_BATCH}, got {limit}"
        )))
    }
}

/// `redisched targets`: the configured targets (no Redis needed).
async fn targets(
    store: &Store,
    targets: &[crate::targets::TargetConfig],
) -> Result<Output, CliError> {
    let mut rows = Vec::new();
    if !targets.is_empty() {
        for topic in store.topics().await? {
            let stats = store.stats(&topic).await?;
            rows.push((topic, stats));
        }
    }
    let view = view::TargetsView::new(targets, |_| None).with_backlog(targets, &rows);
    let mut human = String::new();
    if view.targets.is_empty() {
        human.push_str("no webhook targets configured ([[targets]] in the config file)");
    }
    for t in &view.targets {
        human.push_str(&format!(
            "{}  topics {}  -> {}  body {}  max_in_flight {}  timeout {} ms{}\n",
            t.name,
            t.topics.join(","),
            t.url,
            t.body,
            t.max_in_flight,
            t.timeout_ms,
            if t.signed { "  signed" } else { "" }
        ));
        if let Some(b) = t.backlog {
            human.push_str(&format!(
                "    {} topic(s): {} scheduled, {} due now, {} in flight (all bridges), {} failing, {} parked{}\n",
                b.topics,
                b.scheduled,
                b.due_now,
                b.reserved,
                b.failing,
                b.parked,
                if b.failing + b.parked > 0 {
                    "  !! see `redisched list <topic> --parked` and `redisched get`"
                } else {
                    ""
                }
            ));
        }
    }
    Ok(Output {
        json: view::to_json(&view),
        human: human.trim_end().to_owned(),
    })
}

async fn stats(
    store: &Store,
    topic: Option<&Topic>,
    targets: &[crate::targets::TargetConfig],
) -> Result<Output, CliError> {
    let topics = match topic {
        Some(topic) => vec![topic.clone()],
        None => store.topics().await?,
    };
    let mut rows = Vec::with_capacity(topics.len());
    for topic in topics {
        let stats = store.stats(&topic).await?;
        rows.push((topic, stats));
    }
    let json = view::to_json(&TopicsView::new(&rows).with_targets(targets));
    let human = if rows.is_empty() {
        "no topics yet".to_string()
    } else {
        let width = rows
            .iter()
            .map(|(t, _)| t.as_str().len())
            .max()
            .unwrap_or(5)
            .max(5);
        let limits: Vec<String> = rows
            .iter()
            .map(|(_, s)| match s.rate_limit {
                Some((limit, RateSource::Live)) => limit.to_string(),
                Some((limit, RateSource::Policy)) => format!("{limit} (policy)"),
                None => "-".into(),
            })
            .collect();
        let limit_width = limits.iter().map(String::len).max().unwrap_or(1).max(10);
        // PAUSED stays last: scripts read a paused topic's row as ending in `yes`.
        let mut out = format!(
            "{:<width$}  {:>10}  {:>10}  {:>10}  {:>8}  {:>8}  {:>9}  {:<limit_width$}  {:>6}\n",
            "TOPIC",
            "SCHEDULED",
            "DUE NOW",
            "RESERVED",
            "PARKED",
            "FAILING",
            "THROTTLED",
            "RATE LIMIT",
            "PAUSED"
        );
        for ((topic, s), limit) in rows.iter().zip(&limits) {
            out.push_str(&format!(
                "{:<width$}  {:>10}  {:>10}  {:>10}  {:>8}  {:>8}  {:>9}  {:<limit_width$}  {:>6}\n",
                topic.as_str(),
                s.scheduled,
                s.due_now,
                s.reserved,
                s.parked,
                s.failing,
                s.throttled,
                limit,
                if s.paused { "yes" } else { "no" },
            ));
        }
        out.trim_end().to_string()
    };
    Ok(Output { json, human })
}

/// What `rate-limit` was asked: `None` show, `Some(None)` remove, `Some(Some(_))` set.
fn rate_change(
    rate: Option<&str>,
    burst: Option<&str>,
) -> Result<Option<Option<RateLimit>>, CliError> {
    let usage = |e: crate::policy::RateError| CliError::Usage(e.0);
    match rate {
        None if burst.is_some() => Err(CliError::Usage(
            "--burst needs a rate: redisched rate-limit <topic> <n>/s --burst <k>".into(),
        )),
        None => Ok(None),
        Some("off") if burst.is_some() => {
            Err(CliError::Usage("--burst makes no sense with `off`".into()))
        }
        Some("off") => Ok(Some(None)),
        Some(rate) => {
            let rate = RateLimit::parse_rate(rate).map_err(usage)?;
            let burst = match burst {
                None => None,
                Some(b) => Some(b.trim().parse::<f64>().map_err(|_| {
                    CliError::Usage(format!("--burst must be a whole number >= 1, got {b:?}"))
                })?),
            };
            Ok(Some(Some(RateLimit::new(rate, burst).map_err(usage)?)))
        }
    }
}

async fn rate_limit(
    store: &Store,
    topic: &Topic,
    change: Option<Option<RateLimit>>,
) -> Result<Output, CliError> {
    let changed = match change {
        None => false,
        Some(Some(limit)) => {
            store.set_rate_limit(topic, limit).await?;
            true
        }
        Some(None) => store.delete_rate_limit(topic).await?,
    };
    let state = store.rate_state(topic).await?;
    let in_force = match state.limit {
        None => "unlimited".to_string(),
        Some((limit, RateSource::Live)) => format!("limited to {limit} (live)"),
        Some((limit, RateSource::Policy)) => {
            format!("limited to {limit} (the configuration's [[policies]])")
        }
    };
    let human = match change {
        Some(None) if !changed => format!("topic {topic} had no live rate limit; it is {in_force}"),
        _ => format!(
            "topic {topic} is {in_force}; {} due job(s) held back now",
            state.throttled
        ),
    };
    let json = view::to_json(&RateLimitView::new(topic, &state, changed));
    Ok(Output { json, human })
}

/// `pause` (`paused = true`) and `resume`.
async fn pause(store: &Store, topic: &Topic, paused: bool) -> Result<Output, CliError> {
    let changed = if paused {
        store.pause(topic).await?
    } else {
        store.resume(topic).await?
    };
    let human = match (paused, changed) {
        (true, true) => format!(
            "paused topic {topic}: nothing of it is dispatched until `redisched resume {topic}`"
        ),
        (true, false) => format!("topic {topic} was paused already"),
        (false, true) => format!("resumed topic {topic}: its due jobs are dispatched"),
        (false, false) => format!("topic {topic} was not paused"),
    };
    let json = view::to_json(&PauseView {
        topic: topic.clone(),
        paused,
        changed,
    });
    Ok(Output { json, human })
}

async fn redrive(store: &Store, topic: &Topic, id: Option<&JobId>) -> Result<Output, CliError> {
    let (redriven, human) = match id {
        Some(id) => {
            if !store.redrive(topic, id).await? {
                let info = store.get(topic, id).await?;
                let (_, why) = view::not_parked(topic, id, info.as_ref());
                return Err(CliError::NotFound(why));
            }
            (1, format!("re-drove {topic}/{id}: due now"))
        }
        None => {
            let moved = store.redrive_topic(topic).await?;
            let human = match moved {
                0 => format!("no parked jobs in topic {topic}"),
                n => format!("re-drove {n} parked job(s) of topic {topic}: due now"),
            };
            (moved, human)
        }
    };
    let json = view::to_json(&RedriveView {
        topic: topic.clone(),
        id: id.map(|id| id.to_string()),
        redriven,
    });
    Ok(Output { json, human })
}

async fn history(
    store: &Store,
    topic: &Topic,
    id: Option<&JobId>,
    limit: usize,
) -> Result<Output, CliError> {
    check_limit(limit)?;
    let entries = store.history(topic, id, limit).await?;
    let now = store.server_time().await?;
    let view = HistoryView::new(topic, id, &entries);
    let json = view::to_json(&view);
    let human = if view.entries.is_empty() {
        match id {
            Some(id) => format!("no history of job {id} in topic {topic}"),
            None => format!("no history in topic {topic}"),
        }
    } else {
        let width = view
            .entries
            .iter()
            .map(|e| e.id.len())
            .max()
            .unwrap_or(2)
            .max(2);
        let mut out = format!(
            "{:<24}  {:<14}  {:<10}  {:<width$}  {:>8}  {:<24}  DETAIL\n",
            "AT", "", "OUTCOME", "ID", "ATTEMPTS", "DUE AT"
        );
        for e in &view.entries {
            // A series' next due time, then a delivery note (a webhook's `HTTP 200`).
            let (head, note) = e.detail.split_once(' ').unwrap_or((&e.detail, ""));
            let detail = match head.parse::<i64>() {
                Ok(next) if e.outcome == crate::store::Outcome::Dispatched => {
                    format!("next {} {note}", rfc3339(next))
                        .trim_end()
                        .to_owned()
                }
                _ => e.detail.clone(),
            };
            let line = format!(
                "{:<24}  {:<14}  {:<10}  {:<width$}  {:>8}  {:<24}  {detail}",
                e.at_rfc3339,
                relative(e.at, now),
                e.outcome.as_str(),
                e.id,
                e.attempts,
                e.due_at_rfc3339,
            );
            out.push_str(line.trim_end());
            out.push('\n');
        }
        out.trim_end().to_string()
    };
    Ok(Output { json, human })
}

async fn check(
    store: &Store,
    topic: Option<&Topic>,
    repair: bool,
    allow_eviction: bool,
) -> Result<Output, CliError> {
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
    // The server itself: a policy that may evict jobs, or a full memory, is a problem
    // no repair fixes (exit 6 like the others); an unreadable policy is only said.
    store.probe_health().await?;
    let health = store.health().view();
    let (redis_problems, redis_line) = redis_verdict(&health, allow_eviction);
    let json = json!({
        "repair": repair,
        "topics": reports,
        "examined": examined,
        "problems": found + redis_problems.len(),
        "unrepaired": unrepaired + redis_problems.len(),
        "redis": {
            "eviction_policy": health.eviction_policy,
            "eviction_policy_ok": health.eviction_policy_ok,
            "eviction_allowed": allow_eviction,
            "evicted_keys": health.evicted_keys,
            "oom": health.oom.is_some(),
            "used_memory": health.used_memory,
            "maxmemory": health.maxmemory,
            "unknown_reason": health.unknown_reason,
            "nodes": health.nodes,
            "problems": redis_problems,
        },
    });
    let human = check_human(&reports, &health, &redis_line, &redis_problems, repair);
    let output = Output { json, human };
    if unrepaired > 0 || !redis_problems.is_empty() {
        return Err(CliError::Problems(Box::new(output)));
    }
    Ok(output)
}

/// What `check` says of the Redis server itself: the problems no repair fixes, and the
/// line naming its eviction policy.
fn redis_verdict(health: &HealthView, allow_eviction: bool) -> (Vec<String>, String) {
    let mut redis_problems = Vec::new();
    if health.eviction_policy_ok == Some(false) && !allow_eviction {
        redis_problems.push(format!(
            "maxmemory-policy {} may evict scheduled jobs: set maxmemory-policy noeviction, or redis.allow_eviction = true to accept the risk",
            health.eviction_policy
        ));
    }
    if let Some(oom) = &health.oom {
        redis_problems.push(format!("out of memory, Redis refuses writes: {oom}"));
    }
    let redis_line = match (&health.eviction_policy_ok, &health.unknown_reason) {
        (Some(true), _) => format!(
            "redis: maxmemory-policy {} keeps jobs",
            health.eviction_policy
        ),
        (Some(false), _) if allow_eviction => format!(
            "redis: maxmemory-policy {} may evict scheduled jobs (allowed by redis.allow_eviction)",
            health.eviction_policy
        ),
        (Some(false), _) => format!("redis: maxmemory-policy {}", health.eviction_policy),
        (None, why) => format!(
            "redis: maxmemory-policy unknown ({}); make sure it is noeviction",
            why.as_deref().unwrap_or("not readable")
        ),
    };
    (redis_problems, redis_line)
}

/// `check`'s report for people: the server's line, then each topic with its problems.
fn check_human(
    reports: &[CheckReport],
    health: &HealthView,
    redis_line: &str,
    redis_problems: &[String],
    repair: bool,
) -> String {
    let found: usize = reports.iter().map(|r| r.problems.len()).sum();
    let unrepaired: usize = reports.iter().map(|r| r.unrepaired()).sum();
    let examined: u64 = reports.iter().map(|r| r.examined).sum();
    let mut human = String::new();
    human.push_str(redis_line);
    if let Some(evicted) = health.evicted_keys.filter(|&n| n > 0) {
        human.push_str(&format!(
            "; it has evicted {evicted} key(s) since it started (INFO evicted_keys)"
        ));
    }
    human.push('\n');
    for problem in redis_problems {
        human.push_str(&format!("  redis problem: {problem}\n"));
    }
    for report in reports {
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
    if !redis_problems.is_empty() {
        human.push_str(&format!("; {} Redis problem(s)", redis_problems.len()));
    }
    human
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
