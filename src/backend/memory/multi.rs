//! Leases on several keys at once, in process: all of them or none, under one mutex.

use std::sync::Arc;
use std::time::Instant;

use super::{HeldKey, MemoryLocks};
use crate::backend::contract::LockResult;
use crate::error::LockError;
use crate::holder::HolderRef;
use crate::key::{KeyError, MAX_KEYS_PER_LEASE};
use crate::lease::{Lease, Shape, Token};

impl MemoryLocks {
    /// Takes the sorted, distinct `keys`, all or none; each records `holder`.
    pub(crate) fn acquire_all(&self, keys: &Arc<[Arc<str>]>, holder: HolderRef<'_>) -> LockResult {
        let first = match &keys[..] {
            [key] => return self.acquire_from(key.clone(), Instant::now(), holder),
            [first, ..] => first,
            [] => {
                return Err(KeyError::KeyCount {
                    count: 0,
                    max: MAX_KEYS_PER_LEASE,
                }
                .into());
            }
        };
        let token = Token::unique();
        let ttl = self.inner.policy.ttl;
        let now = Instant::now();
        let expires_at = now + ttl;
        let mut state = self.state();
        let longest = keys.iter().filter_map(|key| state.held_for(key, now)).max();
        if let Some(retry_after) = longest {
            return Err(LockError::Taken { retry_after });
        }
        state.sweep(now);
        let holder = holder.to_holder();
        for key in keys.iter() {
            let held = HeldKey {
                token,
                expires_at,
                since: now,
                holder: holder.clone(),
            };
            state.keys.entry(key.clone()).or_default().holder = Some(held);
        }
        Ok(self.lease(
            &mut state,
            first.clone(),
            Shape::Set(keys.clone()),
            token,
            expires_at,
        ))
    }

    /// Extends every key of an exclusive lease, if every one of them still holds its token.
    pub(super) fn extend_all(&self, lease: &mut Lease, keys: &[Arc<str>]) -> Result<(), LockError> {
        let now = Instant::now();
        let mut state = self.state();
        let mut taken_over = false;
        let mut lost = false;
        for key in keys {
            match state.keys.get(key).and_then(|k| k.holder.as_ref()) {
                Some(held) if held.token == lease.token && held.expires_at > now => {}
                Some(held) => {
                    lost = true;
                    taken_over |= held.token != lease.token && held.expires_at > now;
                }
                None => lost = true,
            }
        }
        if lost {
            return Err(LockError::Expired { taken_over });
        }
        let expires_at = now + self.inner.policy.ttl;
        for key in keys {
            if let Some(held) = state.keys.get_mut(key).and_then(|k| k.holder.as_mut()) {
                held.expires_at = expires_at;
            }
        }
        lease.valid_until = expires_at;
        Ok(())
    }

    /// Releases every key of a set lease that still holds its token; another holder's
    /// keys are left alone.
    pub(super) fn unlock_all(&self, lease: &Lease, keys: &[Arc<str>]) -> Result<(), LockError> {
        let now = Instant::now();
        let mut state = self.state();
        let mut taken_over = false;
        let mut expired = false;
        for key in keys {
            match state.keys.get(key).and_then(|k| k.holder.as_ref()) {
                Some(held) if held.token == lease.token => {
                    expired |= held.expires_at <= now;
                    state.let_go(key);
                }
                Some(held) => {
                    expired = true;
                    taken_over |= held.expires_at > now;
                }
                None => expired = true,
            }
        }
        drop(state);
        for key in keys {
            self.inner.waiters.wake(key);
        }
        if expired {
            Err(LockError::Expired { taken_over })
        } else {
            Ok(())
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::key::{KeyError, MAX_KEYS_PER_LEASE};

    fn is_taken(result: LockResult) -> bool {
        matches!(result, Err(LockError::Taken { .. }))
    }

    #[test]
    fn an_empty_set_is_refused_not_a_panic() {
        let locks = MemoryLocks::new();
        let none: Arc<[Arc<str>]> = Arc::new([]);
        assert!(matches!(
            locks.acquire_all(&none, HolderRef::Direct),
            Err(LockError::InvalidKey(KeyError::KeyCount { count: 0, .. }))
        ));
    }

    #[test]
    fn all_or_none_when_one_key_is_taken() {
        let locks = MemoryLocks::new();
        let bob = locks.try_lock("bob").unwrap();
        assert!(is_taken(locks.try_lock_all(["alice", "bob"])));
        // Alice was not left locked by the attempt.
        let alice = locks.try_lock("alice").unwrap();
        locks.release(&alice).unwrap();
        locks.release(&bob).unwrap();
        let both = locks.try_lock_all(["bob", "alice"]).unwrap();
        assert_eq!(
            both.keys().collect::<Vec<_>>(),
            ["tower-redlock:alice", "tower-redlock:bob"]
        );
        assert_eq!(both.key(), "tower-redlock:alice");
        assert!(is_taken(locks.try_lock("alice")));
        assert!(is_taken(locks.try_lock("bob")));
        locks.release(&both).unwrap();
        locks.try_lock_all(["alice", "bob"]).unwrap();
    }

    #[test]
    fn retry_after_is_the_longest_holder() {
        let short = MemoryLocks::builder()
            .ttl(Duration::from_secs(5))
            .build()
            .unwrap();
        let _a = short.try_lock("a").unwrap();
        // Same locks, a longer lease on b.
        let long = MemoryLocks {
            inner: short.inner.clone(),
        };
        let mut b = long.try_lock("b").unwrap();
        {
            let mut state = long.state();
            let held = state.keys.get_mut(&b.key).unwrap().holder.as_mut().unwrap();
            held.expires_at = Instant::now() + Duration::from_secs(60);
            b.valid_until = held.expires_at;
        }
        let Err(LockError::Taken { retry_after }) = short.try_lock_all(["a", "b", "c"]) else {
            panic!("taken")
        };
        assert!(retry_after > Duration::from_secs(50), "{retry_after:?}");
    }

    #[test]
    fn extend_and_unlock_act_on_every_key() {
        let locks = MemoryLocks::new();
        let mut both = locks.try_lock_all(["x", "y"]).unwrap();
        locks.extend_lease(&mut both).unwrap();
        // One key taken behind the holder's back: the set is lost.
        locks.state().let_go("tower-redlock:y");
        let thief = locks.try_lock("y").unwrap();
        assert!(matches!(
            locks.extend_lease(&mut both.clone()),
            Err(LockError::Expired { taken_over: true })
        ));
        assert!(matches!(
            locks.release(&both),
            Err(LockError::Expired { taken_over: true })
        ));
        // The thief's key was left alone; ours was released.
        assert!(is_taken(locks.try_lock("y")));
        locks.try_lock("x").unwrap();
        locks.release(&thief).unwrap();
    }

    #[test]
    fn key_counts_are_bounded_and_one_key_is_a_plain_lease() {
        let locks = MemoryLocks::new();
        let none: [&str; 0] = [];
        assert!(matches!(
            locks.try_lock_all(none),
            Err(LockError::InvalidKey(KeyError::KeyCount { count: 0, .. }))
        ));
        let many: Vec<String> = (0..=MAX_KEYS_PER_LEASE).map(|i| i.to_string()).collect();
        assert!(matches!(
            locks.try_lock_all(&many),
            Err(LockError::InvalidKey(KeyError::KeyCount { .. }))
        ));
        assert!(locks.try_lock_all(&many[..MAX_KEYS_PER_LEASE]).is_ok());
        // Many duplicates of few keys are few keys, and a new key after them counts.
        let mut repeated = vec!["r1".to_owned(); 10 * MAX_KEYS_PER_LEASE];
        repeated.push("r2".to_owned());
        let lease = locks.try_lock_all(&repeated).unwrap();
        assert_eq!(lease.keys().count(), 2);
        let one = locks.try_lock_all(["same", "same"]).unwrap();
        assert_eq!(one.shape, Shape::Lock);
        assert_eq!(one.keys().count(), 1);
        assert!(matches!(
            locks.try_lock_all(["ok", ""]),
            Err(LockError::InvalidKey(KeyError::Empty))
        ));
    }
}
