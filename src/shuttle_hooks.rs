//! What `verify/shuttle` drives that is not public: a concurrency permit of the in-process
//! store, taken the way the layer takes it. Only in a build with `--cfg shuttle`; not API.

use std::time::Duration;

use crate::backend::concurrency::{ConcurrencyError, ConcurrencyLimiter, PermitSlot};

/// A permit held until dropped.
#[allow(missing_debug_implementations)]
pub struct PermitGuard(#[allow(dead_code)] PermitSlot); // Held for its drop, which releases it.

/// A permit on `resource` under `limit`, waiting up to `max_wait` (as
/// `ConcurrencyLimitLayer::max_wait` does).
///
/// # Errors
///
/// As the layer's acquisition: [`ConcurrencyError::LimitReached`] after the wait.
pub async fn permit(
    limiter: &ConcurrencyLimiter,
    resource: &str,
    limit: u32,
    max_wait: Duration,
) -> Result<PermitGuard, ConcurrencyError> {
    limiter
        .acquire_within(resource, limit, max_wait)
        .await
        .map(PermitGuard)
}
