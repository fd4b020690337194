//! Hot keys answered in process, and the Retry-After estimate, on real Redis and real HTTP.
//!
//! Redis commands are counted with `INFO commandstats` before and after, on every node;
//! commands run inside a script (`PTTL`, `SET`) count as well as the `EVALSHA` itself.

use crate::support;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use axum::Router;
use axum::routing::post;
use support::{
    RedisNode, command_calls, eventually, nodes, post_to, retry_after, serve, subscribers, urls,
};
use tokio::sync::Notify;
use tower_redlock::LockRequest;
use tower_redlock::{LockError, LockLayer, Locks, Redlock};

const PREFIX: &str = "tower-redlock:";

async fn redlock(nodes: &[RedisNode], ttl: Duration) -> Locks {
    Locks::from(
        Redlock::builder(urls(nodes))
            .ttl(ttl)
            .node_timeout(Duration::from_millis(300))
            .build()
            .await
            .unwrap(),
    )
}

/// Every node's command calls so far.
async fn snapshot(nodes: &[RedisNode]) -> Vec<BTreeMap<String, u64>> {
    let mut all = Vec::with_capacity(nodes.len());
    for node in nodes {
        all.push(command_calls(node).await);
    }
    all
}

/// The lock commands run since `before`, per node and command; the connection
/// handshakes of the counting itself (`HELLO`, `CLIENT ...`, `PING`) left out.
async fn since(
    nodes: &[RedisNode],
    before: &[BTreeMap<String, u64>],
) -> Vec<BTreeMap<String, u64>> {
    let after = snapshot(nodes).await;
    after
        .iter()
        .zip(before)
        .map(|(after, before)| {
            after
                .iter()
                .filter(|(name, _)| {
                    !(name.starts_with("client") || *name == "hello" || *name == "ping")
                })
                .filter_map(|(name, calls)| {
                    let new = calls - before.get(name).copied().unwrap_or(0);
                    (new > 0).then(|| (name.clone(), new))
                })
                .collect()
        })
        .collect()
}

fn total(per_node: &[BTreeMap<String, u64>]) -> u64 {
    per_node.iter().flat_map(|node| node.values()).sum()
}

/// A handler that stays in flight until `release` is notified.
#[derive(Clone, Default)]
struct Gate {
    entered: Arc<AtomicUsize>,
    release: Arc<Notify>,
}

impl Gate {
    async fn wait_entered(&self, n: usize) {
        let entered = eventually(Duration::from_secs(5), || async {
            self.entered.load(Ordering::SeqCst) >= n
        })
        .await;
        assert!(entered, "handler not entered");
    }
}

fn gated_app(locks: Locks, gate: Gate) -> Router {
    Router::new()
        .route(
            "/buy",
            post(move || async move {
                gate.entered.fetch_add(1, Ordering::SeqCst);
                gate.release.notified().await;
                "bought"
            }),
        )
        .layer(LockLayer::by_header("Idempotency-Key").backend(locks))
}

async fn local_holder_costs_redis_nothing(n: usize) {
    let nodes = nodes(n);
    let r = redlock(&nodes, Duration::from_secs(10)).await;
    let holder = r.try_lock("item:1").await.unwrap();
    let before = snapshot(&nodes).await;
    for _ in 0..50 {
        let err = r.try_lock("item:1").await.unwrap_err();
        let LockError::Taken { retry_after } = err else {
            panic!("expected Taken, got {err:?}");
        };
        assert!(
            retry_after > Duration::from_secs(9) && retry_after <= Duration::from_secs(10),
            "{retry_after:?}: the holder's remaining TTL"
        );
    }
    let spent = since(&nodes, &before).await;
    assert_eq!(total(&spent), 0, "Redis saw {spent:?}");
    r.unlock(holder).await.unwrap();
}

#[tokio::test]
async fn a_key_held_in_process_is_answered_taken_without_redis_one_node() {
    local_holder_costs_redis_nothing(1).await;
}

#[tokio::test]
async fn a_key_held_in_process_is_answered_taken_without_redis_three_nodes() {
    local_holder_costs_redis_nothing(3).await;
}

#[tokio::test]
async fn a_holder_in_another_client_costs_one_script_per_node_and_no_cleanup_where_nothing_was_set()
{
    let nodes = nodes(3);
    let holder_side = redlock(&nodes, Duration::from_secs(10)).await;
    let r = redlock(&nodes, Duration::from_secs(10)).await;
    let holder = holder_side.try_lock("item:2").await.unwrap();
    let before = snapshot(&nodes).await;
    let attempts = 10u64;
    for _ in 0..attempts {
        let err = r.try_lock("item:2").await.unwrap_err();
        let LockError::Taken { retry_after } = err else {
            panic!("expected Taken, got {err:?}");
        };
        assert!(
            retry_after > Duration::from_secs(8) && retry_after <= Duration::from_secs(10),
            "{retry_after:?}: the holder's remaining TTL, in the attempt's reply"
        );
    }
    let spent = since(&nodes, &before).await;
    eprintln!("{attempts} rejected attempts cost {spent:?}");
    let mut releases = 0;
    let mut answered = 0;
    for node in &spent {
        // Per node and attempt: one acquisition script, which reads the holder's `PTTL`
        // and sets nothing (one round trip, where a refused `SET NX PX` and a `PTTL` after
        // it took two).
        let attempted = node.get("pttl").copied().unwrap_or(0);
        assert!(attempted <= attempts, "{spent:?}");
        assert_eq!(node.get("set"), None, "{spent:?}");
        assert_eq!(node.get("del"), None, "{spent:?}");
        // The verdict comes with a quorum of answers: on a node whose answer came after
        // it, the attempt may have set the key, so it is released there (one script that
        // finds nothing of ours: a GET). Nowhere else.
        let late = node.get("get").copied().unwrap_or(0);
        let scripts = node.get("evalsha").copied().unwrap_or(0);
        assert_eq!(scripts, attempted + late, "{spent:?}");
        assert_eq!(node.values().sum::<u64>(), 2 * attempted + 2 * late);
        releases += late;
        answered += attempted;
    }
    // Each attempt has at most one node not awaited (3 nodes, 2 "held" answers decide):
    // the other two answered.
    assert!(releases <= attempts, "{spent:?}");
    assert!(answered >= 2 * attempts, "{spent:?}");
    holder_side.unlock(holder).await.unwrap();
}

#[tokio::test]
async fn a_burst_on_a_key_held_in_process_costs_redis_nothing_over_http() {
    let nodes = nodes(3);
    let locks = redlock(&nodes, Duration::from_secs(10)).await;
    let gate = Gate::default();
    let base = serve(gated_app(locks, gate.clone())).await;
    let client = reqwest::Client::new();
    let send = || {
        client
            .post(format!("{base}/buy"))
            .header("Idempotency-Key", "sale-1")
            .send()
    };
    let first = tokio::spawn(send());
    gate.wait_entered(1).await;
    let before = snapshot(&nodes).await;
    let burst = 100;
    let answers = futures_util::future::join_all((0..burst).map(|_| send())).await;
    for resp in answers {
        assert_eq!(resp.unwrap().status(), 409);
    }
    let spent = since(&nodes, &before).await;
    let per_rejection = total(&spent) as f64 / f64::from(burst);
    assert!(
        per_rejection < 0.05,
        "{per_rejection} Redis commands per rejected request: {spent:?}"
    );
    gate.release.notify_one();
    assert_eq!(first.await.unwrap().unwrap().status(), 200);
    // Released: the next request goes through at once.
    let next = tokio::spawn(send());
    gate.wait_entered(2).await;
    gate.release.notify_one();
    assert_eq!(next.await.unwrap().unwrap().status(), 200);
}

#[tokio::test]
async fn a_release_leaves_the_local_table_at_once() {
    let nodes = nodes(3);
    let r = redlock(&nodes, Duration::from_secs(10)).await;
    for _ in 0..20 {
        let lease = r.try_lock("cycle").await.unwrap();
        r.unlock(lease).await.unwrap();
        // No stale "taken" answer from the table: the very next attempt acquires.
        let lease = r
            .try_lock("cycle")
            .await
            .expect("free right after the release");
        r.unlock(lease).await.unwrap();
    }
    // Through Locks, the handle the layer and the extractor share.
    let locks = r.clone();
    let lease = locks.try_lock("cycle").await.unwrap();
    locks.unlock(lease).await.unwrap();
    assert!(locks.try_lock("cycle").await.is_ok());
}

#[tokio::test]
async fn a_lease_found_lost_by_a_renewal_leaves_the_local_table_at_once() {
    let nodes = nodes(3);
    let r = redlock(&nodes, Duration::from_secs(10)).await;
    let mut lease = r.try_lock("lost").await.unwrap();
    // Someone deletes the key behind the holder's back (an operator, a flush).
    for node in &nodes {
        let mut conn = node.conn().await;
        let () = redis::cmd("DEL")
            .arg(format!("{PREFIX}lost"))
            .query_async(&mut conn)
            .await
            .unwrap();
    }
    // Still valid for ~10 s, so the table alone would answer "taken".
    assert!(matches!(
        r.try_lock("lost").await,
        Err(LockError::Taken { .. })
    ));
    let err = r.extend(&mut lease).await.unwrap_err();
    assert!(matches!(err, LockError::Expired { .. }), "{err:?}");
    let next = r
        .try_lock("lost")
        .await
        .expect("no stale taken after the loss");
    r.unlock(next).await.unwrap();
}

#[tokio::test]
async fn an_expired_lease_leaves_the_local_table_at_once() {
    let nodes = nodes(3);
    let ttl = Duration::from_millis(600);
    let r = redlock(&nodes, ttl).await;
    let lease = r.try_lock("expiring").await.unwrap();
    let valid_until = lease.valid_until();
    assert!(matches!(
        r.try_lock("expiring").await,
        Err(LockError::Taken { .. })
    ));
    tokio::time::sleep_until(valid_until.into()).await;
    // Past its validity the holder is not this process's any more: the next attempt
    // asks Redis, which frees the key when its TTL ends (a drift allowance later).
    let before = snapshot(&nodes).await;
    let _ = r.try_lock("expiring").await;
    assert!(
        total(&since(&nodes, &before).await) > 0,
        "answered from the table"
    );
    let acquired = eventually(Duration::from_secs(3), || async {
        match r.try_lock("expiring").await {
            Ok(lease) => r.unlock(lease).await.is_ok(),
            Err(_) => false,
        }
    })
    .await;
    assert!(acquired, "the key stayed taken after its TTL");
}

#[tokio::test]
async fn max_wait_queues_in_process_behind_a_local_holder() {
    let nodes = nodes(3);
    let r = redlock(&nodes, Duration::from_secs(30)).await;
    let holder = r.try_lock("queue").await.unwrap();
    let before = snapshot(&nodes).await;
    let waiter = tokio::spawn({
        let r = r.clone();
        async move {
            let lease = r
                .acquire(LockRequest::new("queue").wait(Duration::from_secs(10)))
                .await;
            (lease, Instant::now())
        }
    });
    // Give the waiter time to ask Redis, were it going to.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let spent = since(&nodes, &before).await;
    assert_eq!(
        total(&spent),
        0,
        "the queued waiter touched Redis: {spent:?}"
    );
    assert_eq!(
        subscribers(&nodes, "tower-redlock:{tower-redlock:queue}:released").await,
        0,
        "a waiter behind a local holder needs no notification channel"
    );
    assert!(!waiter.is_finished());
    let released_at = Instant::now();
    r.unlock(holder).await.unwrap();
    let (lease, acquired_at) = waiter.await.unwrap();
    let lease = lease.expect("the waiter gets the lock");
    let delay = acquired_at - released_at;
    assert!(
        delay < Duration::from_millis(500),
        "woken after {delay:?}, as if by the 1 s fallback timer"
    );
    r.unlock(lease).await.unwrap();
}

#[tokio::test]
async fn max_wait_through_the_layer_serves_a_local_queue_one_at_a_time() {
    let nodes = nodes(3);
    let locks = redlock(&nodes, Duration::from_secs(10)).await;
    let running = Arc::new(AtomicUsize::new(0));
    let most = Arc::new(AtomicUsize::new(0));
    let app = Router::new()
        .route(
            "/buy",
            post({
                let (running, most) = (running.clone(), most.clone());
                move || async move {
                    let now = running.fetch_add(1, Ordering::SeqCst) + 1;
                    most.fetch_max(now, Ordering::SeqCst);
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    running.fetch_sub(1, Ordering::SeqCst);
                    "bought"
                }
            }),
        )
        .layer(
            LockLayer::by_header("Idempotency-Key")
                .backend(locks)
                .max_wait(Duration::from_secs(10)),
        );
    let base = serve(app).await;
    let client = reqwest::Client::new();
    let answers = futures_util::future::join_all((0..10).map(|_| {
        client
            .post(format!("{base}/buy"))
            .header("Idempotency-Key", "queued")
            .send()
    }))
    .await;
    for resp in answers {
        assert_eq!(resp.unwrap().status(), 200);
    }
    assert_eq!(most.load(Ordering::SeqCst), 1, "two handlers ran at once");
}

/// An app whose handler holds the key for the `hold-ms` header's milliseconds, or until
/// the gate opens when it has none.
fn timed_app(locks: Locks, gate: Gate) -> Router {
    Router::new()
        .route(
            "/items/{id}/buy",
            post(move |headers: http::HeaderMap| async move {
                match headers.get("hold-ms").and_then(|v| v.to_str().ok()) {
                    Some(ms) => {
                        let ms: u64 = ms.parse().unwrap();
                        tokio::time::sleep(Duration::from_millis(ms)).await;
                    }
                    None => {
                        gate.entered.fetch_add(1, Ordering::SeqCst);
                        gate.release.notified().await;
                    }
                }
                "bought"
            }),
        )
        .layer(LockLayer::by_path_param("id").backend(locks))
}

#[tokio::test]
async fn retry_after_of_a_50_ms_handler_is_1_s_not_the_holders_10_s() {
    let nodes = nodes(3);
    let locks = redlock(&nodes, Duration::from_secs(10)).await;
    let gate = Gate::default();
    let base = serve(timed_app(locks, gate.clone())).await;
    let client = reqwest::Client::new();
    let buy = |item: &str, hold_ms: Option<u64>| {
        let mut request = client.post(format!("{base}/items/{item}/buy"));
        if let Some(ms) = hold_ms {
            request = request.header("hold-ms", ms);
        }
        request.send()
    };

    // Nothing observed yet: the holder's remaining TTL, as before.
    let held = tokio::spawn(buy("a", None));
    gate.wait_entered(1).await;
    let resp = buy("a", None).await.unwrap();
    assert_eq!(resp.status(), 423);
    assert_eq!(retry_after(&resp), 10);
    gate.release.notify_one();
    assert_eq!(held.await.unwrap().unwrap().status(), 200);

    // A few 50 ms holds of the route (other items: the scope is the route's).
    for item in ["b", "c", "d"] {
        assert_eq!(buy(item, Some(50)).await.unwrap().status(), 200);
    }
    let held = tokio::spawn(buy("e", None));
    gate.wait_entered(2).await;
    let resp = buy("e", None).await.unwrap();
    assert_eq!(resp.status(), 423);
    assert_eq!(retry_after(&resp), 1, "a 50 ms handler answers 1 s");
    gate.release.notify_one();
    assert_eq!(held.await.unwrap().unwrap().status(), 200);
}

#[tokio::test]
async fn retry_after_is_never_above_the_holders_remaining_ttl() {
    let nodes = nodes(3);
    let locks = redlock(&nodes, Duration::from_secs(10)).await;
    let base = serve(timed_app(locks, Gate::default())).await;
    let client = reqwest::Client::new();
    // One long hold: the route's estimate is 2.2 s.
    let resp = client
        .post(format!("{base}/items/slow/buy"))
        .header("hold-ms", 2200)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    // Another client holds an item with 800 ms left on every node.
    for node in &nodes {
        let mut conn = node.conn().await;
        let () = redis::cmd("SET")
            .arg(format!("{PREFIX}/items/%7Bid%7D:short"))
            .arg("another-client")
            .arg("PX")
            .arg(800)
            .query_async(&mut conn)
            .await
            .unwrap();
    }
    let resp = post_to(&client, format!("{base}/items/short/buy")).await;
    assert_eq!(resp.status(), 423);
    assert_eq!(
        retry_after(&resp),
        1,
        "bounded by the holder's 800 ms, not the 2.2 s estimate (3)"
    );
}
