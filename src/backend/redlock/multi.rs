//! Leases on several keys at once (Redisson's `MultiLock`, done the Redlock way): each
//! node checks and sets every key of the set in one Lua script, all or none, so one round
//! decides the set, with one quorum verdict and one validity for it.
//!
//! Per node, the script first looks at every key (`PTTL`); if any is held, it sets
//! nothing and answers the longest remaining TTL among the holders; else it sets every key
//! to our token with the TTL. Since a script runs atomically on its node, two clients that
//! name the same keys in opposite orders cannot each take a part on one node and wait for
//! the rest: there is no partial state to wait on, so no deadlock. Across nodes, the
//! quorum decides as for one key, and an attempt that falls short releases its keys
//! everywhere, as for one key.
//!
//! Extension and release are one script per node too: the set is extended only where
//! every key still holds our token, and released key by key where it does (another
//! holder's key is never touched).
//!
//! Keys on one plain Redis node need no common hash slot. A Redis Cluster refuses a script
//! over keys of several slots (`CROSSSLOT`), and the keys of a set hash to different slots
//! (braces in resource names are percent-encoded, so no hash tag joins them): sets are for
//! independent nodes.

mod scripts;

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::Redlock;
use super::round::{Answers, Stragglers};
use super::scripts::Release;
use super::tally::{Rule, Verdict, Vote};
use crate::error::LockError;
use crate::lease::{Lease, Token};
use scripts::{Attempt, acquire_on, extend_on, fence_on, release_on};

impl Redlock {
    /// One acquisition attempt on every resource in `resources` at once (each stored as
    /// `{prefix}{resource}`): the set is acquired, with one token, one validity and one
    /// quorum verdict, or none of it is held. One round trip per node, whatever the
    /// number of keys: every node checks and sets all of them in one Lua script.
    ///
    /// The order of `resources` does not matter and duplicates count once: two callers
    /// that name the same keys in opposite orders never deadlock, one of them gets the
    /// set and the other is told it is taken. A single distinct resource is the same as
    /// [`try_lock`](Self::try_lock). [`extend`](Self::extend), [`unlock`](Self::unlock)
    /// and the layers' renewals act on every key of the lease, each in one script per
    /// node.
    ///
    /// With [`fencing_tokens(true)`](crate::RedlockBuilder::fencing_tokens), the lease has
    /// one fencing token for the set: greater than every earlier token of each of its
    /// keys, and written back to each key's counter.
    ///
    /// On independent plain nodes any keys go together. A Redis Cluster node refuses the
    /// set's script (its keys hash to several slots: `CROSSSLOT`, reported as a node
    /// failure), so take sets on independent nodes.
    ///
    /// # Errors
    ///
    /// As [`try_lock`](Self::try_lock): [`LockError::Taken`] when any key is held by
    /// another holder, with `retry_after` from the longest holder of the set on each
    /// node; [`LockError::NoQuorum`]; [`LockError::TooSlow`]; [`LockError::InvalidKey`]
    /// for an invalid resource, or for none or more than
    /// [`MAX_KEYS_PER_LEASE`](crate::key::MAX_KEYS_PER_LEASE) distinct ones.
    pub async fn try_lock_all<I>(&self, resources: I) -> Result<Lease, LockError>
    where
        I: IntoIterator,
        I::Item: AsRef<str>,
    {
        let keys = self.inner.policy.key_set(resources)?;
        self.acquire_all(keys.into()).await
    }

    /// Like [`try_lock_all`](Self::try_lock_all), retrying up to the retry count after a
    /// random delay when any key is taken or no quorum answered.
    ///
    /// # Errors
    ///
    /// The error of the last attempt, as [`try_lock_all`](Self::try_lock_all).
    pub async fn lock_all<I>(&self, resources: I) -> Result<Lease, LockError>
    where
        I: IntoIterator,
        I::Item: AsRef<str>,
    {
        let keys: Arc<[Arc<str>]> = self.inner.policy.key_set(resources)?.into();
        self.inner
            .policy
            .with_retries(|| self.acquire_all(keys.clone()))
            .await
    }

    /// One attempt on the sorted, distinct `keys`.
    pub(crate) async fn acquire_all(&self, keys: Arc<[Arc<str>]>) -> Result<Lease, LockError> {
        if let [key] = &keys[..] {
            return self.acquire(key.clone(), false).await;
        }
        let token = Token::random();
        let start = Instant::now();
        let mut guard = SetGuard {
            redlock: self,
            keys: &keys,
            token,
            armed: true,
            quorum: false,
        };
        let ttl_ms = self.inner.policy.ttl_ms();
        let fenced = self.inner.fence_ms.is_some();
        let round = self
            .on_nodes(
                |conn| acquire_on(conn, keys.clone(), token, ttl_ms, fenced),
                |attempt| Vote::of(matches!(attempt, Attempt::Set(_))),
                Rule::Contest,
                Stragglers::Drop,
            )
            .await;
        match round.verdict {
            Verdict::Won => {}
            // Released in the background by the guard.
            Verdict::NoQuorum => return Err(self.no_quorum(round)),
            Verdict::Lost => {
                // The nodes that refused set nothing; the others (and those not heard
                // from) are released in the background, so the answer costs one round.
                guard.armed = false;
                self.clean_up_set(&keys, token, &round);
                return Err(LockError::Taken {
                    retry_after: self.set_retry_after(&round),
                });
            }
        }
        guard.quorum = true;
        let fencing_token = match self.inner.fence_ms {
            Some(fence_ms) => {
                let highest = round
                    .values()
                    .filter_map(|a| match a {
                        Attempt::Set(c) => Some(*c),
                        Attempt::Held { .. } => None,
                    })
                    .max()
                    .unwrap_or(0);
                let fencing_token = highest.saturating_add(1);
                let raised = self
                    .on_nodes(
                        |conn| fence_on(conn, keys.clone(), token, fencing_token, fence_ms),
                        |written| Vote::of(*written == 1),
                        Rule::Proof,
                        Stragglers::Finish,
                    )
                    .await;
                match raised.verdict {
                    Verdict::Won => Some(fencing_token),
                    Verdict::Lost => {
                        return Err(LockError::TooSlow {
                            elapsed: start.elapsed(),
                        });
                    }
                    Verdict::NoQuorum => return Err(self.no_quorum(raised)),
                }
            }
            None => None,
        };
        let elapsed = start.elapsed();
        let validity = self
            .validity(elapsed)
            .ok_or(LockError::TooSlow { elapsed })?;
        guard.armed = false;
        Ok(Lease {
            key: keys[0].clone(),
            set: Some(keys.clone()),
            token,
            ttl: self.inner.policy.ttl,
            valid_until: start + validity,
            fencing_token,
            backend: self.inner.id,
        })
    }

    /// How long until enough nodes are free of every holder of the set for a quorum:
    /// nodes where we set the set count as free (it is released), the others free once
    /// their longest holder's key expires.
    fn set_retry_after(&self, round: &Answers<Attempt>) -> Duration {
        let ttl = self.inner.policy.ttl;
        let mut held = Vec::with_capacity(round.answers.len());
        let mut free = 0usize;
        for attempt in round.values() {
            match attempt {
                Attempt::Set(_) => free += 1,
                Attempt::Held { pttl_ms } => {
                    // -1: a key without expiry (not one of ours): count a full TTL.
                    held.push(u64::try_from(*pttl_ms).map_or(ttl, Duration::from_millis));
                }
            }
        }
        let Some(needed) = self.inner.quorum.checked_sub(free).filter(|n| *n > 0) else {
            return Duration::ZERO;
        };
        held.sort_unstable();
        held.get(needed - 1).copied().unwrap_or(ttl)
    }

    /// [`extend`](Self::extend) for a lease on several keys.
    pub(super) async fn extend_all(
        &self,
        lease: &mut Lease,
        keys: Arc<[Arc<str>]>,
    ) -> Result<(), LockError> {
        let start = Instant::now();
        let ttl_ms = self.inner.policy.ttl_ms();
        let fence_ms = self.inner.fence_ms;
        let token = lease.token;
        let round = self
            .on_nodes(
                |conn| extend_on(conn, keys.clone(), token, ttl_ms, fence_ms),
                |reply| Vote::of(*reply == 1),
                Rule::Proof,
                Stragglers::Finish,
            )
            .await;
        match round.verdict {
            Verdict::Won => {
                let elapsed = start.elapsed();
                let validity = self
                    .validity(elapsed)
                    .ok_or(LockError::TooSlow { elapsed })?;
                lease.valid_until = start + validity;
                Ok(())
            }
            Verdict::Lost => Err(LockError::Expired {
                taken_over: round.values().any(|reply| *reply == -1),
            }),
            Verdict::NoQuorum => Err(self.no_quorum(round)),
        }
    }

    /// [`unlock`](Self::unlock) for a lease on several keys.
    pub(super) async fn unlock_all(
        &self,
        keys: Arc<[Arc<str>]>,
        token: Token,
    ) -> Result<(), LockError> {
        let round = self
            .on_nodes(
                |conn| release_on(conn, keys.clone(), token, true),
                super::deleted,
                Rule::Proof,
                Stragglers::Finish,
            )
            .await;
        match round.verdict {
            Verdict::Won => Ok(()),
            Verdict::Lost => Err(LockError::Expired {
                taken_over: round.values().any(|r| matches!(r, Release::HeldByOther)),
            }),
            Verdict::NoQuorum => Err(self.no_quorum(round)),
        }
    }

    /// Deletes a refused attempt's keys, in the background, on the nodes that may have
    /// set them: every node but those that answered "held".
    fn clean_up_set(&self, keys: &Arc<[Arc<str>]>, token: Token, round: &Answers<Attempt>) {
        let keys = keys.clone();
        self.release_where(
            round,
            |attempt| matches!(attempt, Attempt::Held { .. }),
            move |conn| release_on(conn, keys.clone(), token, false),
        );
    }

    /// Releases a set in the background (see
    /// [`release_detached`](Self::release_detached)).
    pub(crate) fn release_all_detached(&self, keys: Arc<[Arc<str>]>, token: Token, publish: bool) {
        match tokio::runtime::Handle::try_current() {
            Ok(handle) => {
                let redlock = self.clone();
                handle.spawn(async move {
                    redlock
                        .on_nodes(
                            |conn| release_on(conn, keys.clone(), token, publish),
                            super::deleted,
                            Rule::Proof,
                            Stragglers::Await,
                        )
                        .await;
                });
            }
            Err(_) => tracing::warn!(
                key = &*keys[0],
                keys = keys.len(),
                "no Tokio runtime to release the locks on; they expire by their TTL"
            ),
        }
    }
}

/// Releases an attempt's keys in the background if dropped armed: before the verdict
/// (the caller's future was dropped), after a refusal, or without validity left.
struct SetGuard<'a> {
    redlock: &'a Redlock,
    keys: &'a Arc<[Arc<str>]>,
    token: Token,
    armed: bool,
    /// Whether a quorum was acquired (the release then wakes marked waiters).
    quorum: bool,
}

impl Drop for SetGuard<'_> {
    fn drop(&mut self) {
        if self.armed {
            self.redlock
                .release_all_detached(self.keys.clone(), self.token, self.quorum);
        }
    }
}
