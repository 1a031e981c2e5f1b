//! `redisched delete`: one job by id, or every job whose id starts with a prefix.

use crate::job::IdPrefix;
use crate::store::Store;
use crate::view::{self, DeleteView, PrefixDeleteView};

use super::output::Output;
use super::{CliError, DeleteArgs};

pub(super) async fn delete(store: &Store, args: &DeleteArgs) -> Result<Output, CliError> {
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
