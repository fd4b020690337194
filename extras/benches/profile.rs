//! A driver to profile one case at a time, for instruction counts under callgrind (the
//! overhead bench measures time; this one runs a fixed number of operations, so that two
//! runs can be subtracted).
//!
//! ```text
//! cargo bench -p extras --bench profile --no-run
//! BIN=$(ls -t target/release/deps/profile-* | grep -v '\.d$' | head -1)
//! valgrind --tool=callgrind $BIN --bench http-layer 0      # setup alone
//! valgrind --tool=callgrind $BIN --bench http-layer 3000   # setup and 3,000 requests
//! ```
//!
//! The difference of the two totals ("Collected"), divided by the count, is the cost of
//! one operation. Cases:
//! - `cycle-floor`, `cycle-crate`: lock cycles on 1 node by 64 tasks (the count is per
//!   task), as in the overhead bench's throughput section;
//! - `http-none`, `http-memory`, `http-floor`, `http-layer`: requests on one keep-alive
//!   connection to the app without a layer, with `LockLayer` on the in-process backend,
//!   with the floor's lock cycle in the handler, and with `LockLayer` on 1 node;
//! - `http-idem`: `IdempotencyLayer` on 1 node, a new key per request (a first run).
//!
//! The in-process layers beside their peers, on an app served with the peer's address
//! (`ConnectInfo`), every layer set never to refuse, a new key per request:
//! - `peer-none`: that app without a layer;
//! - `peer-map-body`: tower-http's `MapResponseBodyLayer` (any layer; axum boxes the
//!   route again);
//! - `peer-tower-concurrency`: tower's `ConcurrencyLimitLayer`;
//! - `peer-governor`, `peer-governor-headers`: tower_governor per peer IP, without and
//!   with its `x-ratelimit-*` headers;
//! - `peer-lock`: `LockLayer::by_header` in process;
//! - `peer-rate-ip`, `peer-rate-header`, `peer-gcra-ip`, `peer-gcra-header`:
//!   `RateLimitLayer` by peer IP and by header, with the fixed window and with GCRA, in
//!   process (by peer IP, one key for every request, as tower_governor's);
//! - `peer-concurrency`: `ConcurrencyLimitLayer::by_header` in process.
//!
//! One request is sent before the count (with a count of 0 too), so that what the first
//! request sets up (tower_governor's clock calibration, say) stays out of the difference.
//!
//! The peers' cases run on a current-thread Tokio runtime, the others on a runtime of one
//! worker. It starts its own `redis-server`.

// A benchmark stops on a failed setup or a result it did not expect.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing,
    clippy::panic
)]

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use axum::Router;
use axum::routing::post;
use tower_redlock::{IdempotencyLayer, LockLayer, Locks, MemoryLocks};

mod common;
#[path = "../tests/support/mod.rs"]
mod support;

use common::{
    Floor, connect, crate_cycle, floor_app, ok_handler, post_key, redlock, serve, serve_with_peer,
};

const TASKS: u64 = 64;

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if !args.iter().any(|a| a == "--bench") {
        println!("profile: a driver for callgrind; see the doc comment of benches/profile.rs");
        return;
    }
    let words: Vec<&String> = args.iter().filter(|a| !a.starts_with('-')).collect();
    let (Some(case), Some(count)) = (words.first(), words.get(1)) else {
        // `cargo bench` runs every bench without arguments: nothing to profile then.
        println!(
            "profile: give a case and a count (cycle-floor, cycle-crate, http-none, \
             http-memory, http-floor, http-layer, http-idem); see the doc comment of benches/profile.rs"
        );
        return;
    };
    let count: u64 = count.parse().expect("a count of operations");
    let nodes = support::nodes(1);
    let urls = support::urls(&nodes);
    // The peers' cases run client and server on one thread, so that no wake-up crosses
    // threads and a count repeats to within a few instructions from run to run; the
    // others keep the worker thread their earlier figures were taken with.
    let runtime = if case.starts_with("peer-") {
        tokio::runtime::Builder::new_current_thread()
    } else {
        let mut builder = tokio::runtime::Builder::new_multi_thread();
        builder.worker_threads(1);
        builder
    }
    .enable_all()
    .build()
    .expect("build the Tokio runtime");
    runtime.block_on(async move {
        match case.as_str() {
            "cycle-floor" | "cycle-crate" => cycles(case, &urls, count).await,
            "http-none" | "http-memory" | "http-floor" | "http-layer" | "http-idem" => {
                requests(case, &urls, count).await;
            }
            peer if peer.starts_with("peer-") => peers(peer, &urls, count).await,
            other => panic!("unknown case {other}"),
        }
    });
    drop(nodes);
}

/// The floor and this crate's client, both built in every case so that the setup costs
/// the same.
async fn clients(urls: &[String]) -> (Arc<Floor>, Locks) {
    (Arc::new(Floor::connect(urls).await), redlock(urls).await)
}

async fn cycles(case: &str, urls: &[String], per_task: u64) {
    let (floor, redlock) = clients(urls).await;
    let crate_cycles = case == "cycle-crate";
    let tasks: Vec<_> = (0..TASKS)
        .map(|task| {
            let (floor, redlock) = (floor.clone(), redlock.clone());
            tokio::spawn(async move {
                for i in 0..per_task {
                    let resource = format!("profile:{task}:{i}");
                    let ok = if crate_cycles {
                        crate_cycle(&redlock, &resource).await
                    } else {
                        floor.cycle(&resource).await
                    };
                    assert!(ok, "a lock cycle failed");
                }
            })
        })
        .collect();
    for task in tasks {
        task.await.expect("cycle task");
    }
}

async fn requests(case: &str, urls: &[String], count: u64) {
    let (floor, redlock) = clients(urls).await;
    let base = || Router::new().route("/", post(ok_handler));
    let app = match case {
        "http-none" => base(),
        "http-memory" => base().layer(
            LockLayer::by_header("Idempotency-Key").backend(Locks::from(MemoryLocks::new())),
        ),
        "http-floor" => floor_app(floor),
        "http-idem" => base().layer(IdempotencyLayer::new().backend(redlock)),
        _ => base().layer(LockLayer::by_header("Idempotency-Key").backend(redlock)),
    };
    let mut sender = connect(serve(app).await).await;
    static NEXT: AtomicU64 = AtomicU64::new(0);
    for _ in 0..count {
        let status = post_key(&mut sender, NEXT.fetch_add(1, Ordering::Relaxed)).await;
        assert_eq!(status, http::StatusCode::OK);
    }
}

async fn peers(case: &str, urls: &[String], count: u64) {
    use std::time::Duration;
    use tower_redlock::{ConcurrencyLimitLayer, MemoryConcurrencyLimiter, Quota, RateLimitLayer};
    use tower_redlock::{MemoryRateLimiter, RateLimiter};

    // Built in every case, so that the setup costs the same as the other cases'.
    let _clients = clients(urls).await;
    let base = || Router::new().route("/", post(ok_handler));
    let never = Quota::new(1_000_000_000, Duration::from_secs(60)).expect("a quota");
    let gcra = Quota::gcra(1_000_000, Duration::from_secs(1), 1_000_000).expect("a quota");
    let limiter = || RateLimiter::from(MemoryRateLimiter::new());
    let governor = |headers: bool| {
        let mut config = tower_governor::governor::GovernorConfigBuilder::default();
        config.per_nanosecond(1).burst_size(u32::MAX);
        if headers {
            let config = config.use_headers().finish().expect("a governor config");
            base().layer(tower_governor::GovernorLayer::new(config))
        } else {
            let config = config.finish().expect("a governor config");
            base().layer(tower_governor::GovernorLayer::new(config))
        }
    };
    let app = match case {
        "peer-none" => base(),
        "peer-map-body" => base().layer(tower_http::map_response_body::MapResponseBodyLayer::new(
            |body: axum::body::Body| body,
        )),
        "peer-tower-concurrency" => {
            base().layer(tower::limit::ConcurrencyLimitLayer::new(1_000_000))
        }
        "peer-governor" => governor(false),
        "peer-governor-headers" => governor(true),
        "peer-lock" => base().layer(
            LockLayer::by_header("Idempotency-Key").backend(Locks::from(MemoryLocks::new())),
        ),
        "peer-rate-ip" => base().layer(RateLimitLayer::by_peer_ip(never).backend(limiter())),
        "peer-rate-header" => {
            base().layer(RateLimitLayer::by_header("Idempotency-Key", never).backend(limiter()))
        }
        "peer-gcra-ip" => base().layer(RateLimitLayer::by_peer_ip(gcra).backend(limiter())),
        "peer-gcra-header" => {
            base().layer(RateLimitLayer::by_header("Idempotency-Key", gcra).backend(limiter()))
        }
        "peer-concurrency" => base().layer(
            ConcurrencyLimitLayer::by_header("Idempotency-Key", 1_000_000)
                .backend(MemoryConcurrencyLimiter::new()),
        ),
        other => panic!("unknown case {other}"),
    };
    let mut sender = connect(serve_with_peer(app).await).await;
    static NEXT: AtomicU64 = AtomicU64::new(0);
    // The warm-up request, in every run.
    let status = post_key(&mut sender, NEXT.fetch_add(1, Ordering::Relaxed)).await;
    assert_eq!(status, http::StatusCode::OK);
    for _ in 0..count {
        let status = post_key(&mut sender, NEXT.fetch_add(1, Ordering::Relaxed)).await;
        assert_eq!(status, http::StatusCode::OK, "{case} refused a request");
    }
}
