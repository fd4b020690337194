//! The in-process lock table itself: expiry at its instant, the sweep of expired keys and
//! its bound, a stale lease against the next holder, and the builder's settings as the
//! store applies them. Instants are given, not waited for: an acquisition "at" a past
//! instant makes a lease that has already expired.

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::{HeldKey, MIN_SWEEP, MemoryLocks};
use crate::backend::contract::LockBackend as _;
use crate::error::LockError;
use crate::holder::HolderRef;
use crate::lease::{Access, Token};

mod waiting;

const TTL: Duration = Duration::from_secs(1);

fn locks() -> MemoryLocks {
    MemoryLocks::builder().ttl(TTL).build().unwrap()
}

/// A lease on `key` taken long enough ago that it has expired.
fn take_expired(locks: &MemoryLocks, key: &str) {
    let long_ago = Instant::now() - 10 * TTL;
    locks
        .acquire_from(Arc::from(key), long_ago, HolderRef::Direct)
        .unwrap();
}

fn take_live(locks: &MemoryLocks, key: &str) {
    locks.acquire(Arc::from(key)).unwrap();
}

fn key_count(locks: &MemoryLocks) -> usize {
    locks.state().keys.len()
}

#[test]
fn a_key_is_not_held_at_the_instant_it_expires() {
    let at = Instant::now();
    let held = HeldKey {
        token: Token::unique(),
        expires_at: at,
        since: at,
        holder: HolderRef::Direct.to_holder(),
    };
    assert_eq!(
        held.left(at),
        None,
        "held at its expiry instant (Redis: gone)"
    );
    let before = at - Duration::from_millis(1);
    assert_eq!(held.left(before), Some(Duration::from_millis(1)));
}

#[test]
fn expired_keys_are_swept_once_the_table_reaches_its_bound() {
    let locks = locks();
    for i in 0..MIN_SWEEP - 1 {
        take_expired(&locks, &format!("old-{i}"));
    }
    take_live(&locks, "live-0");
    assert_eq!(key_count(&locks), MIN_SWEEP, "swept below the bound");
    // At the bound, the next acquisition sweeps: the expired go, the live one stays.
    take_live(&locks, "live-1");
    assert_eq!(key_count(&locks), 2);
    assert!(matches!(
        locks.acquire(Arc::from("live-0")),
        Err(LockError::Taken { .. })
    ));
}

#[test]
fn after_a_sweep_the_bound_is_twice_the_keys_left() {
    let locks = locks();
    let live = MIN_SWEEP + 100;
    for i in 0..live {
        take_live(&locks, &format!("live-{i}"));
    }
    for i in 0..10 {
        take_expired(&locks, &format!("old-{i}"));
    }
    // The last sweep (at MIN_SWEEP keys, all live) set the bound to 2 × MIN_SWEEP: no sweep
    // yet, whatever has expired.
    take_live(&locks, "one-more");
    assert_eq!(key_count(&locks), live + 11);
    assert!(locks.state().sweep_at >= 2 * MIN_SWEEP);
}

#[test]
fn a_stale_lease_cannot_release_the_next_holders_key() {
    let locks = locks();
    let long_ago = Instant::now() - 10 * TTL;
    let stale = locks
        .acquire_from(Arc::from("k"), long_ago, HolderRef::Direct)
        .unwrap();
    let next = locks.acquire(Arc::from("k")).unwrap();
    assert!(matches!(
        locks.release(&stale),
        Err(LockError::Expired { taken_over: true })
    ));
    assert!(
        locks.inspect_key("k").is_held(),
        "the next holder's key was released"
    );
    locks.release(&next).unwrap();
    assert!(!locks.inspect_key("k").is_held());
}

#[test]
fn debug_shows_the_settings_and_the_key_count() {
    let locks = locks();
    take_live(&locks, "k");
    let shown = format!("{locks:?}");
    assert!(shown.starts_with("MemoryLocks {"), "{shown}");
    assert!(shown.contains("ttl: 1s"), "{shown}");
    assert!(shown.contains("keys: 1"), "{shown}");
}

#[test]
fn inspect_names_the_replica_id_set_on_the_builder() {
    let locks = MemoryLocks::builder().replica_id("pod-7").build().unwrap();
    let lease = locks.try_lock("k").unwrap();
    let holder = locks.inspect_key(lease.key()).holder.expect("a holder");
    assert_eq!(holder.replica, "pod-7");
}

#[cfg(feature = "idempotency")]
#[test]
fn the_record_bounds_set_on_the_builder_hold() {
    use bytes::Bytes;

    let ttl = Duration::from_secs(60);
    let locks = MemoryLocks::builder()
        .max_records(2, 1 << 20)
        .build()
        .unwrap();
    for owner in 1..=3 {
        let key = Arc::from(format!("r-{owner}"));
        assert!(
            locks
                .records()
                .insert(key, owner, Bytes::from_static(b"x"), ttl)
        );
    }
    assert_eq!(
        locks.records().usage().0,
        2,
        "more records kept than max_records"
    );

    let locks = MemoryLocks::builder()
        .max_records_per_principal(1)
        .build()
        .unwrap();
    for (key, owner) in [("a", 7), ("b", 7), ("c", 8)] {
        assert!(
            locks
                .records()
                .insert(Arc::from(key), owner, Bytes::from_static(b"x"), ttl)
        );
    }
    assert_eq!(
        locks.records().usage().0,
        2,
        "one principal kept more than its bound"
    );
    assert!(
        locks.records().get("a").is_none(),
        "its oldest record stayed"
    );
    assert!(
        locks.records().get("c").is_some(),
        "another principal's record went"
    );
}

#[test]
fn a_release_records_how_long_a_live_lease_was_held_and_an_expired_one_nothing() {
    let locks = locks();
    let prefix = locks.prefix().to_owned();
    let key = format!("{prefix}report:1");
    let held_for = Duration::from_millis(300);
    let lease = locks
        .acquire_from(
            Arc::from(key.as_str()),
            Instant::now() - held_for,
            HolderRef::Direct,
        )
        .unwrap();
    locks.release(&lease).unwrap();
    let estimate = locks
        .state()
        .holds
        .estimate(&format!("{prefix}report:2"), &prefix);
    assert!(
        estimate.is_some_and(|e| e >= held_for && e < TTL),
        "hold time recorded: {estimate:?}"
    );

    let locks = self::locks();
    let lease = locks
        .acquire_from(Arc::from("x"), Instant::now() - 10 * TTL, HolderRef::Direct)
        .unwrap();
    assert!(matches!(
        locks.release(&lease),
        Err(LockError::Expired { taken_over: false })
    ));
    assert_eq!(locks.state().holds.estimate("x", &prefix), None);
}

#[test]
fn force_unlock_frees_a_live_key_and_counts_only_what_was_held() {
    let locks = locks();
    take_live(&locks, "live");
    take_expired(&locks, "old");
    assert_eq!(locks.force_unlock_key("live"), 1);
    assert!(!locks.inspect_key("live").is_held());
    take_live(&locks, "live");
    assert_eq!(
        locks.force_unlock_key("old"),
        0,
        "an expired key counted as held"
    );
    assert_eq!(locks.force_unlock_key("free"), 0);
    assert_eq!(
        key_count(&locks),
        1,
        "the forced keys were left in the table"
    );
}

#[tokio::test]
async fn inspect_says_a_plain_waiter_waits() {
    let locks = locks();
    let key: Arc<str> = Arc::from("busy");
    let lease = locks.acquire(key.clone()).unwrap();
    assert!(!locks.inspect_key(&key).waiters);
    let waiter = {
        let (locks, key) = (locks.clone(), key.clone());
        tokio::spawn(async move {
            let holder = HolderRef::Direct.to_holder();
            locks
                .lock_within(key, None, Duration::from_secs(5), &holder)
                .await
        })
    };
    // On this single-threaded runtime the yield runs the waiter until it waits.
    tokio::task::yield_now().await;
    let seen = locks.inspect_key(&key);
    assert!(seen.waiters, "{seen:?}");
    assert!(seen.is_held() && seen.readers == 0);
    locks.release(&lease).unwrap();
    let next = tokio::time::timeout(Duration::from_secs(5), waiter).await;
    assert!(next.expect("woken by the release").unwrap().is_ok());
}

#[test]
fn retry_estimate_without_history_is_what_the_holder_has_left() {
    let locks = locks();
    let left = Duration::from_millis(700);
    assert_eq!(locks.retry_estimate("tower-redlock:k", left), left);
}

#[test]
fn readers_are_counted_while_live_and_pruned_once_expired() {
    let locks = locks();
    let key: Arc<str> = Arc::from("shared");
    for _ in 0..2 {
        locks
            .acquire_access(key.clone(), Access::Shared, HolderRef::Direct)
            .unwrap();
    }
    assert_eq!(locks.inspect_key(&key).readers, 2);
    let third = locks
        .acquire_access(key.clone(), Access::Shared, HolderRef::Direct)
        .unwrap();
    assert!(
        third.valid_until() >= Instant::now() + TTL / 2,
        "a reader's lease born expired"
    );
    // Seen from after their TTL: pruned, and the key with them.
    let later = Instant::now() + 2 * TTL;
    locks.state().modes(&key, later, |_| ());
    assert_eq!(key_count(&locks), 0, "expired readers were kept");
}

#[cfg(feature = "idempotency")]
#[test]
fn a_stored_record_is_found_by_the_next_request_and_the_lock_released() {
    use crate::backend::records::{Begin, NewRecord};
    use bytes::Bytes;

    let locks = locks();
    let key: Arc<str> = Arc::from("tower-redlock:order-1");
    let Ok(Begin::Acquired(lease)) = locks.begin_idempotent_now(key.clone(), HolderRef::Direct)
    else {
        panic!("the first request does not run");
    };
    let raw = Bytes::from_static(b"stored response");
    let record = NewRecord {
        raw: raw.clone(),
        owner: 1,
        ttl: Duration::from_secs(60),
    };
    locks.store_and_release(lease, Some(record));
    assert!(
        !locks.inspect_key(&key).is_held(),
        "the lock outlived the request"
    );
    match locks.begin_idempotent_now(key, HolderRef::Direct) {
        Ok(Begin::Found(found)) => assert_eq!(found, raw),
        _ => panic!("the record was not found"),
    }
}

#[tokio::test]
async fn a_handle_over_the_store_uses_its_settings() {
    let store = MemoryLocks::builder()
        .ttl(TTL)
        .prefix("app:")
        .build()
        .unwrap();
    let locks = crate::Locks::from(store);
    let lease = locks.try_lock("k").await.unwrap();
    assert_eq!(lease.key(), "app:k");
    assert_eq!(lease.ttl(), TTL);
}

#[test]
fn has_waiters_is_a_waiting_writer_or_a_queued_fair_waiter() {
    use super::modes::KeyModes;

    let mut modes = KeyModes::default();
    assert!(!modes.has_waiters());
    modes.writers_waiting = 1;
    assert!(modes.has_waiters());
    modes.writers_waiting = 0;
    modes.queue.push_back((Token::unique(), None));
    assert!(modes.has_waiters());

    // Through `inspect`: readers alone are not waiters.
    let locks = locks();
    let key: Arc<str> = Arc::from("read");
    locks
        .acquire_access(key.clone(), Access::Shared, HolderRef::Direct)
        .unwrap();
    assert!(!locks.inspect_key(&key).waiters);
}

/// Sets the expiry of every reader of `key` to just before now.
fn expire_readers(locks: &MemoryLocks, key: &str) {
    let past = Instant::now() - Duration::from_millis(1);
    let mut state = locks.state();
    let modes = state.keys.get_mut(key).and_then(|k| k.modes.as_deref_mut());
    for expiry in modes.expect("readers").readers.values_mut() {
        *expiry = past;
    }
}

#[test]
fn a_live_reader_extends_and_an_expired_one_neither_extends_nor_releases() {
    let locks = locks();
    let key: Arc<str> = Arc::from("read");
    let mut live = locks
        .acquire_access(key.clone(), Access::Shared, HolderRef::Direct)
        .unwrap();
    let before = Instant::now();
    locks.extend_lease(&mut live).unwrap();
    assert!(
        live.valid_until() >= before + TTL,
        "extended to less than a TTL"
    );
    expire_readers(&locks, &key);
    assert!(matches!(
        locks.extend_lease(&mut live),
        Err(LockError::Expired { taken_over: false })
    ));
    assert!(matches!(
        locks.release(&live),
        Err(LockError::Expired { taken_over: false })
    ));
    let fresh = locks
        .acquire_access(key.clone(), Access::Shared, HolderRef::Direct)
        .unwrap();
    locks.release(&fresh).unwrap();
}

#[test]
fn a_sweep_drops_a_key_left_with_expired_readers_only() {
    let locks = locks();
    let key: Arc<str> = Arc::from("read");
    locks
        .acquire_access(key.clone(), Access::Shared, HolderRef::Direct)
        .unwrap();
    let mut state = locks.state();
    state.sweep_at = 0;
    state.sweep(Instant::now() + 2 * TTL);
    assert!(
        state.keys.is_empty(),
        "a key with expired readers only was kept"
    );
}

#[test]
fn a_set_lease_says_taken_over_only_for_another_holders_live_key() {
    let locks = locks();
    let keys: Arc<[Arc<str>]> = Arc::from([Arc::from("a"), Arc::from("b")]);
    let expire = |key: &str| {
        let mut state = locks.state();
        let held = state.keys.get_mut(key).and_then(|k| k.holder.as_mut());
        held.expect("held").expires_at = Instant::now() - Duration::from_millis(1);
    };

    // One of its own keys ran out: lost, and nobody took it.
    let mut lease = locks.acquire_all(&keys, HolderRef::Direct).unwrap();
    expire("b");
    assert!(matches!(
        locks.extend_lease(&mut lease),
        Err(LockError::Expired { taken_over: false })
    ));
    // Another holder has it now: lost to that holder.
    let other = locks.acquire(Arc::from("b")).unwrap();
    assert!(matches!(
        locks.extend_lease(&mut lease),
        Err(LockError::Expired { taken_over: true })
    ));
    assert!(matches!(
        locks.release(&lease),
        Err(LockError::Expired { taken_over: true })
    ));
    assert!(
        locks.inspect_key("b").is_held(),
        "another holder's key was released"
    );
    assert!(
        !locks.inspect_key("a").is_held(),
        "its own key was left behind"
    );
    // The other holder's key ran out too: lost, but nobody holds it now.
    expire("b");
    assert!(matches!(
        locks.extend_lease(&mut lease),
        Err(LockError::Expired { taken_over: false })
    ));
    let _ = other;

    // Released with one of its own keys run out: said, and both keys let go.
    let keys: Arc<[Arc<str>]> = Arc::from([Arc::from("c"), Arc::from("d")]);
    let lease = locks.acquire_all(&keys, HolderRef::Direct).unwrap();
    expire("d");
    assert!(matches!(
        locks.release(&lease),
        Err(LockError::Expired { taken_over: false })
    ));
    assert!(!locks.state().keys.contains_key("c") && !locks.state().keys.contains_key("d"));
}

#[test]
fn what_expires_at_an_instant_is_gone_at_that_instant() {
    use super::modes::{KeyModes, prune};

    // As a Redis key whose PX ran out: at its expiry it is no longer there.
    let at = Instant::now();
    let locks = locks();
    take_live(&locks, "k");
    let mut state = locks.state();
    let held = state.keys.get_mut("k").and_then(|k| k.holder.as_mut());
    held.unwrap().expires_at = at;
    state.sweep_at = 0;
    state.sweep(at);
    assert!(state.keys.is_empty(), "a holder kept at its expiry instant");
    drop(state);

    let mut reader = KeyModes::default();
    reader.readers.insert(Token::unique(), at);
    assert_eq!(reader.live_readers(at), 0);
    assert_eq!(reader.last_reader(at), None);
    let mut reader = Some(Box::new(reader));
    prune(&mut reader, at);
    assert!(reader.is_none(), "a reader kept at its expiry instant");

    let mut queued = KeyModes::default();
    queued.queue.push_back((Token::unique(), Some(at)));
    let mut queued = Some(Box::new(queued));
    prune(&mut queued, at);
    assert!(queued.is_none(), "a fair waiter kept at its deadline");
}
