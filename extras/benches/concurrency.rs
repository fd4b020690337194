//! ConcurrencyLimitLayer against RateLimitLayer: the latency each adds to a request, on one
//! Redis node and in process, serially on one keep-alive connection.
//!
//! Cases, interleaved round by round so that drift hits them alike:
//! - no layer (the baseline every "added" figure is measured from);
//! - `RateLimitLayer::global`, a quota never reached (one round trip: the counting script);
//! - `ConcurrencyLimitLayer::global`, a limit never reached (two round trips: the
//!   acquiring script, and the `ZREM` that releases before the response is sent).
//!
//! `cargo bench -p extras --bench concurrency` (`BENCH_QUICK=1` for a short run). It starts
//! its own `redis-server` process on a free port.

// A benchmark stops on a failed setup or a result it did not expect.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing,
    clippy::panic
)]

#[path = "common/mod.rs"]
mod common;
#[path = "../tests/support/mod.rs"]
mod support;

use std::time::{Duration, Instant};

use axum::Router;
use axum::routing::post;
use tower_redlock::{
    ConcurrencyLimitLayer, ConcurrencyLimiter, MemoryConcurrencyLimiter, MemoryRateLimiter, Quota,
    RateLimitLayer, RateLimiter, RedisConcurrencyLimiter, RedisRateLimiter,
};

const CASES: [&str; 3] = ["no layer", "RateLimitLayer", "ConcurrencyLimitLayer"];

fn app(case: usize, rate: &RateLimiter, concurrency: &ConcurrencyLimiter) -> Router {
    let route = post(common::ok_handler);
    let route = match case {
        0 => route,
        1 => {
            let quota: Quota = "1000000000/3600".parse().expect("a quota");
            route.layer(RateLimitLayer::global(quota).backend(rate.clone()))
        }
        _ => route.layer(ConcurrencyLimitLayer::global(1_000).backend(concurrency.clone())),
    };
    Router::new().route("/", route)
}

fn p50(samples: &mut [Duration]) -> Duration {
    samples.sort_unstable();
    samples[samples.len() / 2]
}

fn main() {
    let quick = std::env::var_os("BENCH_QUICK").is_some();
    let (rounds, per_round) = if quick { (3, 200) } else { (10, 1_000) };
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a runtime");
    runtime.block_on(async {
        println!(
            "concurrency: added p50 per request, serial, {rounds} rounds x {per_round} requests"
        );
        println!("| store | case | p50 | added | vs RateLimitLayer's added |");
        println!("| --- | --- | --- | --- | --- |");
        let node = support::RedisNode::start();
        let stores = [
            (
                "in process",
                RateLimiter::from(MemoryRateLimiter::new()),
                ConcurrencyLimiter::from(MemoryConcurrencyLimiter::new()),
            ),
            (
                "1 Redis node",
                RateLimiter::from(
                    RedisRateLimiter::builder(node.url())
                        .build()
                        .await
                        .expect("a rate limiter"),
                ),
                ConcurrencyLimiter::from(
                    RedisConcurrencyLimiter::builder(node.url())
                        .build()
                        .await
                        .expect("a concurrency limiter"),
                ),
            ),
        ];
        for (store, rate, concurrency) in &stores {
            let mut senders = Vec::new();
            for case in 0..CASES.len() {
                let addr = common::serve(app(case, rate, concurrency)).await;
                senders.push(common::connect(addr).await);
            }
            let mut samples: Vec<Vec<Duration>> = vec![Vec::new(); CASES.len()];
            for _ in 0..rounds {
                for (case, sender) in senders.iter_mut().enumerate() {
                    for i in 0..per_round {
                        let start = Instant::now();
                        let status = common::post_key(sender, i).await;
                        samples[case].push(start.elapsed());
                        assert!(status.is_success(), "{} answered {status}", CASES[case]);
                    }
                }
            }
            let p: Vec<Duration> = samples.iter_mut().map(|s| p50(s)).collect();
            let added: Vec<Duration> = p.iter().map(|d| d.saturating_sub(p[0])).collect();
            for case in 0..CASES.len() {
                let ratio = (case == 2 && !added[1].is_zero())
                    .then(|| added[2].as_secs_f64() / added[1].as_secs_f64());
                println!(
                    "| {store} | {} | {:.1} µs | {:.1} µs | {} |",
                    CASES[case],
                    p[case].as_secs_f64() * 1e6,
                    added[case].as_secs_f64() * 1e6,
                    ratio.map_or(String::new(), |r| format!("{r:.2}x")),
                );
            }
        }
    });
}
