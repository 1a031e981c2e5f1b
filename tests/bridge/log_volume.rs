//! Logs stay readable under bad input: a flood of invalid commands writes
//! the first one of each topic with its reason, then a summary with the exact count, not
//! a WARN line per command. Nothing is hidden: every command is still set aside.

use crate::common;

use std::process::Stdio;
use std::time::Duration;

use common::bridge::*;
use lapin::BasicProperties;

const SECOND: Duration = Duration::from_secs(1);

/// `count=N` of a summary line, as the human log format prints fields.
fn count_field(line: &str) -> Option<u64> {
    let start = line.find("count=")? + "count=".len();
    let digits: String = line[start..]
        .chars()
        .take_while(char::is_ascii_digit)
        .collect();
    digits.parse().ok()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_of_invalid_commands_is_logged_once_per_topic_with_counts() {
    let _shared = common::timed::shared().await;
    let mut config = test_config("logvolume");
    config.log.level = "redisched=info,lapin=error".into();
    let broker = Broker::new(&config).await;
    let mut invalid = broker.consume_invalid().await;
    let log = std::env::temp_dir().join(format!("{}.log", config.redis.prefix));
    let file = std::fs::File::create(&log).expect("log file");
    let mut bridge = ChildBridge::start_logging(&config, Stdio::null(), Stdio::from(file));
    // No message_id: invalid. 1,000 for one topic, 10 for another.
    let floods = [("flood", 1_000usize), ("trickle", 10)];
    for (topic, n) in floods {
        for _ in 0..n {
            broker
                .command(topic, BasicProperties::default(), b"x")
                .await;
        }
    }
    let total: usize = floods.iter().map(|(_, n)| n).sum();
    let set_aside = invalid.collect(total, 60 * SECOND).await;
    let (status, _) = bridge.terminate();
    let text = std::fs::read_to_string(&log).unwrap_or_default();
    let _ = std::fs::remove_file(&log);
    broker.cleanup().await;
    assert_eq!(set_aside.len(), total, "every invalid command set aside");
    assert!(status.success(), "{status:?}");

    let firsts: Vec<&str> = text
        .lines()
        .filter(|l| l.contains("invalid command set aside"))
        .collect();
    let summaries: Vec<&str> = text
        .lines()
        .filter(|l| l.contains("more invalid commands set aside"))
        .collect();
    assert_eq!(
        firsts.len(),
        2,
        "the first of each topic, with its reason:\n{text}"
    );
    assert!(
        firsts.iter().all(|l| l.contains("missing message_id")),
        "{firsts:?}"
    );
    assert!(
        summaries.len() <= 6,
        "a few summaries, not a line each:\n{text}"
    );
    let counted: u64 = summaries.iter().filter_map(|l| count_field(l)).sum();
    assert_eq!(
        counted + firsts.len() as u64,
        total as u64,
        "the summaries count every command the first lines did not show:\n{text}"
    );
    let warn_lines = text.lines().filter(|l| l.contains("WARN")).count();
    assert!(
        warn_lines < 20,
        "{warn_lines} WARN lines for {total} invalid commands:\n{text}"
    );
}
