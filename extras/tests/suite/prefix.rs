//! Every key and channel the crate writes begins with its store's prefix, so that a Redis
//! ACL on the prefixes confines the application: every layer and every kind of lock runs
//! as a Redis user that may touch only `~myapp*` keys and `&myapp*` channels (any other
//! key or channel is refused with `NOPERM`, and the operation fails), while `SCAN`,
//! `PUBSUB CHANNELS` and `MONITOR` on the node list what was written.

use crate::support;

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::routing::post;
use support::{Monitor, RedisNode, eventually, post_to, serve};
use tokio::sync::Semaphore;
use tower_redlock::{
    ConcurrencyLimitLayer, ConcurrencyLimiter, IdempotencyLayer, LockLayer, LockMode, LockRequest,
    Locks, Quota, RateLimitLayer, RateLimiter, RedisConcurrencyLimiter, RedisRateLimiter, Redlock,
};

const LOCKS: &str = "myapp:";
const RATE: &str = "myapp-rate:";
const PERMITS: &str = "myapp-concurrency:";

async fn keys(node: &RedisNode) -> Vec<String> {
    support::scan(&node.url(), "*").await
}

/// The channels with subscribers on the node (`PUBSUB CHANNELS`).
async fn channels(node: &RedisNode) -> Vec<String> {
    let mut conn = node.conn().await;
    redis::cmd("PUBSUB")
        .arg("CHANNELS")
        .query_async(&mut conn)
        .await
        .unwrap()
}

fn prefixed(name: &str) -> bool {
    [LOCKS, RATE, PERMITS].iter().any(|p| name.starts_with(p))
}

/// What a look at the node found: every key, and every channel subscribed to.
#[derive(Default)]
struct Seen {
    keys: BTreeSet<String>,
    channels: BTreeSet<String>,
}

impl Seen {
    /// Looks at the node now; every key and channel must begin with a prefix.
    async fn look(&mut self, node: &RedisNode, when: &str) {
        for key in keys(node).await {
            assert!(
                prefixed(&key),
                "{when}: the key {key:?} is outside the prefixes"
            );
            self.keys.insert(key);
        }
        for channel in channels(node).await {
            assert!(
                prefixed(&channel),
                "{when}: the channel {channel:?} is outside the prefixes"
            );
            self.channels.insert(channel);
        }
    }
}

#[tokio::test]
async fn every_key_and_channel_begins_with_the_prefix() {
    let node = RedisNode::start();
    let mut admin = node.conn().await;
    let () = redis::cmd("ACL")
        .arg("SETUSER")
        .arg("app")
        .arg("on")
        .arg("nopass")
        .arg("resetchannels")
        .arg("~myapp*")
        .arg("&myapp*")
        .arg("+@all")
        .arg("-@dangerous")
        .query_async(&mut admin)
        .await
        .unwrap();
    let url = format!("redis://app:any@127.0.0.1:{}", node.port());
    let monitor = Monitor::start(&node);
    let redlock = || async {
        Locks::from(
            Redlock::builder([url.clone()])
                .prefix(LOCKS)
                .ttl(Duration::from_secs(10))
                .node_timeout(Duration::from_millis(500))
                .fencing_tokens(true)
                .build()
                .await
                .unwrap(),
        )
    };
    let (holder, waiter) = (redlock().await, redlock().await);
    let mut seen = Seen::default();
    let wait = Duration::from_secs(10);

    // A plain lock, its fencing counter, and a waiter woken by its release.
    let held = holder.try_lock("report").await.unwrap();
    let waiting = tokio::spawn({
        let waiter = waiter.clone();
        async move { waiter.acquire(LockRequest::new("report").wait(wait)).await }
    });
    let mark = format!("{LOCKS}{{{LOCKS}report}}:waiters");
    let channel = format!("{LOCKS}{{{LOCKS}report}}:released");
    let subscribed = eventually(Duration::from_secs(5), || async {
        channels(&node).await.contains(&channel) && support::exists(&node, &mark).await
    });
    assert!(subscribed.await, "the waiter neither subscribed nor marked");
    seen.look(&node, "a waiter waits").await;
    holder.unlock(held).await.unwrap();
    waiter
        .unlock(waiting.await.unwrap().unwrap())
        .await
        .unwrap();

    // A reader, and a writer that waits for it (its intent and mark).
    let reader = holder
        .acquire(LockRequest::new("doc").mode(LockMode::Shared))
        .await
        .unwrap();
    let writing = tokio::spawn({
        let waiter = waiter.clone();
        async move {
            let exclusive = LockRequest::new("doc").mode(LockMode::Exclusive);
            waiter.acquire(exclusive.wait(wait)).await
        }
    });
    let intent = format!("{LOCKS}{{{LOCKS}doc}}:writer-waiting");
    let waits = eventually(Duration::from_secs(5), || async {
        support::exists(&node, &intent).await
    });
    assert!(waits.await, "the writer set no intent");
    seen.look(&node, "a writer waits for a reader").await;
    holder.unlock(reader).await.unwrap();
    waiter
        .unlock(writing.await.unwrap().unwrap())
        .await
        .unwrap();

    // A fair waiter in the queue.
    let held = holder.try_lock("turn").await.unwrap();
    let queued = tokio::spawn({
        let waiter = waiter.clone();
        async move {
            let fair = LockRequest::new("turn").mode(LockMode::Fair);
            waiter.acquire(fair.wait(wait)).await
        }
    });
    let queue = format!("{LOCKS}{{{LOCKS}turn}}:queue");
    let in_queue = eventually(Duration::from_secs(5), || async {
        support::exists(&node, &queue).await
    });
    assert!(in_queue.await, "the fair waiter is not in the queue");
    seen.look(&node, "a fair waiter waits").await;
    holder.unlock(held).await.unwrap();
    waiter.unlock(queued.await.unwrap().unwrap()).await.unwrap();

    // Several keys at once.
    let both = holder
        .acquire(LockRequest::all(["account:1", "account:2"]))
        .await
        .unwrap();
    seen.look(&node, "a set of keys is held").await;
    holder.unlock(both).await.unwrap();

    // The layers over HTTP: a lock with fencing, idempotency, both rate limits, and a
    // concurrency limit with a waiter.
    let limiter = RateLimiter::from(
        RedisRateLimiter::builder(url.clone())
            .prefix(RATE)
            .build()
            .await
            .unwrap(),
    );
    let permits = ConcurrencyLimiter::from(
        RedisConcurrencyLimiter::builder(url.clone())
            .prefix(PERMITS)
            .build()
            .await
            .unwrap(),
    );
    let gate = Arc::new(Semaphore::new(0));
    let app = Router::new()
        .route(
            "/items/{id}/buy",
            post(|| async { "bought" })
                .layer(LockLayer::by_path_param("id").backend(holder.clone())),
        )
        .route(
            "/orders",
            post(|| async { "created" }).layer(IdempotencyLayer::new().backend(holder.clone())),
        )
        .route(
            "/search",
            post(|| async { "results" }).layer(
                RateLimitLayer::global("10/60".parse::<Quota>().unwrap())
                    .scope("search")
                    .backend(limiter.clone()),
            ),
        )
        .route(
            "/feed",
            post(|| async { "feed" }).layer(
                RateLimitLayer::global(Quota::gcra(10, Duration::from_secs(1), 5).unwrap())
                    .scope("feed")
                    .backend(limiter.clone())
                    .fail_open(false),
            ),
        )
        .route(
            "/work",
            post({
                let gate = gate.clone();
                move || {
                    let gate = gate.clone();
                    async move {
                        gate.acquire().await.expect("open").forget();
                        "done"
                    }
                }
            })
            .layer(
                ConcurrencyLimitLayer::global(1)
                    .scope("work")
                    .backend(permits)
                    .max_wait(wait)
                    .fail_open(false),
            ),
        );
    let base = serve(app).await;
    let client = reqwest::Client::new();
    assert_eq!(
        post_to(&client, format!("{base}/items/7/buy"))
            .await
            .status(),
        200
    );
    let order = client
        .post(format!("{base}/orders"))
        .header("Idempotency-Key", "order-1")
        .send()
        .await
        .unwrap();
    assert_eq!(order.status(), 200);
    assert_eq!(
        post_to(&client, format!("{base}/search")).await.status(),
        200
    );
    assert_eq!(post_to(&client, format!("{base}/feed")).await.status(), 200);
    let working = tokio::spawn(client.post(format!("{base}/work")).send());
    let set = format!("{PERMITS}{{work:all}}");
    let working_held = eventually(Duration::from_secs(5), || async {
        support::exists(&node, &set).await
    });
    assert!(working_held.await, "no permit was taken");
    let waiting = tokio::spawn(client.post(format!("{base}/work")).send());
    let permit_channel = format!("{set}:released");
    let marked = eventually(Duration::from_secs(5), || async {
        channels(&node).await.contains(&permit_channel)
            && support::exists(&node, &format!("{set}:waiters")).await
    });
    assert!(
        marked.await,
        "the permit waiter neither subscribed nor marked"
    );
    seen.look(&node, "the layers ran, a permit waiter waits")
        .await;
    gate.add_permits(2);
    assert_eq!(working.await.unwrap().unwrap().status(), 200);
    assert_eq!(waiting.await.unwrap().unwrap().status(), 200);
    seen.look(&node, "the end").await;

    // Every kind of key was there at some look.
    let lock = |resource: &str| format!("{LOCKS}{resource}");
    let beside = |resource: &str, role: &str| format!("{LOCKS}{{{LOCKS}{resource}}}:{role}");
    for expected in [
        lock("report"),
        beside("report", "fence"),
        beside("report", "waiters"),
        beside("doc", "readers"),
        beside("doc", "writer-waiting"),
        beside("turn", "queue"),
        beside("turn", "queue-deadlines"),
        beside("account:1", "fence"),
        beside("account:2", "fence"),
        set.clone(),
        format!("{set}:waiters"),
    ] {
        assert!(
            seen.keys.contains(&expected),
            "{expected} was never seen: {:#?}",
            seen.keys
        );
    }
    let with = |part: &str, end: &str| {
        seen.keys
            .iter()
            .any(|k| k.contains(part) && k.ends_with(end))
    };
    assert!(
        with(LOCKS, "}:record"),
        "no idempotency record: {:#?}",
        seen.keys
    );
    assert!(
        with(RATE, "search:all"),
        "no fixed-window count: {:#?}",
        seen.keys
    );
    assert!(
        with(RATE, "feed:all"),
        "no GCRA arrival time: {:#?}",
        seen.keys
    );
    assert!(seen.channels.contains(&channel) && seen.channels.contains(&permit_channel));

    // What was published, scripts included: only on prefixed channels, the lock's and
    // the permit set's among them.
    let published: Vec<String> = monitor
        .lines()
        .iter()
        .filter_map(|line| {
            let rest = line.split_once("\"PUBLISH\" \"")?.1;
            Some(rest.split('"').next()?.to_owned())
        })
        .collect();
    for name in &published {
        assert!(prefixed(name), "published on {name:?}");
    }
    assert!(published.contains(&channel), "{published:?}");
    assert!(published.contains(&permit_channel), "{published:?}");
}
