//! `redisched targets`: the configured webhook targets and what Redis holds for them;
//! `redisched targets redrive`: a target's parked jobs by the time of their last failure;
//! `redisched targets enable|disable`: a target's breaker by hand.

use crate::job::window::FailureWindow;
use crate::store::{HealthOp, Store};
use crate::targets::TargetConfig;
use crate::view::{self, TargetRedriveView};

use super::output::Output;
use super::CliError;

/// `redisched targets`: the configured targets (no Redis needed).
pub(super) async fn targets(store: &Store, targets: &[TargetConfig]) -> Result<Output, CliError> {
    let mut rows = Vec::new();
    if !targets.is_empty() {
        for topic in store.topics().await? {
            let stats = store.stats(&topic).await?;
            rows.push((topic, stats));
        }
    }
    let health = store.targets_health(targets).await?;
    let view = view::TargetsView::new(targets, |_| None)
        .with_backlog(targets, &rows)
        .with_health(&health);
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
        if let Some(h) = &t.health {
            human.push_str(&format!(
                "    state {}{}{}\n",
                h.state,
                if h.held_by_breaker {
                    "  (jobs held by the breaker: they wait, spending no attempts)"
                } else {
                    ""
                },
                if h.state_reason.is_empty() {
                    String::new()
                } else {
                    format!(
                        "  since {}: {}",
                        h.state_changed_at_rfc3339.as_deref().unwrap_or("?"),
                        h.state_reason
                    )
                }
            ));
        }
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

/// `redisched targets redrive <name> [--since T] [--until T]`: the parked jobs of every
/// known topic the target serves whose last failure lies in the window, due now.
pub(super) async fn redrive(
    store: &Store,
    targets: &[TargetConfig],
    name: &str,
    (since, until): (Option<&str>, Option<&str>),
) -> Result<Output, CliError> {
    if !targets.iter().any(|t| t.name == name) {
        return Err(CliError::NotFound(view::no_such_target(name, targets)));
    }
    let now = store.server_time().await?;
    let window = FailureWindow::parse(("--since", "--until"), since, until, now)
        .map_err(|e| CliError::Usage(e.0))?;
    let topics = store.topics().await?;
    let served: Vec<_> = crate::targets::served_by(targets, name, &topics)
        .into_iter()
        .cloned()
        .collect();
    let moved = store.redrive_window_topics(&served, window).await?;
    let view = TargetRedriveView::new(name, window, &moved);
    let span = format!("{} .. {}", view.since_rfc3339, view.until_rfc3339);
    let mut human = match (view.redriven, view.topics.len()) {
        (_, 0) => format!("target {name} serves no known topic: nothing to re-drive"),
        (0, n) => {
            format!("no parked job of target {name} last failed in {span} ({n} topic(s) looked at)")
        }
        (total, _) => format!(
            "re-drove {total} parked job(s) of target {name} that last failed in {span}: due now"
        ),
    };
    if view.redriven > 0 {
        for row in &view.topics {
            human.push_str(&format!("\n  {}  {}", row.topic, row.redriven));
        }
    }
    Ok(Output {
        json: view::to_json(&view),
        human,
    })
}

/// `redisched targets enable|disable <name>`: the breaker by hand. The change is
/// announced (logged, counted, published) by the first bridge that syncs next.
pub(super) async fn by_hand(
    store: &Store,
    targets: &[TargetConfig],
    name: &str,
    enable: bool,
) -> Result<Output, CliError> {
    let Some(target) = targets.iter().find(|t| t.name == name) else {
        return Err(CliError::NotFound(view::no_such_target(name, targets)));
    };
    let op = if enable {
        HealthOp::Enable
    } else {
        HealthOp::Disable
    };
    let h = store.target_health(name, &target.breaker, op).await?;
    let view = view::TargetStateChanged {
        target: name.to_owned(),
        health: view::TargetHealthFields::new(&h),
    };
    let human = if enable {
        format!(
            "target {name} enabled: state {} (its held jobs go out again)",
            view.health.state
        )
    } else {
        format!("target {name} disabled: nothing is sent to it, its jobs wait until `redisched targets enable {name}`")
    };
    Ok(Output {
        json: view::to_json(&view),
        human,
    })
}
