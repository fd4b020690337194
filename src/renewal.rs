//! The renewal schedule every expiring hold shares: a lock's lease (through the
//! [`Watchdog`](crate::lock::watchdog::Watchdog)) and a concurrency limit's permit. A
//! [`Schedule`] extends the hold every `every` up to `max_hold` in all, reports it lost when
//! a renewal finds it gone or the validity runs out, and retries other failures soon.

// With the concurrency limit alone and no Redis, nothing expires, so nothing is renewed:
// `Renewal` is accepted by the layer, and the schedule goes unused.
#![cfg_attr(not(any(feature = "lock", feature = "redis")), allow(dead_code))]

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use tokio::time::Sleep;

use crate::future::BoxFuture;
use crate::redact::LogKey;

/// How a held lease, or a concurrency permit, is renewed while the protected work runs
/// (the "watchdog"): by default every TTL/3, up to 10 × TTL in all, so that a stuck handler
/// cannot hold a key forever (the lease then runs out and is treated as lost).
///
/// ```
/// use std::time::Duration;
/// use tower_redlock::Renewal;
///
/// let renewal = Renewal::default()
///     .every(Duration::from_secs(2))
///     .max_hold(Duration::from_secs(120));
/// let none = Renewal::disabled();
/// ```
#[derive(Debug, Clone, Copy)]
pub struct Renewal {
    enabled: bool,
    every: Option<Duration>,
    max_hold: Option<Duration>,
}

impl Default for Renewal {
    fn default() -> Self {
        Self {
            enabled: true,
            every: None,
            max_hold: None,
        }
    }
}

impl Renewal {
    /// No renewal: the lease lives one TTL from acquisition (it is still reported lost
    /// when its validity ends).
    pub fn disabled() -> Self {
        Self {
            enabled: false,
            ..Self::default()
        }
    }

    /// Renew this often. Default: a third of the TTL; at most half the TTL (a longer
    /// period is shortened to that, so that a renewal lands within the validity); zero
    /// disables renewal.
    #[must_use]
    pub fn every(mut self, every: Duration) -> Self {
        self.every = Some(every);
        self
    }

    /// Stop renewing this long after acquisition. Default: 10 × TTL.
    #[must_use]
    pub fn max_hold(mut self, max_hold: Duration) -> Self {
        self.max_hold = Some(max_hold);
        self
    }
}

/// Why a renewal failed: the hold is gone (lost), or the backend could not say (retried).
pub(crate) trait RenewError: fmt::Display {
    /// Whether the hold is gone: its token is no longer stored.
    fn is_gone(&self) -> bool;
}

/// When to renew a hold, the renewal in flight, and whether the hold was lost.
pub(crate) struct Schedule<E> {
    /// How often to renew (`None`: never), and until when.
    pub(crate) every: Option<Duration>,
    stop_renewing_at: Option<Instant>,
    /// The validity as the last renewal left it.
    valid_until: Instant,
    next_renewal: Instant,
    /// A renewal in flight: the new end of the validity.
    extending: Option<BoxFuture<Result<Instant, E>>>,
    timer: Option<Pin<Box<Sleep>>>,
    lost: bool,
}

impl<E: RenewError> Schedule<E> {
    /// The schedule of a hold of `ttl` valid until `valid_until`.
    pub(crate) fn new(valid_until: Instant, ttl: Duration, renewal: Renewal) -> Self {
        let every = renewal.every.unwrap_or(ttl / 3).min(ttl / 2);
        let every = (renewal.enabled && !every.is_zero()).then_some(every);
        let max_hold = renewal.max_hold.unwrap_or(ttl.saturating_mul(10));
        // The acquisition started a little before `valid_until - ttl` (by the time it took
        // and the drift allowance): counting from there renews and stops renewing a little
        // early, never late, and reads no clock.
        let acquired = valid_until.checked_sub(ttl).unwrap_or(valid_until);
        Self {
            every,
            stop_renewing_at: acquired.checked_add(max_hold),
            valid_until,
            next_renewal: every
                .and_then(|every| acquired.checked_add(every))
                .unwrap_or(acquired),
            extending: None,
            timer: None,
            lost: false,
        }
    }

    /// Whether a renewal is in flight.
    pub(crate) fn is_renewing(&self) -> bool {
        self.extending.is_some()
    }

    /// Whether the validity is still running, checked on the clock now.
    pub(crate) fn is_valid(&self) -> bool {
        !self.lost && Instant::now() < self.valid_until
    }

    /// Whether the hold was found lost.
    #[cfg(any(feature = "lock", test))]
    pub(crate) fn is_lost(&self) -> bool {
        self.lost
    }

    fn mark_lost(&mut self) -> Poll<()> {
        self.lost = true;
        self.extending = None;
        self.timer = None;
        Poll::Ready(())
    }

    /// Drives renewals; `Ready` once the hold is lost (and on every poll after that).
    /// `renew(valid_until)` starts one renewal, which answers the new end of the
    /// validity; `renewed` hears of each that succeeded. `key` names the hold in logs.
    pub(crate) fn poll_lost(
        &mut self,
        cx: &mut Context<'_>,
        key: &str,
        mut renew: impl FnMut(Instant) -> BoxFuture<Result<Instant, E>>,
        mut renewed: impl FnMut(Instant),
    ) -> Poll<()> {
        if self.lost {
            return Poll::Ready(());
        }
        loop {
            if let Some(extending) = self.extending.as_mut() {
                if let Poll::Ready(result) = extending.as_mut().poll(cx) {
                    self.extending = None;
                    let now = Instant::now();
                    match result {
                        Ok(until) => {
                            self.valid_until = until;
                            renewed(until);
                            self.next_renewal = now
                                .checked_add(self.every.unwrap_or_default())
                                .unwrap_or(now);
                        }
                        Err(e) if e.is_gone() => {
                            tracing::warn!(key = %LogKey(key), error = %e, "lost: renewal found the token gone");
                            return self.mark_lost();
                        }
                        Err(e) => {
                            // Still valid until valid_until: try again soon.
                            tracing::warn!(key = %LogKey(key), error = %e, "renewal failed; retrying");
                            let retry = self.every.unwrap_or_default() / 4;
                            self.next_renewal = now
                                .checked_add(retry.max(Duration::from_millis(10)))
                                .unwrap_or(now);
                        }
                    }
                }
            }
            let now = Instant::now();
            if now >= self.valid_until {
                tracing::warn!(key = %LogKey(key), "lost: its validity ended");
                return self.mark_lost();
            }
            let renewing =
                self.every.is_some() && self.stop_renewing_at.is_none_or(|stop| now < stop);
            if renewing && self.extending.is_none() && now >= self.next_renewal {
                self.extending = Some(renew(self.valid_until));
                continue;
            }
            let wake_at = if renewing && self.extending.is_none() {
                self.next_renewal.min(self.valid_until)
            } else {
                self.valid_until
            };
            let timer = self
                .timer
                .get_or_insert_with(|| Box::pin(tokio::time::sleep_until(wake_at.into())));
            if timer.deadline() != wake_at.into() {
                timer.as_mut().reset(wake_at.into());
            }
            if timer.as_mut().poll(cx).is_pending() {
                return Poll::Pending;
            }
        }
    }
}

impl<E> fmt::Debug for Schedule<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Schedule")
            .field("every", &self.every)
            .field("valid_until", &self.valid_until)
            .field("lost", &self.lost)
            .finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests;
