//! Bounded waiting for a held lock, woken by release notifications, on real Redis.

use crate::support;

use std::time::{Duration, Instant};

use futures_util::StreamExt;

use axum::Router;
use axum::routing::post;
use support::{RedisNode, calls, command_calls, eventually, nodes, pttl, serve, subscribers, urls};
use tower_redlock::LockRequest;
use tower_redlock::{LockError, LockLayer, Locks, MemoryLocks, Redlock};

async fn redlock(nodes: &[RedisNode], ttl: Duration, notify: bool) -> Locks {
    Locks::from(
        Redlock::builder(urls(nodes))
            .ttl(ttl)
            .node_timeout(Duration::from_millis(200))
            .notify_waiters(notify)
            .build()
            .await
            .unwrap(),
    )
}

async fn woken_on_release(nodes: &[RedisNode]) {
    // A long TTL: without a notification the waiter would sleep its 1 s fallback. The
    // holder is another client: behind one of its own, a client queues in process.
    let r = redlock(nodes, Duration::from_secs(30), true).await;
    let holder_side = redlock(nodes, Duration::from_secs(30), true).await;
    let holder = holder_side.try_lock("queue").await.unwrap();
    let waiter = tokio::spawn({
        let r = r.clone();
        async move {
            let lease = r
                .acquire(LockRequest::new("queue").wait(Duration::from_secs(10)))
                .await;
            (lease, Instant::now())
        }
    });
    let subscribed = eventually(Duration::from_secs(5), || async {
        subscribers(nodes, "tower-redlock:{tower-redlock:queue}:released").await
            == nodes.len() as i64
    })
    .await;
    assert!(subscribed, "the waiter did not subscribe on every node");
    let released_at = Instant::now();
    holder_side.unlock(holder).await.unwrap();
    let (lease, acquired_at) = waiter.await.unwrap();
    let lease = lease.expect("the waiter gets the lock");
    let delay = acquired_at - released_at;
    assert!(
        delay < Duration::from_millis(300),
        "woken after {delay:?}, as if by the fallback timer"
    );
    r.unlock(lease).await.unwrap();
    // The subscription goes once nobody waits.
    let gone = eventually(Duration::from_secs(5), || async {
        subscribers(nodes, "tower-redlock:{tower-redlock:queue}:released").await == 0
    })
    .await;
    assert!(gone, "subscription left behind");
}

#[tokio::test]
async fn waiter_is_woken_by_release_one_node() {
    woken_on_release(&nodes(1)).await;
}

#[tokio::test]
async fn waiter_is_woken_by_release_three_nodes() {
    woken_on_release(&nodes(3)).await;
}

#[tokio::test]
async fn wait_is_bounded() {
    let nodes = nodes(3);
    let r = redlock(&nodes, Duration::from_secs(30), true).await;
    let _holder = r.try_lock("busy").await.unwrap();
    let start = Instant::now();
    let err = r
        .acquire(LockRequest::new("busy").wait(Duration::from_millis(400)))
        .await
        .unwrap_err();
    let elapsed = start.elapsed();
    assert!(matches!(err, LockError::Taken { .. }), "{err:?}");
    assert!(
        elapsed >= Duration::from_millis(400) && elapsed < Duration::from_millis(900),
        "{elapsed:?}"
    );
}

#[tokio::test]
async fn without_notifications_the_fallback_timer_still_acquires() {
    let nodes = nodes(1);
    let r = redlock(&nodes, Duration::from_secs(30), false).await;
    // Another client holds it: behind one of its own, a client is woken in process.
    let holder_side = redlock(&nodes, Duration::from_secs(30), false).await;
    let holder = holder_side.try_lock("slowpoke").await.unwrap();
    let waiter = tokio::spawn({
        let r = r.clone();
        async move {
            r.acquire(LockRequest::new("slowpoke").wait(Duration::from_secs(5)))
                .await
        }
    });
    holder_side.unlock(holder).await.unwrap();
    assert!(waiter.await.unwrap().is_ok());
}

#[tokio::test]
async fn expiry_without_release_wakes_the_waiter() {
    let nodes = nodes(1);
    let ttl = Duration::from_millis(300);
    let r = redlock(&nodes, ttl, true).await;
    let _abandoned = r.try_lock("expiring").await.unwrap();
    let start = Instant::now();
    let lease = r
        .acquire(LockRequest::new("expiring").wait(Duration::from_secs(5)))
        .await
        .expect("acquired after expiry");
    assert!(
        start.elapsed() < ttl + Duration::from_millis(400),
        "{:?}",
        start.elapsed()
    );
    assert_ne!(lease.token(), _abandoned.token());
}

#[tokio::test]
async fn in_process_waiter_is_woken_by_release() {
    let locks = Locks::from(MemoryLocks::new());
    let holder = locks.try_lock("q").await.unwrap();
    let waiter = tokio::spawn({
        let locks = locks.clone();
        async move {
            (
                locks
                    .acquire(LockRequest::new("q").wait(Duration::from_secs(10)))
                    .await,
                Instant::now(),
            )
        }
    });
    // On this single-threaded runtime the yield runs the waiter until it waits.
    tokio::task::yield_now().await;
    let released_at = Instant::now();
    locks.unlock(holder).await.unwrap();
    let (lease, at) = waiter.await.unwrap();
    assert!(lease.is_ok());
    assert!(
        at - released_at < Duration::from_millis(100),
        "{:?}",
        at - released_at
    );
}

#[tokio::test]
async fn layer_waits_for_the_holder_instead_of_409() {
    let nodes = nodes(3);
    let locks = redlock(&nodes, Duration::from_secs(30), true).await;
    let app = Router::new()
        .route(
            "/orders",
            post(|| async {
                tokio::time::sleep(Duration::from_millis(300)).await;
                "done"
            }),
        )
        .layer(
            LockLayer::by_header("Idempotency-Key")
                .backend(locks)
                .max_wait(Duration::from_secs(3)),
        );
    let base = serve(app).await;
    let client = reqwest::Client::new();
    let send = || {
        client
            .post(format!("{base}/orders"))
            .header("Idempotency-Key", "same")
            .send()
    };
    let (a, b) = tokio::join!(send(), send());
    assert_eq!(a.unwrap().status(), 200);
    assert_eq!(b.unwrap().status(), 200);
}

#[tokio::test]
async fn failed_attempts_wake_nobody() {
    // Another holder has two of three nodes: each of our attempts takes the third and
    // cleans it up again. That cleanup must not publish, or the waiter would wake itself
    // in a loop (and every other waiter with it).
    let nodes = nodes(3);
    let r = redlock(&nodes, Duration::from_secs(30), true).await;
    for node in &nodes[..2] {
        let mut conn = node.conn().await;
        let () = redis::cmd("SET")
            .arg("tower-redlock:partial")
            .arg("someone-else")
            .arg("PX")
            .arg(800)
            .query_async(&mut conn)
            .await
            .unwrap();
    }
    let lease = r
        .acquire(LockRequest::new("partial").wait(Duration::from_secs(5)))
        .await
        .expect("acquired after the holder's TTL");
    let mut publishes = 0;
    let mut sets = 0;
    for node in &nodes {
        publishes += calls(node, "publish").await;
        sets += calls(node, "set").await;
    }
    assert_eq!(publishes, 0, "cleanup of failed attempts published");
    // 2 seeding SETs, then a handful of attempts per node: never a storm.
    assert!(sets < 2 + 3 * 10, "{sets} SET calls while waiting");
    r.unlock(lease).await.unwrap();
}

#[tokio::test]
async fn release_nobody_waits_for_publishes_nothing() {
    let nodes = nodes(1);
    let r = redlock(&nodes, Duration::from_secs(30), true).await;
    let channel = "tower-redlock:{tower-redlock:quiet}:released";
    // A plain listener is no waiter: it does not mark the key.
    let mut listener = redis::Client::open(nodes[0].url())
        .unwrap()
        .get_async_pubsub()
        .await
        .unwrap();
    listener.subscribe(channel).await.unwrap();
    let lease = r.try_lock("quiet").await.unwrap();
    r.unlock(lease).await.unwrap();
    // Messages on one channel arrive in order: had the release published, its message
    // would come first.
    let mut conn = nodes[0].conn().await;
    let receivers: i64 = redis::cmd("PUBLISH")
        .arg(channel)
        .arg("sentinel")
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(receivers, 1);
    let first = tokio::time::timeout(Duration::from_secs(5), listener.on_message().next())
        .await
        .expect("the sentinel arrives")
        .unwrap();
    assert_eq!(first.get_payload::<String>().unwrap(), "sentinel");
    assert_eq!(calls(&nodes[0], "publish").await, 1, "only the sentinel");
}

/// Each node's value for `key`.
async fn values(nodes: &[RedisNode], key: &str) -> Vec<Option<String>> {
    let mut values = Vec::new();
    for node in nodes {
        values.push(support::get(node, key).await);
    }
    values
}

async fn marked_lease_extends_and_release_wakes(fencing: bool) {
    let nodes = nodes(3);
    let build = || {
        Redlock::builder(urls(&nodes))
            .ttl(Duration::from_secs(30))
            .node_timeout(Duration::from_millis(200))
            .fencing_tokens(fencing)
            .build()
    };
    let (holder_side, waiter_side) = (
        Locks::from(build().await.unwrap()),
        Locks::from(build().await.unwrap()),
    );
    let mut holder = holder_side.try_lock("marked").await.unwrap();
    let waiter = tokio::spawn(async move {
        let lease = waiter_side
            .acquire(LockRequest::new("marked").wait(Duration::from_secs(10)))
            .await;
        (lease, Instant::now())
    });
    let all_marked = eventually(Duration::from_secs(5), || async {
        let mut marked = 0;
        for node in &nodes {
            marked += usize::from(
                support::exists(node, "tower-redlock:{tower-redlock:marked}:waiters").await,
            );
        }
        marked == nodes.len()
    })
    .await;
    assert!(
        all_marked,
        "the waiter did not set its mark beside the lock on every node"
    );
    // The holder's value is its token, untouched by the waiter.
    let token = holder.token().to_string();
    assert!(
        values(&nodes, "tower-redlock:marked")
            .await
            .iter()
            .all(|v| v.as_deref() == Some(token.as_str())),
        "the waiter modified the holder's value"
    );
    // The holder still owns the key.
    holder_side
        .extend(&mut holder)
        .await
        .expect("a marked lease extends");
    for node in &nodes {
        let pttl = pttl(node, "tower-redlock:marked").await;
        assert!(pttl > 20_000, "PTTL {pttl} after extending");
    }
    let released_at = Instant::now();
    holder_side
        .unlock(holder)
        .await
        .expect("a marked lease releases");
    let (lease, acquired_at) = waiter.await.unwrap();
    let lease = lease.expect("the waiter gets the lock");
    let delay = acquired_at - released_at;
    // The fallback timer would take 1 s: the release published.
    assert!(delay < Duration::from_millis(300), "woken after {delay:?}");
    if fencing {
        assert!(lease.fencing_token().is_some());
    }
    let published: u64 = calls(&nodes[0], "publish").await
        + calls(&nodes[1], "publish").await
        + calls(&nodes[2], "publish").await;
    assert_eq!(
        published, 3,
        "the release of a marked key publishes on every node"
    );
}

#[tokio::test]
async fn marked_lease_extends_and_its_release_wakes_the_waiter() {
    marked_lease_extends_and_release_wakes(false).await;
}

#[tokio::test]
async fn marked_fenced_lease_extends_and_its_release_wakes_the_waiter() {
    marked_lease_extends_and_release_wakes(true).await;
}

#[tokio::test]
async fn cancelled_waits_leave_no_subscription() {
    let nodes = nodes(3);
    let r = redlock(&nodes, Duration::from_secs(30), true).await;
    // Another client holds the keys, so that the waits subscribe (behind a holder of its
    // own, a client queues in process).
    let holder_side = redlock(&nodes, Duration::from_secs(30), true).await;
    let mut holders = Vec::new();
    for i in 0..10 {
        holders.push(holder_side.try_lock(&format!("cancel-{i}")).await.unwrap());
    }
    for i in 0..10 {
        let key = format!("cancel-{i}");
        let wait = r.acquire(LockRequest::new(&key).wait(Duration::from_secs(10)));
        assert!(
            tokio::time::timeout(Duration::from_millis(200), wait)
                .await
                .is_err()
        );
    }
    let gone = eventually(Duration::from_secs(5), || async {
        let mut channels = 0;
        for node in &nodes {
            let mut conn = node.conn().await;
            let open: Vec<String> = redis::cmd("PUBSUB")
                .arg("CHANNELS")
                .arg("tower-redlock:{tower-redlock:*")
                .query_async(&mut conn)
                .await
                .unwrap();
            channels += open.len();
        }
        channels == 0
    })
    .await;
    assert!(gone, "cancelled waits left their subscriptions behind");
}

#[tokio::test]
async fn waiting_on_a_key_of_another_type_is_taken_not_an_outage() {
    let nodes = nodes(1);
    let r = redlock(&nodes, Duration::from_secs(30), true).await;
    let mut conn = nodes[0].conn().await;
    let () = redis::cmd("HSET")
        .arg("tower-redlock:typed")
        .arg("field")
        .arg("value")
        .query_async(&mut conn)
        .await
        .unwrap();
    // The waiter's attempts try to mark the holder's value; a hash is no token to mark.
    let err = r
        .acquire(LockRequest::new("typed").wait(Duration::from_millis(300)))
        .await
        .unwrap_err();
    assert!(matches!(err, LockError::Taken { .. }), "{err:?}");
}

#[tokio::test]
async fn release_nobody_waits_for_costs_no_publish() {
    let nodes = nodes(1);
    let r = redlock(&nodes, Duration::from_secs(30), true).await;
    const RELEASES: u64 = 50;
    let mut leases = Vec::new();
    for i in 0..RELEASES {
        leases.push(r.try_lock(&format!("unwatched-{i}")).await.unwrap());
    }
    let before = command_calls(&nodes[0]).await;
    for lease in leases {
        r.unlock(lease).await.unwrap();
    }
    let after = command_calls(&nodes[0]).await;
    let mut per_release = Vec::new();
    let mut total = 0;
    for (name, calls) in &after {
        let delta = calls - before.get(name).copied().unwrap_or(0);
        total += delta;
        if delta > 0 {
            per_release.push(format!("{name} {:.2}", delta as f64 / RELEASES as f64));
        }
    }
    eprintln!(
        "commands per release nobody waits for: {}",
        per_release.join(", ")
    );
    assert_eq!(
        after.get("publish").copied().unwrap_or(0),
        before.get("publish").copied().unwrap_or(0),
        "a release nobody waits for published"
    );
    // One script: the lock key's GET and DEL, the GET of the (absent) waiters' mark, and
    // the GET and DEL of the lease's holder record beside the lock.
    assert!(
        total <= 6 * RELEASES,
        "{total} commands for {RELEASES} releases"
    );
}

#[tokio::test]
async fn dropping_every_handle_closes_the_subscriber_connections() {
    let nodes = nodes(1);
    let holder = redlock(&nodes, Duration::from_secs(30), true).await;
    let _lease = holder.try_lock("leak").await.unwrap();
    let baseline = support::client_list(&nodes[0]).await.len();
    for cycle in 0..5 {
        let waiter = redlock(&nodes, Duration::from_secs(30), true).await;
        let err = waiter
            .acquire(LockRequest::new("leak").wait(Duration::from_millis(200)))
            .await
            .unwrap_err();
        assert!(matches!(err, LockError::Taken { .. }), "{err:?}");
        // The wait opened a subscriber connection beside the client's own.
        let open = support::client_list(&nodes[0]).await;
        assert!(
            open.len() >= baseline + 2,
            "cycle {cycle}: no subscriber connection was opened: {open:#?}"
        );
        let clone = waiter.clone();
        drop(waiter);
        drop(clone);
    }
    let settled = eventually(Duration::from_secs(5), || async {
        support::client_list(&nodes[0]).await.len() == baseline
    })
    .await;
    let left = support::client_list(&nodes[0]).await;
    assert!(
        settled,
        "{} connections left by 5 dropped clients: {left:#?}",
        left.len() - baseline
    );
}

#[tokio::test]
async fn a_subscriber_whose_subscribe_failed_is_closed() {
    let nodes = nodes(1);
    // A user that may subscribe to the release channel of `a` only.
    let mut admin = nodes[0].conn().await;
    let () = redis::cmd("ACL")
        .arg("SETUSER")
        .arg("waiter")
        .arg("on")
        .arg("nopass")
        .arg("~*")
        .arg("+@all")
        .arg("resetchannels")
        .arg("&tower-redlock:{tower-redlock:a}:released")
        .query_async(&mut admin)
        .await
        .unwrap();
    let holder = redlock(&nodes, Duration::from_secs(30), true).await;
    let a = holder.try_lock("a").await.unwrap();
    let _b = holder.try_lock("b").await.unwrap();
    let waiter = Locks::from(
        Redlock::builder([format!("redis://waiter:any@127.0.0.1:{}", nodes[0].port())])
            .ttl(Duration::from_secs(30))
            .node_timeout(Duration::from_millis(200))
            .build()
            .await
            .unwrap(),
    );
    let waiting_for_a = tokio::spawn({
        let waiter = waiter.clone();
        async move {
            waiter
                .acquire(LockRequest::new("a").wait(Duration::from_secs(10)))
                .await
        }
    });
    let subscribed = eventually(Duration::from_secs(5), || async {
        subscribers(&nodes, "tower-redlock:{tower-redlock:a}:released").await == 1
    })
    .await;
    assert!(subscribed, "the waiter on a did not subscribe");
    // The subscription for b is refused (NOPERM) on the open subscriber connection.
    let err = waiter
        .acquire(LockRequest::new("b").wait(Duration::from_millis(300)))
        .await
        .unwrap_err();
    assert!(matches!(err, LockError::Taken { .. }), "{err:?}");
    let subscribed_connections = || async {
        support::client_list(&nodes[0])
            .await
            .iter()
            .filter(|line| line.contains("user=waiter") && !line.contains(" sub=0 "))
            .count()
    };
    let closed = eventually(Duration::from_secs(5), || async {
        subscribed_connections().await == 0
    })
    .await;
    assert!(
        closed,
        "the subscriber whose subscribe failed is still open: {:#?}",
        support::client_list(&nodes[0]).await
    );
    // The waiter on a carries on, on its fallback timer.
    holder.unlock(a).await.unwrap();
    let lease = waiting_for_a
        .await
        .unwrap()
        .expect("the waiter on a gets the lock");
    waiter.unlock(lease).await.unwrap();
}
