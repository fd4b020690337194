//! A Sentinel-managed primary (one primary, one replica, three sentinels) as a Redlock
//! node and as the rate limiter's store, with the primary killed mid-test.
#![cfg(feature = "sentinel")]

use crate::support;

use std::time::{Duration, Instant};

use support::eventually;
use support::topology::{SERVICE, Sentinels, cli, contract};
use tower_redlock::Locks;
use tower_redlock::{Node, Quota, RedisRateLimiter, Redlock};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_reach_the_new_primary_after_the_old_one_is_killed() {
    let setup = Sentinels::start();
    let sentinels = setup.sentinel_urls();
    failover(setup, move || Node::sentinel(&sentinels, SERVICE)).await;
}

/// The same over TLS: the sentinels and both servers speak only TLS to the client
/// (`rediss://`, the test's CA trusted with `Node::root_ca`), replication included.
#[cfg(feature = "tls")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_tls_requests_reach_the_new_primary_after_the_old_one_is_killed() {
    let setup = Sentinels::start_tls();
    let sentinels = setup.sentinel_urls();
    assert!(sentinels.iter().all(|url| url.starts_with("rediss://")));
    let ca = setup.tls.as_ref().unwrap().0.ca_pem.clone();
    failover(setup, move || {
        Node::sentinel(&sentinels, SERVICE).root_ca(ca.clone())
    })
    .await;
}

/// The contract on the Sentinel-managed primary, then the primary killed: locks and the
/// rate limit reach the promoted replica.
async fn failover(mut setup: Sentinels, node: impl Fn() -> Node) {
    contract("sentinel", || vec![node()], node()).await;

    let redlock = Locks::from(
        Redlock::from_nodes([node()])
            .ttl(Duration::from_secs(10))
            .node_timeout(Duration::from_millis(300))
            .build()
            .await
            .unwrap(),
    );
    let limiter = RedisRateLimiter::from_node(node())
        .timeout(Duration::from_millis(300))
        .build()
        .await
        .unwrap();
    let quota: Quota = "100/60".parse().unwrap();
    let lease = redlock.lock("sentinel:1").await.unwrap();
    redlock.unlock(lease).await.unwrap();
    // The limiter connects on its first hit: a Sentinel query, then (over TLS) a handshake,
    // which on a loaded machine can outlast one connect timeout; the next hit connects again.
    let reached = eventually(Duration::from_secs(10), || async {
        limiter.hit("sentinel", quota).await.is_ok()
    })
    .await;
    assert!(
        reached,
        "the rate limiter reached the Sentinel-managed primary"
    );

    let replica = setup.replica.port;
    let named = setup.replica_named_port();
    setup.primary.kill();
    let killed = Instant::now();
    let promoted = eventually(Duration::from_secs(30), || async {
        setup.named_primary() == Some(named) && cli(replica, &["ROLE"]).starts_with("master")
    })
    .await;
    assert!(promoted, "the sentinels promoted the replica");
    let promoted_after = killed.elapsed();
    let promoted_at = Instant::now();

    let deadline = promoted_at + Duration::from_secs(10);
    let lease = loop {
        match redlock.try_lock("sentinel:2").await {
            Ok(lease) => break lease,
            Err(e) => assert!(
                Instant::now() < deadline,
                "no lock on the new primary within 10 s of its promotion: {e}"
            ),
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    eprintln!(
        "primary killed; promoted after {promoted_after:?}; served {:?} after the promotion",
        promoted_at.elapsed()
    );
    let key = format!("{}sentinel:2", redlock.prefix());
    assert_eq!(
        cli(replica, &["EXISTS", &key]).trim(),
        "1",
        "on the new primary"
    );
    redlock.unlock(lease).await.unwrap();
    let counted = eventually(Duration::from_secs(10), || async {
        limiter.hit("sentinel", quota).await.is_ok()
    })
    .await;
    assert!(counted, "the rate limit counts on the new primary");
}
