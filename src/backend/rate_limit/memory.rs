//! [`MemoryRateLimiter`]: fixed-window counters and GCRA arrival times in this process's memory.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use super::RateLimitError;
use super::quota::{Quota, Usage, micros};
use crate::backend::KeyMap;
use crate::backend::settings::check_resource;

/// Fixed-window counters and GCRA arrival times in this process's memory, with the
/// semantics of [`RedisRateLimiter`](super::RedisRateLimiter): a window per key starts with
/// its first request, refused requests count too, the time to reset is reported.
///
/// It is the embedded default ([`RateLimiter::default`](super::RateLimiter::default)), for
/// examples, single-replica services and tests: it does not share counts across processes.
/// Chosen (`RateLimiter::from(MemoryRateLimiter::new())`), it works in any process; the
/// default one is refused in a process that built a `RedisRateLimiter`.
/// Counting takes a short mutex, no `.await`. Cloning is cheap and shares the counters.
///
/// # Bounded memory
///
/// It holds at most [`max_keys`](Self::with_max_keys) live windows (default
/// [`DEFAULT_MAX_KEYS`](Self::DEFAULT_MAX_KEYS)), so that a client rotating its id cannot
/// make it grow without end. An ended window is kept one second for its key to come back,
/// and evicted at once when the store is full (ended windows go before a new key is
/// refused), in `O(log n)` a window; the memory is given back as windows go. Each live
/// window costs about 115 bytes plus its key's length: about 14 MB at the default bound
/// with 20-byte keys, 38 MB with the longest keys a layer makes (BENCHMARKS.md, "Memory").
///
/// When `max_keys` windows are live, a request on a key without one is not counted:
/// [`hit`](Self::hit) answers [`RateLimitError::StoreFull`], which the
/// [`RateLimitLayer`](crate::RateLimitLayer) treats as an unavailable store
/// ([`fail_open`](crate::RateLimitLayer::fail_open): let through uncounted by default,
/// 503 when failing closed). Keys with a window go on being
/// limited. Letting new keys through gives the client that fills the store nothing it
/// lacks (each fresh id starts a fresh window anyway); where the limit is a security
/// control, fail closed.
///
/// ```
/// use tower_redlock::{MemoryRateLimiter, Quota, RateLimitError};
///
/// let limiter = MemoryRateLimiter::with_max_keys(2);
/// let quota: Quota = "2/60".parse()?;
/// assert_eq!(limiter.hit("ip:203.0.113.7", quota)?.remaining(), 1);
/// assert_eq!(limiter.hit("ip:203.0.113.7", quota)?.remaining(), 0);
/// assert!(limiter.hit("ip:203.0.113.7", quota)?.is_exceeded());
/// limiter.hit("ip:203.0.113.8", quota)?;
/// // Two live windows: a third key is not counted until one ends.
/// assert!(matches!(
///     limiter.hit("ip:203.0.113.9", quota),
///     Err(RateLimitError::StoreFull { max_keys: 2 })
/// ));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone)]
pub struct MemoryRateLimiter {
    inner: Arc<Mutex<Windows>>,
}

/// The store; its times are whole µs since `epoch`, in `u64` (no overflow for 500,000
/// years), so that a hit does integer arithmetic rather than `Instant` arithmetic.
struct Windows {
    counts: KeyMap<Arc<str>, Window>,
    /// Every window by the time it ends, soonest first: one entry per key of `counts`.
    ends: BinaryHeap<Reverse<(u64, Arc<str>)>>,
    max_keys: usize,
    epoch: Instant,
}

struct Window {
    count: u64,
    /// When the window ends (for GCRA, the theoretical arrival time), in µs since `epoch`.
    resets_at: u64,
}

/// Capacity kept when the store shrinks.
const MIN_CAPACITY: usize = 1024;

/// How long an ended window is kept for its key to come back: 1 s. A GCRA key ends as
/// soon as its arrival time passes, which for a client below the rate is before its next
/// request; reused, its entry costs no allocation and no queueing.
pub(crate) const REUSE_FOR: Duration = Duration::from_secs(1);

impl fmt::Debug for MemoryRateLimiter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemoryRateLimiter")
            .field("keys", &self.len())
            .field("max_keys", &self.max_keys())
            .finish()
    }
}

impl Default for MemoryRateLimiter {
    fn default() -> Self {
        Self::with_max_keys(Self::DEFAULT_MAX_KEYS)
    }
}

impl MemoryRateLimiter {
    /// The default bound on live windows: 100,000.
    pub const DEFAULT_MAX_KEYS: usize = 100_000;

    /// New, empty counters, at most [`DEFAULT_MAX_KEYS`](Self::DEFAULT_MAX_KEYS) live
    /// windows.
    pub fn new() -> Self {
        Self::default()
    }

    /// New, empty counters holding at most `max_keys` live windows (at least 1; 0 is
    /// raised to 1). See [Bounded memory](Self#bounded-memory) for what happens when
    /// they are all taken.
    pub fn with_max_keys(max_keys: usize) -> Self {
        Self {
            inner: Arc::new(Mutex::new(Windows {
                counts: KeyMap::default(),
                ends: BinaryHeap::new(),
                max_keys: max_keys.max(1),
                epoch: Instant::now(),
            })),
        }
    }

    /// The bound on live windows.
    pub fn max_keys(&self) -> usize {
        self.windows().max_keys
    }

    /// The number of windows held: the live ones, and ended ones not evicted yet (those
    /// go at the first request one second after they end, or at once when the store is
    /// full).
    pub fn len(&self) -> usize {
        self.windows().counts.len()
    }

    /// Whether no window is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn windows(&self) -> MutexGuard<'_, Windows> {
        // No code panics while holding the lock; recover the map if a panic ever did.
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Counts one request on `resource` under `quota`: the count after this request, and
    /// the time until the window resets. The first request of a window starts it.
    ///
    /// # Errors
    ///
    /// [`RateLimitError::InvalidKey`] for an empty key, one over
    /// [`MAX_RESOURCE_LEN`](crate::key::MAX_RESOURCE_LEN) bytes, or one with control
    /// characters; [`RateLimitError::StoreFull`] for a key without a live window while
    /// [`max_keys`](Self::with_max_keys) windows are live. It never answers
    /// [`RateLimitError::Unavailable`].
    pub fn hit(&self, resource: &str, quota: Quota) -> Result<Usage, RateLimitError> {
        self.traced_hit(resource, quota, true)
    }

    /// [`hit`](Self::hit) on a key a layer built: its value checked already, its prefix and
    /// scope the server's.
    pub(crate) fn hit_key(&self, key: &str, quota: Quota) -> Result<Usage, RateLimitError> {
        self.traced_hit(key, quota, false)
    }

    fn traced_hit(
        &self,
        resource: &str,
        quota: Quota,
        check: bool,
    ) -> Result<Usage, RateLimitError> {
        let span = crate::observe::op_span!("tower_redlock.rate_limit", resource, "", 1);
        crate::observe::traced_now(
            span,
            || {
                if check {
                    check_resource(resource)?;
                }
                self.hit_untraced(resource, quota)
            },
            super::rate_verdict,
        )
    }

    fn hit_untraced(&self, resource: &str, quota: Quota) -> Result<Usage, RateLimitError> {
        let now = Instant::now();
        let mut windows = self.windows();
        let now = micros(now.saturating_duration_since(windows.epoch));
        windows.evict_ended(now.saturating_sub(micros(REUSE_FOR)));
        if windows.counts.len() >= windows.max_keys {
            windows.evict_ended(now);
            let max_keys = windows.max_keys;
            if windows.counts.len() >= max_keys && !windows.counts.contains_key(resource) {
                return Err(RateLimitError::StoreFull { max_keys });
            }
        }
        if quota.burst().is_some() {
            return Ok(windows.gcra(resource, quota, now));
        }
        let (count, resets_at) = match windows.counts.get_mut(resource) {
            Some(window) if window.resets_at > now => {
                window.count = window.count.saturating_add(1);
                (window.count, window.resets_at)
            }
            // Ended and kept: a new window in the same entry, queued again at its end
            // when the old end comes up.
            Some(window) => {
                *window = Window {
                    count: 1,
                    resets_at: now.saturating_add(micros(quota.window())),
                };
                (1, window.resets_at)
            }
            None => {
                let resets_at = now.saturating_add(micros(quota.window()));
                windows.open(resource, 1, resets_at);
                (1, resets_at)
            }
        };
        let reset_after = Duration::from_micros(resets_at - now);
        Ok(Usage::fixed(count, quota.limit(), reset_after))
    }
}

impl Windows {
    /// A new entry for `resource`, queued for eviction at `resets_at`.
    fn open(&mut self, resource: &str, count: u64, resets_at: u64) {
        let key: Arc<str> = Arc::from(resource);
        self.ends.push(Reverse((resets_at, key.clone())));
        self.counts.insert(key, Window { count, resets_at });
    }

    /// One GCRA decision on `resource` at `now` (see [`Quota::gcra`]): the key's
    /// `resets_at` is its theoretical arrival time (TAT); a TAT that has passed counts as
    /// now (a fresh key is in the same state), and the key is dropped one second after
    /// it.
    fn gcra(&mut self, resource: &str, quota: Quota, now: u64) -> Usage {
        let emission = quota.emission_us();
        let tolerance = quota.tolerance_us();
        let tat = match self.counts.get_mut(resource) {
            Some(window) => {
                let tat = window.resets_at.max(now);
                let ahead = tat - now;
                if ahead > tolerance {
                    let wait = Duration::from_micros(ahead - tolerance);
                    return Usage::gcra(&quota, false, 0, Duration::from_micros(ahead), wait);
                }
                window.resets_at = tat.saturating_add(emission);
                window.resets_at
            }
            None => {
                let tat = now.saturating_add(emission);
                self.open(resource, 0, tat);
                tat
            }
        };
        let ahead = tat - now;
        // What is left of the burst: floor((tolerance + emission - ahead) / emission) (a
        // quota's emission interval is at least 1 µs).
        let remaining = tolerance.saturating_add(emission).saturating_sub(ahead) / emission;
        Usage::gcra(
            &quota,
            true,
            remaining,
            Duration::from_micros(ahead),
            Duration::ZERO,
        )
    }

    /// Evicts the windows that ended by `by`, soonest first, `O(log n)` each; a key whose
    /// window moved on since it was queued is queued again at its new end.
    fn evict_ended(&mut self, by: u64) {
        let mut evicted = false;
        while self.ends.peek().is_some_and(|end| end.0.0 <= by) {
            let Some(Reverse((_, key))) = self.ends.pop() else {
                break;
            };
            match self.counts.get(&key).map(|window| window.resets_at) {
                Some(at) if at > by => self.ends.push(Reverse((at, key))),
                _ => {
                    self.counts.remove(&key);
                    evicted = true;
                }
            }
        }
        // Memory given back once at most a quarter of the capacity is used.
        let len = self.counts.len();
        if evicted && self.counts.capacity() > MIN_CAPACITY.max(len.saturating_mul(4)) {
            let keep = MIN_CAPACITY.max(len.saturating_mul(2));
            self.counts.shrink_to(keep);
            self.ends.shrink_to(keep);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::key::{KeyError, MAX_RESOURCE_LEN};

    fn quota(text: &str) -> Quota {
        text.parse().unwrap()
    }

    /// A client that asks again the moment it may, on `quota`, from `start` µs, until
    /// `passes` requests passed: the instants (µs) at which they passed. Explicit instants,
    /// no sleep: after a refusal, the next try is at the refusal's retry delay.
    fn greedy_run(quota: Quota, start: u64, passes: usize) -> Vec<u64> {
        let limiter = MemoryRateLimiter::new();
        let mut windows = limiter.windows();
        let (mut now, mut passed) = (start, Vec::new());
        while passed.len() < passes {
            let usage = windows.gcra("client", quota, now);
            if usage.is_exceeded() {
                assert!(usage.retry_after() > Duration::ZERO);
                now += micros(usage.retry_after());
            } else {
                passed.push(now);
            }
        }
        passed
    }

    #[test]
    fn gcra_never_passes_more_than_burst_plus_rate_for_rates_that_do_not_divide_the_window() {
        // 3 per second passed 201 times in 66.67 s (against 200.9998) when the emission
        // interval was rounded down to 333,333 µs.
        for text in [
            "3/1s burst 1",
            "7/1s burst 4",
            "999/7s burst 10",
            "10/1s burst 20",
        ] {
            let quota = quota(text);
            let (window, limit, burst) = (micros(quota.window()), quota.limit(), quota.burst());
            let burst = burst.unwrap();
            let passed = greedy_run(quota, 1_000_000, 300);
            // In every interval [a, b] between two passes, at most burst + (b - a) × rate:
            // (n - burst) × window <= (b - a) × limit, in integers.
            for (i, a) in passed.iter().enumerate() {
                for (j, b) in passed.iter().enumerate().skip(i) {
                    let n = (j - i + 1) as u64;
                    assert!(
                        n.saturating_sub(burst) * window <= (b - a) * limit,
                        "{text}: {n} passed in {} µs",
                        b - a
                    );
                }
            }
            // And the rate is reached: the 300th pass comes within one emission of when
            // the rate allows it.
            let last = passed[299] - passed[0];
            let due = (300 - burst) * window / limit;
            assert!(last <= due + quota.emission_us(), "{text}: {last} µs");
        }
    }

    #[test]
    fn memory_counts_a_fixed_window_per_key() {
        let limiter = MemoryRateLimiter::new();
        let q = quota("3/60");
        let counts: Vec<u64> = (0..5)
            .map(|_| limiter.hit("a", q).unwrap().count())
            .collect();
        assert_eq!(counts, [1, 2, 3, 4, 5]);
        assert_eq!(limiter.hit("b", q).unwrap().count(), 1);
        let usage = limiter.hit("a", q).unwrap();
        assert!(usage.is_exceeded());
        assert!(usage.reset_after() <= Duration::from_secs(60));
        assert!(usage.reset_after() > Duration::from_secs(59));
    }

    #[test]
    fn memory_window_does_not_move_with_later_hits() {
        let limiter = MemoryRateLimiter::new();
        let q = quota("10/200ms");
        let first = limiter.hit("a", q).unwrap().reset_after();
        std::thread::sleep(Duration::from_millis(20));
        let later = limiter.hit("a", q).unwrap().reset_after();
        assert!(later < first, "{later:?} < {first:?}");
    }

    #[test]
    fn ended_windows_are_swept_and_their_memory_given_back() {
        let limiter = MemoryRateLimiter::new();
        let q = quota("1/1ms");
        for i in 0..20_000 {
            limiter.hit(&format!("k{i}"), q).unwrap();
        }
        assert!(limiter.windows().counts.capacity() >= 20_000);
        // Kept for their keys to come back for a while, then evicted.
        std::thread::sleep(Duration::from_millis(5));
        limiter.hit("last", q).unwrap();
        assert_eq!(limiter.len(), 20_001);
        std::thread::sleep(REUSE_FOR);
        limiter.hit("last", q).unwrap();
        let windows = limiter.windows();
        assert_eq!((windows.counts.len(), windows.ends.len()), (1, 1));
        let capacities = (windows.counts.capacity(), windows.ends.capacity());
        assert!(
            capacities.0.max(capacities.1) <= 2 * MIN_CAPACITY,
            "{capacities:?}"
        );
    }

    #[test]
    fn an_ended_window_is_reused_by_its_key() {
        let limiter = MemoryRateLimiter::new();
        let fixed = quota("1/1ms");
        let gcra = Quota::gcra(1000, Duration::from_secs(1), 1).unwrap();
        limiter.hit("fixed", fixed).unwrap();
        limiter.hit("gcra", gcra).unwrap();
        std::thread::sleep(Duration::from_millis(5));
        // Both ended: the next requests count from a fresh state, in the same entries.
        let again = limiter.hit("fixed", fixed).unwrap();
        assert_eq!((again.count(), again.is_exceeded()), (1, false));
        assert!(!limiter.hit("gcra", gcra).unwrap().is_exceeded());
        let windows = limiter.windows();
        assert_eq!((windows.counts.len(), windows.ends.len()), (2, 2));
    }

    #[test]
    fn ended_windows_are_evicted_before_a_new_key_is_refused() {
        let limiter = MemoryRateLimiter::with_max_keys(10);
        let short = quota("1/20ms");
        for i in 0..9 {
            limiter.hit(&format!("short:{i}"), short).unwrap();
        }
        limiter.hit("long", quota("1/60")).unwrap();
        let full = limiter.hit("new", short);
        assert!(matches!(
            full,
            Err(RateLimitError::StoreFull { max_keys: 10 })
        ));
        std::thread::sleep(Duration::from_millis(30));
        assert_eq!(limiter.hit("new", short).unwrap().count(), 1);
        // Every ended window went; the live one stayed, with its count.
        assert_eq!(limiter.len(), 2);
        assert_eq!(limiter.hit("long", quota("1/60")).unwrap().count(), 2);
    }

    #[test]
    fn the_cap_has_a_default_and_is_at_least_one() {
        let default = MemoryRateLimiter::DEFAULT_MAX_KEYS;
        assert_eq!(MemoryRateLimiter::new().max_keys(), default);
        assert_eq!(default, 100_000);
        let one = MemoryRateLimiter::with_max_keys(0);
        assert_eq!(one.max_keys(), 1);
        assert!(one.is_empty());
        one.hit("a", quota("1/60")).unwrap();
        assert!(one.hit("b", quota("1/60")).is_err());
    }

    #[test]
    fn invalid_keys_are_refused() {
        let limiter = MemoryRateLimiter::new();
        let invalid = |key: &str| match limiter.hit(key, quota("1/1")) {
            Err(RateLimitError::InvalidKey(e)) => e,
            other => panic!("{other:?}"),
        };
        assert_eq!(invalid(""), KeyError::Empty);
        assert_eq!(invalid("a\nb"), KeyError::ControlCharacter);
        let long = "a".repeat(MAX_RESOURCE_LEN + 1);
        assert!(matches!(invalid(&long), KeyError::TooLong { .. }));
    }
}
