//! Heap allocations per operation: this crate's lock cycle against the floor's (the bare
//! Redis commands) and rslock's, and a request through [`LockLayer`] against no layer.
//!
//! Run with `cargo bench -p extras --bench allocs` (a few seconds). It starts its own
//! `redis-server` processes and runs everything on one thread (a current-thread Tokio
//! runtime: the Redis connection tasks, the axum server and the hyper client included), so
//! that the counter, which counts the allocations of its own thread, sees all of them.
//! Counted: every `alloc` and `realloc`, over `OPS` operations after a warm-up, divided by
//! `OPS`.
//!
//! What it shows: what is built once is not built per request. The script hashes are
//! computed when a script is first used, the key prefix is copied into the one allocation
//! of the whole key, and the header name is parsed when the layer is built; what is left
//! per operation is the key, the lease, the Redis commands and their replies.

// A benchmark stops on a failed setup or a result it did not expect.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing,
    clippy::panic
)]

use std::sync::Arc;

use allocation_counter::AllocationInfo;
use axum::Router;
use axum::routing::post;
use tower_redlock::{LockLayer, Locks, MemoryLocks};

mod common;
#[path = "../tests/support/mod.rs"]
mod support;

use common::{
    Floor, connect, crate_cycle, floor_app, ok_handler, post_key, redlock, rslock_cycle, serve,
};

/// Operations measured per case, after as many to warm up.
const OPS: u64 = 2_000;

struct Row {
    case: String,
    nodes: &'static str,
    per_op: f64,
    bytes_per_op: f64,
    baseline: Option<usize>,
}

/// Runs `op` `OPS` times to warm up, then `OPS` times counted; allocations per op.
fn count<F>(runtime: &tokio::runtime::Runtime, mut op: F) -> (f64, f64)
where
    F: AsyncFnMut(u64) -> bool,
{
    runtime.block_on(async {
        for i in 0..OPS {
            assert!(op(i).await, "warm-up operation failed");
        }
    });
    let mut failed = 0u64;
    let info: AllocationInfo = allocation_counter::measure(|| {
        runtime.block_on(async {
            for i in OPS..2 * OPS {
                failed += u64::from(!op(i).await);
            }
        });
    });
    assert_eq!(failed, 0, "operations failed while counting");
    (
        info.count_total as f64 / OPS as f64,
        info.bytes_total as f64 / OPS as f64,
    )
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if !args.iter().any(|a| a == "--bench") {
        println!("allocs: a benchmark; run it with `cargo bench -p extras --bench allocs`");
        return;
    }
    let nodes = support::nodes(3);
    let urls = support::urls(&nodes);
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("build the Tokio runtime");
    let mut rows: Vec<Row> = Vec::new();

    // Lock cycles on distinct keys.
    for n in [1usize, 3] {
        let nodes_label = if n == 1 { "1" } else { "3" };
        let urls = &urls[..n];
        let (floor, redlock, rslock) = runtime.block_on(async {
            (
                Floor::connect(urls).await,
                redlock(urls).await,
                rslock::LockManager::new(urls.to_vec()),
            )
        });
        let floor_row = rows.len();
        let (per_op, bytes_per_op) = count(&runtime, async |i| {
            floor.cycle(&format!("alloc-floor:{i}")).await
        });
        rows.push(Row {
            case: "lock cycle, floor (redis-rs)".to_owned(),
            nodes: nodes_label,
            per_op,
            bytes_per_op,
            baseline: None,
        });
        let (per_op, bytes_per_op) = count(&runtime, async |i| {
            crate_cycle(&redlock, &format!("alloc-crate:{i}")).await
        });
        rows.push(Row {
            case: "lock cycle, tower-redlock".to_owned(),
            nodes: nodes_label,
            per_op,
            bytes_per_op,
            baseline: Some(floor_row),
        });
        let (per_op, bytes_per_op) = count(&runtime, async |i| {
            rslock_cycle(&rslock, &format!("alloc-rslock:{i}")).await
        });
        rows.push(Row {
            case: "lock cycle, rslock 0.10".to_owned(),
            nodes: nodes_label,
            per_op,
            bytes_per_op,
            baseline: Some(floor_row),
        });
    }
    let memory = Locks::from(MemoryLocks::new());
    let (per_op, bytes_per_op) = count(&runtime, async |i| {
        match memory.try_lock(&format!("alloc-memory:{i}")).await {
            Ok(lease) => memory.unlock(lease).await.is_ok(),
            Err(_) => false,
        }
    });
    rows.push(Row {
        case: "lock cycle, MemoryLocks".to_owned(),
        nodes: "-",
        per_op,
        bytes_per_op,
        baseline: None,
    });

    // HTTP requests on one keep-alive connection, a distinct Idempotency-Key each.
    let apps = runtime.block_on(async {
        let one = redlock(&urls[..1]).await;
        let three = redlock(&urls).await;
        let layer = |locks: Locks| LockLayer::by_header("Idempotency-Key").backend(locks);
        let base = || Router::new().route("/", post(ok_handler));
        vec![
            ("request, no layer", "-", base(), None),
            (
                "request, LockLayer in-process",
                "-",
                base().layer(layer(Locks::from(MemoryLocks::new()))),
                Some(0),
            ),
            (
                "request, floor cycle in handler",
                "1",
                floor_app(Arc::new(Floor::connect(&urls[..1]).await)),
                Some(0),
            ),
            (
                "request, LockLayer Redlock",
                "1",
                base().layer(layer(one)),
                Some(2),
            ),
            (
                "request, floor cycle in handler",
                "3",
                floor_app(Arc::new(Floor::connect(&urls).await)),
                Some(0),
            ),
            (
                "request, LockLayer Redlock",
                "3",
                base().layer(layer(three)),
                Some(4),
            ),
        ]
    });
    let first_http = rows.len();
    for (case, nodes_label, app, baseline) in apps {
        let mut sender = runtime.block_on(async { connect(serve(app).await).await });
        let (per_op, bytes_per_op) = count(&runtime, async |i| {
            post_key(&mut sender, 3_000_000_000 + i).await == http::StatusCode::OK
        });
        rows.push(Row {
            case: case.to_owned(),
            nodes: nodes_label,
            per_op,
            bytes_per_op,
            baseline: baseline.map(|b| first_http + b),
        });
    }
    drop(runtime);
    drop(nodes);

    println!();
    println!(
        "tower-redlock allocations per operation ({OPS} operations per case, after {OPS} to warm up; one thread)"
    );
    println!(
        "{:<34} {:>5} {:>10} {:>10}  compared with",
        "case", "nodes", "allocs/op", "bytes/op"
    );
    println!("{}", "-".repeat(90));
    for row in &rows {
        let compared = row.baseline.map_or_else(String::new, |b| {
            let base = &rows[b];
            format!(
                "{:+.1} allocs, {:+.0} bytes vs {} ({})",
                row.per_op - base.per_op,
                row.bytes_per_op - base.bytes_per_op,
                base.case,
                base.nodes
            )
        });
        println!(
            "{:<34} {:>5} {:>10.1} {:>10.0}  {compared}",
            row.case, row.nodes, row.per_op, row.bytes_per_op
        );
    }
}
