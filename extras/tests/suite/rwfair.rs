//! Shared and exclusive access (`LockLayer::shared`, `exclusive`) and fair waiting
//! (`LockLayer::fair`), on real Redis nodes and over real HTTP, with node faults.

use crate::support;

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::Router;
use axum::routing::{get, post};
use support::{RedisNode, eventually, nodes, redlock, serve, urls};
use tokio::sync::Semaphore;
use tower_redlock::{LockError, LockLayer, Locks, Redlock};
use tower_redlock::{LockMode, LockRequest};

/// A service whose handlers count themselves in and hold until the gate lets them out.
struct App {
    base: String,
    entered: Arc<AtomicUsize>,
    gate: Arc<Semaphore>,
    http: reqwest::Client,
}

impl App {
    async fn start(locks: Locks) -> Self {
        let entered = Arc::new(AtomicUsize::new(0));
        let gate = Arc::new(Semaphore::new(0));
        let handler = {
            let (entered, gate) = (entered.clone(), gate.clone());
            move || {
                let (entered, gate) = (entered.clone(), gate.clone());
                async move {
                    entered.fetch_add(1, Ordering::SeqCst);
                    gate.acquire().await.unwrap().forget();
                    "done"
                }
            }
        };
        let layer = || {
            LockLayer::by_path_param("doc")
                .scope("doc")
                .backend(locks.clone())
        };
        let app = Router::new()
            .route(
                "/read/{doc}",
                get(handler.clone()).layer(layer().mode(LockMode::Shared)),
            )
            .route(
                "/write/{doc}",
                post(handler.clone()).layer(layer().mode(LockMode::Exclusive)),
            )
            .route(
                "/fair/{doc}",
                post(handler).layer(
                    layer()
                        .mode(LockMode::Fair)
                        .max_wait(Duration::from_secs(5)),
                ),
            );
        Self {
            base: serve(app).await,
            entered,
            gate,
            http: reqwest::Client::new(),
        }
    }

    async fn read(&self, doc: &str) -> reqwest::Response {
        let url = format!("{}/read/{doc}", self.base);
        self.http.get(url).send().await.unwrap()
    }

    async fn write(&self, doc: &str) -> reqwest::Response {
        let url = format!("{}/write/{doc}", self.base);
        self.http.post(url).send().await.unwrap()
    }

    fn spawn(&self, path: &str) -> tokio::task::JoinHandle<u16> {
        let (http, url) = (self.http.clone(), format!("{}{path}", self.base));
        let read = path.starts_with("/read");
        tokio::spawn(async move {
            let request = if read { http.get(url) } else { http.post(url) };
            request.send().await.unwrap().status().as_u16()
        })
    }

    async fn entered(&self, n: usize) -> bool {
        eventually(Duration::from_secs(5), || async {
            self.entered.load(Ordering::SeqCst) == n
        })
        .await
    }
}

/// Readers hold `doc` together, and a writer is refused until the last has left.
async fn readers_together_writer_refused(app: &App, doc: &str) {
    let before = app.entered.load(Ordering::SeqCst);
    let readers = [
        app.spawn(&format!("/read/{doc}")),
        app.spawn(&format!("/read/{doc}")),
    ];
    assert!(app.entered(before + 2).await, "both readers hold the key");
    let refused = app.write(doc).await;
    assert_eq!(refused.status(), 423, "a writer while readers hold");
    assert!(refused.headers().contains_key("retry-after"));
    app.gate.add_permits(2);
    for reader in readers {
        assert_eq!(reader.await.unwrap(), 200);
    }
    app.gate.add_permits(1);
    assert_eq!(app.write(doc).await.status(), 200, "free once they left");
}

/// A writer in flight keeps readers out.
async fn writer_excludes_readers(app: &App, doc: &str) {
    let before = app.entered.load(Ordering::SeqCst);
    let writer = app.spawn(&format!("/write/{doc}"));
    assert!(app.entered(before + 1).await);
    let refused = app.read(doc).await;
    assert_eq!(refused.status(), 423, "a reader while the writer holds");
    assert_eq!(app.write(doc).await.status(), 423, "a second writer");
    app.gate.add_permits(1);
    assert_eq!(writer.await.unwrap(), 200);
    app.gate.add_permits(1);
    assert_eq!(app.read(doc).await.status(), 200);
}

#[tokio::test]
async fn readers_hold_together_and_a_writer_waits_for_them_all() {
    let nodes = nodes(3);
    let app = App::start(redlock(&nodes, Duration::from_secs(10)).await).await;
    readers_together_writer_refused(&app, "report").await;
}

#[tokio::test]
async fn writer_excludes_readers_and_other_writers() {
    let nodes = nodes(3);
    let app = App::start(redlock(&nodes, Duration::from_secs(10)).await).await;
    writer_excludes_readers(&app, "ledger").await;
}

#[tokio::test]
async fn in_process_backend_has_the_same_modes() {
    let app = App::start(Locks::from(tower_redlock::MemoryLocks::new())).await;
    readers_together_writer_refused(&app, "report").await;
    writer_excludes_readers(&app, "ledger").await;
}

#[tokio::test]
async fn crashed_reader_expires_at_its_ttl() {
    let nodes = nodes(3);
    let ttl = Duration::from_millis(800);
    let r = redlock(&nodes, ttl).await;
    // Taken and never released nor renewed: the reader "crashed".
    let crashed = r
        .acquire(
            LockRequest::new("crash")
                .mode(LockMode::Shared)
                .wait(Duration::ZERO),
        )
        .await
        .unwrap();
    assert!(crashed.is_shared());
    assert!(matches!(
        r.acquire(
            LockRequest::new("crash")
                .mode(LockMode::Exclusive)
                .wait(Duration::ZERO)
        )
        .await,
        Err(LockError::Taken { .. })
    ));
    let start = Instant::now();
    let writer = r
        .acquire(
            LockRequest::new("crash")
                .mode(LockMode::Exclusive)
                .wait(Duration::from_secs(5)),
        )
        .await
        .expect("the writer gets the key once the reader's TTL ran out");
    assert!(start.elapsed() < ttl + Duration::from_secs(2));
    // The readers' set went with its last reader.
    for node in &nodes {
        assert!(!support::exists(node, "tower-redlock:{tower-redlock:crash}:readers").await);
    }
    assert!(matches!(
        r.unlock(crashed).await,
        Err(LockError::Expired { .. })
    ));
    r.unlock(writer).await.unwrap();
}

#[tokio::test]
async fn shared_leases_are_renewed_and_released_like_any_lease() {
    let nodes = nodes(3);
    let r = redlock(&nodes, Duration::from_millis(600)).await;
    let mut lease = r
        .acquire(
            LockRequest::new("renewed")
                .mode(LockMode::Shared)
                .wait(Duration::ZERO),
        )
        .await
        .unwrap();
    for _ in 0..4 {
        tokio::time::sleep(Duration::from_millis(250)).await;
        r.extend(&mut lease).await.expect("renewed before its TTL");
    }
    // Past the first TTL, still a reader: a writer is refused.
    assert!(matches!(
        r.acquire(
            LockRequest::new("renewed")
                .mode(LockMode::Exclusive)
                .wait(Duration::ZERO)
        )
        .await,
        Err(LockError::Taken { .. })
    ));
    r.unlock(lease).await.unwrap();
    let writer = r
        .acquire(
            LockRequest::new("renewed")
                .mode(LockMode::Exclusive)
                .wait(Duration::ZERO),
        )
        .await
        .unwrap();
    r.unlock(writer).await.unwrap();
}

#[tokio::test]
async fn a_waiting_writer_is_not_starved_by_a_stream_of_readers() {
    not_starved(true).await;
}

#[tokio::test]
async fn a_waiting_writer_is_not_starved_without_release_notifications() {
    not_starved(false).await;
}

async fn not_starved(notify: bool) {
    let nodes = nodes(3);
    let r = Locks::from(
        Redlock::builder(urls(&nodes))
            .node_timeout(Duration::from_millis(200))
            .notify_waiters(notify)
            .build()
            .await
            .unwrap(),
    );
    let stop = Arc::new(AtomicBool::new(false));
    let refused = Arc::new(AtomicUsize::new(0));
    let admitted = Arc::new(AtomicUsize::new(0));
    // Three overlapping streams of readers, each holding 150 ms: the key is never free
    // of readers unless new ones are kept out.
    let mut streams = Vec::new();
    for i in 0..3u64 {
        let (r, stop, refused, admitted) =
            (r.clone(), stop.clone(), refused.clone(), admitted.clone());
        streams.push(tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(50 * i)).await;
            while !stop.load(Ordering::SeqCst) {
                match r
                    .acquire(
                        LockRequest::new("hot")
                            .mode(LockMode::Shared)
                            .wait(Duration::ZERO),
                    )
                    .await
                {
                    Ok(lease) => {
                        admitted.fetch_add(1, Ordering::SeqCst);
                        tokio::time::sleep(Duration::from_millis(150)).await;
                        r.unlock(lease).await.unwrap();
                    }
                    Err(LockError::Taken { .. }) => {
                        refused.fetch_add(1, Ordering::SeqCst);
                        tokio::time::sleep(Duration::from_millis(10)).await;
                    }
                    Err(e) => panic!("{e}"),
                }
            }
        }));
    }
    let started = eventually(Duration::from_secs(5), || async {
        admitted.load(Ordering::SeqCst) >= 3
    })
    .await;
    assert!(started);
    let start = Instant::now();
    let writer = r
        .acquire(
            LockRequest::new("hot")
                .mode(LockMode::Exclusive)
                .wait(Duration::from_secs(5)),
        )
        .await;
    let waited = start.elapsed();
    stop.store(true, Ordering::SeqCst);
    let writer = writer.expect("the writer gets in despite the readers");
    assert!(
        refused.load(Ordering::SeqCst) > 0,
        "readers were kept out while the writer waited"
    );
    r.unlock(writer).await.unwrap();
    for stream in streams {
        stream.await.unwrap();
    }
    assert!(waited < Duration::from_secs(5));
}

/// Waiters on `resource` over `clients`, started one after another once the previous one
/// is queued on every node, while `holder` holds it; the order they acquired in.
async fn fair_order(
    nodes: &[RedisNode],
    clients: &[Locks],
    resource: &str,
    n: usize,
) -> Vec<usize> {
    let queue = format!("tower-redlock:{{tower-redlock:{resource}}}:queue");
    let holder = clients[0].try_lock(resource).await.unwrap();
    let order = Arc::new(Mutex::new(Vec::new()));
    let mut waiters = Vec::new();
    for i in 0..n {
        let (client, order) = (clients[i % clients.len()].clone(), order.clone());
        let resource = resource.to_owned();
        waiters.push(tokio::spawn(async move {
            let lease = client
                .acquire(
                    LockRequest::new(&resource)
                        .mode(LockMode::Fair)
                        .wait(Duration::from_secs(20)),
                )
                .await
                .unwrap();
            order.lock().unwrap().push(i);
            client.unlock(lease).await.unwrap();
        }));
        let queued = eventually(Duration::from_secs(5), || async {
            let mut all = true;
            for node in nodes {
                all &= zcard(node, &queue).await == i + 1;
            }
            all
        })
        .await;
        assert!(queued, "waiter {i} queued on every node");
    }
    clients[0].unlock(holder).await.unwrap();
    for waiter in waiters {
        waiter.await.unwrap();
    }
    order.lock().unwrap().clone()
}

async fn zcard(node: &RedisNode, key: &str) -> usize {
    let mut conn = node.conn().await;
    redis::cmd("ZCARD")
        .arg(key)
        .query_async(&mut conn)
        .await
        .unwrap()
}

#[tokio::test]
async fn fair_waiters_over_two_clients_acquire_in_arrival_order() {
    let nodes = nodes(3);
    let ttl = Duration::from_secs(10);
    let clients = [redlock(&nodes, ttl).await, redlock(&nodes, ttl).await];
    let order = fair_order(&nodes, &clients, "fifo", 6).await;
    assert_eq!(order, vec![0, 1, 2, 3, 4, 5]);
    for node in &nodes {
        assert_eq!(
            zcard(node, "tower-redlock:{tower-redlock:fifo}:queue").await,
            0
        );
    }
}

#[tokio::test]
async fn fair_waiting_over_http_admits_the_queued_request() {
    let nodes = nodes(3);
    let r = redlock(&nodes, Duration::from_secs(10)).await;
    let app = App::start(r.clone()).await;
    let holder = r.try_lock("doc:turn").await.unwrap();
    let waiter = app.spawn("/fair/turn");
    let queued = eventually(Duration::from_secs(5), || async {
        zcard(&nodes[0], "tower-redlock:{tower-redlock:doc:turn}:queue").await == 1
    })
    .await;
    assert!(queued);
    r.unlock(holder).await.unwrap();
    assert!(app.entered(1).await, "the queued request runs");
    app.gate.add_permits(1);
    assert_eq!(waiter.await.unwrap(), 200);
}

/// Starts a fair waiter in a runtime of its own (another replica), waits until it is
/// queued, and then stops that runtime at once: the waiter "crashes" without leaving.
fn crash_a_waiter(nodes: &[RedisNode], resource: &str, max_wait: Duration) {
    let urls = urls(nodes);
    let resource = resource.to_owned();
    let (queued_tx, queued_rx) = std::sync::mpsc::channel();
    let queue = format!("tower-redlock:{{tower-redlock:{resource}}}:queue");
    let probe = nodes[0].url();
    std::thread::spawn(move || {
        let rt = tokio::runtime::Runtime::new().unwrap();
        let r = rt.block_on(async {
            Locks::from(
                Redlock::builder(urls)
                    .node_timeout(Duration::from_millis(200))
                    .build()
                    .await
                    .unwrap(),
            )
        });
        rt.spawn(async move {
            let _ = r
                .acquire(
                    LockRequest::new(&resource)
                        .mode(LockMode::Fair)
                        .wait(max_wait),
                )
                .await;
        });
        let client = redis::Client::open(probe).unwrap();
        let mut conn = client.get_connection().unwrap();
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            let n: usize = redis::cmd("ZCARD").arg(&queue).query(&mut conn).unwrap();
            if n > 0 {
                break;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        rt.shutdown_background();
        queued_tx.send(()).unwrap();
    });
    queued_rx.recv().unwrap();
}

#[tokio::test]
async fn a_crashed_waiter_leaves_the_queue_within_the_bound() {
    let nodes = nodes(3);
    let r = redlock(&nodes, Duration::from_secs(10)).await;
    let holder = r.try_lock("stuck").await.unwrap();
    crash_a_waiter(&nodes, "stuck", Duration::from_secs(60));
    let queue = "tower-redlock:{tower-redlock:stuck}:queue";
    assert_eq!(
        zcard(&nodes[0], queue).await,
        1,
        "the crashed waiter is queued"
    );
    // The next waiter queues behind it; the lock frees; the crashed head drops out within
    // its entry's lifetime (2 s plus the node timeout), and the next one gets the lock.
    let next = tokio::spawn({
        let r = r.clone();
        async move {
            r.acquire(
                LockRequest::new("stuck")
                    .mode(LockMode::Fair)
                    .wait(Duration::from_secs(10)),
            )
            .await
        }
    });
    let behind = eventually(Duration::from_secs(5), || async {
        zcard(&nodes[0], queue).await == 2
    })
    .await;
    assert!(behind);
    let released = Instant::now();
    r.unlock(holder).await.unwrap();
    let lease = next.await.unwrap().expect("the next waiter gets the lock");
    let took = released.elapsed();
    assert!(took < Duration::from_millis(3500), "{took:?}");
    r.unlock(lease).await.unwrap();
    // A node that the next waiter's quorum did not need may keep the crashed entry until
    // its deadline, and the next waiter's own until its leave lands.
    let empty = eventually(Duration::from_secs(3), || async {
        let mut none = true;
        for node in &nodes {
            none &= zcard(node, queue).await == 0;
        }
        none
    })
    .await;
    assert!(empty, "entries left in the queue past their lifetime");
}

#[tokio::test]
async fn a_queue_entry_never_outlives_its_waiters_deadline() {
    let nodes = nodes(3);
    let r = redlock(&nodes, Duration::from_secs(10)).await;
    let _holder = r.try_lock("short").await.unwrap();
    let max_wait = Duration::from_millis(400);
    crash_a_waiter(&nodes, "short", max_wait);
    let gone = eventually(max_wait + Duration::from_millis(600), || async {
        let mut none = true;
        for node in &nodes {
            none &= zcard(node, "tower-redlock:{tower-redlock:short}:queue").await == 0;
        }
        none
    })
    .await;
    assert!(gone, "the entry outlived its waiter's max_wait");
}

#[tokio::test]
async fn a_waiter_that_gives_up_leaves_the_queue_at_once() {
    let nodes = nodes(3);
    let r = redlock(&nodes, Duration::from_secs(10)).await;
    let _holder = r.try_lock("bored").await.unwrap();
    let waiter = tokio::spawn({
        let r = r.clone();
        async move {
            r.acquire(
                LockRequest::new("bored")
                    .mode(LockMode::Fair)
                    .wait(Duration::from_secs(30)),
            )
            .await
        }
    });
    let queue = "tower-redlock:{tower-redlock:bored}:queue";
    assert!(
        eventually(Duration::from_secs(5), || async {
            zcard(&nodes[0], queue).await == 1
        })
        .await
    );
    waiter.abort();
    let left = eventually(Duration::from_secs(1), || async {
        let mut none = true;
        for node in &nodes {
            none &= zcard(node, queue).await == 0;
        }
        none
    })
    .await;
    assert!(left, "a cancelled waiter left its entries behind");
}

#[tokio::test]
async fn minority_killed_every_mode_is_still_exclusive() {
    let mut nodes = nodes(3);
    nodes[2].kill();
    let r = redlock(&nodes, Duration::from_secs(10)).await;
    let app = App::start(r.clone()).await;
    readers_together_writer_refused(&app, "minority-rw").await;
    writer_excludes_readers(&app, "minority-w").await;
    let holder = r
        .acquire(
            LockRequest::new("minority-fair")
                .mode(LockMode::Fair)
                .wait(Duration::ZERO),
        )
        .await
        .unwrap();
    assert!(matches!(
        r.acquire(
            LockRequest::new("minority-fair")
                .mode(LockMode::Fair)
                .wait(Duration::ZERO)
        )
        .await,
        Err(LockError::Taken { .. })
    ));
    let order = {
        r.unlock(holder).await.unwrap();
        fair_order(&nodes[..2], std::slice::from_ref(&r), "minority-order", 3).await
    };
    assert_eq!(order, vec![0, 1, 2]);
}

#[tokio::test]
async fn majority_gone_every_mode_answers_503() {
    let mut nodes = nodes(3);
    let r = redlock(&nodes, Duration::from_secs(10)).await;
    let app = App::start(r.clone()).await;
    nodes[1].kill();
    nodes[2].kill();
    assert_eq!(app.read("gone").await.status(), 503);
    assert_eq!(app.write("gone").await.status(), 503);
    let fair = app.spawn("/fair/gone").await.unwrap();
    assert_eq!(fair, 503);
    assert!(matches!(
        r.acquire(
            LockRequest::new("gone")
                .mode(LockMode::Shared)
                .wait(Duration::ZERO)
        )
        .await,
        Err(LockError::NoQuorum { .. })
    ));
    assert_eq!(app.entered.load(Ordering::SeqCst), 0, "no handler ran");
}
