//! What a lock costs: this crate against the bare Redis commands, against rslock, and
//! over HTTP against no layer at all.
//!
//! Run with `cargo bench -p extras --bench overhead` (about 105 s on two cores, after the
//! build), or `BENCH_QUICK=1 cargo bench -p extras --bench overhead` for a smoke run of a
//! few seconds. A word after `--` runs only the sections whose name contains it: `cycle`,
//! `http` or `hot` (`cargo bench -p extras --bench overhead -- cycle`). `BENCH_DEBUG=1`
//! also prints the deciles of the serial lock cycles (they are often bimodal: see below).
//!
//! The bench starts its own `redis-server` processes (three, on free loopback ports,
//! without persistence) and stops them at the end. It prints one table with absolute
//! figures, the ratios, and the targets (PASS/MISS) next to the figures they judge.
//!
//! Sections:
//! 1. **Lock cycle**: acquire then release on distinct keys, on 1 and on 3 nodes, serial
//!    (p50, p99) and with 64 concurrent tasks (cycles/s), for
//!    - the *floor*: the same commands sent straight with redis-rs on multiplexed
//!      connections (`SET key token NX PX ttl` to every node at once, then the Redis
//!      docs' compare-and-delete script by `EVALSHA` to every node at once), no lock
//!      logic;
//!    - this crate's [`Redlock`] (`try_lock` + `unlock`);
//!    - rslock 0.10 (`lock` + `unlock`).
//! 2. **HTTP**: an axum app with a trivial handler on loopback, driven by 32 keep-alive
//!    connections (hyper), each sending one request after another: no layer, then
//!    [`LockLayer::by_header`] with the in-process backend, on 1 node and on 3 nodes, a
//!    distinct `Idempotency-Key` per request. The baseline for the latency the layer adds
//!    on Redis is the floor's lock cycle run inside the handler of the same app, without
//!    the layer: both are judged by what they add to "no layer" under the same load. Also
//!    with 1 connection, where the added latency is not magnified by queueing. For
//!    scale, a pass-through layer (tower-http's `MapResponseBodyLayer` with a body wrapper
//!    that does nothing): what any layer that wraps the body costs under `Router::layer`.
//! 3. **Hot key**: 200 requests at once on one key, the handler holding it 200 ms: how fast
//!    the losers get their 409 on Redlock (1 and 3 nodes) against the in-process backend,
//!    a check that exactly one handler runs at a time, and the Redis commands per 409
//!    (`INFO commandstats` before and after each burst, commands run inside scripts
//!    included) with the holder in the app's own process and with the holder in another
//!    client (another replica).
//! 4. **Cluster** (with `--features cluster-async`): the lock cycle on a Redis Cluster of
//!    3 primaries and 3 replicas as one Redlock node, against the same commands sent
//!    straight on redis-rs's cluster connection (see `benches/common/cluster.rs`).
//!
//! The clients and the app run on a Tokio runtime of one worker thread (`BENCH_WORKERS=n`
//! for more), so that on a small machine the Redis nodes keep a core of their own, as they
//! would on their own hosts. With two workers on two cores, the workers and `redis-server`
//! fight for the CPUs, and the rates jump between two regimes by a third from one round to
//! the next (a wake-up across workers or not), which drowns the differences measured here.
//!
//! Noise: throughput cases are measured in interleaved rounds (floor, crate, rslock,
//! floor, ...) and serial cycles one of each locker in turn, so that a burst of other work
//! on the machine hits all of them alike; throughput ratios are the median of the
//! per-round ratios. The `spread` column is the range of the per-round rates over their
//! mean, and each section says how much CPU time other processes took while it ran.
//! Compare the ratios of one run rather than absolute times across runs.

// A benchmark stops on a failed setup or a result it did not expect.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing,
    clippy::panic
)]

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Body;
use axum::routing::post;
use http::StatusCode;
use http_body_util::BodyExt;
use tower_http::map_response_body::MapResponseBodyLayer;
use tower_redlock::{LockLayer, Locks, MemoryLocks};

#[cfg(feature = "cluster-async")]
#[path = "common/cluster.rs"]
mod cluster;
mod common;
#[path = "../tests/support/mod.rs"]
mod support;

use common::{
    Floor, connect, crate_cycle, floor_app, ok_handler, post_key, redlock, rslock_cycle, serve,
};

const LOCK_TASKS: usize = 64;
const HTTP_WORKERS: usize = 32;
const HOT_REQUESTS: usize = 200;
const HOT_HOLD: Duration = Duration::from_millis(200);

// Targets, as ratios measured in the same run.
const CYCLE_P50_MAX_1: f64 = 1.05;
const CYCLE_P50_MAX_3: f64 = 1.10;
const CYCLE_RATE_MIN_VS_FLOOR: f64 = 0.90;
const CYCLE_RATE_MIN_VS_RSLOCK: f64 = 1.4;
const HTTP_MEMORY_RATE_MIN: f64 = 0.90;
const HTTP_ADDED_P50_MAX: f64 = 1.10;
const HOT_P50_MAX: f64 = 1.2;
const HOT_LOCAL_COMMANDS_MAX: f64 = 0.05;

/// How long and how often to measure.
#[derive(Clone, Copy)]
struct Plan {
    quick: bool,
    /// Rounds each case is split into, interleaved with the other cases.
    rounds: usize,
    /// Serial lock cycles measured per case.
    serial_iters: usize,
    /// Serial lock cycles run before measuring, per case.
    serial_warmup: usize,
    /// Measured time per case (over all rounds) for throughput.
    duration: Duration,
    /// Warm-up before every throughput round.
    warmup: Duration,
    /// Hot-key waves per backend.
    hot_waves: usize,
}

impl Plan {
    fn from_env() -> Self {
        let quick = std::env::var("BENCH_QUICK").is_ok_and(|v| !v.is_empty() && v != "0");
        if quick {
            Plan {
                quick,
                rounds: 1,
                serial_iters: 200,
                serial_warmup: 50,
                duration: Duration::from_millis(400),
                warmup: Duration::from_millis(100),
                hot_waves: 1,
            }
        } else {
            Plan {
                quick,
                rounds: 10,
                serial_iters: 5000,
                serial_warmup: 300,
                duration: Duration::from_secs(4),
                warmup: Duration::from_millis(150),
                hot_waves: 3,
            }
        }
    }

    fn round_time(&self) -> Duration {
        self.duration / u32::try_from(self.rounds).unwrap_or(1)
    }
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    // `cargo bench` passes `--bench`; `cargo test --benches` does not: stay out of the
    // test suite.
    if !args.iter().any(|a| a == "--bench") {
        println!("overhead: a benchmark; run it with `cargo bench -p extras --bench overhead`");
        return;
    }
    let filter: Option<String> = args.iter().find(|a| !a.starts_with('-')).cloned();
    let plan = Plan::from_env();

    let nodes = support::nodes(3);
    let urls = support::urls(&nodes);
    let workers = std::env::var("BENCH_WORKERS")
        .ok()
        .and_then(|w| w.parse::<usize>().ok())
        .filter(|w| *w > 0)
        .unwrap_or(1);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(workers)
        .enable_all()
        .build()
        .expect("build the Tokio runtime");

    let pids: Vec<u32> = nodes.iter().filter_map(support::RedisNode::pid).collect();
    let cpu_before = CpuSnapshot::take(&pids);
    let started = Instant::now();
    // On a worker thread, as a server's tasks are: a future driven by `block_on` runs on
    // the main thread, and every Redis reply would cost a wake-up across threads.
    let (table, misses) = runtime
        .block_on(runtime.spawn(run(plan, urls, pids.clone(), filter)))
        .expect("the bench task");
    let foreign = cpu_before.and_then(|c| c.foreign_since(&pids));
    drop(runtime);
    drop(nodes);

    println!();
    println!(
        "tower-redlock overhead bench: {} mode, {} CPUs, {workers} runtime worker{}, {} rounds per case, {:.0} s; \
         other processes used {} of the CPU time meanwhile (noise)",
        if plan.quick { "quick" } else { "full" },
        std::thread::available_parallelism().map_or(0, usize::from),
        if workers == 1 { "" } else { "s" },
        plan.rounds,
        started.elapsed().as_secs_f64(),
        fmt_share(foreign),
    );
    table.print();
    println!();
    if misses.is_empty() {
        println!("targets: all PASS");
    } else {
        println!("targets missed ({}):", misses.len());
        for miss in &misses {
            println!("  - {miss}");
        }
    }
}

/// Runs the sections `filter` selects; returns the table and the missed targets.
async fn run(
    plan: Plan,
    urls: Vec<String>,
    pids: Vec<u32>,
    filter: Option<String>,
) -> (Table, Vec<String>) {
    let wants = |section: &str| filter.as_deref().is_none_or(|f| section.contains(f));
    let mut table = Table::default();
    let mut misses = Vec::new();
    let mut floor_p50 = [None, None];
    if wants("cycle") {
        for (slot, n) in [(0, 1), (1, 3)] {
            let (cpu, first) = (CpuSnapshot::take(&pids), table.lines.len());
            floor_p50[slot] = Some(lock_cycle(&plan, &urls[..n], &mut table, &mut misses).await);
            table.note_noise(first, cpu.and_then(|c| c.foreign_since(&pids)));
        }
    }
    if wants("http") {
        let (cpu, first) = (CpuSnapshot::take(&pids), table.lines.len());
        http(&plan, &urls, floor_p50, &mut table, &mut misses).await;
        table.note_noise(first, cpu.and_then(|c| c.foreign_since(&pids)));
    }
    if wants("hot") {
        let (cpu, first) = (CpuSnapshot::take(&pids), table.lines.len());
        hot_key(&plan, &urls, &mut table, &mut misses).await;
        table.note_noise(first, cpu.and_then(|c| c.foreign_since(&pids)));
    }
    // No noise share here: the cluster's six processes, started by the section, would
    // count as other processes.
    #[cfg(feature = "cluster-async")]
    if wants("cluster") {
        cluster::cluster_cycle(&plan, &mut table).await;
    }
    (table, misses)
}

// ---------------------------------------------------------------------------------------
// 1. Lock cycle
// ---------------------------------------------------------------------------------------

/// One way to take and release a lock.
enum Locker {
    Floor(Floor),
    Crate(Locks),
    Rslock(rslock::LockManager),
    #[cfg(feature = "cluster-async")]
    ClusterFloor(cluster::ClusterFloor),
}

impl Locker {
    fn name(&self) -> &'static str {
        match self {
            Locker::Floor(_) => "floor (redis-rs)",
            Locker::Crate(_) => "tower-redlock",
            Locker::Rslock(_) => "rslock 0.10",
            #[cfg(feature = "cluster-async")]
            Locker::ClusterFloor(_) => "floor (redis-rs)",
        }
    }

    /// Acquires and releases `resource`; false if either step failed.
    async fn cycle(&self, resource: &str) -> bool {
        match self {
            Locker::Floor(floor) => floor.cycle(resource).await,
            Locker::Crate(redlock) => crate_cycle(redlock, resource).await,
            Locker::Rslock(manager) => rslock_cycle(manager, resource).await,
            #[cfg(feature = "cluster-async")]
            Locker::ClusterFloor(floor) => floor.cycle(resource).await,
        }
    }
}

/// A resource name not used before in this run.
fn next_resource() -> String {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    format!("cycle:{}", NEXT.fetch_add(1, Ordering::Relaxed))
}

/// Measures the three lockers on `urls`; returns the floor's serial p50.
async fn lock_cycle(
    plan: &Plan,
    urls: &[String],
    table: &mut Table,
    misses: &mut Vec<String>,
) -> Duration {
    let n = urls.len();
    let redlock = redlock(urls).await;
    let lockers = [
        Arc::new(Locker::Floor(Floor::connect(urls).await)),
        Arc::new(Locker::Crate(redlock)),
        Arc::new(Locker::Rslock(rslock::LockManager::new(urls.to_vec()))),
    ];

    // Serial latency: one cycle of each locker in turn, the order rotating, so that slow
    // drifts of the machine (and of the scheduler's placement of tasks) hit all alike.
    let mut serial: Vec<Samples> = lockers.iter().map(|_| Samples::default()).collect();
    for locker in &lockers {
        for _ in 0..plan.serial_warmup {
            locker.cycle(&next_resource()).await;
        }
    }
    for i in 0..plan.serial_iters {
        for j in 0..lockers.len() {
            let k = (i + j) % lockers.len();
            let resource = next_resource();
            let start = Instant::now();
            let ok = lockers[k].cycle(&resource).await;
            serial[k].record(start.elapsed(), ok);
        }
    }
    if std::env::var_os("BENCH_DEBUG").is_some() {
        for (locker, samples) in lockers.iter().zip(&mut serial) {
            let ps: Vec<String> = [10.0, 25.0, 50.0, 75.0, 90.0, 99.0]
                .iter()
                .map(|p| fmt_duration(samples.percentile(*p)))
                .collect();
            eprintln!("{} x{n}: p10..p99 {}", locker.name(), ps.join(" "));
        }
    }

    // Throughput with 64 tasks, in interleaved rounds.
    let mut rates: Vec<Rate> = lockers.iter().map(|_| Rate::default()).collect();
    for _ in 0..plan.rounds {
        for (locker, rate) in lockers.iter().zip(&mut rates) {
            let (count, errors) = cycle_round(locker, plan.warmup, plan.round_time()).await;
            rate.record(count, errors, plan.round_time());
        }
    }

    if std::env::var_os("BENCH_DEBUG").is_some() {
        for (locker, rate) in lockers.iter().zip(&rates) {
            let rounds: Vec<String> = rate.rounds.iter().map(|r| format!("{r:.0}")).collect();
            eprintln!(
                "{} x{n}: cycles/s per round {}",
                locker.name(),
                rounds.join(" ")
            );
        }
    }
    let floor_p50 = serial[0].percentile(50.0);
    let p50_max = if n == 1 {
        CYCLE_P50_MAX_1
    } else {
        CYCLE_P50_MAX_3
    };
    table.section(&format!(
        "1. lock cycle (acquire + release, distinct keys), {n} node{}: serial p50/p99 over {} cycles; rate with {LOCK_TASKS} tasks over {:.1} s",
        if n == 1 { "" } else { "s" },
        plan.serial_iters,
        plan.duration.as_secs_f64(),
    ));
    for (i, locker) in lockers.iter().enumerate() {
        let p50 = serial[i].percentile(50.0);
        let rate = rates[i].per_second();
        let mut targets = Vec::new();
        if matches!(**locker, Locker::Crate(_)) {
            targets.push(judge(
                misses,
                &format!("cycle {n} node: serial p50 <= {p50_max:.2}x floor"),
                ratio(p50, floor_p50),
                Bound::AtMost(p50_max),
            ));
            targets.push(judge(
                misses,
                &format!("cycle {n} node: rate >= {CYCLE_RATE_MIN_VS_FLOOR:.2}x floor"),
                rates[i].paired_ratio(&rates[0]),
                Bound::AtLeast(CYCLE_RATE_MIN_VS_FLOOR),
            ));
            targets.push(judge(
                misses,
                &format!("cycle {n} node: rate >= {CYCLE_RATE_MIN_VS_RSLOCK:.2}x rslock"),
                rates[i].paired_ratio(&rates[2]),
                Bound::AtLeast(CYCLE_RATE_MIN_VS_RSLOCK),
            ));
        }
        table.row(Row {
            case: locker.name().to_owned(),
            nodes: n.to_string(),
            p50: Some(p50),
            p99: Some(serial[i].percentile(99.0)),
            rate: Some(rate),
            p50_ratio: Some(ratio(p50, floor_p50)),
            rate_ratio: Some(rates[i].paired_ratio(&rates[0])),
            spread: Some(rates[i].spread()),
            errors: serial[i].errors + rates[i].errors,
            notes: targets.join("; "),
        });
    }
    floor_p50
}

/// Runs 64 tasks doing lock cycles: `warmup`, then `measure`; returns the cycles that
/// started and ended within `measure`, and the failures.
async fn cycle_round(locker: &Arc<Locker>, warmup: Duration, measure: Duration) -> (u64, u64) {
    let begin = Instant::now() + warmup;
    let end = begin + measure;
    let tasks: Vec<_> = (0..LOCK_TASKS)
        .map(|_| {
            let locker = locker.clone();
            tokio::spawn(async move {
                let (mut count, mut errors) = (0u64, 0u64);
                loop {
                    let start = Instant::now();
                    if start >= end {
                        break;
                    }
                    let ok = locker.cycle(&next_resource()).await;
                    if start >= begin {
                        count += 1;
                        errors += u64::from(!ok);
                    }
                }
                (count, errors)
            })
        })
        .collect();
    let mut total = (0, 0);
    for task in tasks {
        let (count, errors) = task.await.expect("cycle task");
        total.0 += count;
        total.1 += errors;
    }
    total
}

// ---------------------------------------------------------------------------------------
// 2. HTTP
// ---------------------------------------------------------------------------------------

fn next_key() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

/// Drives `addr` with `workers` connections: `warmup`, then `measure`; returns the
/// latencies of the requests that started within `measure`, and the non-200 answers.
async fn http_round(
    addr: SocketAddr,
    workers: usize,
    warmup: Duration,
    measure: Duration,
) -> (Vec<u64>, u64) {
    let mut senders = Vec::with_capacity(workers);
    for _ in 0..workers {
        senders.push(connect(addr).await);
    }
    let begin = Instant::now() + warmup;
    let end = begin + measure;
    let tasks: Vec<_> = senders
        .into_iter()
        .map(|mut sender| {
            tokio::spawn(async move {
                let mut latencies = Vec::with_capacity(64 * 1024);
                let mut errors = 0u64;
                loop {
                    let start = Instant::now();
                    if start >= end {
                        break;
                    }
                    let status = post_key(&mut sender, next_key()).await;
                    if start >= begin {
                        latencies.push(nanos(start.elapsed()));
                        errors += u64::from(status != StatusCode::OK);
                    }
                }
                (latencies, errors)
            })
        })
        .collect();
    let mut all = Vec::new();
    let mut errors = 0;
    for task in tasks {
        let (latencies, e) = task.await.expect("HTTP worker");
        all.extend(latencies);
        errors += e;
    }
    (all, errors)
}

/// One HTTP case: a name, the nodes, the address, and for the layer on Redis the index
/// of the floor case to judge its added latency against.
struct HttpCase {
    name: &'static str,
    nodes: &'static str,
    addr: SocketAddr,
    floor: Option<usize>,
}

/// The index of the pass-through layer among the HTTP cases.
const PASS_THROUGH: usize = 6;

async fn http(
    plan: &Plan,
    urls: &[String],
    serial_floor_p50: [Option<Duration>; 2],
    table: &mut Table,
    misses: &mut Vec<String>,
) {
    let memory = Locks::from(MemoryLocks::new());
    let one = redlock(&urls[..1]).await;
    let three = redlock(urls).await;
    let floor_one = Arc::new(Floor::connect(&urls[..1]).await);
    let floor_three = Arc::new(Floor::connect(urls).await);
    let layer = |locks: &Locks| LockLayer::by_header("Idempotency-Key").backend(locks.clone());
    let base = || Router::new().route("/", post(ok_handler));
    let cases = [
        HttpCase {
            name: "no layer",
            nodes: "-",
            addr: serve(base()).await,
            floor: None,
        },
        HttpCase {
            name: "LockLayer, in-process",
            nodes: "-",
            addr: serve(base().layer(layer(&memory))).await,
            floor: None,
        },
        HttpCase {
            name: "floor cycle in handler",
            nodes: "1",
            addr: serve(floor_app(floor_one)).await,
            floor: None,
        },
        HttpCase {
            name: "LockLayer, Redlock",
            nodes: "1",
            addr: serve(base().layer(layer(&one))).await,
            floor: Some(2),
        },
        HttpCase {
            name: "floor cycle in handler",
            nodes: "3",
            addr: serve(floor_app(floor_three)).await,
            floor: None,
        },
        HttpCase {
            name: "LockLayer, Redlock",
            nodes: "3",
            addr: serve(base().layer(layer(&three))).await,
            floor: Some(4),
        },
        // What any layer that wraps the response body costs under `Router::layer`, for
        // scale: tower-http's `MapResponseBodyLayer` with a wrapper that does nothing.
        HttpCase {
            name: "pass-through layer",
            nodes: "-",
            addr: serve(base().layer(MapResponseBodyLayer::new(|body: Body| body.map_err(|e| e))))
                .await,
            floor: None,
        },
    ];

    for (workers, duration) in [(HTTP_WORKERS, plan.duration), (1, plan.duration / 2)] {
        let round_time = duration / u32::try_from(plan.rounds).unwrap_or(1);
        let mut samples: Vec<Samples> = cases.iter().map(|_| Samples::default()).collect();
        let mut rates: Vec<Rate> = cases.iter().map(|_| Rate::default()).collect();
        for _ in 0..plan.rounds {
            for (case, (samples, rate)) in cases.iter().zip(samples.iter_mut().zip(&mut rates)) {
                let (latencies, errors) =
                    http_round(case.addr, workers, plan.warmup, round_time).await;
                rate.record(latencies.len() as u64, errors, round_time);
                samples.extend(latencies, errors);
            }
        }
        table.section(&format!(
            "2. HTTP, {workers} keep-alive connection{} for {:.1} s: a POST with a distinct Idempotency-Key per request; ratios to no layer",
            if workers == 1 { "" } else { "s" },
            duration.as_secs_f64(),
        ));
        let base_p50 = samples[0].percentile(50.0);
        let added: Vec<Duration> = samples
            .iter_mut()
            .map(|s| s.percentile(50.0).saturating_sub(base_p50))
            .collect();
        for (i, case) in cases.iter().enumerate() {
            let p50 = samples[i].percentile(50.0);
            let rate = rates[i].per_second();
            let mut notes = Vec::new();
            if i == 1 && workers == HTTP_WORKERS {
                notes.push(judge(
                    misses,
                    &format!("HTTP in-process: req/s >= {HTTP_MEMORY_RATE_MIN:.2}x no layer"),
                    rates[i].paired_ratio(&rates[0]),
                    Bound::AtLeast(HTTP_MEMORY_RATE_MIN),
                ));
                notes.push(format!(
                    "{:.3}x the pass-through layer",
                    rates[i].paired_ratio(&rates[PASS_THROUGH])
                ));
            }
            if i == PASS_THROUGH {
                notes.push(
                    "tower-http's MapResponseBodyLayer, a body wrapper that does nothing"
                        .to_owned(),
                );
            }
            if case.name.starts_with("floor") {
                notes.push(format!("adds {} p50: the floor", fmt_duration(added[i])));
            }
            if let Some(floor) = case.floor {
                notes.push(format!(
                    "adds {} p50 vs the floor's {}: {}",
                    fmt_duration(added[i]),
                    fmt_duration(added[floor]),
                    judge(
                        misses,
                        &format!(
                            "HTTP {} node, {workers} connection{}: added p50 <= {HTTP_ADDED_P50_MAX:.2}x the floor's",
                            case.nodes,
                            if workers == 1 { "" } else { "s" },
                        ),
                        ratio(added[i], added[floor]),
                        Bound::AtMost(HTTP_ADDED_P50_MAX),
                    )
                ));
                let serial = serial_floor_p50[usize::from(case.nodes != "1")];
                if let (1, Some(serial)) = (workers, serial) {
                    notes.push(format!(
                        "{:.2}x the serial floor cycle of section 1 ({})",
                        ratio(added[i], serial),
                        fmt_duration(serial)
                    ));
                }
            }
            table.row(Row {
                case: case.name.to_owned(),
                nodes: case.nodes.to_owned(),
                p50: Some(p50),
                p99: Some(samples[i].percentile(99.0)),
                rate: Some(rate),
                p50_ratio: Some(ratio(p50, base_p50)),
                rate_ratio: Some(if i == 0 {
                    1.0
                } else {
                    rates[i].paired_ratio(&rates[0])
                }),
                spread: Some(rates[i].spread()),
                errors: samples[i].errors,
                notes: notes.join("; "),
            });
        }
    }
}

// ---------------------------------------------------------------------------------------
// 3. Hot key
// ---------------------------------------------------------------------------------------

#[derive(Default)]
struct Running {
    now: AtomicUsize,
    max: AtomicUsize,
}

/// Sends `HOT_REQUESTS` requests with Idempotency-Key `key` at once, each on its own
/// connection (opened beforehand); returns each status and time to the answer.
async fn burst(addr: SocketAddr, key: u64) -> Vec<(StatusCode, Duration)> {
    let mut senders = Vec::with_capacity(HOT_REQUESTS);
    for _ in 0..HOT_REQUESTS {
        senders.push(connect(addr).await);
    }
    let barrier = Arc::new(tokio::sync::Barrier::new(HOT_REQUESTS));
    let tasks: Vec<_> = senders
        .into_iter()
        .map(|mut sender| {
            let barrier = barrier.clone();
            tokio::spawn(async move {
                sender.ready().await.expect("connection ready");
                barrier.wait().await;
                let start = Instant::now();
                let status = post_key(&mut sender, key).await;
                (status, start.elapsed())
            })
        })
        .collect();
    let mut answers = Vec::with_capacity(HOT_REQUESTS);
    for task in tasks {
        answers.push(task.await.expect("hot-key request"));
    }
    answers
}

/// Every command the nodes at `urls` ran so far (`INFO commandstats`, commands run inside
/// scripts included), without `INFO` itself and the connection handshakes of the count.
async fn redis_commands(urls: &[String]) -> u64 {
    let mut total = 0;
    for url in urls {
        let client = redis::Client::open(url.as_str()).expect("a valid Redis URL");
        let mut conn = client
            .get_multiplexed_async_connection()
            .await
            .expect("connect to the bench's Redis node");
        let info: String = redis::cmd("INFO")
            .arg("commandstats")
            .query_async(&mut conn)
            .await
            .expect("INFO commandstats");
        total += info
            .lines()
            .filter_map(|line| {
                let (name, rest) = line.strip_prefix("cmdstat_")?.split_once(":calls=")?;
                let skip = name == "info"
                    || name == "hello"
                    || name == "ping"
                    || name.starts_with("client");
                let calls: u64 = rest.split(',').next()?.parse().ok()?;
                (!skip).then_some(calls)
            })
            .sum::<u64>();
    }
    total
}

/// An app whose handler holds the key `HOT_HOLD`, counting how many run at once.
fn hot_app(locks: Locks, running: Arc<Running>) -> Router {
    Router::new()
        .route(
            "/",
            post(move || {
                let running = running.clone();
                async move {
                    let now = running.now.fetch_add(1, Ordering::SeqCst) + 1;
                    running.max.fetch_max(now, Ordering::SeqCst);
                    tokio::time::sleep(HOT_HOLD).await;
                    running.now.fetch_sub(1, Ordering::SeqCst);
                    "done"
                }
            }),
        )
        .layer(LockLayer::by_header("Idempotency-Key").backend(locks))
}

/// The outcome of a hot-key case's waves.
#[derive(Default)]
struct HotCase {
    losers: Samples,
    won: usize,
    conflicts: usize,
    other: usize,
    /// Redis commands over all waves, when the backend is Redis.
    commands: Option<u64>,
}

impl HotCase {
    fn count(&mut self, answers: Vec<(StatusCode, Duration)>) {
        for (status, elapsed) in answers {
            match status {
                StatusCode::OK => self.won += 1,
                StatusCode::CONFLICT => {
                    self.conflicts += 1;
                    self.losers.record(elapsed, true);
                }
                _ => self.other += 1,
            }
        }
    }

    fn per_rejection(&self) -> Option<f64> {
        self.commands
            .map(|c| c as f64 / self.conflicts.max(1) as f64)
    }
}

async fn hot_key(plan: &Plan, urls: &[String], table: &mut Table, misses: &mut Vec<String>) {
    table.section(&format!(
        "3. hot key: {HOT_REQUESTS} requests at once on one Idempotency-Key, handler holds it {} ms; p50/p99 are the losers' time to their 409; Redis commands per 409 from INFO commandstats (script-run commands included)",
        HOT_HOLD.as_millis()
    ));

    // Baseline: the same burst on an instant handler without the layer, for what answering
    // 200 requests at once costs on this machine anyway.
    let addr = serve(Router::new().route("/", post(ok_handler))).await;
    let mut all = Samples::default();
    for wave in 0..plan.hot_waves {
        for (status, elapsed) in burst(addr, 2_000_000_000 + wave as u64).await {
            all.record(elapsed, status == StatusCode::OK);
        }
    }
    table.row(Row {
        case: "burst, no layer".to_owned(),
        nodes: "-".to_owned(),
        p50: Some(all.percentile(50.0)),
        p99: Some(all.percentile(99.0)),
        rate: None,
        p50_ratio: None,
        rate_ratio: None,
        spread: None,
        errors: all.errors,
        notes: "baseline: every request's time to its 200, instant handler".to_owned(),
    });

    // The holder local: the burst's own winner holds the key in the app's process.
    let backends = [
        ("in-process", "-", None),
        ("Redlock", "1", Some(&urls[..1])),
        ("Redlock", "3", Some(urls)),
    ];
    let mut memory_p50 = None;
    for (name, nodes, redis) in backends {
        let locks = match redis {
            Some(urls) => redlock(urls).await,
            None => Locks::from(MemoryLocks::new()),
        };
        let running = Arc::new(Running::default());
        let addr = serve(hot_app(locks, running.clone())).await;
        let mut case = HotCase::default();
        for wave in 0..plan.hot_waves {
            let before = match redis {
                Some(urls) => Some(redis_commands(urls).await),
                None => None,
            };
            case.count(burst(addr, 1_000_000_000 + wave as u64).await);
            if let (Some(urls), Some(before)) = (redis, before) {
                // Let the winner's release land before counting.
                tokio::time::sleep(Duration::from_millis(50)).await;
                let spent = redis_commands(urls).await.saturating_sub(before);
                *case.commands.get_or_insert(0) += spent;
            }
        }
        let max = running.max.load(Ordering::SeqCst);
        assert_eq!(
            max, 1,
            "hot key on {name} ({nodes} nodes): {max} handlers ran at once; the lock must allow one"
        );
        let p50 = case.losers.percentile(50.0);
        let mut notes = vec![format!(
            "{} wave{}: {} x 200, {} x 409, {} other; at most {max} handler at once (asserted 1)",
            plan.hot_waves,
            if plan.hot_waves == 1 { "" } else { "s" },
            case.won,
            case.conflicts,
            case.other,
        )];
        let mut p50_ratio = None;
        match memory_p50 {
            None => memory_p50 = Some(p50),
            Some(memory) => {
                p50_ratio = Some(ratio(p50, memory));
                notes.push(format!(
                    "losers' p50 vs in-process: {}",
                    judge(
                        misses,
                        &format!("hot key, Redlock {nodes} node(s): losers' p50 <= {HOT_P50_MAX:.2}x in-process"),
                        ratio(p50, memory),
                        Bound::AtMost(HOT_P50_MAX),
                    )
                ));
            }
        }
        if let Some(per) = case.per_rejection() {
            notes.push(format!(
                "{per:.3} Redis commands per 409, the winner's acquisition and release included"
            ));
        }
        table.row(Row {
            case: format!("hot key, {name}"),
            nodes: nodes.to_owned(),
            p50: Some(p50),
            p99: Some(case.losers.percentile(99.0)),
            rate: None,
            p50_ratio,
            rate_ratio: None,
            spread: None,
            errors: case.other as u64,
            notes: notes.join("; "),
        });
    }

    // The holder in the app's process (`local`) or in another client, another replica
    // (`remote`): it takes the key before the burst and holds it throughout, so that
    // every request of the burst is rejected, and the commands counted are the rejected
    // requests' own.
    for (nodes, urls, remote) in [
        ("1", &urls[..1], false),
        ("3", urls, false),
        ("1", &urls[..1], true),
        ("3", urls, true),
    ] {
        let app_side = redlock(urls).await;
        let holder_side = if remote {
            redlock(urls).await
        } else {
            app_side.clone()
        };
        let running = Arc::new(Running::default());
        let addr = serve(hot_app(app_side, running)).await;
        let mut case = HotCase::default();
        for wave in 0..plan.hot_waves {
            let value = 3_000_000_000 + 10 * wave as u64 + u64::from(remote);
            // The key the layer takes for the request: the header name, the method and
            // the route, then the value.
            let lease = holder_side
                .try_lock(&format!("idempotency-key POST /:{value}"))
                .await
                .expect("the holder takes the key");
            let before = redis_commands(urls).await;
            case.count(burst(addr, value).await);
            let spent = redis_commands(urls).await.saturating_sub(before);
            *case.commands.get_or_insert(0) += spent;
            holder_side.unlock(lease).await.expect("release");
        }
        let per = case.per_rejection().unwrap_or(f64::NAN);
        let (bound, pass, target) = if remote {
            let bound = urls.len() as f64;
            (bound, per <= bound, format!("<= {bound:.0}, one per node"))
        } else {
            (
                HOT_LOCAL_COMMANDS_MAX,
                per < HOT_LOCAL_COMMANDS_MAX,
                format!("< {HOT_LOCAL_COMMANDS_MAX}"),
            )
        };
        let holder = if remote { "in another client" } else { "local" };
        let verdict = if pass {
            "PASS"
        } else {
            misses.push(format!(
                "hot key, Redlock {nodes} node(s), holder {holder}: {per:.3} Redis commands per 409 (bound {bound})"
            ));
            "MISS"
        };
        let p50 = case.losers.percentile(50.0);
        table.row(Row {
            case: format!("hot key, Redlock, holder {holder}, taken before"),
            nodes: nodes.to_owned(),
            p50: Some(p50),
            p99: Some(case.losers.percentile(99.0)),
            rate: None,
            p50_ratio: memory_p50.map(|memory| ratio(p50, memory)),
            rate_ratio: None,
            spread: None,
            errors: (case.other + case.won) as u64,
            notes: format!(
                "{} x 409, {} x 200, {} other; {per:.3} Redis commands per 409 (target {target}) {verdict}",
                case.conflicts, case.won, case.other,
            ),
        });
    }
}

// ---------------------------------------------------------------------------------------
// Statistics and the table
// ---------------------------------------------------------------------------------------

/// Latencies in nanoseconds.
#[derive(Default)]
struct Samples {
    nanos: Vec<u64>,
    errors: u64,
    sorted: bool,
}

impl Samples {
    fn record(&mut self, elapsed: Duration, ok: bool) {
        self.nanos.push(nanos(elapsed));
        self.errors += u64::from(!ok);
        self.sorted = false;
    }

    fn extend(&mut self, nanos: Vec<u64>, errors: u64) {
        self.nanos.extend(nanos);
        self.errors += errors;
        self.sorted = false;
    }

    /// Nearest-rank percentile; zero without samples.
    fn percentile(&mut self, p: f64) -> Duration {
        if self.nanos.is_empty() {
            return Duration::ZERO;
        }
        if !self.sorted {
            self.nanos.sort_unstable();
            self.sorted = true;
        }
        let rank = ((p / 100.0) * self.nanos.len() as f64).ceil() as usize;
        Duration::from_nanos(self.nanos[rank.clamp(1, self.nanos.len()) - 1])
    }
}

/// Operations per second, per round.
#[derive(Default)]
struct Rate {
    rounds: Vec<f64>,
    count: u64,
    time: Duration,
    errors: u64,
}

impl Rate {
    fn record(&mut self, count: u64, errors: u64, time: Duration) {
        self.rounds.push(count as f64 / time.as_secs_f64());
        self.count += count;
        self.time += time;
        self.errors += errors;
    }

    fn per_second(&self) -> f64 {
        self.count as f64 / self.time.as_secs_f64()
    }

    /// The median over the rounds of this rate against `base`'s in the same round: rounds
    /// run back to back, so a drift of the machine (or of the scheduler's placement of
    /// tasks, which can shift a whole round by a third) cancels out of each ratio.
    fn paired_ratio(&self, base: &Rate) -> f64 {
        let mut ratios: Vec<f64> = self
            .rounds
            .iter()
            .zip(&base.rounds)
            .map(|(rate, base)| rate / base)
            .collect();
        ratios.sort_unstable_by(f64::total_cmp);
        match ratios.len() {
            0 => f64::NAN,
            n if n % 2 == 1 => ratios[n / 2],
            n => (ratios[n / 2 - 1] + ratios[n / 2]) / 2.0,
        }
    }

    /// (max - min) / mean over the rounds.
    fn spread(&self) -> f64 {
        let max = self.rounds.iter().copied().fold(f64::MIN, f64::max);
        let min = self.rounds.iter().copied().fold(f64::MAX, f64::min);
        let mean = self.rounds.iter().sum::<f64>() / self.rounds.len() as f64;
        (max - min) / mean
    }
}

fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

fn ratio(a: Duration, b: Duration) -> f64 {
    a.as_secs_f64() / b.as_secs_f64()
}

enum Bound {
    AtMost(f64),
    AtLeast(f64),
}

/// "1.031x (<=1.05x) PASS" or "0.853x (>=0.90x) MISS"; a miss is also added to `misses`
/// under `name`.
fn judge(misses: &mut Vec<String>, name: &str, measured: f64, bound: Bound) -> String {
    let (pass, sign, limit) = match bound {
        Bound::AtMost(limit) => (measured <= limit, "<=", limit),
        Bound::AtLeast(limit) => (measured >= limit, ">=", limit),
    };
    let verdict = if pass { "PASS" } else { "MISS" };
    if !pass {
        misses.push(format!("{name}: measured {measured:.3}x"));
    }
    // Three decimals, so that a verdict on the edge does not read as 0.90x < 0.90x.
    format!("{measured:.3}x ({sign}{limit:.2}x) {verdict}")
}

fn fmt_duration(d: Duration) -> String {
    let us = d.as_secs_f64() * 1e6;
    if us >= 10_000.0 {
        format!("{:.1} ms", us / 1000.0)
    } else {
        format!("{us:.1} µs")
    }
}

struct Row {
    case: String,
    nodes: String,
    p50: Option<Duration>,
    p99: Option<Duration>,
    rate: Option<f64>,
    p50_ratio: Option<f64>,
    rate_ratio: Option<f64>,
    spread: Option<f64>,
    errors: u64,
    notes: String,
}

#[derive(Default)]
struct Table {
    lines: Vec<Line>,
}

enum Line {
    Section(String),
    Row(Row),
}

impl Table {
    fn section(&mut self, title: &str) {
        self.lines.push(Line::Section(title.to_owned()));
    }

    fn row(&mut self, row: Row) {
        self.lines.push(Line::Row(row));
    }

    /// Adds the share of CPU time other processes took to the sections from line `first`.
    fn note_noise(&mut self, first: usize, share: Option<f64>) {
        for line in &mut self.lines[first..] {
            if let Line::Section(title) = line {
                title.push_str(&format!(" [other processes: {} CPU]", fmt_share(share)));
            }
        }
    }

    fn print(&self) {
        let header = [
            "case",
            "nodes",
            "p50",
            "p99",
            "ops/s",
            "p50 ratio",
            "ops/s ratio",
            "spread",
            "errors",
            "targets and notes",
        ];
        let cells: Vec<Option<[String; 10]>> = self
            .lines
            .iter()
            .map(|line| match line {
                Line::Section(_) => None,
                Line::Row(row) => Some([
                    row.case.clone(),
                    row.nodes.clone(),
                    row.p50.map(fmt_duration).unwrap_or_default(),
                    row.p99.map(fmt_duration).unwrap_or_default(),
                    row.rate.map(|r| format!("{r:.0}")).unwrap_or_default(),
                    row.p50_ratio
                        .map(|r| format!("{r:.2}x"))
                        .unwrap_or_default(),
                    row.rate_ratio
                        .map(|r| format!("{r:.2}x"))
                        .unwrap_or_default(),
                    row.spread
                        .map(|s| format!("{:.1}%", s * 100.0))
                        .unwrap_or_default(),
                    row.errors.to_string(),
                    row.notes.clone(),
                ]),
            })
            .collect();
        let mut widths = header.map(|h| h.chars().count());
        for row in cells.iter().flatten() {
            for (width, cell) in widths.iter_mut().zip(row) {
                *width = (*width).max(cell.chars().count());
            }
        }
        let render = |row: &[String]| {
            let mut line = String::new();
            for (i, (cell, width)) in row.iter().zip(widths).enumerate() {
                let pad = width - cell.chars().count();
                if i == row.len() - 1 {
                    line.push_str(cell);
                } else if i <= 1 {
                    line.push_str(cell);
                    line.push_str(&" ".repeat(pad + 2));
                } else {
                    line.push_str(&" ".repeat(pad));
                    line.push_str(cell);
                    line.push_str("  ");
                }
            }
            line.trim_end().to_owned()
        };
        let header_line = render(&header.map(str::to_owned));
        let rule = "-".repeat(header_line.chars().count().min(200));
        println!("{header_line}");
        for (line, cells) in self.lines.iter().zip(&cells) {
            match (line, cells) {
                (Line::Section(title), _) => {
                    println!("{rule}");
                    println!("{title}");
                }
                (Line::Row(_), Some(cells)) => println!("{}", render(cells)),
                (Line::Row(_), None) => {}
            }
        }
    }
}

/// CPU time of the whole machine against that of this process and its Redis nodes, from
/// /proc (Linux); the difference is other work, the noise of a measurement.
#[derive(Clone, Copy)]
struct CpuSnapshot {
    /// Busy and total ticks of all CPUs.
    busy: u64,
    total: u64,
    /// Ticks of this process and the Redis nodes.
    own: u64,
}

impl CpuSnapshot {
    fn take(pids: &[u32]) -> Option<Self> {
        let stat = std::fs::read_to_string("/proc/stat").ok()?;
        let ticks: Vec<u64> = stat
            .lines()
            .next()?
            .split_whitespace()
            .skip(1)
            .take(8)
            .map(|t| t.parse().unwrap_or(0))
            .collect();
        let total = ticks.iter().sum();
        // user nice system idle iowait irq softirq steal
        let busy = total - ticks.get(3)? - ticks.get(4)?;
        let mut own = process_ticks("/proc/self/stat")?;
        for pid in pids {
            own += process_ticks(&format!("/proc/{pid}/stat"))?;
        }
        Some(CpuSnapshot { busy, total, own })
    }

    /// The share of the machine's CPU time used by other processes since `self`.
    fn foreign_since(self, pids: &[u32]) -> Option<f64> {
        let now = Self::take(pids)?;
        let total = now.total.checked_sub(self.total).filter(|t| *t > 0)?;
        let foreign = (now.busy - self.busy).saturating_sub(now.own - self.own);
        Some(foreign as f64 / total as f64)
    }
}

/// utime + stime of a process, in clock ticks.
fn process_ticks(path: &str) -> Option<u64> {
    let stat = std::fs::read_to_string(path).ok()?;
    let fields: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
    Some(fields.get(11)?.parse::<u64>().ok()? + fields.get(12)?.parse::<u64>().ok()?)
}

fn fmt_share(share: Option<f64>) -> String {
    share.map_or_else(|| "?".to_owned(), |s| format!("{:.0}%", s * 100.0))
}
