//! The renewal schedule on its own, against renewals scripted by the test: when it renews,
//! what it renews from, when it stops, and how each kind of answer ends or keeps the hold.
//! The clock is the real one (the schedule reads `std::time::Instant`); bounds that a late
//! timer could break are kept wide, and the ones a timer cannot break (never early) exact.

use std::collections::VecDeque;
use std::fmt;
use std::future::poll_fn;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use super::{RenewError, Renewal, Schedule};
use crate::future::BoxFuture;

/// A renewal's failure: the token gone, or anything else.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Failure {
    Gone,
    Transient,
}

impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{self:?}")
    }
}

impl RenewError for Failure {
    fn is_gone(&self) -> bool {
        *self == Failure::Gone
    }
}

/// How a renewal answers.
#[derive(Debug, Clone, Copy)]
enum Reply {
    /// At once: valid for this long from now.
    Extend(Duration),
    /// At once: this failure.
    Fail(Failure),
    /// Never (pending until dropped).
    Hang,
}

/// What the schedule did: each renewal it started (when, and the validity it renewed), and
/// each end of validity it heard of.
#[derive(Debug)]
struct RenewalLog {
    replies: VecDeque<Reply>,
    /// The reply once `replies` is used up.
    then: Reply,
    calls: Vec<(Instant, Instant)>,
    renewed: Vec<Instant>,
}

/// Renewals are never this many in a test: more means a loop that renews without waiting.
const RUNAWAY: usize = 100;
/// Polls of one renewal in flight without it being woken: a loop that does not wait.
const SPIN: usize = 10_000;

struct Harness {
    schedule: Schedule<Failure>,
    log: Arc<Mutex<RenewalLog>>,
    /// About when the hold was acquired: its validity's end minus the TTL.
    acquired: Instant,
}

impl Harness {
    fn new(ttl: Duration, renewal: Renewal, replies: &[Reply], then: Reply) -> Self {
        let acquired = Instant::now();
        Self {
            schedule: Schedule::new(acquired + ttl, ttl, renewal),
            log: Arc::new(Mutex::new(RenewalLog {
                replies: replies.iter().copied().collect(),
                then,
                calls: Vec::new(),
                renewed: Vec::new(),
            })),
            acquired,
        }
    }

    /// One poll of the schedule.
    fn poll(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        let log = &self.log;
        self.schedule.poll_lost(
            cx,
            "key",
            |valid_until| {
                let mut log = log.lock().unwrap();
                assert!(
                    log.calls.len() < RUNAWAY,
                    "renewals started without waiting"
                );
                log.calls.push((Instant::now(), valid_until));
                let reply = log.replies.pop_front().unwrap_or(log.then);
                let future: BoxFuture<Result<Instant, Failure>> = match reply {
                    Reply::Extend(ttl) => Box::pin(async move { Ok(Instant::now() + ttl) }),
                    Reply::Fail(failure) => Box::pin(async move { Err(failure) }),
                    Reply::Hang => {
                        let mut polls = 0;
                        Box::pin(poll_fn(move |_| {
                            polls += 1;
                            assert!(polls < SPIN, "a renewal in flight polled without waiting");
                            Poll::Pending
                        }))
                    }
                };
                future
            },
            |until| log.lock().unwrap().renewed.push(until),
        )
    }

    /// Polls the schedule as a task would for up to `bound`: when it reported the hold lost,
    /// or `None` if it still held at the end.
    async fn drive(&mut self, bound: Duration) -> Option<Instant> {
        tokio::time::timeout(bound, poll_fn(|cx| self.poll(cx)))
            .await
            .ok()
            .map(|()| Instant::now())
    }

    /// The renewals started so far: when, and from which end of validity.
    fn calls(&self) -> Vec<(Instant, Instant)> {
        self.log.lock().unwrap().calls.clone()
    }

    fn renewed(&self) -> Vec<Instant> {
        self.log.lock().unwrap().renewed.clone()
    }
}

const MS: Duration = Duration::from_millis(1);

#[tokio::test]
async fn a_disabled_renewal_never_renews_and_the_hold_ends_with_its_validity() {
    let ttl = 150 * MS;
    let mut h = Harness::new(ttl, Renewal::disabled(), &[], Reply::Extend(ttl));
    assert!(h.schedule.every.is_none());
    assert!(h.schedule.is_valid() && !h.schedule.is_lost());
    let lost = h
        .drive(5_000 * MS)
        .await
        .expect("lost when the validity ends");
    assert!(lost >= h.acquired + ttl, "lost before its validity ended");
    assert!(h.calls().is_empty(), "a disabled renewal renewed");
    assert!(h.schedule.is_lost() && !h.schedule.is_valid());
}

#[tokio::test]
async fn renews_every_period_from_acquisition_and_moves_the_validity() {
    let ttl = 1_000 * MS;
    let every = 40 * MS;
    let mut h = Harness::new(
        ttl,
        Renewal::default().every(every),
        &[],
        Reply::Extend(ttl),
    );
    assert_eq!(
        h.drive(300 * MS).await,
        None,
        "lost while every renewal succeeded"
    );
    let calls = h.calls();
    let renewed = h.renewed();
    // 7 on time; far fewer if the period were the default (TTL/3: none in 300 ms).
    assert!(
        (3..=8).contains(&calls.len()),
        "{} renewals in 300 ms, every 40 ms",
        calls.len()
    );
    assert!(
        calls[0].0 >= h.acquired + every,
        "renewed before its period"
    );
    assert_eq!(
        calls[0].1,
        h.acquired + ttl,
        "the first renews the acquired validity"
    );
    for (i, pair) in calls.windows(2).enumerate() {
        assert!(
            pair[1].0 >= pair[0].0 + every,
            "renewals closer than the period"
        );
        assert_eq!(
            pair[1].1, renewed[i],
            "a renewal not from the last validity"
        );
    }
    assert!(renewed.windows(2).all(|p| p[0] < p[1]));
    assert_eq!(renewed.len(), calls.len());
    assert!(h.schedule.is_valid() && !h.schedule.is_lost() && !h.schedule.is_renewing());
}

#[tokio::test]
async fn stops_renewing_after_max_hold_and_then_ends_with_the_validity() {
    let ttl = 200 * MS;
    let max_hold = 100 * MS;
    let renewal = Renewal::default().every(40 * MS).max_hold(max_hold);
    let mut h = Harness::new(ttl, renewal, &[], Reply::Extend(ttl));
    let lost = h.drive(5_000 * MS).await.expect("lost once renewals stop");
    let calls = h.calls();
    assert!(
        (1..=2).contains(&calls.len()),
        "{} renewals within a max_hold of 100 ms, every 40 ms",
        calls.len()
    );
    for (at, _) in &calls {
        assert!(*at < h.acquired + max_hold, "renewed after max_hold");
    }
    let last = *h.renewed().last().unwrap();
    assert!(
        lost >= last,
        "lost before the last renewal's validity ended"
    );
}

#[tokio::test]
async fn a_renewal_that_finds_the_token_gone_loses_the_hold_at_once() {
    let ttl = 2_000 * MS;
    let renewal = Renewal::default().every(30 * MS);
    let mut h = Harness::new(
        ttl,
        renewal,
        &[Reply::Fail(Failure::Gone)],
        Reply::Extend(ttl),
    );
    let lost = h
        .drive(1_000 * MS)
        .await
        .expect("lost on the first renewal");
    assert!(lost < h.acquired + ttl, "lost only when the validity ended");
    assert_eq!(h.calls().len(), 1);
    assert!(h.schedule.is_lost());
    assert!(!h.schedule.is_valid(), "valid after it was found lost");
    assert!(!h.schedule.is_renewing());
    // Lost for good: every later poll says so, and renews nothing.
    let mut cx = Context::from_waker(Waker::noop());
    assert_eq!(h.poll(&mut cx), Poll::Ready(()));
    assert_eq!(h.calls().len(), 1);
    assert!(h.renewed().is_empty());
}

#[tokio::test]
async fn a_failed_renewal_is_retried_soon_and_the_hold_kept() {
    let ttl = 3_000 * MS;
    let every = 200 * MS;
    let renewal = Renewal::default().every(every);
    let replies = [Reply::Fail(Failure::Transient)];
    let mut h = Harness::new(ttl, renewal, &replies, Reply::Extend(ttl));
    assert_eq!(
        h.drive(350 * MS).await,
        None,
        "lost on a failure that was not 'gone'"
    );
    let calls = h.calls();
    assert!(calls.len() >= 2, "the failed renewal was not retried");
    // Retried a quarter period later (50 ms), not at once and not a period or more later.
    let gap = calls[1].0 - calls[0].0;
    assert!(gap >= every / 4, "retried after {gap:?}");
    assert!(gap < 2 * every, "retried after {gap:?}");
    // From the validity the failure left as it was.
    assert_eq!(calls[1].1, h.acquired + ttl);
    assert_eq!(h.renewed().len(), calls.len() - 1);
    assert!(h.schedule.is_valid() && !h.schedule.is_lost());
}

#[tokio::test]
async fn one_renewal_in_flight_at_a_time_and_the_task_waits_for_it() {
    let ttl = 2_000 * MS;
    let renewal = Renewal::default().every(20 * MS);
    let mut h = Harness::new(ttl, renewal, &[], Reply::Hang);
    assert!(
        !h.schedule.is_renewing(),
        "renewing before the first renewal"
    );
    assert_eq!(h.drive(200 * MS).await, None);
    assert!(h.schedule.is_renewing());
    assert_eq!(
        h.calls().len(),
        1,
        "a second renewal began beside the first"
    );
    assert!(h.schedule.is_valid());
}

#[tokio::test]
async fn validity_is_read_off_the_clock_without_a_poll() {
    let ttl = 100 * MS;
    let h = Harness::new(ttl, Renewal::default(), &[], Reply::Extend(ttl));
    assert!(h.schedule.is_valid());
    // What is under test is the clock passing the end of the validity.
    tokio::time::sleep_until((h.acquired + ttl + 20 * MS).into()).await;
    assert!(!h.schedule.is_valid(), "valid past the end of its validity");
    assert!(!h.schedule.is_lost(), "lost without a poll to find it");
    assert!(h.calls().is_empty());
}

#[test]
fn debug_names_the_schedule_and_its_state() {
    let h = Harness::new(90 * MS, Renewal::default(), &[], Reply::Hang);
    let shown = format!("{:?}", h.schedule);
    assert!(shown.starts_with("Schedule {"), "{shown}");
    assert!(shown.contains("every: Some(30ms)"), "{shown}");
    assert!(shown.contains("lost: false"), "{shown}");
}
