//! Waiters handed the turn: a fair queue's head that gives up, and a writer that stops
//! waiting, wake whoever they held back, without a release. The clock is paused: a waiter
//! woken by a hand-over acquires with no time gone by, while one left to its fallback timer
//! sleeps at least `TURN` of it.

use std::sync::Arc;
use std::time::Duration;

use crate::backend::memory::MemoryLocks;
use crate::backend::memory::modes::TURN;
use crate::error::LockError;
use crate::holder::HolderRef;
use crate::lease::Access;

/// Waits (on the test's clock) until `key`'s fair queue holds `len` waiters.
async fn queued(locks: &MemoryLocks, key: &str, len: usize) {
    for _ in 0..500 {
        let now = {
            let state = locks.state();
            let modes = state.keys.get(key).and_then(|k| k.modes.as_deref());
            modes.map_or(0, |m| m.queue.len())
        };
        if now == len {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("{key}'s queue never held {len} waiters");
}

fn spawn_take(
    locks: &MemoryLocks,
    mode: crate::LockMode,
) -> tokio::task::JoinHandle<Result<crate::Lease, LockError>> {
    let locks = locks.clone();
    tokio::spawn(async move {
        let request = crate::LockRequest::new("q")
            .mode(mode)
            .wait(Duration::from_secs(30));
        locks.take(request).await
    })
}

#[tokio::test(start_paused = true)]
async fn the_head_of_a_fair_queue_that_gives_up_hands_the_turn_on_at_once() {
    let locks = MemoryLocks::builder().build().unwrap();
    let key = "tower-redlock:q";
    let holder = locks.acquire(Arc::from(key)).unwrap();
    let head = spawn_take(&locks, crate::LockMode::Fair);
    queued(&locks, key, 1).await;
    let next = spawn_take(&locks, crate::LockMode::Fair);
    queued(&locks, key, 2).await;
    // The key frees without a release's wake-up (as when a lease runs out), and the head
    // gives up: only its leaving can wake the next one.
    locks.state().let_go(key);
    let started = tokio::time::Instant::now();
    head.abort();
    assert!(head.await.is_err());
    let next = tokio::time::timeout(Duration::from_secs(60), next).await;
    let lease = next
        .expect("the next waiter never got its turn")
        .unwrap()
        .unwrap();
    assert!(
        started.elapsed() < TURN / 2,
        "woken by its own timer after {:?}, not by the head leaving",
        started.elapsed()
    );
    locks.release(&lease).unwrap();
    let _ = holder;
    queued(&locks, key, 0).await;
}

#[tokio::test(start_paused = true)]
async fn readers_held_back_by_a_waiting_writer_go_once_it_gives_up() {
    let locks = MemoryLocks::builder().build().unwrap();
    let key = "tower-redlock:q";
    let reader = locks
        .acquire_access(Arc::from(key), Access::Shared, HolderRef::Direct)
        .unwrap();
    let writer = spawn_take(&locks, crate::LockMode::Exclusive);
    let intent = |locks: &MemoryLocks| {
        let state = locks.state();
        let modes = state.keys.get(key).and_then(|k| k.modes.as_deref());
        modes.map_or(0, |m| m.writers_waiting)
    };
    while intent(&locks) == 0 {
        tokio::task::yield_now().await;
    }
    let held_back = spawn_take(&locks, crate::LockMode::Shared);
    tokio::task::yield_now().await;
    assert!(
        !held_back.is_finished(),
        "a reader went ahead of a waiting writer"
    );
    let started = tokio::time::Instant::now();
    writer.abort();
    assert!(writer.await.is_err());
    assert_eq!(intent(&locks), 0);
    let second = tokio::time::timeout(Duration::from_secs(60), held_back).await;
    let second = second.expect("the reader never went").unwrap().unwrap();
    assert!(
        started.elapsed() < TURN / 2,
        "woken by its own timer after {:?}, not by the writer giving up",
        started.elapsed()
    );
    locks.release(&second).unwrap();
    locks.release(&reader).unwrap();
}
