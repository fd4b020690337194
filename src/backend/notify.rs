//! Release notifications over Redis pub/sub: one subscriber connection per node, waking
//! this process's waiters (see [`Waiters`]) when a holder releases, for the lock backend
//! and the Redis concurrency limiter. Every release channel begins with the store's prefix
//! ([`Channels`]).

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use futures_util::StreamExt;
use redis::aio::{PubSubSink, PubSubStream};
use tokio::sync::oneshot;

use crate::backend::connection::{Connection, RECONNECT_MAX_PAUSE, RETRY_INTERVAL};
use crate::backend::node::Connector;
use crate::backend::wait::Waiters;

/// How a store names the release channels of its keys. Every name begins with the store's
/// prefix, so that a Redis ACL on the prefix (`&<prefix>*`) covers them.
#[derive(Debug, Clone)]
pub(crate) enum Channels {
    /// A lock key `K`'s: `<prefix>{K}:released`, as its other keys beside it.
    #[cfg(feature = "lock")]
    Tagged(Arc<str>),
    /// A key that begins with the prefix and ends with its own hash tag (a concurrency
    /// limiter's permit set, `<prefix>{<resource>}`): `<key>:released`.
    #[cfg(feature = "concurrency-limit")]
    Suffixed,
}

/// A lock key's release channel, `<prefix>{<key>}:released` ([`Channels::Tagged`]).
#[cfg(feature = "lock")]
pub(crate) fn released<'a>(prefix: &'a str, key: &'a str) -> Joined<'a, 4> {
    Joined([prefix, "{", key, "}:released"])
}

impl Channels {
    /// The release channel of `key`, as the scripts that publish name it.
    pub(crate) fn released<'a>(&'a self, key: &'a str) -> Joined<'a, 4> {
        match self {
            #[cfg(feature = "lock")]
            Channels::Tagged(prefix) => released(prefix, key),
            #[cfg(feature = "concurrency-limit")]
            Channels::Suffixed => Joined([key, ":released", "", ""]),
        }
    }

    /// [`released`](Self::released) as a string.
    fn channel(&self, key: &str) -> String {
        self.released(key).to_string()
    }

    /// The key whose release channel is `channel`, if it is one.
    fn key_of<'a>(&self, channel: &'a str) -> Option<&'a str> {
        match self {
            #[cfg(feature = "lock")]
            Channels::Tagged(prefix) => channel
                .strip_prefix(&**prefix)?
                .strip_prefix('{')?
                .strip_suffix("}:released"),
            #[cfg(feature = "concurrency-limit")]
            Channels::Suffixed => channel.strip_suffix(":released"),
        }
    }
}

/// Pieces written in place as one Redis argument (no string built), or shown joined.
pub(crate) struct Joined<'a, const N: usize>(pub(crate) [&'a str; N]);

/// Up to this many bytes, a [`Joined`] is put together on the stack and written as one
/// argument (one copy into the command, where each piece was one write).
const JOINED_ON_STACK: usize = 256;

impl<const N: usize> redis::ToRedisArgs for Joined<'_, N> {
    fn write_redis_args<W: ?Sized + redis::RedisWrite>(&self, out: &mut W) {
        use std::io::Write as _;
        let mut joined = [0u8; JOINED_ON_STACK];
        let mut len = 0usize;
        for part in self.0 {
            let end = len.saturating_add(part.len());
            let Some(slot) = joined.get_mut(len..end) else {
                // Longer: piece by piece.
                let mut arg = out.writer_for_next_arg();
                for part in self.0 {
                    // Writing into the command's buffer cannot fail.
                    let _ = arg.write_all(part.as_bytes());
                }
                return;
            };
            slot.copy_from_slice(part.as_bytes());
            len = end;
        }
        out.write_arg(joined.get(..len).unwrap_or_default());
    }
}

impl<const N: usize> std::fmt::Display for Joined<'_, N> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.iter().try_for_each(|part| f.write_str(part))
    }
}

/// Unsubscribes from a key's channel when dropped, unless someone waits on it again.
pub(crate) struct UnsubscribeOnDrop {
    pub(crate) notifier: Arc<Notifier>,
    pub(crate) key: Arc<str>,
}

impl Drop for UnsubscribeOnDrop {
    fn drop(&mut self) {
        self.notifier.unsubscribe(self.key.clone());
    }
}

/// One subscriber connection per node, opened by [`watch`](Notifier::watch) (or the first
/// wait), waking this process's waiters on release messages.
pub(crate) struct Notifier {
    pub(crate) waiters: Arc<Waiters>,
    nodes: Vec<NodeSubscriber>,
    /// The nodes' command connections, replaced when the node drops its subscriber.
    conns: Vec<Connection>,
    channels: Channels,
    timeout: Duration,
}

struct NodeSubscriber {
    connector: Connector,
    sink: tokio::sync::Mutex<Option<Subscriber>>,
}

/// An open subscriber connection; `alive` turns false when its reader task ends.
struct Subscriber {
    sink: PubSubSink,
    alive: Arc<AtomicBool>,
    /// The keys whose channel subscription is confirmed on this connection.
    channels: HashSet<Arc<str>>,
    /// Dropped with the subscriber: the reader task ends, and the connection closes.
    _close: oneshot::Sender<()>,
}

impl Notifier {
    pub(crate) fn new(
        connectors: Vec<Connector>,
        conns: Vec<Connection>,
        waiters: Arc<Waiters>,
        channels: Channels,
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
            conns,
            channels,
            timeout,
        }
    }

    /// Opens every node's subscriber connection in the background, retried as after a
    /// drop (see [`read`]).
    pub(crate) fn watch(self: &Arc<Self>) {
        for index in 0..self.nodes.len() {
            let notifier = Arc::downgrade(self);
            tokio::spawn(async move {
                if let Some(reading) = reconnect(&notifier, index).await {
                    read(notifier, index, reading).await;
                }
            });
        }
    }

    /// Subscribes to `key`'s release channel on every node that answers in time, and
    /// returns once confirmed: only then may a waiter mark the key. Failures are left to
    /// the fallback timer.
    pub(crate) async fn subscribe(self: &Arc<Self>, key: &Arc<str>) {
        futures_util::future::join_all(
            (0..self.nodes.len()).map(|node| self.subscribe_on(node, key)),
        )
        .await;
    }

    async fn subscribe_on(self: &Arc<Self>, index: usize, key: &Arc<str>) {
        let Some(node) = self.nodes.get(index) else {
            return;
        };
        let attempt = async {
            let mut sink = node.sink.lock().await;
            if !alive(&sink) {
                *sink = None;
                let (subscriber, reading) = self.open(node).await?;
                tokio::spawn(read(Arc::downgrade(self), index, reading));
                *sink = Some(subscriber);
            }
            let Some(open) = sink.as_mut() else {
                return Ok(());
            };
            if open.channels.contains(key) {
                return Ok(());
            }
            let subscribed = open.sink.subscribe(self.channels.channel(key)).await;
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
                    let unsubscribe = open.sink.unsubscribe(this.channels.channel(&key));
                    let _ = tokio::time::timeout(this.timeout, unsubscribe).await;
                }
            }
        });
    }

    /// A subscriber connection to `node`, subscribed to the keys waited on now: the node's
    /// half, and the reader's.
    async fn open(&self, node: &NodeSubscriber) -> redis::RedisResult<(Subscriber, Reading)> {
        let pubsub = node.connector.pubsub().await?;
        let (mut sink, stream) = pubsub.split();
        let waited = self.waiters.keys_waited();
        if !waited.is_empty() {
            let channels: Vec<_> = waited
                .iter()
                .map(|key| self.channels.channel(key))
                .collect();
            sink.subscribe(channels).await?;
        }
        let alive = Arc::new(AtomicBool::new(true));
        let (close, closed) = oneshot::channel::<()>();
        let subscriber = Subscriber {
            sink,
            alive: alive.clone(),
            channels: waited.into_iter().collect(),
            _close: close,
        };
        Ok((
            subscriber,
            Reading {
                stream,
                alive,
                closed,
            },
        ))
    }
}

fn alive(sink: &Option<Subscriber>) -> bool {
    sink.as_ref()
        .is_some_and(|s| s.alive.load(Ordering::Acquire))
}

/// What a reader task holds of its connection.
struct Reading {
    stream: PubSubStream,
    alive: Arc<AtomicBool>,
    closed: oneshot::Receiver<()>,
}

/// Reads node `index`'s release messages and wakes their waiters. When the node drops the
/// connection, replaces it ([`reconnect`]) and wakes every waiter to re-try (a release may
/// have gone unheard). Ends when the subscriber is dropped.
async fn read(notifier: Weak<Notifier>, index: usize, mut reading: Reading) {
    loop {
        let dropped_by_node = loop {
            tokio::select! {
                msg = reading.stream.next() => match msg {
                    Some(msg) => {
                        let Some(notifier) = notifier.upgrade() else {
                            return;
                        };
                        if let Some(key) = notifier.channels.key_of(msg.get_channel_name()) {
                            notifier.waiters.wake(key);
                        }
                    }
                    None => break true,
                },
                // The subscriber was dropped: dropping `stream` closes the connection.
                _ = &mut reading.closed => break false,
            }
        };
        reading.alive.store(false, Ordering::Release);
        let Some(this) = notifier.upgrade() else {
            return;
        };
        // Whoever waits now would miss notifications from this node: let them re-try.
        this.waiters.wake_all();
        if !dropped_by_node {
            return;
        }
        // The node's command connection most likely went with it.
        if let Some(conn) = this.conns.get(index) {
            conn.node_dropped();
        }
        drop(this);
        match reconnect(&notifier, index).await {
            Some(next) => reading = next,
            None => return,
        }
    }
}

/// A new connection for node `index`: at once, then after pauses doubling from
/// [`RETRY_INTERVAL`] to [`RECONNECT_MAX_PAUSE`]; `None` when a subscription reconnected
/// first or the client is gone.
async fn reconnect(notifier: &Weak<Notifier>, index: usize) -> Option<Reading> {
    let mut pause = RETRY_INTERVAL;
    loop {
        let this = notifier.upgrade()?;
        {
            let node = this.nodes.get(index)?;
            let mut sink = node.sink.lock().await;
            if alive(&sink) {
                return None;
            }
            if let Ok(Ok((subscriber, reading))) =
                tokio::time::timeout(this.timeout, this.open(node)).await
            {
                *sink = Some(subscriber);
                drop(sink);
                this.waiters.wake_all();
                return Some(reading);
            }
            *sink = None;
        }
        drop(this);
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(RECONNECT_MAX_PAUSE);
    }
}

#[cfg(all(test, feature = "lock", feature = "concurrency-limit"))]
mod tests {
    use super::Channels;

    #[test]
    fn a_release_channel_begins_with_the_prefix_and_names_its_key() {
        let locks = Channels::Tagged("app:".into());
        let key = "app:/items:42";
        assert_eq!(locks.channel(key), "app:{app:/items:42}:released");
        assert_eq!(locks.key_of(&locks.channel(key)), Some(key));
        assert_eq!(locks.key_of(key), None);
        assert_eq!(locks.key_of("app:{x}:fence"), None);
        assert_eq!(locks.key_of("{app:/items:42}:released"), None);
        let permits = Channels::Suffixed;
        let set = "app-permits:{work:global}";
        assert_eq!(permits.channel(set), "app-permits:{work:global}:released");
        assert_eq!(permits.key_of(&permits.channel(set)), Some(set));
        let mut cmd = redis::cmd("PUBLISH");
        cmd.arg(locks.released(key));
        assert_eq!(
            cmd.get_packed_command(),
            format!(
                "*2\r\n$7\r\nPUBLISH\r\n${}\r\n{}\r\n",
                locks.channel(key).len(),
                locks.channel(key)
            )
            .into_bytes()
        );
    }
}
