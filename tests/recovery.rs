//! Nodes that come back: a node's port served for a while by something that is not Redis,
//! or a connection that goes silent, and then a real Redis again. The Redlock client and
//! the Redis rate limiter must use the node again within the bound their docs give.

mod support;

use std::time::{Duration, Instant};

use support::{FakeServer, HTTP_400, Proxy, RedisNode, eventually, nodes};
use tower_redlock::{Quota, RateLimitError, RedisRateLimiter, Redlock};

const NODE_TIMEOUT: Duration = Duration::from_millis(200);

/// The bound the builders document once the node serves Redis again: the next connection
/// attempt starts at most 100 ms after the last failed one (then one connection attempt).
/// Polling every 10 ms, with room for a slow test machine.
const RECOVERY: Duration = Duration::from_secs(1);

/// The bound for a connection that went silent: the operation gives up after its timeout,
/// a PING probe (at most one a second) waits 1 s, then a new connection. With room for a
/// slow test machine.
fn silent_recovery(timeout: Duration) -> Duration {
    timeout + Duration::from_secs(3)
}

async fn redlock(urls: Vec<String>) -> Redlock {
    Redlock::builder(urls)
        .ttl(Duration::from_secs(5))
        .node_timeout(NODE_TIMEOUT)
        .retry_count(0)
        .build()
        .await
        .unwrap()
}

async fn locks_once(redlock: &Redlock, resource: &str) -> bool {
    match redlock.try_lock(resource).await {
        Ok(lease) => {
            let _ = redlock.unlock(lease).await;
            true
        }
        Err(_) => false,
    }
}

/// Polls `locks_once` until it succeeds; the time it took, or `None` after `within`.
async fn time_to_lock(redlock: &Redlock, within: Duration) -> Option<Duration> {
    let started = Instant::now();
    eventually(within, || locks_once(redlock, "recovery"))
        .await
        .then(|| started.elapsed())
}

/// Node 0's port is served by `fake` answering `reply` until the client has met it, then
/// by a real Redis again; node 1 is stopped, so that every lock needs node 0.
async fn redlock_uses_the_node_again_after(fake: fn(u16) -> FakeServer, db: &str) {
    let mut nodes = nodes(3);
    let urls = nodes.iter().map(|n| format!("{}{db}", n.url())).collect();
    let redlock = redlock(urls).await;
    assert!(locks_once(&redlock, "recovery").await);

    nodes[0].kill();
    let fake = fake(nodes[0].port());
    // The client connects to the fake and reads its answer (locks still succeed on
    // nodes 1 and 2).
    assert!(
        eventually(Duration::from_secs(5), || async {
            locks_once(&redlock, "recovery").await;
            fake.answered() >= 2
        })
        .await,
        "the client never connected to the fake server"
    );
    for _ in 0..5 {
        assert!(locks_once(&redlock, "recovery").await, "a quorum is up");
    }
    fake.stop();
    nodes[0].restart();
    nodes[1].kill();

    let took = time_to_lock(&redlock, Duration::from_secs(5)).await;
    let took = took.expect("node 0 answers again, but the client never used it");
    assert!(took <= RECOVERY, "took {took:?} to use node 0 again");
}

#[tokio::test]
async fn redlock_uses_a_node_again_after_its_port_answered_http() {
    redlock_uses_the_node_again_after(|port| FakeServer::start(port, HTTP_400), "").await;
}

#[tokio::test]
async fn redlock_uses_a_node_again_after_its_handshake_was_refused() {
    // With a database number, the handshake sends SELECT; an error reply to it (from a
    // proxy without a backend, say) fails the connection attempt with a server error
    // rather than an I/O or parse error.
    redlock_uses_the_node_again_after(FakeServer::start_resp_errors, "/1").await;
}

async fn hits_once(limiter: &RedisRateLimiter) -> Result<(), RateLimitError> {
    let quota: Quota = "1000/60".parse().unwrap();
    limiter.hit("recovery", quota).await.map(|_| ())
}

#[tokio::test]
async fn rate_limiter_uses_redis_again_after_its_port_answered_http() {
    let mut node = RedisNode::start();
    let limiter = RedisRateLimiter::builder(node.url())
        .timeout(NODE_TIMEOUT)
        .build()
        .await
        .unwrap();
    hits_once(&limiter).await.unwrap();

    node.kill();
    let fake = FakeServer::start(node.port(), HTTP_400);
    assert!(
        eventually(Duration::from_secs(5), || async {
            let _ = hits_once(&limiter).await;
            fake.answered() >= 2
        })
        .await,
        "the limiter never connected to the fake server"
    );
    assert!(matches!(
        hits_once(&limiter).await,
        Err(RateLimitError::Unavailable(_))
    ));
    fake.stop();
    node.restart();

    let started = Instant::now();
    assert!(
        eventually(Duration::from_secs(5), || async {
            hits_once(&limiter).await.is_ok()
        })
        .await,
        "Redis answers again, but the limiter never used it"
    );
    let took = started.elapsed();
    assert!(took <= RECOVERY, "took {took:?} to use Redis again");
}

#[tokio::test]
async fn redlock_replaces_a_connection_that_went_silent() {
    let mut nodes = nodes(3);
    let proxy = Proxy::start(nodes[0].addr()).await;
    let urls = vec![proxy.url(), nodes[1].url(), nodes[2].url()];
    let redlock = redlock(urls).await;
    assert!(locks_once(&redlock, "recovery").await);
    assert_eq!(proxy.open_connections(), 1);

    // Node 0's connection forwards nothing from now on, and never closes; node 1 stops.
    proxy.black_hole();
    nodes[1].kill();

    let bound = silent_recovery(NODE_TIMEOUT);
    let took = time_to_lock(&redlock, bound + Duration::from_secs(2)).await;
    let took = took.expect("node 0 answers on a new connection, but the client never opened one");
    assert!(
        took <= bound,
        "took {took:?} to replace the silent connection"
    );
    // The silent connection was closed, not left open beside the new one.
    assert!(
        eventually(Duration::from_secs(2), || async {
            proxy.open_connections() == 1
        })
        .await,
        "{} connections open through the proxy",
        proxy.open_connections()
    );
}

#[tokio::test]
async fn rate_limiter_replaces_a_connection_that_went_silent() {
    let node = RedisNode::start();
    let proxy = Proxy::start(node.addr()).await;
    let timeout = Duration::from_millis(100);
    let limiter = RedisRateLimiter::builder(proxy.url())
        .timeout(timeout)
        .build()
        .await
        .unwrap();
    hits_once(&limiter).await.unwrap();

    proxy.black_hole();
    let started = Instant::now();
    let bound = silent_recovery(timeout);
    assert!(
        eventually(bound + Duration::from_secs(2), || async {
            hits_once(&limiter).await.is_ok()
        })
        .await,
        "Redis answers on a new connection, but the limiter never opened one"
    );
    let took = started.elapsed();
    assert!(
        took <= bound,
        "took {took:?} to replace the silent connection"
    );
}
