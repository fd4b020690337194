//! Waiting for a held lock: waiters are woken when the holder releases.
//!
//! A process with waiters subscribes to the lock's release channel,
//! `<prefix>{<lock key>}:released`, and wakes its waiters for the key when a message
//! arrives; each then tries again (as Redisson does). A waiter's attempts that find the
//! lock held set a short-lived mark, `<prefix>{<lock key>}:waiters`, and a release that
//! finds a mark deletes it and publishes in the same script, so a lock nobody waits for is
//! released without a `PUBLISH`. A message can be missed and a lease can expire without a
//! release, so every wait also has a fallback timer: the holder's remaining TTL, at most
//! one second, with jitter.

use std::sync::atomic::Ordering;
use std::sync::{Arc, PoisonError};
#[cfg(feature = "lock")]
use std::time::{Duration, Instant};

use crate::backend::KeyMap;
#[cfg(feature = "lock")]
use crate::error::LockError;
#[cfg(feature = "lock")]
use crate::lease::Lease;
use crate::sync::{AtomicUsize, Mutex, MutexGuard, Notify};

/// The longest a waiter sleeps before trying again without a notification.
#[cfg(feature = "lock")]
pub(crate) const MAX_FALLBACK: Duration = Duration::from_secs(1);

/// The waiters of this process, per key.
#[derive(Default)]
pub(crate) struct Waiters {
    keys: Mutex<KeyMap<Arc<str>, Waiting>>,
    /// How many keys are waited on: lets a release skip the lock when nobody waits.
    waited: AtomicUsize,
}

struct Waiting {
    notify: Arc<Notify>,
    count: usize,
}

/// One registered waiter; unregisters on drop.
pub(crate) struct WaitTicket<'a> {
    waiters: &'a Waiters,
    key: Arc<str>,
    pub(crate) notify: Arc<Notify>,
}

impl Waiters {
    fn keys(&self) -> MutexGuard<'_, KeyMap<Arc<str>, Waiting>> {
        self.keys.lock().unwrap_or_else(PoisonError::into_inner)
    }

    pub(crate) fn register(&self, key: &Arc<str>) -> WaitTicket<'_> {
        let mut keys = self.keys();
        let entry = keys.entry(key.clone()).or_insert_with(|| {
            self.waited.fetch_add(1, Ordering::AcqRel);
            Waiting {
                notify: Arc::new(Notify::new()),
                count: 0,
            }
        });
        entry.count += 1;
        crate::observe::Held::Waiter.start();
        WaitTicket {
            waiters: self,
            key: key.clone(),
            notify: entry.notify.clone(),
        }
    }

    /// Wakes every waiter on `key` in this process.
    pub(crate) fn wake(&self, key: &str) {
        if self.waited.load(Ordering::Acquire) == 0 {
            return;
        }
        if let Some(waiting) = self.keys().get(key) {
            waiting.notify.notify_waiters();
        }
    }

    #[cfg(feature = "redis")]
    pub(crate) fn wake_all(&self) {
        for waiting in self.keys().values() {
            waiting.notify.notify_waiters();
        }
    }

    #[cfg(any(feature = "lock", feature = "redis"))]
    /// Whether anybody waits on `key`.
    pub(crate) fn is_waited(&self, key: &str) -> bool {
        self.keys().contains_key(key)
    }

    #[cfg(feature = "redis")]
    pub(crate) fn keys_waited(&self) -> Vec<Arc<str>> {
        self.keys().keys().cloned().collect()
    }
}

impl Drop for WaitTicket<'_> {
    fn drop(&mut self) {
        crate::observe::Held::Waiter.end();
        let mut keys = self.waiters.keys();
        match keys.get_mut(&self.key) {
            Some(waiting) if waiting.count > 1 => waiting.count -= 1,
            Some(_) => {
                keys.remove(&self.key);
                self.waiters.waited.fetch_sub(1, Ordering::AcqRel);
            }
            None => {}
        }
    }
}

/// How long to sleep after a `Taken` with `retry_after`, given `left` until the deadline:
/// at most [`MAX_FALLBACK`], plus up to a tenth more at random to spread the waiters.
#[cfg(feature = "lock")]
fn fallback(retry_after: Duration, left: Duration) -> Duration {
    let base = retry_after.min(MAX_FALLBACK);
    let span = u64::try_from((base / 10).as_micros()).unwrap_or(u64::MAX);
    let jitter = Duration::from_micros(rand::random::<u64>() % span.saturating_add(1));
    base.saturating_add(jitter).min(left)
}

/// Waits up to `max_wait` for `key`: registers as a waiter, runs `subscribe` (done once
/// the release channel is subscribed), then alternates `attempt` and sleeps (until woken
/// or the fallback timer) while the lock is taken.
#[cfg(feature = "lock")]
pub(crate) async fn bounded_wait<A, AF, S>(
    waiters: &Waiters,
    key: &Arc<str>,
    max_wait: Duration,
    mut attempt: A,
    subscribe: S,
) -> Result<Lease, LockError>
where
    A: FnMut() -> AF,
    AF: std::future::Future<Output = Result<Lease, LockError>>,
    S: std::future::Future<Output = ()>,
{
    let deadline = Instant::now().checked_add(max_wait);
    let ticket = waiters.register(key);
    // Bounded by the wait itself, as well as by the notifier's own timeout.
    let _ = crate::sync::timeout(max_wait, subscribe).await;
    loop {
        // Armed before the attempt, so that a release during it is not missed.
        let notified = ticket.notify.notified();
        let mut notified = std::pin::pin!(notified);
        notified.as_mut().enable();
        match attempt().await {
            Err(LockError::Taken { retry_after }) => {
                let left = deadline.map_or(Duration::MAX, |d| {
                    d.saturating_duration_since(Instant::now())
                });
                if left.is_zero() {
                    return Err(LockError::Taken { retry_after });
                }
                tokio::select! {
                    () = notified => {}
                    () = crate::sync::sleep(fallback(retry_after, left)) => {}
                }
            }
            other => return other,
        }
    }
}
