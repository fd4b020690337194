//! A client that sends its request body slowly holds no lock: `LockLayer` reads the body
//! before it takes the lock (408 past its timeout, 413 past its size). Real HTTP, on both
//! backends.

use crate::support;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Bytes;
use axum::routing::post;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::oneshot;
use tower_redlock::{LockLayer, Locked, Locks, MemoryLocks};

async fn backends(nodes: &[support::RedisNode]) -> Vec<(&'static str, Locks)> {
    vec![
        ("in-process", Locks::from(MemoryLocks::new())),
        (
            "redlock",
            support::redlock(nodes, Duration::from_secs(10)).await,
        ),
    ]
}

/// A client that sends the head of `POST {path}` with `Content-Length: 100000` and the
/// header `extra`, then one byte of body every 50 ms until the server answers or
/// `within` passes; `sent` is told once the head is sent. Returns the status line's code
/// (0 when none came) and when it came.
async fn trickle(
    base: &str,
    path: &str,
    extra: &str,
    within: Duration,
    sent: oneshot::Sender<()>,
) -> (u16, Duration) {
    let addr = base.trim_start_matches("http://");
    let mut stream = TcpStream::connect(addr).await.unwrap();
    let head = format!(
        "POST {path} HTTP/1.1\r\nhost: {addr}\r\ncontent-type: application/json\r\n{extra}content-length: 100000\r\n\r\n{{"
    );
    stream.write_all(head.as_bytes()).await.unwrap();
    let started = Instant::now();
    let _ = sent.send(());
    let mut answer = [0u8; 12];
    loop {
        tokio::select! {
            read = stream.read(&mut answer) => {
                let n = read.unwrap_or(0);
                let text = String::from_utf8_lossy(&answer[..n]).into_owned();
                let code = text.get(9..12).and_then(|c| c.parse().ok()).unwrap_or(0);
                return (code, started.elapsed());
            }
            _ = tokio::time::sleep(Duration::from_millis(50)) => {
                if started.elapsed() > within || stream.write_all(b" ").await.is_err() {
                    return (0, started.elapsed());
                }
            }
        }
    }
}

/// Counts the handler's runs.
fn counted(
    runs: &Arc<AtomicUsize>,
) -> impl Fn(Bytes) -> std::future::Ready<String> + Clone + use<> {
    let runs = runs.clone();
    move |body: Bytes| {
        runs.fetch_add(1, Ordering::SeqCst);
        std::future::ready(format!("{} bytes", body.len()))
    }
}

#[tokio::test]
async fn a_slow_body_holds_no_lock_and_is_answered_408() {
    let nodes = support::nodes(1);
    for (name, locks) in backends(&nodes).await {
        let runs = Arc::new(AtomicUsize::new(0));
        let layer = LockLayer::by_header("x-order")
            .backend(locks)
            .request_body_timeout(Duration::from_millis(600));
        let base =
            support::serve(Router::new().route("/orders", post(counted(&runs)).layer(layer))).await;
        let (sent, head_sent) = oneshot::channel();
        let slow = tokio::spawn({
            let base = base.clone();
            async move {
                let within = Duration::from_secs(5);
                trickle(&base, "/orders", "x-order: 1\r\n", within, sent).await
            }
        });
        head_sent.await.unwrap();
        // While the slow client sends, another client takes the same key at once, every
        // time.
        let http = reqwest::Client::new();
        for _ in 0..3 {
            let fast = http
                .post(format!("{base}/orders"))
                .header("x-order", "1")
                .body("{}")
                .timeout(Duration::from_secs(2))
                .send()
                .await
                .unwrap();
            assert_eq!(fast.status(), 200, "{name}");
            assert_eq!(fast.text().await.unwrap(), "2 bytes", "{name}");
        }
        let (status, after) = slow.await.unwrap();
        assert_eq!(status, 408, "{name}");
        assert!(
            after < Duration::from_secs(2),
            "{name}: answered after {after:?}"
        );
        assert_eq!(
            runs.load(Ordering::SeqCst),
            3,
            "{name}: the slow request never ran"
        );
    }
}

#[tokio::test]
async fn by_default_a_slow_client_does_not_keep_the_key_from_others() {
    let runs = Arc::new(AtomicUsize::new(0));
    let layer = LockLayer::by_path_param("item").backend(MemoryLocks::new());
    let base =
        support::serve(Router::new().route("/items/{item}", post(counted(&runs)).layer(layer)))
            .await;
    let (sent, head_sent) = oneshot::channel();
    let slow = tokio::spawn({
        let base = base.clone();
        async move { trickle(&base, "/items/7", "", Duration::from_secs(1), sent).await }
    });
    head_sent.await.unwrap();
    let started = Instant::now();
    let fast = reqwest::Client::new()
        .post(format!("{base}/items/7"))
        .body("{}")
        .send()
        .await
        .unwrap();
    assert_eq!(fast.status(), 200);
    assert!(started.elapsed() < Duration::from_secs(1));
    // The slow client was still sending: no answer yet.
    assert_eq!(slow.await.unwrap().0, 0);
}

#[tokio::test]
async fn a_body_over_the_bound_is_413_and_takes_no_lock() {
    let runs = Arc::new(AtomicUsize::new(0));
    let layer = LockLayer::by_header("x-order")
        .backend(MemoryLocks::new())
        .max_request_body(1024);
    let base =
        support::serve(Router::new().route("/orders", post(counted(&runs)).layer(layer))).await;
    let http = reqwest::Client::new();
    let big = http
        .post(format!("{base}/orders"))
        .header("x-order", "1")
        .body(vec![b'x'; 2048])
        .send()
        .await
        .unwrap();
    assert_eq!(big.status(), 413);
    // Without a length (chunked): read up to the bound, then refused.
    let addr = base.trim_start_matches("http://");
    let mut stream = TcpStream::connect(addr).await.unwrap();
    let mut request = format!(
        "POST /orders HTTP/1.1\r\nhost: {addr}\r\nx-order: 1\r\ntransfer-encoding: chunked\r\n\r\n"
    );
    for _ in 0..4 {
        request.push_str(&format!("200\r\n{}\r\n", "x".repeat(512)));
    }
    request.push_str("0\r\n\r\n");
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut answer = [0u8; 12];
    stream.read_exact(&mut answer).await.unwrap();
    assert_eq!(&answer, b"HTTP/1.1 413");
    let fits = http
        .post(format!("{base}/orders"))
        .header("x-order", "1")
        .body(vec![b'x'; 1024])
        .send()
        .await
        .unwrap();
    assert_eq!(fits.text().await.unwrap(), "1024 bytes");
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn a_streamed_body_is_handed_on_under_the_lock() {
    let runs = Arc::new(AtomicUsize::new(0));
    let layer = LockLayer::by_header("x-order")
        .backend(MemoryLocks::new())
        .max_request_body(16)
        .stream_request_body(true);
    let base =
        support::serve(Router::new().route("/orders", post(counted(&runs)).layer(layer))).await;
    let http = reqwest::Client::new();
    let big = http
        .post(format!("{base}/orders"))
        .header("x-order", "1")
        .body(vec![b'x'; 4096])
        .send()
        .await
        .unwrap();
    assert_eq!(big.text().await.unwrap(), "4096 bytes");
    // Streamed, the lock is held while the client sends.
    let (sent, _) = oneshot::channel();
    let slow = tokio::spawn({
        let base = base.clone();
        async move {
            let within = Duration::from_secs(1);
            trickle(&base, "/orders", "x-order: 2\r\n", within, sent).await
        }
    });
    let held = support::eventually(Duration::from_secs(2), || {
        let request = http
            .post(format!("{base}/orders"))
            .header("x-order", "2")
            .body("{}");
        async move { request.send().await.unwrap().status() == 409 }
    })
    .await;
    assert!(held, "the streaming request holds its key");
    slow.await.unwrap();
}

#[tokio::test]
async fn locked_behind_read_request_body_holds_no_lock_while_the_body_arrives() {
    use axum::extract::Path;
    use tower_redlock::lock::ReadRequestBodyLayer;

    let nodes = support::nodes(1);
    for (name, locks) in backends(&nodes).await {
        let pay = |order: Locked<Path<u64>>, body: String| async move {
            format!("order {} paid with {body}", order.0)
        };
        let app = Router::new()
            .route(
                "/orders/{id}/pay",
                post(pay).layer(ReadRequestBodyLayer::new()),
            )
            .with_state(locks);
        let base = support::serve(app).await;
        let (sent, head_sent) = oneshot::channel();
        let slow = tokio::spawn({
            let base = base.clone();
            let within = Duration::from_secs(1);
            async move { trickle(&base, "/orders/5/pay", "", within, sent).await }
        });
        head_sent.await.unwrap();
        let fast = reqwest::Client::new()
            .post(format!("{base}/orders/5/pay"))
            .body("cash")
            .timeout(Duration::from_secs(2))
            .send()
            .await
            .unwrap();
        assert_eq!(fast.status(), 200, "{name}");
        assert_eq!(
            fast.text().await.unwrap(),
            "order 5 paid with cash",
            "{name}"
        );
        assert_eq!(
            slow.await.unwrap().0,
            0,
            "{name}: the slow client was still sending"
        );
    }
}
