//! IdempotencyLayer against LockLayer::by_header: the latency each adds to a request, on
//! 1 and 3 Redis nodes, serially on one keep-alive connection.
//!
//! Cases, interleaved round by round so that drift hits them alike; each round gives every
//! case's p50 and the ratios of what the layers add, and the figures are medians over the
//! rounds (with the ratios' range):
//! - no layer (the baseline every "added" figure is measured from);
//! - `LockLayer::by_header("Idempotency-Key")`, a new key per request (a lock cycle);
//! - `IdempotencyLayer`, a new key per request (a first run: look up and lock, then store
//!   and release);
//! - `IdempotencyLayer`, one key already stored (a replay).
//!
//! Targets: a first run adds at most 1.10x what LockLayer adds; a replay at most 0.60x.
//!
//! `cargo bench -p extras --bench idempotency` (`BENCH_QUICK=1` for a short run). It starts
//! its own `redis-server` processes on free ports.

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
use tower_redlock::{IdempotencyLayer, LockLayer, Locks};

const CASES: [&str; 4] = [
    "no layer",
    "LockLayer",
    "Idempotency first",
    "Idempotency replay",
];

fn app(case: usize, locks: &Locks) -> Router {
    let route = post(common::ok_handler);
    let route = match case {
        0 => route,
        1 => route.layer(LockLayer::by_header("Idempotency-Key").backend(locks.clone())),
        _ => route.layer(IdempotencyLayer::new().backend(locks.clone())),
    };
    Router::new().route("/", route)
}

fn p50(samples: &mut [Duration]) -> Duration {
    samples.sort_unstable();
    samples[samples.len() / 2]
}

/// The median of `ratios` with their range; zeros when there are none.
fn median_range(ratios: &mut [f64]) -> (f64, f64, f64) {
    if ratios.is_empty() {
        return (0.0, 0.0, 0.0);
    }
    ratios.sort_unstable_by(f64::total_cmp);
    (
        ratios[ratios.len() / 2],
        ratios[0],
        ratios[ratios.len() - 1],
    )
}

fn main() {
    let quick = std::env::var_os("BENCH_QUICK").is_some();
    let (rounds, per_round) = if quick { (3, 200) } else { (20, 500) };
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a runtime");
    runtime.block_on(async {
        println!(
            "idempotency: added p50 per request, serial, {rounds} rounds x {per_round} requests"
        );
        println!(
            "| nodes | case | p50 (median of rounds) | added | vs LockLayer's added (median of rounds, range) | target |"
        );
        println!("| --- | --- | --- | --- | --- | --- |");
        for n in [1usize, 3] {
            let nodes = support::nodes(n);
            let locks = common::redlock(&support::urls(&nodes)).await;
            let mut senders = Vec::new();
            for case in 0..CASES.len() {
                let addr = common::serve(app(case, &locks)).await;
                senders.push(common::connect(addr).await);
            }
            // The replay case's one key, stored once.
            let replay_key = u64::MAX;
            assert!(
                common::post_key(&mut senders[3], replay_key)
                    .await
                    .is_success()
            );
            // Per round: each case's p50, and the ratios of what the layers add. The
            // figures printed are medians over the rounds, so that a round slowed by other
            // processes moves one sample, not the result.
            let mut p50s: Vec<Vec<Duration>> = vec![Vec::new(); CASES.len()];
            let mut ratios: [Vec<f64>; 2] = [Vec::new(), Vec::new()];
            let mut next_key = 0u64;
            for _ in 0..rounds {
                let mut round: Vec<Vec<Duration>> = vec![Vec::with_capacity(per_round); CASES.len()];
                for (case, sender) in senders.iter_mut().enumerate() {
                    for _ in 0..per_round {
                        let key = if case == 3 {
                            replay_key
                        } else {
                            next_key += 1;
                            next_key
                        };
                        let start = Instant::now();
                        let status = common::post_key(sender, key).await;
                        round[case].push(start.elapsed());
                        assert!(status.is_success(), "{} answered {status}", CASES[case]);
                    }
                }
                let p: Vec<Duration> = round.iter_mut().map(|s| p50(s)).collect();
                let added = |case: usize| p[case].saturating_sub(p[0]).as_secs_f64();
                if added(1) > 0.0 {
                    ratios[0].push(added(2) / added(1));
                    ratios[1].push(added(3) / added(1));
                }
                for (case, d) in p.into_iter().enumerate() {
                    p50s[case].push(d);
                }
            }
            let p: Vec<Duration> = p50s.iter_mut().map(|s| p50(s)).collect();
            let added: Vec<Duration> = p.iter().map(|d| d.saturating_sub(p[0])).collect();
            for case in 0..CASES.len() {
                let (ratio, target) = match case {
                    2 => (Some(median_range(&mut ratios[0])), "<= 1.10x"),
                    3 => (Some(median_range(&mut ratios[1])), "<= 0.60x"),
                    _ => (None, ""),
                };
                println!(
                    "| {n} | {} | {:.1} µs | {:.1} µs | {} | {target} |",
                    CASES[case],
                    p[case].as_secs_f64() * 1e6,
                    added[case].as_secs_f64() * 1e6,
                    ratio.map_or(String::new(), |(m, lo, hi)| format!(
                        "{m:.2}x ({lo:.2}x to {hi:.2}x)"
                    )),
                );
            }
        }
    });
}
