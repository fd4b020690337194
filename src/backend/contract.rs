//! What a lock backend implements, in the storage's terms: the [`LockMode`]s, the prefixed
//! and checked keys of a request ([`Claim`]), and the private [`LockBackend`] trait that
//! [`Locks`](crate::Locks) runs a [`LockRequest`](crate::LockRequest) over.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use crate::backend::settings::Settings;
use crate::error::LockError;
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

/// Why a set of keys in another mode is refused.
pub(crate) const SET_MODE: &str = "a lease on several keys takes LockMode::Plain only";
/// The prefixed, checked keys of a request: one, or a sorted set of distinct keys.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Claim {
    One(Arc<str>),
    Set(Arc<[Arc<str>]>),
}

impl Claim {
    /// The key that names the claim in spans, logs and hold times: the first of a set.
    // A set is built with two keys or more only (`resolve` above, `LockPolicy::decide_all`
    // from the layer's sorted, distinct keys), so it has a first; a reference to the key
    // itself keeps the acquisition path free of a copy.
    #[allow(clippy::indexing_slicing)]
    pub(crate) fn first(&self) -> &Arc<str> {
        match self {
            Claim::One(key) => key,
            Claim::Set(keys) => &keys[0],
        }
    }

    /// Every key of the claim.
    pub(crate) fn keys(&self) -> &[Arc<str>] {
        match self {
            Claim::One(key) => std::slice::from_ref(key),
            Claim::Set(keys) => keys,
        }
    }
}

/// What a lock backend does, mode by mode, for [`acquire`]: one attempt, and a wait of up
/// to `max_wait` woken by releases. Keys are prefixed and checked.
pub(crate) trait LockBackend: Sync {
    fn policy(&self) -> &Settings;
    /// Which backend instance this is (see `backend::next_backend_id`), so that a lease
    /// can tell which one issued it.
    fn id(&self) -> u64;
    /// The prefix put before every key.
    fn prefix(&self) -> &str {
        &self.policy().prefix
    }
    /// One plain attempt on `key`.
    fn try_one(&self, key: Arc<str>) -> impl Future<Output = LockResult> + Send;
    /// One attempt on every key of a set.
    fn try_all(&self, keys: Arc<[Arc<str>]>) -> impl Future<Output = LockResult> + Send;
    /// `key` in `mode`, waiting up to `max_wait`; a zero `max_wait` is one attempt (a fair
    /// one granted only when nobody waits).
    fn wait(
        &self,
        key: Arc<str>,
        mode: LockMode,
        max_wait: Duration,
    ) -> impl Future<Output = LockResult> + Send;
}

pub(crate) type LockResult = Result<Lease, LockError>;
