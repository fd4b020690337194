//! RateLimitLayer through real servers on 127.0.0.1, a real HTTP client, and real Redis.

use crate::support;

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::Router;
use axum::routing::post;
use support::{RedisNode, get, pttl, serve};
use tokio::sync::Barrier;
use tower_redlock::Locks;
use tower_redlock::{MemoryRateLimiter, Quota, RateLimitLayer, RateLimiter, RedisRateLimiter};

const TIMEOUT: Duration = Duration::from_millis(100);

async fn redis_limiter(node: &RedisNode) -> RateLimiter {
    redis_limiter_with(node, TIMEOUT).await
}

async fn redis_limiter_with(node: &RedisNode, timeout: Duration) -> RateLimiter {
    RateLimiter::from(
        RedisRateLimiter::builder(node.url())
            .timeout(timeout)
            .build()
            .await
            .unwrap(),
    )
}

fn quota(text: &str) -> Quota {
    text.parse().unwrap()
}

/// The route of the example: `POST /items/{item_id}/buy`, limited per `X-Client-Id`, else
/// per peer IP.
fn buy_app(limiter: RateLimiter, quota: Quota, fail_open: bool) -> Router {
    buy_app_with(limiter, quota, fail_open, 1)
}

/// [`buy_app`], with each replica's own share of the quota while the store is down.
fn buy_app_with(limiter: RateLimiter, quota: Quota, fail_open: bool, replicas: u32) -> Router {
    Router::new()
        .route("/items/{item_id}/buy", post(|| async { "bought" }))
        .route_layer(
            RateLimitLayer::by_header_or_peer_ip("X-Client-Id", quota)
                .scope("buy")
                .backend(limiter)
                .fail_open(fail_open)
                .outage_replicas(replicas)
                .legacy_headers(true),
        )
}

async fn buy(client: &reqwest::Client, base: &str, client_id: Option<&str>) -> reqwest::Response {
    let mut req = client.post(format!("{base}/items/42/buy"));
    if let Some(id) = client_id {
        req = req.header("x-client-id", id);
    }
    req.send().await.expect("HTTP request")
}

fn header<'a>(resp: &'a reqwest::Response, name: &str) -> Option<&'a str> {
    resp.headers().get(name).map(|v| v.to_str().unwrap())
}

/// `r` and `t` of `RateLimit: "default";r=R;t=T`.
fn ratelimit(resp: &reqwest::Response) -> (u64, u64) {
    let value = header(resp, "ratelimit").expect("RateLimit header");
    let rest = value
        .strip_prefix("\"default\";r=")
        .unwrap_or_else(|| panic!("{value}"));
    let (r, t) = rest.split_once(";t=").unwrap_or_else(|| panic!("{value}"));
    (r.parse().unwrap(), t.parse().unwrap())
}

/// Sends `n` requests for one client at once, spread over `bases`; returns the number of
/// 200s and of 429s.
async fn burst(bases: &[String], n: usize, client_id: &str) -> (usize, usize) {
    let client = reqwest::Client::new();
    let barrier = Arc::new(Barrier::new(n));
    let tasks: Vec<_> = (0..n)
        .map(|i| {
            let (client, barrier) = (client.clone(), barrier.clone());
            let base = bases[i % bases.len()].clone();
            let id = client_id.to_owned();
            tokio::spawn(async move {
                barrier.wait().await;
                buy(&client, &base, Some(&id)).await.status().as_u16()
            })
        })
        .collect();
    let (mut ok, mut too_many) = (0, 0);
    for task in tasks {
        match task.await.unwrap() {
            200 => ok += 1,
            429 => too_many += 1,
            other => panic!("unexpected status {other}"),
        }
    }
    (ok, too_many)
}

/// Sends `limit` requests and checks that `r` counts down from `limit - 1` to 0, then that
/// the next is refused; waits (polling, bounded) for the window to reset and checks the
/// count starts again from `limit - 1`.
async fn countdown_then_reset(base: &str, limit: u64, window: Duration) {
    let client = reqwest::Client::new();
    for expected in (0..limit).rev() {
        let resp = buy(&client, base, Some("countdown")).await;
        assert_eq!(resp.status(), 200);
        let (r, t) = ratelimit(&resp);
        assert_eq!(r, expected, "remaining counts down");
        assert!((1..=window.as_secs()).contains(&t), "t={t}");
    }
    let refused = buy(&client, base, Some("countdown")).await;
    assert_eq!(refused.status(), 429);
    assert_eq!(ratelimit(&refused).0, 0);

    let deadline = Instant::now() + window + Duration::from_secs(2);
    let passed = loop {
        let resp = buy(&client, base, Some("countdown")).await;
        if resp.status() == 200 {
            break resp;
        }
        assert_eq!(resp.status(), 429);
        assert!(
            Instant::now() < deadline,
            "the window did not reset within {window:?} + 2 s"
        );
        tokio::time::sleep(Duration::from_millis(25)).await;
    };
    assert_eq!(
        ratelimit(&passed).0,
        limit - 1,
        "a new window starts from the full limit"
    );
    let next = buy(&client, base, Some("countdown")).await;
    assert_eq!(ratelimit(&next).0, limit - 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn exactly_limit_requests_pass_across_two_replicas_sharing_redis() {
    let node = RedisNode::start();
    // Two replicas: two apps, each with its own connection to the same node. A generous
    // timeout: 300 requests at once on a small test machine can keep a task waiting for
    // a CPU longer than 100 ms, and this test is about counting, not about timeouts.
    let timeout = Duration::from_secs(2);
    let a = serve(buy_app(
        redis_limiter_with(&node, timeout).await,
        quota("25/60"),
        false,
    ))
    .await;
    let b = serve(buy_app(
        redis_limiter_with(&node, timeout).await,
        quota("25/60"),
        false,
    ))
    .await;

    let (ok, too_many) = burst(&[a, b], 300, "flash").await;
    assert_eq!((ok, too_many), (25, 275));

    let key = "tower-redlock-rate:buy:id:flash";
    let count = get(&node, key).await;
    assert_eq!(
        count.as_deref(),
        Some("300"),
        "every request was counted once"
    );
    let pttl = pttl(&node, key).await;
    assert!(
        (1..=60_000).contains(&pttl),
        "the window's key expires with it: {pttl}"
    );
}

#[tokio::test]
async fn window_resets_and_remaining_counts_down_on_redis() {
    let node = RedisNode::start();
    let base = serve(buy_app(redis_limiter(&node).await, quota("3/1"), false)).await;
    countdown_then_reset(&base, 3, Duration::from_secs(1)).await;
}

#[tokio::test]
async fn over_limit_answers_429_with_problem_headers_and_retry_after_not_before_reset() {
    let node = RedisNode::start();
    let base = serve(buy_app(redis_limiter(&node).await, quota("2/2"), false)).await;
    let client = reqwest::Client::new();
    for _ in 0..2 {
        assert_eq!(buy(&client, &base, Some("eager")).await.status(), 200);
    }
    let resp = buy(&client, &base, Some("eager")).await;
    let answered = Instant::now();
    assert_eq!(resp.status(), 429);
    assert_eq!(
        header(&resp, "content-type"),
        Some("application/problem+json")
    );
    assert_eq!(
        header(&resp, "ratelimit-policy"),
        Some("\"default\";q=2;w=2")
    );
    let retry_after: u64 = header(&resp, "retry-after").unwrap().parse().unwrap();
    let (r, t) = ratelimit(&resp);
    assert_eq!(
        (r, t),
        (0, retry_after),
        "RateLimit agrees with Retry-After"
    );
    assert!(
        (1..=2).contains(&retry_after),
        "Retry-After {retry_after} within the 2 s window"
    );
    assert_eq!(header(&resp, "x-ratelimit-limit"), Some("2"));
    assert_eq!(header(&resp, "x-ratelimit-remaining"), Some("0"));
    assert_eq!(
        header(&resp, "x-ratelimit-reset"),
        Some(retry_after.to_string().as_str())
    );

    // Retry-After is not earlier than the reset Redis will do.
    let pttl = pttl(&node, "tower-redlock-rate:buy:id:eager").await;
    assert!(
        pttl > 0 && pttl as u64 <= retry_after * 1000,
        "PTTL {pttl} ms > Retry-After {retry_after} s"
    );

    let body: serde_json::Value = resp.json().await.unwrap();
    assert_eq!(body["status"], 429);
    assert_eq!(body["title"], "Too Many Requests");
    assert!(
        body["detail"]
            .as_str()
            .unwrap()
            .contains("at most 2 per 2 s"),
        "{body}"
    );

    // A client that waits exactly Retry-After gets through.
    tokio::time::sleep_until((answered + Duration::from_secs(retry_after)).into()).await;
    let resp = buy(&client, &base, Some("eager")).await;
    assert_eq!(resp.status(), 200, "refused after waiting Retry-After");
    assert_eq!(ratelimit(&resp).0, 1);
}

#[tokio::test]
async fn keys_are_scoped_per_client_id_else_peer_ip_and_expire_with_the_window() {
    let node = RedisNode::start();
    let base = serve(buy_app(redis_limiter(&node).await, quota("1/60"), false)).await;
    let client = reqwest::Client::new();
    assert_eq!(buy(&client, &base, Some("alice")).await.status(), 200);
    assert_eq!(buy(&client, &base, Some("alice")).await.status(), 429);
    // Another id, and no id (the peer IP), count on their own.
    assert_eq!(buy(&client, &base, Some("bob")).await.status(), 200);
    assert_eq!(buy(&client, &base, None).await.status(), 200);
    assert_eq!(buy(&client, &base, None).await.status(), 429);
    // An id that spells the peer's address is not the address.
    assert_eq!(buy(&client, &base, Some("127.0.0.1")).await.status(), 200);

    for (key, count) in [
        ("tower-redlock-rate:buy:id:alice", "2"),
        ("tower-redlock-rate:buy:id:bob", "1"),
        ("tower-redlock-rate:buy:ip:127.0.0.1", "2"),
        ("tower-redlock-rate:buy:id:127.0.0.1", "1"),
    ] {
        assert_eq!(get(&node, key).await.as_deref(), Some(count), "{key}");
        let pttl = pttl(&node, key).await;
        assert!(
            (1..=60_000).contains(&pttl),
            "{key} expires within the window: {pttl}"
        );
    }
    // A malformed client id (a bad escape in an RFC 8941 string) is refused.
    let resp = buy(&client, &base, Some("\"a\\tb\"")).await;
    assert_eq!(resp.status(), 400);
}

#[tokio::test]
async fn redis_killed_fail_open_without_a_fallback_lets_requests_through_uncounted() {
    let mut node = RedisNode::start();
    let limiter = redis_limiter(&node).await;
    let base = serve(buy_app_with(limiter, quota("1/60"), true, 0)).await;
    let client = reqwest::Client::new();
    let resp = buy(&client, &base, Some("open")).await;
    assert_eq!(resp.status(), 200);
    assert_eq!(ratelimit(&resp).0, 0, "counted on Redis while it is up");

    node.kill();
    for _ in 0..3 {
        let started = Instant::now();
        let resp = buy(&client, &base, Some("open")).await;
        assert_eq!(
            resp.status(),
            200,
            "fail open: over the limit, but Redis cannot tell"
        );
        assert!(
            started.elapsed() < Duration::from_secs(1),
            "took {:?}",
            started.elapsed()
        );
        assert_eq!(
            header(&resp, "ratelimit-policy"),
            Some("\"default\";q=1;w=60")
        );
        assert_eq!(header(&resp, "ratelimit"), None, "no count to report");
        assert_eq!(resp.text().await.unwrap(), "bought");
    }
}

#[tokio::test]
async fn a_failed_open_rate_limit_still_refuses_past_its_fallback_quota() {
    let mut node = RedisNode::start();
    // Two replicas share 4 per minute: each allows 2 on its own while Redis is down.
    let base = serve(buy_app_with(
        redis_limiter(&node).await,
        quota("4/60"),
        true,
        2,
    ))
    .await;
    let client = reqwest::Client::new();
    assert_eq!(buy(&client, &base, Some("flash")).await.status(), 200);

    node.kill();
    let mut seen = Vec::new();
    for _ in 0..4 {
        let started = Instant::now();
        let resp = buy(&client, &base, Some("flash")).await;
        assert!(
            started.elapsed() < Duration::from_secs(1),
            "took {:?}",
            started.elapsed()
        );
        seen.push(resp.status().as_u16());
        if resp.status() == 200 {
            assert_eq!(
                header(&resp, "ratelimit-policy"),
                Some("\"default\";q=4;w=60")
            );
            assert!(
                header(&resp, "ratelimit").is_some(),
                "counted by the replica"
            );
        } else {
            assert!(header(&resp, "retry-after").is_some());
        }
    }
    assert_eq!(
        seen,
        [200, 200, 429, 429],
        "the replica's share, 2 of 4, then 429"
    );
    // Another client has a share of its own.
    assert_eq!(buy(&client, &base, Some("other")).await.status(), 200);
}

#[tokio::test]
async fn redis_killed_fail_closed_answers_503_without_details() {
    let mut node = RedisNode::start();
    let base = serve(buy_app(redis_limiter(&node).await, quota("5/60"), false)).await;
    let client = reqwest::Client::new();
    assert_eq!(buy(&client, &base, Some("closed")).await.status(), 200);

    node.kill();
    for _ in 0..3 {
        let started = Instant::now();
        let resp = buy(&client, &base, Some("closed")).await;
        assert!(
            started.elapsed() < Duration::from_secs(1),
            "took {:?}",
            started.elapsed()
        );
        assert_eq!(resp.status(), 503);
        assert_eq!(header(&resp, "retry-after"), Some("1"));
        assert_eq!(
            header(&resp, "content-type"),
            Some("application/problem+json")
        );
        assert_eq!(header(&resp, "ratelimit"), None);
        let body = resp.text().await.unwrap();
        for leak in [
            &node.port().to_string(),
            "127.0.0.1",
            "refused",
            "edis",
            "rror",
        ] {
            assert!(!body.contains(leak), "body leaks {leak:?}: {body}");
        }
    }
}

#[tokio::test]
async fn unresponsive_redis_answers_after_the_timeout_not_a_hang() {
    let node = RedisNode::start();
    let base = serve(buy_app(redis_limiter(&node).await, quota("5/60"), false)).await;
    let client = reqwest::Client::new();
    assert_eq!(buy(&client, &base, Some("slow")).await.status(), 200);

    // The connection stays open, but nothing answers.
    node.pause();
    let started = Instant::now();
    let resp = buy(&client, &base, Some("slow")).await;
    let elapsed = started.elapsed();
    node.resume();
    assert_eq!(resp.status(), 503);
    assert!(
        elapsed >= TIMEOUT,
        "answered in {elapsed:?}, before the timeout: not from Redis?"
    );
    assert!(
        elapsed < TIMEOUT * 5,
        "took {elapsed:?} with a {TIMEOUT:?} timeout"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn memory_backend_exactly_limit_requests_pass_under_concurrency() {
    // Two routers in one process sharing one in-process store.
    let limiter = RateLimiter::from(MemoryRateLimiter::new());
    let a = serve(buy_app(limiter.clone(), quota("25/60"), false)).await;
    let b = serve(buy_app(limiter, quota("25/60"), false)).await;
    let (ok, too_many) = burst(&[a, b], 300, "flash").await;
    assert_eq!((ok, too_many), (25, 275));
}

#[tokio::test]
async fn memory_backend_window_resets_and_remaining_counts_down() {
    let base = serve(buy_app(
        MemoryRateLimiter::new().into(),
        quota("3/1"),
        false,
    ))
    .await;
    countdown_then_reset(&base, 3, Duration::from_secs(1)).await;
}

#[tokio::test]
async fn memory_backend_client_rotating_ids_cannot_grow_the_store_past_its_cap() {
    let store = MemoryRateLimiter::with_max_keys(50);
    let open = serve(buy_app(store.clone().into(), quota("1/3600"), true)).await;
    let closed = serve(buy_app(store.clone().into(), quota("1/3600"), false)).await;
    let client = reqwest::Client::new();
    // A known client, counted before the store fills.
    assert_eq!(buy(&client, &open, Some("known")).await.status(), 200);
    for i in 0..200 {
        let resp = buy(&client, &open, Some(&format!("rotating-{i}"))).await;
        assert_eq!(resp.status(), 200, "fail open: a new id is let through");
        // Counted while there was room, uncounted after.
        assert_eq!(header(&resp, "ratelimit").is_some(), i < 49, "request {i}");
        assert!(store.len() <= 50, "{} windows", store.len());
    }
    assert_eq!(store.len(), 50);
    // Failing closed, a new id is not let through uncounted.
    let resp = buy(&client, &closed, Some("rotating-new")).await;
    assert_eq!(resp.status(), 503);
    assert_eq!(header(&resp, "retry-after"), Some("1"));
    // The known client is still limited, on either layer.
    assert_eq!(buy(&client, &open, Some("known")).await.status(), 429);
    assert_eq!(buy(&client, &closed, Some("known")).await.status(), 429);
}

#[tokio::test]
async fn default_lock_and_rate_limit_keys_cannot_coincide() {
    use tower_redlock::Redlock;

    let node = RedisNode::start();
    let redlock = Locks::from(Redlock::builder([node.url()]).build().await.unwrap());
    let limiter = RedisRateLimiter::builder(node.url()).build().await.unwrap();
    // Neither default prefix starts with the other, so no lock key is a counter's key.
    assert!(!limiter.prefix().starts_with(redlock.prefix()));
    assert!(!redlock.prefix().starts_with(limiter.prefix()));

    // A lock with scope `rate` on the key the layer of `buy_app` counts client `flash`
    // under: with the former default prefix (`tower-redlock:rate:`) both were
    // `tower-redlock:rate:buy:id:flash`, and counting failed on the lock's token.
    let lease = redlock.lock("rate:buy:id:flash").await.unwrap();
    let usage = limiter.hit("buy:id:flash", quota("5/60")).await.unwrap();
    assert_eq!(usage.count(), 1);
    let mut conn = node.conn().await;
    let held: Option<String> = redis::cmd("GET")
        .arg(lease.key())
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(
        held.as_deref(),
        Some(lease.token().as_str()),
        "the lock's value is untouched"
    );
    redlock.unlock(lease).await.unwrap();

    // Through the layer too: the counter lives beside the lock, under its own prefix.
    let lease = redlock.lock("rate:buy:id:flash").await.unwrap();
    let base = serve(buy_app(RateLimiter::from(limiter), quota("5/60"), false)).await;
    let client = reqwest::Client::new();
    let resp = buy(&client, &base, Some("flash")).await;
    assert_eq!(resp.status(), 200);
    assert_eq!(ratelimit(&resp).0, 3, "the second count of client flash");
    redlock.unlock(lease).await.unwrap();
}

#[tokio::test]
async fn rate_limit_prefix_with_a_brace_is_refused() {
    use tower_redlock::ConfigError;

    for prefix in ["app{1}:", "app{:", "app}:"] {
        let built = RedisRateLimiter::builder("redis://127.0.0.1:1")
            .prefix(prefix)
            .build()
            .await;
        match built {
            Err(ConfigError::BraceInPrefix(p)) => assert_eq!(p, prefix),
            other => panic!("{prefix:?}: {other:?}"),
        }
    }
}

#[tokio::test]
async fn a_header_limit_is_the_tenants_across_routes() {
    // Two routes, each with its own layer on the same store: one tenant's 5 per 10 s are
    // shared by both, and another tenant has its own.
    let limiter = RateLimiter::from(MemoryRateLimiter::new());
    let layer = || RateLimitLayer::by_header("x-tenant", quota("5/10")).backend(limiter.clone());
    let app = Router::new()
        .route("/orders", post(|| async { "ordered" }).route_layer(layer()))
        .route(
            "/refunds",
            post(|| async { "refunded" }).route_layer(layer()),
        );
    let base = serve(app).await;
    let client = reqwest::Client::new();
    let mut passed = 0;
    for i in 0..10 {
        let path = if i % 2 == 0 { "orders" } else { "refunds" };
        let response = client
            .post(format!("{base}/{path}"))
            .header("x-tenant", "acme")
            .send()
            .await
            .unwrap();
        if response.status() == 200 {
            passed += 1;
        } else {
            assert_eq!(response.status(), 429);
        }
    }
    assert_eq!(passed, 5, "one limit for the tenant over both routes");
    let other = client
        .post(format!("{base}/orders"))
        .header("x-tenant", "globex")
        .send()
        .await
        .unwrap();
    assert_eq!(other.status(), 200);
}
