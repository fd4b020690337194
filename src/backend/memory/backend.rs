//! The in-process backend's side of the one acquisition path
//! ([`LockBackend`](crate::backend::request::LockBackend)).

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;
#[cfg(test)]
use std::time::Instant;

use super::MemoryLocks;
use crate::backend::request::{LockBackend, LockMode, LockResult};
use crate::backend::settings::Settings;

impl LockBackend for MemoryLocks {
    fn policy(&self) -> &Settings {
        &self.inner.policy
    }

    fn id(&self) -> u64 {
        self.inner.id
    }

    fn try_one(&self, key: Arc<str>) -> impl Future<Output = LockResult> + Send {
        std::future::ready(self.acquire(key))
    }

    fn try_all(&self, keys: Arc<[Arc<str>]>) -> impl Future<Output = LockResult> + Send {
        std::future::ready(self.acquire_all(&keys))
    }

    async fn wait(&self, key: Arc<str>, mode: LockMode, max_wait: Duration) -> LockResult {
        if mode == LockMode::Fair {
            self.lock_fair_key_within(key, max_wait).await
        } else {
            self.lock_within(key, mode.access(), max_wait).await
        }
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
