//! What the benches share: the floor (the bare Redis commands of a lock cycle) and the
//! HTTP pieces (a trivial app, a keep-alive client).
#![allow(dead_code, unreachable_pub)]

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use axum::Router;
use axum::routing::post;
use axum::serve::ListenerExt;
use bytes::Bytes;
use futures_util::future::join_all;
use http::{Request, StatusCode};
use http_body_util::{BodyExt, Empty};
use hyper::client::conn::http1::SendRequest;
use hyper_util::rt::TokioIo;
use redis::Value;
use redis::aio::MultiplexedConnection;

/// Lock TTL for every client: 10 s, this crate's default.
pub const TTL: Duration = Duration::from_secs(10);
pub const TTL_MS: u64 = 10_000;
/// The key prefix this crate puts before every key; the floor and rslock use it too, so
/// that every client sends keys of the same length.
pub const PREFIX: &str = "tower-redlock:";
/// The compare-and-delete script of the Redis docs' "Distributed Locks with Redis" page.
/// This crate's release script does the same, naming the waiters' mark as a second key of
/// its `DEL`, and tells a key that is gone from one held by another.
pub const RELEASE_SCRIPT: &str = r#"
if redis.call("get", KEYS[1]) == ARGV[1] then
  return redis.call("del", KEYS[1])
else
  return 0
end
"#;
/// This crate's Redlock client on `urls`, with the bench's TTL.
pub async fn redlock(urls: &[String]) -> tower_redlock::Locks {
    tower_redlock::Locks::from(
        tower_redlock::Redlock::builder(urls)
            .ttl(TTL)
            .build()
            .await
            .expect("build the Redlock client"),
    )
}

/// One lock cycle of this crate: `try_lock` then `unlock`; false if either failed.
pub async fn crate_cycle(redlock: &tower_redlock::Locks, resource: &str) -> bool {
    match redlock.try_lock(resource).await {
        Ok(lease) => redlock.unlock(lease).await.is_ok(),
        Err(_) => false,
    }
}

/// One lock cycle of rslock: `lock` then `unlock`, on the prefixed key; false if it failed.
pub async fn rslock_cycle(manager: &rslock::LockManager, resource: &str) -> bool {
    let key = prefixed(resource);
    match manager.lock(key.as_bytes(), TTL).await {
        Ok(lock) => {
            manager.unlock(&lock).await;
            true
        }
        Err(_) => false,
    }
}

/// The bare commands on redis-rs multiplexed connections.
pub struct Floor {
    conns: Vec<MultiplexedConnection>,
    sha: String,
    quorum: usize,
}

impl Floor {
    pub async fn connect(urls: &[String]) -> Self {
        let mut conns = Vec::new();
        let mut sha = String::new();
        for url in urls {
            let client = redis::Client::open(url.as_str()).expect("a valid Redis URL");
            let mut conn = client
                .get_multiplexed_async_connection()
                .await
                .expect("connect to the bench's Redis node");
            sha = redis::cmd("SCRIPT")
                .arg("LOAD")
                .arg(RELEASE_SCRIPT)
                .query_async(&mut conn)
                .await
                .expect("SCRIPT LOAD");
            conns.push(conn);
        }
        Floor {
            quorum: conns.len() / 2 + 1,
            conns,
            sha,
        }
    }

    pub async fn cycle(&self, resource: &str) -> bool {
        let key = prefixed(resource);
        let token = token();
        let set = self
            .on_all(|mut conn| {
                let mut cmd = redis::cmd("SET");
                cmd.arg(&key)
                    .arg(&token[..])
                    .arg("NX")
                    .arg("PX")
                    .arg(TTL_MS);
                async move { cmd.query_async::<Value>(&mut conn).await }
            })
            .await;
        let acquired = set.iter().filter(|r| matches!(r, Ok(Value::Okay))).count();
        let released = self
            .on_all(|mut conn| {
                let mut cmd = redis::cmd("EVALSHA");
                cmd.arg(&self.sha).arg(1).arg(&key).arg(&token[..]);
                async move { cmd.query_async::<Value>(&mut conn).await }
            })
            .await;
        acquired >= self.quorum && released.iter().all(Result::is_ok)
    }

    async fn on_all<F, Fut>(&self, op: F) -> Vec<redis::RedisResult<Value>>
    where
        F: Fn(MultiplexedConnection) -> Fut,
        Fut: Future<Output = redis::RedisResult<Value>>,
    {
        if let [conn] = self.conns.as_slice() {
            return vec![op(conn.clone()).await];
        }
        join_all(self.conns.iter().map(|conn| op(conn.clone()))).await
    }
}

pub fn prefixed(resource: &str) -> String {
    let mut key = String::with_capacity(PREFIX.len() + resource.len());
    key.push_str(PREFIX);
    key.push_str(resource);
    key
}

/// A unique 32-byte token, the size of this crate's, without the OS random source.
pub fn token() -> [u8; 32] {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let n = u128::from(NEXT.fetch_add(1, Ordering::Relaxed)) | (0x5eed_u128 << 100);
    let mut out = [0u8; 32];
    for (i, byte) in out.iter_mut().enumerate() {
        let nibble = ((n >> (4 * (31 - i))) & 0xf) as u8;
        *byte = b"0123456789abcdef"[usize::from(nibble)];
    }
    out
}

pub async fn ok_handler() -> &'static str {
    "ok"
}

/// Sets TCP_NODELAY on an accepted connection.
fn nodelay(tcp: &mut tokio::net::TcpStream) {
    let _ = tcp.set_nodelay(true);
}

/// A free loopback port, with TCP_NODELAY on accepted connections.
async fn nodelay_listener() -> (
    SocketAddr,
    axum::serve::TapIo<tokio::net::TcpListener, fn(&mut tokio::net::TcpStream)>,
) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind a loopback port");
    let addr = listener.local_addr().expect("local address");
    let nodelay: fn(&mut tokio::net::TcpStream) = nodelay;
    (addr, listener.tap_io(nodelay))
}

/// Serves `app` on a free loopback port, with TCP_NODELAY on accepted connections.
pub async fn serve(app: Router) -> SocketAddr {
    let (addr, listener) = nodelay_listener().await;
    tokio::spawn(async move {
        axum::serve(listener, app).await.expect("serve");
    });
    addr
}

/// [`serve`], with the peer's address in each request (`ConnectInfo<SocketAddr>`), as
/// the peer-IP keys need.
pub async fn serve_with_peer(app: Router) -> SocketAddr {
    let (addr, listener) = nodelay_listener().await;
    tokio::spawn(async move {
        let app = app.into_make_service_with_connect_info::<SocketAddr>();
        axum::serve(listener, app).await.expect("serve");
    });
    addr
}

/// One keep-alive HTTP/1.1 connection.
pub async fn connect(addr: SocketAddr) -> SendRequest<Empty<Bytes>> {
    let stream = tokio::net::TcpStream::connect(addr)
        .await
        .expect("connect to the app");
    stream.set_nodelay(true).expect("TCP_NODELAY");
    let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .expect("HTTP/1.1 handshake");
    tokio::spawn(async move {
        let _ = conn.await;
    });
    sender
}

/// POSTs to `/` with `Idempotency-Key: key`; returns the status once the body is read.
pub async fn post_key(sender: &mut SendRequest<Empty<Bytes>>, key: u64) -> StatusCode {
    sender.ready().await.expect("connection ready");
    let request = Request::post("/")
        .header(http::header::HOST, "bench")
        .header("idempotency-key", key)
        .body(Empty::<Bytes>::new())
        .expect("a valid request");
    let response = sender.send_request(request).await.expect("a response");
    let status = response.status();
    let _ = response.into_body().collect().await.expect("the body");
    status
}

/// The floor over HTTP: a handler that runs the floor's lock cycle itself (`SET NX PX`,
/// then the compare-and-delete script, on every node) on the request's Idempotency-Key,
/// with no layer. What it adds to "no layer" is what a lock cycle costs in this setting.
pub fn floor_app(floor: Arc<Floor>) -> Router {
    Router::new().route(
        "/",
        post(move |headers: http::HeaderMap| {
            let floor = floor.clone();
            async move {
                let value = headers
                    .get("idempotency-key")
                    .and_then(|v| v.to_str().ok())
                    .unwrap_or_default();
                // The key the layer builds: the scope (method and route), then the value.
                let mut resource = String::with_capacity(8 + value.len());
                resource.push_str("POST /:");
                resource.push_str(value);
                if floor.cycle(&resource).await {
                    (StatusCode::OK, "ok")
                } else {
                    (StatusCode::CONFLICT, "taken")
                }
            }
        }),
    )
}
