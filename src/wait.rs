//! Waiting for a held lock: waiters are woken when the holder releases.
//!
//! A process with waiters subscribes to a channel named after the key on every node it
//! can reach, and wakes its waiters for the key when a message arrives; each waiter then
//! tries again, as Redisson does. Once subscribed, a waiter's attempts mark the holder's
//! value (a `+` after the token), and the release of a marked key publishes on the channel
//! in the same Lua script; a key nobody waits for is released without a `PUBLISH`. A message can be missed (a node restarts, a connection drops)
//! and a lease can simply expire without a release, so every wait also has a fallback
//! timer: the holder's remaining TTL, capped at one second, with jitter.

use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use redis::aio::PubSubSink;
use tokio::sync::Notify;

use crate::error::LockError;
use crate::lease::Lease;

/// The longest a waiter sleeps before trying again without a notification.
pub(crate) const MAX_FALLBACK: Duration = Duration::from_secs(1);

/// The waiters of this process, per key.
#[derive(Default)]
pub(crate) struct Waiters {
    keys: Mutex<HashMap<Arc<str>, Waiting>>,
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
    fn keys(&self) -> std::sync::MutexGuard<'_, HashMap<Arc<str>, Waiting>> {
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

    fn wake_all(&self) {
        for waiting in self.keys().values() {
            waiting.notify.notify_waiters();
        }
    }

    /// Whether anybody waits on `key`.
    pub(crate) fn is_waited(&self, key: &str) -> bool {
        self.keys().contains_key(key)
    }

    fn keys_waited(&self) -> Vec<Arc<str>> {
        self.keys().keys().cloned().collect()
    }
}

impl WaitTicket<'_> {
    fn leave(&self) {
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

impl Drop for WaitTicket<'_> {
    fn drop(&mut self) {
        self.leave();
    }
}

/// A random delay in `[0, max / 10]`, to spread waiters that fall back to the timer.
pub(crate) fn jitter(max: Duration) -> Duration {
    let span = u64::try_from((max / 10).as_micros()).unwrap_or(u64::MAX);
    Duration::from_micros(rand::random::<u64>() % span.saturating_add(1))
}

/// Unsubscribes from a key's channel when dropped (a wait that ends or is cancelled),
/// unless someone in the process waits on it again.
pub(crate) struct UnsubscribeOnDrop {
    pub(crate) notifier: Arc<Notifier>,
    pub(crate) key: Arc<str>,
}

impl Drop for UnsubscribeOnDrop {
    fn drop(&mut self) {
        self.notifier.unsubscribe(self.key.clone());
    }
}

/// The pub/sub side for Redis: one subscriber connection per node, opened on the first
/// wait, reading release messages and waking this process's waiters.
pub(crate) struct Notifier {
    pub(crate) waiters: Arc<Waiters>,
    nodes: Vec<NodeSubscriber>,
    timeout: Duration,
}

struct NodeSubscriber {
    client: redis::Client,
    sink: tokio::sync::Mutex<Option<Subscriber>>,
}

/// An open subscriber connection; `alive` turns false when its reader task ends (the
/// connection dropped), so that the next subscription reconnects.
struct Subscriber {
    sink: PubSubSink,
    alive: Arc<AtomicBool>,
    /// The channels this connection's subscription to is confirmed.
    channels: HashSet<Arc<str>>,
}

impl Notifier {
    pub(crate) fn new(clients: Vec<redis::Client>, timeout: Duration) -> Self {
        Self {
            waiters: Arc::default(),
            nodes: clients
                .into_iter()
                .map(|client| NodeSubscriber {
                    client,
                    sink: tokio::sync::Mutex::new(None),
                })
                .collect(),
            timeout,
        }
    }

    /// Subscribes to `key`'s release channel on every node that answers in time, and
    /// returns once each subscription is confirmed: only then may a waiter mark the key.
    /// Cheap when the channel is already subscribed (by another waiter of this process);
    /// a waiter arriving while another's subscription is in flight waits for it under the
    /// node's lock, and subscribes itself if that one gave up. Failures are left to the
    /// fallback timer.
    pub(crate) async fn subscribe(&self, key: &Arc<str>) {
        futures_util::future::join_all(self.nodes.iter().map(|node| self.subscribe_on(node, key)))
            .await;
    }

    async fn subscribe_on(&self, node: &NodeSubscriber, key: &Arc<str>) {
        let attempt = async {
            let mut sink = node.sink.lock().await;
            if !sink
                .as_ref()
                .is_some_and(|s| s.alive.load(Ordering::Acquire))
            {
                *sink = None;
                *sink = Some(self.connect(node).await?);
            }
            let Some(open) = sink.as_mut() else {
                return Ok(());
            };
            if open.channels.contains(key) {
                return Ok(());
            }
            let subscribed = open.sink.subscribe(&**key).await;
            match subscribed {
                Ok(()) => {
                    open.channels.insert(key.clone());
                }
                Err(_) => *sink = None,
            }
            subscribed
        };
        match tokio::time::timeout(self.timeout, attempt).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => {
                tracing::debug!(error = %e, "release notifications unavailable on a node")
            }
            Err(_) => tracing::debug!("release notifications: subscribe timed out on a node"),
        }
    }

    /// Unsubscribes from `key`'s channel in the background, unless someone waits again.
    pub(crate) fn unsubscribe(self: &Arc<Self>, key: Arc<str>) {
        let Ok(handle) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let this = self.clone();
        handle.spawn(async move {
            for node in &this.nodes {
                let mut sink = node.sink.lock().await;
                // Checked under the node's lock: a new first waiter subscribes under the
                // same lock, so it is either seen here or subscribes after this.
                if this.waiters.is_waited(&key) {
                    return;
                }
                if let Some(open) = sink.as_mut() {
                    open.channels.remove(&key);
                    let _ = tokio::time::timeout(this.timeout, open.sink.unsubscribe(&*key)).await;
                }
            }
        });
    }

    /// Opens a subscriber connection and the task that reads it; resubscribes the keys
    /// currently waited on.
    async fn connect(&self, node: &NodeSubscriber) -> redis::RedisResult<Subscriber> {
        let pubsub = node.client.get_async_pubsub().await?;
        let (mut sink, mut stream) = pubsub.split();
        let waited = self.waiters.keys_waited();
        if !waited.is_empty() {
            sink.subscribe(waited.iter().map(|k| &**k).collect::<Vec<_>>())
                .await?;
        }
        // Only now: should this future be dropped (the subscribe timed out) or fail before,
        // both halves go with it and the connection is closed, not left to a reader task.
        let waiters = self.waiters.clone();
        let alive = Arc::new(AtomicBool::new(true));
        let reader_alive = alive.clone();
        tokio::spawn(async move {
            while let Some(msg) = stream.next().await {
                waiters.wake(msg.get_channel_name());
            }
            reader_alive.store(false, Ordering::Release);
            // Whoever waits now would miss notifications from this node: let them re-try.
            waiters.wake_all();
        });
        Ok(Subscriber {
            sink,
            alive,
            channels: waited.into_iter().collect(),
        })
    }
}

/// How long to sleep after a `Taken` with `retry_after`, given `left` until the deadline.
fn fallback(retry_after: Duration, left: Duration) -> Duration {
    let base = retry_after.min(MAX_FALLBACK);
    base.saturating_add(jitter(base)).min(left)
}

/// Waits up to `max_wait` for `key`: registers as a waiter, runs `subscribe` (which
/// returns once the release channel is subscribed), then alternates `attempt` and sleeps (until woken or the fallback timer) while the lock
/// is taken. The notification is armed before each attempt, so a release during the
/// attempt is not missed.
pub(crate) async fn bounded_wait<A, AF, S>(
    waiters: &Waiters,
    key: &Arc<str>,
    max_wait: Duration,
    mut attempt: A,
    subscribe: S,
) -> Result<Lease, LockError>
where
    A: FnMut() -> AF,
    AF: Future<Output = Result<Lease, LockError>>,
    S: Future<Output = ()>,
{
    let deadline = Instant::now().checked_add(max_wait);
    let ticket = waiters.register(key);
    // Bounded by the wait itself, as well as by the notifier's own timeout.
    let _ = tokio::time::timeout(max_wait, subscribe).await;
    loop {
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
                    () = tokio::time::sleep(fallback(retry_after, left)) => {}
                }
            }
            other => return other,
        }
    }
}
