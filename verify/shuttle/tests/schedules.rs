//! The in-process stores under shuttle's schedules: a few tasks on a few keys, each
//! waiting (`LockRequest::wait`, a concurrency permit's wait) as long as it takes, over
//! thousands of schedules drawn at random and by PCT (probabilistic concurrency testing).
//!
//! In this build (`--cfg shuttle`) the stores' `Mutex`, atomics and `Notify` are shuttle's
//! and the fallback timers never fire (`src/sync.rs`), so every schedule checks:
//! - mutual exclusion: never two holders of a key (a plain or exclusive lock), never a
//!   writer beside a reader, never more permits than the limit;
//! - wake-ups are never lost: every waiter gets its turn from a release's notification
//!   alone (a lost one leaves it waiting forever, which shuttle reports as a deadlock);
//! - nothing leaks: at the end no key is held or waited on, no permit is counted.
//!
//! `SHUTTLE_ITERATIONS` sets the schedules per scheduler and check (default 5000).
#![cfg(shuttle)]
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing)]

use std::sync::Arc;
use std::time::Duration;

use shuttle::future::{block_on, spawn, yield_now};
use shuttle::sync::atomic::{AtomicUsize, Ordering};
use tower_redlock::shuttle_hooks::permit;
use tower_redlock::{
    ConcurrencyLimiter, LockMode, LockRequest, Locks, MemoryConcurrencyLimiter, MemoryLocks,
};

/// Longer than any schedule: a waiter gives up only when woken never again.
const FOREVER: Duration = Duration::from_secs(3600);

const KEYS: [&str; 2] = ["a", "b"];

fn iterations() -> usize {
    std::env::var("SHUTTLE_ITERATIONS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(5000)
}

/// `check` under the random scheduler, then under PCT with depth 3.
fn explore(check: fn()) {
    shuttle::check_random(check, iterations());
    shuttle::check_pct(check, iterations(), 3);
}

/// How many are inside, per key; panics when `allowed` is exceeded.
struct Inside(Vec<AtomicUsize>);

impl Inside {
    fn new() -> Arc<Self> {
        Arc::new(Self(KEYS.iter().map(|_| AtomicUsize::new(0)).collect()))
    }

    fn enter(&self, key: usize, allowed: usize) {
        let before = self.0[key].fetch_add(1, Ordering::SeqCst);
        assert!(before < allowed, "{} inside key {key}", before + 1);
    }

    fn leave(&self, key: usize) {
        self.0[key].fetch_sub(1, Ordering::SeqCst);
    }

    fn count(&self, key: usize) -> usize {
        self.0[key].load(Ordering::SeqCst)
    }
}

async fn nothing_left(locks: &Locks) {
    for key in KEYS {
        let seen = locks.inspect(key).await.unwrap();
        assert!(!seen.is_held(), "{key} still held: {seen:?}");
        assert!(!seen.waiters, "{key} still waited on: {seen:?}");
    }
}

/// Three tasks, two rounds each on alternating keys, all waiting.
fn plain_locks() {
    block_on(async {
        let locks = Locks::from(MemoryLocks::new());
        let inside = Inside::new();
        let tasks: Vec<_> = (0..3)
            .map(|task| {
                let (locks, inside) = (locks.clone(), inside.clone());
                spawn(async move {
                    for round in 0..2 {
                        let key = (task + round) % KEYS.len();
                        let request = LockRequest::new(KEYS[key]).wait(FOREVER);
                        let lease = locks
                            .acquire(request)
                            .await
                            .expect("a waiter gets its turn");
                        inside.enter(key, 1);
                        yield_now().await;
                        inside.leave(key);
                        locks
                            .unlock(lease)
                            .await
                            .expect("a valid lease is released");
                    }
                })
            })
            .collect();
        for task in tasks {
            task.await.unwrap();
        }
        nothing_left(&locks).await;
    });
}

#[test]
fn plain_locks_exclude_and_wake_every_waiter() {
    explore(plain_locks);
}

/// Two readers and two writers on one key: writers alone, readers together.
fn shared_and_exclusive() {
    block_on(async {
        let locks = Locks::from(MemoryLocks::new());
        let (readers, writers) = (Inside::new(), Inside::new());
        let tasks: Vec<_> = (0..4)
            .map(|task| {
                let (locks, readers, writers) = (locks.clone(), readers.clone(), writers.clone());
                let writer = task % 2 == 0;
                spawn(async move {
                    let mode = if writer {
                        LockMode::Exclusive
                    } else {
                        LockMode::Shared
                    };
                    let request = LockRequest::new(KEYS[0]).mode(mode).wait(FOREVER);
                    let lease = locks
                        .acquire(request)
                        .await
                        .expect("a waiter gets its turn");
                    if writer {
                        writers.enter(0, 1);
                        assert_eq!(readers.count(0), 0, "a writer beside a reader");
                    } else {
                        readers.enter(0, 2);
                        assert_eq!(writers.count(0), 0, "a reader beside a writer");
                    }
                    yield_now().await;
                    if writer {
                        writers.leave(0)
                    } else {
                        readers.leave(0)
                    }
                    locks
                        .unlock(lease)
                        .await
                        .expect("a valid lease is released");
                })
            })
            .collect();
        for task in tasks {
            task.await.unwrap();
        }
        nothing_left(&locks).await;
    });
}

#[test]
fn shared_and_exclusive_leases_exclude_and_wake_every_waiter() {
    explore(shared_and_exclusive);
}

/// Four tasks, two rounds each, under a limit of 2 on one key.
fn permits() {
    block_on(async {
        let store = MemoryConcurrencyLimiter::new();
        let limiter = ConcurrencyLimiter::from(store.clone());
        let inside = Inside::new();
        let tasks: Vec<_> = (0..4)
            .map(|_| {
                let (limiter, inside) = (limiter.clone(), inside.clone());
                spawn(async move {
                    for _ in 0..2 {
                        let held = permit(&limiter, KEYS[0], 2, FOREVER)
                            .await
                            .expect("a waiter gets a permit");
                        inside.enter(0, 2);
                        yield_now().await;
                        inside.leave(0);
                        drop(held);
                    }
                })
            })
            .collect();
        for task in tasks {
            task.await.unwrap();
        }
        assert_eq!(store.in_flight(KEYS[0]), 0, "a permit leaked");
        assert!(store.is_empty(), "a key left with permits");
    });
}

#[test]
fn permits_stay_under_the_limit_and_are_all_returned() {
    explore(permits);
}

/// Three fair waiters on one key, two rounds each.
fn fair() {
    block_on(async {
        let locks = Locks::from(MemoryLocks::new());
        let inside = Inside::new();
        let tasks: Vec<_> = (0..3)
            .map(|_| {
                let (locks, inside) = (locks.clone(), inside.clone());
                spawn(async move {
                    for _ in 0..2 {
                        let request = LockRequest::new(KEYS[0]).mode(LockMode::Fair).wait(FOREVER);
                        let lease = locks
                            .acquire(request)
                            .await
                            .expect("a waiter gets its turn");
                        inside.enter(0, 1);
                        yield_now().await;
                        inside.leave(0);
                        locks
                            .unlock(lease)
                            .await
                            .expect("a valid lease is released");
                    }
                })
            })
            .collect();
        for task in tasks {
            task.await.unwrap();
        }
        nothing_left(&locks).await;
    });
}

#[test]
fn fair_waiters_exclude_and_wake_every_waiter() {
    explore(fair);
}
