//! The metrics this crate emits through the [`metrics`] facade (with the `metrics`
//! feature) and the spans it opens through [`tracing`], named in one place.
//!
//! No label and no span field ever holds a key's value: a span carries the key's *scope*,
//! and node errors are labelled with the node's `host:port`.
//!
//! Each metric and span, with its labels and fields, is listed in the guide's observability
//! chapter (`src/docs/guide_observability.md`): keep the two in step.

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
use std::pin::Pin;
use std::task::{Context, Poll, ready};
use std::time::Instant;

/// A request counter's `result` enum, whose `count` uses a literal name and label (a static
/// key: the `metrics` macros allocate a key per call otherwise).
macro_rules! results {
    ($name:ident counts $metric:literal { $($variant:ident => $label:literal,)* }) => {
        #[derive(Debug, Clone, Copy, PartialEq, Eq)]
        pub(crate) enum $name {
            $($variant,)*
        }

        impl $name {
            /// Counts one request with this result.
            pub(crate) fn count(self) {
                #[cfg(feature = "metrics")]
                match self {
                    $(Self::$variant => {
                        metrics::counter!($metric, "result" => $label).increment(1);
                    })*
                }
            }
        }
    };
}

// The counters' `result` values (see the observability guide).
results! {
    LockResult counts "tower_redlock_lock_requests_total" {
        Acquired => "acquired",
        Taken => "taken",
        Unavailable => "unavailable",
        Invalid => "invalid",
        // Counted on top of `acquired`.
        Lost => "lost",
    }
}

results! {
    RateLimitResult counts "tower_redlock_rate_limit_requests_total" {
        Allowed => "allowed",
        Limited => "limited",
        Unavailable => "unavailable",
        Invalid => "invalid",
    }
}

results! {
    ConcurrencyResult counts "tower_redlock_concurrency_requests_total" {
        Admitted => "admitted",
        Limited => "limited",
        Unavailable => "unavailable",
        Invalid => "invalid",
    }
}

results! {
    IdempotencyResult counts "tower_redlock_idempotency_requests_total" {
        New => "new",
        Replayed => "replayed",
        InFlight => "in_flight",
        Mismatch => "mismatch",
        Missing => "missing",
        Invalid => "invalid",
        Unavailable => "unavailable",
    }
}

/// Counts one lock request by its acquisition's outcome, and records how long it took.
pub(crate) fn lock_outcome<T>(acquired: &Result<T, crate::error::LockError>, started: Instant) {
    use crate::error::LockError;
    #[cfg(feature = "metrics")]
    metrics::histogram!("tower_redlock_lock_acquire_duration_seconds").record(Since(started));
    #[cfg(not(feature = "metrics"))]
    let _ = started;
    LockResult::count(match acquired {
        Ok(_) => LockResult::Acquired,
        Err(LockError::Taken { .. }) => LockResult::Taken,
        Err(LockError::InvalidKey(_) | LockError::Unsupported(_)) => LockResult::Invalid,
        Err(_) => LockResult::Unavailable,
    });
}

/// What this process holds or waits for now: gauges, raised at the start, lowered at the end.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Held {
    /// Leases (layers, extractors, `Locks::with_lock`/`with_lease`).
    Lease,
    /// Requests waiting for a lock or a permit.
    Waiter,
    /// `ConcurrencyLimitLayer` permits.
    Permit,
}

impl Held {
    pub(crate) fn start(self) {
        #[cfg(feature = "metrics")]
        self.gauge().increment(1.0);
    }

    pub(crate) fn end(self) {
        #[cfg(feature = "metrics")]
        self.gauge().decrement(1.0);
    }

    #[cfg(feature = "metrics")]
    fn gauge(self) -> metrics::Gauge {
        match self {
            Held::Lease => metrics::gauge!("tower_redlock_leases_held"),
            Held::Waiter => metrics::gauge!("tower_redlock_waiters"),
            Held::Permit => metrics::gauge!("tower_redlock_concurrency_permits_held"),
        }
    }
}

/// Records how long a lease was held: since `acquired`, up to now.
pub(crate) fn lock_held_since(acquired: Instant) {
    #[cfg(feature = "metrics")]
    metrics::histogram!("tower_redlock_lock_held_duration_seconds").record(Since(acquired));
    #[cfg(not(feature = "metrics"))]
    let _ = acquired;
}

/// The seconds from an instant to now, for a histogram: the clock is read only when a
/// recorder takes the value (never without one installed).
#[cfg(feature = "metrics")]
struct Since(Instant);

#[cfg(feature = "metrics")]
impl metrics::IntoF64 for Since {
    fn into_f64(self) -> f64 {
        self.0.elapsed().as_secs_f64()
    }
}

/// Counts one failure (an error or a timeout) of the Redis node at `node` (`host:port`).
pub(crate) fn node_error(node: &str) {
    #[cfg(feature = "metrics")]
    metrics::counter!("tower_redlock_node_errors_total", "node" => node.to_owned()).increment(1);
    #[cfg(not(feature = "metrics"))]
    let _ = node;
}

/// The scope of `key` (`{prefix}{scope}:{value}`): what follows `prefix` up to the first
/// `:`; empty without a `:`. Never any of the value.
pub(crate) fn scope<'k>(key: &'k str, prefix: &str) -> &'k str {
    let rest = key.strip_prefix(prefix).unwrap_or("");
    rest.split_once(':').map_or("", |(scope, _)| scope)
}

/// A `DEBUG` span `tower_redlock.<op>` with the key's scope and the quorum; [`traced`] adds
/// the verdict and elapsed time. Made only once a `tracing` dispatcher is set: without one,
/// `tracing`'s `log` feature (on through axum) would still compute the fields.
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

/// Runs `future` in `span` and records its verdict and elapsed time there. A disabled span
/// costs one check per poll.
#[inline(always)]
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
    /// The future of [`traced`] (an `async fn` would hold `future` twice).
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

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        if this.span.is_disabled() {
            return this.future.poll(cx);
        }
        let start = *this.start.get_or_insert_with(Instant::now);
        let out = {
            let _entered = this.span.enter();
            ready!(this.future.poll(cx))
        };
        this.span.record("verdict", (this.verdict)(&out));
        this.span
            .record("elapsed_ms", start.elapsed().as_secs_f64() * 1e3);
        Poll::Ready(out)
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
        Err(LockError::Unsupported(_)) => "unsupported",
        Err(LockError::NoBackendChosen) => "no_backend_chosen",
    }
}

/// Records in the current span (from [`op_span!`]) how many nodes answered its last round.
pub(crate) fn nodes_answered(answered: usize) {
    if !tracing::dispatcher::has_been_set() {
        return;
    }
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
