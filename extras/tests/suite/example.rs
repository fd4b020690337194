//! The flash-sale example, end to end: two example processes sharing three real Redis
//! nodes, driven over HTTP.

use crate::support;

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};

use support::{RedisNode, eventually, nodes, post_to, retry_after, urls};

pub(crate) struct Example {
    child: Child,
    pub(crate) base: String,
}

impl Drop for Example {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn example_binary() -> PathBuf {
    // target/<profile>/deps/example-<hash> -> target/<profile>/examples/flash_sale
    let exe = std::env::current_exe().unwrap();
    let path = exe
        .parent()
        .unwrap()
        .parent()
        .unwrap()
        .join("examples")
        .join("flash_sale");
    assert!(
        path.exists(),
        "{} is missing: `cargo test --workspace` builds it (the example is the crate's, at \
         the workspace root); run `cargo build --example flash_sale` there",
        path.display()
    );
    path
}

async fn start_example(nodes: &[RedisNode], work_ms: u64, locking: bool) -> Example {
    start_example_with(nodes, work_ms, locking, &[]).await
}

pub(crate) async fn start_example_with(
    nodes: &[RedisNode],
    work_ms: u64,
    locking: bool,
    env: &[(&str, &str)],
) -> Example {
    let port = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let child = Command::new(example_binary())
        .env("LISTEN_ADDR", format!("127.0.0.1:{port}"))
        .env("REDIS_URLS", urls(nodes).join(","))
        .env("WORK_MS", work_ms.to_string())
        .env("LOCKING", if locking { "on" } else { "off" })
        .env("RUST_LOG", "warn")
        .envs(env.iter().copied())
        .stdout(Stdio::null())
        .spawn()
        .expect("start the example");
    let example = Example {
        child,
        base: format!("http://127.0.0.1:{port}"),
    };
    let url = format!("{}/healthz", example.base);
    let up = eventually(Duration::from_secs(20), || async {
        reqwest::get(&url).await.is_ok_and(|r| r.status() == 200)
    })
    .await;
    assert!(up, "example did not answer /healthz");
    example
}

/// Buyers spread over the processes; each retries on 423 until it buys or the item is gone.
/// Returns how many purchases succeeded.
async fn run_sale(examples: &[Example], item: &str, buyers: usize) -> usize {
    let client = reqwest::Client::new();
    let mut tasks = Vec::new();
    for i in 0..buyers {
        let url = format!("{}/items/{item}/buy", examples[i % examples.len()].base);
        let client = client.clone();
        tasks.push(tokio::spawn(async move {
            for _ in 0..2000 {
                let resp = client.post(&url).send().await.unwrap();
                match resp.status().as_u16() {
                    200 => return true,
                    410 => return false,
                    423 => tokio::time::sleep(Duration::from_millis(5)).await,
                    other => panic!("unexpected {other}: {}", resp.text().await.unwrap()),
                }
            }
            panic!("buyer never got an answer other than 423");
        }));
    }
    let mut bought = 0;
    for t in tasks {
        bought += usize::from(t.await.unwrap());
    }
    bought
}

async fn put_stock(example: &Example, item: &str, stock: i64) {
    let resp = reqwest::Client::new()
        .put(format!("{}/items/{item}", example.base))
        .json(&serde_json::json!({"stock": stock}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
}

async fn item(example: &Example, item: &str) -> serde_json::Value {
    reqwest::get(format!("{}/items/{item}", example.base))
        .await
        .unwrap()
        .json()
        .await
        .unwrap()
}

/// A `main` that returns a configuration error through `?` prints its message, not the
/// variant's fields.
#[test]
fn flash_sale_with_a_bad_redis_url_prints_the_configuration_error_message() {
    let output = Command::new(example_binary())
        .env("LISTEN_ADDR", "127.0.0.1:0")
        .env("REDIS_URLS", "http://10.0.0.1")
        .env("RUST_LOG", "off")
        .output()
        .expect("run the example");
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("Error: invalid Redis URL for node 0: "),
        "{stderr}"
    );
    assert!(!stderr.contains("InvalidUrl {"), "{stderr}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn flash_sale_two_processes_sell_exactly_the_stock() {
    let nodes = nodes(3);
    let examples = [
        start_example(&nodes, 10, true).await,
        start_example(&nodes, 10, true).await,
    ];
    put_stock(&examples[0], "tv", 10).await;
    let bought = run_sale(&examples, "tv", 30).await;
    assert_eq!(bought, 10);
    let counts = item(&examples[1], "tv").await;
    assert_eq!(counts["stock"], 0, "{counts}");
    assert_eq!(counts["sold"], 10, "{counts}");
}

#[tokio::test]
async fn flash_sale_without_locking_oversells() {
    // The control for the test above: the same sale without the lock sells more than the stock.
    let nodes = nodes(1);
    let examples = [
        start_example(&nodes, 300, false).await,
        start_example(&nodes, 300, false).await,
    ];
    put_stock(&examples[0], "tv", 3).await;
    let bought = run_sale(&examples, "tv", 10).await;
    assert!(bought > 3, "sold {bought} of 3 without a lock");
}

#[tokio::test]
async fn example_orders_and_pay() {
    let nodes = nodes(3);
    let example = start_example(&nodes, 300, true).await;
    let client = reqwest::Client::new();
    let orders = format!("{}/orders", example.base);
    assert_eq!(client.post(&orders).send().await.unwrap().status(), 400);
    let send = || client.post(&orders).header("Idempotency-Key", "k-1").send();
    let (a, b) = tokio::join!(send(), send());
    let mut statuses = [a.unwrap().status().as_u16(), b.unwrap().status().as_u16()];
    statuses.sort();
    assert_eq!(statuses, [201, 409]);

    let pay = format!("{}/orders/o-1/pay", example.base);
    let (a, b) = tokio::join!(client.post(&pay).send(), client.post(&pay).send());
    let (a, b) = (a.unwrap(), b.unwrap());
    let mut statuses = [a.status().as_u16(), b.status().as_u16()];
    statuses.sort();
    assert_eq!(statuses, [200, 423]);
    let paid: serde_json::Value = if a.status() == 200 {
        a.json().await
    } else {
        b.json().await
    }
    .unwrap();
    assert_eq!(paid, serde_json::json!({"order_id": "o-1", "paid": true}));
}

/// The rate limit per client IP, behind a trusted proxy (the test, on 127.0.0.1, plays it):
/// shared by two processes, and keyed by the right-most `X-Forwarded-For` entry, whatever
/// the client forges on its left.
#[tokio::test]
async fn example_rate_limit_per_client_ip_across_processes() {
    let nodes = nodes(1);
    let env = [("RATE_LIMIT", "3/60"), ("TRUSTED_PROXIES", "127.0.0.1/32")];
    let examples = [
        start_example_with(&nodes, 1, true, &env).await,
        start_example_with(&nodes, 1, true, &env).await,
    ];
    put_stock(&examples[0], "lamp", 100).await;
    let client = reqwest::Client::new();
    let buy = |i: usize, forwarded_for: String| {
        client
            .post(format!("{}/items/lamp/buy", examples[i % 2].base))
            .header("X-Forwarded-For", forwarded_for)
            .send()
    };
    // One client, alternating between the two processes, with a new forged left-most
    // entry each time: the limit is shared, and the forgery changes nothing.
    let mut statuses = Vec::new();
    for i in 0..5 {
        let forwarded_for = format!("198.51.100.{i}, 203.0.113.7");
        statuses.push(buy(i, forwarded_for).await.unwrap().status().as_u16());
    }
    assert_eq!(statuses, [200, 200, 200, 429, 429]);
    let limited = buy(0, "203.0.113.7".into()).await.unwrap();
    assert!(limited.headers().contains_key("retry-after"));
    assert_eq!(
        limited.headers()["ratelimit-policy"],
        "\"default\";q=3;w=60"
    );
    let stored = keys(&nodes[0]).await;
    assert!(
        stored.contains(&"tower-redlock-rate:buy:203.0.113.7/32".to_owned()),
        "{stored:?}"
    );
    // Another client behind the proxy has its own count.
    assert_eq!(buy(1, "203.0.113.8".into()).await.unwrap().status(), 200);
}

/// All keys on the node (a test node: `KEYS` is fine here).
async fn keys(node: &RedisNode) -> Vec<String> {
    let mut conn = node.conn().await;
    redis::cmd("KEYS")
        .arg("*")
        .query_async(&mut conn)
        .await
        .unwrap()
}

#[tokio::test]
async fn example_order_reports_the_key_the_layer_locked() {
    let nodes = nodes(1);
    let example = start_example(&nodes, 300, true).await;
    let client = reqwest::Client::new();
    let order = |key: &'static str| {
        client
            .post(format!("{}/orders", example.base))
            .header("Idempotency-Key", key)
            .send()
    };

    // While the order runs, the lock key is in Redis: the answer must name that key.
    let in_flight = tokio::spawn(order("abc\""));
    let deadline = Instant::now() + Duration::from_secs(5);
    let seen = loop {
        let seen = keys(&nodes[0]).await;
        if !seen.is_empty() || Instant::now() >= deadline {
            break seen;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    let appeared = !seen.is_empty();
    assert!(appeared, "no lock key appeared while the order ran");
    let resp = in_flight.await.unwrap().unwrap();
    assert_eq!(resp.status(), 201);
    let body: serde_json::Value = resp.json().await.unwrap();
    let reported = body["lock_key"].as_str().expect("lock_key in the answer");
    assert!(
        seen.iter().any(|k| k == reported),
        "reported {reported:?}, locked {seen:?}"
    );
    assert!(reported.ends_with("abc\""), "{reported}");

    // `abc"` and `abc` are two keys, so both run at once, and each reports its own.
    let (a, b) = tokio::join!(order("abc\""), order("abc"));
    let (a, b) = (a.unwrap(), b.unwrap());
    assert_eq!((a.status().as_u16(), b.status().as_u16()), (201, 201));
    let a: serde_json::Value = a.json().await.unwrap();
    let b: serde_json::Value = b.json().await.unwrap();
    assert_eq!(a["lock_key"], reported);
    assert_ne!(a["lock_key"], b["lock_key"], "{a} {b}");
}

/// Answers every connection on `port` as an HTTP server answers a line it cannot parse,
/// then closes it: a node's port taken over by a program that is not Redis.
async fn not_redis_on(port: u16) -> tokio::task::JoinHandle<()> {
    let listener = tokio::net::TcpListener::bind(("127.0.0.1", port))
        .await
        .expect("bind the stopped node's port");
    tokio::spawn(async move {
        loop {
            let Ok((mut socket, _)) = listener.accept().await else {
                return;
            };
            tokio::spawn(async move {
                let mut buf = [0u8; 1024];
                let _ = socket.read(&mut buf).await;
                let _ = socket
                    .write_all(b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
                    .await;
            });
        }
    })
}

#[tokio::test]
async fn example_buy_answers_503_within_the_node_timeout_when_the_stock_node_is_not_redis() {
    // The stock lives in the first node; the lock has a quorum on the other two.
    let mut nodes = nodes(3);
    let example = start_example(&nodes, 1, true).await;
    put_stock(&example, "tv", 3).await;
    nodes[0].kill();
    let fake = not_redis_on(nodes[0].port()).await;

    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(8))
        .build()
        .unwrap();
    let buy = format!("{}/items/tv/buy", example.base);
    for _ in 0..3 {
        let started = Instant::now();
        let resp = client
            .post(&buy)
            .send()
            .await
            .expect("an answer within 8 s");
        let took = started.elapsed();
        assert_eq!(resp.status(), 503);
        assert_eq!(resp.headers()["content-type"], "application/problem+json");
        // The example's node timeout is 500 ms: one for the stock read, at most one more
        // each for the lock's acquisition and release; the rest is slack for a busy machine.
        assert!(took < Duration::from_secs(3), "a buy took {took:?}");
    }
    fake.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn example_orders_are_replayed_across_processes_and_with_a_node_down() {
    let mut nodes = nodes(3);
    let one = start_example(&nodes, 20, true).await;
    let two = start_example(&nodes, 20, true).await;
    let client = reqwest::Client::new();
    let order = |base: &str, key: &str, body: &str| {
        client
            .post(format!("{base}/orders"))
            .header("Idempotency-Key", key)
            .header("content-type", "application/json")
            .body(body.to_owned())
            .send()
    };
    let body = r#"{"item": "tv", "quantity": 1}"#;
    let first = order(&one.base, "order-7", body).await.unwrap();
    assert_eq!(first.status(), 201);
    assert!(first.headers().get("idempotent-replayed").is_none());
    let created: serde_json::Value = first.json().await.unwrap();
    assert_eq!(created["idempotency_key"], "order-7");
    // Sequential retries, on either process, get the first answer back.
    for base in [&one.base, &two.base, &one.base] {
        let again = order(base, "order-7", body).await.unwrap();
        assert_eq!(again.status(), 201);
        assert_eq!(again.headers()["idempotent-replayed"], "true");
        let replayed: serde_json::Value = again.json().await.unwrap();
        assert_eq!(replayed, created, "one order, not four");
    }
    // The same key with another body is refused.
    let other = order(&two.base, "order-7", r#"{"item": "radio"}"#)
        .await
        .unwrap();
    assert_eq!(other.status(), 422);
    // A simulated server error is not stored: the retry runs again.
    for _ in 0..2 {
        let failed = order(&one.base, "order-8", r#"{"simulate": "error"}"#)
            .await
            .unwrap();
        assert_eq!(failed.status(), 500);
        assert!(failed.headers().get("idempotent-replayed").is_none());
    }
    // One node of three down: still replayed.
    nodes[2].kill();
    let again = order(&two.base, "order-7", body).await.unwrap();
    assert_eq!(again.status(), 201);
    assert_eq!(again.headers()["idempotent-replayed"], "true");
    let replayed: serde_json::Value = again.json().await.unwrap();
    assert_eq!(replayed, created);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn example_max_concurrent_buys_limits_buys_in_flight_across_processes() {
    let nodes = nodes(1);
    let env = [("MAX_CONCURRENT_BUYS", "2")];
    // Each buy works 1.5 s, so that six sent at once overlap.
    let examples = [
        start_example_with(&nodes, 1500, true, &env).await,
        start_example_with(&nodes, 1500, true, &env).await,
    ];
    let items = ["a", "b", "c", "d", "e", "f"];
    for item in items {
        put_stock(&examples[0], item, 1).await;
    }
    let client = reqwest::Client::new();
    let buys: Vec<_> = items
        .iter()
        .enumerate()
        .map(|(i, item)| {
            let url = format!("{}/items/{item}/buy", examples[i % 2].base);
            let client = client.clone();
            tokio::spawn(async move { client.post(url).send().await.unwrap() })
        })
        .collect();
    // Other routes answer as before while buys are in flight.
    assert_eq!(item(&examples[1], "a").await["stock"], 1);
    let mut bought = 0;
    let mut busy = 0;
    for buy in buys {
        let resp = buy.await.unwrap();
        match resp.status().as_u16() {
            200 => bought += 1,
            503 => {
                assert_eq!(resp.headers()["retry-after"], "1");
                assert_eq!(resp.headers()["content-type"], "application/problem+json");
                busy += 1;
            }
            other => panic!("unexpected {other}: {}", resp.text().await.unwrap()),
        }
    }
    assert!(
        (1..=2).contains(&bought),
        "{bought} buys ran at once, over MAX_CONCURRENT_BUYS=2"
    );
    assert_eq!(bought + busy, items.len());
    // Once they are done, the next buy gets in.
    let resp = post_to(&client, format!("{}/items/f/buy", examples[0].base)).await;
    assert!(matches!(resp.status().as_u16(), 200 | 410));
}

/// The value of the sample `name{labels}` in a Prometheus text exposition (0 when absent).
/// `labels` as the exporter writes them: `result="acquired"`.
fn sample(text: &str, name: &str, labels: &str) -> u64 {
    let series = format!("{name}{{{labels}}} ");
    text.lines()
        .find_map(|line| line.strip_prefix(&series))
        .map_or(0, |value| value.trim().parse().unwrap())
}

#[tokio::test]
async fn example_metrics_count_the_answers_the_clients_saw() {
    let nodes = nodes(3);
    let example = start_example(&nodes, 50, true).await;
    put_stock(&example, "m-1", 3).await;
    let client = reqwest::Client::new();

    // Buyers at once on one item: 200 (bought), 423 (another buy holds it), 410 (sold out).
    let buy = format!("{}/items/m-1/buy", example.base);
    let buys = futures_util::future::join_all(
        (0..12).map(|_| async { client.post(&buy).send().await.unwrap().status().as_u16() }),
    )
    .await;
    let mut buys_seen = std::collections::BTreeMap::<u16, u64>::new();
    for status in buys {
        *buys_seen.entry(status).or_default() += 1;
    }
    // Then, one at a time, until the stock is gone: every answer is 200 or 410.
    for _ in 0..5 {
        let status = client.post(&buy).send().await.unwrap().status().as_u16();
        *buys_seen.entry(status).or_default() += 1;
    }
    assert!(buys_seen.contains_key(&410), "{buys_seen:?}");

    // Orders: new, replayed, mismatched, missing key.
    let orders = format!("{}/orders", example.base);
    let order = |key: Option<&'static str>, body: &'static str| {
        let mut request = client.post(&orders).body(body);
        if let Some(key) = key {
            request = request.header("Idempotency-Key", key);
        }
        async move { request.send().await.unwrap().status().as_u16() }
    };
    assert_eq!(order(Some("m-order"), "{\"n\":1}").await, 201);
    assert_eq!(order(Some("m-order"), "{\"n\":1}").await, 201);
    assert_eq!(order(Some("m-order"), "{\"n\":2}").await, 422);
    assert_eq!(order(None, "{}").await, 400);

    let text = reqwest::get(format!("{}/metrics", example.base))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let responses = |route: &str, status: u16| {
        sample(
            &text,
            "flash_sale_http_responses_total",
            &format!("route=\"{route}\",status=\"{status}\""),
        )
    };
    for (status, seen) in &buys_seen {
        assert_eq!(responses("/items/{item_id}/buy", *status), *seen, "{text}");
    }
    assert_eq!(responses("/items/{item_id}", 200), 1, "{text}");
    assert_eq!(responses("/orders", 201), 2, "{text}");
    assert_eq!(responses("/orders", 422), 1, "{text}");
    assert_eq!(responses("/orders", 400), 1, "{text}");

    // The lock layer's view of the same buys: each 200 and 410 ran holding the lock.
    let locked = buys_seen.get(&200).copied().unwrap_or(0) + buys_seen[&410];
    let lock = |result: &str| {
        sample(
            &text,
            "tower_redlock_lock_requests_total",
            &format!("result=\"{result}\""),
        )
    };
    assert_eq!(lock("acquired"), locked, "{text}");
    assert_eq!(
        lock("taken"),
        buys_seen.get(&423).copied().unwrap_or(0),
        "{text}"
    );
    assert_eq!(lock("unavailable"), 0, "{text}");
    let idempotency = |result: &str| {
        sample(
            &text,
            "tower_redlock_idempotency_requests_total",
            &format!("result=\"{result}\""),
        )
    };
    assert_eq!(idempotency("new"), 1, "{text}");
    assert_eq!(idempotency("replayed"), 1, "{text}");
    assert_eq!(idempotency("mismatch"), 1, "{text}");
    assert_eq!(idempotency("missing"), 1, "{text}");
    assert!(
        text.contains("tower_redlock_lock_acquire_duration_seconds_bucket"),
        "{text}"
    );
}

// Accounts and transfers: `POST /transfers` locks both accounts with one lease.

async fn put_balance(example: &Example, account: &str, balance: i64) {
    let resp = reqwest::Client::new()
        .put(format!("{}/accounts/{account}", example.base))
        .json(&serde_json::json!({"balance": balance}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
}

async fn balance(example: &Example, account: &str) -> i64 {
    let body: serde_json::Value = reqwest::get(format!("{}/accounts/{account}", example.base))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(body["account_id"], account, "{body}");
    body["balance"].as_i64().unwrap()
}

async fn post_transfer(
    client: &reqwest::Client,
    example: &Example,
    from: &str,
    to: &str,
    amount: i64,
) -> reqwest::Response {
    client
        .post(format!("{}/transfers", example.base))
        .json(&serde_json::json!({"from": from, "to": to, "amount": amount}))
        .send()
        .await
        .unwrap()
}

/// A transfer between every pair of `accounts`, both ways round, with amounts that
/// overdraw some accounts at times.
fn every_pair<'a>(accounts: &[&'a str]) -> Vec<(&'a str, &'a str, i64)> {
    let mut transfers = Vec::new();
    for (i, from) in accounts.iter().enumerate() {
        for (j, to) in accounts.iter().enumerate() {
            if i != j {
                transfers.push((*from, *to, 30 + ((i * 7 + j * 13) % 50) as i64));
            }
        }
    }
    transfers
}

/// Runs the transfers at once, alternating between the examples; each retries while it
/// gets 423. Returns how many moved money (200) and how many lacked the funds (409).
async fn run_transfers(examples: &[Example], transfers: &[(&str, &str, i64)]) -> (usize, usize) {
    run_transfers_retrying(examples, transfers, &[423]).await
}

/// [`run_transfers`], retrying on each status of `retry`.
async fn run_transfers_retrying(
    examples: &[Example],
    transfers: &[(&str, &str, i64)],
    retry: &'static [u16],
) -> (usize, usize) {
    let client = reqwest::Client::new();
    let mut tasks = Vec::new();
    for (i, (from, to, amount)) in transfers.iter().enumerate() {
        let url = format!("{}/transfers", examples[i % examples.len()].base);
        let body = serde_json::json!({"from": from, "to": to, "amount": amount});
        let client = client.clone();
        tasks.push(tokio::spawn(async move {
            for _ in 0..2000 {
                let resp = client.post(&url).json(&body).send().await.unwrap();
                match resp.status().as_u16() {
                    200 => return true,
                    409 => return false,
                    status if retry.contains(&status) => {
                        tokio::time::sleep(Duration::from_millis(5)).await;
                    }
                    other => panic!("unexpected {other}: {}", resp.text().await.unwrap()),
                }
            }
            panic!("a transfer never got an answer other than {retry:?}");
        }));
    }
    let (mut moved, mut refused) = (0, 0);
    for task in tasks {
        if task.await.unwrap() {
            moved += 1;
        } else {
            refused += 1;
        }
    }
    (moved, refused)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn example_transfers_keep_the_total_across_two_processes_and_a_node_fault() {
    let mut nodes = nodes(3);
    let examples = [
        start_example(&nodes, 10, true).await,
        start_example(&nodes, 10, true).await,
    ];
    let accounts = ["a", "b", "c", "d"];
    for account in accounts {
        put_balance(&examples[0], account, 100).await;
    }
    let transfers = every_pair(&accounts);
    let (moved, refused) = run_transfers(&examples, &transfers).await;
    assert!(moved > 0, "{moved} moved, {refused} refused");
    // A minority of lock nodes gone (not the one with the balances): still exclusive.
    nodes[2].kill();
    let (more, _) = run_transfers(&examples, &transfers).await;
    assert!(more > 0);
    let mut total = 0;
    for account in accounts {
        let balance = balance(&examples[1], account).await;
        assert!(balance >= 0, "{account} went negative: {balance}");
        total += balance;
    }
    assert_eq!(total, 400, "money was lost or made");
}

#[tokio::test]
async fn example_transfers_without_locking_lose_money() {
    // The control for the test above: concurrent transfers into one account, without the
    // lock, overwrite each other's credit.
    let nodes = nodes(1);
    let examples = [
        start_example(&nodes, 300, false).await,
        start_example(&nodes, 300, false).await,
    ];
    let sources = ["s0", "s1", "s2", "s3", "s4", "s5"];
    for source in sources {
        put_balance(&examples[0], source, 100).await;
    }
    put_balance(&examples[0], "hub", 0).await;
    let transfers: Vec<_> = sources.iter().map(|s| (*s, "hub", 10)).collect();
    let (moved, _) = run_transfers(&examples, &transfers).await;
    assert_eq!(moved, sources.len());
    let mut total = balance(&examples[1], "hub").await;
    for source in sources {
        total += balance(&examples[1], source).await;
    }
    assert!(total < 600, "no money lost without a lock: {total}");
}

#[tokio::test]
async fn example_transfer_answers() {
    let nodes = nodes(3);
    let example = start_example(&nodes, 10, true).await;
    put_balance(&example, "x", 50).await;
    put_balance(&example, "y", 5).await;
    let client = reqwest::Client::new();
    for (from, to, amount) in [("x", "x", 5), ("x", "y", 0), ("x", "y", -3)] {
        let resp = post_transfer(&client, &example, from, to, amount).await;
        assert_eq!(resp.status(), 400, "{from} -> {to}: {amount}");
        assert_eq!(resp.headers()["content-type"], "application/problem+json");
    }
    let not_json = client
        .post(format!("{}/transfers", example.base))
        .header("content-type", "application/json")
        .body("{\"from\": \"x\"")
        .send()
        .await
        .unwrap();
    assert_eq!(not_json.status(), 400);

    let short = post_transfer(&client, &example, "y", "x", 6).await;
    assert_eq!(short.status(), 409);
    assert_eq!(short.headers()["content-type"], "application/problem+json");

    let done = post_transfer(&client, &example, "x", "y", 20).await;
    assert_eq!(done.status(), 200);
    let body: serde_json::Value = done.json().await.unwrap();
    assert_eq!(
        body,
        serde_json::json!({
            "amount": 20,
            "from": {"account_id": "x", "balance": 30},
            "to": {"account_id": "y", "balance": 25},
        })
    );

    // Either account held by someone else: 423 with Retry-After, whichever side it is.
    let other = tower_redlock::Locks::from(
        tower_redlock::Redlock::builder(urls(&nodes))
            .ttl(Duration::from_secs(20))
            .build()
            .await
            .unwrap(),
    );
    let held = other.try_lock("account:y").await.unwrap();
    for (from, to) in [("x", "y"), ("y", "x")] {
        let resp = post_transfer(&client, &example, from, to, 1).await;
        assert_eq!(resp.status(), 423, "{from} -> {to}");
        let retry_after = retry_after(&resp);
        assert!((15..=20).contains(&retry_after), "{retry_after}");
    }
    other.unlock(held).await.unwrap();
    assert_eq!(
        post_transfer(&client, &example, "y", "x", 1).await.status(),
        200
    );
    assert_eq!(balance(&example, "x").await, 31);
    assert_eq!(balance(&example, "y").await, 24);
}

/// The flash sale with the locks, the stock and the rate limit on one Redis Cluster
/// (`REDIS_CLUSTER`), and the stock's shard failed over (`CLUSTER FAILOVER`) mid-sale.
/// Buyers retry on 423 and on 503 (nothing sold while the shard moves).
#[cfg(feature = "cluster-async")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn flash_sale_on_a_cluster_sells_exactly_the_stock_through_a_failover() {
    let cluster = support::topology::Cluster::start(3);
    let urls = cluster.urls().join(",");
    // The rate limit is counted on the cluster too, high enough never to reject.
    let env = [
        ("REDIS_CLUSTER", urls.as_str()),
        ("RATE_LIMIT", "100000/60"),
    ];
    let examples = [
        start_example_with(&[], 100, true, &env).await,
        start_example_with(&[], 100, true, &env).await,
    ];
    put_stock(&examples[0], "tv", 20).await;
    let client = reqwest::Client::new();
    let buyers: Vec<_> = (0..40)
        .map(|i| {
            let url = format!("{}/items/tv/buy", examples[i % 2].base);
            let client = client.clone();
            tokio::spawn(async move {
                for _ in 0..4000 {
                    let resp = client.post(&url).send().await.unwrap();
                    match resp.status().as_u16() {
                        200 => return true,
                        410 => return false,
                        423 | 503 => tokio::time::sleep(Duration::from_millis(5)).await,
                        other => panic!("unexpected {other}: {}", resp.text().await.unwrap()),
                    }
                }
                panic!("buyer never got an answer other than 423 or 503");
            })
        })
        .collect();
    let started = eventually(Duration::from_secs(30), || async {
        item(&examples[1], "tv").await["sold"].as_i64() >= Some(3)
    })
    .await;
    assert!(started, "the sale started");
    assert!(
        item(&examples[1], "tv").await["sold"].as_i64() < Some(20),
        "the failover starts mid-sale"
    );
    let cluster = tokio::task::spawn_blocking(move || {
        cluster.failover("flash_sale:tv:stock");
        cluster
    })
    .await
    .unwrap();
    let mut bought = 0;
    for buyer in buyers {
        bought += usize::from(buyer.await.unwrap());
    }
    assert_eq!(bought, 20);
    let counts = item(&examples[1], "tv").await;
    assert_eq!(counts["stock"], 0, "{counts}");
    assert_eq!(counts["sold"], 20, "{counts}");
    drop(cluster);
}

/// `/transfers` on a Redis Cluster (`REDIS_CLUSTER`): each transfer locks two accounts
/// whose keys lie in different slots, taken slot by slot; a shard that holds some of
/// the accounts' locks fails over (`CLUSTER FAILOVER`) while transfers run, and the total
/// is kept. The balances are chosen to live on another shard than the one failed over,
/// so that the example's own two writes per transfer (not atomic, on purpose) are not
/// what the failover interrupts. Transfers retry on 423 and on 503.
#[cfg(feature = "cluster-async")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn example_transfers_keep_the_total_on_a_cluster_through_a_failover() {
    let cluster = support::topology::Cluster::start(3);
    let urls = cluster.urls().join(",");
    let env = [("REDIS_CLUSTER", urls.as_str())];
    let examples = [
        start_example_with(&[], 10, true, &env).await,
        start_example_with(&[], 10, true, &env).await,
    ];
    let lock_shard = |account: &str| {
        cluster
            .shard_of(&format!("tower-redlock:account:{account}"))
            .0
    };
    let data_shard = |account: &str| cluster.shard_of(&format!("flash_sale:account:{account}")).0;
    // Four accounts whose balances share one shard, and whose locks lie on at least
    // two shards, one of them another than the balances'.
    let names: Vec<String> = (0..400).map(|i| format!("n{i}")).collect();
    let data = data_shard(&names[0]);
    let candidates: Vec<&String> = names
        .iter()
        .filter(|name| data_shard(name) == data)
        .take(12)
        .collect();
    let moving = candidates
        .iter()
        .find(|name| lock_shard(name) != data)
        .expect("an account whose lock is on another shard than the balances");
    let failed_over = lock_shard(moving);
    let mut accounts = vec![moving.as_str()];
    accounts.extend(
        candidates
            .iter()
            .filter(|name| *name != moving)
            .take(3)
            .map(|name| name.as_str()),
    );
    for account in &accounts {
        put_balance(&examples[0], account, 100).await;
    }
    let transfers = every_pair(&accounts);
    let (moved, _) = run_transfers_retrying(&examples, &transfers, &[423, 503]).await;
    assert!(moved > 0);
    // The failover in the middle of a second run of transfers.
    assert_eq!(lock_shard(moving), failed_over);
    let key = format!("tower-redlock:account:{moving}");
    let failover = tokio::task::spawn_blocking(move || {
        cluster.failover(&key);
        cluster
    });
    // Rounds of transfers while the shard moves, and one after.
    let mut during = 0;
    while !failover.is_finished() {
        during += run_transfers_retrying(&examples, &transfers, &[423, 503])
            .await
            .0;
    }
    let cluster = failover.await.unwrap();
    let (after, _) = run_transfers_retrying(&examples, &transfers, &[423, 503]).await;
    assert!(during + after > 0);
    let mut total = 0;
    for account in &accounts {
        let balance = balance(&examples[1], account).await;
        assert!(balance >= 0, "{account} went negative: {balance}");
        total += balance;
    }
    assert_eq!(total, 400, "money was lost or made");
    drop(cluster);
}
