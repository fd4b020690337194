//! Release notifications over Redis pub/sub: one subscriber connection per node, opened on
//! the first wait, waking this process's waiters (see [`Waiters`]) when a holder releases.
//!
//! A lock's release channel is `{<lock key>}:released` (see [`Aux`]). A subscriber
//! connection lives as long as the client (every handle of the [`Redlock`]) or until it
//! is replaced, whichever comes first: dropping it ends its reader task, which closes the
//! connection.
//!
//! [`Redlock`]: super::Redlock

use std::collections::HashSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use futures_util::StreamExt;
use redis::aio::PubSubSink;
use tokio::sync::oneshot;

use super::keys::Aux;
use crate::backend::node::Connector;
use crate::backend::wait::Waiters;

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
    connector: Connector,
    sink: tokio::sync::Mutex<Option<Subscriber>>,
}

/// An open subscriber connection; `alive` turns false when its reader task ends (the
/// connection dropped), so that the next subscription reconnects.
struct Subscriber {
    sink: PubSubSink,
    alive: Arc<AtomicBool>,
    /// The lock keys whose release channel this connection's subscription to is confirmed.
    channels: HashSet<Arc<str>>,
    /// Dropped with the subscriber (replaced, or the client gone): the reader task then
    /// ends and drops its half, and the connection closes.
    _close: oneshot::Sender<()>,
}

impl Notifier {
    pub(crate) fn new(
        connectors: Vec<Connector>,
        waiters: Arc<Waiters>,
        timeout: Duration,
    ) -> Self {
        Self {
            waiters,
            nodes: connectors
                .into_iter()
                .map(|connector| NodeSubscriber {
                    connector,
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
            let subscribed = open.sink.subscribe(Aux::released(key)).await;
            match subscribed {
                Ok(()) => {
                    open.channels.insert(key.clone());
                }
                // Closes the connection (see `Subscriber::_close`); the next subscription
                // opens a new one.
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
                    let unsubscribe = open.sink.unsubscribe(Aux::released(&key));
                    let _ = tokio::time::timeout(this.timeout, unsubscribe).await;
                }
            }
        });
    }

    /// Opens a subscriber connection and the task that reads it; resubscribes the keys
    /// currently waited on.
    async fn connect(&self, node: &NodeSubscriber) -> redis::RedisResult<Subscriber> {
        let pubsub = node.connector.pubsub().await?;
        let (mut sink, mut stream) = pubsub.split();
        let waited = self.waiters.keys_waited();
        if !waited.is_empty() {
            let channels: Vec<_> = waited.iter().map(|key| Aux::released(key)).collect();
            sink.subscribe(channels).await?;
        }
        // Only now: should this future be dropped (the subscribe timed out) or fail before,
        // both halves go with it and the connection is closed, not left to a reader task.
        let waiters = self.waiters.clone();
        let alive = Arc::new(AtomicBool::new(true));
        let reader_alive = alive.clone();
        let (close, mut closed) = oneshot::channel::<()>();
        tokio::spawn(async move {
            loop {
                tokio::select! {
                    msg = stream.next() => match msg {
                        Some(msg) => {
                            if let Some(key) = Aux::lock_key_of_release(msg.get_channel_name()) {
                                waiters.wake(key);
                            }
                        }
                        None => break,
                    },
                    // The subscriber was dropped: dropping `stream` closes the connection.
                    _ = &mut closed => break,
                }
            }
            reader_alive.store(false, Ordering::Release);
            // Whoever waits now would miss notifications from this node: let them re-try.
            waiters.wake_all();
        });
        Ok(Subscriber {
            sink,
            alive,
            channels: waited.into_iter().collect(),
            _close: close,
        })
    }
}
