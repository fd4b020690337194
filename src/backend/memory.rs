//! The in-process backend: the same contract as [`Redlock`](crate::Redlock), in one
//! process, without Redis.

use std::collections::hash_map::Entry;
use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
#[cfg(feature = "idempotency")]
use std::time::Duration;
use std::time::Instant;

use crate::backend::KeyMap;
use crate::backend::hold::HoldTimes;
#[cfg(feature = "idempotency")]
use crate::backend::records::{
    Begin, DEFAULT_MAX_RECORD_BYTES, DEFAULT_MAX_RECORDS, MemoryRecords, record_key,
};
use crate::backend::settings::{Policy, policy_setters};
use crate::backend::wait::{Waiters, bounded_wait, waits_by_resource};
use crate::error::{ConfigError, LockError};
use crate::lease::{Lease, Token};
use crate::observe::{self, op_span};

mod modes;

mod multi;

/// Locks held in this process's memory, with the same contract as [`Redlock`](crate::Redlock):
/// random tokens, expiry after the TTL, "taken" answers with the time until the holder's
/// lease runs out, and "expired" answers on release and extension.
///
/// It is the embedded default ([`Locks::default`](crate::Locks::default)): for examples, for
/// a service with a single replica, and for testing an application without Redis. It does
/// not lock across processes.
///
/// Cloning is cheap and shares the same locks.
///
/// ```
/// # async fn demo() -> Result<(), tower_redlock::LockError> {
/// use tower_redlock::{LockError, MemoryLocks};
///
/// let locks = MemoryLocks::new();
/// let lease = locks.try_lock("order:42")?;
/// assert!(matches!(locks.try_lock("order:42"), Err(LockError::Taken { .. })));
/// locks.unlock(lease)?;
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct MemoryLocks {
    inner: Arc<Shared>,
}

struct Shared {
    id: u64,
    policy: Policy,
    state: Mutex<State>,
    waiters: Waiters,
    #[cfg(feature = "idempotency")]
    records: MemoryRecords,
}

struct State {
    held: KeyMap<Arc<str>, Held>,
    /// Expired entries are swept when the map grows past this size.
    sweep_at: usize,
    /// The last fencing token issued, for any key.
    fence: u64,
    /// Readers, waiting writers and fair queues, per key.
    modes: modes::Modes,
    /// The hold times of the releases, recorded as they leave `held`.
    holds: HoldTimes,
}

struct Held {
    token: Token,
    expires_at: Instant,
    /// When it was acquired, for the hold times behind `Retry-After`.
    since: Instant,
}

const MIN_SWEEP: usize = 1024;

impl fmt::Debug for MemoryLocks {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemoryLocks")
            .field("ttl", &self.inner.policy.ttl)
            .field("prefix", &self.inner.policy.prefix)
            .field("held", &self.state().held.len())
            .finish()
    }
}

impl Default for MemoryLocks {
    fn default() -> Self {
        Self::new()
    }
}

/// Builds [`MemoryLocks`]; see [`MemoryLocks::builder`].
#[derive(Debug, Default)]
#[must_use]
pub struct MemoryLocksBuilder {
    policy: Policy,
    #[cfg(feature = "idempotency")]
    max_records: Option<(usize, usize)>,
}

impl MemoryLocksBuilder {
    policy_setters!();

    /// Bounds on the idempotency records ([`IdempotencyLayer`](crate::IdempotencyLayer))
    /// kept in process: at most `records` of them, and `bytes` in all (keys and stored
    /// responses). Defaults 10,000 and 64 MiB. When full, expired records go first, then
    /// those closest to their expiry; a record evicted early lets a retry of its request
    /// run again.
    #[cfg(feature = "idempotency")]
    #[cfg_attr(docsrs, doc(cfg(feature = "idempotency")))]
    pub fn max_records(mut self, records: usize, bytes: usize) -> Self {
        self.max_records = Some((records, bytes));
        self
    }

    /// Checks the configuration.
    ///
    /// # Errors
    ///
    /// A [`ConfigError`] for a zero or too long TTL, an empty retry delay range, or a bad
    /// prefix.
    pub fn build(self) -> Result<MemoryLocks, ConfigError> {
        self.policy.validate()?;
        #[cfg(feature = "idempotency")]
        let records = {
            let (records, bytes) = self
                .max_records
                .unwrap_or((DEFAULT_MAX_RECORDS, DEFAULT_MAX_RECORD_BYTES));
            MemoryRecords::new(records, bytes)
        };
        Ok(MemoryLocks::with_policy(
            self.policy,
            #[cfg(feature = "idempotency")]
            records,
        ))
    }
}

impl MemoryLocks {
    /// New, empty locks with the defaults: 10 s TTL, 3 retries 50 to 250 ms apart, prefix
    /// `"tower-redlock:"`.
    pub fn new() -> Self {
        Self::with_policy(
            Policy::default(),
            #[cfg(feature = "idempotency")]
            MemoryRecords::new(DEFAULT_MAX_RECORDS, DEFAULT_MAX_RECORD_BYTES),
        )
    }

    /// A builder to set the TTL, the retries and the prefix.
    pub fn builder() -> MemoryLocksBuilder {
        MemoryLocksBuilder::default()
    }

    fn with_policy(policy: Policy, #[cfg(feature = "idempotency")] records: MemoryRecords) -> Self {
        Self {
            inner: Arc::new(Shared {
                id: crate::backend::next_backend_id(),
                policy,
                state: Mutex::new(State {
                    held: KeyMap::default(),
                    sweep_at: MIN_SWEEP,
                    fence: 0,
                    modes: modes::Modes::default(),
                    holds: HoldTimes::default(),
                }),
                waiters: Waiters::default(),
                #[cfg(feature = "idempotency")]
                records,
            }),
        }
    }

    /// How long a request that found `key` held should wait before trying again (see
    /// [`HoldTimes`]).
    pub(crate) fn retry_estimate(
        &self,
        key: &str,
        holder_left: std::time::Duration,
    ) -> std::time::Duration {
        self.state()
            .holds
            .retry_after(key, self.prefix(), holder_left)
    }

    /// The idempotency records kept with these locks.
    #[cfg(feature = "idempotency")]
    pub(crate) fn records(&self) -> &MemoryRecords {
        &self.inner.records
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
    pub fn ttl(&self) -> std::time::Duration {
        self.inner.policy.ttl
    }

    fn state(&self) -> MutexGuard<'_, State> {
        // No code panics while holding the lock; recover the map if a panic ever did.
        self.inner
            .state
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// One acquisition attempt on `resource` (stored as `{prefix}{resource}`). The lease is
    /// valid for exactly the TTL: there is no clock drift inside one process.
    ///
    /// # Errors
    ///
    /// [`LockError::Taken`] with the holder's remaining TTL, or [`LockError::InvalidKey`].
    pub fn try_lock(&self, resource: &str) -> Result<Lease, LockError> {
        let key = self.inner.policy.full_key(resource)?;
        self.acquire(key)
    }

    pub(crate) fn acquire(&self, key: Arc<str>) -> Result<Lease, LockError> {
        self.acquire_from(key, Instant::now())
    }

    /// [`acquire`](Self::acquire) at `now`, read by the caller just before (the lease then
    /// ends that much earlier: never later than its TTL).
    pub(crate) fn acquire_from(&self, key: Arc<str>, now: Instant) -> Result<Lease, LockError> {
        let span = op_span!("tower_redlock.acquire", &key, self.prefix(), 1);
        observe::traced_now(
            span,
            || self.acquire_in(&mut self.state(), key, now),
            observe::lock_verdict,
        )
    }

    /// [`acquire`](Self::acquire) under the state's lock.
    fn acquire_in(
        &self,
        state: &mut State,
        key: Arc<str>,
        now: Instant,
    ) -> Result<Lease, LockError> {
        let token = Token::random();
        let ttl = self.inner.policy.ttl;
        let expires_at = now + ttl;
        if state.held.len() >= state.sweep_at {
            state.held.retain(|_, held| held.expires_at > now);
            state.sweep_at = (state.held.len() * 2).max(MIN_SWEEP);
        }
        // One hash of the key, whether it is held or not.
        match state.held.entry(key.clone()) {
            Entry::Occupied(mut entry) => {
                let held = entry.get_mut();
                if held.expires_at > now {
                    return Err(LockError::Taken {
                        retry_after: held.expires_at - now,
                    });
                }
                *held = Held {
                    token,
                    expires_at,
                    since: now,
                };
            }
            Entry::Vacant(entry) => {
                entry.insert(Held {
                    token,
                    expires_at,
                    since: now,
                });
            }
        }
        state.fence = state.fence.saturating_add(1);
        Ok(Lease {
            key,
            set: None,
            token,
            ttl,
            valid_until: expires_at,
            fencing_token: Some(state.fence),
            backend: self.inner.id,
        })
    }

    /// Like [`try_lock`](Self::try_lock), retrying up to the retry count after a random
    /// delay while the lock is taken.
    ///
    /// # Errors
    ///
    /// The error of the last attempt.
    pub async fn lock(&self, resource: &str) -> Result<Lease, LockError> {
        let key = self.inner.policy.full_key(resource)?;
        // The only error of an attempt on a valid key is `Taken`.
        self.inner
            .policy
            .with_retries(|| std::future::ready(self.acquire(key.clone())))
            .await
    }

    waits_by_resource! {
        /// Waits up to `max_wait` for the lock when it is held: woken at once when the
        /// holder releases, or when its lease expires. A zero `max_wait` is one attempt.
        ///
        /// # Errors
        ///
        /// [`LockError::Taken`] when it is still held at the deadline, or
        /// [`LockError::InvalidKey`].
        lock_within => lock_key_within();
    }

    /// [`lock_within`](Self::lock_within) for a key that already has the prefix.
    pub(crate) async fn lock_key_within(
        &self,
        key: Arc<str>,
        max_wait: std::time::Duration,
    ) -> Result<Lease, LockError> {
        match self.acquire(key.clone()) {
            Err(LockError::Taken { .. }) if !max_wait.is_zero() => {}
            first => return first,
        }
        let attempt = || std::future::ready(self.acquire(key.clone()));
        bounded_wait(&self.inner.waiters, &key, max_wait, attempt, async {}).await
    }

    /// Extends the lease to a full TTL from now, if it is still held (every key of a lease
    /// on several keys).
    ///
    /// # Errors
    ///
    /// [`LockError::Expired`] when the lease ran out (`taken_over` when someone else holds
    /// the key now); the lease is then left as it was.
    pub fn extend(&self, lease: &mut Lease) -> Result<(), LockError> {
        let span = op_span!("tower_redlock.extend", lease.key(), self.prefix(), 1);
        observe::traced_now(span, || self.extend_untraced(lease), observe::lock_verdict)
    }

    fn extend_untraced(&self, lease: &mut Lease) -> Result<(), LockError> {
        if lease.is_shared() {
            return self.extend_shared(lease);
        }
        if let Some(keys) = lease.set.clone() {
            return self.extend_all(lease, &keys);
        }
        let now = Instant::now();
        let mut state = self.state();
        match state.held.get_mut(&lease.key) {
            Some(held) if held.token == lease.token && held.expires_at > now => {
                held.expires_at = now + self.inner.policy.ttl;
                lease.valid_until = held.expires_at;
                Ok(())
            }
            Some(held) => Err(LockError::Expired {
                taken_over: held.token != lease.token && held.expires_at > now,
            }),
            None => Err(LockError::Expired { taken_over: false }),
        }
    }

    /// Releases the lease (every key of a lease on several keys that still holds its
    /// token).
    ///
    /// # Errors
    ///
    /// [`LockError::Expired`] when it had already run out (`taken_over` when someone else
    /// holds the key now). Another holder's lock is never touched.
    pub fn unlock(&self, lease: Lease) -> Result<(), LockError> {
        let span = op_span!("tower_redlock.release", lease.key(), self.prefix(), 1);
        observe::traced_now(span, || self.unlock_untraced(lease), observe::lock_verdict)
    }

    fn unlock_untraced(&self, lease: Lease) -> Result<(), LockError> {
        if lease.is_shared() {
            return self.unlock_shared(&lease);
        }
        if let Some(keys) = &lease.set {
            return self.unlock_all(&lease, keys);
        }
        let now = Instant::now();
        let mut state = self.state();
        // One hash of the key: look and remove through the same entry.
        let Entry::Occupied(entry) = state.held.entry(lease.key.clone()) else {
            return Err(LockError::Expired { taken_over: false });
        };
        let held = entry.get();
        if held.token != lease.token {
            return Err(LockError::Expired {
                taken_over: held.expires_at > now,
            });
        }
        let expired = held.expires_at <= now;
        let since = held.since;
        entry.remove();
        if !expired {
            let held = now.saturating_duration_since(since);
            state.holds.record(&lease.key, self.prefix(), held);
        }
        drop(state);
        self.inner.waiters.wake(&lease.key);
        if expired {
            Err(LockError::Expired { taken_over: false })
        } else {
            Ok(())
        }
    }
}

/// Idempotency records in process, beside the locks.
#[cfg(feature = "idempotency")]
impl MemoryLocks {
    /// The record of `key`, or the lock on `key` when there is none; at once.
    pub(crate) fn begin_idempotent(&self, key: Arc<str>) -> Result<Begin, LockError> {
        let record_key = record_key(&key);
        if let Some(raw) = self.records().get(&record_key) {
            return Ok(Begin::Found(raw));
        }
        let lease = self.acquire(key)?;
        Ok(self.recheck(lease, &record_key))
    }

    /// [`begin_idempotent`](Self::begin_idempotent), waiting up to `max_wait` for a holder
    /// to finish.
    pub(crate) async fn begin_idempotent_within(
        &self,
        key: Arc<str>,
        max_wait: Duration,
    ) -> Result<Begin, LockError> {
        let record_key = record_key(&key);
        if let Some(raw) = self.records().get(&record_key) {
            return Ok(Begin::Found(raw));
        }
        let lease = self.lock_key_within(key, max_wait).await?;
        Ok(self.recheck(lease, &record_key))
    }

    /// Looks again under the lock: a holder may have stored its record and released
    /// between the first look and the acquisition.
    fn recheck(&self, lease: Lease, record_key: &str) -> Begin {
        match self.records().get(record_key) {
            Some(raw) => {
                let _ = self.unlock(lease);
                Begin::Found(raw)
            }
            None => Begin::Acquired(lease),
        }
    }

    /// Stores `record` for `ttl` while the lease is valid, then releases the lease.
    pub(crate) fn finish_idempotent(
        &self,
        lease: Lease,
        record: Option<bytes::Bytes>,
        ttl: Duration,
    ) {
        if let Some(raw) = record.filter(|_| lease.is_valid()) {
            self.records().insert(record_key(lease.key()), raw, ttl);
        }
        let _ = self.unlock(lease);
    }
}
