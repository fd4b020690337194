//! A flash sale: many buyers, one stock counter, and the locks that keep it honest.
//!
//! ```text
//! cargo run --example flash_sale                      # in-process locks and data
//! REDIS_URLS=redis://127.0.0.1:7001,redis://127.0.0.1:7002,redis://127.0.0.1:7003 \
//!   LISTEN_ADDR=127.0.0.1:3001 cargo run --example flash_sale
//! ```
//!
//! Environment:
//! - `LISTEN_ADDR`: where to listen (default `127.0.0.1:3000`);
//! - `REDIS_URLS`: comma-separated `redis://` URLs of the lock nodes; the stock lives in the
//!   first one. Unset: in-process locks and data;
//! - `REDIS_CLUSTER` (with `--features cluster-async`): comma-separated `redis://` URLs of
//!   one Redis Cluster's nodes; when set and `REDIS_URLS` is not, the locks, the stock and
//!   the rate limit all live on that cluster (one Redlock node: see `Node::cluster` for
//!   what a failover can lose);
//! - `WORK_MS`: simulated work inside each locked handler (default 50);
//! - `LOCKING=off`: the same routes without any lock, to see what the lock prevents;
//! - `RATE_LIMIT`: `LIMIT/SECONDS` (such as `5/10`), a limit on `POST /items/{item_id}/buy`
//!   per client IP (IPv6 per /64), counted in the first Redis node (or in process). Unset:
//!   no limit;
//! - `TRUSTED_PROXIES`: comma-separated address ranges of the proxies in front (such as
//!   `10.0.0.0/8,127.0.0.1/32`): from them, `RATE_LIMIT`'s client IP is the right-most
//!   `X-Forwarded-For` entry outside the ranges (below); else, and unset, the peer's;
//! - `IDEMPOTENCY_TTL`: how long `POST /orders` results are kept for replay, in seconds
//!   (default 86400);
//! - `SHADOW=1`: every layer in shadow mode: each decides and counts as usual
//!   (`tower_redlock_shadow_refusals_total` on `GET /metrics`) but lets every request
//!   through, as when trying a new rule on live traffic (below);
//! - `MAX_CONCURRENT_BUYS`: at most this many `POST /items/{item_id}/buy` in flight at
//!   once, across all items and every example process sharing the first Redis node (or the
//!   cluster, or in process); over it, 503 with `Retry-After`. Unset: no limit.
//!
//! Behind a proxy: here curl on 127.0.0.1 plays the trusted proxy and the client
//! 203.0.113.7 forges a new left-most entry each time; the client still has two buys a
//! minute, so the loop prints 200, 200, 429 (once `cargo run` has started the server):
//!
//! ```text
//! RATE_LIMIT=2/60 TRUSTED_PROXIES=127.0.0.1/32 cargo run --example flash_sale &
//! curl -s -o /dev/null -X PUT localhost:3000/items/tv -H 'content-type: application/json' -d '{"stock": 9}'
//! for forged in 192.0.2.1 192.0.2.2 192.0.2.3; do
//!   curl -s -o /dev/null -w '%{http_code}\n' -X POST localhost:3000/items/tv/buy \
//!     -H "X-Forwarded-For: $forged, 203.0.113.7"
//! done
//! ```
//!
//! In shadow mode two buys of one item at once both run (200, 200: the second would have
//! been 423), and the metrics count the refusal that was let through:
//!
//! ```text
//! SHADOW=1 WORK_MS=1000 cargo run --example flash_sale &
//! curl -s -o /dev/null -X PUT localhost:3000/items/tv -H 'content-type: application/json' -d '{"stock": 9}'
//! curl -s -o /dev/null -w '%{http_code}\n' -X POST localhost:3000/items/tv/buy &
//! sleep 0.2; curl -s -o /dev/null -w '%{http_code}\n' -X POST localhost:3000/items/tv/buy; wait %2
//! curl -s localhost:3000/metrics | grep shadow_refusals
//! ```
//!
//! Routes:
//! - `GET /healthz`: the process answers;
//! - `GET /ready`: whether its stores answer now, for a readiness probe: 200 when a
//!   quorum of the lock nodes, the stock's node and (when set) the rate limit's and the
//!   concurrency limit's answer, else 503; the body says which,
//!   `{"concurrency_limit":null,"locks":true,"rate_limit":null,"stock":true}` (`null`:
//!   not set);
//! - `GET /metrics`: the Prometheus text exposition of this process's metrics: the crate's
//!   own (`tower_redlock_*`, see the guide's `observability` chapter) and
//!   `flash_sale_http_responses_total{route, status}`, one count per answer the example
//!   gave (`route` is the matched route, such as `/items/{item_id}/buy`);
//! - `PUT /items/{item_id}` with `{"stock": N}`: sets the stock, sold to 0;
//! - `GET /items/{item_id}`: `{"item_id", "stock", "sold"}`;
//! - `POST /items/{item_id}/buy`: locked on the item (423 while another buy runs); reads
//!   the stock, works, writes stock - 1 (not atomically, on purpose); 410 when sold out;
//!   429 over `RATE_LIMIT`; 503 over `MAX_CONCURRENT_BUYS`;
//! - `POST /orders` with any JSON body: behind `IdempotencyLayer` on the `Idempotency-Key`
//!   header (400 without, 409 while the same key is in flight, 422 for the same key with
//!   another body); answers 201 with `{"order_id", "idempotency_key", "lock_key"}` (the
//!   key the layer locked, from the request's `Lease`; `null` with `LOCKING=off`), and a
//!   retry with the same key and body gets that same answer back with
//!   `Idempotent-Replayed: true`, from any example process sharing the nodes.
//!   `{"simulate": "error"}` answers 500, which is not stored: a retry runs again;
//! - `POST /orders/{order_id}/pay`: locked by the `Locked<OrderId>` extractor (423 while
//!   another pay of the same order runs).
//! - `PUT /accounts/{account_id}` with `{"balance": N}`, `GET /accounts/{account_id}`:
//!   `{"account_id", "balance"}`, stored as `flash_sale:account:{id}` beside the stock;
//! - `POST /transfers` with `{"from": "...", "to": "...", "amount": N}`: locks both
//!   accounts with one lease (`LockRequest::all`), reads both balances, works, writes
//!   both (not atomically, on purpose); 200 with both new balances, 409 when `from` lacks
//!   the funds, 423 while either account is locked, 400 when `from` equals `to` or the
//!   amount is not positive (see `flash_sale/accounts.rs`).
//!
//! Every Redis command, the lock's and the stock's, waits at most [`NODE_TIMEOUT`] for its
//! answer: a stock node that does not answer as Redis makes a buy answer 503 within it.

// An example keeps to its point: it stops on a failed setup or a poisoned lock.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing,
    clippy::panic
)]

use std::borrow::Cow;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::{FromRef, Path, State};
use axum::http::StatusCode;
use axum::middleware;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post, put};
use axum::{Json, Router};
use metrics_exporter_prometheus::PrometheusHandle;
use serde::Deserialize;
use serde_json::json;
use tower_redlock::key::{ClientIpKey, ClientIpSource};
use tower_redlock::{
    ConcurrencyLimitLayer, ConcurrencyLimiter, IdempotencyLayer, Lease, LockKey, LockLayer, Locked,
    Locks, MemoryConcurrencyLimiter, MemoryLocks, MemoryRateLimiter, Problem, Quota,
    RateLimitLayer, RateLimiter, RedisConcurrencyLimiter, RedisRateLimiter, Redlock, Shadow,
};

/// How long one Redis node may take to answer a command: the lock's node timeout (the
/// crate's default for a 10 s TTL), and the bound on each command of the stock store.
const NODE_TIMEOUT: Duration = Duration::from_millis(500);

#[path = "flash_sale/accounts.rs"]
mod accounts;
#[path = "flash_sale/cluster.rs"]
mod cluster;
#[path = "flash_sale/metrics.rs"]
mod metrics_setup;
#[path = "flash_sale/store.rs"]
mod store;

use cluster::{cluster_backends, cluster_permits};
use metrics_setup::{count_responses, prometheus};
use store::{Store, StoreError, bounded, store_error};

#[derive(Clone)]
struct AppState {
    locks: Locks,
    store: Store,
    work: Duration,
    idempotency_ttl: Duration,
    /// The limiters in use, for `GET /ready`.
    limiters: (Option<RateLimiter>, Option<ConcurrencyLimiter>),
}

impl FromRef<AppState> for Locks {
    fn from_ref(state: &AppState) -> Locks {
        state.locks.clone()
    }
}

/// An order id from the path; its lock key is `order:{id}`.
#[derive(Deserialize)]
struct OrderId(String);

impl LockKey for OrderId {
    const SCOPE: &'static str = "order";
    fn lock_key(&self) -> Cow<'_, str> {
        Cow::Borrowed(&self.0)
    }
}

#[derive(Deserialize)]
struct SetStock {
    stock: i64,
}

fn not_found(item: &str) -> Response {
    Problem::new(
        StatusCode::NOT_FOUND,
        format!("No item {item}; create it with PUT /items/{item}."),
    )
    .into_response()
}

async fn set_stock(
    State(app): State<AppState>,
    Path(item): Path<String>,
    Json(body): Json<SetStock>,
) -> Response {
    if body.stock < 0 {
        return Problem::new(StatusCode::UNPROCESSABLE_ENTITY, "stock must be 0 or more")
            .into_response();
    }
    match app.store.set(&item, body.stock, 0).await {
        Ok(()) => Json(json!({"item_id": item, "stock": body.stock, "sold": 0})).into_response(),
        Err(e) => store_error(e),
    }
}

async fn get_item(State(app): State<AppState>, Path(item): Path<String>) -> Response {
    match app.store.get(&item).await {
        Ok(Some((stock, sold))) => {
            Json(json!({"item_id": item, "stock": stock, "sold": sold})).into_response()
        }
        Ok(None) => not_found(&item),
        Err(e) => store_error(e),
    }
}

/// Read, work, write: safe only because the lock lets one buyer per item in at a time.
async fn buy(State(app): State<AppState>, Path(item): Path<String>) -> Response {
    let (stock, sold) = match app.store.get(&item).await {
        Ok(Some(counts)) => counts,
        Ok(None) => return not_found(&item),
        Err(e) => return store_error(e),
    };
    tokio::time::sleep(app.work).await;
    if stock <= 0 {
        return Problem::new(StatusCode::GONE, format!("Item {item} is sold out.")).into_response();
    }
    match app.store.set(&item, stock - 1, sold + 1).await {
        Ok(()) => Json(json!({"item_id": item, "remaining": stock - 1})).into_response(),
        Err(e) => store_error(e),
    }
}

/// Creates an order from any JSON body. Answers with the key the layer locked, as stored
/// in Redis: the lease knows it, where the header as the handler would re-read it may
/// differ (quoting, whitespace). `{"simulate": "error"}` answers 500, to show that server
/// errors are not stored for replay.
async fn create_order(
    State(app): State<AppState>,
    lease: Option<Lease>,
    headers: axum::http::HeaderMap,
    body: axum::body::Bytes,
) -> Response {
    let order: serde_json::Value = if body.is_empty() {
        json!({})
    } else {
        match serde_json::from_slice(&body) {
            Ok(order) => order,
            Err(e) => {
                return Problem::new(
                    StatusCode::BAD_REQUEST,
                    format!("The body is not JSON: {e}."),
                )
                .into_response();
            }
        }
    };
    tokio::time::sleep(app.work).await;
    if order.get("simulate").and_then(|v| v.as_str()) == Some("error") {
        return Problem::new(StatusCode::INTERNAL_SERVER_ERROR, "Simulated failure.")
            .into_response();
    }
    let lock_key = lease.as_ref().map(|lease| lease.key().to_owned());
    // The key as the client sent it (the lock key holds it after the caller's principal).
    let idempotency_key = headers
        .get("idempotency-key")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    let order_id = format!("ord_{:016x}", rand::random::<u64>());
    (
        StatusCode::CREATED,
        Json(
            json!({"order_id": order_id, "idempotency_key": idempotency_key, "lock_key": lock_key}),
        ),
    )
        .into_response()
}

async fn pay(State(app): State<AppState>, order: Locked<Path<OrderId>>) -> Response {
    tokio::time::sleep(app.work).await;
    Json(json!({"order_id": order.0.0, "paid": true})).into_response()
}

async fn pay_unlocked(State(app): State<AppState>, Path(order): Path<OrderId>) -> Response {
    tokio::time::sleep(app.work).await;
    Json(json!({"order_id": order.0, "paid": true})).into_response()
}

/// `GET /ready`: 200 when every store in use answers now, else 503; the body says which
/// (`null` for a limit that is not set).
async fn ready(State(app): State<AppState>) -> Response {
    let (rate_limit, concurrency_limit) = &app.limiters;
    let (locks, stock, rate_limit, concurrency_limit) = tokio::join!(
        app.locks.ready(),
        app.store.ready(),
        async { Some(rate_limit.as_ref()?.ready().await) },
        async { Some(concurrency_limit.as_ref()?.ready().await) },
    );
    let limits = [rate_limit, concurrency_limit];
    let status = if locks && stock && limits.into_iter().flatten().all(|ready| ready) {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    let body = json!({"locks": locks, "stock": stock, "rate_limit": rate_limit, "concurrency_limit": concurrency_limit});
    (status, Json(body)).into_response()
}

fn app(
    state: AppState,
    locking: bool,
    shadow: Shadow,
    rate_limit: Option<RateLimitLayer<ClientIpKey>>,
    buys_in_flight: Option<ConcurrencyLimitLayer<tower_redlock::key::GlobalKey>>,
    metrics: PrometheusHandle,
) -> Router {
    let router = Router::new()
        .route("/healthz", get(|| async { "ok" }))
        .route("/ready", get(ready))
        .route(
            "/metrics",
            get(move || std::future::ready(metrics.render())),
        )
        .route("/items/{item_id}", put(set_stock).get(get_item));
    // The rate limit is the outer layer (added last): it answers 429 before a lock is taken.
    let mut buy_route = post(buy);
    if locking {
        buy_route = buy_route.layer(
            LockLayer::by_path_param("item_id")
                .backend(state.locks.clone())
                .shadow(shadow.clone()),
        );
    }
    // Between the two: a buy counts as in flight while it waits for its item's lock.
    if let Some(buys_in_flight) = buys_in_flight {
        buy_route = buy_route.layer(buys_in_flight.shadow(shadow.clone()));
    }
    if let Some(rate_limit) = rate_limit {
        buy_route = buy_route.layer(rate_limit.shadow(shadow.clone()));
    }
    let router = router.route("/items/{item_id}/buy", buy_route);
    let router = if locking {
        let locks = state.locks.clone();
        router
            .route(
                "/orders",
                post(create_order).layer(
                    IdempotencyLayer::new()
                        .backend(locks)
                        .record_ttl(state.idempotency_ttl)
                        .shadow(shadow),
                ),
            )
            .route("/orders/{order_id}/pay", post(pay))
    } else {
        router
            .route("/orders", post(create_order))
            .route("/orders/{order_id}/pay", post(pay_unlocked))
    };
    router
        .merge(accounts::routes(locking))
        .layer(middleware::from_fn(count_responses))
        .with_state(state)
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    // One level for every target, from RUST_LOG (`warn`, `info`, `debug`, `off`).
    let level = std::env::var("RUST_LOG")
        .ok()
        .and_then(|level| level.parse().ok())
        .unwrap_or(tracing_subscriber::filter::LevelFilter::INFO);
    tracing_subscriber::fmt().with_max_level(level).init();
    let metrics = prometheus()?;

    let addr: SocketAddr = std::env::var("LISTEN_ADDR")
        .unwrap_or_else(|_| "127.0.0.1:3000".into())
        .parse()
        .map_err(|e| format!("LISTEN_ADDR must be host:port: {e}"))?;
    let work = Duration::from_millis(match std::env::var("WORK_MS") {
        Ok(ms) => ms
            .parse()
            .map_err(|e| format!("WORK_MS must be a whole number of milliseconds: {e}"))?,
        Err(_) => 50,
    });
    let idempotency_ttl = Duration::from_secs(match std::env::var("IDEMPOTENCY_TTL") {
        Ok(secs) => secs
            .parse()
            .map_err(|e| format!("IDEMPOTENCY_TTL must be a whole number of seconds: {e}"))?,
        Err(_) => 86_400,
    });
    let locking = !matches!(std::env::var("LOCKING").as_deref(), Ok("off"));
    // Every layer decides and counts, but lets every request through (a switch an app
    // could also flip at run time, from its config reload).
    let shadow = Shadow::new(matches!(std::env::var("SHADOW").as_deref(), Ok("1")));
    let urls = env_list("REDIS_URLS");

    let quota: Option<Quota> = match std::env::var("RATE_LIMIT") {
        Ok(text) => Some(
            text.parse()
                .map_err(|e| format!("RATE_LIMIT must be LIMIT/SECONDS, such as 5/10: {e}"))?,
        ),
        Err(_) => None,
    };

    let max_buys: Option<u32> = match std::env::var("MAX_CONCURRENT_BUYS") {
        Ok(text) => Some(
            text.parse()
                .map_err(|e| format!("MAX_CONCURRENT_BUYS must be a whole number: {e}"))?,
        ),
        Err(_) => None,
    };

    let cluster = env_list("REDIS_CLUSTER");
    let on_cluster = urls.is_empty() && !cluster.is_empty();

    let (locks, store, limiter) = if on_cluster {
        cluster_backends(&cluster).await?
    } else if urls.is_empty() {
        // In process, chosen: no log line says that a backend was forgotten.
        let limiter = RateLimiter::from(MemoryRateLimiter::new());
        let locks = Locks::from(MemoryLocks::new());
        (locks, Store::Memory(Arc::default()), limiter)
    } else {
        let redlock = Redlock::builder(&urls)
            .node_timeout(NODE_TIMEOUT)
            .build()
            .await?;
        let data = redis::Client::open(urls[0].as_str())?
            .get_connection_manager()
            .await?;
        let limiter = RedisRateLimiter::builder(urls[0].as_str()).build().await?;
        (
            Locks::from(redlock),
            Store::Redis(data),
            RateLimiter::from(limiter),
        )
    };
    // The client IP: behind TRUSTED_PROXIES, the right-most X-Forwarded-For entry they did
    // not write; from any other peer (every one when unset), the peer's own address.
    let client_ip = ClientIpKey::new(ClientIpSource::RightmostXForwardedFor)
        .trusted_proxies(env_list("TRUSTED_PROXIES"))
        .map_err(|e| format!("TRUSTED_PROXIES: {e}"))?;
    let rate_limit = quota.map(|quota| {
        RateLimitLayer::by_client_ip(client_ip, quota)
            .scope("buy")
            .backend(limiter.clone())
    });
    let mut limiters = (quota.map(|_| limiter), None);
    let buys_in_flight = match max_buys {
        None => None,
        Some(max) => {
            // Counted where every process sees them: the first node, or the cluster.
            let permits = match urls.first() {
                Some(url) => RedisConcurrencyLimiter::builder(url).build().await?.into(),
                None if on_cluster => cluster_permits(&cluster).await?,
                None => ConcurrencyLimiter::from(MemoryConcurrencyLimiter::new()),
            };
            limiters.1 = Some(permits.clone());
            Some(
                ConcurrencyLimitLayer::global(max)
                    .scope("buy")
                    .backend(permits),
            )
        }
    };
    let backend = if on_cluster {
        format!(
            "locks and stock on the Redis Cluster of {}",
            cluster.join(",")
        )
    } else if urls.is_empty() {
        "in-process locks and data".to_owned()
    } else {
        format!("Redlock over {} node(s), stock in {}", urls.len(), urls[0])
    };
    let rate_limit_text = quota.map_or_else(|| "none".to_owned(), |q| q.to_string());
    tracing::info!(%addr, backend, locking, work_ms = work.as_millis() as u64, rate_limit = rate_limit_text, max_concurrent_buys = ?max_buys, "flash sale listening");

    let listener = tokio::net::TcpListener::bind(addr).await?;
    axum::serve(
        listener,
        app(
            AppState {
                locks,
                store,
                work,
                idempotency_ttl,
                limiters,
            },
            locking,
            shadow,
            rate_limit,
            buys_in_flight,
            metrics,
        )
        .into_make_service_with_connect_info::<SocketAddr>(),
    )
    .await?;
    Ok(())
}

/// The comma-separated entries of the environment variable `name`: none when unset.
fn env_list(name: &str) -> Vec<String> {
    std::env::var(name)
        .unwrap_or_default()
        .split(',')
        .map(str::trim)
        .filter(|entry| !entry.is_empty())
        .map(str::to_owned)
        .collect()
}
