//! The in-process backend's side of the one acquisition path
//! ([`LockBackend`](crate::backend::request::LockBackend)).

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;
#[cfg(test)]
use std::time::Instant;

use super::MemoryLocks;
#[cfg(test)]
use crate::backend::request::LockMode;
use crate::backend::request::{LockBackend, LockResult};
use crate::backend::settings::Settings;
use crate::lease::Access;

impl LockBackend for MemoryLocks {
    fn policy(&self) -> &Settings {
        &self.inner.policy
    }

    fn id(&self) -> u64 {
        self.inner.id
    }

    fn try_plain(&self, key: Arc<str>) -> impl Future<Output = LockResult> + Send {
        std::future::ready(self.acquire(key))
    }

    fn try_all(&self, keys: Arc<[Arc<str>]>) -> impl Future<Output = LockResult> + Send {
        std::future::ready(self.acquire_all(&keys))
    }

    fn wait_plain(
        &self,
        key: Arc<str>,
        max_wait: Duration,
    ) -> impl Future<Output = LockResult> + Send {
        self.lock_key_within(key, max_wait)
    }

    fn wait_access(
        &self,
        key: Arc<str>,
        access: Access,
        max_wait: Duration,
    ) -> impl Future<Output = LockResult> + Send {
        self.lock_access_within(key, access, max_wait)
    }

    fn wait_fair(
        &self,
        key: Arc<str>,
        max_wait: Duration,
    ) -> impl Future<Output = LockResult> + Send {
        self.lock_fair_key_within(key, max_wait)
    }
}

/// Requests by resource name, for this module's tests.
#[cfg(test)]
impl MemoryLocks {
    pub(crate) fn try_lock(&self, resource: &str) -> LockResult {
        let key = self.inner.policy.full_key(resource)?;
        self.acquire(key)
    }

    pub(crate) fn try_lock_all<'a, I>(&self, resources: I) -> LockResult
    where
        I: IntoIterator,
        I::Item: Into<std::borrow::Cow<'a, str>>,
    {
        let request = crate::backend::request::LockRequest::all(resources);
        let (claim, _) = request.resolve(&self.inner.policy)?;
        self.attempt(&claim, LockMode::Plain, Instant::now())
    }

    pub(crate) async fn take(
        &self,
        request: crate::backend::request::LockRequest<'_>,
    ) -> LockResult {
        let (claim, options) = request.resolve(&self.inner.policy)?;
        crate::backend::request::acquire(self, claim, options).await
    }
}
