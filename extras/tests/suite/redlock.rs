//! The Redlock client and the in-process backend against their contract, on real
//! `redis-server` processes.

use crate::support;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use redis::AsyncCommands;
use support::{RedisNode, eventually, exists, get, nodes, pttl, urls};
use tower_redlock::{ConfigError, LockError, Locks, MemoryLocks, Redlock};

const PREFIX: &str = "tower-redlock:";

async fn redlock(nodes: &[RedisNode], ttl: Duration, node_timeout: Duration) -> Locks {
    Locks::from(
        Redlock::builder(urls(nodes))
            .ttl(ttl)
            .node_timeout(node_timeout)
            .retry_count(2000)
            .retry_delay(Duration::from_millis(1), Duration::from_millis(5))
            .build()
            .await
            .unwrap(),
    )
}

async fn on_nodes(nodes: &[RedisNode], key: &str) -> usize {
    let mut n = 0;
    for node in nodes {
        n += usize::from(exists(node, key).await);
    }
    n
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mutual_exclusion_three_nodes_no_lost_update() {
    let nodes = nodes(3);
    let locks = redlock(&nodes, Duration::from_secs(5), Duration::from_millis(200)).await;
    let counter = redis::Client::open(nodes[0].url()).unwrap();
    const TASKS: usize = 16;
    const ROUNDS: usize = 8;
    let in_section = Arc::new(AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for _ in 0..TASKS {
        let locks = locks.clone();
        let counter = counter.clone();
        let in_section = in_section.clone();
        tasks.push(tokio::spawn(async move {
            let mut conn = counter.get_multiplexed_async_connection().await.unwrap();
            for _ in 0..ROUNDS {
                let lease = locks.lock("counter").await.expect("lock within retries");
                assert_eq!(
                    in_section.fetch_add(1, Ordering::SeqCst),
                    0,
                    "two holders at once"
                );
                // Read, yield, write: loses updates unless the lock excludes the others.
                let n: i64 = conn
                    .get::<_, Option<i64>>("shared-counter")
                    .await
                    .unwrap()
                    .unwrap_or(0);
                tokio::task::yield_now().await;
                let () = conn.set("shared-counter", n + 1).await.unwrap();
                in_section.fetch_sub(1, Ordering::SeqCst);
                locks.unlock(lease).await.unwrap();
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    let mut conn = nodes[0].conn().await;
    let n: i64 = conn.get("shared-counter").await.unwrap();
    assert_eq!(n, (TASKS * ROUNDS) as i64);
}

#[tokio::test]
async fn minority_down_still_grants() {
    let mut nodes = nodes(5);
    let r = redlock(&nodes, Duration::from_secs(5), Duration::from_millis(200)).await;
    nodes[0].kill();
    nodes[3].kill();
    let lease = r
        .try_lock("minority")
        .await
        .expect("3 of 5 nodes are a quorum");
    assert_eq!(
        on_nodes(&nodes[1..3], lease.key()).await
            + usize::from(exists(&nodes[4], lease.key()).await),
        3
    );
    r.unlock(lease).await.unwrap();
}

#[tokio::test]
async fn majority_down_is_no_quorum_within_node_timeout() {
    let mut nodes = nodes(3);
    let timeout = Duration::from_millis(200);
    let r = redlock(&nodes, Duration::from_secs(5), timeout).await;
    nodes[1].kill();
    nodes[2].kill();
    let start = Instant::now();
    let err = r.try_lock("majority").await.unwrap_err();
    let elapsed = start.elapsed();
    match err {
        LockError::NoQuorum {
            quorum,
            nodes: n,
            failures,
            ..
        } => {
            assert_eq!((quorum, n, failures.len()), (2, 3, 2));
        }
        other => panic!("expected NoQuorum, got {other:?}"),
    }
    // Decided as soon as the quorum is out of reach; the cleanup runs in the background.
    assert!(
        elapsed < timeout + Duration::from_millis(100),
        "took {elapsed:?}"
    );
    // Nothing is left on the live node: released in the background, long before the TTL.
    let key = format!("{PREFIX}majority");
    let released = eventually(Duration::from_secs(2), || async {
        !exists(&nodes[0], &key).await
    })
    .await;
    assert!(released, "partial acquisition left on the live node");
}

#[tokio::test]
async fn majority_paused_is_no_quorum_within_node_timeout() {
    let nodes = nodes(3);
    let timeout = Duration::from_millis(150);
    let r = redlock(&nodes, Duration::from_secs(5), timeout).await;
    nodes[0].pause();
    nodes[1].pause();
    let start = Instant::now();
    let err = r.try_lock("paused").await.unwrap_err();
    let elapsed = start.elapsed();
    nodes[0].resume();
    nodes[1].resume();
    assert!(matches!(err, LockError::NoQuorum { .. }), "{err:?}");
    assert!(
        elapsed < timeout * 2 + Duration::from_millis(150),
        "took {elapsed:?}"
    );
}

#[tokio::test]
async fn partial_acquisition_is_released() {
    let nodes = nodes(3);
    let r = redlock(&nodes, Duration::from_secs(10), Duration::from_millis(200)).await;
    let key = format!("{PREFIX}partial");
    // Another holder has two of three nodes, with 5 s left.
    for node in &nodes[..2] {
        let mut conn = node.conn().await;
        let () = redis::cmd("SET")
            .arg(&key)
            .arg("other")
            .arg("PX")
            .arg(5000)
            .query_async(&mut conn)
            .await
            .unwrap();
    }
    let err = r.try_lock("partial").await.unwrap_err();
    let LockError::Taken { retry_after } = err else {
        panic!("expected Taken, got {err:?}");
    };
    assert!(
        retry_after <= Duration::from_secs(5) && retry_after > Duration::from_secs(4),
        "{retry_after:?}"
    );
    // Our SET succeeded on the third node; it must have been deleted again.
    assert!(
        !exists(&nodes[2], &key).await,
        "stale key left on the node that said OK"
    );
    // The other holder's keys are untouched.
    assert_eq!(on_nodes(&nodes[..2], &key).await, 2);
}

#[tokio::test]
async fn dropped_acquire_is_released() {
    let nodes = nodes(3);
    // A long node timeout, so the acquire is still waiting for the paused nodes (no
    // quorum yet, none ruled out) when it is dropped.
    let r = redlock(&nodes, Duration::from_secs(30), Duration::from_secs(2)).await;
    let key = format!("{PREFIX}dropped");
    nodes[1].pause();
    nodes[2].pause();
    let attempt = tokio::time::timeout(Duration::from_millis(300), r.try_lock("dropped")).await;
    assert!(
        attempt.is_err(),
        "the acquire should still be waiting on the paused nodes"
    );
    // The live node had said OK; the dropped future must release it, long before the TTL.
    let released = eventually(Duration::from_secs(5), || async {
        !exists(&nodes[0], &key).await
    })
    .await;
    nodes[1].resume();
    nodes[2].resume();
    assert!(released, "key left behind by a dropped acquire");
}

#[tokio::test]
async fn hung_node_does_not_delay_acquire_or_release() {
    let nodes = nodes(3);
    let timeout = Duration::from_secs(1);
    let r = redlock(&nodes, Duration::from_secs(10), timeout).await;
    nodes[1].pause();
    // Two of three answer at once: a quorum, so nobody waits for the hung node.
    let start = Instant::now();
    let lease = r.try_lock("slow").await.expect("two of three nodes answer");
    let acquired_in = start.elapsed();
    let start = Instant::now();
    r.unlock(lease).await.unwrap();
    let released_in = start.elapsed();
    nodes[1].resume();
    assert!(acquired_in < timeout / 3, "acquire took {acquired_in:?}");
    assert!(released_in < timeout / 3, "release took {released_in:?}");
}

#[tokio::test]
async fn slow_node_bounded_by_node_timeout() {
    let nodes = nodes(3);
    let timeout = Duration::from_millis(100);
    let r = redlock(&nodes, Duration::from_secs(10), timeout).await;
    // One node hung and one holding another's key: the verdict needs the hung node's
    // answer, which never comes; the node timeout bounds the wait.
    let mut conn = nodes[0].conn().await;
    let () = redis::cmd("SET")
        .arg(format!("{PREFIX}slow"))
        .arg("other")
        .query_async(&mut conn)
        .await
        .unwrap();
    nodes[1].pause();
    let start = Instant::now();
    let err = r.try_lock("slow").await.unwrap_err();
    let elapsed = start.elapsed();
    nodes[1].resume();
    assert!(matches!(err, LockError::Taken { .. }), "{err:?}");
    assert!(
        elapsed < timeout * 2 + Duration::from_millis(150),
        "took {elapsed:?}"
    );
}

/// The contract both backends keep.
mod contract {
    use super::*;

    pub(super) async fn taken_then_free(locks: &Locks) {
        let a = locks.try_lock("contract:taken").await.unwrap();
        match locks.try_lock("contract:taken").await {
            Err(LockError::Taken { retry_after }) => {
                assert!(retry_after <= locks.ttl() && retry_after > Duration::ZERO)
            }
            other => panic!("expected Taken, got {other:?}"),
        }
        locks.unlock(a).await.unwrap();
        let b = locks
            .try_lock("contract:taken")
            .await
            .expect("free after release");
        locks.unlock(b).await.unwrap();
    }

    pub(super) async fn tokens_differ(locks: &Locks) {
        let a = locks.try_lock("contract:tok").await.unwrap();
        locks.unlock(a.clone()).await.unwrap();
        let b = locks.try_lock("contract:tok").await.unwrap();
        assert_ne!(a.token(), b.token());
        assert_eq!(a.key(), b.key());
        assert_eq!(a.key(), "tower-redlock:contract:tok");
        locks.unlock(b).await.unwrap();
    }

    /// `locks` has a short TTL.
    pub(super) async fn non_owner_release_leaves_lock(locks: &Locks) {
        let a = locks.try_lock("contract:owner").await.unwrap();
        let b = wait_for_lock(locks, "contract:owner").await;
        assert_ne!(a.token(), b.token());
        match locks.unlock(a).await {
            Err(LockError::Expired { taken_over: true }) => {}
            other => panic!("expected Expired {{ taken_over: true }}, got {other:?}"),
        }
        assert!(
            matches!(
                locks.try_lock("contract:owner").await,
                Err(LockError::Taken { .. })
            ),
            "B's lock was removed"
        );
        locks.unlock(b).await.unwrap();
    }

    /// `locks` has a short TTL.
    pub(super) async fn expired_release_is_reported(locks: &Locks) {
        let a = locks.try_lock("contract:expired").await.unwrap();
        let ttl = locks.ttl();
        tokio::time::sleep(ttl + Duration::from_millis(100)).await; // outlive the TTL on purpose
        assert!(!a.is_valid());
        match locks.unlock(a).await {
            Err(LockError::Expired { taken_over: false }) => {}
            other => panic!("expected Expired {{ taken_over: false }}, got {other:?}"),
        }
    }

    /// `locks` has a short TTL.
    pub(super) async fn extend_keeps_lock_past_ttl(locks: &Locks) {
        let ttl = locks.ttl();
        let mut lease = locks.try_lock("contract:extend").await.unwrap();
        assert!(lease.remaining() <= ttl);
        let start = Instant::now();
        while start.elapsed() < ttl * 3 {
            tokio::time::sleep(ttl / 3).await;
            let before = lease.valid_until();
            locks.extend(&mut lease).await.expect("extend while held");
            assert!(lease.valid_until() > before);
            assert!(
                lease.remaining() <= ttl,
                "validity {:?} above TTL {ttl:?}",
                lease.remaining()
            );
        }
        assert!(matches!(
            locks.try_lock("contract:extend").await,
            Err(LockError::Taken { .. })
        ));
        locks.unlock(lease).await.unwrap();
    }

    /// `locks` has a short TTL.
    pub(super) async fn extend_after_expiry_fails(locks: &Locks) {
        let mut a = locks.try_lock("contract:late").await.unwrap();
        let b = wait_for_lock(locks, "contract:late").await;
        let before = a.valid_until();
        assert!(matches!(
            locks.extend(&mut a).await,
            Err(LockError::Expired { taken_over: true })
        ));
        assert_eq!(
            a.valid_until(),
            before,
            "a failed extend must leave the lease as it was"
        );
        locks.unlock(b).await.unwrap();
    }

    pub(super) async fn invalid_keys_are_refused(locks: &Locks) {
        for bad in ["", "a\nb", &"x".repeat(2000)] {
            assert!(
                matches!(locks.try_lock(bad).await, Err(LockError::InvalidKey(_))),
                "{bad:?}"
            );
        }
    }

    async fn wait_for_lock(locks: &Locks, key: &str) -> tower_redlock::Lease {
        let deadline = Instant::now() + locks.ttl() * 10;
        loop {
            match locks.try_lock(key).await {
                Ok(lease) => return lease,
                Err(LockError::Taken { .. }) if Instant::now() < deadline => {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                other => panic!("lock never freed: {other:?}"),
            }
        }
    }

    pub(super) async fn all(long: &Locks, short: &Locks) {
        taken_then_free(long).await;
        tokens_differ(long).await;
        invalid_keys_are_refused(long).await;
        non_owner_release_leaves_lock(short).await;
        expired_release_is_reported(short).await;
        extend_keeps_lock_past_ttl(short).await;
        extend_after_expiry_fails(short).await;
    }
}

#[tokio::test]
async fn contract_in_process() {
    let long = Locks::from(MemoryLocks::new());
    let short = Locks::from(
        MemoryLocks::builder()
            .ttl(Duration::from_millis(300))
            .build()
            .unwrap(),
    );
    contract::all(&long, &short).await;
}

/// The contract on `n` nodes: a client with a long TTL and one with a short TTL.
async fn contract_on(n: usize) {
    let nodes = nodes(n);
    let long = redlock(&nodes, Duration::from_secs(10), Duration::from_millis(200)).await;
    let short = redlock(
        &nodes,
        Duration::from_millis(300),
        Duration::from_millis(100),
    )
    .await;
    contract::all(&long, &short).await;
}

#[tokio::test]
async fn contract_one_node() {
    contract_on(1).await;
}

#[tokio::test]
async fn contract_three_nodes() {
    contract_on(3).await;
}

#[tokio::test]
async fn an_even_number_of_nodes_is_logged_as_a_warning_when_built() {
    let (logs, _guard) = support::Logs::capture();
    let nodes = nodes(3);
    let build = |n: usize| Redlock::builder(urls(&nodes[..n])).build();
    let _two = build(2).await.unwrap();
    let warning = [
        "WARN",
        "an even number of Redlock nodes",
        "a quorum of 2 of 2 tolerates 0 failed nodes",
        "odd number",
    ];
    assert_eq!(logs.lines_with(&warning), 1, "{}", logs.text());
    // One and three nodes tolerate all they can: no warning.
    let _one = build(1).await.unwrap();
    let _three = build(3).await.unwrap();
    assert_eq!(logs.lines_with(&["even number"]), 1, "{}", logs.text());
}

#[tokio::test]
async fn release_on_one_node_of_three_reports_expired() {
    // A lease is released only if a quorum still holds it.
    let nodes = nodes(3);
    let r = redlock(&nodes, Duration::from_secs(10), Duration::from_millis(200)).await;
    let lease = r.try_lock("gone").await.unwrap();
    for node in &nodes[..2] {
        let mut conn = node.conn().await;
        let () = conn.del(lease.key()).await.unwrap();
    }
    assert!(matches!(
        r.unlock(lease).await,
        Err(LockError::Expired { taken_over: false })
    ));
}

#[tokio::test]
async fn builder_rejects_bad_configuration() {
    let ok = ["redis://127.0.0.1:1"];
    let none: [&str; 0] = [];
    assert!(matches!(
        Redlock::builder(none).build().await,
        Err(ConfigError::NoNodes)
    ));
    assert!(matches!(
        Redlock::builder(["not a url"]).build().await,
        Err(ConfigError::InvalidUrl { index: 0, .. })
    ));
    assert!(matches!(
        Redlock::builder(ok).ttl(Duration::ZERO).build().await,
        Err(ConfigError::InvalidTtl { .. })
    ));
    assert!(matches!(
        Redlock::builder(ok)
            .ttl(Duration::from_millis(2))
            .build()
            .await,
        Err(ConfigError::InvalidTtl { .. })
    ));
    assert!(matches!(
        Redlock::builder(ok)
            .ttl(Duration::from_secs(365 * 86400))
            .build()
            .await,
        Err(ConfigError::InvalidTtl { .. })
    ));
    assert!(matches!(
        Redlock::builder(ok)
            .node_timeout(Duration::from_secs(10))
            .build()
            .await,
        Err(ConfigError::InvalidNodeTimeout { .. })
    ));
    assert!(matches!(
        Redlock::builder(ok).drift_factor(f64::NAN).build().await,
        Err(ConfigError::InvalidDriftFactor(_))
    ));
    assert!(matches!(
        Redlock::builder(ok)
            .retry_delay(Duration::from_secs(2), Duration::from_secs(1))
            .build()
            .await,
        Err(ConfigError::InvalidRetryDelay { .. })
    ));
    assert!(matches!(
        Redlock::builder(ok).prefix("a\0").build().await,
        Err(ConfigError::InvalidPrefix(_))
    ));
    // A node that is down at start is not a configuration error.
    let r = Locks::from(
        Redlock::builder(ok)
            .build()
            .await
            .expect("unreachable node is retried later"),
    );
    assert!(matches!(
        r.try_lock("x").await,
        Err(LockError::NoQuorum { .. })
    ));
}

#[tokio::test]
async fn scripts_are_reloaded_after_a_flush() {
    let nodes = nodes(3);
    let r = redlock(&nodes, Duration::from_secs(10), Duration::from_millis(200)).await;
    let mut lease = r.try_lock("noscript").await.unwrap();
    r.extend(&mut lease).await.unwrap();
    // As after a restart: the nodes forget every script; EVALSHA answers NOSCRIPT.
    for node in &nodes {
        let mut conn = node.conn().await;
        let () = redis::cmd("SCRIPT")
            .arg("FLUSH")
            .query_async(&mut conn)
            .await
            .unwrap();
    }
    r.extend(&mut lease)
        .await
        .expect("extend reloads its script");
    let key = lease.key().to_owned();
    r.unlock(lease).await.expect("release reloads its script");
    assert_eq!(on_nodes(&nodes, &key).await, 0);
}

#[tokio::test]
async fn prefix_with_braces_is_refused() {
    for prefix in ["app{x}:", "{app}:", "app}:"] {
        match Redlock::builder(["redis://127.0.0.1:1"])
            .prefix(prefix)
            .build()
            .await
        {
            Err(e @ ConfigError::BraceInPrefix(_)) => {
                assert!(e.to_string().contains(prefix), "{e}")
            }
            other => panic!("{prefix:?}: expected BraceInPrefix, got {other:?}"),
        }
        assert!(matches!(
            MemoryLocks::builder().prefix(prefix).build(),
            Err(ConfigError::BraceInPrefix(_))
        ));
    }
}

async fn fenced(nodes: &[RedisNode]) -> Locks {
    Locks::from(
        Redlock::builder(urls(nodes))
            .ttl(Duration::from_secs(10))
            .node_timeout(Duration::from_millis(200))
            .retry_count(0)
            .fencing_tokens(true)
            .build()
            .await
            .unwrap(),
    )
}

#[tokio::test]
async fn fencing_counter_is_per_lock_key_and_expires() {
    const DAY_MS: i64 = 24 * 3600 * 1000;
    let nodes = nodes(3);
    let r = fenced(&nodes).await;
    let counter = "tower-redlock:{tower-redlock:fa}:fence";
    let a = r.try_lock("fa").await.unwrap();
    assert_eq!(a.fencing_token(), Some(1));
    r.unlock(a).await.unwrap();
    let mut a = r.try_lock("fa").await.unwrap();
    assert_eq!(a.fencing_token(), Some(2));
    // Another key counts on its own; the old reserved name is an ordinary resource.
    let b = r.try_lock("fb").await.unwrap();
    assert_eq!(b.fencing_token(), Some(1));
    let c = r.try_lock("fencing-counter").await.unwrap();
    assert_eq!(c.fencing_token(), Some(1));
    let written = eventually(Duration::from_secs(2), || async {
        let mut all = true;
        for node in &nodes {
            all &= get(node, counter).await.as_deref() == Some("2");
        }
        all
    })
    .await;
    assert!(written, "the counter of key fa is not 2 on every node");
    for node in &nodes {
        let left = pttl(node, counter).await;
        assert!(left > DAY_MS - 60_000 && left <= DAY_MS, "PTTL {left}");
        // As if a day had nearly passed: a renewal sets the expiry again.
        let mut conn = node.conn().await;
        let _: i64 = redis::cmd("PEXPIRE")
            .arg(counter)
            .arg(5_000)
            .query_async(&mut conn)
            .await
            .unwrap();
    }
    r.extend(&mut a).await.unwrap();
    let refreshed = eventually(Duration::from_secs(2), || async {
        let mut all = true;
        for node in &nodes {
            all &= pttl(node, counter).await > DAY_MS - 60_000;
        }
        all
    })
    .await;
    assert!(refreshed, "a renewal did not refresh the counter's expiry");
}

#[tokio::test]
async fn fencing_counter_written_by_another_client_is_a_clear_error() {
    let nodes = nodes(3);
    let r = fenced(&nodes).await;
    let counter = "tower-redlock:{tower-redlock:spoiled}:fence";
    for node in &nodes {
        let mut conn = node.conn().await;
        let () = conn.set(counter, "not-a-number").await.unwrap();
    }
    let err = r.try_lock("spoiled").await.unwrap_err();
    let LockError::NoQuorum { ref failures, .. } = err else {
        panic!("expected NoQuorum, got {err:?}");
    };
    // Two failures of three already leave no quorum: the third may not be awaited.
    assert!(failures.len() >= 2, "{err}");
    for failure in failures {
        assert!(
            matches!(
                &failure.reason,
                tower_redlock::NodeFailureReason::InvalidFencingCounter { key } if key == counter
            ),
            "{failure}"
        );
    }
    // The message says what is wrong, with the key redacted (its value could be an
    // account id); the key itself is in the failure's reason, for the fix.
    let message = err.to_string();
    assert!(message.contains("fencing counter \"#"), "{message}");
    assert!(!message.contains("spoiled"), "{message}");
    // Nothing set, nothing changed.
    assert_eq!(on_nodes(&nodes, "tower-redlock:spoiled").await, 0);
    for node in &nodes {
        assert_eq!(get(node, counter).await.as_deref(), Some("not-a-number"));
    }
    // A value of another type, and numbers Lua would mangle, are refused the same way.
    let mut conn = nodes[0].conn().await;
    let () = conn.del(counter).await.unwrap();
    let () = conn.hset(counter, "f", "1").await.unwrap();
    for (node, value) in nodes[1..].iter().zip(["1e3", "99999999999999999"]) {
        let mut conn = node.conn().await;
        let () = conn.set(counter, value).await.unwrap();
    }
    assert!(matches!(
        r.try_lock("spoiled").await,
        Err(LockError::NoQuorum { .. })
    ));
    // With one spoiled node of three, the other two are a quorum.
    for node in &nodes[1..] {
        let mut conn = node.conn().await;
        let () = conn.del(counter).await.unwrap();
    }
    let lease = r.try_lock("spoiled").await.expect("two clean nodes");
    assert_eq!(lease.fencing_token(), Some(1));
    let mut conn = nodes[0].conn().await;
    let kind: String = redis::cmd("TYPE")
        .arg(counter)
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(kind, "hash", "the foreign counter was modified");
    r.unlock(lease).await.unwrap();
}

/// `number_of_cached_scripts` of `INFO memory` (Redis 7).
async fn cached_scripts(node: &RedisNode) -> u64 {
    let mut conn = node.conn().await;
    let info: String = redis::cmd("INFO")
        .arg("memory")
        .query_async(&mut conn)
        .await
        .unwrap();
    info.lines()
        .find_map(|line| line.strip_prefix("number_of_cached_scripts:"))
        .and_then(|n| n.trim().parse().ok())
        .expect("INFO memory has number_of_cached_scripts")
}

#[tokio::test]
async fn every_script_is_loaded_with_each_new_connection() {
    let mut nodes = nodes(1);
    let locks = Locks::from(
        Redlock::builder(urls(&nodes))
            .node_timeout(Duration::from_millis(200))
            .build()
            .await
            .unwrap(),
    );
    // Every script of every mode, not only the plain lock's: a reader, a fair waiter or a
    // set never meets a node that lacks its script.
    let loaded = cached_scripts(&nodes[0]).await;
    assert!(loaded >= 15, "{loaded} scripts loaded");
    nodes[0].restart();
    assert_eq!(cached_scripts(&nodes[0]).await, 0, "restarted empty");
    // The first operations after the restart replace the broken connection; the new one
    // loads every script before any command of a mode that needs one.
    let back = eventually(Duration::from_secs(5), || async {
        match locks.try_lock("after-restart").await {
            Ok(lease) => locks.unlock(lease).await.is_ok(),
            Err(_) => false,
        }
    })
    .await;
    assert!(back, "the node serves locks again");
    assert_eq!(cached_scripts(&nodes[0]).await, loaded);
}
