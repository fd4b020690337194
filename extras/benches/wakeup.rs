//! Wake-up latency: the time from a holder's release to the next waiter's acquisition,
//! with release notifications (pub/sub) against polling, on 1 and 3 Redis nodes.
//!
//! `cargo bench -p extras --bench wakeup` (`BENCH_QUICK=1` for a short run). It starts its
//! own `redis-server` processes on free ports.

// A benchmark stops on a failed setup or a result it did not expect.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing,
    clippy::panic
)]

#[path = "../tests/support/mod.rs"]
mod support;

use std::time::{Duration, Instant};

use tower_redlock::Redlock;
use tower_redlock::{LockRequest, Locks};

#[derive(Clone, Copy, PartialEq)]
enum Mode {
    /// `lock_within`, woken by the release notification.
    PubSub,
    /// `lock`, re-trying after a random 50 to 250 ms delay (go-redsync's default policy).
    Polling,
}

async fn measure(nodes: &[support::RedisNode], mode: Mode, rounds: usize) -> Vec<Duration> {
    let redlock = Locks::from(
        Redlock::builder(support::urls(nodes))
            .ttl(Duration::from_secs(30))
            .node_timeout(Duration::from_millis(200))
            .retry_count(1000)
            .retry_delay(Duration::from_millis(50), Duration::from_millis(250))
            .notify_waiters(mode == Mode::PubSub)
            .build()
            .await
            .unwrap(),
    );
    let mut delays = Vec::with_capacity(rounds);
    for round in 0..rounds {
        let key = format!("wake-{round}");
        let holder = redlock.try_lock(&key).await.unwrap();
        let waiter = tokio::spawn({
            let redlock = redlock.clone();
            let key = key.clone();
            async move {
                let lease = match mode {
                    Mode::PubSub => {
                        redlock
                            .acquire(LockRequest::new(&key).wait(Duration::from_secs(10)))
                            .await
                    }
                    Mode::Polling => redlock.lock(&key).await,
                };
                (lease.expect("waiter acquires"), Instant::now())
            }
        });
        match mode {
            Mode::PubSub => {
                let channel = format!("tower-redlock:{key}");
                while support::subscribers(nodes, &channel).await < nodes.len() as i64 {
                    tokio::time::sleep(Duration::from_millis(1)).await;
                }
            }
            // Let the poller settle into its retry sleep at a random phase.
            Mode::Polling => tokio::time::sleep(Duration::from_millis(30)).await,
        }
        let released_at = Instant::now();
        redlock.unlock(holder).await.unwrap();
        let (lease, acquired_at) = waiter.await.unwrap();
        delays.push(acquired_at - released_at);
        redlock.unlock(lease).await.unwrap();
    }
    delays.sort();
    delays
}

fn pct(sorted: &[Duration], p: f64) -> Duration {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i]
}

fn ms(d: Duration) -> String {
    format!("{:.2} ms", d.as_secs_f64() * 1000.0)
}

#[tokio::main]
async fn main() {
    let quick = std::env::var_os("BENCH_QUICK").is_some();
    let rounds = if quick { 10 } else { 100 };
    println!("wake-up latency, release -> next waiter acquired ({rounds} rounds each)");
    println!(
        "{:<8} {:<28} {:>10} {:>10} {:>14}",
        "nodes", "waiter", "p50", "p99", "p50 vs pub/sub"
    );
    for n in [1, 3] {
        let nodes = support::nodes(n);
        let pubsub = measure(&nodes, Mode::PubSub, rounds).await;
        let polling = measure(&nodes, Mode::Polling, rounds).await;
        let base = pct(&pubsub, 0.5).as_secs_f64();
        for (name, delays) in [
            ("lock_within (pub/sub)", &pubsub),
            ("lock (poll 50-250 ms)", &polling),
        ] {
            let p50 = pct(delays, 0.5);
            println!(
                "{:<8} {:<28} {:>10} {:>10} {:>13.1}x",
                n,
                name,
                ms(p50),
                ms(pct(delays, 0.99)),
                p50.as_secs_f64() / base
            );
        }
    }
}
