//! TLS (`rediss://`, rustls) to a `redis-server` whose certificate a CA made by the test
//! signed, trusted through `Node::root_ca`.
#![cfg(feature = "tls")]

use crate::support;

use std::time::Duration;

use support::topology::TlsNode;
use tower_redlock::Locks;
use tower_redlock::{LockError, Node, Quota, RedisRateLimiter, Redlock};

#[tokio::test]
async fn locks_and_rate_limits_over_tls_with_a_custom_ca() {
    let node = TlsNode::start();
    let redlock = Locks::from(
        Redlock::from_nodes([Node::url(node.url()).root_ca(node.ca_pem.clone())])
            .ttl(Duration::from_secs(10))
            .build()
            .await
            .unwrap(),
    );
    let lease = redlock.lock("tls:1").await.unwrap();
    assert!(matches!(
        redlock.try_lock("tls:1").await,
        Err(LockError::Taken { .. })
    ));
    // What the node stores, over the plain-text port the test opened beside TLS.
    let key = format!("{}tls:1", redlock.prefix());
    assert_eq!(node.server.cli(&["EXISTS", &key]).trim(), "1");
    redlock.unlock(lease).await.unwrap();
    assert_eq!(node.server.cli(&["EXISTS", &key]).trim(), "0");

    let limiter = RedisRateLimiter::from_node(Node::url(node.url()).root_ca(node.ca_pem.clone()))
        .build()
        .await
        .unwrap();
    let quota: Quota = "2/60".parse().unwrap();
    assert_eq!(limiter.hit("ip:1", quota).await.unwrap().remaining(), 1);
    assert_eq!(limiter.hit("ip:1", quota).await.unwrap().remaining(), 0);
}

#[tokio::test]
async fn a_certificate_no_trusted_root_signed_is_refused() {
    let node = TlsNode::start();
    // The system's roots do not include the test's CA: the handshake fails, the node
    // counts as failed, and no lock is granted.
    let redlock = Locks::from(
        Redlock::from_nodes([Node::url(node.url())])
            .ttl(Duration::from_secs(10))
            .build()
            .await
            .unwrap(),
    );
    match redlock.try_lock("tls:2").await {
        Err(LockError::NoQuorum { failures, .. }) => assert_eq!(failures.len(), 1),
        other => panic!("expected NoQuorum, got {other:?}"),
    }
    let key = format!("{}tls:2", redlock.prefix());
    assert_eq!(node.server.cli(&["EXISTS", &key]).trim(), "0");
}
