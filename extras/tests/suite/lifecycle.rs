//! The lease lifecycle on real Redis: renewal, the lock-loss guarantee, fencing tokens.

use crate::support;

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::Router;
use axum::http::HeaderMap;
use axum::routing::post;
use support::{RedisNode, eventually, exists, nodes, serve, urls};
use tower_redlock::LockRequest;
use tower_redlock::{
    LeaseStatus, LockError, LockLayer, Locks, MemoryLocks, OnLockLoss, Redlock, Renewal,
};

async fn redlock(nodes: &[RedisNode], ttl: Duration, fencing: bool) -> Locks {
    Locks::from(
        Redlock::builder(urls(nodes))
            .ttl(ttl)
            .node_timeout(Duration::from_millis(100))
            .retry_count(1000)
            .retry_delay(Duration::from_millis(1), Duration::from_millis(5))
            .fencing_tokens(fencing)
            .build()
            .await
            .unwrap(),
    )
}

async fn count_on(nodes: &[RedisNode], key: &str) -> usize {
    let mut n = 0;
    for node in nodes {
        n += usize::from(exists(node, key).await);
    }
    n
}

/// Records when the handler last made progress, and whether its future was dropped.
#[derive(Clone, Default)]
struct Progress {
    last_tick: Arc<Mutex<Option<Instant>>>,
    status: Arc<Mutex<Option<LeaseStatus>>>,
    dropped: Arc<AtomicBool>,
    entered: Arc<AtomicUsize>,
}

struct DropFlag(Arc<AtomicBool>);

impl Drop for DropFlag {
    fn drop(&mut self) {
        self.0.store(true, Ordering::SeqCst);
    }
}

impl Progress {
    /// A handler that works in 10 ms steps for `total`, recording each step.
    async fn work(&self, status: LeaseStatus, total: Duration) -> String {
        *self.status.lock().unwrap() = Some(status.clone());
        self.entered.fetch_add(1, Ordering::SeqCst);
        let _flag = DropFlag(self.dropped.clone());
        let start = Instant::now();
        while start.elapsed() < total {
            *self.last_tick.lock().unwrap() = Some(Instant::now());
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        format!("done lost={}", status.is_lost())
    }
}

fn app(
    locks: Locks,
    progress: Progress,
    work: Duration,
    configure: impl FnOnce(
        LockLayer<tower_redlock::key::HeaderKey>,
    ) -> LockLayer<tower_redlock::key::HeaderKey>,
) -> Router {
    Router::new()
        .route(
            "/jobs",
            post(move |status: LeaseStatus| async move { progress.work(status, work).await }),
        )
        .layer(configure(LockLayer::by_header("Job-Id").backend(locks)))
}

#[tokio::test]
async fn renewal_keeps_the_lock_past_its_ttl() {
    let nodes = nodes(3);
    let ttl = Duration::from_millis(400);
    let progress = Progress::default();
    let base = serve(app(
        redlock(&nodes, ttl, false).await,
        progress.clone(),
        ttl * 4,
        |l| l,
    ))
    .await;
    let client = reqwest::Client::new();
    let first = tokio::spawn(
        client
            .post(format!("{base}/jobs"))
            .header("Job-Id", "a")
            .send(),
    );
    assert!(
        eventually(Duration::from_secs(5), || async {
            progress.entered.load(Ordering::SeqCst) == 1
        })
        .await
    );
    let key = "tower-redlock:job-id POST /jobs:a";
    // Three TTLs later the lock is still held, on every node.
    let start = Instant::now();
    while start.elapsed() < ttl * 3 {
        let resp = client
            .post(format!("{base}/jobs"))
            .header("Job-Id", "a")
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 409, "lock lost after {:?}", start.elapsed());
        tokio::time::sleep(ttl / 4).await;
    }
    assert_eq!(count_on(&nodes, key).await, 3);
    let resp = first.await.unwrap().unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.text().await.unwrap(), "done lost=false");
    // Released, and no renewal brings it back.
    assert_eq!(count_on(&nodes, key).await, 0);
    let resurrected = eventually(ttl, || async { count_on(&nodes, key).await > 0 }).await;
    assert!(!resurrected, "a renewal resurrected the released lock");
}

#[tokio::test]
async fn majority_killed_mid_request_stops_the_handler_within_validity() {
    let mut nodes = nodes(3);
    let ttl = Duration::from_millis(600);
    let progress = Progress::default();
    let base = serve(app(
        redlock(&nodes, ttl, false).await,
        progress.clone(),
        Duration::from_secs(10),
        |l| l,
    ))
    .await;
    let request = tokio::spawn(
        reqwest::Client::new()
            .post(format!("{base}/jobs"))
            .header("Job-Id", "b")
            .send(),
    );
    assert!(
        eventually(Duration::from_secs(5), || async {
            progress.entered.load(Ordering::SeqCst) == 1
        })
        .await
    );
    nodes[0].kill();
    nodes[1].kill();
    let killed_at = Instant::now();
    let resp = request.await.unwrap().unwrap();
    // Renewals fail, the validity runs out, the handler is dropped: 503, well before the work ends.
    assert!(
        killed_at.elapsed() < ttl * 3,
        "took {:?}",
        killed_at.elapsed()
    );
    assert!(
        progress.dropped.load(Ordering::SeqCst),
        "the handler future was not dropped"
    );
    assert_eq!(resp.status(), 503);
    let body: serde_json::Value = resp.json().await.unwrap();
    assert!(
        body["detail"].as_str().unwrap().contains("lock was lost"),
        "{body}"
    );
    let status = progress.status.lock().unwrap().clone().unwrap();
    assert!(status.is_lost());
    let last_tick = progress.last_tick.lock().unwrap().unwrap();
    assert!(
        last_tick < status.valid_until(),
        "the handler ran {:?} past validity",
        last_tick - status.valid_until()
    );
}

#[tokio::test]
async fn max_hold_stops_renewal() {
    let nodes = nodes(1);
    let ttl = Duration::from_millis(300);
    let progress = Progress::default();
    let base = serve(app(
        redlock(&nodes, ttl, false).await,
        progress.clone(),
        Duration::from_secs(10),
        |l| l.renewal(Renewal::default().every(ttl / 3).max_hold(ttl * 2)),
    ))
    .await;
    let start = Instant::now();
    let resp = reqwest::Client::new()
        .post(format!("{base}/jobs"))
        .header("Job-Id", "c")
        .send()
        .await
        .unwrap();
    let elapsed = start.elapsed();
    assert_eq!(resp.status(), 503);
    // Renewed until max_hold, then it ran out one TTL later at most.
    assert!(elapsed >= ttl * 2 && elapsed < ttl * 5, "{elapsed:?}");
}

#[tokio::test]
async fn on_lock_loss_continue_runs_on_flagged() {
    let nodes = nodes(1);
    let ttl = Duration::from_millis(300);
    let progress = Progress::default();
    let base = serve(app(
        redlock(&nodes, ttl, false).await,
        progress.clone(),
        ttl * 3,
        |l| {
            l.renewal(Renewal::disabled())
                .on_lock_loss(OnLockLoss::Continue)
        },
    ))
    .await;
    let resp = reqwest::Client::new()
        .post(format!("{base}/jobs"))
        .header("Job-Id", "d")
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.text().await.unwrap(), "done lost=true");
}

#[tokio::test]
async fn with_lock_renews_and_stops_work_on_loss() {
    let mut nodes = nodes(3);
    let ttl = Duration::from_millis(500);
    let locks = redlock(&nodes, ttl, false).await;

    // Work three TTLs long completes, renewed throughout.
    let out = locks
        .with_lock(
            LockRequest::new("batch").retry(),
            Renewal::default(),
            |status| async move {
                tokio::time::sleep(ttl * 3).await;
                status.is_lost()
            },
        )
        .await
        .unwrap();
    assert!(!out);
    assert_eq!(
        count_on(&nodes, "tower-redlock:batch").await,
        0,
        "not released"
    );

    // Kill the majority mid-work: the work is stopped, never polled past validity.
    let last_tick = Arc::new(Mutex::new(None::<(Instant, Instant)>));
    let ticks = last_tick.clone();
    let run = tokio::spawn({
        let locks = locks.clone();
        async move {
            locks
                .with_lock(
                    LockRequest::new("batch").retry(),
                    Renewal::default(),
                    |status| async move {
                        loop {
                            *ticks.lock().unwrap() = Some((Instant::now(), status.valid_until()));
                            tokio::time::sleep(Duration::from_millis(10)).await;
                        }
                    },
                )
                .await
        }
    });
    assert!(
        eventually(Duration::from_secs(5), || async {
            last_tick.lock().unwrap().is_some()
        })
        .await
    );
    nodes[1].kill();
    nodes[2].kill();
    let result: Result<(), LockError> = run.await.unwrap();
    assert!(matches!(result, Err(LockError::Lost)), "{result:?}");
    let (tick, valid_until) = last_tick.lock().unwrap().unwrap();
    assert!(tick < valid_until);
}

#[tokio::test]
async fn in_process_with_lock_renews_past_ttl() {
    let ttl = Duration::from_millis(200);
    let locks = Locks::from(MemoryLocks::builder().ttl(ttl).build().unwrap());
    let inner = locks.clone();
    let held_throughout = locks
        .with_lock(
            LockRequest::new("memo").retry(),
            Renewal::default(),
            |_| async move {
                let start = Instant::now();
                let mut held = true;
                while start.elapsed() < ttl * 3 {
                    held &= matches!(inner.try_lock("memo").await, Err(LockError::Taken { .. }));
                    tokio::time::sleep(ttl / 5).await;
                }
                held
            },
        )
        .await
        .unwrap();
    assert!(held_throughout);
}

/// Acquires `key` `rounds` times from `tasks` tasks; returns the fencing tokens in the
/// order the critical sections ran.
async fn fenced_rounds(locks: &Locks, key: &'static str, tasks: usize, rounds: usize) -> Vec<u64> {
    let seen = Arc::new(Mutex::new(Vec::new()));
    let mut handles = Vec::new();
    for _ in 0..tasks {
        let locks = locks.clone();
        let seen = seen.clone();
        handles.push(tokio::spawn(async move {
            for _ in 0..rounds {
                let lease = locks.lock(key).await.expect("lock within retries");
                seen.lock()
                    .unwrap()
                    .push(lease.fencing_token().expect("fencing token"));
                tokio::task::yield_now().await;
                locks.unlock(lease).await.unwrap();
            }
        }));
    }
    for h in handles {
        h.await.unwrap();
    }
    Arc::try_unwrap(seen).unwrap().into_inner().unwrap()
}

fn assert_strictly_increasing(tokens: &[u64]) {
    for pair in tokens.windows(2) {
        assert!(
            pair[0] < pair[1],
            "fencing tokens not increasing: {tokens:?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fencing_tokens_increase_under_concurrency() {
    let nodes = nodes(3);
    let locks = redlock(&nodes, Duration::from_secs(5), true).await;
    let tokens = fenced_rounds(&locks, "fenced", 8, 8).await;
    assert_eq!(tokens.len(), 64);
    assert_strictly_increasing(&tokens);

    let memory = Locks::from(MemoryLocks::builder().fencing_tokens(true).build().unwrap());
    assert_strictly_increasing(&fenced_rounds(&memory, "fenced", 8, 8).await);
}

#[tokio::test]
async fn fencing_tokens_increase_across_minority_restarts() {
    let mut nodes = nodes(3);
    let locks = redlock(&nodes, Duration::from_secs(5), true).await;
    let mut tokens = Vec::new();
    for round in 0..12 {
        if round % 3 == 2 {
            // A minority node comes back empty: its counter starts again from zero.
            nodes[round % 3].restart();
        }
        let killed = (round % 4 == 1).then_some((round + 1) % 3);
        if let Some(killed) = killed {
            nodes[killed].kill();
        }
        let lease = locks.lock("restarts").await.expect("a quorum is up");
        tokens.push(lease.fencing_token().unwrap());
        let _ = locks.unlock(lease).await;
        // Only the node killed this round comes back (empty); a node that merely answers
        // slowly under load keeps its data.
        if let Some(killed) = killed {
            nodes[killed].restart();
        }
        // The documented assumption: a node restarts empty only after the others took part
        // in the last write-back. A node that came back is caught up by the next
        // acquisition that reaches it (its connection is replaced on first use), so
        // acquire until every node holds the last token.
        let counter = "tower-redlock:{tower-redlock:restarts}:fence";
        for _ in 0..50 {
            let last = tokens.last().copied();
            let mut behind = false;
            for node in &nodes {
                let held = support::get(node, counter).await;
                behind |= held.and_then(|v| v.parse::<u64>().ok()) != last;
            }
            if !behind {
                break;
            }
            let lease = locks.lock("restarts").await.expect("a quorum is up");
            tokens.push(lease.fencing_token().unwrap());
            let _ = locks.unlock(lease).await;
        }
    }
    assert_strictly_increasing(&tokens);
}

#[tokio::test]
async fn fencing_token_reaches_the_inner_service_as_a_header() {
    let nodes = nodes(1);
    let locks = redlock(&nodes, Duration::from_secs(5), true).await;
    let app = Router::new()
        .route(
            "/write",
            post(
                |headers: HeaderMap, lease: tower_redlock::Lease| async move {
                    let header: u64 = headers["fencing-token"].to_str().unwrap().parse().unwrap();
                    assert_eq!(Some(header), lease.fencing_token());
                    header.to_string()
                },
            ),
        )
        .layer(
            LockLayer::by_header("Idempotency-Key")
                .backend(locks)
                .fencing_header("Fencing-Token"),
        );
    let base = serve(app).await;
    let client = reqwest::Client::new();
    let mut last = 0;
    // One key: fencing tokens increase per lock key (each key has its own counter).
    for _ in 0..3 {
        let resp = client
            .post(format!("{base}/write"))
            .header("Idempotency-Key", "w")
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 200);
        let token: u64 = resp.text().await.unwrap().parse().unwrap();
        assert!(token > last);
        last = token;
    }
}

/// A route whose body streams: a first chunk at once, the last once `gate` is notified.
fn streaming_app(
    layer: LockLayer<tower_redlock::key::HeaderKey>,
    gate: Arc<tokio::sync::Notify>,
) -> Router {
    use axum::body::{Body, Bytes};
    use futures_util::stream;
    Router::new()
        .route(
            "/export",
            post(move || {
                let gate = gate.clone();
                async move {
                    Body::from_stream(stream::unfold(0, move |step| {
                        let gate = gate.clone();
                        async move {
                            let chunk = match step {
                                0 => "first\n",
                                1 => {
                                    gate.notified().await;
                                    "last\n"
                                }
                                _ => return None,
                            };
                            Some((Ok::<_, std::io::Error>(Bytes::from(chunk)), step + 1))
                        }
                    }))
                }
            }),
        )
        .layer(layer)
}

async fn streamed_body_runs_locked(locks: Locks) {
    let gate = Arc::new(tokio::sync::Notify::new());
    let layer = LockLayer::by_header("Job-Id").backend(locks);
    let base = serve(streaming_app(layer, gate.clone())).await;
    let client = reqwest::Client::new();
    let send = || {
        client
            .post(format!("{base}/export"))
            .header("Job-Id", "stream")
            .send()
    };
    let mut streaming = send().await.unwrap();
    assert_eq!(streaming.status(), 200);
    assert_eq!(streaming.chunk().await.unwrap().unwrap(), "first\n");
    // The body is still being produced: the key is held.
    let during = send().await.unwrap();
    assert_eq!(
        during.status(),
        409,
        "another request ran while the body streamed"
    );
    gate.notify_one();
    assert_eq!(streaming.chunk().await.unwrap().unwrap(), "last\n");
    assert!(streaming.chunk().await.unwrap().is_none());
    // The body has ended: the key is free again.
    let after = send().await.unwrap();
    assert_eq!(after.status(), 200);
}

#[tokio::test]
async fn streamed_body_runs_locked_in_process() {
    streamed_body_runs_locked(Locks::from(MemoryLocks::new())).await;
}

#[tokio::test]
async fn streamed_body_runs_locked_three_nodes() {
    let nodes = nodes(3);
    streamed_body_runs_locked(redlock(&nodes, Duration::from_secs(10), false).await).await;
}

#[tokio::test]
async fn release_at_head_lets_the_body_stream_unlocked() {
    let gate = Arc::new(tokio::sync::Notify::new());
    let layer = LockLayer::by_header("Job-Id")
        .backend(MemoryLocks::new())
        .release_at_head(true);
    let base = serve(streaming_app(layer, gate.clone())).await;
    let client = reqwest::Client::new();
    let send = || {
        client
            .post(format!("{base}/export"))
            .header("Job-Id", "head")
            .send()
    };
    let mut streaming = send().await.unwrap();
    assert_eq!(streaming.chunk().await.unwrap().unwrap(), "first\n");
    let during = send().await.unwrap();
    assert_eq!(during.status(), 200, "released at the head");
    gate.notify_one();
    assert_eq!(streaming.chunk().await.unwrap().unwrap(), "last\n");
}

#[tokio::test]
async fn a_lease_lost_mid_body_ends_the_body_with_an_error() {
    let ttl = Duration::from_millis(300);
    let locks = Locks::from(MemoryLocks::builder().ttl(ttl).build().unwrap());
    let layer = LockLayer::by_header("Job-Id")
        .backend(locks)
        .renewal(Renewal::disabled());
    let never = Arc::new(tokio::sync::Notify::new());
    let base = serve(streaming_app(layer, never)).await;
    let mut streaming = reqwest::Client::new()
        .post(format!("{base}/export"))
        .header("Job-Id", "lost")
        .send()
        .await
        .unwrap();
    assert_eq!(streaming.chunk().await.unwrap().unwrap(), "first\n");
    // The lease runs out (no renewal) while the body waits for its last chunk.
    let cut = tokio::time::timeout(ttl * 10, streaming.chunk())
        .await
        .expect("the body ends when the lease is lost");
    assert!(cut.is_err(), "the body ended cleanly: {cut:?}");
}

/// A body of known length that never says it has ended: only its size tells.
struct Sized(Vec<&'static str>);

impl http_body::Body for Sized {
    type Data = axum::body::Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<Self::Data>, Self::Error>>> {
        if self.0.is_empty() {
            return std::task::Poll::Ready(None);
        }
        // One frame per wake-up, so that the head leaves before the body.
        cx.waker().wake_by_ref();
        let chunk = self.0.remove(0);
        std::task::Poll::Ready(Some(Ok(http_body::Frame::data(chunk.into()))))
    }

    fn size_hint(&self) -> http_body::SizeHint {
        http_body::SizeHint::with_exact(self.0.iter().map(|c| c.len() as u64).sum())
    }
}

/// Sends 30 requests with one key, one after the other on one connection, each as soon as
/// the previous response was read: none may meet the lock of the one before.
async fn next_request_never_meets_its_own_lock(locks: Locks) {
    let app = Router::new()
        .route(
            "/stream",
            post(|| async {
                use futures_util::stream;
                axum::body::Body::from_stream(stream::iter(
                    ["a", "b", "c"].map(|c| Ok::<_, std::io::Error>(axum::body::Bytes::from(c))),
                ))
            }),
        )
        .route(
            "/sized",
            post(|| async { axum::body::Body::new(Sized(vec!["ab", "cd"])) }),
        )
        .route("/full", post(|| async { "abcd" }))
        .layer(LockLayer::by_header("Job-Id").backend(locks));
    let base = serve(app).await;
    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(1)
        .build()
        .unwrap();
    for path in ["stream", "sized", "full"] {
        for i in 0..30 {
            let resp = client
                .post(format!("{base}/{path}"))
                .header("Job-Id", "again")
                .send()
                .await
                .unwrap();
            assert_eq!(resp.status(), 200, "{path}, request {i}");
            let body = resp.bytes().await.unwrap();
            assert!(body == "abc" || body == "abcd", "{body:?}");
        }
    }
}

#[tokio::test]
async fn next_request_never_meets_its_own_lock_in_process() {
    next_request_never_meets_its_own_lock(Locks::from(MemoryLocks::new())).await;
}

#[tokio::test]
async fn next_request_never_meets_its_own_lock_three_nodes() {
    let nodes = nodes(3);
    next_request_never_meets_its_own_lock(redlock(&nodes, Duration::from_secs(10), false).await)
        .await;
}

#[tokio::test]
async fn fencing_tokens_are_off_by_default_and_the_same_on_both_backends() {
    let nodes = nodes(1);
    for fencing in [false, true] {
        let backends = [
            (
                "redis",
                redlock(&nodes, Duration::from_secs(5), fencing).await,
            ),
            (
                "in process",
                Locks::from(
                    MemoryLocks::builder()
                        .fencing_tokens(fencing)
                        .build()
                        .unwrap(),
                ),
            ),
        ];
        for (name, locks) in backends {
            let key = format!("fence-{fencing}");
            let first = locks.try_lock(&key).await.unwrap();
            let earlier = first.fencing_token();
            locks.unlock(first).await.unwrap();
            let second = locks.try_lock(&key).await.unwrap();
            assert_eq!(earlier.is_some(), fencing, "{name}, fencing {fencing}");
            assert_eq!(second.fencing_token().is_some(), fencing, "{name}");
            if fencing {
                assert!(second.fencing_token() > earlier, "{name}: increasing");
            }
            locks.unlock(second).await.unwrap();
            // A reader never has one.
            let reader =
                LockRequest::new(format!("{key}-read")).mode(tower_redlock::LockMode::Shared);
            let reader = locks.acquire(reader).await.unwrap();
            assert_eq!(reader.fencing_token(), None, "{name}: a reader");
            locks.unlock(reader).await.unwrap();
        }
    }
}

/// A handler behind a `LockLayer` on "job:7" asks the same backend for "job:7" again.
async fn a_handler_gets_its_own_lease_back(locks: Locks) {
    let handler = {
        let locks = locks.clone();
        move |held: tower_redlock::Lease| {
            let locks = locks.clone();
            async move {
                // One attempt, then a wait: both the layer's lease, at once.
                let again = locks.try_lock("job:7").await.expect("reentrant try_lock");
                let waited = locks
                    .acquire(LockRequest::new("job:7").wait(Duration::from_secs(5)))
                    .await
                    .expect("reentrant wait");
                let same = again.token() == held.token() && waited.token() == held.token();
                // Releasing the inner leases leaves the layer's in place...
                locks.unlock(again).await.unwrap();
                locks.unlock(waited).await.unwrap();
                // ... and a task the handler spawns is another request.
                let other = tokio::spawn({
                    let locks = locks.clone();
                    async move { locks.try_lock("job:7").await }
                })
                .await
                .unwrap();
                format!("{same} {}", matches!(other, Err(LockError::Taken { .. })))
            }
        }
    };
    let layer = LockLayer::by_fn(|_| Some("7".to_owned()))
        .scope("job")
        .backend(locks.clone());
    let base = serve(Router::new().route("/jobs", post(handler).layer(layer))).await;
    let answer = reqwest::Client::new()
        .post(format!("{base}/jobs"))
        .send()
        .await
        .unwrap();
    assert_eq!(answer.status(), 200);
    assert_eq!(answer.text().await.unwrap(), "true true");
    // The layer, the outermost holder, released it with the response.
    let after = eventually(Duration::from_secs(5), || async {
        match locks.try_lock("job:7").await {
            Ok(lease) => locks.unlock(lease).await.is_ok(),
            Err(_) => false,
        }
    })
    .await;
    assert!(after, "released once the response was done");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reentrant_within_a_request_on_both_backends() {
    a_handler_gets_its_own_lease_back(Locks::from(MemoryLocks::new())).await;
    let nodes = nodes(1);
    a_handler_gets_its_own_lease_back(redlock(&nodes, Duration::from_secs(10), false).await).await;
}
