//! The lease lifecycle on real Redis: renewal, the lock-loss guarantee, fencing tokens.

mod support;

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::Router;
use axum::extract::Extension;
use axum::http::HeaderMap;
use axum::routing::post;
use support::{RedisNode, eventually, exists, nodes, serve, urls};
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
            post(
                move |Extension(status): Extension<LeaseStatus>| async move {
                    progress.work(status, work).await
                },
            ),
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
        .with_lock("batch", Renewal::default(), |status| async move {
            tokio::time::sleep(ttl * 3).await;
            status.is_lost()
        })
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
                .with_lock("batch", Renewal::default(), |status| async move {
                    loop {
                        *ticks.lock().unwrap() = Some((Instant::now(), status.valid_until()));
                        tokio::time::sleep(Duration::from_millis(10)).await;
                    }
                })
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
        .with_lock("memo", Renewal::default(), |_| async move {
            let start = Instant::now();
            let mut held = true;
            while start.elapsed() < ttl * 3 {
                held &= matches!(inner.try_lock("memo").await, Err(LockError::Taken { .. }));
                tokio::time::sleep(ttl / 5).await;
            }
            held
        })
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

    let memory = Locks::from(MemoryLocks::new());
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
        if round % 4 == 1 {
            nodes[(round + 1) % 3].kill();
        }
        let lease = locks.lock("restarts").await.expect("a quorum is up");
        tokens.push(lease.fencing_token().unwrap());
        let _ = locks.unlock(lease).await;
        for node in nodes.iter_mut() {
            if !support::answers(node) {
                node.restart();
            }
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
                |headers: HeaderMap, Extension(lease): Extension<tower_redlock::Lease>| async move {
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
