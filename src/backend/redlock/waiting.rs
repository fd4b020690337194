//! Waiting for a held lock: on the nodes, woken by release notifications or a fallback
//! timer; behind a holder of this process, in process.

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::Redlock;
use crate::backend::notify::UnsubscribeOnDrop;
use crate::backend::wait::{MAX_FALLBACK, Waiters, bounded_wait};
use crate::error::LockError;
use crate::lease::Lease;

impl Redlock {
    /// Waits up to `max_wait` for a plain lock on a prefixed key (zero: one attempt); the
    /// lease records `holder`.
    pub(crate) async fn lock_key_within(
        &self,
        key: Arc<str>,
        max_wait: Duration,
        holder: Arc<str>,
    ) -> Result<Lease, LockError> {
        match self.acquire(key.clone(), false, holder.clone()).await {
            Err(LockError::Taken { .. }) if !max_wait.is_zero() => {}
            first => return first,
        }
        let deadline = Instant::now().checked_add(max_wait);
        // Behind a holder of this process: queue here, without Redis, until it releases.
        if let Some(result) = self.queue_locally(&key, deadline, &holder).await {
            return result;
        }
        let left = deadline.map_or(max_wait, |d| d.saturating_duration_since(Instant::now()));
        // Subscribed by now: mark the lock as waited for, so that its release publishes.
        let mark = self.inner.notifier.is_some();
        self.wait_on_nodes(&key, left, &self.inner.waiters, || {
            self.acquire(key.clone(), mark, holder.clone())
        })
        .await
    }

    /// Waits while this process holds `key`, woken by its release (or at least every
    /// second), and tries again. `None` once the holder is another process's; else the
    /// outcome of the first attempt not refused for contention, or `Taken` at the deadline.
    async fn queue_locally(
        &self,
        key: &Arc<str>,
        deadline: Option<Instant>,
        holder: &Arc<str>,
    ) -> Option<Result<Lease, LockError>> {
        let mut valid_until = self.inner.local.holder(key)?;
        let ticket = self.inner.waiters.register(key);
        loop {
            let notified = ticket.notify.notified();
            let mut notified = std::pin::pin!(notified);
            notified.as_mut().enable();
            let now = Instant::now();
            if deadline.is_some_and(|d| d <= now) {
                return Some(Err(LockError::Taken {
                    retry_after: valid_until.saturating_duration_since(now),
                }));
            }
            if self.inner.local.holder(key).is_some() {
                let wake_at = now
                    .checked_add(MAX_FALLBACK)
                    .map_or(valid_until, |fallback| fallback.min(valid_until));
                let wake_at = deadline.map_or(wake_at, |d| d.min(wake_at));
                tokio::select! {
                    () = notified => {}
                    () = tokio::time::sleep_until(wake_at.into()) => {}
                }
            }
            match self.acquire(key.clone(), false, holder.clone()).await {
                Err(LockError::Taken { .. }) => match self.inner.local.holder(key) {
                    Some(next) => valid_until = next,
                    None => return None,
                },
                other => return Some(other),
            }
        }
    }

    /// `attempt(false)`, then (when the key is taken and `max_wait` is not zero) a bounded
    /// wait of `attempt(true)`s, which mark the key as waited for.
    pub(super) async fn wait_with<F, Fut>(
        &self,
        key: Arc<str>,
        max_wait: Duration,
        mut attempt: F,
    ) -> Result<Lease, LockError>
    where
        F: FnMut(bool) -> Fut,
        Fut: Future<Output = Result<Lease, LockError>>,
    {
        match attempt(false).await {
            Err(LockError::Taken { .. }) if !max_wait.is_zero() => {}
            first => return first,
        }
        // Without notifications, nothing wakes the waiter but its timer.
        let no_waiters = Waiters::default();
        let notifier = self.inner.notifier.as_ref();
        let waiters = notifier.map_or(&no_waiters, |notifier| &*notifier.waiters);
        // Waiting attempts even without notifications: a writer's intent and a fair
        // waiter's place must be kept up.
        self.wait_on_nodes(&key, max_wait, waiters, || attempt(true))
            .await
    }

    /// Waits up to `max_wait` for `key` on the nodes, subscribed to its release channel,
    /// running `attempt` on each wake-up ([`bounded_wait`]).
    async fn wait_on_nodes<F, Fut>(
        &self,
        key: &Arc<str>,
        max_wait: Duration,
        waiters: &Waiters,
        attempt: F,
    ) -> Result<Lease, LockError>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<Lease, LockError>>,
    {
        let notifier = self.inner.notifier.as_ref();
        // Also when this future is dropped mid-wait.
        let _unsubscribe = notifier.map(|notifier| UnsubscribeOnDrop {
            notifier: notifier.clone(),
            key: key.clone(),
        });
        let subscribe = async {
            if let Some(notifier) = notifier {
                notifier.subscribe(key).await;
            }
        };
        bounded_wait(waiters, key, max_wait, attempt, subscribe).await
    }
}
