//! Model-based property test of the store: random sequences of put (nx and replace,
//! one-shot or recurring), delete, reserve, release (current or stale token; a series
//! moves to its next occurrence or ends), retry, failed publishes that park a job at
//! `MAX_ATTEMPTS`, redrive, pause and resume, requeue and pull over a few ids in two
//! topics, run against the real Redis and an in-memory model.
//!
//! After every step, raw Redis commands check the store's invariant (an id is in the
//! jobs hash exactly when it is in exactly one of `scheduled`, `reserved`; parked jobs
//! are in `scheduled` at the parking score; `failing` holds exactly the jobs with a
//! recorded failure) and that each set holds exactly the ids the model expects; every
//! reply is checked against the model (status, removed flag, release counts, attempts,
//! failures, state, spec, bodies, paused batches).
//!
//! Time cannot be controlled, so the model only uses due times that are certain:
//! "now" (delay 0) or "far later" (60 s, never due within a case). Reservations are
//! either long (60 s, never expire within a case) or 1 ms; before a requeue the test
//! sleeps a few ms if any 1 ms reservation is outstanding, so that requeue finds every
//! one of them expired. Nothing depends on a race.

use crate::common;

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use proptest::prelude::*;
use redis::Commands;
use redisched::job::spec::ScheduleSpec;
use redisched::job::{Due, JobId, PutMode, Topic};
use redisched::store::{
    Delivered, JobState, Lease, NextDue, PutRequest, PutStatus, RetryOutcome, Store,
};

const TOPICS: [&str; 2] = ["m.one", "m.two"];
const IDS: [&str; 3] = ["a", "b", "c"];
const LATER_MS: i64 = 60_000;
const LONG_TTR: Duration = Duration::from_secs(60);
const SHORT_TTR: Duration = Duration::from_millis(1);
/// Failed publishes after which a job is parked.
const MAX_ATTEMPTS: u32 = 2;
/// Where parked jobs wait in `scheduled` (lua/README.md, "Parked jobs").
const PARKED_SCORE: f64 = 1e17;

#[derive(Debug, Clone, Copy)]
enum TokenPick {
    /// The reservation's token if reserved, else the last one it ever had.
    Current,
    /// One of the tokens this id ever had (most likely stale).
    Old(usize),
    Zero,
}

#[derive(Debug, Clone)]
enum Step {
    Put {
        t: usize,
        id: usize,
        replace: bool,
        later: bool,
        body: u8,
        series: bool,
    },
    Delete {
        t: usize,
        id: usize,
    },
    Reserve {
        t: usize,
        limit: usize,
        short: bool,
    },
    Release {
        t: usize,
        ids: Vec<(usize, TokenPick)>,
        /// Recurring jobs among them end their series instead of moving on.
        end: bool,
    },
    /// A failed publish, recorded; parks the job at `MAX_ATTEMPTS`.
    Fail {
        t: usize,
        id: usize,
        token: TokenPick,
    },
    Redrive {
        t: usize,
        /// One id, or all parked jobs of the topic.
        id: Option<usize>,
    },
    Pause {
        t: usize,
    },
    Resume {
        t: usize,
    },
    Retry {
        t: usize,
        id: usize,
        token: TokenPick,
        later: bool,
    },
    Requeue {
        t: usize,
        limit: usize,
    },
    Pull {
        t: usize,
        limit: usize,
    },
}

fn token_pick() -> impl Strategy<Value = TokenPick> {
    prop_oneof![
        3 => Just(TokenPick::Current),
        2 => (0..4usize).prop_map(TokenPick::Old),
        1 => Just(TokenPick::Zero),
    ]
}

fn step() -> impl Strategy<Value = Step> {
    let t = 0..TOPICS.len();
    let id = 0..IDS.len();
    prop_oneof![
        5 => (t.clone(), id.clone(), any::<bool>(), prop::bool::weighted(0.25), any::<u8>(), prop::bool::weighted(0.3))
            .prop_map(|(t, id, replace, later, body, series)| Step::Put { t, id, replace, later, body, series }),
        1 => (t.clone(), id.clone()).prop_map(|(t, id)| Step::Delete { t, id }),
        4 => (t.clone(), 1..4usize, prop::bool::weighted(0.4))
            .prop_map(|(t, limit, short)| Step::Reserve { t, limit, short }),
        4 => (t.clone(), prop::collection::vec((id.clone(), token_pick()), 1..3), prop::bool::weighted(0.2))
            .prop_map(|(t, ids, end)| Step::Release { t, ids, end }),
        4 => (t.clone(), id.clone(), token_pick())
            .prop_map(|(t, id, token)| Step::Fail { t, id, token }),
        1 => (t.clone(), prop::option::of(id.clone())).prop_map(|(t, id)| Step::Redrive { t, id }),
        1 => t.clone().prop_map(|t| Step::Pause { t }),
        1 => t.clone().prop_map(|t| Step::Resume { t }),
        2 => (t.clone(), id.clone(), token_pick(), prop::bool::weighted(0.3))
            .prop_map(|(t, id, token, later)| Step::Retry { t, id, token, later }),
        2 => (t.clone(), 1..4usize).prop_map(|(t, limit)| Step::Requeue { t, limit }),
        1 => (t, 1..4usize).prop_map(|(t, limit)| Step::Pull { t, limit }),
    ]
}

#[derive(Debug, Clone, PartialEq)]
enum Place {
    Scheduled { due_now: bool },
    Reserved { token: u64, short: bool },
    Parked,
}

#[derive(Debug, Clone)]
struct MJob {
    place: Place,
    attempts: u32,
    body: Vec<u8>,
    /// A recurring job (put with a schedule spec).
    series: bool,
    /// Failed publishes recorded (of this occurrence).
    failures: u32,
}

#[derive(Debug, Default)]
struct Model {
    jobs: BTreeMap<(usize, usize), MJob>,
    /// Every token each (topic, id) was ever reserved under, oldest first.
    tokens: BTreeMap<(usize, usize), Vec<u64>>,
    /// Highest token seen per topic: new ones must be larger (unique per topic).
    max_token: [u64; 2],
    paused: [bool; 2],
}

impl Model {
    fn resolve(&self, key: (usize, usize), pick: TokenPick) -> u64 {
        let history = self.tokens.get(&key).map(Vec::as_slice).unwrap_or(&[]);
        match pick {
            TokenPick::Current => match self.jobs.get(&key).map(|j| &j.place) {
                Some(Place::Reserved { token, .. }) => *token,
                _ => history.last().copied().unwrap_or(0),
            },
            TokenPick::Old(i) if !history.is_empty() => history[i % history.len()],
            TokenPick::Old(_) => 987_654_321,
            TokenPick::Zero => 0,
        }
    }

    fn holds(&self, key: (usize, usize), token: u64) -> bool {
        matches!(self.jobs.get(&key), Some(MJob { place: Place::Reserved { token: current, .. }, .. }) if *current == token)
    }

    /// What reserve or pull may take: nothing while the topic is paused.
    fn due(&self, t: usize) -> BTreeSet<usize> {
        if self.paused[t] {
            return BTreeSet::new();
        }
        self.jobs
            .iter()
            .filter(|((jt, _), job)| *jt == t && job.place == Place::Scheduled { due_now: true })
            .map(|((_, id), _)| *id)
            .collect()
    }

    fn expired(&self, t: usize) -> BTreeSet<usize> {
        self.jobs
            .iter()
            .filter(|((jt, _), job)| {
                *jt == t && matches!(job.place, Place::Reserved { short: true, .. })
            })
            .map(|((_, id), _)| *id)
            .collect()
    }
}

fn spec() -> ScheduleSpec {
    ScheduleSpec::every(LATER_MS as u64)
}

fn body_of(seed: u8) -> Vec<u8> {
    vec![seed, 0, 0xff, b'|']
}

fn id_index(id: &str) -> usize {
    IDS.iter()
        .position(|i| *i == id)
        .unwrap_or_else(|| panic!("unknown id {id}"))
}

async fn run_step(
    store: &Store,
    topics: &[Topic],
    model: &mut Model,
    step: &Step,
) -> Result<(), TestCaseError> {
    match step {
        Step::Put {
            t,
            id,
            replace,
            later,
            body,
            series,
        } => {
            let key = (*t, *id);
            let request = PutRequest {
                topic: topics[*t].clone(),
                id: JobId::new(IDS[*id]).unwrap(),
                body: body_of(*body),
                meta: vec![*body],
                due: if *later {
                    Due::Delay(LATER_MS)
                } else {
                    Due::NOW
                },
                mode: if *replace {
                    PutMode::Replace
                } else {
                    PutMode::Keep
                },
            };
            let outcome = if *series {
                store.put_recurring(request, spec()).await
            } else {
                store.put(request).await
            }
            .map_err(|e| TestCaseError::fail(e.to_string()))?;
            let fresh = MJob {
                place: Place::Scheduled { due_now: !*later },
                attempts: 0,
                body: body_of(*body),
                series: *series,
                failures: 0,
            };
            let expected = match (model.jobs.contains_key(&key), *replace) {
                (false, _) => {
                    model.jobs.insert(key, fresh);
                    PutStatus::Scheduled
                }
                (true, false) => PutStatus::Duplicate,
                (true, true) => {
                    model.jobs.insert(key, fresh);
                    PutStatus::Replaced
                }
            };
            prop_assert_eq!(outcome.status, expected);
        }
        Step::Delete { t, id } => {
            let removed = store
                .delete(&topics[*t], &JobId::new(IDS[*id]).unwrap())
                .await
                .map_err(|e| TestCaseError::fail(e.to_string()))?;
            prop_assert_eq!(removed, model.jobs.remove(&(*t, *id)).is_some());
        }
        Step::Reserve { t, limit, short } => {
            let ttr = if *short { SHORT_TTR } else { LONG_TTR };
            let batch = store
                .reserve(&topics[*t], ttr, *limit)
                .await
                .map_err(|e| TestCaseError::fail(e.to_string()))?;
            let due = model.due(*t);
            prop_assert_eq!(batch.jobs.len(), due.len().min(*limit));
            prop_assert!(batch.corrupt.is_empty());
            prop_assert_eq!(batch.paused, model.paused[*t]);
            for job in &batch.jobs {
                let id = id_index(&job.id);
                prop_assert!(due.contains(&id), "{} was not due", job.id);
                prop_assert!(
                    job.token > model.max_token[*t],
                    "token {} not fresh",
                    job.token
                );
                model.max_token[*t] = job.token;
                let entry = model.jobs.get_mut(&(*t, id)).unwrap();
                prop_assert_eq!(job.attempt, entry.attempts + 1);
                prop_assert_eq!(&job.body, &entry.body);
                prop_assert_eq!(job.spec.is_some(), entry.series);
                entry.attempts += 1;
                entry.place = Place::Reserved {
                    token: job.token,
                    short: *short,
                };
                model.tokens.entry((*t, id)).or_default().push(job.token);
            }
            if batch.jobs.len() < due.len() {
                prop_assert!(batch.next_due.is_some_and(|d| d <= batch.now));
            }
        }
        Step::Release { t, ids, end } => {
            // A next occurrence certainly after the server's now, never due in a case.
            let next = store
                .server_time()
                .await
                .map_err(|e| TestCaseError::fail(e.to_string()))?
                + LATER_MS;
            let mut delivered = Vec::new();
            let mut expected = 0;
            let mut seen = BTreeSet::new();
            for (id, pick) in ids {
                let token = model.resolve((*t, *id), *pick);
                let series = model.jobs.get(&(*t, *id)).is_some_and(|j| j.series);
                delivered.push(Delivered {
                    lease: Lease {
                        topic: topics[*t].clone(),
                        id: IDS[*id].to_string(),
                        token,
                    },
                    next_due: match (series, *end) {
                        (false, _) => NextDue::OneShot,
                        (true, false) => NextDue::At(next),
                        (true, true) => NextDue::End,
                    },
                });
                if model.holds((*t, *id), token) && seen.insert(*id) {
                    expected += 1;
                }
            }
            let released = if delivered.iter().all(|d| d.next_due == NextDue::OneShot) {
                // The plain path, as a bridge without series uses it.
                let leases: Vec<Lease> = delivered.into_iter().map(|d| d.lease).collect();
                store.release(&leases).await
            } else {
                store.release_delivered(&delivered).await
            }
            .map_err(|e| TestCaseError::fail(e.to_string()))?;
            prop_assert_eq!(released, expected);
            for id in seen {
                let job = model.jobs.get_mut(&(*t, id)).unwrap();
                if job.series && !*end {
                    // The series moves on: next occurrence, attempts and failures reset.
                    job.place = Place::Scheduled { due_now: false };
                    job.attempts = 0;
                    job.failures = 0;
                } else {
                    model.jobs.remove(&(*t, id));
                }
            }
        }
        Step::Fail { t, id, token } => {
            let token = model.resolve((*t, *id), *token);
            let lease = Lease {
                topic: topics[*t].clone(),
                id: IDS[*id].to_string(),
                token,
            };
            let outcome = store
                .retry_failed(&lease, Duration::ZERO, "unroutable: NO_ROUTE", MAX_ATTEMPTS)
                .await
                .map_err(|e| TestCaseError::fail(e.to_string()))?;
            if !model.holds((*t, *id), token) {
                prop_assert_eq!(outcome, RetryOutcome::Stale);
            } else {
                let job = model.jobs.get_mut(&(*t, *id)).unwrap();
                job.failures += 1;
                if job.failures >= MAX_ATTEMPTS {
                    prop_assert_eq!(outcome, RetryOutcome::Parked);
                    job.place = Place::Parked;
                } else {
                    prop_assert_eq!(outcome, RetryOutcome::Retried);
                    job.place = Place::Scheduled { due_now: true };
                }
            }
        }
        Step::Redrive { t, id } => {
            let parked = |model: &Model, id: usize| {
                model
                    .jobs
                    .get(&(*t, id))
                    .is_some_and(|j| j.place == Place::Parked)
            };
            let moved: Vec<usize> = match id {
                Some(id) => {
                    let done = store
                        .redrive(&topics[*t], &JobId::new(IDS[*id]).unwrap())
                        .await
                        .map_err(|e| TestCaseError::fail(e.to_string()))?;
                    prop_assert_eq!(done, parked(model, *id));
                    if done {
                        vec![*id]
                    } else {
                        vec![]
                    }
                }
                None => {
                    let all: Vec<usize> = (0..IDS.len()).filter(|&i| parked(model, i)).collect();
                    let count = store
                        .redrive_topic(&topics[*t])
                        .await
                        .map_err(|e| TestCaseError::fail(e.to_string()))?;
                    prop_assert_eq!(count as usize, all.len());
                    all
                }
            };
            for id in moved {
                // Due now, attempts and failures kept.
                model.jobs.get_mut(&(*t, id)).unwrap().place = Place::Scheduled { due_now: true };
            }
        }
        Step::Pause { t } => {
            let changed = store
                .pause(&topics[*t])
                .await
                .map_err(|e| TestCaseError::fail(e.to_string()))?;
            prop_assert_eq!(changed, !model.paused[*t]);
            model.paused[*t] = true;
        }
        Step::Resume { t } => {
            let changed = store
                .resume(&topics[*t])
                .await
                .map_err(|e| TestCaseError::fail(e.to_string()))?;
            prop_assert_eq!(changed, model.paused[*t]);
            model.paused[*t] = false;
        }
        Step::Retry {
            t,
            id,
            token,
            later,
        } => {
            let token = model.resolve((*t, *id), *token);
            let lease = Lease {
                topic: topics[*t].clone(),
                id: IDS[*id].to_string(),
                token,
            };
            let delay = Duration::from_millis(if *later { LATER_MS as u64 } else { 0 });
            let moved = store
                .retry(&lease, delay)
                .await
                .map_err(|e| TestCaseError::fail(e.to_string()))?;
            let expected = model.holds((*t, *id), token);
            prop_assert_eq!(moved, expected);
            if expected {
                model.jobs.get_mut(&(*t, *id)).unwrap().place =
                    Place::Scheduled { due_now: !*later };
            }
        }
        Step::Requeue { t, limit } => {
            let expired = model.expired(*t);
            if !expired.is_empty() {
                // Every 1 ms reservation is certainly expired after this.
                tokio::time::sleep(Duration::from_millis(3)).await;
            }
            let requeued = store
                .requeue(&topics[*t], *limit)
                .await
                .map_err(|e| TestCaseError::fail(e.to_string()))?;
            prop_assert_eq!(requeued.count as usize, expired.len().min(*limit));
            // Which of the expired ones moved depends on their deadlines (ms apart or
            // equal): read it back, and check it is the right number of the right ones.
            let scheduled_key = store.keys().topic(&topics[*t]).0[0].clone();
            let mut moved = 0;
            for id in expired {
                let score: Option<f64> =
                    common::raw_redis().zscore(&scheduled_key, IDS[id]).unwrap();
                if score.is_some() {
                    moved += 1;
                    model.jobs.get_mut(&(*t, id)).unwrap().place =
                        Place::Scheduled { due_now: true };
                }
            }
            prop_assert_eq!(moved, requeued.count as usize);
            let long_left = model
                .jobs
                .iter()
                .any(|((jt, _), j)| *jt == *t && matches!(j.place, Place::Reserved { .. }));
            prop_assert_eq!(requeued.next_deadline.is_some(), long_left);
        }
        Step::Pull { t, limit } => {
            let batch = store
                .pull(&topics[*t], *limit)
                .await
                .map_err(|e| TestCaseError::fail(e.to_string()))?;
            let due = model.due(*t);
            prop_assert_eq!(batch.jobs.len(), due.len().min(*limit));
            prop_assert_eq!(batch.paused, model.paused[*t]);
            for job in &batch.jobs {
                let id = id_index(&job.id);
                prop_assert!(due.contains(&id));
                let entry = model.jobs.remove(&(*t, id)).unwrap();
                prop_assert_eq!(job.token, 0);
                prop_assert_eq!(job.attempt, entry.attempts + 1);
                prop_assert_eq!(&job.body, &entry.body);
            }
        }
    }
    Ok(())
}

/// The invariant, read with raw commands, plus agreement with the model.
async fn check(store: &Store, topics: &[Topic], model: &Model) -> Result<(), TestCaseError> {
    let mut raw = common::raw_redis();
    for (t, topic) in topics.iter().enumerate() {
        let keys = store.keys().all(topic);
        let scheduled: BTreeSet<String> = raw.zrange(&keys[0], 0, -1).unwrap();
        let parked: BTreeSet<String> = raw.zrangebyscore(&keys[0], PARKED_SCORE, "+inf").unwrap();
        let failing: BTreeSet<String> = raw.zrange(&keys[7], 0, -1).unwrap();
        let reserved: BTreeSet<String> = raw.zrange(&keys[1], 0, -1).unwrap();
        let records: BTreeSet<String> = raw.hkeys(&keys[2]).unwrap();
        prop_assert!(
            scheduled.is_disjoint(&reserved),
            "in both sets: {:?}",
            scheduled.intersection(&reserved).collect::<Vec<_>>()
        );
        let indexed: BTreeSet<String> = scheduled.union(&reserved).cloned().collect();
        prop_assert_eq!(&records, &indexed, "jobs hash vs scheduled ∪ reserved");

        let expect = |want_reserved: bool| -> BTreeSet<String> {
            model
                .jobs
                .iter()
                .filter(|((jt, _), j)| {
                    *jt == t && matches!(j.place, Place::Reserved { .. }) == want_reserved
                })
                .map(|((_, id), _)| IDS[*id].to_string())
                .collect()
        };
        prop_assert_eq!(&scheduled, &expect(false), "scheduled set of {}", topic);
        prop_assert_eq!(&reserved, &expect(true), "reserved set of {}", topic);
        let of_model = |keep: &dyn Fn(&MJob) -> bool| -> BTreeSet<String> {
            model
                .jobs
                .iter()
                .filter(|((jt, _), j)| *jt == t && keep(j))
                .map(|((_, id), _)| IDS[*id].to_string())
                .collect()
        };
        prop_assert_eq!(
            &parked,
            &of_model(&|j| j.place == Place::Parked),
            "parked of {}",
            topic
        );
        prop_assert_eq!(
            &failing,
            &of_model(&|j| j.failures > 0),
            "failing of {}",
            topic
        );
        let stats = store
            .stats(topic)
            .await
            .map_err(|e| TestCaseError::fail(e.to_string()))?;
        prop_assert_eq!(
            stats.records,
            stats.scheduled + stats.reserved + stats.parked
        );
        prop_assert_eq!(stats.paused, model.paused[t]);
        prop_assert_eq!(stats.parked as usize, parked.len());

        for (id, name) in IDS.iter().enumerate() {
            let info = store
                .get(topic, &JobId::new(*name).unwrap())
                .await
                .map_err(|e| TestCaseError::fail(e.to_string()))?;
            match (model.jobs.get(&(t, id)), info) {
                (None, None) => {}
                (Some(job), Some(info)) => {
                    prop_assert_eq!(info.attempts, job.attempts);
                    prop_assert_eq!(&info.body, &job.body);
                    prop_assert_eq!(info.spec.is_some(), job.series);
                    prop_assert_eq!(info.failures, job.failures);
                    prop_assert_eq!(info.last_error.is_some(), job.failures > 0);
                    match job.place {
                        Place::Reserved { token, .. } => {
                            prop_assert_eq!(info.state, JobState::Reserved);
                            prop_assert_eq!(info.token, token);
                        }
                        Place::Scheduled { .. } => prop_assert_eq!(info.state, JobState::Scheduled),
                        Place::Parked => prop_assert_eq!(info.state, JobState::Parked),
                    }
                }
                (job, info) => prop_assert!(false, "{topic}/{name}: model {job:?}, store {info:?}"),
            }
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, max_shrink_iters: 200, ..ProptestConfig::default() })]

    #[test]
    fn store_matches_the_model_and_keeps_its_invariant(steps in prop::collection::vec(step(), 1..40)) {
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        runtime.block_on(async {
            let store = common::test_store().await;
            let topics: Vec<Topic> = TOPICS.iter().map(|t| Topic::new(*t).unwrap()).collect();
            let mut model = Model::default();
            for (n, step) in steps.iter().enumerate() {
                run_step(&store, &topics, &mut model, step)
                    .await
                    .map_err(|e| TestCaseError::fail(format!("step {n} {step:?}: {e}")))?;
                check(&store, &topics, &model)
                    .await
                    .map_err(|e| TestCaseError::fail(format!("after step {n} {step:?}: {e}")))?;
            }
            Ok::<(), TestCaseError>(())
        })?;
    }
}
