//! What an operator can watch: the metrics this crate emits through the [`metrics`] facade
//! (with the `metrics` feature) and the spans it opens through [`tracing`].
//!
//! The names and label values live here, in one place; the layers and backends call the
//! small functions below at the points where they decide.
//!
//! No label and no span field ever holds a key's value: a span carries the key's *scope*
//! (what comes after the prefix and before the first `:`), and node errors are labelled
//! with the node's `host:port`, which the clients never see.
//!
//! | metric | kind | label: values | counted where |
//! | --- | --- | --- | --- |
//! | `tower_redlock_lock_requests_total` | counter | `result`: `acquired`, `taken`, `unavailable`, `invalid`, `lost` | the lock policy and `Locked` (the first four), the keyed core (a bad key), the watchdog (`lost`) |
//! | `tower_redlock_lock_acquire_duration_seconds` | histogram | | the lock policy and `Locked` |
//! | `tower_redlock_lock_held_duration_seconds` | histogram | | the watchdog, as it is dropped |
//! | `tower_redlock_rate_limit_requests_total` | counter | `result`: `allowed`, `limited`, `unavailable`, `invalid` | the rate-limit policy, the keyed core |
//! | `tower_redlock_idempotency_requests_total` | counter | `result`: `new`, `replayed`, `in_flight`, `mismatch`, `missing`, `invalid`, `unavailable` | the idempotency policy, the keyed core |
//! | `tower_redlock_node_errors_total` | counter | `node`: `host:port` | a Redlock round, the Redis rate limiter |
//!
//! Spans (`DEBUG`): `tower_redlock.acquire`, `.extend`, `.release`, `.rate_limit`,
//! `.idempotency.lookup`, `.idempotency.store`, with `scope`, `quorum`, `nodes_answered`,
//! `verdict` and `elapsed_ms` ([`op_span!`], [`traced`]), once a `tracing` subscriber is
//! set (globally or as a scoped default); without one they cost one check.

// Each layer and backend uses its part: with some of them left out, the rest goes unused.
#![cfg_attr(
    not(all(
        feature = "metrics",
        feature = "lock",
        feature = "rate-limit",
        feature = "idempotency",
        feature = "redis"
    )),
    allow(dead_code, unused_imports, unused_macros)
)]

use std::future::Future;
use std::time::{Duration, Instant};

/// `tower_redlock_lock_requests_total{result}`: the outcome of every lock a
/// [`LockLayer`](crate::LockLayer) or a [`Locked`](crate::Locked) extractor asked for.
pub(crate) const LOCK_REQUESTS: &str = "tower_redlock_lock_requests_total";
/// `tower_redlock_lock_acquire_duration_seconds`: how long an acquisition took, whatever
/// its outcome.
pub(crate) const LOCK_ACQUIRE_DURATION: &str = "tower_redlock_lock_acquire_duration_seconds";
/// `tower_redlock_lock_held_duration_seconds`: how long a lease was held, from its
/// acquisition to its release or loss.
pub(crate) const LOCK_HELD_DURATION: &str = "tower_redlock_lock_held_duration_seconds";
/// `tower_redlock_rate_limit_requests_total{result}`.
pub(crate) const RATE_LIMIT_REQUESTS: &str = "tower_redlock_rate_limit_requests_total";
/// `tower_redlock_idempotency_requests_total{result}`.
pub(crate) const IDEMPOTENCY_REQUESTS: &str = "tower_redlock_idempotency_requests_total";
/// `tower_redlock_node_errors_total{node}`: a Redis node that failed or did not answer in
/// time, by `host:port`.
pub(crate) const NODE_ERRORS: &str = "tower_redlock_node_errors_total";

/// The `result` of a lock request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum LockResult {
    /// A lease was taken: the request ran.
    Acquired,
    /// Another holder had the key: 409 or 423.
    Taken,
    /// No quorum, or too slow to leave validity: 503.
    Unavailable,
    /// The key was missing or unusable: 400.
    Invalid,
    /// A held lease was lost while its request ran (a renewal found the token gone, or the
    /// validity ran out). Counted on top of `acquired`.
    Lost,
}

impl LockResult {
    /// The label value.
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Self::Acquired => "acquired",
            Self::Taken => "taken",
            Self::Unavailable => "unavailable",
            Self::Invalid => "invalid",
            Self::Lost => "lost",
        }
    }
}

/// The `result` of a rate-limited request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum RateLimitResult {
    /// Counted, within the quota.
    Allowed,
    /// Over the quota: 429.
    Limited,
    /// The store could not count it: run uncounted (fail open) or 503.
    Unavailable,
    /// The key was missing or unusable: 400.
    Invalid,
}

impl RateLimitResult {
    /// The label value.
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Self::Allowed => "allowed",
            Self::Limited => "limited",
            Self::Unavailable => "unavailable",
            Self::Invalid => "invalid",
        }
    }
}

/// The `result` of a request through the idempotency layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum IdempotencyResult {
    /// No record: the request runs, its response is stored.
    New,
    /// A record for the same request: its response is replayed.
    Replayed,
    /// The same key is in flight: 409.
    InFlight,
    /// A record for another request (another payload): 422.
    Mismatch,
    /// No `Idempotency-Key` header: 400.
    Missing,
    /// An unusable key, or a record that cannot be replayed or read: 400, 409 or 500.
    Invalid,
    /// The store could not answer: 503.
    Unavailable,
}

impl IdempotencyResult {
    /// The label value.
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Self::New => "new",
            Self::Replayed => "replayed",
            Self::InFlight => "in_flight",
            Self::Mismatch => "mismatch",
            Self::Missing => "missing",
            Self::Invalid => "invalid",
            Self::Unavailable => "unavailable",
        }
    }
}

/// Counts one lock request.
pub(crate) fn lock_request(result: LockResult) {
    #[cfg(feature = "metrics")]
    metrics::counter!(LOCK_REQUESTS, "result" => result.as_str()).increment(1);
    #[cfg(not(feature = "metrics"))]
    let _ = result;
}

/// Counts one lock request by the outcome of its acquisition, begun at `started`, and
/// records how long the acquisition took.
pub(crate) fn lock_outcome<T>(acquired: &Result<T, crate::error::LockError>, started: Instant) {
    use crate::error::LockError;
    #[cfg(feature = "metrics")]
    lock_acquired_in(started.elapsed());
    #[cfg(not(feature = "metrics"))]
    let _ = started;
    lock_request(match acquired {
        Ok(_) => LockResult::Acquired,
        Err(LockError::Taken { .. }) => LockResult::Taken,
        Err(LockError::InvalidKey(_)) => LockResult::Invalid,
        Err(
            LockError::NoQuorum { .. }
            | LockError::TooSlow { .. }
            | LockError::Expired { .. }
            | LockError::Lost,
        ) => LockResult::Unavailable,
    });
}

/// Records how long an acquisition took.
pub(crate) fn lock_acquired_in(elapsed: Duration) {
    #[cfg(feature = "metrics")]
    metrics::histogram!(LOCK_ACQUIRE_DURATION).record(elapsed.as_secs_f64());
    #[cfg(not(feature = "metrics"))]
    let _ = elapsed;
}

/// Records how long a lease was held.
pub(crate) fn lock_held_for(held: Duration) {
    #[cfg(feature = "metrics")]
    metrics::histogram!(LOCK_HELD_DURATION).record(held.as_secs_f64());
    #[cfg(not(feature = "metrics"))]
    let _ = held;
}

/// Counts one rate-limited request.
pub(crate) fn rate_limit_request(result: RateLimitResult) {
    #[cfg(feature = "metrics")]
    metrics::counter!(RATE_LIMIT_REQUESTS, "result" => result.as_str()).increment(1);
    #[cfg(not(feature = "metrics"))]
    let _ = result;
}

/// Counts one request through the idempotency layer.
pub(crate) fn idempotency_request(result: IdempotencyResult) {
    #[cfg(feature = "metrics")]
    metrics::counter!(IDEMPOTENCY_REQUESTS, "result" => result.as_str()).increment(1);
    #[cfg(not(feature = "metrics"))]
    let _ = result;
}

/// Counts one failure (an error or a timeout) of the Redis node at `node` (`host:port`).
pub(crate) fn node_error(node: &str) {
    #[cfg(feature = "metrics")]
    metrics::counter!(NODE_ERRORS, "node" => node.to_owned()).increment(1);
    #[cfg(not(feature = "metrics"))]
    let _ = node;
}

/// The scope of `key` (`{prefix}{scope}:{value}`): what follows `prefix`, up to the first
/// `:`. Empty when there is no `:` (the whole key is then a value). Never any of the
/// value: a scope with a `:` of its own is cut short rather than let the value in.
pub(crate) fn scope<'k>(key: &'k str, prefix: &str) -> &'k str {
    let rest = key.strip_prefix(prefix).unwrap_or("");
    rest.split_once(':').map_or("", |(scope, _)| scope)
}

/// A span for one backend operation: `tower_redlock.<op>`, at the `DEBUG` level, with the
/// key's scope and the quorum; [`traced`] fills in the verdict and the elapsed time, and
/// a Redlock round the number of nodes that answered.
///
/// Made only once a `tracing` dispatcher has been set (globally, or as a scoped default):
/// without one, `tracing` would still compute the fields for the `log` crate's sake
/// (its `log` feature, which axum turns on), on every operation.
macro_rules! op_span {
    ($name:literal, $key:expr, $prefix:expr, $quorum:expr) => {
        if ::tracing::dispatcher::has_been_set() {
            ::tracing::debug_span!(
                $name,
                scope = $crate::observe::scope($key, $prefix),
                quorum = $quorum,
                nodes_answered = ::tracing::field::Empty,
                verdict = ::tracing::field::Empty,
                elapsed_ms = ::tracing::field::Empty,
            )
        } else {
            ::tracing::Span::none()
        }
    };
}
pub(crate) use op_span;

/// Runs `future` in `span` (a child of the span current where it was made, such as
/// tower-http's request span), and records its verdict and elapsed time there. A
/// disabled span costs one check per poll.
pub(crate) fn traced<F, T, E>(
    span: tracing::Span,
    future: F,
    verdict: fn(&Result<T, E>) -> &'static str,
) -> Traced<F, T, E>
where
    F: Future<Output = Result<T, E>>,
{
    Traced {
        future,
        span,
        start: None,
        verdict,
    }
}

pin_project_lite::pin_project! {
    /// The future of [`traced`]: the operation's own future, held once (an `async fn`
    /// wrapper would hold it twice, as its argument and as the future it awaits).
    pub(crate) struct Traced<F, T, E> {
        #[pin]
        future: F,
        span: tracing::Span,
        start: Option<Instant>,
        verdict: fn(&Result<T, E>) -> &'static str,
    }
}

impl<F, T, E> Future for Traced<F, T, E>
where
    F: Future<Output = Result<T, E>>,
{
    type Output = Result<T, E>;

    fn poll(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Self::Output> {
        let this = self.project();
        if this.span.is_disabled() {
            return this.future.poll(cx);
        }
        let start = *this.start.get_or_insert_with(Instant::now);
        let out = {
            let _entered = this.span.enter();
            std::task::ready!(this.future.poll(cx))
        };
        this.span.record("verdict", (this.verdict)(&out));
        this.span
            .record("elapsed_ms", start.elapsed().as_secs_f64() * 1e3);
        std::task::Poll::Ready(out)
    }
}

/// [`traced`] for an operation that does not wait (an in-process backend).
pub(crate) fn traced_now<T, E>(
    span: tracing::Span,
    op: impl FnOnce() -> Result<T, E>,
    verdict: fn(&Result<T, E>) -> &'static str,
) -> Result<T, E> {
    if span.is_disabled() {
        return op();
    }
    let start = Instant::now();
    let out = span.in_scope(op);
    span.record("nodes_answered", 1);
    span.record("verdict", verdict(&out));
    span.record("elapsed_ms", start.elapsed().as_secs_f64() * 1e3);
    out
}

/// The verdict of a lock operation, for its span: `ok`, or the error's kind.
pub(crate) fn lock_verdict<T>(result: &Result<T, crate::error::LockError>) -> &'static str {
    use crate::error::LockError;
    match result {
        Ok(_) => "ok",
        Err(LockError::Taken { .. }) => "taken",
        Err(LockError::NoQuorum { .. }) => "no_quorum",
        Err(LockError::TooSlow { .. }) => "too_slow",
        Err(LockError::Expired { .. }) => "expired",
        Err(LockError::Lost) => "lost",
        Err(LockError::InvalidKey(_)) => "invalid_key",
    }
}

/// Records in the current span (an operation's, from [`op_span!`]) how many nodes answered
/// its last round.
pub(crate) fn nodes_answered(answered: usize) {
    let span = tracing::Span::current();
    if !span.is_disabled() {
        span.record("nodes_answered", answered);
    }
}

#[cfg(test)]
mod tests {
    use super::scope;

    #[test]
    fn scope_never_holds_the_value() {
        assert_eq!(
            scope("tower-redlock:POST /orders:abc", "tower-redlock:"),
            "POST /orders"
        );
        assert_eq!(scope("tower-redlock:job:1:2", "tower-redlock:"), "job");
        assert_eq!(scope("tower-redlock:secret", "tower-redlock:"), "");
        assert_eq!(scope("other:secret", "tower-redlock:"), "");
        assert_eq!(scope("ip:203.0.113.7", ""), "ip");
    }
}
