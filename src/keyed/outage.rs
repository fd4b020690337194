//! The keyed core's rare log lines, at most one per interval for each kind of layer: a
//! store found unavailable, and a refusal let through in shadow mode.

use super::policy::Policy;
use crate::rejection::RejectedBy;
use std::time::Duration;

/// How often, at most, a kind of layer logs that its store is unavailable: 10 s. Under
/// an outage every request meets it (a client rotating ids, one per request); the
/// counter `tower_redlock_store_unavailable_total` counts each.
pub(crate) const OUTAGE_LOG_INTERVAL: Duration = Duration::from_secs(10);

/// A kind of line logged at most once per [`OUTAGE_LOG_INTERVAL`] for each kind of layer.
#[derive(Clone, Copy)]
pub(crate) enum Log {
    Outage = 0,
    Shadow = 1,
}

/// Whether a `log` line for `P`'s kind of layer is due (at most one per
/// [`OUTAGE_LOG_INTERVAL`]): how many went unlogged since the last one, or `None` (this one
/// is counted as unlogged).
pub(crate) fn due<P: Policy>(log: Log) -> Option<u64> {
    use std::sync::atomic::{AtomicU64, Ordering};
    static NEXT_MS: [[AtomicU64; 4]; 2] = [const { [const { AtomicU64::new(0) }; 4] }; 2];
    static UNLOGGED: [[AtomicU64; 4]; 2] = [const { [const { AtomicU64::new(0) }; 4] }; 2];
    static START: std::sync::OnceLock<std::time::Instant> = std::sync::OnceLock::new();

    let layer = match P::REJECTED_BY {
        RejectedBy::Lock => 0,
        RejectedBy::Idempotency => 1,
        RejectedBy::RateLimit => 2,
        _ => 3,
    };
    let (Some(next_ms), Some(unlogged_since)) = (
        NEXT_MS.get(log as usize).and_then(|l| l.get(layer)),
        UNLOGGED.get(log as usize).and_then(|l| l.get(layer)),
    ) else {
        return None;
    };
    let now = START.get_or_init(std::time::Instant::now).elapsed();
    let now_ms = u64::try_from(now.as_millis()).unwrap_or(u64::MAX);
    let next = next_ms.load(Ordering::Relaxed);
    let interval = u64::try_from(OUTAGE_LOG_INTERVAL.as_millis()).unwrap_or(u64::MAX);
    let due = now_ms >= next
        && next_ms
            .compare_exchange(
                next,
                now_ms.saturating_add(interval),
                Ordering::Relaxed,
                Ordering::Relaxed,
            )
            .is_ok();
    if !due {
        unlogged_since.fetch_add(1, Ordering::Relaxed);
        return None;
    }
    Some(unlogged_since.swap(0, Ordering::Relaxed))
}

/// Counts a request that found `P`'s store unavailable, and logs it at most once per
/// [`OUTAGE_LOG_INTERVAL`] for each kind of layer, with how many went unlogged since.
pub(crate) fn outage<P: Policy>(error: &(dyn std::fmt::Display + Send + Sync), fail_open: bool) {
    #[cfg(feature = "metrics")]
    metrics::counter!(
        "tower_redlock_store_unavailable_total",
        "layer" => P::REJECTED_BY.layer(),
        "outcome" => if fail_open { "fail_open" } else { "fail_closed" }
    )
    .increment(1);
    let Some(unlogged) = due::<P>(Log::Outage) else {
        return;
    };
    let answer = if fail_open {
        "running unguarded (fail open)"
    } else {
        "answering 503 (fail closed)"
    };
    tracing::warn!(
        layer = P::REJECTED_BY.layer(),
        %error,
        unlogged,
        "store unavailable; {answer}; at most one such line per {OUTAGE_LOG_INTERVAL:?} for this kind of layer ({unlogged} unlogged since the last one)"
    );
}
