//! A Redis Cluster (3 primaries, 3 replicas, made with `redis-cli --cluster create`) as a
//! Redlock node and as the rate limiter's store, with a replica promoted by `CLUSTER
//! FAILOVER` mid-test.
#![cfg(feature = "cluster-async")]

use crate::support;

use std::collections::HashSet;
use std::time::{Duration, Instant};

use support::topology::{Cluster, cli};
use support::{nodes, urls};
use tower_redlock::{LockError, Node, Quota, RedisRateLimiter, Redlock};
use tower_redlock::{LockRequest, Locks};

async fn on_cluster(cluster: &Cluster) -> Locks {
    let redlock = Redlock::from_nodes([Node::cluster(cluster.urls())])
        .ttl(Duration::from_secs(10))
        .node_timeout(Duration::from_millis(500))
        .fencing_tokens(true)
        .build()
        .await
        .unwrap();
    // The whole cluster is one Redlock node.
    assert_eq!(redlock.node_count(), 1);
    Locks::from(redlock)
}

/// The keys every primary holds now.
fn primaries_with_keys(cluster: &Cluster) -> usize {
    cluster
        .servers
        .iter()
        .filter(|s| s.cli(&["ROLE"]).starts_with("master"))
        .filter(|s| s.cli(&["DBSIZE"]).trim().parse::<u64>().unwrap_or(0) > 0)
        .count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_is_one_redlock_node_with_keys_on_every_shard_and_locks_survive_a_failover() {
    let cluster = Cluster::start(3);
    let redlock = on_cluster(&cluster).await;

    // Locks on 30 keys spread over the three shards, each with its scripts (fencing
    // counter, waiters' mark) in its own slot.
    let mut leases = Vec::new();
    for i in 0..30 {
        leases.push(redlock.lock(&format!("item:{i}")).await.unwrap());
    }
    assert_eq!(primaries_with_keys(&cluster), 3, "keys on every shard");
    let tokens: HashSet<_> = leases.iter().map(|l| l.fencing_token()).collect();
    assert!(tokens.iter().all(|t| t.is_some()));
    assert!(matches!(
        redlock.try_lock("item:7").await,
        Err(LockError::Taken { .. })
    ));

    // The shard of item:7 fails over while the lease is held: the coordinated failover
    // hands the lock to the new primary, which keeps it.
    let lease = leases.swap_remove(7);
    let key = format!("{}item:7", redlock.prefix());
    let new_primary = cluster.failover(&key);
    assert_eq!(cli(new_primary, &["EXISTS", &key]).trim(), "1");
    let taken = loop {
        match redlock.try_lock("item:7").await {
            Err(LockError::NoQuorum { .. }) => tokio::task::yield_now().await,
            other => break other,
        }
    };
    assert!(matches!(taken, Err(LockError::Taken { .. })), "{taken:?}");
    let mut lease = lease;
    redlock.extend(&mut lease).await.unwrap();
    redlock.unlock(lease).await.unwrap();
    assert_eq!(cli(new_primary, &["EXISTS", &key]).trim(), "0");
    let again = redlock.try_lock("item:7").await.unwrap();
    assert!(again.fencing_token() > Some(0));
    for lease in leases {
        redlock.unlock(lease).await.unwrap();
    }
    redlock.unlock(again).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_on_a_cluster_is_woken_by_the_release() {
    let cluster = Cluster::start(3);
    let client = || {
        Redlock::from_nodes([Node::cluster(cluster.urls())])
            // A long TTL: only a release (or the 1 s fallback) frees the lock in time.
            .ttl(Duration::from_secs(30))
            .build()
    };
    let redlock = Locks::from(client().await.unwrap());
    // The holder is another client (another replica): a waiter behind a holder of its
    // own process queues in process and never touches Redis.
    let holder = Locks::from(client().await.unwrap());
    let held = holder.lock("report").await.unwrap();
    let waiter = {
        let redlock = redlock.clone();
        tokio::spawn(async move {
            let lease = redlock
                .acquire(LockRequest::new("report").wait(Duration::from_secs(20)))
                .await;
            (lease, Instant::now())
        })
    };
    // The waiter subscribed on one seed node, and marked the lock (on its shard).
    let channel = format!("{0}{{{0}report}}:released", redlock.prefix());
    let mark = format!("{0}{{{0}report}}:waiters", redlock.prefix());
    let subscribed = support::eventually(Duration::from_secs(10), || async {
        let subscribers: u32 = cluster
            .servers
            .iter()
            .map(|s| {
                let out = s.cli(&["PUBSUB", "NUMSUB", &channel]);
                out.lines()
                    .nth(1)
                    .and_then(|n| n.trim().parse::<u32>().ok())
                    .unwrap_or(0)
            })
            .sum();
        let marked = cluster
            .servers
            .iter()
            .any(|s| s.cli(&["EXISTS", &mark]).trim() == "1");
        subscribers == 1 && marked
    })
    .await;
    assert!(
        subscribed,
        "the waiter subscribed on one node and marked the lock"
    );
    let released_at = Instant::now();
    holder.unlock(held).await.unwrap();
    let (lease, acquired_at) = waiter.await.unwrap();
    let lease = lease.unwrap();
    // The fallback timer would take 1 s: the release's PUBLISH crossed the cluster.
    let delay = acquired_at - released_at;
    assert!(
        delay < Duration::from_millis(300),
        "woken after {delay:?}, as if by the fallback timer"
    );
    redlock.unlock(lease).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redlock_over_a_cluster_and_two_single_nodes_keeps_a_quorum_without_one() {
    let cluster = Cluster::start(3);
    let mut singles = nodes(2);
    let mut list = vec![Node::cluster(cluster.urls())];
    list.extend(urls(&singles).into_iter().map(Node::url));
    let redlock = Redlock::from_nodes(list)
        .ttl(Duration::from_secs(10))
        .node_timeout(Duration::from_millis(300))
        .build()
        .await
        .unwrap();
    assert_eq!((redlock.node_count(), redlock.quorum()), (3, 2));
    let redlock = Locks::from(redlock);
    let lease = redlock.lock("invoice:1").await.unwrap();
    assert!(matches!(
        redlock.try_lock("invoice:1").await,
        Err(LockError::Taken { .. })
    ));
    redlock.unlock(lease).await.unwrap();
    singles[0].kill();
    let lease = redlock.lock("invoice:2").await.unwrap();
    redlock.unlock(lease).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_rate_limit_on_a_cluster_counts_across_shards_and_a_failover() {
    let cluster = Cluster::start(3);
    let limiter = RedisRateLimiter::from_node(Node::cluster(cluster.urls()))
        .timeout(Duration::from_millis(500))
        .build()
        .await
        .unwrap();
    let quota: Quota = "3/60".parse().unwrap();
    for client in 0..20 {
        let usage = limiter.hit(&format!("ip:{client}"), quota).await.unwrap();
        assert_eq!(usage.remaining(), 2);
    }
    assert_eq!(primaries_with_keys(&cluster), 3, "counters on every shard");
    let key = format!("{}ip:0", limiter.prefix());
    cluster.failover(&key);
    let second = loop {
        match limiter.hit("ip:0", quota).await {
            Ok(usage) => break usage,
            Err(_) => tokio::task::yield_now().await,
        }
    };
    assert_eq!(second.remaining(), 1, "the count moved with the shard");
    limiter.hit("ip:0", quota).await.unwrap();
    let over = limiter.hit("ip:0", quota).await.unwrap();
    assert!(over.remaining() == 0 && over.count() > quota.limit());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_concurrency_limit_on_a_cluster_admits_at_most_the_limit_per_key_across_shards() {
    use axum::routing::post;
    use tokio::sync::Semaphore;
    use tower_redlock::{ConcurrencyLimitLayer, RedisConcurrencyLimiter};

    let cluster = Cluster::start(3);
    let limiter = RedisConcurrencyLimiter::from_node(Node::cluster(cluster.urls()))
        .timeout(Duration::from_secs(2))
        .build()
        .await
        .unwrap();
    // Every admitted request waits at the gate until the test opens it.
    let gate = std::sync::Arc::new(Semaphore::new(0));
    let handler = {
        let gate = gate.clone();
        move || async move {
            gate.acquire().await.unwrap().forget();
            "done"
        }
    };
    let app = axum::Router::new().route(
        "/work",
        post(handler).layer(ConcurrencyLimitLayer::by_header("x-tenant", 1).backend(limiter)),
    );
    let base = support::serve(app).await;
    let client = reqwest::Client::new();
    let tenants: Vec<String> = (0..6).map(|i| format!("tenant-{i}")).collect();
    let send = |tenant: String| {
        let (client, url) = (client.clone(), format!("{base}/work"));
        tokio::spawn(async move {
            let resp = client.post(url).header("x-tenant", tenant).send().await;
            resp.unwrap().status().as_u16()
        })
    };
    // One request per tenant is admitted and waits: its permit is held on its key's shard.
    let first: Vec<_> = tenants.iter().map(|t| send(t.clone())).collect();
    let held = support::eventually(Duration::from_secs(10), || async {
        // Distinct names: a replica holds its primary's keys too.
        let mut keys = HashSet::new();
        for server in &cluster.servers {
            let found = server.cli(&["KEYS", "tower-redlock-concurrency:*"]);
            keys.extend(
                found
                    .lines()
                    .map(str::trim)
                    .filter(|l| !l.is_empty())
                    .map(str::to_owned),
            );
        }
        keys.len() == tenants.len()
    })
    .await;
    assert!(held, "each tenant's permit set is on the cluster");
    // A second request of each tenant is over its limit of 1: 503, whichever shard.
    for tenant in &tenants {
        assert_eq!(send(tenant.clone()).await.unwrap(), 503, "{tenant}");
    }
    gate.add_permits(tenants.len());
    for request in first {
        assert_eq!(request.await.unwrap(), 200);
    }
    // Released: each tenant gets in again.
    gate.add_permits(tenants.len());
    for tenant in &tenants {
        assert_eq!(send(tenant.clone()).await.unwrap(), 200, "{tenant}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_set_across_shards_is_taken_slot_by_slot_all_or_none_and_released_everywhere() {
    let cluster = Cluster::start(3);
    let locks = on_cluster(&cluster).await;
    let key = |resource: &str| format!("{}{resource}", locks.prefix());
    let shard = |resource: &str| cluster.shard_of(&key(resource)).0;
    // Two sets of three accounts, sharing `shared`, each spread over at least two shards.
    let accounts: Vec<String> = (0..40).map(|i| format!("account:{i}")).collect();
    let shared = &accounts[0];
    let pick = |skip: &[&String]| -> Vec<String> {
        let mut set = vec![shared.clone()];
        for account in &accounts[1..] {
            if set.len() < 3
                && !skip.contains(&account)
                && shard(account) != shard(&set[set.len() - 1])
            {
                set.push(account.clone());
            }
        }
        set
    };
    let first = pick(&[]);
    let second = pick(&first.iter().collect::<Vec<_>>());
    assert_eq!((first.len(), second.len()), (3, 3));
    let on_its_shard = |resource: &str| cli(shard(resource), &["EXISTS", &key(resource)]);

    let mut lease = locks.acquire(LockRequest::all(&first)).await.unwrap();
    assert!(lease.fencing_token().is_some());
    for account in &first {
        assert_eq!(on_its_shard(account).trim(), "1", "{account} on its shard");
    }
    // The second set meets `shared` held: refused, and none of its other keys is left
    // set on any shard.
    let refused = locks.acquire(LockRequest::all(&second)).await;
    assert!(
        matches!(refused, Err(LockError::Taken { .. })),
        "{refused:?}"
    );
    for account in &second[1..] {
        assert_eq!(on_its_shard(account).trim(), "0", "{account} released");
    }
    locks.extend(&mut lease).await.unwrap();
    locks.unlock(lease).await.unwrap();
    for account in &first {
        assert_eq!(on_its_shard(account).trim(), "0", "{account} released");
    }
    let taken = locks.acquire(LockRequest::all(&second)).await.unwrap();
    locks.unlock(taken).await.unwrap();
}
