//! The watchdog over a lease: its loss found by a renewal or by the clock, the status
//! handles it wakes, and the checks made before each poll of the work, on the in-process
//! store and on a store whose renewals the test holds in flight ([`Gated`]).

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use super::{LeaseStatus, Renewal, Watchdog};
use crate::backend::contract::{Answer, Claim, LockBackend, LockResult, OneKey};
use crate::backend::inspect::LockInspection;
use crate::backend::settings::Settings;
#[cfg(feature = "idempotency")]
use crate::backend::{contract::Begun, records::NewRecord};
use crate::error::{LockError, LockOperation};
use crate::future::BoxFuture;
use crate::future::Watch;
use crate::holder::{Holder, HolderRef};
use crate::lease::Lease;
use crate::renewal::RenewError;
use crate::{LockRequest, Locks, MemoryLocks};

fn locks(ttl: Duration) -> Locks {
    Locks::from(MemoryLocks::builder().ttl(ttl).build().unwrap())
}

/// A task awaiting `status.lost()`, checked to be waiting.
async fn awaiting_loss(status: &LeaseStatus) -> tokio::task::JoinHandle<()> {
    let status = status.clone();
    let waiter = tokio::spawn(async move { status.lost().await });
    // On this single-threaded runtime the yield runs the waiter until it waits.
    tokio::task::yield_now().await;
    assert!(!waiter.is_finished());
    waiter
}

#[tokio::test]
async fn lost_resolves_when_the_holder_releases() {
    let locks = locks(Duration::from_secs(30));
    let lease = locks.try_lock("released").await.unwrap();
    let watchdog = Watchdog::new(locks, lease, Renewal::default());
    let status = watchdog.status();
    let waiter = awaiting_loss(&status).await;
    drop(watchdog);
    tokio::time::timeout(Duration::from_secs(5), waiter)
        .await
        .expect("lost() resolves once the watchdog is gone")
        .unwrap();
    assert!(!status.is_lost(), "a release is not a loss");
}

#[tokio::test]
async fn lost_resolves_when_the_validity_ends() {
    let ttl = Duration::from_millis(150);
    let locks = locks(ttl);
    let lease = locks.try_lock("expiring").await.unwrap();
    let watchdog = Watchdog::new(locks, lease, Renewal::disabled());
    let status = watchdog.status();
    let start = Instant::now();
    tokio::time::timeout(Duration::from_secs(5), status.lost())
        .await
        .expect("lost() resolves at the end of the validity");
    assert!(status.is_lost());
    assert!(start.elapsed() < ttl + Duration::from_secs(1));
    assert_eq!(status.remaining(), Duration::ZERO);
    drop(watchdog);
}

#[tokio::test]
async fn renewals_move_the_status_and_mark_loss() {
    let ttl = Duration::from_millis(2_000);
    let locks = locks(ttl);
    let lease = locks.try_lock("renewed").await.unwrap();
    let first = lease.valid_until();
    let copy = lease.clone();
    let mut watchdog = Watchdog::new(
        locks.clone(),
        lease,
        Renewal::default().every(Duration::from_millis(50)),
    );
    let status = watchdog.status();
    // Drive the watchdog until a renewal has moved the validity.
    let moved = tokio::time::timeout(
        Duration::from_secs(5),
        std::future::poll_fn(|cx| {
            let _ = watchdog.poll_lost(cx);
            if status.valid_until() > first {
                std::task::Poll::Ready(())
            } else {
                std::task::Poll::Pending
            }
        }),
    )
    .await;
    assert!(moved.is_ok(), "no renewal moved the validity");
    assert!(!status.is_lost());
    // The key is released behind the watchdog's back and taken by another holder: the
    // next renewal finds the token gone, and the status says lost.
    let waiter = awaiting_loss(&status).await;
    let valid_until = status.valid_until();
    locks.unlock(copy).await.unwrap();
    let _thief = locks.try_lock("renewed").await.unwrap();
    tokio::time::timeout(
        Duration::from_secs(5),
        std::future::poll_fn(|cx| watchdog.poll_lost(cx)),
    )
    .await
    .expect("the renewal finds the token gone");
    assert!(
        Instant::now() < valid_until,
        "found lost only when the validity ended, not by the renewal"
    );
    tokio::time::timeout(Duration::from_secs(5), waiter)
        .await
        .expect("lost() resolves on the loss")
        .unwrap();
    assert!(status.is_lost());
}

#[tokio::test]
async fn with_lock_gives_the_work_its_lease_and_fencing_token() {
    let locks = Locks::from(MemoryLocks::builder().fencing_tokens(true).build().unwrap());
    let (key, token, fence) = locks
        .with_lock(
            LockRequest::new("fenced").retry(),
            Renewal::default(),
            |status| async move {
                let lease = status.lease();
                (
                    lease.key().to_owned(),
                    lease.token().to_string(),
                    lease.fencing_token(),
                )
            },
        )
        .await
        .unwrap();
    assert_eq!(key, "tower-redlock:fenced");
    assert_eq!(token.len(), 32);
    assert!(fence.is_some());
    // Released at the end: the next holder gets a greater fencing token.
    let next = locks.try_lock("fenced").await.unwrap();
    assert!(next.fencing_token() > fence);
}

/// The in-process store, but each extension waits for the test's verdict: `None` extends,
/// `Some(error)` fails with it.
struct Gated {
    inner: MemoryLocks,
    started: AtomicUsize,
    verdicts: tokio::sync::Mutex<tokio::sync::mpsc::UnboundedReceiver<Option<LockError>>>,
}

impl fmt::Debug for Gated {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Gated").finish_non_exhaustive()
    }
}

type Verdicts = tokio::sync::mpsc::UnboundedSender<Option<LockError>>;

impl Gated {
    fn new(ttl: Duration) -> (Arc<Self>, Verdicts) {
        let (send, verdicts) = tokio::sync::mpsc::unbounded_channel();
        let gated = Arc::new(Self {
            inner: MemoryLocks::builder().ttl(ttl).build().unwrap(),
            started: AtomicUsize::new(0),
            verdicts: tokio::sync::Mutex::new(verdicts),
        });
        (gated, send)
    }
}

/// Delegates to the in-process store, all but `extend`.
impl LockBackend for Arc<Gated> {
    fn settings(&self) -> &Settings {
        self.inner.settings()
    }
    fn id(&self) -> u64 {
        self.inner.id()
    }
    fn in_process(&self) -> bool {
        true
    }
    fn attempt(&self, claim: Claim, at: Instant, holder: HolderRef<'_>) -> Answer<LockResult> {
        self.inner.attempt(claim, at, holder)
    }
    fn wait(&self, one: OneKey, max_wait: Duration, holder: Holder) -> BoxFuture<LockResult> {
        self.inner.wait(one, max_wait, holder)
    }
    fn extend(&self, lease: Lease) -> Answer<LockResult> {
        self.started.fetch_add(1, Ordering::SeqCst);
        let gated = self.clone();
        Answer::Later(Box::pin(async move {
            let verdict = gated.verdicts.lock().await.recv().await;
            match verdict {
                Some(Some(error)) => Err(error),
                _ => gated.inner.extend(lease).get().await,
            }
        }))
    }
    fn unlock(&self, lease: Lease) -> Answer<Result<(), LockError>> {
        self.inner.unlock(lease)
    }
    fn end(&self, lease: &Lease) -> Answer<()> {
        self.inner.end(lease)
    }
    fn release_detached(&self, lease: &Lease) {
        self.inner.release_detached(lease);
    }
    fn retry_estimate(&self, key: &str, holder_left: Duration) -> Duration {
        self.inner.retry_estimate(key, holder_left)
    }
    fn inspect(&self, key: Arc<str>) -> Answer<Result<LockInspection, LockError>> {
        self.inner.inspect(key)
    }
    fn ready(&self) -> Answer<bool> {
        self.inner.ready()
    }
    fn force_unlock(&self, key: Arc<str>) -> Answer<Result<usize, LockError>> {
        self.inner.force_unlock(key)
    }
    #[cfg(feature = "idempotency")]
    fn begin_idempotent(&self, key: Arc<str>, wait: Duration, holder: HolderRef<'_>) -> Begun {
        self.inner.begin_idempotent(key, wait, holder)
    }
    #[cfg(feature = "idempotency")]
    fn finish_idempotent(&self, lease: Lease, record: Option<NewRecord>) -> Answer<()> {
        self.inner.finish_idempotent(lease, record)
    }
}

fn noop() -> Context<'static> {
    Context::from_waker(Waker::noop())
}

#[tokio::test]
async fn a_valid_lease_is_not_lost_before_the_first_poll_and_arms_no_timer() {
    let locks = locks(Duration::from_secs(30));
    let lease = locks.try_lock("fresh").await.unwrap();
    let mut watchdog = Watchdog::new(locks, lease, Renewal::default());
    assert!(watchdog.is_valid());
    assert!(!watchdog.is_renewing());
    assert!(!Watch::lost_before_poll(&mut watchdog, &mut noop()));
    assert!(
        watchdog.schedule.is_none(),
        "the check before a poll made a schedule"
    );
    assert!(!watchdog.status().is_lost());
}

#[tokio::test]
async fn a_lease_past_its_validity_is_lost_before_the_first_poll() {
    let ttl = Duration::from_millis(100);
    let locks = locks(ttl);
    let lease = locks.try_lock("stale").await.unwrap();
    let end = lease.valid_until();
    let mut watchdog = Watchdog::new(locks, lease, Renewal::default());
    let status = watchdog.status();
    // What is under test is the clock passing the end of the validity, unpolled.
    tokio::time::sleep_until((end + Duration::from_millis(20)).into()).await;
    assert!(!watchdog.is_valid(), "valid past the end of its validity");
    assert!(Watch::lost_before_poll(&mut watchdog, &mut noop()));
    assert!(status.is_lost());
}

#[tokio::test]
async fn a_renewal_answered_between_polls_is_taken_in_before_the_next() {
    let (gated, verdicts) = Gated::new(Duration::from_secs(30));
    let locks = Locks::from_backend(Arc::new(gated.clone()));
    let lease = locks.try_lock("gated").await.unwrap();
    let renewal = Renewal::default().every(Duration::from_millis(20));
    let mut watchdog = Watchdog::new(locks, lease, renewal);
    let status = watchdog.status();
    // Polled as the work's task would be until the first renewal is in flight.
    let started = tokio::time::timeout(
        Duration::from_secs(5),
        std::future::poll_fn(|cx| {
            assert!(watchdog.poll_lost(cx).is_pending());
            if gated.started.load(Ordering::SeqCst) > 0 {
                Poll::Ready(())
            } else {
                Poll::Pending
            }
        }),
    )
    .await;
    assert!(started.is_ok(), "no renewal began");
    assert!(watchdog.is_renewing());
    // In flight and unanswered: the lease is still valid, so the work may be polled.
    assert!(!Watch::lost_before_poll(&mut watchdog, &mut noop()));
    assert!(!status.is_lost());
    // The renewal finds the token gone before the next poll of the work: not polled.
    verdicts
        .send(Some(LockError::Expired { taken_over: true }))
        .unwrap();
    assert!(
        Watch::lost_before_poll(&mut watchdog, &mut noop()),
        "the work would be polled after its lease was found gone"
    );
    assert!(status.is_lost());
}

#[test]
fn only_a_token_found_gone_loses_the_lease_at_once() {
    assert!(LockError::Expired { taken_over: false }.is_gone());
    assert!(LockError::Expired { taken_over: true }.is_gone());
    let too_slow = LockError::TooSlow {
        operation: LockOperation::Extend,
        elapsed: Duration::from_secs(1),
    };
    assert!(!too_slow.is_gone());
    let undecided = LockError::NoQuorum {
        operation: LockOperation::Extend,
        quorum: 2,
        nodes: 3,
        failures: Vec::new(),
    };
    assert!(!undecided.is_gone());
}

#[tokio::test]
async fn with_lease_runs_work_that_waits_to_its_end_and_releases() {
    let locks = locks(Duration::from_secs(30));
    let lease = locks.try_lock("waits").await.unwrap();
    let answer = locks
        .with_lease(lease, Renewal::default(), |_| async {
            tokio::time::sleep(Duration::from_millis(30)).await;
            7
        })
        .await;
    assert_eq!(answer.unwrap(), 7);
    assert!(
        locks.try_lock("waits").await.is_ok(),
        "the lease was not released"
    );
}

#[tokio::test]
async fn debug_names_the_key_and_whether_it_was_lost() {
    let locks = locks(Duration::from_secs(30));
    let lease = locks.try_lock("shown").await.unwrap();
    let watchdog = Watchdog::new(locks, lease, Renewal::disabled());
    let shown = format!("{watchdog:?}");
    assert!(shown.starts_with("Watchdog {"), "{shown}");
    assert!(shown.contains("tower-redlock:shown"), "{shown}");
    assert!(shown.contains("lost: false"), "{shown}");
}
