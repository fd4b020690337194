//! Readiness: `ready()` of every store says whether it can decide now (a quorum of
//! Redlock nodes, a limiter's node, always in process), within its node timeout, and
//! comes back once the nodes do; `require_nodes_at_start(true)` makes `build()` fail,
//! naming the nodes, when they do not answer.

use crate::support;

use std::time::{Duration, Instant};

use support::{eventually, nodes, urls};
use tower_redlock::{
    ConcurrencyLimiter, ConfigError, Locks, MemoryConcurrencyLimiter, MemoryLocks,
    MemoryRateLimiter, RateLimiter, RedisConcurrencyLimiter, RedisRateLimiter, Redlock,
};

const NODE_TIMEOUT: Duration = Duration::from_millis(200);
/// Long enough for a node started again to be connected to (reconnections pause at most
/// 1 s between attempts).
const BACK_WITHIN: Duration = Duration::from_secs(10);

/// Whether `ready` answers `false` within the node timeout (and a margin for a loaded
/// machine).
async fn not_ready_within_the_timeout(ready: impl Future<Output = bool>) -> bool {
    let started = Instant::now();
    let ready = ready.await;
    let elapsed = started.elapsed();
    assert!(elapsed < NODE_TIMEOUT * 5, "ready() took {elapsed:?}");
    !ready
}

#[tokio::test]
async fn redlock_is_not_ready_with_a_majority_stopped_and_ready_once_they_return() {
    let mut nodes = nodes(3);
    let redlock = Redlock::builder(urls(&nodes))
        .node_timeout(NODE_TIMEOUT)
        .build()
        .await
        .unwrap();
    let locks = Locks::from(redlock.clone());
    assert!(redlock.ready().await && locks.ready().await);

    // One node down leaves a quorum.
    nodes[0].kill();
    assert!(redlock.ready().await, "two of three answer");

    // A majority stopped: one killed, one frozen (its connection open, nothing answers).
    nodes[1].pause();
    assert!(not_ready_within_the_timeout(redlock.ready()).await);
    assert!(not_ready_within_the_timeout(locks.ready()).await);

    nodes[1].resume();
    nodes[0].restart();
    let back = eventually(BACK_WITHIN, || redlock.ready()).await;
    assert!(back, "not ready again once the nodes were back");
    assert!(locks.ready().await);
}

#[tokio::test]
async fn the_limiters_are_not_ready_with_their_node_stopped_and_ready_once_it_returns() {
    let mut nodes = nodes(1);
    let url = nodes[0].url();
    let rate = RedisRateLimiter::builder(&url)
        .timeout(NODE_TIMEOUT)
        .build()
        .await
        .unwrap();
    let permits = RedisConcurrencyLimiter::builder(&url)
        .timeout(NODE_TIMEOUT)
        .build()
        .await
        .unwrap();
    let (rate_handle, permits_handle) = (
        RateLimiter::from(rate.clone()),
        ConcurrencyLimiter::from(permits.clone()),
    );
    assert!(rate.ready().await && rate_handle.ready().await);
    assert!(permits.ready().await && permits_handle.ready().await);

    nodes[0].kill();
    assert!(not_ready_within_the_timeout(rate.ready()).await);
    assert!(not_ready_within_the_timeout(rate_handle.ready()).await);
    assert!(not_ready_within_the_timeout(permits.ready()).await);
    assert!(not_ready_within_the_timeout(permits_handle.ready()).await);

    nodes[0].restart();
    assert!(
        eventually(BACK_WITHIN, || rate.ready()).await,
        "rate limiter"
    );
    assert!(eventually(BACK_WITHIN, || permits.ready()).await, "permits");
}

#[tokio::test]
async fn in_process_stores_are_always_ready() {
    assert!(Locks::from(MemoryLocks::new()).ready().await);
    assert!(RateLimiter::from(MemoryRateLimiter::new()).ready().await);
    assert!(
        ConcurrencyLimiter::from(MemoryConcurrencyLimiter::new())
            .ready()
            .await
    );
}

/// The addresses `host:port` of `urls`.
fn addresses(urls: &[String]) -> Vec<String> {
    urls.iter()
        .map(|url| url.trim_start_matches("redis://").to_owned())
        .collect()
}

#[tokio::test]
async fn require_nodes_at_start_fails_build_with_every_node_down_and_names_them() {
    let mut nodes = nodes(3);
    let urls = urls(&nodes);
    for node in &mut nodes {
        node.kill();
    }
    let build = |required| {
        Redlock::builder(&urls)
            .node_timeout(NODE_TIMEOUT)
            .require_nodes_at_start(required)
            .build()
    };
    let error = build(true).await.unwrap_err();
    let ConfigError::NodesUnreachable {
        nodes: 3,
        needed: 2,
        failures,
    } = &error
    else {
        panic!("{error:?}");
    };
    assert_eq!(failures.len(), 3, "{error}");
    let text = error.to_string();
    for address in addresses(&urls) {
        assert!(text.contains(&address), "{address} not named: {text}");
    }
    // Without the option it starts, not ready.
    let started = build(false).await.unwrap();
    assert!(!started.ready().await);

    let url = &urls[0];
    let rate = RedisRateLimiter::builder(url)
        .timeout(NODE_TIMEOUT)
        .require_nodes_at_start(true)
        .build()
        .await;
    let permits = RedisConcurrencyLimiter::builder(url)
        .timeout(NODE_TIMEOUT)
        .require_nodes_at_start(true)
        .build()
        .await;
    for error in [rate.err(), permits.err()] {
        let error = error.expect("build failed");
        assert!(
            matches!(&error, ConfigError::NodesUnreachable { nodes: 1, needed: 1, failures } if failures.len() == 1),
            "{error:?}"
        );
        let address = &addresses(std::slice::from_ref(url))[0];
        assert!(error.to_string().contains(address), "{error}");
    }
}

#[tokio::test]
async fn require_nodes_at_start_builds_with_a_quorum_up() {
    let mut nodes = nodes(3);
    nodes[2].kill();
    let redlock = Redlock::builder(urls(&nodes))
        .node_timeout(NODE_TIMEOUT)
        .require_nodes_at_start(true)
        .build()
        .await
        .unwrap();
    assert!(redlock.ready().await);
}

/// The flash-sale example's `GET /ready`: 200 with every store up (locks, stock, rate
/// limit, concurrency limit), 503 naming the locks while a majority of the lock nodes is
/// down, 503 naming the stock and the limits while the first node (theirs) is, and 200
/// again once they are back. Each state is awaited (bounded): a loaded machine may make
/// one probe of a live node miss the example's 500 ms node timeout.
#[tokio::test]
async fn the_example_is_ready_only_while_its_stores_answer() {
    let mut nodes = nodes(3);
    let env = [("RATE_LIMIT", "100/10"), ("MAX_CONCURRENT_BUYS", "5")];
    let example = crate::example::start_example_with(&nodes, 0, true, &env).await;
    let url = format!("{}/ready", example.base);
    let answers = |status: u16, body: serde_json::Value| {
        let url = url.clone();
        async move {
            let response = reqwest::get(&url).await.unwrap();
            let seen = response.status().as_u16();
            seen == status && response.json::<serde_json::Value>().await.unwrap() == body
        }
    };
    let stores = |locks: bool, others: bool| serde_json::json!({"locks": locks, "stock": others, "rate_limit": others, "concurrency_limit": others});
    assert!(answers(200, stores(true, true)).await, "not ready at first");

    nodes[1].kill();
    nodes[2].kill();
    let locks_down = eventually(BACK_WITHIN, || answers(503, stores(false, true))).await;
    assert!(
        locks_down,
        "not 503 naming the locks with two lock nodes down"
    );
    nodes[1].restart();
    nodes[2].restart();
    let back = eventually(BACK_WITHIN, || answers(200, stores(true, true))).await;
    assert!(back, "not ready once the lock nodes were back");

    nodes[0].kill();
    let first_down = eventually(BACK_WITHIN, || answers(503, stores(true, false))).await;
    assert!(
        first_down,
        "not 503 naming the stock and the limits with the first node down"
    );
    nodes[0].restart();
    let back = eventually(BACK_WITHIN, || answers(200, stores(true, true))).await;
    assert!(back, "not ready once the first node was back");
}
