//! How long locks are held, as seen in this process: the estimate behind a contended
//! request's `Retry-After`.
//!
//! Every release by this process records how long the lease was held, under the key's
//! *scope*: the part between the backend's prefix and the next `:` (the layer's scope, the
//! `report` of `report:2026-11`; empty without a `:`). A scope's estimate is a moving
//! average of its hold times, each new one weighing 1/4. After [`WARM_UP`] releases, a
//! release of the same scope as the last one recorded is sampled once in [`SAMPLE_EVERY`]
//! (then it costs a comparison, not a lookup); another scope's is always recorded.

use std::time::Duration;

use crate::backend::KeyMap;

/// How far one observation moves the estimate: by 1/2^WEIGHT_SHIFT of the difference.
const WEIGHT_SHIFT: u32 = 2;

/// Releases recorded, every one, before sampling starts.
const WARM_UP: u64 = 64;

/// After the warm-up, one release in this many is recorded.
const SAMPLE_EVERY: u64 = 8;

/// Scopes tracked at most; a scope seen after that has no estimate (its answers keep the
/// holder's remaining TTL). Scopes are the server's (routes, extractor types, resource
/// names), never a client's, so this is a guard rather than a limit anyone should reach.
const MAX_SCOPES: usize = 1024;

/// The moving hold-time estimate per scope. It has no lock of its own: its owner keeps it
/// under the lock of the table its releases already update (the hot-key table, the
/// in-process locks), so that recording a release costs no second lock.
#[derive(Debug, Default)]
pub(crate) struct HoldTimes {
    /// Per scope, the estimate in microseconds.
    scopes: KeyMap<Box<str>, u64>,
    /// Releases seen, recorded or not.
    releases: u64,
    /// The scope of the last release recorded.
    last: Box<str>,
}

impl HoldTimes {
    /// Records that `key` (with the backend's `prefix`) was held for `held`: every
    /// release during the warm-up and every release of another scope than the last
    /// recorded, and one in [`SAMPLE_EVERY`] of the others.
    pub(crate) fn record(&mut self, key: &str, prefix: &str, held: Duration) {
        self.releases = self.releases.wrapping_add(1);
        if self.releases > WARM_UP
            && !self.releases.is_multiple_of(SAMPLE_EVERY)
            && in_scope(key, prefix, &self.last)
        {
            return;
        }
        let scope = scope_of(key, prefix);
        if *self.last != *scope {
            self.last = scope.into();
        }
        let sample = u64::try_from(held.as_micros()).unwrap_or(u64::MAX);
        if let Some(estimate) = self.scopes.get_mut(scope) {
            *estimate = if sample >= *estimate {
                estimate.saturating_add((sample - *estimate) >> WEIGHT_SHIFT)
            } else {
                *estimate - ((*estimate - sample) >> WEIGHT_SHIFT)
            };
        } else if self.scopes.len() < MAX_SCOPES {
            self.scopes.insert(scope.into(), sample);
        }
    }

    /// The estimated hold time of `key`'s scope, if any was observed.
    pub(crate) fn estimate(&self, key: &str, prefix: &str) -> Option<Duration> {
        let scope = scope_of(key, prefix);
        self.scopes
            .get(scope)
            .map(|micros| Duration::from_micros(*micros))
    }

    /// How long a request that found `key` held should wait: the scope's estimate,
    /// bounded by `holder_left` (the holder's remaining TTL); `holder_left` itself
    /// without an estimate. The caller rounds it up to whole seconds, at least 1.
    pub(crate) fn retry_after(&self, key: &str, prefix: &str, holder_left: Duration) -> Duration {
        self.estimate(key, prefix)
            .map_or(holder_left, |estimate| estimate.min(holder_left))
    }
}

/// Whether `key`'s scope is `scope`: [`scope_of`] without searching the key for its end.
fn in_scope(key: &str, prefix: &str, scope: &str) -> bool {
    let rest = key.strip_prefix(prefix).unwrap_or(key);
    match rest.strip_prefix(scope) {
        Some(after) if !scope.is_empty() => after.starts_with(':'),
        _ => scope_of(key, prefix) == scope,
    }
}

/// The scope of `key`: between `prefix` and the first `:` after it; empty without one.
fn scope_of<'a>(key: &'a str, prefix: &str) -> &'a str {
    let rest = key.strip_prefix(prefix).unwrap_or(key);
    rest.split_once(':').map_or("", |(scope, _)| scope)
}

#[cfg(test)]
mod tests {
    use super::*;

    const PREFIX: &str = "tower-redlock:";

    #[test]
    fn the_scope_is_between_the_prefix_and_the_first_colon() {
        assert_eq!(scope_of("tower-redlock:report:2026-11", PREFIX), "report");
        assert_eq!(
            scope_of("tower-redlock:idempotency-key POST /orders:a:b", PREFIX),
            "idempotency-key POST /orders"
        );
        assert_eq!(scope_of("tower-redlock:job-7", PREFIX), "");
    }

    #[test]
    fn in_scope_agrees_with_scope_of() {
        let keys = [
            "tower-redlock:report:1",
            "tower-redlock:report",
            "tower-redlock:reports:1",
        ];
        for key in keys
            .into_iter()
            .chain(["tower-redlock::x", "other:report:1"])
        {
            for scope in ["report", "", "reports", "rep"] {
                assert_eq!(
                    in_scope(key, PREFIX, scope),
                    scope_of(key, PREFIX) == scope,
                    "{key} in {scope}"
                );
            }
        }
    }

    #[test]
    fn the_estimate_follows_the_hold_times_and_is_bounded_by_the_holders_ttl() {
        let mut holds = HoldTimes::default();
        let key = "tower-redlock:/items/%7Bid%7D:42";
        let (ttl_left, ms) = (Duration::from_secs(10), Duration::from_millis);
        assert_eq!(holds.retry_after(key, PREFIX, ttl_left), ttl_left);
        holds.record(key, PREFIX, ms(50));
        assert_eq!(holds.retry_after(key, PREFIX, ttl_left), ms(50));
        // Another value of the scope shares the estimate.
        let other = "tower-redlock:/items/%7Bid%7D:7";
        assert_eq!(holds.retry_after(other, PREFIX, ttl_left), ms(50));
        // Never above the holder's remaining TTL.
        assert_eq!(holds.retry_after(key, PREFIX, ms(20)), ms(20));
        // A quarter of the way to each new observation.
        holds.record(key, PREFIX, ms(450));
        assert_eq!(holds.estimate(key, PREFIX), Some(ms(150)));
        holds.record(key, PREFIX, ms(50));
        assert_eq!(holds.estimate(key, PREFIX), Some(ms(125)));
        // Other scopes are apart.
        assert_eq!(holds.estimate("tower-redlock:/users:42", PREFIX), None);
    }

    #[test]
    fn after_the_warm_up_one_release_in_eight_of_the_same_scope_is_recorded() {
        let mut holds = HoldTimes::default();
        let (key, ms) = ("tower-redlock:report:1", Duration::from_millis);
        for _ in 0..WARM_UP {
            holds.record(key, PREFIX, ms(100));
        }
        assert_eq!(holds.estimate(key, PREFIX), Some(ms(100)));
        // Seven releases pass unrecorded, the eighth moves the estimate.
        for _ in 1..SAMPLE_EVERY {
            holds.record(key, PREFIX, ms(900));
        }
        assert_eq!(holds.estimate(key, PREFIX), Some(ms(100)));
        holds.record(key, PREFIX, ms(900));
        assert_eq!(holds.estimate(key, PREFIX), Some(ms(300)));
        // Another scope's release is recorded at once, and so is the next one of the
        // first scope.
        let other = "tower-redlock:export:1";
        holds.record(other, PREFIX, ms(40));
        assert_eq!(holds.estimate(other, PREFIX), Some(ms(40)));
        holds.record(key, PREFIX, ms(300));
        assert_eq!(holds.estimate(key, PREFIX), Some(ms(300)));
    }

    #[test]
    fn extreme_hold_times_do_not_overflow() {
        let mut holds = HoldTimes::default();
        holds.record("k:1", "", Duration::MAX);
        holds.record("k:1", "", Duration::MAX);
        holds.record("k:1", "", Duration::ZERO);
        assert!(holds.estimate("k:1", "").is_some());
    }
}
