//! `redisched put`: the body, the schedule (`--every`, `--cron`/`--tz`, `--jitter`) and
//! the write.

use std::io::Read;

use crate::config::Config;
use crate::job::schedule::{PartsError, Schedule, ScheduleParts};
use crate::job::{Due, PutMode};
use crate::store::{PutRequest, Store};
use crate::view::{self, rfc3339, PutView, ScheduleFields};

use super::output::{relative, Output};
use super::{connect, CliError, PutArgs};

/// Checks the arguments before Redis is reached, then writes the job.
pub(super) async fn execute(config: &Config, args: &PutArgs) -> Result<Output, CliError> {
    let schedule = schedule_of(args, config.limits.min_interval_ms)?;
    let body = read_body(args)?;
    if let Some(url) = &args.url {
        crate::targets::check_job_url_for(&config.targets, args.topic.as_str(), url)
            .map_err(|reason| CliError::Usage(format!("--url: {reason}")))?;
    }
    let store = connect(config).await?;
    put(&store, args, body, schedule).await
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

/// The schedule `--every` or `--cron` (+ `--tz`) asks for, with its `--jitter` (ms, 0
/// for none): every face's rule (`Schedule::from_parts`), refused in the flags' terms.
fn schedule_of(args: &PutArgs, min_interval_ms: u64) -> Result<Option<(Schedule, u64)>, CliError> {
    let parts = ScheduleParts {
        every: args.every.as_deref(),
        cron: args.cron.as_deref(),
        tz: args.tz.as_deref(),
        jitter: args.jitter.as_deref(),
    };
    Schedule::from_parts(parts, min_interval_ms).map_err(|err| {
        let flag_value = |value: &Option<String>| value.as_deref().unwrap_or_default().to_owned();
        CliError::Usage(match err {
            // clap refuses these two first (`conflicts_with`, `requires`).
            PartsError::BothEveryAndCron => "give --every or --cron, not both".into(),
            PartsError::TzWithoutCron => "--tz is only used with --cron".into(),
            PartsError::JitterWithoutSchedule => "--jitter is only for a recurring job (give --every or --cron): a one-shot job has no occurrences to spread".into(),
            PartsError::Every(e) => format!("--every {}: {e}", flag_value(&args.every)),
            PartsError::Cron(e) => format!("--cron: {e}"),
            PartsError::Jitter(e) => format!("--jitter {}: {e}", flag_value(&args.jitter)),
        })
    })
}

async fn put(
    store: &Store,
    args: &PutArgs,
    body: Vec<u8>,
    schedule: Option<(Schedule, u64)>,
) -> Result<Output, CliError> {
    let explicit = args.delay.or(args.at);
    let mode = if args.replace {
        PutMode::Replace
    } else {
        PutMode::Keep
    };
    let size = body.len();
    let jitter_ms = schedule.as_ref().map_or(0, |(_, ms)| *ms);
    let mut request = PutRequest {
        topic: args.topic.clone(),
        id: args.id.clone(),
        body,
        meta: crate::job::expiry::meta_with_expiry(
            crate::job::meta::of_put(args.url.as_deref(), jitter_ms),
            args.expires_after,
        ),
        due: explicit.unwrap_or(Due::NOW),
        mode,
    };
    let outcome = match &schedule {
        None => store.put(request).await?,
        Some((schedule, _)) => {
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
        .and_then(|(s, _)| ScheduleFields::of(Some(&s.to_spec())).describe())
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
