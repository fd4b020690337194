//! Leases that say who holds them: `Locks::inspect` names the replica, method, route and
//! request id of the request that took a lock through a layer, on real nodes and in
//! process; the record beside the lock (`<prefix>{<lock key>}:holder`) lives exactly as
//! long as the lock, a refused request leaves it alone, and a value there that this crate
//! did not write is never touched.

use crate::support;

use std::sync::Arc;
use std::time::Duration;

use std::borrow::Cow;

use axum::Router;
use axum::extract::Path;
use axum::http::StatusCode;
use axum::routing::post;
use support::{RedisNode, eventually, exists, nodes, pttl, serve, urls};
use tokio::sync::{Semaphore, mpsc};
use tower_redlock::{
    IdempotencyLayer, Lease, LockKey, LockLayer, LockMode, LockRequest, Locked, Locks, MemoryLocks,
    Redlock,
};

const REPLICA: &str = "web-7";

/// The key `role` beside the lock on `resource`, with the default prefix.
fn beside(resource: &str, role: &str) -> String {
    format!("tower-redlock:{{tower-redlock:{resource}}}:{role}")
}

async fn on_redis(nodes: &[RedisNode], ttl: Duration) -> Locks {
    Locks::from(
        Redlock::builder(urls(nodes))
            .ttl(ttl)
            .node_timeout(Duration::from_millis(300))
            .replica_id(REPLICA)
            .build()
            .await
            .unwrap(),
    )
}

fn in_process(ttl: Duration) -> Locks {
    let memory = MemoryLocks::builder().ttl(ttl).replica_id(REPLICA);
    Locks::from(memory.build().unwrap())
}

/// `POST /items/{item_id}/buy` under a `LockLayer` on the item, scope `item`: each request
/// says on `entered` that it runs, then waits for a permit of `release`.
fn shop(locks: Locks, entered: mpsc::UnboundedSender<()>, release: Arc<Semaphore>) -> Router {
    let buy = move || {
        let (entered, release) = (entered.clone(), release.clone());
        async move {
            entered.send(()).unwrap();
            release.acquire().await.unwrap().forget();
            StatusCode::OK
        }
    };
    let layer = LockLayer::by_path_param("item_id")
        .scope("item")
        .backend(locks);
    Router::new().route("/items/{item_id}/buy", post(buy).layer(layer))
}

async fn buy(base: &str, request_id: &str) -> reqwest::Response {
    reqwest::Client::new()
        .post(format!("{base}/items/tv/buy?coupon=1"))
        .header("x-request-id", request_id)
        .send()
        .await
        .unwrap()
}

/// A buy holds the item's lock: `inspect` names this replica, `POST`, the matched route
/// and the request id; a second buy through `other` (another client on Redis, whose
/// attempt reaches the nodes), refused (423), leaves the record as it was; once the first
/// ends, nobody is named, and on Redis the record is gone from every node.
async fn inspect_names_the_holder_of_a_layer_lock(locks: Locks, other: Locks, nodes: &[RedisNode]) {
    let (entered, mut running) = mpsc::unbounded_channel();
    let release = Arc::new(Semaphore::new(0));
    let base = serve(shop(locks.clone(), entered.clone(), release.clone())).await;
    let other_base = serve(shop(other, entered, release.clone())).await;
    let first = tokio::spawn({
        let base = base.clone();
        async move { buy(&base, "req-1").await.status() }
    });
    running.recv().await.unwrap();

    let seen = locks.inspect("item:tv").await.unwrap();
    assert!(seen.is_held(), "{seen:?}");
    let holder = seen.holder.expect("the holder is named");
    assert_eq!(holder.replica, REPLICA);
    assert_eq!(holder.method.as_deref(), Some("POST"));
    assert_eq!(holder.route.as_deref(), Some("/items/{item_id}/buy"));
    assert_eq!(holder.request_id.as_deref(), Some("req-1"));
    for node in nodes {
        let record = support::get(node, &beside("item:tv", "holder"))
            .await
            .unwrap();
        assert!(record.ends_with(&holder.to_string()), "{record}");
    }

    let refused = buy(&other_base, "req-2").await;
    assert_eq!(refused.status(), StatusCode::LOCKED);
    let after = locks.inspect("item:tv").await.unwrap().holder;
    let after = after.expect("a refused request overwrote the holder");
    assert_eq!(after, holder, "a refused request overwrote the holder");

    release.add_permits(1);
    assert_eq!(first.await.unwrap(), StatusCode::OK);
    let free = locks.inspect("item:tv").await.unwrap();
    assert!(!free.is_held() && free.holder.is_none(), "{free:?}");
    for node in nodes {
        assert!(!exists(node, &beside("item:tv", "holder")).await);
    }
}

#[tokio::test]
async fn inspect_names_the_holder_of_a_layer_lock_on_one_node() {
    let nodes = nodes(1);
    let locks = on_redis(&nodes, Duration::from_secs(10)).await;
    let other = on_redis(&nodes, Duration::from_secs(10)).await;
    inspect_names_the_holder_of_a_layer_lock(locks, other, &nodes).await;
}

#[tokio::test]
async fn inspect_names_the_holder_of_a_layer_lock_on_three_nodes() {
    let nodes = nodes(3);
    let locks = on_redis(&nodes, Duration::from_secs(10)).await;
    let other = on_redis(&nodes, Duration::from_secs(10)).await;
    inspect_names_the_holder_of_a_layer_lock(locks, other, &nodes).await;
}

#[tokio::test]
async fn inspect_names_the_holder_of_a_layer_lock_in_process() {
    let locks = in_process(Duration::from_secs(10));
    inspect_names_the_holder_of_a_layer_lock(locks.clone(), locks, &[]).await;
}

#[derive(serde::Deserialize)]
struct OrderId(String);

impl LockKey for OrderId {
    const SCOPE: &'static str = "order";
    fn lock_key(&self) -> Cow<'_, str> {
        Cow::Borrowed(&self.0)
    }
}

/// The `Locked<T>` extractor's lease and the `IdempotencyLayer`'s name their request too:
/// each handler sends its lease's key (without the prefix) and waits; `inspect` of that
/// key names the method, the route and the trace id of its `traceparent`.
async fn extractor_and_idempotency_leases_name_their_request(locks: Locks) {
    let (entered, mut running) = mpsc::unbounded_channel::<String>();
    let release = Arc::new(Semaphore::new(0));
    let (prefix, gate) = (locks.prefix().to_owned(), release.clone());
    let hold = move |lease: &Lease| {
        let (entered, release) = (entered.clone(), gate.clone());
        let key = lease.key().strip_prefix(&prefix).unwrap().to_owned();
        async move {
            entered.send(key).unwrap();
            release.acquire().await.unwrap().forget();
            StatusCode::OK
        }
    };
    let pay = {
        let hold = hold.clone();
        move |order: Locked<Path<OrderId>>| async move { hold(order.lease()).await }
    };
    let create = move |lease: Lease| async move { hold(&lease).await };
    let app = Router::new()
        .route("/orders/{order_id}/pay", post(pay))
        .route(
            "/orders",
            post(create).layer(IdempotencyLayer::new().backend(locks.clone())),
        )
        .with_state(locks.clone());
    let base = serve(app).await;
    let trace = "4bf92f3577b34da6a3ce929d0e0e4736";
    for (path, route) in [
        ("/orders/42/pay", "/orders/{order_id}/pay"),
        ("/orders", "/orders"),
    ] {
        let request = reqwest::Client::new()
            .post(format!("{base}{path}"))
            .header("Idempotency-Key", "\"order-1\"")
            .header("traceparent", format!("00-{trace}-00f067aa0ba902b7-01"))
            .send();
        let answered = tokio::spawn(request);
        let key = running.recv().await.unwrap();
        let holder = locks.inspect(&key).await.unwrap().holder;
        let holder = holder.unwrap_or_else(|| panic!("{path}: no holder named"));
        assert_eq!(holder.replica, REPLICA, "{path}");
        assert_eq!(holder.method.as_deref(), Some("POST"), "{path}");
        assert_eq!(holder.route.as_deref(), Some(route), "{path}");
        assert_eq!(holder.request_id.as_deref(), Some(trace), "{path}");
        release.add_permits(1);
        assert_eq!(answered.await.unwrap().unwrap().status(), 200, "{path}");
    }
}

#[tokio::test]
async fn extractor_and_idempotency_leases_name_their_request_on_one_node() {
    let nodes = nodes(1);
    let locks = on_redis(&nodes, Duration::from_secs(10)).await;
    extractor_and_idempotency_leases_name_their_request(locks).await;
}

#[tokio::test]
async fn extractor_and_idempotency_leases_name_their_request_in_process() {
    extractor_and_idempotency_leases_name_their_request(in_process(Duration::from_secs(10))).await;
}

/// A direct call's lease names the replica alone; its record expires with the lock
/// (same TTL), an extension keeps it as long as the lock, and it is gone once the lease
/// runs out.
async fn the_holder_expires_with_the_lock(locks: Locks, nodes: &[RedisNode]) {
    let ttl = locks.ttl();
    let mut lease = locks.try_lock("job:1").await.unwrap();
    let holder = locks.inspect("job:1").await.unwrap().holder.unwrap();
    assert_eq!(holder.replica, REPLICA);
    assert_eq!(
        (holder.method, holder.route, holder.request_id),
        (None, None, None)
    );
    let (lock, record) = ("tower-redlock:job:1", beside("job:1", "holder"));
    for node in nodes {
        let (lock_ttl, record_ttl) = (pttl(node, lock).await, pttl(node, &record).await);
        assert!(
            record_ttl > 0 && record_ttl <= lock_ttl,
            "{record_ttl} {lock_ttl}"
        );
    }
    // Half the TTL gone, an extension: the record is renewed with the lock.
    let ttl_ms = i64::try_from(ttl.as_millis()).unwrap();
    if let Some(node) = nodes.first() {
        let halfway = eventually(ttl, || async { pttl(node, &record).await < ttl_ms / 2 });
        assert!(halfway.await, "the record has no expiry");
        locks.extend(&mut lease).await.unwrap();
        for node in nodes {
            assert!(pttl(node, &record).await > ttl_ms * 3 / 4, "not extended");
        }
    }
    let expired = eventually(ttl * 3, || async {
        locks.inspect("job:1").await.unwrap().holder.is_none()
    });
    assert!(expired.await, "the holder outlived the lease");
    for node in nodes {
        assert!(!exists(node, &record).await, "the record outlived the lock");
    }
}

#[tokio::test]
async fn the_holder_expires_with_the_lock_on_three_nodes() {
    let nodes = nodes(3);
    let locks = on_redis(&nodes, Duration::from_millis(1500)).await;
    the_holder_expires_with_the_lock(locks, &nodes).await;
}

#[tokio::test]
async fn the_holder_expires_with_the_lock_in_process() {
    the_holder_expires_with_the_lock(in_process(Duration::from_millis(300)), &[]).await;
}

/// Every mode that records a holder, on one node: the record is written with the lock,
/// names the lease's token, and goes with its release; a reader records none.
#[tokio::test]
async fn each_mode_records_its_holder_and_its_release_deletes_it() {
    let node = RedisNode::start();
    let plain = on_redis(std::slice::from_ref(&node), Duration::from_secs(10)).await;
    let fenced = Locks::from(
        Redlock::builder([node.url()])
            .fencing_tokens(true)
            .replica_id(REPLICA)
            .build()
            .await
            .unwrap(),
    );
    type Request = fn(&'static str) -> LockRequest<'static>;
    let cases: [(&str, &Locks, Request); 6] = [
        ("plain", &plain, |r| LockRequest::new(r)),
        ("fenced", &fenced, |r| LockRequest::new(r)),
        ("exclusive", &fenced, |r| {
            LockRequest::new(r).mode(LockMode::Exclusive)
        }),
        ("fair", &plain, |r| LockRequest::new(r).mode(LockMode::Fair)),
        ("waiting", &plain, |r| {
            LockRequest::new(r).wait(Duration::from_secs(1))
        }),
        ("a set", &fenced, |r| {
            LockRequest::all([r, "mode:other"]).into()
        }),
    ];
    for (what, locks, request) in cases {
        let lease = locks.acquire(request("mode:1")).await.unwrap();
        for resource in lease.keys().map(|k| k.trim_start_matches("tower-redlock:")) {
            let record = support::get(&node, &beside(resource, "holder")).await;
            let record = record.unwrap_or_else(|| panic!("{what}: no record for {resource}"));
            let expected = format!("{} replica={REPLICA}", lease.token());
            assert_eq!(record, expected, "{what}");
            assert!(locks.inspect(resource).await.unwrap().holder.is_some());
        }
        locks.unlock(lease).await.unwrap();
        for resource in ["mode:1", "mode:other"] {
            let record = beside(resource, "holder");
            assert!(!exists(&node, &record).await, "{what}: {record} left");
        }
    }
    let shared = LockRequest::new("mode:1").mode(LockMode::Shared);
    let reader = plain.acquire(shared).await.unwrap();
    assert!(!exists(&node, &beside("mode:1", "holder")).await);
    assert_eq!(plain.inspect("mode:1").await.unwrap().holder, None);
    plain.unlock(reader).await.unwrap();
}

/// A value at the holder record that this crate did not write (another type, or a string
/// not in its format): the lock is taken all the same, its extension, inspection,
/// release and a forced unlock leave the value as it is, and no holder is named.
#[tokio::test]
async fn a_holder_record_of_another_type_or_format_is_left_as_it_is() {
    let node = RedisNode::start();
    let locks = on_redis(std::slice::from_ref(&node), Duration::from_secs(10)).await;
    let mut conn = node.conn().await;
    let foreign: [(&str, &[&str]); 4] = [
        ("HSET", &["owner", "someone else"]),
        ("RPUSH", &["a", "b"]),
        ("SET", &["not a holder"]),
        // 32 characters and a space, but not lowercase hex.
        ("SET", &["0123456789ABCDEF0123456789ABCDEF replica=x"]),
    ];
    for (i, (write, args)) in foreign.into_iter().enumerate() {
        let resource = format!("foreign:{i}");
        let record = beside(&resource, "holder");
        let mut cmd = redis::cmd(write);
        cmd.arg(&record).arg(args);
        let _: redis::Value = cmd.query_async(&mut conn).await.unwrap();
        let dump = || async {
            let dump: Vec<u8> = redis::cmd("DUMP")
                .arg(&record)
                .query_async(&mut node.conn().await)
                .await
                .unwrap();
            (dump, pttl(&node, &record).await)
        };
        let before = dump().await;
        let mut lease = locks.try_lock(&resource).await.unwrap();
        assert_eq!(dump().await, before, "{write}: the attempt wrote it");
        locks.extend(&mut lease).await.unwrap();
        assert_eq!(locks.inspect(&resource).await.unwrap().holder, None);
        locks.unlock(lease).await.unwrap();
        let _lease = locks.try_lock(&resource).await.unwrap();
        assert_eq!(locks.force_unlock(&resource).await.unwrap(), 1);
        assert_eq!(dump().await, before, "{write}: modified");
    }
}
