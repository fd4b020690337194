//! Fairness: N waiters of one key arrive in a known order over two clients while a holder
//! holds it; each, once it acquires, releases at once. Reports how many acquired before
//! a waiter that arrived earlier (out of order), and the hand-off latency (a release's
//! start to the next waiter's acquisition), for fair waiting (`lock_fair_within`) against
//! today's wake-up (`lock_within`: every waiter woken, the fastest wins), on 3 nodes.
//!
//! `cargo bench -p extras --bench fairness` (`BENCH_QUICK=1` for a short run). It starts
//! its own `redis-server` processes on free ports.

// A benchmark stops on a failed setup or a result it did not expect.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing,
    clippy::panic
)]

#[path = "../tests/support/mod.rs"]
mod support;

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tower_redlock::Redlock;
use tower_redlock::{LockMode, LockRequest, Locks};

const WAITERS: usize = 8;

#[derive(Clone, Copy, PartialEq)]
enum Mode {
    Fair,
    WakeUp,
}

/// One acquisition: who (arrival index), and when it acquired (and began to release).
type Turn = (usize, Instant);

async fn client(nodes: &[support::RedisNode]) -> Locks {
    Locks::from(
        Redlock::builder(support::urls(nodes))
            .ttl(Duration::from_secs(30))
            .node_timeout(Duration::from_millis(200))
            .build()
            .await
            .unwrap(),
    )
}

async fn zcard(node: &support::RedisNode, key: &str) -> usize {
    let mut conn = node.conn().await;
    redis::cmd("ZCARD")
        .arg(key)
        .query_async(&mut conn)
        .await
        .unwrap()
}

/// One round: the turns in acquisition order, and the holder's release start.
async fn round(
    nodes: &[support::RedisNode],
    clients: &[Locks; 2],
    mode: Mode,
    key: &str,
) -> (Vec<Turn>, Instant) {
    let full = format!("tower-redlock:{key}");
    let holder = clients[0].try_lock(key).await.unwrap();
    let turns = Arc::new(Mutex::new(Vec::with_capacity(WAITERS)));
    let mut tasks = Vec::with_capacity(WAITERS);
    for i in 0..WAITERS {
        let (client, turns, key) = (clients[i % 2].clone(), turns.clone(), key.to_owned());
        tasks.push(tokio::spawn(async move {
            let wait = Duration::from_secs(20);
            let lease = match mode {
                Mode::Fair => {
                    client
                        .acquire(LockRequest::new(&key).mode(LockMode::Fair).wait(wait))
                        .await
                }
                Mode::WakeUp => client.acquire(LockRequest::new(&key).wait(wait)).await,
            }
            .expect("every waiter acquires");
            turns.lock().unwrap().push((i, Instant::now()));
            client.unlock(lease).await.unwrap();
        }));
        // A known arrival order: the next waiter starts once this one is in.
        match mode {
            Mode::Fair => {
                let queue = format!("tower-redlock:{{{full}}}:queue");
                while zcard(&nodes[0], &queue).await < i + 1 {
                    tokio::time::sleep(Duration::from_millis(1)).await;
                }
            }
            Mode::WakeUp => tokio::time::sleep(Duration::from_millis(5)).await,
        }
    }
    // Every waiter subscribed (both clients, every node) and the key marked as waited for.
    let channel = format!("tower-redlock:{{{full}}}:released");
    let mark = format!("tower-redlock:{{{full}}}:waiters");
    while support::subscribers(nodes, &channel).await < 2 * nodes.len() as i64
        || !support::exists(&nodes[0], &mark).await
    {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    tokio::time::sleep(Duration::from_millis(20)).await;
    let released = Instant::now();
    clients[0].unlock(holder).await.unwrap();
    for task in tasks {
        task.await.unwrap();
    }
    let mut turns = Arc::try_unwrap(turns).unwrap().into_inner().unwrap();
    turns.sort_by_key(|(_, acquired)| *acquired);
    (turns, released)
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
    let rounds = if quick { 3 } else { 20 };
    let nodes = support::nodes(3);
    let clients = [client(&nodes).await, client(&nodes).await];
    println!(
        "fairness: {WAITERS} waiters over 2 clients, 3 nodes, {rounds} rounds each; \
         hand-off = a release's start to the next acquisition"
    );
    println!(
        "{:<30} {:>14} {:>10} {:>10} {:>14}",
        "waiters", "out of order", "p50", "p99", "p50 vs wake-up"
    );
    let mut results = Vec::new();
    for mode in [Mode::WakeUp, Mode::Fair] {
        let mut out_of_order = 0usize;
        let mut handoffs = Vec::new();
        for r in 0..rounds {
            let key = format!("fair-{}-{r}", mode as u8);
            let (turns, released) = round(&nodes, &clients, mode, &key).await;
            // Acquired while a waiter that arrived earlier was still waiting.
            out_of_order += turns
                .iter()
                .enumerate()
                .filter(|(k, (i, _))| turns[k + 1..].iter().any(|(j, _)| j < i))
                .count();
            let mut previous = released;
            for (_, acquired) in &turns {
                handoffs.push(acquired.saturating_duration_since(previous));
                previous = *acquired;
            }
        }
        handoffs.sort();
        results.push((mode, out_of_order, handoffs));
    }
    let base = pct(&results[0].2, 0.5).as_secs_f64();
    for (mode, out_of_order, handoffs) in &results {
        let name = match mode {
            Mode::WakeUp => "lock_within (wake-up)",
            Mode::Fair => "lock_fair_within (fair)",
        };
        let p50 = pct(handoffs, 0.5);
        println!(
            "{:<30} {:>8} / {:<4} {:>10} {:>10} {:>13.1}x",
            name,
            out_of_order,
            rounds * WAITERS,
            ms(p50),
            ms(pct(handoffs, 0.99)),
            p50.as_secs_f64() / base
        );
    }
}
