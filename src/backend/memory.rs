//! The in-process backend: the same contract as [`Redlock`](crate::Redlock), in one
//! process, without Redis.

use std::collections::hash_map::Entry;
use std::fmt;
use std::num::NonZeroU64;
use std::sync::{Arc, PoisonError};
use std::time::{Duration, Instant};

use crate::backend::KeyMap;
use crate::backend::contract::{LockBackend as _, LockResult};
use crate::backend::hold::HoldTimes;
use crate::backend::inspect::LockInspection;
#[cfg(feature = "idempotency")]
use crate::backend::records::{
    DEFAULT_MAX_RECORD_BYTES, DEFAULT_MAX_RECORDS, DEFAULT_MAX_RECORDS_PER_PRINCIPAL, MemoryRecords,
};
use crate::backend::settings::{Settings, policy_setters};
use crate::backend::wait::Waiters;
use crate::error::{ConfigError, LockError};
use crate::holder::{Holder, HolderRef, LockHolder};
use crate::lease::{Lease, Shape, Token};
use crate::observe::{self, op_span};
use crate::sync::{Mutex, MutexGuard};

mod contract;
#[cfg(feature = "idempotency")]
mod idempotency;
mod modes;
mod multi;

/// Locks held in this process's memory, with the same contract as [`Redlock`](crate::Redlock):
/// random tokens, expiry after the TTL, "taken" answers with the time until the holder's
/// lease runs out, and "expired" answers on release and extension.
///
/// It is the embedded default ([`Locks::default`](crate::Locks::default)): for examples, for
/// a service with a single replica, and for testing an application without Redis. It does
/// not lock across processes. Chosen (`Locks::from(MemoryLocks::new())`), it works in any
/// process; the default one is refused in a process that built a `Redlock`.
///
/// Cloning is cheap and shares the same locks.
///
/// ```
/// # async fn demo() -> Result<(), tower_redlock::LockError> {
/// use tower_redlock::{LockError, Locks, MemoryLocks};
///
/// let locks = Locks::from(MemoryLocks::new());
/// let lease = locks.try_lock("order:42").await?;
/// assert!(matches!(locks.try_lock("order:42").await, Err(LockError::Taken { .. })));
/// locks.unlock(lease).await?;
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct MemoryLocks {
    inner: Arc<MemoryCore>,
}

struct MemoryCore {
    id: u64,
    policy: Settings,
    state: Mutex<Table>,
    waiters: Waiters,
    #[cfg(feature = "idempotency")]
    records: MemoryRecords,
}

struct Table {
    /// One entry per key that is held, has readers or has waiters.
    keys: KeyMap<Arc<str>, KeyState>,
    /// Expired entries are swept when the map grows past this size.
    sweep_at: usize,
    /// The last fencing token issued, for any key.
    fence: u64,
    /// The hold times of the releases, recorded as holders leave.
    holds: HoldTimes,
}

/// Everything on one key: its exclusive holder, and its readers and waiters.
#[derive(Default)]
struct KeyState {
    /// A plain lock, a writer or a member of a set: the model of the Redis lock key. It
    /// may have expired (swept later).
    holder: Option<HeldKey>,
    /// Readers, waiting writers and the fair queue, only on keys taken in those modes.
    modes: Option<Box<modes::KeyModes>>,
}

struct HeldKey {
    token: Token,
    expires_at: Instant,
    /// When it was acquired, for the hold times behind `Retry-After`.
    since: Instant,
    /// Who took it, for `inspect` (turned into text only there).
    holder: Holder,
}

impl HeldKey {
    /// How long it is still held at `now`, if it is.
    fn left(&self, now: Instant) -> Option<Duration> {
        (self.expires_at > now).then(|| self.expires_at - now)
    }
}

const MIN_SWEEP: usize = 1024;

impl Table {
    /// Drops expired holders, readers and waiters, and the keys left with none, once the
    /// map has grown past [`sweep_at`](Self::sweep_at).
    fn sweep(&mut self, now: Instant) {
        if self.keys.len() >= self.sweep_at {
            self.keys.retain(|_, state| {
                state.holder = state.holder.take().filter(|h| h.expires_at > now);
                modes::prune(&mut state.modes, now);
                state.holder.is_some() || state.modes.is_some()
            });
            self.sweep_at = (self.keys.len() * 2).max(MIN_SWEEP);
        }
    }

    /// How long the exclusive holder of `key` still holds it, if it does.
    fn held_for(&self, key: &str, now: Instant) -> Option<Duration> {
        self.keys.get(key)?.holder.as_ref()?.left(now)
    }

    /// Removes the holder of `key`, and the key when nothing else is left on it.
    fn let_go(&mut self, key: &str) {
        if let Some(state) = self.keys.get_mut(key) {
            state.holder = None;
            if state.modes.is_none() {
                self.keys.remove(key);
            }
        }
    }
}

impl fmt::Debug for MemoryLocks {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemoryLocks")
            .field("ttl", &self.inner.policy.ttl)
            .field("prefix", &self.inner.policy.prefix)
            .field("keys", &self.state().keys.len())
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
    policy: Settings,
    #[cfg(feature = "idempotency")]
    max_records: Option<(usize, usize)>,
    #[cfg(feature = "idempotency")]
    max_records_per_principal: Option<usize>,
}

impl MemoryLocksBuilder {
    policy_setters!();

    /// The replica id each lease records as its holder's, for
    /// [`Locks::inspect`](crate::Locks::inspect) to name ([`LockHolder`]): say, the pod's
    /// name. Default `<hostname>-<pid>`, read once per process (see
    /// [`RedlockBuilder::replica_id`](crate::RedlockBuilder::replica_id)). Bytes outside
    /// printable ASCII, spaces included, become `_`, and it is cut to 64 bytes.
    pub fn replica_id(mut self, id: impl AsRef<str>) -> Self {
        self.policy.replica = crate::holder::replica_id(id.as_ref());
        self
    }

    /// Bounds on the idempotency records ([`IdempotencyLayer`](crate::IdempotencyLayer))
    /// kept in process: at most `records` of them, and `bytes` in all (keys and stored
    /// responses). Defaults 10,000 and 64 MiB. When full, expired records go first, then
    /// the oldest record of the principal seen last (see
    /// [`max_records_per_principal`](Self::max_records_per_principal)), so that a flood
    /// evicts its own records, never those stored before it began; a record evicted
    /// early lets a retry of its request run again.
    #[cfg(feature = "idempotency")]
    #[cfg_attr(docsrs, doc(cfg(feature = "idempotency")))]
    pub fn max_records(mut self, records: usize, bytes: usize) -> Self {
        self.max_records = Some((records, bytes));
        self
    }

    /// The most idempotency records kept in process for one principal (the caller's
    /// credentials, or its tenant: see
    /// [`IdempotencyLayer::credential_headers`](crate::IdempotencyLayer::credential_headers)).
    /// Default 1,000. A principal at this bound gives up its own oldest record for a new
    /// one, so that one caller's requests cannot evict another's. Every anonymous caller
    /// is one principal.
    #[cfg(feature = "idempotency")]
    #[cfg_attr(docsrs, doc(cfg(feature = "idempotency")))]
    pub fn max_records_per_principal(mut self, records: usize) -> Self {
        self.max_records_per_principal = Some(records);
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
        let (records, bytes) = self
            .max_records
            .unwrap_or((DEFAULT_MAX_RECORDS, DEFAULT_MAX_RECORD_BYTES));
        let table = Table {
            keys: KeyMap::default(),
            sweep_at: MIN_SWEEP,
            fence: 0,
            holds: HoldTimes::default(),
        };
        Ok(MemoryLocks {
            inner: Arc::new(MemoryCore {
                id: crate::backend::next_backend_id(),
                policy: self.policy,
                state: Mutex::new(table),
                waiters: Waiters::default(),
                #[cfg(feature = "idempotency")]
                records: MemoryRecords::new(
                    records,
                    self.max_records_per_principal
                        .unwrap_or(DEFAULT_MAX_RECORDS_PER_PRINCIPAL),
                    bytes,
                ),
            }),
        })
    }
}

impl MemoryLocks {
    /// New, empty locks with the defaults: 10 s TTL, 3 retries 50 to 250 ms apart, prefix
    /// `"tower-redlock:"`.
    // The defaults pass `validate` (every test that builds `MemoryLocks::new()` shows it).
    #[allow(clippy::expect_used)]
    pub fn new() -> Self {
        Self::builder()
            .build()
            .expect("the default settings are valid")
    }

    /// A builder to set the TTL, the retries and the prefix.
    pub fn builder() -> MemoryLocksBuilder {
        MemoryLocksBuilder::default()
    }

    /// The idempotency records kept with these locks.
    #[cfg(feature = "idempotency")]
    pub(crate) fn records(&self) -> &MemoryRecords {
        &self.inner.records
    }

    fn state(&self) -> MutexGuard<'_, Table> {
        // No code panics while holding the lock; recover the map if a panic ever did.
        self.inner
            .state
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// One attempt on `key` by a direct call (its lease records the replica only).
    #[cfg(test)]
    pub(crate) fn acquire(&self, key: Arc<str>) -> LockResult {
        self.acquire_from(key, Instant::now(), HolderRef::Direct)
    }

    /// [`acquire`](Self::acquire) at `now`, read by the caller just before (the lease then
    /// ends that much earlier: never later than its TTL), for `holder`.
    pub(crate) fn acquire_from(
        &self,
        key: Arc<str>,
        now: Instant,
        holder: HolderRef<'_>,
    ) -> LockResult {
        let span = op_span!("tower_redlock.acquire", &key, self.prefix(), 1);
        observe::traced_now(
            span,
            || self.acquire_in(&mut self.state(), key, now, holder),
            observe::lock_verdict,
        )
    }

    /// [`acquire_from`](Self::acquire_from) under the state's lock; `holder` is read only
    /// when the key is taken.
    fn acquire_in(
        &self,
        state: &mut Table,
        key: Arc<str>,
        now: Instant,
        holder: HolderRef<'_>,
    ) -> LockResult {
        let token = Token::unique();
        let expires_at = now + self.inner.policy.ttl;
        state.sweep(now);
        // One hash of the key, whether it is held or not.
        let current = &mut state.keys.entry(key.clone()).or_default().holder;
        if let Some(retry_after) = current.as_ref().and_then(|h| h.left(now)) {
            return Err(LockError::Taken { retry_after });
        }
        *current = Some(HeldKey {
            token,
            expires_at,
            since: now,
            holder: holder.to_holder(),
        });
        Ok(self.lease(state, key, Shape::Lock, token, expires_at))
    }

    /// The exclusive lease of an acquisition that just set `key` (or every key of `set`)
    /// to `token`; with the next fencing token when they are on.
    fn lease(
        &self,
        state: &mut Table,
        key: Arc<str>,
        shape: Shape,
        token: Token,
        valid_until: Instant,
    ) -> Lease {
        state.fence = state.fence.saturating_add(1);
        Lease {
            key,
            shape,
            token,
            ttl: self.inner.policy.ttl,
            valid_until,
            fencing_token: NonZeroU64::new(state.fence).filter(|_| self.inner.policy.fencing),
            backend: self.inner.id,
            reentered: false,
        }
    }

    /// [`Locks::extend`](crate::Locks::extend) in process: never `NoQuorum` or `TooSlow`.
    pub(crate) fn extend_lease(&self, lease: &mut Lease) -> Result<(), LockError> {
        let span = op_span!("tower_redlock.extend", lease.key(), self.prefix(), 1);
        observe::traced_now(span, || self.extend_untraced(lease), observe::lock_verdict)
    }

    fn extend_untraced(&self, lease: &mut Lease) -> Result<(), LockError> {
        match &lease.shape {
            Shape::Reader { .. } => self.extend_shared(lease),
            Shape::Set(keys) => {
                let keys = keys.clone();
                self.extend_all(lease, &keys)
            }
            Shape::Lock => {
                let key = lease.key.clone();
                self.extend_all(lease, std::slice::from_ref(&key))
            }
        }
    }

    /// [`Locks::unlock`](crate::Locks::unlock) in process: never `NoQuorum`.
    pub(crate) fn release(&self, lease: &Lease) -> Result<(), LockError> {
        let span = op_span!("tower_redlock.release", lease.key(), self.prefix(), 1);
        observe::traced_now(span, || self.unlock_untraced(lease), observe::lock_verdict)
    }

    fn unlock_untraced(&self, lease: &Lease) -> Result<(), LockError> {
        if lease.is_shared() {
            return self.unlock_shared(lease);
        }
        if let Shape::Set(keys) = &lease.shape {
            return self.unlock_all(lease, keys);
        }
        let now = Instant::now();
        let mut state = self.state();
        // One hash of the key: look and remove through the same entry.
        let Entry::Occupied(mut entry) = state.keys.entry(lease.key.clone()) else {
            return Err(LockError::Expired { taken_over: false });
        };
        let key_state = entry.get_mut();
        let since = match &key_state.holder {
            Some(held) if held.token == lease.token => held.since,
            Some(held) => {
                return Err(LockError::Expired {
                    taken_over: held.expires_at > now,
                });
            }
            None => return Err(LockError::Expired { taken_over: false }),
        };
        let expired = key_state.holder.take().is_some_and(|h| h.expires_at <= now);
        if key_state.modes.is_none() {
            entry.remove();
        }
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

    /// [`Locks::inspect`](crate::Locks::inspect) for a full key.
    pub(crate) fn inspect_key(&self, key: &str) -> LockInspection {
        let now = Instant::now();
        let state = self.state();
        let entry = state.keys.get(key);
        let held = entry
            .and_then(|k| k.holder.as_ref())
            .filter(|h| h.expires_at > now);
        let remaining = held.and_then(|h| h.left(now));
        let holder = held.map(|h| LockHolder::parse(&h.holder.encode(&self.inner.policy.replica)));
        let modes = entry.and_then(|k| k.modes.as_deref());
        LockInspection {
            key: key.to_owned(),
            nodes_answered: 1,
            nodes_holding: usize::from(remaining.is_some()),
            quorum: 1,
            remaining,
            fencing_token: None,
            readers: modes.map_or(0, |m| m.live_readers(now)),
            waiters: modes.is_some_and(|m| m.has_waiters()) || self.inner.waiters.is_waited(key),
            holder,
        }
    }

    /// [`Locks::force_unlock`](crate::Locks::force_unlock) for a full key: 1 when it was
    /// held.
    pub(crate) fn force_unlock_key(&self, key: &str) -> usize {
        let now = Instant::now();
        let mut state = self.state();
        let held = state
            .keys
            .get(key)
            .and_then(|k| k.holder.as_ref())
            .is_some_and(|h| h.expires_at > now);
        state.let_go(key);
        drop(state);
        self.inner.waiters.wake(key);
        usize::from(held)
    }
}

#[cfg(test)]
mod tests;
