//! The outage breaker: a store whose nodes keep failing answers at once, and closes again
//! soon after they return. Real Redis nodes, stopped with SIGSTOP (connections stay open
//! and nothing answers: without the breaker, every request waits for the node timeout).

use std::time::{Duration, Instant};

use axum::Router;
use axum::routing::post;
use tower_redlock::LockLayer;

use crate::support::{nodes, redlock, serve};

async fn order(client: &reqwest::Client, url: &str, id: &str) -> (u16, Duration) {
    let started = Instant::now();
    let status = client
        .post(url)
        .header("x-order-id", id)
        .send()
        .await
        .unwrap()
        .status()
        .as_u16();
    (status, started.elapsed())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_every_node_stopped_the_breaker_answers_at_once_and_closes_soon_after_their_return() {
    let nodes = nodes(3);
    // A node timeout of 200 ms (support::redlock).
    let locks = redlock(&nodes, Duration::from_secs(10)).await;
    let layer = LockLayer::by_header("x-order-id").backend(locks);
    let app = Router::new().route("/orders", post(|| async { "ok" }).layer(layer));
    let url = format!("{}/orders", serve(app).await);
    let client = reqwest::Client::new();
    assert_eq!(order(&client, &url, "1").await.0, 200);

    for node in &nodes {
        node.pause();
    }
    // The first requests wait for the node timeout; once the breakers open, at once.
    let (status, took) = order(&client, &url, "2").await;
    assert_eq!(status, 503);
    assert!(
        took >= Duration::from_millis(200),
        "waited for the nodes: {took:?}"
    );
    let mut fast = None;
    for attempt in 0..20 {
        let (status, took) = order(&client, &url, &format!("o{attempt}")).await;
        assert_eq!(status, 503);
        if took < Duration::from_millis(5) {
            fast = Some(attempt);
            break;
        }
    }
    let opened_after = fast.expect("no request was answered within 5 ms");
    assert!(
        opened_after <= 3,
        "the breakers opened after {opened_after} more requests"
    );
    // While open, requests are answered at once, but for the probe each node sends once
    // per cool-down (500 ms), which waits for the node timeout.
    let mut times = Vec::new();
    for attempt in 0..10 {
        let (status, took) = order(&client, &url, &format!("p{attempt}")).await;
        assert_eq!(status, 503);
        times.push(took);
    }
    let fast = times
        .iter()
        .filter(|t| **t < Duration::from_millis(5))
        .count();
    assert!(fast >= 8, "answered at once: {fast} of 10 ({times:?})");
    assert!(
        times.iter().all(|t| *t < Duration::from_millis(300)),
        "{times:?}"
    );

    for node in &nodes {
        node.resume();
    }
    let back = Instant::now();
    let mut closed = None;
    while back.elapsed() < Duration::from_secs(3) {
        if order(&client, &url, &format!("q{}", back.elapsed().as_millis()))
            .await
            .0
            == 200
        {
            closed = Some(back.elapsed());
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let closed = closed.expect("no request succeeded within 3 s of the nodes' return");
    assert!(
        closed < Duration::from_secs(1),
        "closed {closed:?} after the nodes' return"
    );
}
