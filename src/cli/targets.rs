//! `redisched targets`: the configured webhook targets and what Redis holds for them.

use crate::store::Store;
use crate::view;

use super::output::Output;
use super::CliError;

/// `redisched targets`: the configured targets (no Redis needed).
pub(super) async fn targets(
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
