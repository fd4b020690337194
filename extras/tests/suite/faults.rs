//! Honest answers under faults: killed and stopped nodes, on real `redis-server` processes.
//!
//! `Taken` needs a quorum of answers, `Expired` needs proof that the token cannot be on a
//! quorum, and a hung node costs nothing once the answers in hand decide the verdict.

use crate::support;

use std::time::{Duration, Instant};

use support::{RedisNode, calls, eventually, exists, nodes, pttl, urls};
use tower_redlock::LockRequest;
use tower_redlock::{LockError, LockOperation, Locks, Redlock, Renewal};

async fn redlock(nodes: &[RedisNode], ttl: Duration, node_timeout: Duration) -> Locks {
    Locks::from(
        Redlock::builder(urls(nodes))
            .ttl(ttl)
            .node_timeout(node_timeout)
            .retry_count(0)
            .build()
            .await
            .unwrap(),
    )
}

/// Stores `value` under `key` on `node` with a TTL, as another holder would.
async fn hold(node: &RedisNode, key: &str, value: &str, ttl_ms: u64) {
    let mut conn = node.conn().await;
    let () = redis::cmd("SET")
        .arg(key)
        .arg(value)
        .arg("PX")
        .arg(ttl_ms)
        .query_async(&mut conn)
        .await
        .unwrap();
}

async fn delete(node: &RedisNode, key: &str) {
    let mut conn = node.conn().await;
    let _: i64 = redis::cmd("DEL")
        .arg(key)
        .query_async(&mut conn)
        .await
        .unwrap();
}

#[tokio::test]
async fn taken_only_when_a_quorum_answered() {
    // Another holder on two of five nodes; one node killed, two stopped. Two "held"
    // answers and a connection error make a quorum of OKs impossible, but only two nodes
    // answered: nothing is known about the lock, so the verdict is no quorum.
    let mut nodes = nodes(5);
    let r = redlock(&nodes, Duration::from_secs(10), Duration::from_millis(200)).await;
    let key = "tower-redlock:few-answers";
    for node in &nodes[..2] {
        hold(node, key, "another-holder", 30_000).await;
    }
    nodes[2].kill();
    nodes[3].pause();
    nodes[4].pause();
    let result = r.try_lock("few-answers").await;
    nodes[3].resume();
    nodes[4].resume();
    match result {
        Err(LockError::NoQuorum {
            quorum: 3,
            nodes: 5,
            failures,
            ..
        }) => assert_eq!(failures.len(), 3, "{failures:?}"),
        other => panic!("expected NoQuorum with 3 failures, got {other:?}"),
    }
}

#[tokio::test]
async fn three_of_five_killed_is_never_taken() {
    // The run: with 3 of 5 nodes killed, an attempt must never say Taken, whatever
    // order the two "held" answers and the three connection errors come in.
    let mut nodes = nodes(5);
    let r = redlock(&nodes, Duration::from_secs(10), Duration::from_millis(200)).await;
    let key = "tower-redlock:killed";
    for node in &nodes[..2] {
        hold(node, key, "another-holder", 60_000).await;
    }
    for node in &mut nodes[2..] {
        node.kill();
    }
    let mut taken = 0;
    for _ in 0..100 {
        match r.try_lock("killed").await {
            Err(LockError::NoQuorum { .. }) => {}
            Err(LockError::Taken { .. }) => taken += 1,
            other => panic!("expected NoQuorum, got {other:?}"),
        }
    }
    assert_eq!(
        taken, 0,
        "{taken} of 100 attempts said Taken without a quorum"
    );
}

#[tokio::test]
async fn expired_only_when_the_answers_prove_it() {
    // A lease on 5 nodes; its token replaced by another holder's on 2, one node killed
    // that still held it. The token may be on 3 nodes, a quorum: neither extend nor
    // unlock may say Expired.
    let mut nodes = nodes(5);
    let r = redlock(&nodes, Duration::from_secs(10), Duration::from_millis(200)).await;
    let mut lease = r.try_lock("unproven").await.unwrap();
    let key = lease.key().to_owned();
    hold(&nodes[3], &key, "another-holder", 30_000).await;
    hold(&nodes[4], &key, "another-holder", 30_000).await;
    nodes[2].kill();
    let before = lease.valid_until();
    match r.extend(&mut lease).await {
        Err(LockError::NoQuorum { failures, .. }) => assert_eq!(failures.len(), 1),
        other => panic!("extend: expected NoQuorum, got {other:?}"),
    }
    assert_eq!(
        lease.valid_until(),
        before,
        "a failed extend moved the lease"
    );
    match r.unlock(lease.clone()).await {
        Err(LockError::NoQuorum { failures, .. }) => assert_eq!(failures.len(), 1),
        other => panic!("unlock: expected NoQuorum, got {other:?}"),
    }
    // The unlock deleted the key where it held the token; now 4 nodes answer that the
    // token is gone, and any 3 of them (N - quorum + 1) are proof. Any 3 include one of
    // the nodes where another holder has the key, whichever answer first.
    match r.extend(&mut lease).await {
        Err(LockError::Expired { taken_over: true }) => {}
        other => panic!("extend: expected Expired {{ taken_over: true }}, got {other:?}"),
    }
    match r.unlock(lease).await {
        Err(LockError::Expired { taken_over: true }) => {}
        other => panic!("unlock: expected Expired {{ taken_over: true }}, got {other:?}"),
    }
}

#[tokio::test]
async fn watchdog_keeps_a_lease_through_unprovable_renewals() {
    // Renewals during a stopped node that holds the token, with the token gone from two
    // other nodes of five, answer no quorum: the watchdog retries, and once the node is
    // back a renewal succeeds and the work completes.
    let nodes = nodes(5);
    let locks = redlock(&nodes, Duration::from_secs(2), Duration::from_millis(150)).await;
    let (started_tx, started_rx) = tokio::sync::oneshot::channel();
    let (finish_tx, finish_rx) = tokio::sync::oneshot::channel::<()>();
    let work = tokio::spawn({
        let locks = locks.clone();
        async move {
            let renewal = Renewal::default().every(Duration::from_millis(400));
            locks
                .with_lock(
                    LockRequest::new("renewed").retry(),
                    renewal,
                    |status| async move {
                        started_tx.send(()).unwrap();
                        finish_rx.await.unwrap();
                        status.is_lost()
                    },
                )
                .await
        }
    });
    started_rx.await.unwrap();
    let key = "tower-redlock:renewed";
    delete(&nodes[3], key).await;
    delete(&nodes[4], key).await;
    let attempts_before = calls(&nodes[0], "evalsha").await;
    nodes[2].pause();
    // Two renewals reached a live node while the stopped one held its answer back: the
    // first answered no quorum, and the watchdog tried again.
    let retried = eventually(Duration::from_secs(3), || async {
        calls(&nodes[0], "evalsha").await >= attempts_before + 2
    })
    .await;
    nodes[2].resume();
    assert!(
        retried,
        "the watchdog did not retry after an unprovable renewal"
    );
    // A renewal with the node back succeeds (3 of 5 hold the token).
    let renewed = eventually(Duration::from_secs(3), || async {
        let pttl = pttl(&nodes[2], key).await;
        pttl > 1_700
    })
    .await;
    assert!(renewed, "no renewal succeeded once the node was back");
    finish_tx.send(()).unwrap();
    let lost = work
        .await
        .unwrap()
        .expect("the work ran to its end under the lease");
    assert!(!lost, "the status reported the lease lost");
}

#[tokio::test]
async fn hung_node_costs_nothing_on_any_verdict() {
    // 3 nodes, node_timeout 500 ms, one node stopped (SIGSTOP). Every answer that the two
    // live nodes decide comes without waiting for the stopped one.
    let nodes = nodes(3);
    let timeout = Duration::from_millis(500);
    let bound = Duration::from_millis(250);
    let r = Locks::from(
        Redlock::builder(urls(&nodes))
            .ttl(Duration::from_secs(10))
            .node_timeout(timeout)
            .retry_count(0)
            .fencing_tokens(true)
            .build()
            .await
            .unwrap(),
    );
    let held = "tower-redlock:held";
    for node in &nodes {
        hold(node, held, "another-holder", 30_000).await;
    }
    nodes[2].pause();
    let timed = |what: &str, started: Instant| {
        let elapsed = started.elapsed();
        eprintln!("{what}: {elapsed:?}");
        assert!(
            elapsed < bound,
            "{what} took {elapsed:?} with a stopped node"
        );
    };

    // Taken: two "held" answers of three already make a quorum of OKs impossible.
    let mut slowest = Duration::ZERO;
    for _ in 0..5 {
        let started = Instant::now();
        let err = r.try_lock("held").await.unwrap_err();
        slowest = slowest.max(started.elapsed());
        let LockError::Taken { retry_after } = err else {
            panic!("expected Taken, got {err:?}");
        };
        assert!(retry_after > Duration::from_secs(25), "{retry_after:?}");
    }
    eprintln!("Taken, slowest of 5: {slowest:?}");
    assert!(
        slowest < bound,
        "Taken took {slowest:?} with a stopped node"
    );

    // A fenced acquisition, its extension and its release.
    let started = Instant::now();
    let mut lease = r.try_lock("free").await.expect("two of three nodes answer");
    timed("fenced acquisition", started);
    assert!(lease.fencing_token().is_some());
    let started = Instant::now();
    r.extend(&mut lease).await.unwrap();
    timed("extend", started);
    let started = Instant::now();
    r.unlock(lease).await.unwrap();
    timed("unlock", started);

    // Expired, proven by the two live nodes.
    let mut lease = r.try_lock("gone").await.unwrap();
    for node in &nodes[..2] {
        delete(node, lease.key()).await;
    }
    let started = Instant::now();
    assert!(matches!(
        r.extend(&mut lease).await,
        Err(LockError::Expired { taken_over: false })
    ));
    timed("extend, expired", started);
    let started = Instant::now();
    assert!(matches!(
        r.unlock(lease).await,
        Err(LockError::Expired { taken_over: false })
    ));
    timed("unlock, expired", started);
    nodes[2].resume();
}

#[tokio::test]
async fn taken_cleans_up_partial_sets_in_the_background() {
    // 5 nodes: another holder on 3, one free, one stopped. Three "held" answers decide
    // Taken at once; our SET on the free node and the one the stopped node runs when it
    // wakes are both deleted again.
    let nodes = nodes(5);
    let r = redlock(&nodes, Duration::from_secs(10), Duration::from_millis(500)).await;
    let key = "tower-redlock:partial";
    for node in &nodes[..3] {
        hold(node, key, "another-holder", 30_000).await;
    }
    nodes[4].pause();
    let started = Instant::now();
    let err = r.try_lock("partial").await.unwrap_err();
    let elapsed = started.elapsed();
    assert!(matches!(err, LockError::Taken { .. }), "{err:?}");
    assert!(
        elapsed < Duration::from_millis(250),
        "Taken took {elapsed:?}"
    );
    let cleaned = eventually(Duration::from_secs(3), || async {
        !exists(&nodes[3], key).await
    })
    .await;
    assert!(cleaned, "our SET left on the free node");
    nodes[4].resume();
    let cleaned = eventually(Duration::from_secs(3), || async {
        !exists(&nodes[4], key).await
    })
    .await;
    assert!(cleaned, "our SET left on the node that was stopped");
    for node in &nodes[..3] {
        assert!(
            exists(node, key).await,
            "the other holder's key was touched"
        );
    }
}

/// The text of `result`'s error (which it must be).
fn error_text<T: std::fmt::Debug>(result: Result<T, LockError>) -> (LockError, String) {
    let error = result.unwrap_err();
    let text = error.to_string();
    (error, text)
}

/// A lock never taken and a lease lost fail differently, by variant and by text: a
/// refused attempt is `Taken` ("... so it was not acquired"), and the renewal and the
/// release of a lease whose token is gone are `Expired` ("the lease was lost ..."); with a
/// majority of the nodes down, the acquisition, the renewal and the release each say
/// which of them found no quorum.
async fn lost_and_never_taken_read_apart(locks: Locks, other: Locks, nodes: &mut [RedisNode]) {
    let mut lease = locks.try_lock("order:7").await.unwrap();
    let (refused, text) = error_text(other.try_lock("order:7").await);
    assert!(matches!(refused, LockError::Taken { .. }), "{refused:?}");
    assert!(
        text.contains("not acquired") && !text.contains("lost"),
        "{text}"
    );

    // The lease is lost behind its holder's back (an operator's force_unlock).
    locks.force_unlock("order:7").await.unwrap();
    let (lost, text) = error_text(locks.extend(&mut lease).await);
    assert!(
        matches!(lost, LockError::Expired { taken_over: false }),
        "{lost:?}"
    );
    assert!(
        text.contains("lease was lost") && !text.contains("not acquired"),
        "{text}"
    );
    let taker = other.try_lock("order:7").await.unwrap();
    let (lost, text) = error_text(locks.unlock(lease).await);
    assert!(
        matches!(lost, LockError::Expired { taken_over: true }),
        "{lost:?}"
    );
    assert!(
        text.contains("lease was lost") && text.contains("another holder"),
        "{text}"
    );
    other.unlock(taker).await.unwrap();

    if nodes.is_empty() {
        return;
    }
    let mut held = locks.try_lock("order:8").await.unwrap();
    for node in &mut nodes[1..] {
        node.kill();
    }
    let expect = |result: Result<(), LockError>, operation: LockOperation, says: &str| {
        let (error, text) = error_text(result);
        assert!(
            matches!(error, LockError::NoQuorum { operation: o, .. } if o == operation),
            "{error:?}"
        );
        assert!(text.starts_with(&format!("no quorum to {says}")), "{text}");
    };
    let acquired = locks.try_lock("order:9").await.map(drop);
    expect(
        acquired,
        LockOperation::Acquire,
        "acquire the lock (it was not acquired)",
    );
    let extended = locks.extend(&mut held).await;
    expect(
        extended,
        LockOperation::Extend,
        "extend the lease (it may still hold",
    );
    let released = locks.unlock(held).await;
    expect(released, LockOperation::Release, "release the lease");
}

#[tokio::test]
async fn a_lost_lease_and_a_lock_never_taken_fail_apart_on_three_nodes() {
    let mut nodes = nodes(3);
    let locks = redlock(&nodes, Duration::from_secs(10), Duration::from_millis(200)).await;
    let other = redlock(&nodes, Duration::from_secs(10), Duration::from_millis(200)).await;
    lost_and_never_taken_read_apart(locks, other, &mut nodes).await;
}

#[tokio::test]
async fn a_lost_lease_and_a_lock_never_taken_fail_apart_in_process() {
    let locks = Locks::from(tower_redlock::MemoryLocks::new());
    lost_and_never_taken_read_apart(locks.clone(), locks, &mut []).await;
}
