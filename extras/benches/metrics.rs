//! What the metrics cost: the in-process HTTP rate with a Prometheus recorder installed,
//! against the same app with none.
//!
//! One axum app on loopback, `LockLayer::by_header("Idempotency-Key")` and a global
//! `RateLimitLayer`, both on the in-process backends, a new key per request: every request
//! takes and releases a lease and is counted (two counters and two histograms with a
//! recorder). 32 keep-alive connections (hyper) send one request after another. Everything
//! runs on one current-thread Tokio runtime, so a recorder set for that thread
//! (`metrics::set_default_local_recorder`) sees every request; the rounds alternate
//! "no recorder" and "recorder" so that drift on the machine hits both alike, and the
//! ratio is the median of the per-round ratios. Spans are off in both (no subscriber).
//!
//! Target: the rate with the recorder at least 0.97x the rate without (a cost under 3%).
//!
//! `cargo bench -p extras --bench metrics` (`BENCH_QUICK=1` for a short run).

// A benchmark stops on a failed setup or a result it did not expect.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing,
    clippy::panic
)]

#[path = "common/mod.rs"]
mod common;

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use axum::Router;
use axum::routing::post;
use metrics_exporter_prometheus::PrometheusBuilder;
use tower_redlock::{
    LockLayer, Locks, MemoryLocks, MemoryRateLimiter, RateLimitLayer, RateLimiter,
};

const CONNECTIONS: usize = 32;
const TARGET: f64 = 0.97;

fn app() -> Router {
    let lock = LockLayer::by_header("Idempotency-Key").backend(Locks::from(MemoryLocks::new()));
    let rate = RateLimitLayer::global("1000000000/60".parse().expect("a quota"))
        .backend(RateLimiter::from(MemoryRateLimiter::new()));
    let route: axum::routing::MethodRouter = post(common::ok_handler).layer(lock);
    Router::new().route("/", route.layer(rate))
}

/// Requests answered within `measure` after `warmup`, over [`CONNECTIONS`] connections.
async fn round(addr: SocketAddr, next_key: &mut u64, warmup: Duration, measure: Duration) -> u64 {
    let begin = Instant::now() + warmup;
    let end = begin + measure;
    let mut tasks = Vec::new();
    for _ in 0..CONNECTIONS {
        let mut sender = common::connect(addr).await;
        let first = *next_key;
        *next_key += 1 << 32;
        tasks.push(tokio::spawn(async move {
            let (mut key, mut done) = (first, 0u64);
            loop {
                let start = Instant::now();
                if start >= end {
                    return done;
                }
                key += 1;
                let status = common::post_key(&mut sender, key).await;
                assert!(status.is_success(), "answered {status}");
                done += u64::from(start >= begin);
            }
        }));
    }
    let mut total = 0;
    for task in tasks {
        total += task.await.expect("a connection task");
    }
    total
}

fn main() {
    if !std::env::args().any(|a| a == "--bench") {
        return;
    }
    let quick = std::env::var_os("BENCH_QUICK").is_some();
    let (rounds, measure) = if quick {
        (2, Duration::from_millis(300))
    } else {
        (10, Duration::from_millis(800))
    };
    let warmup = Duration::from_millis(100);
    let recorder = PrometheusBuilder::new()
        .set_buckets(&[0.001, 0.01, 0.1, 1.0, 10.0])
        .expect("buckets")
        .build_recorder();
    let handle = recorder.handle();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a runtime");
    runtime.block_on(async {
        let addr = common::serve(app()).await;
        let mut next_key = 1u64;
        let (mut off, mut on, mut ratios) = (0u64, 0u64, Vec::new());
        for _ in 0..rounds {
            let without = round(addr, &mut next_key, warmup, measure).await;
            let with = {
                let _recorder = metrics::set_default_local_recorder(&recorder);
                round(addr, &mut next_key, warmup, measure).await
            };
            // Drains the histograms, as a scrape or the exporter's upkeep would.
            handle.run_upkeep();
            off += without;
            on += with;
            ratios.push(with as f64 / without as f64);
        }
        ratios.sort_by(f64::total_cmp);
        let ratio = ratios[ratios.len() / 2];
        let seconds = measure.as_secs_f64() * rounds as f64;
        println!("metrics: in-process HTTP rate, {CONNECTIONS} connections, {rounds} rounds of {measure:?} each");
        println!("| case | req/s |");
        println!("| --- | --- |");
        println!("| no recorder | {:.0} |", off as f64 / seconds);
        println!("| Prometheus recorder | {:.0} |", on as f64 / seconds);
        println!(
            "with / without (median of rounds): {ratio:.3}x, target >= {TARGET:.2}x: {}",
            if ratio >= TARGET { "PASS" } else { "MISS" }
        );
        assert!(
            handle.render().contains("tower_redlock_lock_requests_total"),
            "the recorder saw no lock request"
        );
    });
}
