//! Round trips per request: each layer on Redis nodes behind a fixed network delay, its
//! latency counted in Redis round trips and set beside the fewest it could take.
//!
//! Every `redis-server` sits behind a proxy that delays each direction by `DELAY_MS`
//! (default 2 ms: a round trip of about 4 ms, see `benches/common/delay.rs`). The unit is
//! that round trip as measured: the p50 of plain redis-rs `PING`s through the proxy, `N`
//! at the start and `N / 4` before each case, pooled, so that a burst of other work on the
//! machine during one of them does not set the scale of every row (the range of the
//! batches' p50s is printed).
//! Each case then sends `N` requests over HTTP/1.1 (keep-alive, one at a time, so the
//! latencies are serial) to an axum app on loopback with the layer on the delayed nodes,
//! and the table gives the p50 and the p90 in round trips, the physical limit (the round
//! trips the layer cannot do without), their ratio, and the Redis commands per request
//! (`INFO commandstats` on the case's nodes before and after, commands run inside scripts
//! included, summed over the nodes).
//!
//! Cases, on 1 and on 3 nodes where the backend takes several (a `Redlock`; the rate and
//! concurrency limiters use one node):
//! - `no-layer`: the HTTP request alone, what loopback HTTP adds to every other row;
//! - `lock-cycle`: `LockLayer::by_header`, a new key per request (acquire, release: 2);
//! - `lock-refused`: the key held by another client (another `Redlock`), answered 409 (1);
//! - `lock-fenced`: the lock cycle on a `Redlock` with fencing tokens (2);
//! - `idempotency-first`: `IdempotencyLayer`, a new key per request (look up and lock,
//!   store and release: 2);
//! - `idempotency-replay`: the same key again, the stored response replayed (1);
//! - `rate-fixed`, `rate-gcra`: `RateLimitLayer::by_header` on a `RedisRateLimiter`, a
//!   fixed window and GCRA, a quota never reached (1);
//! - `concurrency`: `ConcurrencyLimitLayer::by_header` on a `RedisConcurrencyLimiter`, a
//!   limit never reached (acquire, release: 2).
//!
//! The proxies add a little to each hop (a thread or two woken when a chunk is due: the
//! unit came out at about 4.4 ms for 2 ms each way on two busy cores), alike for the `PING`
//! and for the layers' commands; loopback HTTP adds the `no-layer` row (about 20 µs, under
//! a hundredth of a round trip at 2 ms each way).
//!
//! `bash scripts/roundtrips` builds and runs it (`cargo bench -p extras --bench
//! roundtrips`); env: `DELAY_MS` (each way, default 2, fractions allowed), `N` (requests
//! per case and PINGs for the unit, default 200), `WARMUP` (requests per case before
//! measuring, default 20). Words after `--` run only the cases whose name contains one of
//! them (`no-layer` always runs). Prints figures only, no targets. It starts its own
//! `redis-server` processes (3, on free loopback ports, without persistence) and stops them
//! at the end.

// A benchmark stops on a failed setup or a result it did not expect.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing,
    clippy::panic
)]

#[path = "common/mod.rs"]
mod common;
#[path = "common/delay.rs"]
mod delay;
#[path = "../tests/support/mod.rs"]
mod support;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use axum::Router;
use axum::routing::post;
use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::{BodyExt, Empty};
use hyper::client::conn::http1::SendRequest;
use tower_redlock::{
    ConcurrencyLimitLayer, IdempotencyLayer, LockLayer, Locks, Quota, RateLimitLayer,
    RedisConcurrencyLimiter, RedisRateLimiter, Redlock,
};

use delay::{DelayProxy, Timer};
use support::RedisNode;

/// The header every layer but `IdempotencyLayer` takes its key from.
const KEY_HEADER: &str = "x-key";
/// The lock layers' scope, so that the key another client holds is known: `bench:{value}`.
const SCOPE: &str = "bench";

struct Settings {
    delay: Duration,
    n: usize,
    warmup: usize,
    words: Vec<String>,
}

impl Settings {
    fn from_env() -> Self {
        let number = |name: &str, default: f64| -> f64 {
            std::env::var(name)
                .ok()
                .filter(|v| !v.is_empty())
                .map_or(default, |v| {
                    v.parse()
                        .unwrap_or_else(|_| panic!("{name}={v} is not a number"))
                })
        };
        let delay_ms = number("DELAY_MS", 2.0);
        assert!(delay_ms >= 0.0, "DELAY_MS must not be negative");
        Settings {
            delay: Duration::from_secs_f64(delay_ms / 1000.0),
            n: (number("N", 200.0) as usize).max(1),
            warmup: number("WARMUP", 20.0) as usize,
            // `cargo bench` passes `--bench`; other words pick cases.
            words: std::env::args()
                .skip(1)
                .filter(|a| !a.starts_with('-'))
                .collect(),
        }
    }

    fn selected(&self, case: &str) -> bool {
        case == "no-layer" || self.words.is_empty() || self.words.iter().any(|w| case.contains(w))
    }
}

/// How a case picks the key of each request.
#[derive(Clone)]
enum Keys {
    /// A new key per request.
    Fresh,
    /// The same key every time.
    Fixed(String),
}

struct Case {
    name: &'static str,
    nodes: usize,
    /// The round trips the layer cannot do without; `None` for the request alone.
    limit: Option<u32>,
    app: Router,
    keys: Keys,
    /// Whether a measured request's status is the one the case expects.
    expected: fn(StatusCode) -> bool,
}

struct Measured {
    name: &'static str,
    nodes: usize,
    limit: Option<u32>,
    p50: Duration,
    p90: Duration,
    /// Commands per request, by name, summed over the case's nodes.
    commands: BTreeMap<String, f64>,
}

fn route(layer: impl FnOnce(axum::routing::MethodRouter) -> axum::routing::MethodRouter) -> Router {
    Router::new().route("/", layer(post(common::ok_handler)))
}

fn success(status: StatusCode) -> bool {
    status.is_success()
}

fn refused(status: StatusCode) -> bool {
    status == StatusCode::CONFLICT || status == StatusCode::LOCKED
}

/// POSTs to `/` with the key in both `x-key` and `Idempotency-Key`; the status once the
/// body is read.
async fn send(sender: &mut SendRequest<Empty<Bytes>>, key: &str) -> StatusCode {
    sender.ready().await.expect("connection ready");
    let request = Request::post("/")
        .header(http::header::HOST, "bench")
        .header(KEY_HEADER, key)
        .header("idempotency-key", key)
        .body(Empty::<Bytes>::new())
        .expect("a valid request");
    let response = sender.send_request(request).await.expect("a response");
    let status = response.status();
    let _ = response.into_body().collect().await.expect("the body");
    status
}

/// Nearest-rank percentile of sorted samples.
fn percentile(sorted: &[Duration], p: f64) -> Duration {
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

/// Every command's calls so far, summed over `nodes`.
async fn calls(nodes: &[RedisNode]) -> BTreeMap<String, u64> {
    let mut total = BTreeMap::new();
    for node in nodes {
        for (name, count) in support::command_calls(node).await {
            *total.entry(name).or_insert(0) += count;
        }
    }
    total
}

/// The round trip through a proxy: plain `PING`s on one redis-rs connection, measured
/// in batches over the run and pooled.
struct Unit {
    conn: redis::aio::MultiplexedConnection,
    samples: Vec<Duration>,
    /// Each batch's p50.
    batches: Vec<Duration>,
}

impl Unit {
    async fn connect(url: &str) -> Self {
        let client = redis::Client::open(url).expect("a valid Redis URL");
        let conn = client
            .get_multiplexed_async_connection()
            .await
            .expect("connect to the node");
        Unit {
            conn,
            samples: Vec::new(),
            batches: Vec::new(),
        }
    }

    /// `n` PINGs, after a few unmeasured; the batch's p50 and p90.
    async fn measure(&mut self, n: usize) -> (Duration, Duration) {
        let mut batch = Vec::with_capacity(n);
        for i in 0..n + 5 {
            let start = Instant::now();
            let pong: String = redis::cmd("PING")
                .query_async(&mut self.conn)
                .await
                .expect("PING");
            assert_eq!(pong, "PONG");
            if i >= 5 {
                batch.push(start.elapsed());
            }
        }
        batch.sort_unstable();
        let p = (percentile(&batch, 50.0), percentile(&batch, 90.0));
        self.samples.extend(batch);
        self.batches.push(p.0);
        p
    }

    /// The p50 of every sample so far.
    fn p50(&mut self) -> Duration {
        self.samples.sort_unstable();
        percentile(&self.samples, 50.0)
    }
}

async fn redlock(urls: &[String], fencing: bool) -> Locks {
    Locks::from(
        Redlock::builder(urls)
            .ttl(common::TTL)
            .fencing_tokens(fencing)
            .build()
            .await
            .expect("build the Redlock client"),
    )
}

async fn run(
    case: Case,
    nodes: &[RedisNode],
    settings: &Settings,
    unit: &mut Unit,
    next: &mut u64,
) -> Measured {
    // Before the commands are counted: the PINGs go to the first node.
    unit.measure((settings.n / 4).max(1)).await;
    let addr = common::serve(case.app).await;
    let mut sender = common::connect(addr).await;
    let mut key = || match &case.keys {
        Keys::Fixed(key) => key.clone(),
        Keys::Fresh => {
            *next += 1;
            format!("{}-{next}", case.name)
        }
    };
    // A fixed key is used once before the warm-up, so that even without one every
    // measured request finds what the first left (a stored response to replay).
    let first = usize::from(matches!(case.keys, Keys::Fixed(_)));
    for _ in 0..first + settings.warmup {
        let status = send(&mut sender, &key()).await;
        assert!((case.expected)(status), "{} answered {status}", case.name);
    }
    let before = calls(nodes).await;
    let mut samples = Vec::with_capacity(settings.n);
    for _ in 0..settings.n {
        let key = key();
        let start = Instant::now();
        let status = send(&mut sender, &key).await;
        samples.push(start.elapsed());
        assert!((case.expected)(status), "{} answered {status}", case.name);
    }
    let after = calls(nodes).await;
    let commands = after
        .into_iter()
        .filter_map(|(name, count)| {
            let added = count - before.get(&name).copied().unwrap_or(0);
            (added > 0).then(|| (name, added as f64 / settings.n as f64))
        })
        .collect();
    samples.sort_unstable();
    Measured {
        name: case.name,
        nodes: case.nodes,
        limit: case.limit,
        p50: percentile(&samples, 50.0),
        p90: percentile(&samples, 90.0),
        commands,
    }
}

fn ms(d: Duration) -> String {
    format!("{:.2} ms", d.as_secs_f64() * 1e3)
}

fn in_units(d: Duration, unit: Duration) -> f64 {
    d.as_secs_f64() / unit.as_secs_f64()
}

/// A Markdown table, its columns padded.
fn print_table(header: &[&str], rows: &[Vec<String>]) {
    let mut widths: Vec<usize> = header.iter().map(|h| h.chars().count()).collect();
    for row in rows {
        for (width, cell) in widths.iter_mut().zip(row) {
            *width = (*width).max(cell.chars().count());
        }
    }
    let line = |cells: &[String]| {
        let padded: Vec<String> = cells
            .iter()
            .zip(&widths)
            .map(|(cell, width)| format!("{cell:<width$}"))
            .collect();
        println!("| {} |", padded.join(" | "));
    };
    line(&header.iter().map(|h| (*h).to_owned()).collect::<Vec<_>>());
    line(&widths.iter().map(|w| "-".repeat(*w)).collect::<Vec<_>>());
    for row in rows {
        line(row);
    }
}

fn main() {
    let settings = Settings::from_env();
    let started = Instant::now();
    let nodes = support::nodes(3);

    // The proxies run on a runtime of their own, so that their forwarding never waits for
    // the app or the client (which share the main thread, as the other benches do).
    let proxy_runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .thread_name("delay-proxy")
        .enable_all()
        .build()
        .expect("the proxies' runtime");
    let timer = Timer::start();
    let proxies: Vec<DelayProxy> = nodes
        .iter()
        .map(|node| {
            proxy_runtime.block_on(DelayProxy::start(
                node.addr(),
                settings.delay,
                timer.clone(),
            ))
        })
        .collect();
    let delayed: Vec<String> = proxies.iter().map(DelayProxy::url).collect();
    let direct = support::urls(&nodes);

    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a runtime");
    runtime.block_on(async {
        let (direct_p50, _) = Unit::connect(&direct[0]).await.measure(settings.n).await;
        let mut unit = Unit::connect(&delayed[0]).await;
        let (first_p50, first_p90) = unit.measure(settings.n).await;
        println!(
            "round trips per request: {} each way, N = {} serial requests per case ({} before, \
             unmeasured)",
            ms(settings.delay),
            settings.n,
            settings.warmup
        );
        println!(
            "PING through the proxy p50 {} (p90 {}); straight to the node p50 {:.0} µs",
            ms(first_p50),
            ms(first_p90),
            direct_p50.as_secs_f64() * 1e6
        );

        let mut next = 0u64;
        let mut results = Vec::new();
        let no_layer = Case {
            name: "no-layer",
            nodes: 1,
            limit: None,
            app: route(|r| r),
            keys: Keys::Fresh,
            expected: success,
        };
        results.push(run(no_layer, &nodes[..1], &settings, &mut unit, &mut next).await);

        for n in [1usize, 3] {
            let urls = &delayed[..n];
            let locks = redlock(urls, false).await;
            let fenced = redlock(urls, true).await;
            let lock_layer = |locks: &Locks| {
                LockLayer::by_header(KEY_HEADER)
                    .scope(SCOPE)
                    .backend(locks.clone())
            };

            if settings.selected("lock-cycle") {
                let case = Case {
                    name: "lock-cycle",
                    nodes: n,
                    limit: Some(2),
                    app: route(|r| r.layer(lock_layer(&locks))),
                    keys: Keys::Fresh,
                    expected: success,
                };
                results.push(run(case, &nodes[..n], &settings, &mut unit, &mut next).await);
            }

            if settings.selected("lock-refused") {
                // Another client (another Redlock, straight to the nodes) holds the key.
                let holder = Locks::from(
                    Redlock::builder(&direct[..n])
                        .ttl(Duration::from_secs(600))
                        .build()
                        .await
                        .expect("the holder's Redlock"),
                );
                let held = format!("held-{n}");
                let lease = holder
                    .try_lock(&format!("{SCOPE}:{held}"))
                    .await
                    .expect("take the key first");
                let case = Case {
                    name: "lock-refused",
                    nodes: n,
                    limit: Some(1),
                    app: route(|r| r.layer(lock_layer(&locks))),
                    keys: Keys::Fixed(held),
                    expected: refused,
                };
                results.push(run(case, &nodes[..n], &settings, &mut unit, &mut next).await);
                holder.unlock(lease).await.expect("release the held key");
            }

            if settings.selected("lock-fenced") {
                let case = Case {
                    name: "lock-fenced",
                    nodes: n,
                    limit: Some(2),
                    app: route(|r| r.layer(lock_layer(&fenced))),
                    keys: Keys::Fresh,
                    expected: success,
                };
                results.push(run(case, &nodes[..n], &settings, &mut unit, &mut next).await);
            }

            if settings.selected("idempotency-first") {
                let case = Case {
                    name: "idempotency-first",
                    nodes: n,
                    limit: Some(2),
                    app: route(|r| r.layer(IdempotencyLayer::new().backend(locks.clone()))),
                    keys: Keys::Fresh,
                    expected: success,
                };
                results.push(run(case, &nodes[..n], &settings, &mut unit, &mut next).await);
            }

            if settings.selected("idempotency-replay") {
                let app = route(|r| r.layer(IdempotencyLayer::new().backend(locks.clone())));
                // Stored by the first request, which is not measured.
                let case = Case {
                    name: "idempotency-replay",
                    nodes: n,
                    limit: Some(1),
                    app,
                    keys: Keys::Fixed(format!("replayed-{n}")),
                    expected: success,
                };
                results.push(run(case, &nodes[..n], &settings, &mut unit, &mut next).await);
            }
        }

        // The limiters' stores are one node each.
        let rate = RedisRateLimiter::builder(&delayed[0])
            .build()
            .await
            .expect("a rate limiter");
        let fixed = Quota::new(1_000_000_000, Duration::from_secs(3600)).expect("a quota");
        let gcra = Quota::gcra(1_000_000, Duration::from_secs(3600), 1_000).expect("a quota");
        for (name, quota) in [("rate-fixed", fixed), ("rate-gcra", gcra)] {
            if settings.selected(name) {
                let layer = RateLimitLayer::by_header(KEY_HEADER, quota).backend(rate.clone());
                let case = Case {
                    name,
                    nodes: 1,
                    limit: Some(1),
                    app: route(|r| r.layer(layer)),
                    keys: Keys::Fresh,
                    expected: success,
                };
                results.push(run(case, &nodes[..1], &settings, &mut unit, &mut next).await);
            }
        }
        if settings.selected("concurrency") {
            let limiter = RedisConcurrencyLimiter::builder(&delayed[0])
                .build()
                .await
                .expect("a concurrency limiter");
            let layer = ConcurrencyLimitLayer::by_header(KEY_HEADER, 1_000).backend(limiter);
            let case = Case {
                name: "concurrency",
                nodes: 1,
                limit: Some(2),
                app: route(|r| r.layer(layer)),
                keys: Keys::Fresh,
                expected: success,
            };
            results.push(run(case, &nodes[..1], &settings, &mut unit, &mut next).await);
        }

        let pings = unit.samples.len();
        let lowest = unit.batches.iter().min().copied().unwrap_or_default();
        let highest = unit.batches.iter().max().copied().unwrap_or_default();
        let unit = unit.p50();
        let http = results[0].p50;
        let rows: Vec<Vec<String>> = results
            .iter()
            .map(|m| {
                let p50 = in_units(m.p50, unit);
                // Summed from +0.0: an empty sum of floats is -0.0.
                let total = m.commands.values().fold(0.0, |a, b| a + b);
                vec![
                    m.name.to_owned(),
                    m.nodes.to_string(),
                    ms(m.p50),
                    format!("{p50:.2}"),
                    format!("{:.2}", in_units(m.p90, unit)),
                    m.limit.map_or("-".to_owned(), |l| l.to_string()),
                    m.limit
                        .map_or("-".to_owned(), |l| format!("{:.2}x", p50 / f64::from(l))),
                    format!("{:.2}", in_units(m.p50.saturating_sub(http), unit)),
                    format!("{total:.2}"),
                ]
            })
            .collect();
        println!();
        print_table(
            &[
                "case",
                "nodes",
                "p50",
                "p50 (RTT)",
                "p90 (RTT)",
                "limit (RTT)",
                "p50 / limit",
                "p50 - no-layer (RTT)",
                "commands / request",
            ],
            &rows,
        );
        println!();
        println!(
            "commands per request (INFO commandstats on the case's nodes, inside scripts \
             included, summed over the nodes):"
        );
        for m in &results {
            let list: Vec<String> = m
                .commands
                .iter()
                .map(|(name, per)| format!("{name} {per:.2}"))
                .collect();
            let line = format!("  {:<20} {} node(s): {}", m.name, m.nodes, list.join(", "));
            println!("{}", line.trim_end());
        }
        println!();
        println!(
            "RTT = the unit, {}: the p50 of {pings} PINGs through the proxy, {} at the start \
             and {} before each case (the batches' p50s from {} to {}). HTTP on loopback adds \
             the no-layer row's share to every row.",
            ms(unit),
            settings.n,
            (settings.n / 4).max(1),
            ms(lowest),
            ms(highest)
        );
        println!("took {:.0} s", started.elapsed().as_secs_f64());
    });
    drop(proxies);
    drop(proxy_runtime);
}
