//! The command line: `redisched run` (the bridge) and the operator commands, which work
//! straight on Redis through the same Lua scripts as the bridge (via [`Store`]).
//!
//! Output is for people by default and JSON with `--json`; the exit code says what
//! happened (see [`exit`]).
//!
//! This file owns the arguments (clap) and hands each command to its handler: `put.rs`,
//! `delete.rs`, `read.rs` (get, list, stats, history), `control.rs` (pause, resume,
//! rate-limit, redrive), `targets.rs`, `check.rs` (check, check-config). The error type
//! and its exit codes are in `error.rs`, what a command prints in `output.rs`.

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand, ValueEnum};

use crate::config::Config;
use crate::job::{Due, JobId, Topic};
use crate::store::{ListWhich, Store, StoreError};

mod check;
mod control;
mod delete;
mod error;
mod output;
mod put;
mod read;
mod targets;

pub use check::config_warnings;
pub use error::{config_key, describe_config_error, CliError};
pub use output::Output;

/// Exit codes of every command.
pub mod exit {
    pub const OK: u8 = 0;
    /// `get`, `delete` or `redrive` of a job that does not exist (or is not parked), or a
    /// target name the configuration does not have.
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
  1  not found (get/delete of a job that does not exist, redrive of one not parked,
     a target name the configuration does not have)
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
    /// status and failure counts); `targets redrive <name>` re-drives a target's parked jobs
    Targets(TargetsArgs),
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

#[derive(Debug, Args)]
pub struct TargetsArgs {
    #[command(subcommand)]
    pub action: Option<TargetsAction>,
}

#[derive(Debug, Subcommand)]
pub enum TargetsAction {
    /// Bring a target back after it was disabled (410 Gone, too many trips, or by hand):
    /// its breaker closed, counts reset; its held jobs go out again
    Enable {
        /// The target's `name` in the configuration
        name: String,
    },
    /// Disable a target by hand: nothing is sent to it, its jobs wait (nothing is lost)
    /// until `redisched targets enable`
    Disable {
        /// The target's `name` in the configuration
        name: String,
    },
    /// Make due now (attempts kept) the parked jobs of every topic the target serves whose
    /// last failure lies in the window; prints how many, per topic
    #[command(after_help = "Examples:\n  \
        redisched targets redrive billing                     # every parked job of its topics\n  \
        redisched targets redrive billing --since 2030-01-01T09:00:00Z --until 2030-01-01T10:30:00Z\n  \
        redisched targets redrive billing --since 1893488400000\n\n\
        A time is epoch milliseconds or RFC 3339 (Z, an offset, or no zone = UTC); both ends are \
        included. --since defaults to the beginning, --until to now (a later --until is now). \
        A topic is the target's when the target is the first whose patterns match it. The work \
        goes in bounded steps, so Redis is never blocked long; running it again is safe (what \
        was re-driven is no longer parked). Exit 1 if no target has that name.")]
    Redrive {
        /// The target's `name` in the configuration
        name: String,
        /// Only jobs whose last failure was at or after this time
        #[arg(long, value_name = "TIME")]
        since: Option<String>,
        /// Only jobs whose last failure was at or before this time
        #[arg(long, value_name = "TIME")]
        until: Option<String>,
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
    crate::job::expiry::parse_ms("--expires-after", raw).map_err(|e| e.0)
}

fn parse_delay(raw: &str) -> Result<Due, String> {
    let delay =
        humantime::parse_duration(raw).map_err(|e| format!("{e} (examples: 250ms, 90s, 3d)"))?;
    Due::delay("--delay", raw, delay.as_millis() as i128).map_err(|e| e.to_string())
}

fn parse_at(raw: &str) -> Result<Due, String> {
    Due::at_rfc3339("--at", raw).map_err(|e| e.to_string())
}

/// Runs an operator command (everything but `run`).
pub async fn execute(cli: &Cli) -> Result<Output, CliError> {
    if let Command::CheckConfig { format } = &cli.command {
        return check::check_config(
            cli.config.as_deref(),
            cli.json || *format == ConfigFormat::Json,
        );
    }
    let config = Config::load(cli.config.as_deref())?;
    match &cli.command {
        Command::Run | Command::CheckConfig { .. } => Err(CliError::Usage(
            "`run` is handled by the binary's main, not by cli::execute".into(),
        )),
        Command::Put(args) => put::execute(&config, args).await,
        Command::Delete(args) => delete::delete(&connect(&config).await?, args).await,
        Command::Get(job) => read::get(&connect(&config).await?, job).await,
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
            read::list(&connect(&config).await?, topic, *limit, *offset, which).await
        }
        Command::Stats { topic } => {
            read::stats(&connect(&config).await?, topic.as_ref(), &config.targets).await
        }
        Command::Targets(TargetsArgs { action: None }) => {
            targets::targets(&connect(&config).await?, &config.targets).await
        }
        Command::Targets(TargetsArgs {
            action: Some(TargetsAction::Enable { name }),
        }) => targets::by_hand(&connect(&config).await?, &config.targets, name, true).await,
        Command::Targets(TargetsArgs {
            action: Some(TargetsAction::Disable { name }),
        }) => targets::by_hand(&connect(&config).await?, &config.targets, name, false).await,
        Command::Targets(TargetsArgs {
            action: Some(TargetsAction::Redrive { name, since, until }),
        }) => {
            let store = connect(&config).await?;
            let window = (since.as_deref(), until.as_deref());
            targets::redrive(&store, &config.targets, name, window).await
        }
        Command::Pause { topic } => control::pause(&connect(&config).await?, topic, true).await,
        Command::Resume { topic } => control::pause(&connect(&config).await?, topic, false).await,
        Command::RateLimit { topic, rate, burst } => {
            let change = control::rate_change(rate.as_deref(), burst.as_deref())?;
            control::rate_limit(&connect(&config).await?, topic, change).await
        }
        Command::Redrive { topic, id } => {
            control::redrive(&connect(&config).await?, topic, id.as_ref()).await
        }
        Command::History { topic, id, limit } => {
            read::history(&connect(&config).await?, topic, id.as_ref(), *limit).await
        }
        Command::Check { topic, repair } => {
            check::check(
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
    }
}
