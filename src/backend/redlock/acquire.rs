//! An acquisition: the `SET NX` round, the fencing round, and the cleanup of an attempt
//! that fell short. [`Acquisition`] holds these steps for every kind of attempt (a plain
//! one, a shared or exclusive one, a fair one, one on a set of keys): each sends its own
//! node operation (a script, or the native `SET NX PX` of a plain attempt) and gets its
//! answers as [`Attempted`].

use std::future::Future;
use std::num::NonZeroU64;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::Redlock;
use super::hot::{Admission, Outcome};
use super::keys::Keys;
use super::round::{Answers, Stragglers};
use super::scripts::{self, Attempt, Attempted};
use super::tally::{QuorumVerdict, Rule, Vote};
use crate::backend::connection::Connection;
use crate::backend::request::LockBackend;
use crate::backend::settings::Settings;
use crate::error::{LockError, NodeFailureReason};
use crate::lease::{Access, Lease, Token};

impl LockBackend for Redlock {
    fn policy(&self) -> &Settings {
        &self.inner.policy
    }

    fn id(&self) -> u64 {
        self.inner.id
    }

    fn try_plain(&self, key: Arc<str>) -> impl Future<Output = Result<Lease, LockError>> + Send {
        self.acquire(key, false)
    }

    fn try_all(
        &self,
        keys: Arc<[Arc<str>]>,
    ) -> impl Future<Output = Result<Lease, LockError>> + Send {
        self.acquire_all(keys)
    }

    fn wait_plain(
        &self,
        key: Arc<str>,
        max_wait: Duration,
    ) -> impl Future<Output = Result<Lease, LockError>> + Send {
        self.lock_key_within(key, max_wait)
    }

    fn wait_access(
        &self,
        key: Arc<str>,
        access: Access,
        max_wait: Duration,
    ) -> impl Future<Output = Result<Lease, LockError>> + Send {
        self.lock_access_within(key, access, max_wait)
    }

    fn wait_fair(
        &self,
        key: Arc<str>,
        max_wait: Duration,
    ) -> impl Future<Output = Result<Lease, LockError>> + Send {
        self.lock_fair_key_within(key, max_wait)
    }
}

impl Redlock {
    /// One acquisition attempt; a `waiting` attempt (by a waiter subscribed to the lock's
    /// release channel) sets the waiters' mark where the lock is held, so that its
    /// holder's release publishes.
    ///
    /// Answered in process when it can be (see [`hot`](super::hot)): "taken" while this
    /// client holds the key, and the outcome of the attempt already in flight on the
    /// key, if any, instead of a second one.
    pub(super) async fn acquire_untraced(
        &self,
        key: Arc<str>,
        waiting: bool,
    ) -> Result<Lease, LockError> {
        loop {
            match self.inner.hot.enter(&key, waiting) {
                Admission::Held { left } => {
                    // Answered in process: no node was asked.
                    crate::observe::nodes_answered(0);
                    // The keys outlive the validity by up to the drift allowance.
                    return Err(LockError::Taken {
                        retry_after: left.saturating_add(self.inner.drift),
                    });
                }
                Admission::Follow(flight) => match flight.outcome().await {
                    Outcome::Taken(retry_after) => return Err(LockError::Taken { retry_after }),
                    Outcome::Failed(e) => return Err(e),
                    // Won: the next look finds the holder (or, released meanwhile, a
                    // free key). Abandoned: nobody asked Redis yet.
                    Outcome::Won | Outcome::Abandoned => {}
                },
                Admission::Lead(flight) => {
                    let result = self.attempt_round(&key, waiting, flight.entered).await;
                    flight.finish(&result);
                    return result;
                }
            }
        }
    }

    /// One acquisition attempt on the nodes, started at `start`.
    async fn attempt_round(
        &self,
        key: &Arc<str>,
        waiting: bool,
        start: Instant,
    ) -> Result<Lease, LockError> {
        // Releases whatever was set if this future is dropped before the verdict.
        let mut acquisition = Acquisition::starting(self, Keys::Lock(key.clone()), start);
        let token = acquisition.token;
        let attempt = Attempt {
            ttl_ms: self.inner.policy.ttl_ms(),
            fenced: self.inner.fence_ms.is_some(),
            mark_ms: waiting.then_some(self.inner.mark_ms),
        };
        // Taken: our key is deleted where it may have been set (every node but those that
        // answered "held"), in the background; usually nowhere.
        let round = acquisition
            .round(
                |conn| scripts::acquire(conn, key.clone(), token, attempt),
                CleanUp::Background,
                None,
            )
            .await?;
        warn_invalid_counters(&round);
        acquisition.won(&round, self.inner.fence_ms).await
    }

    /// Deletes `keys` where they hold `token`, in the background, each bounded by the
    /// node timeout, on the nodes of `round` that did not answer "held": where the attempt
    /// set them, and where it may have (no answer in time).
    fn release_unless_held(&self, round: &Answers<Attempted>, keys: &Keys, token: Token) {
        let nodes: Vec<_> = self
            .inner
            .nodes
            .iter()
            .zip(&round.answers)
            .filter(|(_, answer)| !matches!(answer, Some(Ok(Attempted::Held { .. }))))
            .map(|(node, _)| node.conn.clone())
            .collect();
        if nodes.is_empty() {
            return;
        }
        let Ok(handle) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let timeout = self.inner.node_timeout;
        let keys = keys.clone();
        handle.spawn(futures_util::future::join_all(nodes.into_iter().map(
            move |conn| tokio::time::timeout(timeout, keys.clone().release(conn, token, false)),
        )));
    }

    /// The second round of a fenced acquisition: the token is one above the highest
    /// counter the acquiring nodes returned, written back to every node where we hold the
    /// keys, with the counters' expiry set to `fence_ms`. Succeeds with a quorum of writes.
    async fn raise_fence(
        &self,
        keys: &Keys,
        token: Token,
        highest_counter: u64,
        fence_ms: u64,
        start: Instant,
    ) -> Result<u64, LockError> {
        let fencing_token = highest_counter.saturating_add(1);
        let round = self
            .on_nodes(
                Instant::now(),
                |conn| {
                    keys.clone()
                        .raise_fence(conn, token, fencing_token, fence_ms)
                },
                |written| Vote::of(*written == 1),
                Rule::Proof,
                Stragglers::Finish,
            )
            .await;
        match round.verdict {
            QuorumVerdict::Won => Ok(fencing_token),
            QuorumVerdict::Lost => Err(LockError::TooSlow {
                elapsed: start.elapsed(),
            }),
            QuorumVerdict::NoQuorum => Err(self.no_quorum(round)),
        }
    }

    /// How long until enough holders' keys expire for a quorum of nodes to be free, from
    /// the answers of a lost attempt: nodes where it set the keys count as free (they are
    /// deleted there); `turn` is how long a node that is free but not ours to take (a fair
    /// queue's head goes first) counts as held, and without it such a node counts as free.
    fn retry_after(&self, round: &Answers<Attempted>, turn: Option<Duration>) -> Duration {
        let ttl = self.inner.policy.ttl;
        let mut held: Vec<Duration> = Vec::with_capacity(round.answers.len());
        let mut free = 0usize;
        for attempted in round.values() {
            match *attempted {
                Attempted::Set(_) => free += 1,
                Attempted::Held { pttl_ms: -2 } => match turn {
                    Some(turn) => held.push(turn),
                    None => free += 1,
                },
                // -1: no expiry set (not one of ours): a full TTL.
                Attempted::Held { pttl_ms } => {
                    held.push(u64::try_from(pttl_ms).map_or(ttl, Duration::from_millis));
                }
            }
        }
        let Some(needed) = self.inner.quorum.checked_sub(free).filter(|n| *n > 0) else {
            return turn.unwrap_or(Duration::ZERO);
        };
        held.sort_unstable();
        held.get(needed - 1).copied().unwrap_or(ttl)
    }
}

/// Logs the nodes of a won round whose fencing counter another client spoiled: the lock
/// was acquired without them, but they stay out of every fenced acquisition of the key.
fn warn_invalid_counters(round: &Answers<Attempted>) {
    for answer in round.answers.iter().flatten() {
        if let Err(NodeFailureReason::InvalidFencingCounter { key }) = answer {
            tracing::warn!(
                counter = %crate::redact::LogKey(key),
                "a node's fencing counter is not an integer; delete it"
            );
        }
    }
}

/// How a refused attempt deletes what it may have set.
#[derive(Debug, Clone, Copy)]
pub(super) enum CleanUp {
    /// In the background, on every node that did not answer "held" (where it set the
    /// keys, and where it may have: no answer in time), so that the refusal costs one
    /// round.
    Background,
    /// Before the refusal is answered, on every node, unless every node answered that it
    /// set nothing.
    Awaited,
}

/// One acquisition attempt, with a fresh token, on `keys`: its round ([`round`]), and the
/// lease a won round gives ([`won`]). Dropped armed (before its verdict, as when the
/// caller's future is dropped, or failing after it), it releases whatever it set, in the
/// background.
///
/// [`round`]: Acquisition::round
/// [`won`]: Acquisition::won
pub(super) struct Acquisition<'a> {
    redlock: &'a Redlock,
    keys: Keys,
    pub(super) token: Token,
    /// When the attempt started: the lease's validity counts from here.
    pub(super) start: Instant,
    armed: bool,
    /// Whether a quorum of nodes was acquired (the release then wakes marked waiters).
    quorum: bool,
}

impl<'a> Acquisition<'a> {
    pub(super) fn new(redlock: &'a Redlock, keys: Keys) -> Self {
        Self::starting(redlock, keys, Instant::now())
    }

    /// An attempt that started at `start`, a clock reading just taken.
    pub(super) fn starting(redlock: &'a Redlock, keys: Keys, start: Instant) -> Self {
        Self {
            redlock,
            keys,
            token: Token::random(),
            start,
            armed: true,
            quorum: false,
        }
    }

    /// Runs `op` (the attempt's script on one node) on every node at once, under the
    /// node timeout from the attempt's start, each node voting for where it set the keys,
    /// under [`Rule::Contest`], and stops waiting for the rest at the verdict (this
    /// attempt, if dropped, releases what they set).
    ///
    /// Returns the answers of a won round. A lost round is [`LockError::Taken`], with how
    /// long until a quorum may be free ([`retry_after`](Redlock::retry_after) with
    /// `turn`), once what the attempt may have set is deleted as `clean_up` says; an
    /// undecided one is [`LockError::NoQuorum`], and the caller drops the attempt.
    pub(super) async fn round<F, Fut>(
        &mut self,
        op: F,
        clean_up: CleanUp,
        turn: Option<Duration>,
    ) -> Result<Answers<Attempted>, LockError>
    where
        F: Fn(Connection) -> Fut,
        Fut: Future<Output = Result<Attempted, NodeFailureReason>> + Send + 'static,
    {
        let redlock = self.redlock;
        let round = redlock
            .on_nodes(
                self.start,
                op,
                |attempted| Vote::of(attempted.counter().is_some()),
                Rule::Contest,
                Stragglers::Drop,
            )
            .await;
        match round.verdict {
            QuorumVerdict::Won => return Ok(round),
            QuorumVerdict::NoQuorum => return Err(redlock.no_quorum(round)),
            QuorumVerdict::Lost => {}
        }
        // Taken: the answers tell how long the holders have left.
        let retry_after = redlock.retry_after(&round, turn);
        match clean_up {
            CleanUp::Background => redlock.release_unless_held(&round, &self.keys, self.token),
            CleanUp::Awaited if may_have_set(&round) => {
                let keys = self.keys.clone();
                redlock
                    .release_keys(keys, self.token, false, |_| Vote::For, Stragglers::Finish)
                    .await;
            }
            CleanUp::Awaited => {}
        }
        self.armed = false;
        Err(LockError::Taken { retry_after })
    }

    /// The lease of the won `round`: with `fence_ms`, fenced one above the highest
    /// counter its nodes returned ([`raise_fence`](Redlock::raise_fence)); valid for the
    /// TTL less the time the attempt took and the drift allowance.
    ///
    /// # Errors
    ///
    /// Those of the fencing round, and [`LockError::TooSlow`] when no validity is left:
    /// the lock, held by a quorum, is then released in the background.
    pub(super) async fn won(
        mut self,
        round: &Answers<Attempted>,
        fence_ms: Option<u64>,
    ) -> Result<Lease, LockError> {
        // From here a failure gives up a lock that waiters may be marking: its release
        // wakes them.
        self.quorum = true;
        let redlock = self.redlock;
        let fencing_token = match fence_ms {
            Some(fence_ms) => {
                let highest = round
                    .values()
                    .filter_map(Attempted::counter)
                    .max()
                    .unwrap_or(0);
                let raised =
                    redlock.raise_fence(&self.keys, self.token, highest, fence_ms, self.start);
                NonZeroU64::new(raised.await?)
            }
            None => None,
        };
        let elapsed = self.start.elapsed();
        let validity = redlock
            .validity(elapsed)
            .ok_or(LockError::TooSlow { elapsed })?;
        self.armed = false;
        Ok(Lease {
            key: self.keys.lease_key(),
            shape: self.keys.shape(),
            token: self.token,
            ttl: redlock.inner.policy.ttl,
            valid_until: self.start + validity,
            fencing_token,
            backend: redlock.inner.id,
            reentered: false,
        })
    }
}

impl Drop for Acquisition<'_> {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        let (redlock, token, publish) = (self.redlock, self.token, self.quorum);
        redlock.release_detached(self.keys.clone(), token, publish);
    }
}

/// Whether a refused attempt may have set something on a node: unless every node
/// answered that it set nothing, it may have.
fn may_have_set(round: &Answers<Attempted>) -> bool {
    !round
        .answers
        .iter()
        .all(|answer| matches!(answer, Some(Ok(Attempted::Held { .. }))))
}
