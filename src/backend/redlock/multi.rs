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
//! Keys on one plain Redis node need no common hash slot. A Redis Cluster would refuse a
//! script over keys of several slots (`CROSSSLOT`): there the keys of one set must share a
//! slot (a common hash tag in the resource names).

use std::sync::{Arc, LazyLock};
use std::time::{Duration, Instant};

use redis::Script;

use super::Redlock;
use super::round::{Answers, Stragglers};
use super::scripts::{Aux, COUNTER_VALID, Release, evalsha, run};
use super::tally::{Rule, Verdict, Vote};
use crate::backend::connection::Connection;
use crate::error::{LockError, NodeFailureReason};
use crate::lease::{Lease, Token};

/// Takes every key of the set, or none. KEYS: the N lock keys, then (fenced) their N
/// fencing counters. ARGV: the token, the TTL in ms, N, `1` when fenced.
///
/// Returns `{1, c}` when every key is set (`c`: the highest fencing counter of the set, 0
/// unset or unfenced), `{0, pttl}` when any key is held, with nothing set (`pttl`: the
/// longest remaining TTL of the held keys in ms, -1 when one has no expiry), `{-2, i}`
/// with nothing set when the counter of the `i`-th key is not an integer below 2^53.
static ACQUIRE_ALL: LazyLock<Script> = LazyLock::new(|| {
    Script::new(&format!(
        r"
local n = tonumber(ARGV[3])
local held, longest = false, 0
for i = 1, n do
  local p = redis.call('PTTL', KEYS[i])
  if p == -1 then
    held, longest = true, -1
  elseif p >= 0 then
    held = true
    if longest ~= -1 and p > longest then longest = p end
  end
end
if held then
  return {{0, longest}}
end
local top = 0
if ARGV[4] == '1' then
  for i = 1, n do
    local c = redis.pcall('GET', KEYS[n + i])
    if not {COUNTER_VALID} then
      return {{-2, i}}
    end
    if c and tonumber(c) > top then top = tonumber(c) end
  end
end
for i = 1, n do
  redis.call('SET', KEYS[i], ARGV[1], 'PX', ARGV[2])
end
return {{1, top}}
"
    ))
});

/// Raises every fencing counter of the set (KEYS[N+1..2N]) to ARGV[2], with the expiry
/// ARGV[3] ms, while every lock key (KEYS[1..N]) holds our token ARGV[1]; N is ARGV[4].
///
/// Returns 1 when done, 0 when a key does not hold the token, -2 when a counter is not an
/// integer below 2^53 (nothing written).
static FENCE_ALL: LazyLock<Script> = LazyLock::new(|| {
    Script::new(&format!(
        r"
local n = tonumber(ARGV[4])
for i = 1, n do
  if redis.pcall('GET', KEYS[i]) ~= ARGV[1] then return 0 end
end
for i = 1, n do
  local c = redis.pcall('GET', KEYS[n + i])
  if not {COUNTER_VALID} then return -2 end
end
for i = 1, n do
  local c = redis.call('GET', KEYS[n + i])
  if tonumber(c or '0') < tonumber(ARGV[2]) then
    redis.call('SET', KEYS[n + i], ARGV[2], 'PX', ARGV[3])
  else
    redis.call('PEXPIRE', KEYS[n + i], ARGV[3])
  end
end
return 1
"
    ))
});

/// Sets a new TTL (ARGV[2] ms) on every lock key KEYS[1..N] (N = ARGV[3]) if every one
/// of them holds our token ARGV[1]; fenced, refreshes the valid counters KEYS[N+1..2N]
/// to ARGV[4] ms as well.
///
/// Returns 1 when extended, -1 when a key holds anything else (nothing extended), 0 when
/// a key is gone and none is held by another (nothing extended).
static EXTEND_ALL: LazyLock<Script> = LazyLock::new(|| {
    Script::new(&format!(
        r"
local n = tonumber(ARGV[3])
local gone = false
for i = 1, n do
  local v = redis.pcall('GET', KEYS[i])
  if not v then
    gone = true
  elseif v ~= ARGV[1] then
    return -1
  end
end
if gone then return 0 end
for i = 1, n do
  redis.call('PEXPIRE', KEYS[i], ARGV[2])
end
if #KEYS > n then
  for i = 1, n do
    local c = redis.pcall('GET', KEYS[n + i])
    if c and {COUNTER_VALID} then
      redis.call('PEXPIRE', KEYS[n + i], ARGV[4])
    end
  end
end
return 1
"
    ))
});

/// Deletes every lock key KEYS[1..N] (N = ARGV[3]) that holds our token ARGV[1]; when
/// ARGV[2] is `1`, wakes the waiters that marked a deleted key (KEYS[N+i], as the
/// single-key release does).
///
/// Returns 1 when every key was deleted, 0 when some were gone and none held by another,
/// and `-3 - pttl` when any holds anything else (`pttl`: the longest remaining TTL among
/// those, -1 when one has no expiry).
static RELEASE_ALL: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"
local n = tonumber(ARGV[3])
local deleted, other, longest = 0, false, 0
for i = 1, n do
  local v = redis.pcall('GET', KEYS[i])
  if v == ARGV[1] then
    redis.call('DEL', KEYS[i])
    deleted = deleted + 1
    if ARGV[2] == '1' and redis.call('DEL', KEYS[n + i]) == 1 then
      redis.call('PUBLISH', '{' .. KEYS[i] .. '}:released', '')
    end
  elseif v then
    other = true
    local p = redis.call('PTTL', KEYS[i])
    if p == -1 then
      longest = -1
    elseif longest ~= -1 and p > longest then
      longest = p
    end
  end
end
if other then return -3 - longest end
if deleted == n then return 1 end
return 0
",
    )
});

/// One node's answer to an attempt on a set.
enum Attempt {
    /// Every key is ours; the highest fencing counter of the set (0 unfenced).
    Set(u64),
    /// A key is held; the longest remaining TTL among the holders, in ms (-1: no expiry).
    Held { pttl_ms: i64 },
}

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
    /// On a Redis Cluster node the keys of one set must share a hash slot (Redis refuses
    /// a script over several slots with `CROSSSLOT`, which this reports as a node
    /// failure); on independent plain nodes, as here, any keys go together.
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
                // The nodes that refused set nothing; the guard releases the others (and
                // those not heard from) in the background, so the answer costs one round.
                guard.armed = !round
                    .answers
                    .iter()
                    .all(|answer| matches!(answer, Some(Ok(Attempt::Held { .. }))));
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
                taken_over: round
                    .values()
                    .any(|r| matches!(r, Release::HeldByOther { .. })),
            }),
            Verdict::NoQuorum => Err(self.no_quorum(round)),
        }
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

/// Which auxiliary key of each lock key a script also gets.
#[derive(Clone, Copy)]
enum Beside {
    Fence,
    Waiters,
}

/// The lock keys, then one auxiliary key per lock key.
fn set_command(script: &Script, keys: &[Arc<str>], beside: Option<Beside>) -> redis::Cmd {
    let mut cmd = evalsha(script, keys.len() * if beside.is_some() { 2 } else { 1 });
    for key in keys {
        cmd.arg(&**key);
    }
    for key in keys {
        match beside {
            Some(Beside::Fence) => cmd.arg(Aux::fence(key)),
            Some(Beside::Waiters) => cmd.arg(Aux::waiters(key)),
            None => break,
        };
    }
    cmd
}

async fn acquire_on(
    mut conn: Connection,
    keys: Arc<[Arc<str>]>,
    token: Token,
    ttl_ms: u64,
    fenced: bool,
) -> Result<Attempt, NodeFailureReason> {
    let mut cmd = set_command(&ACQUIRE_ALL, &keys, fenced.then_some(Beside::Fence));
    cmd.arg(token.as_bytes())
        .arg(ttl_ms)
        .arg(keys.len())
        .arg(if fenced { "1" } else { "0" });
    let reply: (i64, i64) = run(&mut conn, &ACQUIRE_ALL, &cmd).await?;
    match reply {
        (1, counter) => Ok(Attempt::Set(u64::try_from(counter).unwrap_or(0))),
        (0, pttl_ms) => Ok(Attempt::Held { pttl_ms }),
        (_, index) => {
            let key = usize::try_from(index - 1)
                .ok()
                .and_then(|i| keys.get(i))
                .unwrap_or(&keys[0]);
            Err(NodeFailureReason::InvalidFencingCounter {
                key: Aux::fence(key).to_string(),
            })
        }
    }
}

async fn fence_on(
    mut conn: Connection,
    keys: Arc<[Arc<str>]>,
    token: Token,
    fencing_token: u64,
    fence_ms: u64,
) -> Result<i64, NodeFailureReason> {
    let mut cmd = set_command(&FENCE_ALL, &keys, Some(Beside::Fence));
    cmd.arg(token.as_bytes())
        .arg(fencing_token)
        .arg(fence_ms)
        .arg(keys.len());
    let reply = run(&mut conn, &FENCE_ALL, &cmd).await?;
    if reply == -2 {
        return Err(NodeFailureReason::InvalidFencingCounter {
            key: Aux::fence(&keys[0]).to_string(),
        });
    }
    Ok(reply)
}

async fn extend_on(
    mut conn: Connection,
    keys: Arc<[Arc<str>]>,
    token: Token,
    ttl_ms: u64,
    fence_ms: Option<u64>,
) -> Result<i64, NodeFailureReason> {
    let beside = fence_ms.map(|_| Beside::Fence);
    let mut cmd = set_command(&EXTEND_ALL, &keys, beside);
    cmd.arg(token.as_bytes()).arg(ttl_ms).arg(keys.len());
    if let Some(fence_ms) = fence_ms {
        cmd.arg(fence_ms);
    }
    Ok(run(&mut conn, &EXTEND_ALL, &cmd).await?)
}

async fn release_on(
    mut conn: Connection,
    keys: Arc<[Arc<str>]>,
    token: Token,
    publish: bool,
) -> Result<Release, NodeFailureReason> {
    let mut cmd = set_command(&RELEASE_ALL, &keys, Some(Beside::Waiters));
    cmd.arg(token.as_bytes())
        .arg(if publish { "1" } else { "0" })
        .arg(keys.len());
    let code: i64 = run(&mut conn, &RELEASE_ALL, &cmd).await?;
    Ok(match code {
        1 => Release::Deleted,
        0 => Release::Absent,
        _ => Release::HeldByOther {
            pttl_ms: (-3i64).saturating_sub(code),
        },
    })
}
