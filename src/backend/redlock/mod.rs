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
//! Release and extension are Lua scripts that act only if the key still holds our token
//! (followed by `+` once a waiter marked it; see [`Redlock::lock_within`]).

mod notify;
mod idempotency;
mod scripts;

use std::fmt;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::{Client, Value};

use crate::backend::settings::{Policy, policy_setters};
use crate::backend::wait::{Waiters, bounded_wait};
use crate::error::{ConfigError, LockError, NodeFailure, NodeFailureReason};
use crate::key::KeyError;
use crate::lease::{Lease, Token};
use notify::{Notifier, UnsubscribeOnDrop};

/// Default node timeout, as a fraction of the TTL: 5% (go-redsync's timeout factor).
const DEFAULT_NODE_TIMEOUT_FACTOR: u32 = 20;
/// Default clock drift factor, as the Redis docs and go-redsync: 0.01.
const DEFAULT_DRIFT_FACTOR: f64 = 0.01;
/// The fixed part of the drift allowance: 2 ms.
const DRIFT_FLOOR: Duration = Duration::from_millis(2);

/// A Redlock client over 1, 3 or 5 (any N) independent Redis masters.
///
/// Cloning is cheap and shares the connections. Connections are multiplexed and reconnect
/// by themselves (redis-rs `ConnectionManager`); a node that is down at start or goes down
/// later is retried on later operations.
///
/// Use it through [`Locks`](crate::Locks) (`Locks::from(redlock)`) with the layer and the
/// extractor, or on its own:
///
/// ```no_run
/// # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
/// use std::time::Duration;
/// use tower_redlock::Redlock;
///
/// let redlock = Redlock::builder(["redis://127.0.0.1:7001", "redis://127.0.0.1:7002", "redis://127.0.0.1:7003"])
///     .ttl(Duration::from_secs(10))
///     .build()
///     .await?;
/// let lease = redlock.lock("report:2026-11").await?;
/// // ... work while lease.remaining() > 0 ...
/// redlock.unlock(lease).await?;
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct Redlock {
    inner: Arc<Inner>,
}

struct Inner {
    id: u64,
    nodes: Vec<Node>,
    notifier: Option<Arc<Notifier>>,
    fence_key: Option<Arc<str>>,
    quorum: usize,
    node_timeout: Duration,
    drift: Duration,
    policy: Policy,
}

struct Node {
    label: String,
    conn: ConnectionManager,
}

impl fmt::Debug for Redlock {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Redlock")
            .field(
                "nodes",
                &self
                    .inner
                    .nodes
                    .iter()
                    .map(|n| &n.label)
                    .collect::<Vec<_>>(),
            )
            .field("quorum", &self.inner.quorum)
            .field("ttl", &self.inner.policy.ttl)
            .field("node_timeout", &self.inner.node_timeout)
            .field("drift", &self.inner.drift)
            .field("prefix", &self.inner.policy.prefix)
            .finish()
    }
}

/// Builds a [`Redlock`]; see [`Redlock::builder`].
#[derive(Debug)]
#[must_use]
pub struct RedlockBuilder {
    nodes: Vec<Result<Client, ConfigError>>,
    node_timeout: Option<Duration>,
    drift_factor: f64,
    fencing: bool,
    notify_waiters: bool,
    policy: Policy,
}

/// The resource name of the fencing counter, under the prefix.
const FENCE_RESOURCE: &str = "fencing-counter";

impl Redlock {
    /// Starts a builder from Redis URLs (`redis://[:password@]host:port[/db]`), one per
    /// independent master. Use 1 (the single-instance algorithm), 3 or 5.
    pub fn builder<I>(urls: I) -> RedlockBuilder
    where
        I: IntoIterator,
        I::Item: AsRef<str>,
    {
        let nodes = urls
            .into_iter()
            .enumerate()
            .map(|(index, url)| {
                Client::open(url.as_ref())
                    .map_err(|source| ConfigError::InvalidUrl { index, source })
            })
            .collect();
        RedlockBuilder::new(nodes)
    }

    /// Starts a builder from ready redis-rs clients, one per independent master.
    pub fn from_clients<I>(clients: I) -> RedlockBuilder
    where
        I: IntoIterator<Item = Client>,
    {
        RedlockBuilder::new(clients.into_iter().map(Ok).collect())
    }

    /// The number of nodes.
    pub fn node_count(&self) -> usize {
        self.inner.nodes.len()
    }

    /// The number of nodes that must agree: `N/2 + 1`.
    pub fn quorum(&self) -> usize {
        self.inner.quorum
    }

    #[cfg(feature = "axum")]
    pub(crate) fn id(&self) -> u64 {
        self.inner.id
    }

    /// The prefix put before every key.
    pub fn prefix(&self) -> &str {
        &self.inner.policy.prefix
    }

    /// The lease TTL.
    pub fn ttl(&self) -> Duration {
        self.inner.policy.ttl
    }

    /// One acquisition attempt on `resource` (stored as `{prefix}{resource}`).
    ///
    /// # Errors
    ///
    /// - [`LockError::Taken`] when another holder has it, with how long until it frees;
    /// - [`LockError::NoQuorum`] when too few nodes answered within the node timeout;
    /// - [`LockError::TooSlow`] when a quorum agreed but too late to leave any validity;
    /// - [`LockError::InvalidKey`] for an empty key, one over
    ///   [`MAX_RESOURCE_LEN`](crate::key::MAX_RESOURCE_LEN) bytes, or one with control
    ///   characters.
    pub async fn try_lock(&self, resource: &str) -> Result<Lease, LockError> {
        let key = self.inner.policy.full_key(resource)?;
        self.acquire(key, false).await
    }

    /// Like [`try_lock`](Self::try_lock), retrying up to the retry count after a random
    /// delay when the lock is taken or no quorum answered.
    ///
    /// # Errors
    ///
    /// The error of the last attempt, as [`try_lock`](Self::try_lock).
    pub async fn lock(&self, resource: &str) -> Result<Lease, LockError> {
        let key = self.inner.policy.full_key(resource)?;
        self.inner
            .policy
            .with_retries(|| self.acquire(key.clone(), false))
            .await
    }

    /// Waits up to `max_wait` for the lock when it is held: the waiter is woken when the
    /// holder releases (waiters subscribe to a channel named after the key on every node
    /// and mark the holder's value, a `+` after its token; the release of a marked key
    /// publishes on that channel), and re-tries on a jittered fallback timer
    /// (the holder's remaining TTL, at most 1 s) in case a notification is missed or the
    /// lease simply expires. A zero `max_wait` is one attempt, like
    /// [`try_lock`](Self::try_lock). An attempt in flight at the deadline runs to its end
    /// (bounded by the node timeout) rather than being cut off.
    ///
    /// # Errors
    ///
    /// [`LockError::Taken`] when the lock is still held at the deadline; the other errors
    /// of [`try_lock`](Self::try_lock) at once.
    pub async fn lock_within(
        &self,
        resource: &str,
        max_wait: Duration,
    ) -> Result<Lease, LockError> {
        let key = self.inner.policy.full_key(resource)?;
        self.lock_key_within(key, max_wait).await
    }

    /// [`lock_within`](Self::lock_within) for a key that already has the prefix.
    pub(crate) async fn lock_key_within(
        &self,
        key: Arc<str>,
        max_wait: Duration,
    ) -> Result<Lease, LockError> {
        match self.acquire(key.clone(), false).await {
            Err(LockError::Taken { .. }) if !max_wait.is_zero() => {}
            first => return first,
        }
        let notifier = self.inner.notifier.as_ref();
        // Also when this future is dropped mid-wait.
        let _unsubscribe = notifier.map(|notifier| UnsubscribeOnDrop {
            notifier: notifier.clone(),
            key: key.clone(),
        });
        let no_waiters = Waiters::default();
        let waiters = notifier.map_or(&no_waiters, |n| &*n.waiters);
        let subscribe = async {
            if let Some(notifier) = notifier {
                notifier.subscribe(&key).await;
            }
        };
        bounded_wait(
            waiters,
            &key,
            max_wait,
            // Subscribed by now: mark the holder's key, so that its release publishes.
            || self.acquire(key.clone(), notifier.is_some()),
            subscribe,
        )
        .await
    }

    /// Extends the lease to a full TTL from now on every node where it still holds the
    /// token; succeeds with a quorum and a positive recomputed validity, and then moves
    /// `lease.valid_until()`.
    ///
    /// # Errors
    ///
    /// [`LockError::Expired`] when too few nodes still hold the token (the lease is lost),
    /// [`LockError::NoQuorum`] when too few nodes answered, [`LockError::TooSlow`] when
    /// the answers came too late. On error the lease is left as it was.
    pub async fn extend(&self, lease: &mut Lease) -> Result<(), LockError> {
        let start = Instant::now();
        let ttl_ms = self.inner.policy.ttl_ms();
        let results = self
            .on_nodes(
                |mut conn| {
                    let key = lease.key.clone();
                    let token = lease.token;
                    async move {
                        let mut cmd = scripts::evalsha(&scripts::EXTEND, 1);
                        cmd.arg(&*key).arg(token.as_bytes()).arg(ttl_ms);
                        let reply: i64 = scripts::run(&mut conn, &scripts::EXTEND, &cmd).await?;
                        Ok(reply)
                    }
                },
                |reply| *reply == 1,
                Some(Stragglers::Finish),
            )
            .await;
        let mut extended = 0;
        let mut taken_over = false;
        let mut failures = Vec::new();
        for (node, result) in self.inner.nodes.iter().zip(results) {
            match result {
                Some(Ok(1)) => extended += 1,
                Some(Ok(-1)) => taken_over = true,
                Some(Ok(_)) | None => {}
                Some(Err(reason)) => failures.push(node.failure(reason)),
            }
        }
        if extended >= self.inner.quorum {
            let elapsed = start.elapsed();
            return match self.validity(elapsed) {
                Some(validity) => {
                    lease.valid_until = start + validity;
                    Ok(())
                }
                None => Err(LockError::TooSlow { elapsed }),
            };
        }
        Err(self
            .no_quorum(failures)
            .unwrap_or(LockError::Expired { taken_over }))
    }

    /// Releases the lease: deletes the key on every node where it still holds the token.
    ///
    /// # Errors
    ///
    /// [`LockError::Expired`] when fewer than a quorum of nodes still held the token (it
    /// had run out; `taken_over` says whether another holder has it now), or
    /// [`LockError::NoQuorum`] when too few nodes answered (the keys expire by their TTL).
    pub async fn unlock(&self, lease: Lease) -> Result<(), LockError> {
        let outcomes = self
            .release_all(&lease.key, lease.token, true, Some(Stragglers::Finish))
            .await;
        let mut deleted = 0;
        let mut taken_over = false;
        let mut failures = Vec::new();
        for (node, outcome) in self.inner.nodes.iter().zip(outcomes) {
            match outcome {
                Some(Ok(Release::Deleted)) => deleted += 1,
                Some(Ok(Release::HeldByOther { .. })) => taken_over = true,
                Some(Ok(Release::Absent)) | None => {}
                Some(Err(reason)) => failures.push(node.failure(reason)),
            }
        }
        if deleted >= self.inner.quorum {
            return Ok(());
        }
        Err(self
            .no_quorum(failures)
            .unwrap_or(LockError::Expired { taken_over }))
    }

    /// One acquisition attempt; a `waiting` attempt (by a waiter subscribed to the key's
    /// channel) marks the key where it is held, so that its holder's release publishes.
    async fn acquire(&self, key: Arc<str>, waiting: bool) -> Result<Lease, LockError> {
        if self.inner.fence_key.as_ref() == Some(&key) {
            return Err(KeyError::Reserved.into());
        }
        let token = Token::random();
        let start = Instant::now();
        // Releases whatever was set if this future is dropped before the verdict.
        let mut guard = AcquireGuard {
            redlock: self,
            key: &key,
            token,
            armed: true,
            quorum: false,
        };
        let ttl_ms = self.inner.policy.ttl_ms();
        let fence_key = self.inner.fence_key.as_ref();
        let results = self
            .on_nodes(
                |mut conn| {
                    let key = key.clone();
                    let fence_key = fence_key.cloned();
                    async move {
                        match fence_key {
                            Some(fence_key) => {
                                let mut cmd = scripts::evalsha(&scripts::ACQUIRE_FENCED, 2);
                                cmd.arg(&*key)
                                    .arg(&*fence_key)
                                    .arg(token.as_bytes())
                                    .arg(ttl_ms)
                                    .arg(if waiting { "1" } else { "0" });
                                let counter: i64 =
                                    scripts::run(&mut conn, &scripts::ACQUIRE_FENCED, &cmd).await?;
                                Ok(u64::try_from(counter).ok())
                            }
                            None if waiting => {
                                let mut cmd = scripts::evalsha(&scripts::ACQUIRE_WAITING, 1);
                                cmd.arg(&*key).arg(token.as_bytes()).arg(ttl_ms);
                                let set: i64 =
                                    scripts::run(&mut conn, &scripts::ACQUIRE_WAITING, &cmd)
                                        .await?;
                                Ok(u64::try_from(set).ok())
                            }
                            None => {
                                let mut cmd = redis::cmd("SET");
                                cmd.arg(&*key)
                                    .arg(token.as_bytes())
                                    .arg("NX")
                                    .arg("PX")
                                    .arg(ttl_ms);
                                let reply = cmd.query_async::<Value>(&mut conn).await?;
                                Ok(matches!(reply, Value::Okay).then_some(0))
                            }
                        }
                    }
                },
                Option::is_some,
                Some(Stragglers::Drop),
            )
            .await;
        let mut acquired = 0;
        let mut highest_counter = 0u64;
        let mut failures = Vec::new();
        for (node, result) in self.inner.nodes.iter().zip(results) {
            match result {
                Some(Ok(Some(counter))) => {
                    acquired += 1;
                    highest_counter = highest_counter.max(counter);
                }
                Some(Ok(None)) | None => {}
                Some(Err(reason)) => failures.push(node.failure(reason)),
            }
        }
        if acquired >= self.inner.quorum {
            // From here a failure gives up a lock that waiters may be marking: its release
            // wakes them.
            guard.quorum = true;
            let fencing_token = match fence_key {
                Some(fence_key) => {
                    self.raise_fence(&key, token, fence_key, highest_counter)
                        .await
                }
                None => Ok(None),
            };
            let elapsed = start.elapsed();
            match (fencing_token, self.validity(elapsed)) {
                (Ok(fencing_token), Some(validity)) => {
                    guard.armed = false;
                    return Ok(Lease {
                        key: key.clone(),
                        token,
                        ttl: self.inner.policy.ttl,
                        valid_until: start + validity,
                        fencing_token,
                        backend: self.inner.id,
                    });
                }
                // The guard, still armed, releases in the background as it drops.
                (Err(fence_failures), _) => {
                    return Err(self
                        .no_quorum(fence_failures)
                        .unwrap_or(LockError::TooSlow {
                            elapsed: start.elapsed(),
                        }));
                }
                (Ok(_), None) => return Err(LockError::TooSlow { elapsed }),
            }
        }
        if let Some(no_quorum) = self.no_quorum(failures) {
            // Released in the background by the guard: nothing to wait for.
            return Err(no_quorum);
        }
        // Taken: the release also tells how long the holders have left.
        let outcomes = self.release_all(&key, token, false, None).await;
        guard.armed = false;
        Err(LockError::Taken {
            retry_after: self.retry_after(&outcomes),
        })
    }

    /// The second round of a fenced acquisition: the token is one above the highest counter
    /// the acquiring nodes returned, written back to every node where we hold the key.
    /// Succeeds with a quorum of writes.
    async fn raise_fence(
        &self,
        key: &Arc<str>,
        token: Token,
        fence_key: &Arc<str>,
        highest_counter: u64,
    ) -> Result<Option<u64>, Vec<NodeFailure>> {
        let fencing_token = highest_counter.saturating_add(1);
        let results = self
            .on_nodes(
                |mut conn| {
                    let key = key.clone();
                    let fence_key = fence_key.clone();
                    async move {
                        let mut cmd = scripts::evalsha(&scripts::FENCE, 2);
                        cmd.arg(&*key)
                            .arg(&*fence_key)
                            .arg(token.as_bytes())
                            .arg(fencing_token);
                        scripts::run::<i64>(&mut conn, &scripts::FENCE, &cmd).await
                    }
                },
                |written| *written == 1,
                Some(Stragglers::Finish),
            )
            .await;
        let mut written = 0;
        let mut failures = Vec::new();
        for (node, result) in self.inner.nodes.iter().zip(results) {
            match result {
                Some(Ok(1)) => written += 1,
                Some(Ok(_)) | None => {}
                Some(Err(reason)) => failures.push(node.failure(reason)),
            }
        }
        if written >= self.inner.quorum {
            Ok(Some(fencing_token))
        } else {
            Err(failures)
        }
    }

    /// How long until enough holders' keys expire for a quorum to be free.
    fn retry_after(&self, outcomes: &[Option<Result<Release, NodeFailureReason>>]) -> Duration {
        let ttl = self.inner.policy.ttl;
        let mut held: Vec<Duration> = Vec::with_capacity(outcomes.len());
        let mut free = 0usize;
        for outcome in outcomes.iter().flatten() {
            match outcome {
                Ok(Release::Deleted | Release::Absent) => free += 1,
                Ok(Release::HeldByOther { pttl_ms }) => match u64::try_from(*pttl_ms) {
                    Ok(ms) => held.push(Duration::from_millis(ms)),
                    // -1: no expiry set (not one of ours); -2: gone meanwhile.
                    Err(_) if *pttl_ms == -2 => free += 1,
                    Err(_) => held.push(ttl),
                },
                Err(_) => {}
            }
        }
        let Some(needed) = self.inner.quorum.checked_sub(free).filter(|n| *n > 0) else {
            return Duration::ZERO;
        };
        held.sort_unstable();
        held.get(needed - 1).copied().unwrap_or(ttl)
    }

    /// `Some(NoQuorum)` when so many nodes failed that no quorum could have answered.
    fn no_quorum(&self, failures: Vec<NodeFailure>) -> Option<LockError> {
        let nodes = self.inner.nodes.len();
        (failures.len() > nodes - self.inner.quorum).then_some(LockError::NoQuorum {
            quorum: self.inner.quorum,
            nodes,
            failures,
        })
    }

    fn validity(&self, elapsed: Duration) -> Option<Duration> {
        self.inner
            .policy
            .ttl
            .checked_sub(elapsed)?
            .checked_sub(self.inner.drift)
            .filter(|v| !v.is_zero())
    }

    /// Deletes the key on every node where it holds `token`. `publish` wakes the waiters
    /// that marked the key: a release of a lock held by a quorum, not the cleanup of an
    /// attempt that fell short (see the RELEASE script). `early`: see
    /// [`on_nodes`](Self::on_nodes).
    async fn release_all(
        &self,
        key: &Arc<str>,
        token: Token,
        publish: bool,
        early: Option<Stragglers>,
    ) -> Vec<Option<Result<Release, NodeFailureReason>>> {
        let flag: &'static str = if publish { "1" } else { "0" };
        self.on_nodes(
            |mut conn| {
                let key = key.clone();
                async move {
                    let mut cmd = scripts::evalsha(&scripts::RELEASE, 1);
                    cmd.arg(&*key).arg(token.as_bytes()).arg(flag);
                    let code: i64 = scripts::run(&mut conn, &scripts::RELEASE, &cmd).await?;
                    Ok(match code {
                        1 => Release::Deleted,
                        0 => Release::Absent,
                        _ => Release::HeldByOther {
                            pttl_ms: (-3i64).saturating_sub(code),
                        },
                    })
                }
            },
            |r| matches!(r, Release::Deleted),
            early,
        )
        .await
    }

    /// Runs `op` on every node at once, each bounded by the node timeout; results in node
    /// order, `None` for a node whose answer was not awaited.
    ///
    /// With `early`, returns as soon as the outcome is decided: `wins` (answers for which
    /// `win` holds) reach the quorum, or losses make it unreachable. A hung node then costs
    /// nothing once a quorum has answered; its operation is dropped, or finished in the
    /// background ([`Stragglers::Finish`]), as a release must be.
    ///
    /// All nodes start at once, so one timer (the common deadline) bounds them all.
    async fn on_nodes<F, Fut, T>(
        &self,
        op: F,
        win: fn(&T) -> bool,
        early: Option<Stragglers>,
    ) -> Vec<Option<Result<T, NodeFailureReason>>>
    where
        F: Fn(ConnectionManager) -> Fut,
        Fut: Future<Output = redis::RedisResult<T>> + Send + 'static,
        T: Send + 'static,
    {
        let timeout = self.inner.node_timeout;
        let nodes = &self.inner.nodes;
        if let [node] = nodes.as_slice() {
            let answer = match tokio::time::timeout(timeout, op(node.conn.clone())).await {
                Ok(Ok(value)) => Ok(value),
                Ok(Err(e)) => Err(NodeFailureReason::Redis(e)),
                Err(_) => Err(NodeFailureReason::Timeout(timeout)),
            };
            return vec![Some(answer)];
        }
        let started = tokio::time::Instant::now();
        let deadline = started + timeout;
        let mut round = Round {
            pending: nodes
                .iter()
                .map(|node| Some(Box::pin(op(node.conn.clone()))))
                .collect(),
            results: nodes.iter().map(|_| None).collect(),
            win,
            wins: 0,
            losses: 0,
        };
        let (quorum, n) = (self.inner.quorum, nodes.len());
        let decided = |round: &Round<Fut, T>| {
            early.is_some() && (round.wins >= quorum || round.losses > n - quorum)
        };
        let mut timer = std::pin::pin!(tokio::time::sleep_until(deadline));
        let timed_out = std::future::poll_fn(|cx| {
            if round.poll_pending(cx) || decided(&round) {
                Poll::Ready(false)
            } else {
                timer.as_mut().poll(cx).map(|()| true)
            }
        })
        .await;
        if timed_out {
            round.time_out(timeout);
        } else if early == Some(Stragglers::Finish) && round.pending.iter().any(Option::is_some) {
            // Healthy nodes answer within moments of each other: give them a short grace
            // (as long as the quorum took, at least 1 ms) before handing the rest to a
            // background task, so that the common case spawns nothing.
            let grace = started.elapsed().max(Duration::from_millis(1));
            timer
                .as_mut()
                .reset(deadline.min(tokio::time::Instant::now() + grace));
            std::future::poll_fn(|cx| {
                if round.poll_pending(cx) {
                    Poll::Ready(())
                } else {
                    timer.as_mut().poll(cx)
                }
            })
            .await;
            if tokio::time::Instant::now() >= deadline {
                round.time_out(timeout);
            }
            let rest: Vec<_> = round.pending.drain(..).flatten().collect();
            if !rest.is_empty() {
                if let Ok(handle) = tokio::runtime::Handle::try_current() {
                    handle.spawn(tokio::time::timeout_at(
                        deadline,
                        futures_util::future::join_all(rest),
                    ));
                }
            }
        }
        round.results
    }

    /// Releases in the background: for guards dropped outside an async context.
    pub(crate) fn release_detached(&self, key: Arc<str>, token: Token, publish: bool) {
        match tokio::runtime::Handle::try_current() {
            Ok(handle) => {
                let redlock = self.clone();
                handle.spawn(async move {
                    redlock.release_all(&key, token, publish, None).await;
                });
            }
            Err(_) => tracing::warn!(
                key = &*key,
                "no Tokio runtime to release the lock on; it expires by its TTL"
            ),
        }
    }
}

/// What [`Redlock::on_nodes`] does with nodes still answering once the outcome is decided.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stragglers {
    /// Stop waiting for them.
    Drop,
    /// Finish their operations in the background.
    Finish,
}

/// The node operations of one [`Redlock::on_nodes`] call, polled in place.
struct Round<Fut, T> {
    pending: Vec<Option<Pin<Box<Fut>>>>,
    results: Vec<Option<Result<T, NodeFailureReason>>>,
    win: fn(&T) -> bool,
    wins: usize,
    losses: usize,
}

impl<Fut, T> Round<Fut, T>
where
    Fut: Future<Output = redis::RedisResult<T>>,
{
    /// Polls the operations still pending and records their answers; true once none is.
    fn poll_pending(&mut self, cx: &mut Context<'_>) -> bool {
        let mut all_done = true;
        for (slot, result) in self.pending.iter_mut().zip(&mut self.results) {
            let Some(operation) = slot else { continue };
            match operation.as_mut().poll(cx) {
                Poll::Ready(answer) => {
                    *slot = None;
                    match &answer {
                        Ok(value) if (self.win)(value) => self.wins += 1,
                        _ => self.losses += 1,
                    }
                    *result = Some(answer.map_err(NodeFailureReason::Redis));
                }
                Poll::Pending => all_done = false,
            }
        }
        all_done
    }

    /// Counts the operations still pending at the deadline as timed out, and drops them.
    fn time_out(&mut self, timeout: Duration) {
        for (slot, result) in self.pending.iter_mut().zip(&mut self.results) {
            if slot.take().is_some() {
                *result = Some(Err(NodeFailureReason::Timeout(timeout)));
            }
        }
    }
}

enum Release {
    Deleted,
    Absent,
    HeldByOther { pttl_ms: i64 },
}

impl Node {
    fn failure(&self, reason: NodeFailureReason) -> NodeFailure {
        NodeFailure {
            node: self.label.clone(),
            reason,
        }
    }
}

struct AcquireGuard<'a> {
    redlock: &'a Redlock,
    key: &'a Arc<str>,
    token: Token,
    armed: bool,
    /// Whether a quorum of nodes was acquired (the release then wakes marked waiters).
    quorum: bool,
}

impl Drop for AcquireGuard<'_> {
    fn drop(&mut self) {
        if self.armed {
            self.redlock
                .release_detached(self.key.clone(), self.token, self.quorum);
        }
    }
}

impl RedlockBuilder {
    fn new(nodes: Vec<Result<Client, ConfigError>>) -> Self {
        Self {
            nodes,
            node_timeout: None,
            drift_factor: DEFAULT_DRIFT_FACTOR,
            fencing: false,
            notify_waiters: true,
            policy: Policy::default(),
        }
    }

    policy_setters!();

    /// How long to wait for one node's answer before counting it as failed. Default 5% of
    /// the TTL (500 ms for the default 10 s), as go-redsync. It must be shorter than the
    /// TTL, and should be much shorter so that a dead node cannot eat the validity.
    /// Operations return as soon as a quorum has answered (or cannot), so a hung node
    /// costs nothing while the others agree; the timeout bounds the wait when the verdict
    /// needs the hung node. The Redis docs suggest 5 to 50 ms for a 10 s TTL on a fast
    /// network.
    pub fn node_timeout(mut self, timeout: Duration) -> Self {
        self.node_timeout = Some(timeout);
        self
    }

    /// The clock drift factor: the validity is reduced by `ttl * factor + 2 ms` to allow for
    /// clocks that run at different rates. Default 0.01 (the Redis docs, go-redsync); a
    /// finite number in `[0, 0.5)`.
    pub fn drift_factor(mut self, factor: f64) -> Self {
        self.drift_factor = factor;
        self
    }

    /// Whether [`lock_within`](Redlock::lock_within) waiters subscribe to release
    /// notifications (Redis pub/sub, one subscriber connection per node while anybody in
    /// this process waits). Default on; off, waiters only re-try on their fallback timer
    /// (the holder's remaining TTL, capped at 1 s), and do not mark the keys they wait
    /// for. A release publishes only when a subscribed waiter (of any process) marked the
    /// key, so a lock nobody waits for costs no `PUBLISH`.
    pub fn notify_waiters(mut self, enabled: bool) -> Self {
        self.notify_waiters = enabled;
        self
    }

    /// Issue a fencing token with every acquisition ([`Lease::fencing_token`]). Default
    /// off: it costs one more round trip per acquisition.
    ///
    /// Each node keeps one counter, `{prefix}fencing-counter` (a reserved key name). An
    /// acquisition reads the counter on every node atomically with its `SET NX`, takes
    /// one above the highest value seen, and writes it back (raising, never lowering) on
    /// every node where it holds the key, requiring a quorum of those writes before it
    /// succeeds.
    ///
    /// Why the token is monotonic across quorums, not just per node: a later acquisition
    /// of the same key succeeds on a quorum, and any two quorums share a node. On that
    /// shared node the later `SET NX` succeeded only after the earlier holder's key was
    /// gone, hence after the earlier holder's write-back there (which ran while its key
    /// held its token). So the later acquisition reads at least the earlier token and
    /// issues a strictly greater one, even if its quorum misses the node that holds the
    /// highest counter.
    ///
    /// Assumptions: nodes keep their data. A node restarted empty forgets its counter;
    /// while every other node of a later quorum took part in the earlier write-back the
    /// order still holds, but a restart combined with another failure can issue a smaller
    /// token (A writes back on X and Z while Y is down; X restarts empty; B acquires on X
    /// and Y). Delayed restarts protect the lock, not the counter. Run the nodes with persistence (`appendonly yes`, `appendfsync always`) where
    /// fencing matters. Tokens are exact up to 2^53 (Lua numbers).
    pub fn fencing_tokens(mut self, enabled: bool) -> Self {
        self.fencing = enabled;
        self
    }

    /// Checks the configuration, opens a connection to every node and loads the Lua
    /// scripts there, each node bounded by the node timeout. A node that cannot be reached
    /// now is not an error: it is retried on every later operation, and locks are granted
    /// while a quorum answers.
    ///
    /// Needs a Tokio runtime with the time driver.
    ///
    /// # Errors
    ///
    /// A [`ConfigError`]: no nodes, an invalid URL, a zero or too long TTL, a TTL too short
    /// to leave validity after the drift allowance, a node timeout not shorter than the
    /// TTL, a drift factor out of range, an empty retry delay range, or a bad prefix.
    pub async fn build(self) -> Result<Redlock, ConfigError> {
        self.policy.validate()?;
        if !(self.drift_factor.is_finite() && (0.0..0.5).contains(&self.drift_factor)) {
            return Err(ConfigError::InvalidDriftFactor(self.drift_factor));
        }
        let ttl = self.policy.ttl;
        let drift = ttl.mul_f64(self.drift_factor).saturating_add(DRIFT_FLOOR);
        if ttl <= drift {
            return Err(ConfigError::InvalidTtl {
                ttl,
                reason: "it leaves no validity after the clock drift allowance (ttl * drift_factor + 2 ms)",
            });
        }
        let node_timeout = self
            .node_timeout
            .unwrap_or(ttl / DEFAULT_NODE_TIMEOUT_FACTOR);
        if node_timeout.is_zero() || node_timeout >= ttl {
            return Err(ConfigError::InvalidNodeTimeout {
                timeout: node_timeout,
                ttl,
            });
        }
        if self.nodes.is_empty() {
            return Err(ConfigError::NoNodes);
        }
        let config = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(node_timeout.max(Duration::from_millis(500))))
            .set_response_timeout(None)
            .set_number_of_retries(1)
            .set_min_delay(Duration::from_millis(10))
            .set_max_delay(Duration::from_millis(500));
        let mut nodes = Vec::with_capacity(self.nodes.len());
        let mut clients = Vec::with_capacity(self.nodes.len());
        for client in self.nodes {
            let client = client?;
            clients.push(client.clone());
            let label = client.get_connection_info().addr().to_string();
            let conn = ConnectionManager::new_lazy_with_config(client, config.clone()).map_err(
                |source| ConfigError::InvalidUrl {
                    index: nodes.len(),
                    source,
                },
            )?;
            nodes.push(Node { label, conn });
        }
        let quorum = nodes.len() / 2 + 1;
        let redlock = Redlock {
            inner: Arc::new(Inner {
                id: crate::backend::next_backend_id(),
                nodes,
                notifier: self.notify_waiters.then(|| {
                    Arc::new(Notifier::new(
                        clients,
                        node_timeout.max(Duration::from_millis(100)),
                    ))
                }),
                fence_key: self
                    .fencing
                    .then(|| Arc::from(format!("{}{FENCE_RESOURCE}", self.policy.prefix))),
                quorum,
                node_timeout,
                drift,
                policy: self.policy,
            }),
        };
        // Loading the scripts now also checks that the nodes answer. An acquisition
        // returns once the quorum is decided and drops the slower nodes' commands, so on
        // a node that lacks a script (flushed, restarted) the `NOSCRIPT` fallback might
        // never run there; releases and extensions finish theirs and load it again.
        let loads = redlock
            .on_nodes(
                |mut conn| async move {
                    for script in scripts::ALL {
                        script.load_async(&mut conn).await?;
                    }
                    Ok(())
                },
                |()| true,
                None,
            )
            .await;
        for (node, load) in redlock.inner.nodes.iter().zip(loads) {
            if let Some(Err(reason)) = load {
                tracing::warn!(failure = %node.failure(reason), "Redis node not reachable yet; it will be retried");
            }
        }
        Ok(redlock)
    }
}
