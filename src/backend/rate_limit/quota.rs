//! [`Quota`] (how many requests per window, and by which algorithm) and [`Usage`] (where
//! one key stands).

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

/// The longest window accepted: 2^32 - 1 ms (about 49.7 days), as for lock TTLs.
pub(crate) const MAX_WINDOW: Duration = Duration::from_millis(u32::MAX as u64);

/// The largest GCRA tolerance: 2^51 µs, so that a theoretical arrival time in µs since
/// the Unix epoch plus it stays an exact integer in Lua's doubles (below 2^53).
const MAX_TOLERANCE_US: u64 = 1 << 51;

/// A rate limit: [`limit`](Self::limit) requests per key per [`window`](Self::window),
/// counted by one of two algorithms.
///
/// - **Fixed window** ([`Quota::new`]): a key's window starts with its first request and
///   lasts `window`; request `limit + 1` in it is refused until it ends (the Redis `INCR`
///   documentation's rate limiter, <https://redis.io/docs/latest/commands/incr/>). A
///   client can spend a limit at a window's end and again at the next one's start.
/// - **GCRA** ([`Quota::gcra`]), the generic cell rate algorithm (ITU-T I.371; the
///   algorithm of redis-cell and tower_governor): one request every `window / limit` as a
///   steady rate, with bursts of up to [`burst`](Self::burst) at once. Each key holds one
///   value, its theoretical arrival time; a request is allowed when it is at most
///   `(burst - 1) × window / limit` ahead of now. In any interval of length `t`, at most
///   `burst + t × limit / window` requests pass.
///
/// Build one with [`Quota::new`] or [`Quota::gcra`], or parse `"LIMIT/SECONDS"` (the
/// window may carry a unit, `ms`, `s`, `m`, `h` or `d`), with `" burst N"` for GCRA:
///
/// ```
/// use std::time::Duration;
/// use tower_redlock::Quota;
///
/// let quota: Quota = "100/60".parse()?;
/// assert_eq!(quota, Quota::new(100, Duration::from_secs(60))?);
/// assert_eq!("1000/1h".parse::<Quota>()?.window(), Duration::from_secs(3600));
/// assert_eq!("5/500ms".parse::<Quota>()?.window(), Duration::from_millis(500));
/// assert!("0/60".parse::<Quota>().is_err());
/// // GCRA: 10 per second, bursts of up to 20.
/// let gcra: Quota = "10/1s burst 20".parse()?;
/// assert_eq!(gcra, Quota::gcra(10, Duration::from_secs(1), 20)?);
/// assert_eq!(gcra.burst(), Some(20));
/// # Ok::<(), tower_redlock::rate_limit::QuotaError>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Quota {
    limit: u64,
    window: Duration,
    /// GCRA's burst; `None` for a fixed window.
    burst: Option<u64>,
}

/// `duration` in whole µs, saturating.
pub(crate) fn micros(duration: Duration) -> u64 {
    u64::try_from(duration.as_micros()).unwrap_or(u64::MAX)
}

/// Why a [`Quota`] was refused.
///
/// Its `Debug` is its `Display` text, so that a `main` that returns it through `?` prints
/// the message and the fix.
#[derive(Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum QuotaError {
    /// The limit is zero: use at least 1 request per window.
    #[error("the rate limit must allow at least 1 request per window")]
    ZeroLimit,
    /// The window is shorter than 1 ms or longer than 2^32 - 1 ms (about 49.7 days).
    #[error("invalid rate limit window {0:?}: use 1 ms to 4294967295 ms (about 49 days)")]
    InvalidWindow(Duration),
    /// A GCRA burst of 0, or one whose tolerance, `(burst - 1) × window / limit`, is over
    /// 2^51 µs (about 71 years).
    #[error(
        "invalid GCRA burst {0}: use 1 or more, with (burst - 1) × window / limit under 71 years"
    )]
    InvalidBurst(u64),
    /// A GCRA rate of more than one request per µs (`limit` above the window in µs).
    #[error("the GCRA rate {limit} per {window:?} is over one request per microsecond")]
    RateTooHigh {
        /// The limit per window.
        limit: u64,
        /// The window.
        window: Duration,
    },
    /// The text is not `LIMIT/WINDOW`, such as `100/60` (seconds) or `100/1m`.
    #[error(
        "invalid rate limit {0:?}: use LIMIT/SECONDS such as 100/60, or a unit: 100/1m, 10/500ms, 1000/1h, 10000/1d"
    )]
    Malformed(String),
}

impl fmt::Debug for QuotaError {
    /// The `Display` text: what a `main` that returns the error prints.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

impl Quota {
    /// At most `limit` requests per key in each `window`. The window is counted in whole
    /// milliseconds (Redis `PEXPIRE`); a sub-millisecond part is dropped.
    ///
    /// # Errors
    ///
    /// [`QuotaError::ZeroLimit`] for a zero limit, [`QuotaError::InvalidWindow`] for a
    /// window under 1 ms or over 2^32 - 1 ms.
    pub fn new(limit: u64, window: Duration) -> Result<Self, QuotaError> {
        if limit == 0 {
            return Err(QuotaError::ZeroLimit);
        }
        let window = Duration::from_millis(u64::try_from(window.as_millis()).unwrap_or(u64::MAX));
        if window.is_zero() || window > MAX_WINDOW {
            return Err(QuotaError::InvalidWindow(window));
        }
        Ok(Self {
            limit,
            window,
            burst: None,
        })
    }

    /// A GCRA limit: a steady rate of `limit` requests per `window` (one every
    /// `window / limit`, rounded up to whole µs, so that the bound `burst + t × limit /
    /// window` holds for rates that do not divide the window), with bursts of up to
    /// `burst` requests at once. `Quota::gcra(100, Duration::from_secs(60), 100)` allows 100 at once, then one
    /// more every 600 ms.
    ///
    /// # Errors
    ///
    /// As [`Quota::new`] for the limit and the window; [`QuotaError::RateTooHigh`] when
    /// `limit` is over the window in µs; [`QuotaError::InvalidBurst`] for a zero burst or
    /// a tolerance over 2^51 µs.
    pub fn gcra(limit: u64, window: Duration, burst: u64) -> Result<Self, QuotaError> {
        let mut quota = Self::new(limit, window)?;
        let window_us = micros(quota.window);
        if window_us / limit == 0 {
            return Err(QuotaError::RateTooHigh {
                limit,
                window: quota.window,
            });
        }
        quota.burst = Some(burst);
        let tolerance = window_us
            .div_ceil(limit)
            .checked_mul(burst.saturating_sub(1));
        if burst == 0 || tolerance.is_none_or(|t| t > MAX_TOLERANCE_US) {
            return Err(QuotaError::InvalidBurst(burst));
        }
        Ok(quota)
    }

    /// GCRA's burst: how many requests may pass at once; `None` for a fixed window.
    pub fn burst(&self) -> Option<u64> {
        self.burst
    }

    /// One `share`-th of this quota (at least one request), for each of `share` replicas
    /// that count apart: the limit and the burst divided, rounded up; the same window.
    pub(crate) fn divided(self, share: u32) -> Self {
        let share = u64::from(share.max(1));
        let limit = self.limit.div_ceil(share).max(1);
        let burst = self.burst.map(|burst| burst.div_ceil(share).max(1));
        // Dividing keeps every bound that `new` and `gcra` checked.
        match burst {
            None => Self::new(limit, self.window).unwrap_or(self),
            Some(burst) => Self::gcra(limit, self.window, burst).unwrap_or(self),
        }
    }

    /// GCRA's emission interval, `window / limit`, in whole µs rounded up: rounded down,
    /// a rate that does not divide the window would let more through than `burst + t ×
    /// limit / window` (3 per second: 333,333 µs, 201 requests in 66.67 s against
    /// 200.9998).
    pub(crate) fn emission_us(&self) -> u64 {
        let window_us = micros(self.window);
        window_us.div_ceil(self.limit).max(1)
    }

    /// GCRA's tolerance, `(burst - 1) × emission`, in µs; bounded by `gcra`.
    pub(crate) fn tolerance_us(&self) -> u64 {
        let burst = self.burst.unwrap_or(1);
        self.emission_us().saturating_mul(burst.saturating_sub(1))
    }

    /// The `q` and `w` (seconds, rounded up) of `RateLimit-Policy`: the limit per window;
    /// for GCRA, the burst and the time it takes to earn it back (`burst × window /
    /// limit`), so that the `r` of `RateLimit` (what is left of the burst) counts down
    /// from `q`.
    pub(crate) fn policy(&self) -> (u64, u64) {
        use crate::problem::retry_after_secs as secs;
        match self.burst {
            None => (self.limit, secs(self.window)),
            Some(burst) => {
                let refill_us = self.tolerance_us().saturating_add(self.emission_us());
                (burst, secs(Duration::from_micros(refill_us)))
            }
        }
    }

    /// The number of requests allowed per key in one window.
    pub fn limit(&self) -> u64 {
        self.limit
    }

    /// The window's length, in whole milliseconds.
    pub fn window(&self) -> Duration {
        self.window
    }

    /// The window in milliseconds, as sent to `PEXPIRE`.
    #[cfg(feature = "redis")]
    pub(crate) fn window_ms(&self) -> u64 {
        // Bounded by MAX_WINDOW in new().
        u64::try_from(self.window.as_millis()).unwrap_or(u64::from(u32::MAX))
    }
}

impl fmt::Display for Quota {
    /// `LIMIT/SECONDS` for a whole number of seconds, `LIMIT/MILLISms` otherwise, then
    /// ` burst N` for GCRA; the output parses back to the same quota.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.window.subsec_millis() == 0 {
            write!(f, "{}/{}", self.limit, self.window.as_secs())?;
        } else {
            write!(f, "{}/{}ms", self.limit, self.window.as_millis())?;
        }
        match self.burst {
            Some(burst) => write!(f, " burst {burst}"),
            None => Ok(()),
        }
    }
}

impl FromStr for Quota {
    type Err = QuotaError;

    /// Parses `LIMIT/WINDOW`: `LIMIT` a whole number above 0, `WINDOW` a whole number of
    /// seconds, or a whole number with a unit: `ms`, `s`, `m` (minutes), `h` or `d`; then,
    /// for GCRA, ` burst N`. Spaces around either part are ignored.
    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let malformed = || QuotaError::Malformed(text.to_owned());
        let (rate, burst) = match text.split_once(" burst ") {
            Some((rate, burst)) => (
                rate,
                Some(parse_digits(burst.trim()).ok_or_else(malformed)?),
            ),
            None => (text, None),
        };
        let (limit, window) = rate.split_once('/').ok_or_else(malformed)?;
        let limit: u64 = parse_digits(limit.trim()).ok_or_else(malformed)?;
        let window = window.trim();
        let split = window
            .find(|c: char| !c.is_ascii_digit())
            .unwrap_or(window.len());
        let (amount, unit) = window.split_at(split);
        let amount = parse_digits(amount).ok_or_else(malformed)?;
        let millis_per_unit: u64 = match unit {
            "" | "s" => 1_000,
            "ms" => 1,
            "m" => 60_000,
            "h" => 3_600_000,
            "d" => 86_400_000,
            _ => return Err(malformed()),
        };
        let millis = amount
            .checked_mul(millis_per_unit)
            .ok_or(QuotaError::InvalidWindow(Duration::MAX))?;
        let window = Duration::from_millis(millis);
        match burst {
            Some(burst) => Quota::gcra(limit, window, burst),
            None => Quota::new(limit, window),
        }
    }
}

/// ASCII digits only (no sign, no `_`), as a `u64`.
fn parse_digits(text: &str) -> Option<u64> {
    if text.is_empty() || !text.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    text.parse().ok()
}

/// Where one key stands in its current window, after counting this request.
///
/// The [`RateLimitLayer`](crate::RateLimitLayer) puts it in the request extensions of
/// every request it lets through, so a handler can read it (`Extension<Usage>` in axum).
///
/// For GCRA the "window" is the burst: [`limit`](Self::limit) is the burst,
/// [`count`](Self::count) how much of it is spent, and [`reset_after`](Self::reset_after)
/// the time until all of it is earned back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Usage {
    pub(crate) count: u64,
    pub(crate) limit: u64,
    pub(crate) reset_after: Duration,
    /// For a refused request: how long until one would pass.
    pub(crate) retry_after: Duration,
}

impl Usage {
    /// The number of requests counted in this window, this one included. Refused
    /// requests count too (as in the Redis `INCR` pattern), so it may exceed the limit.
    pub fn count(&self) -> u64 {
        self.count
    }

    /// The limit per window.
    pub fn limit(&self) -> u64 {
        self.limit
    }

    /// How many more requests this window allows: `limit - count`, at least 0. The `r`
    /// of the `RateLimit` header.
    pub fn remaining(&self) -> u64 {
        self.limit.saturating_sub(self.count)
    }

    /// Whether this request is over the limit (and is answered 429).
    pub fn is_exceeded(&self) -> bool {
        self.count > self.limit
    }

    /// The time until the window ends and the count starts again from 0, as the store
    /// reported it (`PTTL`, ms).
    pub fn reset_after(&self) -> Duration {
        self.reset_after
    }

    /// For a refused request, how long until a request on this key would pass (the
    /// `Retry-After`): the end of the window, or for GCRA the next emission.
    pub fn retry_after(&self) -> Duration {
        self.retry_after
    }

    /// A fixed window's usage.
    pub(crate) fn fixed(count: u64, limit: u64, reset_after: Duration) -> Self {
        Self {
            count,
            limit,
            reset_after,
            retry_after: reset_after,
        }
    }

    /// A GCRA decision under `quota`: `allowed` with `remaining` of the burst left, or
    /// refused for `retry_after`; all of the burst is back after `reset_after`.
    pub(crate) fn gcra(
        quota: &Quota,
        allowed: bool,
        remaining: u64,
        reset_after: Duration,
        retry_after: Duration,
    ) -> Self {
        let burst = quota.burst.unwrap_or(1);
        Self {
            count: if allowed {
                burst.saturating_sub(remaining)
            } else {
                burst.saturating_add(1)
            },
            limit: burst,
            reset_after,
            retry_after: if allowed { Duration::ZERO } else { retry_after },
        }
    }
}

#[cfg(test)]
mod tests;
