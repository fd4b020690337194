//! Hot keys answered in process: this client's own holders and acquisitions in flight.
//!
//! While this [`Redlock`](super::Redlock) holds key K, another attempt on K is answered
//! "taken" without a round trip (Redis would refuse it anyway). While an attempt on K is
//! in flight, further attempts share its outcome: a burst on one key costs one attempt.
//! The table only ever answers "taken"; a holder leaves it when released, found lost, or
//! past its validity.

use std::collections::hash_map::Entry as SlotEntry;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use tokio::sync::Notify;

use crate::backend::KeyMap;
use crate::backend::hold::HoldTimes;
use crate::error::LockError;
use crate::lease::{Lease, Token};

/// The table is swept of expired holders when it grows past this size (and past twice
/// its size after the last sweep).
const MIN_SWEEP: usize = 1024;

/// This client's holders and acquisitions in flight, and the hold times of its releases.
#[derive(Default)]
pub(super) struct LocalHolders {
    state: Mutex<HolderTable>,
}

#[derive(Default)]
struct HolderTable {
    slots: KeyMap<Arc<str>, HolderSlot>,
    /// The hold times of this client's releases, recorded as they leave `slots`.
    holds: HoldTimes,
    sweep_at: usize,
    /// Numbers the attempts, so that an attempt knows whether the slot is still its own.
    attempts: u64,
}

enum HolderSlot {
    /// An attempt of this process is in flight.
    Acquiring(InFlight),
    /// This process holds the key.
    Held(HeldLease),
}

/// The slot of an attempt in flight.
struct InFlight {
    /// Which attempt (see [`HolderTable::attempts`]).
    attempt: u64,
    /// A waiter's attempt, which marks the lock where it is held.
    waiting: bool,
    /// Where later attempts wait for its outcome; made by the first of them.
    followers: Option<Arc<Flight>>,
}

/// This process's hold on a key: its lease's token and validity.
struct HeldLease {
    token: Token,
    valid_until: Instant,
    /// When its attempt started: its hold time counts from here.
    since: Instant,
}

/// The outcome of one attempt in flight, which the attempts that arrive meanwhile share.
pub(super) struct Flight {
    outcome: Mutex<Option<Outcome>>,
    done: Notify,
}

/// How an attempt in flight ended.
#[derive(Clone)]
pub(super) enum Outcome {
    /// It acquired the key: this process holds it now.
    Won,
    /// Another holder has the key, for `retry_after` at most.
    Taken(Duration),
    /// The nodes could not decide (no quorum, too slow).
    Failed(LockError),
    /// The attempt was dropped before its verdict, or displaced by a waiting attempt:
    /// the follower enters again.
    Abandoned,
}

/// What to do about an attempt on a key.
pub(super) enum Admission<'a> {
    /// Nothing known here: send the attempt, and report its outcome through the guard.
    Lead(FlightGuard<'a>),
    /// Another attempt on the key is in flight: share its outcome.
    Follow(Arc<Flight>),
    /// This process holds the key, with `left` of validity.
    Held { left: Duration },
}

impl LocalHolders {
    fn state(&self) -> MutexGuard<'_, HolderTable> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Where an attempt on `key` stands. A `waiting` attempt (which marks the lock) does
    /// not follow a plain one: it sends its own, and the plain one's followers follow it.
    pub(super) fn enter<'a>(&'a self, key: &'a Arc<str>, waiting: bool) -> Admission<'a> {
        let now = Instant::now();
        let mut state = self.state();
        if state.slots.len() >= state.sweep_at.max(MIN_SWEEP) {
            state.slots.retain(|_, slot| match slot {
                HolderSlot::Held(holder) => holder.valid_until > now,
                HolderSlot::Acquiring(_) => true,
            });
            state.sweep_at = state.slots.len().saturating_mul(2);
        }
        state.attempts = state.attempts.wrapping_add(1);
        let ours = InFlight {
            attempt: state.attempts,
            waiting,
            followers: None,
        };
        let attempt = ours.attempt;
        let displaced = match state.slots.entry(key.clone()) {
            SlotEntry::Vacant(vacant) => {
                vacant.insert(HolderSlot::Acquiring(ours));
                None
            }
            SlotEntry::Occupied(mut occupied) => match occupied.get_mut() {
                HolderSlot::Held(holder) if holder.valid_until > now => {
                    return Admission::Held {
                        left: holder.valid_until - now,
                    };
                }
                HolderSlot::Acquiring(flight) if flight.waiting || !waiting => {
                    let followers = flight.followers.get_or_insert_with(Flight::new);
                    return Admission::Follow(followers.clone());
                }
                // A holder past its validity, or a plain attempt in flight (its followers
                // enter again; it leaves this slot alone unless it wins).
                slot => match std::mem::replace(slot, HolderSlot::Acquiring(ours)) {
                    HolderSlot::Acquiring(plain) => plain.followers,
                    HolderSlot::Held(_) => None,
                },
            },
        };
        drop(state);
        if let Some(followers) = displaced {
            followers.report(Outcome::Abandoned);
        }
        Admission::Lead(FlightGuard {
            holders: self,
            entered: now,
            key,
            attempt,
            finished: false,
        })
    }

    /// The end of the validity of this process's holder of `key`, if there is one.
    pub(super) fn holder(&self, key: &str) -> Option<Instant> {
        let now = Instant::now();
        match self.state().slots.get(key) {
            Some(HolderSlot::Held(holder)) if holder.valid_until > now => Some(holder.valid_until),
            _ => None,
        }
    }

    /// Whether `key` is in the table at all (held, even past its validity, or in flight).
    #[cfg(test)]
    pub(super) fn contains(&self, key: &str) -> bool {
        self.state().slots.contains_key(key)
    }

    /// Removes the holder of `key` with `token`; records its hold time when `released`
    /// (not for a lease found lost). Returns whether it was there.
    fn remove(&self, key: &str, token: Token, released: Option<&str>) -> bool {
        let now = released.map(|_| Instant::now());
        let mut state = self.state();
        // Put back in the rare case it is not this lease.
        let since = match state.slots.remove_entry(key) {
            Some((_, HolderSlot::Held(holder))) if holder.token == token => holder.since,
            Some((key, slot)) => {
                state.slots.insert(key, slot);
                return false;
            }
            None => return false,
        };
        if let (Some(prefix), Some(now)) = (released, now) {
            let held = now.saturating_duration_since(since);
            state.holds.record(key, prefix, held);
        }
        true
    }

    pub(super) fn retry_after(&self, key: &str, prefix: &str, holder_left: Duration) -> Duration {
        self.state().holds.retry_after(key, prefix, holder_left)
    }

    /// The lease is being released: it leaves the table, its hold time recorded. Returns
    /// whether it was there (its local waiters are then to be woken).
    pub(super) fn released(&self, key: &str, token: Token, prefix: &str) -> bool {
        self.remove(key, token, Some(prefix))
    }

    /// Forgets this process's holder of `key`, whatever its token: the lock was deleted
    /// on the nodes (a forced unlock).
    pub(super) fn forget(&self, key: &str) {
        let mut state = self.state();
        if matches!(state.slots.get(key), Some(HolderSlot::Held(_))) {
            state.slots.remove(key);
        }
    }

    /// The lease is lost (a renewal found its token gone): it leaves the table now.
    pub(super) fn lost(&self, key: &str, token: Token) {
        self.remove(key, token, None);
    }

    /// A renewal moved the lease's validity to `valid_until`.
    pub(super) fn renewed(&self, key: &str, token: Token, valid_until: Instant) {
        if let Some(HolderSlot::Held(holder)) = self.state().slots.get_mut(key) {
            if holder.token == token {
                holder.valid_until = valid_until;
            }
        }
    }

    /// Enters a lease acquired without [`enter`](Self::enter) (the idempotency layer's
    /// first step), unless the key is already in the table.
    #[cfg(feature = "idempotency")]
    pub(super) fn hold(&self, lease: &Lease) {
        let mut state = self.state();
        state
            .slots
            .entry(lease.key.clone())
            .or_insert_with(|| HolderSlot::Held(HeldLease::of(lease, Instant::now())));
    }
}

impl HeldLease {
    /// The holder of `lease`, held `since` its attempt started.
    fn of(lease: &Lease, since: Instant) -> Self {
        Self {
            token: lease.token,
            valid_until: lease.valid_until,
            since,
        }
    }
}

impl Flight {
    fn new() -> Arc<Self> {
        Arc::new(Self {
            outcome: Mutex::new(None),
            done: Notify::new(),
        })
    }

    /// Waits for the attempt's outcome.
    pub(super) async fn outcome(&self) -> Outcome {
        loop {
            let notified = self.done.notified();
            let mut notified = std::pin::pin!(notified);
            notified.as_mut().enable();
            if let Some(outcome) = self.lock().clone() {
                return outcome;
            }
            notified.await;
        }
    }

    /// Hands `outcome` to the followers.
    fn report(&self, outcome: Outcome) {
        *self.lock() = Some(outcome);
        self.done.notify_waiters();
    }

    fn lock(&self) -> MutexGuard<'_, Option<Outcome>> {
        self.outcome.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// The attempt in flight on a key: reports its outcome to the table and its followers;
/// dropped before that, it leaves the slot and lets them send their own.
pub(super) struct FlightGuard<'a> {
    holders: &'a LocalHolders,
    /// When the attempt entered the table: its start, for its validity and its hold time.
    pub(super) entered: Instant,
    key: &'a Arc<str>,
    attempt: u64,
    finished: bool,
}

impl FlightGuard<'_> {
    /// Reports the attempt's result: a lease enters the table as held.
    pub(super) fn finish(mut self, result: &Result<Lease, LockError>) {
        self.end(Some(result));
    }

    /// Ends the attempt (`None`: dropped before its verdict).
    fn end(&mut self, result: Option<&Result<Lease, LockError>>) {
        self.finished = true;
        let lease = result.and_then(|result| result.as_ref().ok());
        // Followers to tell: this attempt's own, or those of the attempt whose slot its
        // lease takes.
        let followers = {
            let mut state = self.holders.state();
            match (state.slots.get_mut(&**self.key), lease) {
                (Some(slot), Some(lease)) => {
                    // A lease is this process's holder, whoever is in the slot now.
                    match std::mem::replace(
                        slot,
                        HolderSlot::Held(HeldLease::of(lease, self.entered)),
                    ) {
                        HolderSlot::Acquiring(flight) => {
                            flight.followers.map(|f| (f, Outcome::Won))
                        }
                        HolderSlot::Held(_) => None,
                    }
                }
                (None, Some(lease)) => {
                    state.slots.insert(
                        self.key.clone(),
                        HolderSlot::Held(HeldLease::of(lease, self.entered)),
                    );
                    None
                }
                (Some(HolderSlot::Acquiring(flight)), None) if flight.attempt == self.attempt => {
                    let followers = flight.followers.take();
                    state.slots.remove(&**self.key);
                    followers.map(|f| (f, outcome_of(result)))
                }
                (_, None) => None,
            }
        };
        if let Some((followers, outcome)) = followers {
            followers.report(outcome);
        }
    }
}

/// What the followers of an attempt learn from its `result` (`None`: abandoned).
fn outcome_of(result: Option<&Result<Lease, LockError>>) -> Outcome {
    match result {
        Some(Ok(_)) => Outcome::Won,
        Some(Err(LockError::Taken { retry_after })) => Outcome::Taken(*retry_after),
        Some(Err(e)) => Outcome::Failed(e.clone()),
        None => Outcome::Abandoned,
    }
}

impl Drop for FlightGuard<'_> {
    fn drop(&mut self) {
        if !self.finished {
            self.end(None);
        }
    }
}

#[cfg(test)]
mod tests;
