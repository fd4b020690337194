//! What a lock backend implements, in the storage's terms: the [`LockMode`]s, the prefixed
//! and checked keys of a request ([`Claim`]), and the private [`LockBackend`] trait that
//! [`Locks`](crate::Locks) runs a [`LockRequest`](crate::LockRequest) over.

use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::backend::inspect::LockInspection;
#[cfg(feature = "idempotency")]
use crate::backend::records::{Begin, NewRecord};
use crate::backend::settings::Settings;
use crate::error::LockError;
use crate::future::{BoxFuture, boxed};
use crate::holder::{Holder, HolderRef};
use crate::lease::{Access, Lease};

/// How a lease holds its key.
///
/// The modes of one key work together only as the table says: a plain lease does not see
/// readers, so every writer of a key that has readers takes it [`Exclusive`](Self::Exclusive).
///
/// | mode | holders at once | waits for |
/// | --- | --- | --- |
/// | [`Plain`](Self::Plain) | one | the plain or exclusive holder |
/// | [`Shared`](Self::Shared) | any number of readers | the holder, and any exclusive waiter |
/// | [`Exclusive`](Self::Exclusive) | one | the holder and every reader; keeps new readers out while it waits |
/// | [`Fair`](Self::Fair) | one | the holder and every fair waiter that came first |
///
/// The [lock module docs](crate::lock#modes) give the guarantees and the round trips of each.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum LockMode {
    /// One holder; the cheapest (one `SET NX PX` per node on Redis).
    #[default]
    Plain,
    /// A reader: held together with other readers, never with an exclusive holder. A
    /// reader's lease carries no fencing token.
    Shared,
    /// A writer over readers: one holder, once every reader has left; new readers are
    /// refused while it waits.
    Exclusive,
    /// Plain, with waiters served in arrival order across every process
    /// ([`LockRequest::wait`](crate::LockRequest::wait)); with no wait, it is granted only
    /// when nobody waits.
    Fair,
}

impl LockMode {
    /// The access of a shared or an exclusive (over readers) mode; `None` for the others.
    pub(crate) fn access(self) -> Option<Access> {
        match self {
            Self::Shared => Some(Access::Shared),
            Self::Exclusive => Some(Access::Exclusive),
            Self::Plain | Self::Fair => None,
        }
    }
}

/// The prefixed, checked keys of a request: one in a mode, or a sorted set of distinct
/// keys held plain (the only mode a set takes, so a backend never sees another).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Claim {
    One(OneKey),
    Set(Arc<[Arc<str>]>),
}

/// One key and the mode it is taken in.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct OneKey {
    pub(crate) key: Arc<str>,
    pub(crate) mode: LockMode,
}

impl Claim {
    /// `key` in `mode`.
    pub(crate) fn one(key: Arc<str>, mode: LockMode) -> Self {
        Claim::One(OneKey { key, mode })
    }

    /// The key that names the claim in spans, logs and hold times: the first of a set.
    // A set is built with two keys or more only (`resolve` above, `LockPolicy::decide_all`
    // from the layer's sorted, distinct keys), so it has a first; a reference to the key
    // itself keeps the acquisition path free of a copy.
    #[allow(clippy::indexing_slicing)]
    pub(crate) fn first(&self) -> &Arc<str> {
        match self {
            Claim::One(one) => &one.key,
            Claim::Set(keys) => &keys[0],
        }
    }

    /// Every key of the claim.
    pub(crate) fn keys(&self) -> &[Arc<str>] {
        match self {
            Claim::One(one) => std::slice::from_ref(&one.key),
            Claim::Set(keys) => keys,
        }
    }
}

/// A backend's answer: at once (in process), or a future (over the network).
pub(crate) enum Answer<T> {
    Now(T),
    Later(BoxFuture<T>),
}

impl<T> Answer<T> {
    /// The answer of `make`'s future, built in its box.
    pub(crate) fn later<F>(make: impl FnOnce() -> F) -> Self
    where
        F: Future<Output = T> + Send + 'static,
    {
        Answer::Later(boxed(make))
    }

    pub(crate) async fn get(self) -> T {
        match self {
            Answer::Now(value) => value,
            Answer::Later(future) => future.await,
        }
    }
}

/// What a lock backend does, in the storage's terms: keys are prefixed and checked, and
/// the lock domain (`lock/`: waits, retries, reentrancy, renewal) runs every request
/// through these. The in-process store answers at once ([`Answer::Now`]) wherever it need
/// not wait; Redlock answers with a future.
pub(crate) trait LockBackend: Send + Sync + fmt::Debug + 'static {
    fn settings(&self) -> &Settings;
    /// Which backend instance this is (see `backend::next_backend_id`), so that a lease
    /// can tell which one issued it.
    fn id(&self) -> u64;
    /// Whether this is the in-process store (which overrides this).
    fn in_process(&self) -> bool {
        false
    }
    /// This backend as a Redlock, for the handle's paths that run a Redis future in place
    /// (one attempt, a release): through the trait each future is boxed, and a Redis
    /// one is over glibc's thread cache, so each box costs a trip through its allocator.
    /// `None` in process.
    #[cfg(feature = "redis")]
    fn redlock(&self) -> Option<&crate::backend::redlock::Redlock> {
        None
    }
    /// The prefix put before every key.
    fn prefix(&self) -> &str {
        &self.settings().prefix
    }
    /// One attempt on `claim`, from `started` (a fair one is granted only when nobody
    /// waits). A lease taken records `holder` beside its keys (read only then in process;
    /// sent with the attempt on Redis).
    fn attempt(&self, claim: Claim, started: Instant, holder: HolderRef<'_>) -> Answer<LockResult>;
    /// One key, waiting up to `max_wait`, woken by releases; the lease records `holder`.
    fn wait(&self, one: OneKey, max_wait: Duration, holder: Holder) -> BoxFuture<LockResult>;
    /// The lease extended to a full TTL from now; on error the caller keeps the old one.
    fn extend(&self, lease: Lease) -> Answer<LockResult>;
    fn unlock(&self, lease: Lease) -> Answer<Result<(), LockError>>;
    /// The end of a layer's lease: [`unlock`](Self::unlock) with a failure logged (the keys
    /// left behind expire by their TTL). A release once started must land: the caller
    /// finishes a future it drops before it is done in the background
    /// ([`FinishOnDrop`](crate::future::FinishOnDrop)).
    fn end(&self, lease: &Lease) -> Answer<()>;
    /// Releases without waiting: at once in process, on a spawned task for Redis.
    fn release_detached(&self, lease: &Lease);
    /// The `Retry-After` of a contended `key`, from its hold times and what the holder has
    /// left (see [`HoldTimes`](crate::backend::hold::HoldTimes)).
    fn retry_estimate(&self, key: &str, holder_left: Duration) -> Duration;
    fn inspect(&self, key: Arc<str>) -> Answer<Result<LockInspection, LockError>>;
    /// Whether the store answers now: in process always; on Redis, a quorum of the nodes
    /// answering `PING` within the node timeout.
    fn ready(&self) -> Answer<bool>;
    fn force_unlock(&self, key: Arc<str>) -> Answer<Result<usize, LockError>>;
    /// The idempotency record of `key`, or the lock on `key` when there is none (its
    /// lease recording `holder`); waits up to `wait` for a holder to finish.
    #[cfg(feature = "idempotency")]
    fn begin_idempotent(&self, key: Arc<str>, wait: Duration, holder: HolderRef<'_>) -> Begun;
    /// Stores `record` (when given), and ends the lease as [`end`](Self::end) does; a
    /// record that a quorum did not take is logged.
    #[cfg(feature = "idempotency")]
    fn finish_idempotent(&self, lease: Lease, record: Option<NewRecord>) -> Answer<()>;
}

/// What [`LockBackend::begin_idempotent`] finds.
#[cfg(feature = "idempotency")]
pub(crate) type Begun = Answer<Result<Begin, LockError>>;

pub(crate) type LockResult = Result<Lease, LockError>;
