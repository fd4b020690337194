//! Leases on several keys at once (`lock_all`): all or none, no deadlock whatever the
//! order, one quorum verdict for the set, node faults, and the HTTP answers of a handler
//! that locks two accounts; on the in-process backend and on real `redis-server` nodes.

use crate::support;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use axum::Router;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use support::{RedisNode, eventually, exists, get, nodes, retry_after, serve, urls};
use tower_redlock::LockRequest;
use tower_redlock::{LockError, Locks, MemoryLocks, Redlock, Rejection, Renewal};

const PREFIX: &str = "tower-redlock:";

fn redlock_builder(nodes: &[RedisNode], ttl: Duration) -> tower_redlock::RedlockBuilder {
    Redlock::builder(urls(nodes))
        .ttl(ttl)
        .node_timeout(Duration::from_millis(200))
        .retry_count(2000)
        .retry_delay(Duration::from_millis(1), Duration::from_millis(5))
}

async fn redlock(nodes: &[RedisNode], ttl: Duration) -> Locks {
    Locks::from(redlock_builder(nodes, ttl).build().await.unwrap())
}

fn memory() -> Locks {
    Locks::from(
        MemoryLocks::builder()
            .retry_count(2000)
            .retry_delay(Duration::from_millis(1), Duration::from_millis(5))
            .build()
            .unwrap(),
    )
}

/// On how many of `nodes` the key exists.
async fn count_on(nodes: &[RedisNode], key: &str) -> usize {
    let mut n = 0;
    for node in nodes {
        n += usize::from(exists(node, key).await);
    }
    n
}

/// Waits (bounded) until `key` is on none of `nodes`: a release or the cleanup of a refused
/// attempt returns at its verdict and finishes on the last nodes in the background.
async fn assert_gone(nodes: &[RedisNode], key: &str) {
    assert!(
        eventually(Duration::from_secs(5), || async {
            count_on(nodes, key).await == 0
        })
        .await,
        "{key} is still on {} node(s)",
        count_on(nodes, key).await
    );
}

/// All or none: a set with one held key takes nothing, and then takes all once it frees.
async fn all_or_none(locks: &Locks, nodes: &[RedisNode]) {
    let bob = locks.try_lock("bob").await.unwrap();
    let err = locks
        .acquire(LockRequest::all(["alice", "bob", "carol"]))
        .await
        .unwrap_err();
    assert!(matches!(err, LockError::Taken { .. }), "{err:?}");
    // Nothing of the refused set is left behind: not in process, not on any node.
    for key in ["alice", "carol"] {
        assert_gone(nodes, &format!("{PREFIX}{key}")).await;
        let lease = locks
            .try_lock(key)
            .await
            .expect("left free by the refused set");
        locks.unlock(lease).await.unwrap();
    }
    locks.unlock(bob).await.unwrap();
    let set = locks
        .acquire(LockRequest::all(["carol", "bob", "alice"]))
        .await
        .unwrap();
    assert_eq!(
        set.keys().collect::<Vec<_>>(),
        [
            "tower-redlock:alice",
            "tower-redlock:bob",
            "tower-redlock:carol"
        ]
    );
    // Every key holds the token on a quorum (the last node may not have been awaited).
    for key in set.keys() {
        let mut holding = 0;
        for node in nodes {
            holding += usize::from(get(node, key).await.as_deref() == Some(set.token().as_str()));
        }
        assert!(holding >= nodes.len().div_ceil(2), "{key} on {holding}");
    }
    for key in ["alice", "bob", "carol"] {
        assert!(matches!(
            locks.try_lock(key).await,
            Err(LockError::Taken { .. })
        ));
    }
    let keys: Vec<String> = set.keys().map(str::to_owned).collect();
    locks.unlock(set).await.unwrap();
    for key in &keys {
        assert_gone(nodes, key).await;
    }
}

#[tokio::test]
async fn all_or_none_when_one_key_is_taken_in_process() {
    all_or_none(&memory(), &[]).await;
}

#[tokio::test]
async fn all_or_none_when_one_key_is_taken_on_redis() {
    let nodes = nodes(3);
    all_or_none(&redlock(&nodes, Duration::from_secs(10)).await, &nodes).await;
}

/// Transfers between accounts `a` and `b` in both orders at once, on shared counters
/// read and written without atomicity: every transfer completes (no deadlock), nobody is
/// ever inside with a contender, and the total is kept.
async fn opposite_orders(locks: Locks) {
    const TASKS: usize = 8;
    const ROUNDS: usize = 10;
    let balances = Arc::new(std::sync::Mutex::new([1000i64, 1000i64]));
    let inside = Arc::new(AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for task in 0..TASKS {
        let locks = locks.clone();
        let balances = balances.clone();
        let inside = inside.clone();
        tasks.push(tokio::spawn(async move {
            // Half name the accounts one way round, half the other.
            let (from, to, names) = if task % 2 == 0 {
                (0, 1, ["account:a", "account:b"])
            } else {
                (1, 0, ["account:b", "account:a"])
            };
            for _ in 0..ROUNDS {
                locks
                    .with_lock(
                        LockRequest::all(names).retry(),
                        Renewal::default(),
                        |_| async {
                            assert_eq!(inside.fetch_add(1, Ordering::SeqCst), 0, "two holders");
                            let [a, b] = *balances.lock().unwrap();
                            tokio::task::yield_now().await;
                            let mut next = [a, b];
                            next[from] -= 1;
                            next[to] += 1;
                            *balances.lock().unwrap() = next;
                            inside.fetch_sub(1, Ordering::SeqCst);
                        },
                    )
                    .await
                    .expect("the set within the retries");
            }
        }));
    }
    let all = async {
        for task in tasks {
            task.await.unwrap();
        }
    };
    tokio::time::timeout(Duration::from_secs(120), all)
        .await
        .expect("every transfer completes: no deadlock");
    let [a, b] = *balances.lock().unwrap();
    assert_eq!(a + b, 2000);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn opposite_orders_never_deadlock_in_process() {
    opposite_orders(memory()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn opposite_orders_never_deadlock_on_redis() {
    let nodes = nodes(3);
    opposite_orders(redlock(&nodes, Duration::from_secs(10)).await).await;
}

#[tokio::test]
async fn retry_after_is_the_longest_holder_of_the_set() {
    let nodes = nodes(3);
    let short = redlock(&nodes, Duration::from_secs(2)).await;
    let long = redlock(&nodes, Duration::from_secs(60)).await;
    let _a = short.try_lock("a").await.unwrap();
    let _b = long.try_lock("b").await.unwrap();
    let Err(LockError::Taken { retry_after }) =
        short.acquire(LockRequest::all(["a", "b", "c"])).await
    else {
        panic!("the set is taken")
    };
    assert!(
        retry_after > Duration::from_secs(30) && retry_after <= Duration::from_secs(60),
        "{retry_after:?}"
    );
    assert_gone(&nodes, "tower-redlock:c").await;
}

#[tokio::test]
async fn a_minority_killed_is_still_exclusive() {
    let mut nodes = nodes(3);
    let locks = redlock(&nodes, Duration::from_secs(10)).await;
    nodes[2].kill();
    let set = locks.acquire(LockRequest::all(["x", "y"])).await.unwrap();
    assert!(matches!(
        locks.acquire(LockRequest::all(["y", "z"])).await,
        Err(LockError::Taken { .. })
    ));
    assert!(matches!(
        locks.try_lock("x").await,
        Err(LockError::Taken { .. })
    ));
    // Another client on the same nodes sees the same.
    let other = redlock(&nodes, Duration::from_secs(10)).await;
    assert!(matches!(
        other.acquire(LockRequest::all(["z", "x"])).await,
        Err(LockError::Taken { .. })
    ));
    assert_gone(&nodes[..2], "tower-redlock:z").await;
    locks.unlock(set).await.unwrap();
    other.acquire(LockRequest::all(["z", "x"])).await.unwrap();
}

#[tokio::test]
async fn a_majority_gone_is_no_quorum() {
    let mut nodes = nodes(3);
    let locks = redlock(&nodes, Duration::from_secs(10)).await;
    let mut set = locks.acquire(LockRequest::all(["p", "q"])).await.unwrap();
    nodes[1].kill();
    nodes[2].kill();
    assert!(matches!(
        locks.acquire(LockRequest::all(["r", "s"])).await,
        Err(LockError::NoQuorum { .. })
    ));
    // A held set can neither be proven lost nor kept.
    assert!(matches!(
        locks.extend(&mut set).await,
        Err(LockError::NoQuorum { .. })
    ));
    assert!(matches!(
        locks.unlock(set).await,
        Err(LockError::NoQuorum { .. })
    ));
    // Nothing of the refused set stays on the node left.
    assert_gone(&nodes[..1], "tower-redlock:r").await;
}

#[tokio::test]
async fn renewal_keeps_every_key_and_the_end_releases_them() {
    let nodes = nodes(3);
    let ttl = Duration::from_millis(600);
    let locks = redlock(&nodes, ttl).await;
    let keys = locks
        .with_lock(
            LockRequest::all(["m", "n"]).retry(),
            Renewal::default(),
            |status| async move {
                // Held past several TTLs: renewed on every key.
                let mut held = tokio::time::interval(ttl / 2);
                for _ in 0..5 {
                    held.tick().await;
                }
                assert!(status.remaining() > Duration::ZERO);
                status.lease().keys().map(str::to_owned).collect::<Vec<_>>()
            },
        )
        .await
        .expect("not lost");
    assert_eq!(keys, ["tower-redlock:m", "tower-redlock:n"]);
    for key in &keys {
        assert_gone(&nodes, key).await;
    }
}

#[tokio::test]
async fn a_set_with_one_key_taken_over_is_expired() {
    let nodes = nodes(3);
    let locks = redlock(&nodes, Duration::from_secs(10)).await;
    let set = locks.acquire(LockRequest::all(["u", "v"])).await.unwrap();
    // Another client's value on `v` on every node (as if the lease had run out there).
    for node in &nodes {
        let mut conn = node.conn().await;
        let () = redis::cmd("SET")
            .arg("tower-redlock:v")
            .arg("someone-else")
            .arg("PX")
            .arg(60_000)
            .query_async(&mut conn)
            .await
            .unwrap();
    }
    assert!(matches!(
        locks.extend(&mut set.clone()).await,
        Err(LockError::Expired { taken_over: true })
    ));
    assert!(matches!(
        locks.unlock(set.clone()).await,
        Err(LockError::Expired { taken_over: true })
    ));
    // Our key was released; theirs is left as it was.
    assert_gone(&nodes, "tower-redlock:u").await;
    for node in &nodes {
        assert_eq!(
            get(node, "tower-redlock:v").await.as_deref(),
            Some("someone-else")
        );
    }
}

#[tokio::test]
async fn fencing_token_of_a_set_is_above_each_key() {
    let nodes = nodes(3);
    let locks = Locks::from(
        redlock_builder(&nodes, Duration::from_secs(10))
            .fencing_tokens(true)
            .build()
            .await
            .unwrap(),
    );
    let mut last = 0;
    for _ in 0..3 {
        let lease = locks.try_lock("f1").await.unwrap();
        last = lease.fencing_token().unwrap();
        locks.unlock(lease).await.unwrap();
    }
    let set = locks.acquire(LockRequest::all(["f2", "f1"])).await.unwrap();
    let fence = set.fencing_token().expect("a set has one fencing token");
    assert!(fence > last, "{fence} > {last}");
    locks.unlock(set).await.unwrap();
    // Each key's counter was raised to it: the next holder of either key goes above.
    for key in ["f1", "f2"] {
        let lease = locks.try_lock(key).await.unwrap();
        assert!(lease.fencing_token().unwrap() > fence, "{key}");
        locks.unlock(lease).await.unwrap();
    }
}

/// A handler that moves between two accounts named in the path, under one lease on both:
/// one attempt, 423 with `Retry-After` when either is held, 503 without a quorum.
async fn transfer(
    State(locks): State<Locks>,
    Path((from, to)): Path<(String, String)>,
) -> Response {
    let accounts = [format!("account:{from}"), format!("account:{to}")];
    let lease = match locks.acquire(LockRequest::all(&accounts)).await {
        Ok(lease) => lease,
        Err(e) => return Rejection::from_lock_error(&e, StatusCode::LOCKED).into_response(),
    };
    let keys = lease.keys().count();
    match locks
        .with_lease(lease, Renewal::default(), |_| async move {
            tokio::time::sleep(Duration::from_millis(10)).await;
            keys
        })
        .await
    {
        Ok(keys) => format!("{keys} accounts").into_response(),
        Err(e) => Rejection::from_lock_error(&e, StatusCode::LOCKED).into_response(),
    }
}

#[tokio::test]
async fn http_answers_for_a_set_423_then_503_without_a_majority() {
    let mut nodes = nodes(3);
    let locks = redlock(&nodes, Duration::from_secs(20)).await;
    let app = Router::new()
        .route("/transfers/{from}/{to}", post(transfer))
        .with_state(locks.clone());
    let base = serve(app).await;
    let client = reqwest::Client::new();
    let post = |path: &str| client.post(format!("{base}{path}")).send();

    let ok = post("/transfers/a/b").await.unwrap();
    assert_eq!(ok.status(), 200);
    assert_eq!(ok.text().await.unwrap(), "2 accounts");

    // `b` held elsewhere: a transfer naming it either way round is 423.
    let held = locks.try_lock("account:b").await.unwrap();
    for path in ["/transfers/a/b", "/transfers/b/c"] {
        let resp = post(path).await.unwrap();
        assert_eq!(resp.status(), 423, "{path}");
        let retry_after = retry_after(&resp);
        assert!((15..=20).contains(&retry_after), "{retry_after}");
        assert_eq!(resp.headers()["content-type"], "application/problem+json");
    }
    locks.unlock(held).await.unwrap();
    assert!(
        eventually(Duration::from_secs(5), || async {
            post("/transfers/b/c").await.unwrap().status() == 200
        })
        .await
    );

    nodes[1].kill();
    assert_eq!(
        post("/transfers/a/c").await.unwrap().status(),
        200,
        "a minority down"
    );
    nodes[2].kill();
    let resp = post("/transfers/a/c").await.unwrap();
    assert_eq!(resp.status(), 503);
    assert_eq!(resp.headers()["retry-after"], "1");
}

/// Requests marked `hold` stay in the handler until the test lets them go.
#[derive(Clone)]
struct Gate {
    entered: Arc<tokio::sync::Notify>,
    release: Arc<tokio::sync::Semaphore>,
}

impl Gate {
    fn new() -> Self {
        Self {
            entered: Arc::new(tokio::sync::Notify::new()),
            release: Arc::new(tokio::sync::Semaphore::new(0)),
        }
    }
}

/// `POST /transfers` behind `LockLayer::by_fn_all` on the `from` and `to` headers.
fn transfers_app(locks: &Locks, gate: Gate) -> Router {
    let layer = tower_redlock::LockLayer::by_fn_all(|parts| {
        let account = |name| Some(parts.headers.get(name)?.to_str().ok()?.to_owned());
        Some(vec![account("from")?, account("to")?])
    })
    .scope("account")
    .backend(locks.clone());
    let handler = move |lease: tower_redlock::Lease, headers: axum::http::HeaderMap| async move {
        if headers.contains_key("hold") {
            gate.entered.notify_one();
            gate.release.acquire().await.unwrap().forget();
        }
        lease.keys().collect::<Vec<_>>().join(" ")
    };
    Router::new().route("/transfers", post(handler).layer(layer))
}

async fn send(base: &str, from: &str, to: &str, hold: bool) -> reqwest::Response {
    let mut request = reqwest::Client::new()
        .post(format!("{base}/transfers"))
        .header("from", from)
        .header("to", to);
    if hold {
        request = request.header("hold", "1");
    }
    request.send().await.unwrap()
}

async fn layer_over_a_set(locks: Locks, nodes: &[RedisNode]) {
    let gate = Gate::new();
    let base = serve(transfers_app(&locks, gate.clone())).await;
    let entered = gate.entered.notified();
    let first = tokio::spawn({
        let base = base.clone();
        async move { send(&base, "b", "a", true).await }
    });
    tokio::time::timeout(Duration::from_secs(10), entered)
        .await
        .expect("the first transfer runs");
    // Held on a quorum of nodes (the acquisition does not wait for the last node).
    let quorum = if nodes.is_empty() {
        0
    } else {
        nodes.len() / 2 + 1
    };
    assert!(count_on(nodes, "tower-redlock:account:a").await >= quorum);
    assert!(count_on(nodes, "tower-redlock:account:b").await >= quorum);
    // Either account, named either way round: 423 with Retry-After, nothing left held.
    for (from, to) in [("a", "b"), ("c", "b"), ("a", "d")] {
        let resp = send(&base, from, to, false).await;
        assert_eq!(resp.status(), 423, "{from} -> {to}");
        assert!(resp.headers().contains_key("retry-after"));
    }
    assert_gone(nodes, "tower-redlock:account:c").await;
    let other = send(&base, "c", "d", false).await;
    assert_eq!(other.status(), 200);
    assert_eq!(
        other.text().await.unwrap(),
        "tower-redlock:account:c tower-redlock:account:d"
    );
    gate.release.add_permits(1);
    let first = first.await.unwrap();
    assert_eq!(first.status(), 200);
    assert_eq!(
        first.text().await.unwrap(),
        "tower-redlock:account:a tower-redlock:account:b"
    );
    // Released with the response: both keys, on every node.
    assert!(
        eventually(Duration::from_secs(5), || async {
            count_on(nodes, "tower-redlock:account:a").await
                + count_on(nodes, "tower-redlock:account:b").await
                == 0
        })
        .await
    );
    assert_eq!(send(&base, "a", "b", false).await.status(), 200);
    // No key, or a bad one: 400.
    let missing = reqwest::Client::new()
        .post(format!("{base}/transfers"))
        .header("from", "a")
        .send()
        .await
        .unwrap();
    assert_eq!(missing.status(), 400);
    assert_eq!(send(&base, "a", "", false).await.status(), 400);
}

#[tokio::test]
async fn layer_by_fn_all_locks_every_key_in_process() {
    layer_over_a_set(memory(), &[]).await;
}

#[tokio::test]
async fn layer_by_fn_all_locks_every_key_on_redis() {
    let nodes = nodes(3);
    layer_over_a_set(redlock(&nodes, Duration::from_secs(10)).await, &nodes).await;
}

#[tokio::test]
async fn layer_by_fn_all_with_a_minority_killed_then_a_majority_gone() {
    let mut nodes = nodes(3);
    let locks = redlock(&nodes, Duration::from_secs(10)).await;
    let gate = Gate::new();
    let base = serve(transfers_app(&locks, gate.clone())).await;
    nodes[0].kill();
    let entered = gate.entered.notified();
    let first = tokio::spawn({
        let base = base.clone();
        async move { send(&base, "a", "b", true).await }
    });
    tokio::time::timeout(Duration::from_secs(10), entered)
        .await
        .expect("the first transfer runs");
    // Still exclusive on the two nodes left.
    assert_eq!(send(&base, "b", "a", false).await.status(), 423);
    gate.release.add_permits(1);
    assert_eq!(first.await.unwrap().status(), 200);
    nodes[1].kill();
    let resp = send(&base, "a", "b", false).await;
    assert_eq!(resp.status(), 503);
    assert_eq!(resp.headers()["retry-after"], "1");
}

/// The commands each node was sent since `before` (`INFO commandstats` also counts the
/// commands a script runs: those are left out, as is the test's own connections' setup).
async fn ran_since(
    node: &RedisNode,
    before: &std::collections::BTreeMap<String, u64>,
) -> std::collections::BTreeMap<String, u64> {
    support::command_calls(node)
        .await
        .into_iter()
        .filter(|(name, _)| name.starts_with("eval") || name.starts_with("script"))
        .filter_map(|(name, calls)| {
            let new = calls - before.get(&name).copied().unwrap_or(0);
            (new > 0).then_some((name, new))
        })
        .collect()
}

#[tokio::test]
async fn a_set_costs_one_script_per_node_for_each_operation() {
    let nodes = nodes(3);
    // A node timeout no loaded machine reaches: a timed-out command would be counted again
    // on a new connection (which loads every script), and the counts would be a timing's.
    let locks = Locks::from(
        redlock_builder(&nodes, Duration::from_secs(10))
            .node_timeout(Duration::from_secs(5))
            .build()
            .await
            .unwrap(),
    );
    let keys = ["k1", "k2", "k3", "k4", "k5"];
    // Warm up: the scripts are loaded on every node.
    let mut lease = locks.acquire(LockRequest::all(keys)).await.unwrap();
    locks.extend(&mut lease).await.unwrap();
    locks.unlock(lease).await.unwrap();
    let snapshot = || async {
        let mut calls = Vec::new();
        for node in &nodes {
            calls.push(support::command_calls(node).await);
        }
        calls
    };
    let before = snapshot().await;
    let mut lease = locks.acquire(LockRequest::all(keys)).await.unwrap();
    locks.extend(&mut lease).await.unwrap();
    locks.unlock(lease).await.unwrap();
    let scripts = |n: u64| std::collections::BTreeMap::from([("evalsha".to_owned(), n)]);
    for (node, before) in nodes.iter().zip(&before) {
        assert!(
            eventually(Duration::from_secs(5), || async {
                ran_since(node, before).await == scripts(3)
            })
            .await,
            "{:?}",
            ran_since(node, before).await
        );
    }
    // A refusal answers after one script per node; a node whose answer was not awaited
    // (the verdict came from the others) gets one more, the release in the background.
    let _held = locks.acquire(LockRequest::all(keys)).await.unwrap();
    let before = snapshot().await;
    assert!(matches!(
        locks.acquire(LockRequest::all(["k5", "k6"])).await,
        Err(LockError::Taken { .. })
    ));
    let mut total = 0;
    for (node, before) in nodes.iter().zip(&before) {
        // The script of a node whose answer was not awaited may still be on its way.
        assert!(
            eventually(Duration::from_secs(5), || async {
                !ran_since(node, before).await.is_empty()
            })
            .await
        );
        let ran = ran_since(node, before).await;
        assert!(ran == scripts(1) || ran == scripts(2), "{ran:?}");
        total += ran["evalsha"];
    }
    assert!(total <= 4, "{total}");
    assert!(
        eventually(Duration::from_secs(5), || async {
            count_on(&nodes, "tower-redlock:k6").await == 0
        })
        .await
    );
}
