//! An acquisition: the `SET NX` round, the fencing round, and the cleanup of an attempt
//! that fell short.

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::Redlock;
use super::hot::{Entry, Outcome};
use super::round::{Answers, Stragglers};
use super::scripts::{self, Attempt, Attempted};
use super::tally::{Rule, Verdict, Vote};
use crate::backend::connection::Connection;
use crate::error::{LockError, NodeFailureReason};
use crate::lease::{Lease, Token};

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
                Entry::Held { left } => {
                    // Answered in process: no node was asked.
                    crate::observe::nodes_answered(0);
                    // The keys outlive the validity by up to the drift allowance.
                    return Err(LockError::Taken {
                        retry_after: left.saturating_add(self.inner.drift),
                    });
                }
                Entry::Follow(flight) => match flight.outcome().await {
                    Outcome::Taken(retry_after) => return Err(LockError::Taken { retry_after }),
                    Outcome::Failed(e) => return Err(e),
                    // Won: the next look finds the holder (or, released meanwhile, a
                    // free key). Abandoned: nobody asked Redis yet.
                    Outcome::Won | Outcome::Abandoned => {}
                },
                Entry::Lead(flight) => {
                    let result = self.attempt(key.clone(), waiting).await;
                    flight.finish(&result);
                    return result;
                }
            }
        }
    }

    /// One acquisition attempt on the nodes.
    async fn attempt(&self, key: Arc<str>, waiting: bool) -> Result<Lease, LockError> {
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
        let attempt = Attempt {
            ttl_ms: self.inner.policy.ttl_ms(),
            fenced: self.inner.fence_ms.is_some(),
            mark_ms: waiting.then_some(self.inner.mark_ms),
        };
        let round = self
            .on_nodes(
                |conn| scripts::acquire(conn, key.clone(), token, attempt),
                |attempted| Vote::of(matches!(attempted, Attempted::Set(_))),
                Rule::Contest,
                Stragglers::Drop,
            )
            .await;
        match round.verdict {
            Verdict::Won => {}
            // Released in the background by the guard: nothing to wait for.
            Verdict::NoQuorum => return Err(self.no_quorum(round)),
            Verdict::Lost => {
                // Taken: the answers tell how long the holders have left. Our key is
                // deleted where it may have been set (every node but those that answered
                // "held"), in the background; usually nowhere.
                self.clean_up(&key, token, &round);
                guard.armed = false;
                return Err(LockError::Taken {
                    retry_after: self.retry_after(&round),
                });
            }
        }
        // From here a failure gives up a lock that waiters may be marking: its release
        // wakes them.
        guard.quorum = true;
        let fencing_token = match self.inner.fence_ms {
            Some(fence_ms) => {
                warn_invalid_counters(&round);
                let highest = round
                    .values()
                    .filter_map(|attempted| match attempted {
                        Attempted::Set(counter) => Some(*counter),
                        Attempted::Held { .. } => None,
                    })
                    .max()
                    .unwrap_or(0);
                let raised = self.raise_fence(&key, token, highest, fence_ms, start);
                Some(raised.await?)
            }
            None => None,
        };
        let elapsed = start.elapsed();
        // Without validity left, the guard, still armed, releases in the background.
        let validity = self
            .validity(elapsed)
            .ok_or(LockError::TooSlow { elapsed })?;
        guard.armed = false;
        Ok(Lease {
            key: key.clone(),
            set: None,
            token,
            ttl: self.inner.policy.ttl,
            valid_until: start + validity,
            fencing_token,
            backend: self.inner.id,
        })
    }

    /// Deletes our key, in the background, on every node of a lost attempt that did not
    /// answer "held": where it was set, and where it may have been (no answer in time).
    fn clean_up(&self, key: &Arc<str>, token: Token, round: &Answers<Attempted>) {
        let key = key.clone();
        self.release_where(
            round,
            |attempted| matches!(attempted, Attempted::Held { .. }),
            move |conn| scripts::release(conn, key.clone(), token, false),
        );
    }

    /// Runs `release` in the background, each bounded by the node timeout, on the nodes
    /// of `round` whose answer is not `held`: where an attempt set something, or may have
    /// (no answer in time).
    pub(super) fn release_where<T, F, Fut>(
        &self,
        round: &Answers<T>,
        held: fn(&T) -> bool,
        release: F,
    ) where
        F: Fn(Connection) -> Fut + Send + 'static,
        Fut: Future + Send + 'static,
        Fut::Output: Send + 'static,
    {
        let nodes: Vec<_> = self
            .inner
            .nodes
            .iter()
            .zip(&round.answers)
            .filter(|(_, answer)| !matches!(answer, Some(Ok(value)) if held(value)))
            .map(|(node, _)| node.conn.clone())
            .collect();
        if nodes.is_empty() {
            return;
        }
        let Ok(handle) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let timeout = self.inner.node_timeout;
        handle.spawn(futures_util::future::join_all(
            nodes
                .into_iter()
                .map(move |conn| tokio::time::timeout(timeout, release(conn))),
        ));
    }

    /// The second round of a fenced acquisition: the token is one above the highest
    /// counter the acquiring nodes returned, written back to every node where we hold the
    /// key, with the counter's expiry set to `fence_ms`. Succeeds with a quorum of writes.
    pub(super) async fn raise_fence(
        &self,
        key: &Arc<str>,
        token: Token,
        highest_counter: u64,
        fence_ms: u64,
        start: Instant,
    ) -> Result<u64, LockError> {
        let fencing_token = highest_counter.saturating_add(1);
        let round = self
            .on_nodes(
                |conn| scripts::raise_fence(conn, key.clone(), token, fencing_token, fence_ms),
                |written| Vote::of(*written == 1),
                Rule::Proof,
                Stragglers::Finish,
            )
            .await;
        match round.verdict {
            Verdict::Won => Ok(fencing_token),
            Verdict::Lost => Err(LockError::TooSlow {
                elapsed: start.elapsed(),
            }),
            Verdict::NoQuorum => Err(self.no_quorum(round)),
        }
    }

    /// How long until enough holders' keys expire for a quorum to be free, from the
    /// answers of a lost attempt (nodes where it set the key count as free: it is
    /// deleted there).
    fn retry_after(&self, round: &Answers<Attempted>) -> Duration {
        let ttl = self.inner.policy.ttl;
        let mut held: Vec<Duration> = Vec::with_capacity(round.answers.len());
        let mut free = 0usize;
        for attempted in round.values() {
            match attempted {
                Attempted::Set(_) => free += 1,
                Attempted::Held { pttl_ms } => match u64::try_from(*pttl_ms) {
                    Ok(ms) => held.push(Duration::from_millis(ms)),
                    // -1: no expiry set (not one of ours).
                    Err(_) => held.push(ttl),
                },
            }
        }
        let Some(needed) = self.inner.quorum.checked_sub(free).filter(|n| *n > 0) else {
            return Duration::ZERO;
        };
        held.sort_unstable();
        held.get(needed - 1).copied().unwrap_or(ttl)
    }
}

/// Logs the nodes of a won round whose fencing counter another client spoiled: the lock
/// was acquired without them, but they stay out of every fenced acquisition of the key.
fn warn_invalid_counters(round: &Answers<Attempted>) {
    for answer in round.answers.iter().flatten() {
        if let Err(reason @ NodeFailureReason::InvalidFencingCounter { .. }) = answer {
            tracing::warn!(
                reason = ?reason,
                "a node's fencing counter is not an integer; delete it"
            );
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
