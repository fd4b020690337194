//! The Redlock client: one lock over N independent Redis masters.
//!
//! The algorithm is the one of the Redis documentation page "Distributed Locks with Redis"
//! (<https://redis.io/docs/latest/develop/use/patterns/distributed-locks/>), with the
//! defaults of go-redsync where the page leaves a choice:
//!
//! 1. Draw a 128-bit token from a CSPRNG seeded by the OS.
//! 2. Send `SET key token NX PX ttl` to every node at once, each bounded by the node timeout.
//! 3. Succeed only if at least `N/2 + 1` nodes said OK and the validity left,
//!    `ttl - elapsed - (ttl * drift_factor + 2 ms)`, measured on the monotonic clock, is
//!    above zero.
//! 4. Otherwise delete the key on every node where it holds our token (also when the
//!    caller's future is dropped mid-acquire: the release is spawned), and retry after a
//!    random delay if retries are left.
//!
//! Release and extension are Lua scripts that act only if the key still holds our token;
//! a value this crate did not write is never modified (redis-py's `Lock`, pottery or
//! redsync may share the keys). A lock's own keys and channel sit beside it as
//! `<prefix>{<lock key>}:<role>`, in the lock key's Redis Cluster slot.
//!
//! Verdicts say what the answers prove (see [`tally`]): `Taken` needs a quorum of
//! answers without a quorum of OKs (the attempt met contention; a failed node's OK could
//! still have made a quorum, as with one OK, one "held" and one failure of 3), `Expired`
//! needs N - quorum + 1 nodes without our token (which no failed node can swing), and
//! anything short of these is `NoQuorum`, which callers retry. `exhaustive` checks every
//! sequence of answers against these rules.

mod acquire;
mod builder;
mod contract;
mod fair;
#[cfg(feature = "idempotency")]
mod idempotency;
mod inspect;
mod keys;
mod local;
mod multi;
mod round;
mod scripts;
mod shared;
mod tally;
mod waiting;

#[cfg(test)]
mod exhaustive;

use std::fmt;
use std::sync::Arc;
use std::time::{Duration, Instant};

use redis::Client;

use crate::backend::connection::Connection;
use crate::backend::contract::LockBackend;
use crate::backend::node::Node;
use crate::backend::notify::Notifier;
use crate::backend::settings::Settings;
use crate::backend::wait::Waiters;
use crate::error::{LockError, LockOperation, NodeFailure, NodeFailureReason};
use crate::lease::{Lease, Token};
use crate::observe::{self, op_span};
pub use builder::RedlockBuilder;
use keys::Keys;
use local::LocalHolders;
use round::{Answers, Stragglers};
use scripts::ReleaseReply;
use tally::{QuorumVerdict, Rule, Vote};

/// A Redlock client over 1, 3 or 5 (any N) independent Redis masters.
///
/// Cloning is cheap and shares the connections, which are multiplexed and replaced after
/// any kind of failure (see [`RedlockBuilder::node_timeout`]).
///
/// Use it through [`Locks`](crate::Locks) (`Locks::from(redlock)`) with the layer and the
/// extractor, or on its own:
///
/// ```no_run
/// # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
/// use std::time::Duration;
/// use tower_redlock::{Locks, Redlock};
///
/// let redlock = Redlock::builder(["redis://127.0.0.1:7001", "redis://127.0.0.1:7002", "redis://127.0.0.1:7003"])
///     .ttl(Duration::from_secs(10))
///     .build()
///     .await?;
/// let locks = Locks::from(redlock);
/// let lease = locks.lock("report:2026-11").await?;
/// // ... work while lease.remaining() > 0 ...
/// locks.unlock(lease).await?;
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct Redlock {
    inner: Arc<RedlockCore>,
}

struct RedlockCore {
    id: u64,
    nodes: Vec<Connection>,
    /// This process's waiters, woken by release notifications and this client's releases.
    waiters: Arc<Waiters>,
    notifier: Option<Arc<Notifier>>,
    /// The keys this client holds or is acquiring, answered in process.
    local: LocalHolders,
    /// With fencing tokens: how long a counter lives after its last write, in ms.
    fence_ms: Option<u64>,
    /// How long a waiter's mark lives, in ms: longer than a waiter's sleep between attempts.
    mark_ms: u64,
    quorum: usize,
    node_timeout: Duration,
    drift: Duration,
    policy: Settings,
    /// The holder record of a direct call's lease (the replica id alone), made once.
    direct_holder: Arc<str>,
}

impl fmt::Debug for Redlock {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let inner = &self.inner;
        let nodes: Vec<_> = inner.nodes.iter().map(Connection::label).collect();
        f.debug_struct("Redlock")
            .field("nodes", &nodes)
            .field("quorum", &inner.quorum)
            .field("ttl", &inner.policy.ttl)
            .field("node_timeout", &inner.node_timeout)
            .field("drift", &inner.drift)
            .field("prefix", &inner.policy.prefix)
            .finish()
    }
}

impl Redlock {
    /// Starts a builder from Redis URLs (`redis://[:password@]host:port[/db]`), one per
    /// independent master. Use 1 (the single-instance algorithm), 3 or 5.
    pub fn builder<I>(urls: I) -> RedlockBuilder
    where
        I: IntoIterator,
        I::Item: AsRef<str>,
    {
        Self::from_nodes(urls.into_iter().map(Node::url))
    }

    /// Starts a builder from ready redis-rs clients, one per independent master.
    pub fn from_clients<I>(clients: I) -> RedlockBuilder
    where
        I: IntoIterator<Item = Client>,
    {
        Self::from_nodes(clients.into_iter().map(Node::client))
    }

    /// Starts a builder from [`Node`](crate::Node)s, one per independent Redlock node
    /// (a server, a Redis Cluster or a Sentinel service), e.g.
    /// `[Node::cluster(a), Node::cluster(b), Node::cluster(c)]`.
    pub fn from_nodes<I>(nodes: I) -> RedlockBuilder
    where
        I: IntoIterator<Item = Node>,
    {
        RedlockBuilder::new(nodes.into_iter().collect())
    }

    /// The number of nodes.
    pub fn node_count(&self) -> usize {
        self.inner.nodes.len()
    }

    /// The number of nodes that must agree: `N/2 + 1`.
    pub fn quorum(&self) -> usize {
        self.inner.quorum
    }

    /// One acquisition attempt, in a `tower_redlock.acquire` span; the lease records
    /// `holder` (see [`Holder::encode`](crate::holder::Holder::encode)).
    pub(crate) async fn acquire(
        &self,
        key: Arc<str>,
        waiting: bool,
        holder: Arc<str>,
    ) -> Result<Lease, LockError> {
        let span = op_span!("tower_redlock.acquire", &key, self.prefix(), self.quorum());
        observe::traced(
            span,
            self.acquire_untraced(key, waiting, holder),
            observe::lock_verdict,
        )
        .await
    }

    /// Whether a quorum of the nodes answers `PING` now, each within the node timeout:
    /// for a readiness probe. It returns as soon as a quorum has answered (or cannot), so
    /// it takes one round trip while the nodes are up, and at most the node timeout when
    /// they hang; a node that is down is connected again in the background, and the next
    /// call finds it back. It takes no lock and writes nothing: cheap enough to call every
    /// few seconds. [`Locks::ready`](crate::Locks::ready) asks the same through the handle.
    ///
    /// ```no_run
    /// # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
    /// use tower_redlock::Redlock;
    ///
    /// let redlock = Redlock::builder(["redis://10.0.0.1", "redis://10.0.0.2", "redis://10.0.0.3"])
    ///     .build()
    ///     .await?;
    /// // In a `GET /ready` handler: 200 when true, 503 when not.
    /// let ready = redlock.ready().await;
    /// # Ok(()) }
    /// ```
    pub async fn ready(&self) -> bool {
        let ping = |conn| scripts::connect(conn);
        let answered = |_: &()| Vote::For;
        let round = self
            .on_nodes(
                Instant::now(),
                ping,
                answered,
                Rule::Acquire,
                Stragglers::Drop,
            )
            .await;
        round.verdict == QuorumVerdict::Won
    }

    /// [`Locks::extend`](crate::Locks::extend) on the nodes (a set: where every key holds
    /// the token), with the verdicts of the module docs; on error the lease is unchanged.
    pub(crate) async fn extend_lease(&self, lease: &mut Lease) -> Result<(), LockError> {
        let span = op_span!(
            "tower_redlock.extend",
            lease.key(),
            self.prefix(),
            self.quorum()
        );
        observe::traced(span, self.extend_untraced(lease), observe::lock_verdict).await
    }

    async fn extend_untraced(&self, lease: &mut Lease) -> Result<(), LockError> {
        let start = Instant::now();
        let keys = Keys::of(lease);
        let (token, ttl_ms, fence_ms) =
            (lease.token, self.inner.policy.ttl_ms(), self.inner.fence_ms);
        let round = self
            .on_nodes(
                start,
                |conn| {
                    let prefix = self.inner.policy.prefix.clone();
                    keys.clone().extend(conn, prefix, token, ttl_ms, fence_ms)
                },
                extended,
                Rule::Held,
                Stragglers::Finish,
            )
            .await;
        match round.verdict {
            QuorumVerdict::Won => {
                let elapsed = start.elapsed();
                let validity = self.validity(elapsed).ok_or(LockError::TooSlow {
                    operation: LockOperation::Extend,
                    elapsed,
                })?;
                lease.valid_until = start + validity;
                self.inner
                    .local
                    .renewed(&lease.key, token, lease.valid_until);
                Ok(())
            }
            QuorumVerdict::Lost => {
                self.inner.local.lost(&lease.key, token);
                Err(LockError::Expired {
                    taken_over: round.values().any(|reply| *reply == -1),
                })
            }
            QuorumVerdict::NoQuorum => Err(self.no_quorum(round, LockOperation::Extend)),
        }
    }

    /// [`Locks::unlock`](crate::Locks::unlock) on the nodes: deletes the keys where they
    /// hold the token, with the verdicts of the module docs.
    pub(crate) async fn release(&self, lease: Lease) -> Result<(), LockError> {
        let span = op_span!(
            "tower_redlock.release",
            lease.key(),
            self.prefix(),
            self.quorum()
        );
        observe::traced(span, self.unlock_untraced(lease), observe::lock_verdict).await
    }

    async fn unlock_untraced(&self, lease: Lease) -> Result<(), LockError> {
        let local = self
            .inner
            .local
            .released(&lease.key, lease.token, self.prefix());
        let keys = Keys::of(&lease);
        let round = self
            .release_keys(keys, lease.token, true, deleted, Stragglers::Finish)
            .await;
        if local {
            self.inner.waiters.wake(&lease.key);
        }
        match round.verdict {
            QuorumVerdict::Won => Ok(()),
            QuorumVerdict::Lost => Err(LockError::Expired {
                taken_over: round
                    .values()
                    .any(|r| matches!(r, ReleaseReply::HeldByOther)),
            }),
            QuorumVerdict::NoQuorum => Err(self.no_quorum(round, LockOperation::Release)),
        }
    }

    /// The error of a round of `operation` without a verdict: the nodes that failed, and
    /// why.
    fn no_quorum<T>(&self, round: Answers<T>, operation: LockOperation) -> LockError {
        let failures = self
            .inner
            .nodes
            .iter()
            .zip(round.answers)
            .filter_map(|(node, answer)| match answer {
                Some(Err(reason)) => Some(failure(node, reason)),
                _ => None,
            })
            .collect();
        LockError::NoQuorum {
            operation,
            quorum: self.inner.quorum,
            nodes: self.inner.nodes.len(),
            failures,
        }
    }

    fn validity(&self, elapsed: Duration) -> Option<Duration> {
        validity(self.inner.policy.ttl, self.inner.drift, elapsed)
    }

    /// Runs `op` on every node at once: one [`round`] under the node timeout from
    /// `started`. An `async fn`, so that the round's future is built in its own, where it
    /// is awaited (as a returned combinator it was built, then copied in).
    async fn on_nodes<F, Fut, T>(
        &self,
        started: Instant,
        op: F,
        vote: fn(&T) -> Vote,
        rule: Rule,
        stragglers: Stragglers,
    ) -> Answers<T>
    where
        F: Fn(Connection) -> Fut,
        Fut: Future<Output = Result<T, NodeFailureReason>> + Send + 'static,
        T: Send + 'static,
    {
        let deadline = started + self.inner.node_timeout;
        let ops = self.inner.nodes.iter().map(|node| {
            let op = &op;
            move || round::counted(op(node.clone()), node.label().clone(), deadline)
        });
        let round = round::run(
            round::Ops::new(ops),
            started,
            self.inner.node_timeout,
            self.inner.quorum,
            vote,
            rule,
            stragglers,
        );
        let round = round.await;
        observe::nodes_answered(round.values().count());
        round
    }

    /// [`on_nodes`](Self::on_nodes) from now, every node awaited, for the answers alone
    /// (the verdict is not read).
    fn on_every_node<F, Fut, T>(&self, op: F) -> impl Future<Output = Answers<T>>
    where
        F: Fn(Connection) -> Fut,
        Fut: Future<Output = Result<T, NodeFailureReason>> + Send + 'static,
        T: Send + 'static,
    {
        let vote = |_: &T| Vote::For;
        self.on_nodes(Instant::now(), op, vote, Rule::Held, Stragglers::Await)
    }

    /// Releases `lease` in the background: for guards dropped outside an async context.
    pub(crate) fn release_lease_detached(&self, lease: &Lease) {
        self.release_detached(Keys::of(lease), lease.token, true);
    }

    /// Releases `keys` in the background.
    fn release_detached(&self, keys: Keys, token: Token, publish: bool) {
        let key = keys.lease_key();
        let local = self.inner.local.released(&key, token, self.prefix());
        match tokio::runtime::Handle::try_current() {
            Ok(handle) => {
                let redlock = self.clone();
                let span = op_span!("tower_redlock.release", &key, self.prefix(), self.quorum());
                handle.spawn(async move {
                    let release = async {
                        let round = redlock
                            .release_keys(keys, token, publish, deleted, Stragglers::Await)
                            .await;
                        Ok::<_, ()>(round.verdict)
                    };
                    let _ = observe::traced(span, release, |round| match round {
                        Ok(QuorumVerdict::Won) => "ok",
                        Ok(QuorumVerdict::Lost) => "expired",
                        Ok(QuorumVerdict::NoQuorum) | Err(()) => "no_quorum",
                    })
                    .await;
                    if local {
                        redlock.inner.waiters.wake(&key);
                    }
                });
            }
            Err(_) => tracing::warn!(
                key = %crate::redact::LogKey(&key),
                "no Tokio runtime to release the lock on; it expires by its TTL"
            ),
        }
    }
}

/// The validity a lease of `ttl` has left `elapsed` after its round started, less the
/// `drift` allowance; `None` unless positive. Never underflows, whatever the values.
fn validity(ttl: Duration, drift: Duration, elapsed: Duration) -> Option<Duration> {
    ttl.checked_sub(elapsed)?
        .checked_sub(drift)
        .filter(|v| !v.is_zero())
}

/// A release's vote: for where it deleted our token.
fn deleted(release: &ReleaseReply) -> Vote {
    Vote::of(matches!(release, ReleaseReply::Deleted))
}

/// An extension's vote: for where it renewed our token (the script's 1; 0 when the keys
/// are gone, -1 when another holds one).
fn extended(reply: &i64) -> Vote {
    Vote::of(*reply == 1)
}

/// The failure of `node` for `reason`.
fn failure(node: &Connection, reason: NodeFailureReason) -> NodeFailure {
    NodeFailure {
        node: node.label().to_string(),
        reason,
    }
}
