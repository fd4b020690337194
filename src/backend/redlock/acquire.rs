//! An acquisition: the `SET NX` round, the fencing round, and the cleanup of an attempt
//! that fell short, for every kind of attempt ([`Acquisition`]).

use std::future::Future;
use std::num::NonZeroU64;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::Redlock;
use super::keys::Keys;
use super::local::{Admission, Outcome};
use super::round::{Answers, Stragglers};
use super::scripts::{self, Attempt, Attempted};
use super::tally::{QuorumVerdict, Rule, Vote};
use crate::backend::connection::Connection;
use crate::error::{LockError, LockOperation, NodeFailureReason};
use crate::lease::{Lease, Token};

impl Redlock {
    /// One acquisition attempt, answered in process when it can be (see
    /// [`local`](super::local)); a `waiting` attempt sets the waiters' mark where it is held.
    /// The lease records `holder` beside its key.
    pub(super) async fn acquire_untraced(
        &self,
        key: Arc<str>,
        waiting: bool,
        holder: Arc<str>,
    ) -> Result<Lease, LockError> {
        loop {
            match self.inner.local.enter(&key, waiting) {
                Admission::Held { left } => {
                    crate::observe::nodes_answered(0);
                    // The keys outlive the validity by up to the drift allowance.
                    return Err(LockError::Taken {
                        retry_after: left.saturating_add(self.inner.drift),
                    });
                }
                Admission::Follow(flight) => match flight.outcome().await {
                    Outcome::Taken(retry_after) => return Err(LockError::Taken { retry_after }),
                    Outcome::Failed(e) => return Err(e),
                    // The next look finds the holder, or a free key.
                    Outcome::Won | Outcome::Abandoned => {}
                },
                Admission::Lead(flight) => {
                    let entered = flight.entered;
                    let result = self.attempt_round(&key, waiting, entered, &holder).await;
                    flight.finish(&result);
                    return result;
                }
            }
        }
    }

    /// One acquisition attempt on the nodes, started at `start`, recording `holder`.
    async fn attempt_round(
        &self,
        key: &Arc<str>,
        waiting: bool,
        start: Instant,
        holder: &Arc<str>,
    ) -> Result<Lease, LockError> {
        let mut acquisition = Acquisition::starting(self, Keys::Lock(key.clone()), start);
        let token = acquisition.token;
        // On one node, the counter is raised with the `SET`: no second round.
        let raise_fence_ms = self.inner.fence_ms.filter(|_| self.inner.nodes.len() == 1);
        let attempt = Attempt {
            ttl_ms: self.inner.policy.ttl_ms(),
            fenced: self.inner.fence_ms.is_some(),
            mark_ms: waiting.then_some(self.inner.mark_ms),
            raise_fence_ms,
        };
        let round = acquisition
            .round(
                |conn| {
                    let prefix = self.inner.policy.prefix.clone();
                    scripts::acquire(conn, prefix, key.clone(), token, attempt, holder.clone())
                },
                CleanUp::Background,
                None,
            )
            .await?;
        warn_invalid_counters(&round);
        let fence = match (self.inner.fence_ms, raise_fence_ms) {
            (_, Some(_)) => Fence::RaisedInPlace,
            (Some(fence_ms), None) => Fence::Raise(fence_ms),
            (None, None) => Fence::None,
        };
        acquisition.won(&round, fence).await
    }

    /// Deletes `keys` where they hold `token`, in the background, on the nodes of `round`
    /// that did not answer "held".
    fn release_unless_held(&self, round: &Answers<Attempted>, keys: &Keys, token: Token) {
        let nodes: Vec<_> = self
            .inner
            .nodes
            .iter()
            .zip(&round.answers)
            .filter(|(_, answer)| !matches!(answer, Some(Ok(Attempted::Held { .. }))))
            .map(|(node, _)| node.clone())
            .collect();
        if nodes.is_empty() {
            return;
        }
        let Ok(handle) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let timeout = self.inner.node_timeout;
        let (prefix, keys) = (self.inner.policy.prefix.clone(), keys.clone());
        handle.spawn(futures_util::future::join_all(nodes.into_iter().map(
            move |conn| {
                let release = keys.clone().release(conn, prefix.clone(), token, false);
                tokio::time::timeout(timeout, release)
            },
        )));
    }

    /// The second round of a fenced acquisition: writes one above `highest_counter` back
    /// to every node where we hold the keys; succeeds with a quorum of writes.
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
                    let prefix = self.inner.policy.prefix.clone();
                    keys.clone()
                        .raise_fence(conn, prefix, token, fencing_token, fence_ms)
                },
                |written| Vote::of(*written == 1),
                Rule::Held,
                Stragglers::Finish,
            )
            .await;
        match round.verdict {
            QuorumVerdict::Won => Ok(fencing_token),
            QuorumVerdict::Lost => Err(LockError::TooSlow {
                operation: LockOperation::Acquire,
                elapsed: start.elapsed(),
            }),
            QuorumVerdict::NoQuorum => Err(self.no_quorum(round, LockOperation::Acquire)),
        }
    }

    /// How long until a quorum of nodes may be free, from a lost attempt's answers: nodes
    /// where it set the keys count as free; one free but not ours to take counts as held
    /// for `turn`, or as free without it.
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

/// Logs the nodes of a won round whose fencing counter is not an integer.
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

/// How a won attempt gets its fencing token.
#[derive(Debug, Clone, Copy)]
pub(super) enum Fence {
    /// Not fenced.
    None,
    /// A second round writes one above the highest counter back to the nodes, expiring
    /// in this many ms ([`raise_fence`](Redlock::raise_fence)): what makes tokens increase
    /// across quorums of several nodes.
    Raise(u64),
    /// The attempt raised the counter of its one node with the `SET`: the token is the
    /// counter as it stood, plus one.
    RaisedInPlace,
}

impl Fence {
    /// Fenced in a second round when `fence_ms` is set, else not fenced.
    pub(super) fn in_rounds(fence_ms: Option<u64>) -> Self {
        fence_ms.map_or(Fence::None, Fence::Raise)
    }
}

/// How a refused attempt deletes what it may have set.
#[derive(Debug, Clone, Copy)]
pub(super) enum CleanUp {
    /// In the background, on every node that did not answer "held".
    Background,
    /// Before the refusal is answered, unless every node answered that it set nothing.
    Awaited,
}

/// One acquisition attempt on `keys`, with a fresh token: its [`round`], and the lease a
/// won round gives ([`won`]). Dropped before its verdict (or failing after it), it
/// releases whatever it set, in the background.
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

    /// Runs `op` on every node at once under [`Rule::Acquire`], returning at the verdict:
    /// the answers of a won round; [`LockError::Taken`] (see
    /// [`retry_after`](Redlock::retry_after)) once cleaned up as `clean_up` says; or
    /// [`LockError::NoQuorum`].
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
            .on_nodes(self.start, op, took, Rule::Acquire, Stragglers::Drop)
            .await;
        match round.verdict {
            QuorumVerdict::Won => return Ok(round),
            QuorumVerdict::NoQuorum => {
                return Err(redlock.no_quorum(round, LockOperation::Acquire));
            }
            QuorumVerdict::Lost => {}
        }
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

    /// The lease of the won `round`, fenced as `fence` says. Errors: the fencing round's,
    /// and [`LockError::TooSlow`] when no validity is left (the lock is then released).
    pub(super) async fn won(
        mut self,
        round: &Answers<Attempted>,
        fence: Fence,
    ) -> Result<Lease, LockError> {
        // From here a failure's release wakes the waiters.
        self.quorum = true;
        let redlock = self.redlock;
        let highest = || {
            round
                .values()
                .filter_map(Attempted::counter)
                .max()
                .unwrap_or(0)
        };
        let fencing_token = match fence {
            Fence::Raise(fence_ms) => {
                let raised =
                    redlock.raise_fence(&self.keys, self.token, highest(), fence_ms, self.start);
                NonZeroU64::new(raised.await?)
            }
            Fence::RaisedInPlace => NonZeroU64::new(highest().saturating_add(1)),
            Fence::None => None,
        };
        let elapsed = self.start.elapsed();
        let validity = redlock.validity(elapsed).ok_or(LockError::TooSlow {
            operation: LockOperation::Acquire,
            elapsed,
        })?;
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

/// An acquisition's vote: for where the attempt set the keys.
pub(super) fn took(attempted: &Attempted) -> Vote {
    Vote::of(attempted.counter().is_some())
}

/// Whether a refused attempt may have set something: unless every node answered "held".
fn may_have_set(round: &Answers<Attempted>) -> bool {
    !round
        .answers
        .iter()
        .all(|answer| matches!(answer, Some(Ok(Attempted::Held { .. }))))
}
