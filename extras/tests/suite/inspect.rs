//! The operator's tools against real nodes: `Locks::inspect` sees a holder, its TTL, its
//! fencing token, readers and waiters; `Locks::force_unlock` frees a lock that a dead job
//! left, and its holder then finds the lease gone.

use crate::support;

use std::time::Duration;

use support::{nodes, urls};
use tower_redlock::{LockError, LockMode, LockRequest, Locks, MemoryLocks, Redlock};

async fn operator_tools(locks: Locks, nodes_total: usize, fenced: bool) {
    let quorum = nodes_total / 2 + 1;
    let free = locks.inspect("job:42").await.unwrap();
    assert!(!free.is_held());
    assert_eq!((free.nodes_answered, free.nodes_holding), (nodes_total, 0));
    assert_eq!(free.remaining, None);

    let lease = locks.try_lock("job:42").await.unwrap();
    let held = locks.inspect("job:42").await.unwrap();
    assert!(held.is_held(), "{held:?}");
    assert_eq!(held.quorum, quorum);
    assert_eq!(held.nodes_holding, nodes_total);
    let left = held.remaining.expect("a TTL");
    assert!(left <= locks.ttl() && left > locks.ttl() / 2, "{left:?}");
    assert_eq!(held.key, format!("{}job:42", locks.prefix()));
    if fenced {
        assert_eq!(held.fencing_token, lease.fencing_token());
    }

    // A dead job's lock, freed by hand: another holder may take it, and the first
    // holder's release finds it gone.
    assert_eq!(locks.force_unlock("job:42").await.unwrap(), nodes_total);
    assert!(!locks.inspect("job:42").await.unwrap().is_held());
    let second = locks.try_lock("job:42").await.unwrap();
    assert!(matches!(
        locks.unlock(lease).await,
        Err(LockError::Expired { taken_over: true })
    ));
    locks.unlock(second).await.unwrap();
    assert_eq!(
        locks.force_unlock("job:42").await.unwrap(),
        0,
        "nothing held"
    );

    // Readers are counted, and a waiting writer is seen.
    let shared = LockRequest::new("doc:7").mode(LockMode::Shared);
    let a = locks.acquire(shared.clone()).await.unwrap();
    let b = locks.acquire(shared).await.unwrap();
    let seen = locks.inspect("doc:7").await.unwrap();
    assert_eq!(seen.readers, 2, "{seen:?}");
    assert!(!seen.is_held(), "readers are not an exclusive holder");
    let writer = tokio::spawn({
        let locks = locks.clone();
        async move {
            let request = LockRequest::new("doc:7")
                .mode(LockMode::Exclusive)
                .wait(Duration::from_secs(5));
            locks.acquire(request).await
        }
    });
    assert!(
        support::eventually(Duration::from_secs(5), || {
            let locks = locks.clone();
            async move { locks.inspect("doc:7").await.unwrap().waiters }
        })
        .await,
        "the waiting writer is seen"
    );
    locks.unlock(a).await.unwrap();
    locks.unlock(b).await.unwrap();
    locks.unlock(writer.await.unwrap().unwrap()).await.unwrap();
}

#[tokio::test]
async fn inspect_and_force_unlock_on_three_nodes() {
    let nodes = nodes(3);
    let redlock = Redlock::builder(urls(&nodes))
        .fencing_tokens(true)
        .build()
        .await
        .unwrap();
    operator_tools(Locks::from(redlock), 3, true).await;
}

#[tokio::test]
async fn inspect_and_force_unlock_in_process() {
    operator_tools(Locks::from(MemoryLocks::new()), 1, false).await;
}
