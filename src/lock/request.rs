//! [`LockRequest`]: what to take, as data; [`Locks::acquire`](crate::Locks::acquire) runs it.

use std::borrow::Cow;
#[cfg(feature = "redis")]
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::backend::contract::{Answer, Claim, LockBackend, LockMode, LockResult};
#[cfg(feature = "redis")]
use crate::backend::redlock::Redlock;
use crate::backend::settings::Settings;
use crate::error::LockError;
use crate::future::BoxFuture;
use crate::holder::{Holder, HolderRef};

/// How long an acquisition waits for a held lock.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) enum Wait {
    /// One attempt.
    #[default]
    Once,
    /// The backend's retries: up to its retry count, after a random delay each.
    Retries,
    /// Woken when the holder releases, up to this long.
    Within(Duration),
}

impl Wait {
    /// A wait of up to `max_wait`; zero is one attempt.
    pub(crate) fn up_to(max_wait: Duration) -> Self {
        if max_wait.is_zero() {
            Wait::Once
        } else {
            Wait::Within(max_wait)
        }
    }
}

/// How to take a lock: the mode and the wait. `Copy`, so that a layer keeps one and uses
/// it for every request.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Options {
    pub(crate) mode: LockMode,
    pub(crate) wait: Wait,
}

/// What to lock: the resource or resources, the [mode](LockMode), and how long to wait.
/// Build one, then hand it to [`Locks::acquire`](crate::Locks::acquire) or
/// [`Locks::with_lock`](crate::Locks::with_lock); it can be kept and used again.
///
/// Defaults: one attempt, [`LockMode::Plain`]. A resource is stored as
/// `{prefix}{resource}` (see [`Locks::prefix`](crate::Locks::prefix)).
///
/// ```
/// # async fn demo() -> Result<(), tower_redlock::LockError> {
/// use std::time::{Duration, Instant};
/// use tower_redlock::{LockMode, LockRequest, Locks};
///
/// let locks = Locks::default();
/// // A reader that waits up to 2 s for a writer to finish.
/// let report = LockRequest::new("ledger").mode(LockMode::Shared).wait(Duration::from_secs(2));
/// let lease = locks.acquire(&report).await?;
/// locks.unlock(lease).await?;
///
/// // Both accounts of a transfer, all or none, whichever way round they are named.
/// let both = locks.acquire(&LockRequest::all(["account:bob", "account:alice"])).await?;
/// assert_eq!(both.keys().count(), 2);
/// locks.unlock(both).await?;
/// # Ok(()) }
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
#[must_use]
pub struct LockRequest<'a> {
    resources: Resources<'a>,
    options: Options,
}

#[derive(Clone, Debug, PartialEq, Eq)]
enum Resources<'a> {
    One(Cow<'a, str>),
    All(Vec<Cow<'a, str>>),
}

impl<'a> LockRequest<'a> {
    /// A request for one resource.
    pub fn new(resource: impl Into<Cow<'a, str>>) -> Self {
        Self {
            resources: Resources::One(resource.into()),
            options: Options::default(),
        }
    }

    /// A request for every resource of `resources` at once, with one lease: a
    /// [`LockAllRequest`].
    pub fn all<I>(resources: I) -> LockAllRequest<'a>
    where
        I: IntoIterator,
        I::Item: Into<Cow<'a, str>>,
    {
        LockAllRequest {
            resources: resources.into_iter().map(Into::into).collect(),
            wait: Wait::Once,
        }
    }

    /// The mode; default [`LockMode::Plain`].
    pub fn mode(mut self, mode: LockMode) -> Self {
        self.options.mode = mode;
        self
    }

    /// Waits up to `max_wait` while the lock is held: woken at once when the holder
    /// releases (on Redis through pub/sub, see the [lock module docs](crate::lock#waiting)),
    /// else on a fallback timer (the holder's remaining TTL, at most 1 s). Zero is one
    /// attempt, the default. An attempt in flight at the deadline runs to its end
    /// (bounded by the node timeout on Redis).
    pub fn wait(mut self, max_wait: Duration) -> Self {
        self.options.wait = Wait::up_to(max_wait);
        self
    }

    /// Tries again while the lock is held or no quorum answered, up to the backend's retry
    /// count, after a random delay from its retry delay range each time (the Redlock
    /// algorithm's retry; defaults 3 retries, 50 to 250 ms apart).
    pub fn retry(mut self) -> Self {
        self.options.wait = Wait::Retries;
        self
    }

    /// The keys to take, prefixed and checked, with the options.
    pub(crate) fn resolve(&self, policy: &Settings) -> Result<(Claim, Options), LockError> {
        let claim = match &self.resources {
            Resources::One(resource) => Claim::one(policy.full_key(resource)?, self.options.mode),
            Resources::All(resources) => {
                let mut keys = policy.key_set(resources)?;
                if keys.len() == 1 {
                    Claim::one(keys.swap_remove(0), self.options.mode)
                } else if self.options.mode != LockMode::Plain {
                    // What no backend does: a set in another mode than plain, or waiting
                    // (only for a `LockAllRequest` turned into a `LockRequest` by hand).
                    return Err(LockError::Unsupported(SET_MODE));
                } else if let Wait::Within(_) = self.options.wait {
                    return Err(LockError::Unsupported(SET_WAIT));
                } else {
                    Claim::Set(keys.into())
                }
            }
        };
        Ok((claim, self.options))
    }
}

/// Several resources taken at once with one lease: all of them or none, one token, one
/// validity and, on Redis, one quorum verdict for the set. The order does not matter (they
/// are sorted, duplicates dropped), so two callers that name the same keys in opposite
/// orders never deadlock. One distinct resource is a plain request for it.
/// [`Lease::keys`](crate::Lease::keys) lists what is held. Built with
/// [`LockRequest::all`]; [`Locks::acquire`](crate::Locks::acquire) takes it.
///
/// A set is held in [`LockMode::Plain`] and waits with [`retry`](Self::retry) only: it has
/// no mode and no wait to set.
#[derive(Clone, Debug, PartialEq, Eq)]
#[must_use]
pub struct LockAllRequest<'a> {
    resources: Vec<Cow<'a, str>>,
    wait: Wait,
}

impl LockAllRequest<'_> {
    /// Tries again while a key is held or no quorum answered, as
    /// [`LockRequest::retry`] does.
    pub fn retry(mut self) -> Self {
        self.wait = Wait::Retries;
        self
    }
}

impl<'a> From<LockAllRequest<'a>> for LockRequest<'a> {
    fn from(request: LockAllRequest<'a>) -> Self {
        Self {
            resources: Resources::All(request.resources),
            options: Options {
                mode: LockMode::Plain,
                wait: request.wait,
            },
        }
    }
}

impl<'a> From<&LockAllRequest<'a>> for LockRequest<'a> {
    fn from(request: &LockAllRequest<'a>) -> Self {
        request.clone().into()
    }
}

impl<'a> From<&'a str> for LockRequest<'a> {
    fn from(resource: &'a str) -> Self {
        Self::new(resource)
    }
}

impl From<String> for LockRequest<'static> {
    fn from(resource: String) -> Self {
        Self::new(resource)
    }
}

impl<'a> From<&LockRequest<'a>> for LockRequest<'a> {
    fn from(request: &LockRequest<'a>) -> Self {
        request.clone()
    }
}

/// Why a set of keys in another mode is refused.
const SET_MODE: &str = "a lease on several keys takes LockMode::Plain only";
/// Why a set of keys that waits is refused.
const SET_WAIT: &str = "a lease on several keys waits with retry() only, not wait(..)";

/// Runs a request that waits or retries on prefixed keys, on either backend; the lease
/// records `holder`.
pub(crate) async fn acquire(
    backend: &dyn LockBackend,
    claim: Claim,
    options: Options,
    holder: Holder,
) -> LockResult {
    let attempt = |claim| {
        let holder = HolderRef::Known(&holder);
        backend.attempt(claim, Instant::now(), holder).get()
    };
    match (options.wait, claim) {
        (Wait::Once, claim) => attempt(claim).await,
        // Again after a random retry delay, up to the retry count, while it fails on
        // anything but the request itself.
        (Wait::Retries, claim) => {
            let policy = backend.settings();
            let mut retries = 0;
            loop {
                match attempt(claim.clone()).await {
                    Err(e)
                        if !matches!(e, LockError::InvalidKey(_) | LockError::Unsupported(_))
                            && retries < policy.retry_count =>
                    {
                        retries += 1;
                        tokio::time::sleep(policy.retry_delay()).await;
                    }
                    result => return result,
                }
            }
        }
        (Wait::Within(max_wait), Claim::One(one)) => backend.wait(one, max_wait, holder).await,
        // Refused by `LockRequest::resolve`; the layers ask a set for one attempt.
        (Wait::Within(_), Claim::Set(_)) => Err(LockError::Unsupported(SET_WAIT)),
    }
}

/// An acquisition decided at once, or one to await.
pub(crate) enum Decided {
    Now(LockResult),
    Later(Pending),
}

impl Decided {
    pub(crate) async fn get(self) -> LockResult {
        match self {
            Decided::Now(result) => result,
            Decided::Later(pending) => pending.run().await,
        }
    }
}

impl From<Answer<LockResult>> for Decided {
    fn from(answer: Answer<LockResult>) -> Self {
        match answer {
            Answer::Now(result) => Decided::Now(result),
            Answer::Later(future) => Decided::Later(Pending::Boxed(future)),
        }
    }
}

/// An acquisition that waits on the backend, not started yet: on Redis one plain attempt,
/// run in place by the future that awaits it (see [`LockBackend::redlock`]); otherwise the
/// backend's future, boxed.
pub(crate) enum Pending {
    #[cfg(feature = "redis")]
    Attempt {
        redis: Redlock,
        key: Arc<str>,
        holder: Arc<str>,
    },
    Boxed(BoxFuture<LockResult>),
}

impl Pending {
    pub(crate) async fn run(self) -> LockResult {
        match self {
            #[cfg(feature = "redis")]
            Pending::Attempt { redis, key, holder } => redis.acquire(key, false, holder).await,
            Pending::Boxed(future) => future.await,
        }
    }

    /// The acquisition as a boxed future (written in its box: only a future that
    /// captures little is).
    pub(crate) fn boxed(self) -> BoxFuture<LockResult> {
        match self {
            #[cfg(feature = "redis")]
            Pending::Attempt { redis, key, holder } => {
                crate::future::boxed(|| async move { redis.acquire(key, false, holder).await })
            }
            Pending::Boxed(future) => future,
        }
    }
}
