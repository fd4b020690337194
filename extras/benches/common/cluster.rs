//! Section 4 of the overhead bench: the lock cycle on a Redis Cluster (3 primaries, 3
//! replicas, on loopback), this crate's `Redlock` over `Node::cluster` against the floor:
//! the same commands sent straight on redis-rs's cluster connection (`SET key token NX PX
//! ttl`, then the compare-and-delete script by `EVALSHA`, each routed to the key's shard).
//! Needs `--features cluster-async`.

use std::sync::Arc;
use std::time::Instant;

use redis::Value;
use redis::cluster_async::ClusterConnection;
use tower_redlock::{Node, Redlock};

use super::common::{RELEASE_SCRIPT, TTL, TTL_MS, prefixed, token};
use super::{Locker, Plan, Rate, Row, Samples, Table, cycle_round, next_resource, ratio};
use tower_redlock::Locks;

/// The bare commands of a lock cycle on one cluster connection.
pub(super) struct ClusterFloor {
    conn: ClusterConnection,
    sha: String,
}

impl ClusterFloor {
    pub(super) async fn cycle(&self, resource: &str) -> bool {
        let key = prefixed(resource);
        let token = token();
        let mut conn = self.conn.clone();
        let mut set = redis::cmd("SET");
        set.arg(&key)
            .arg(&token[..])
            .arg("NX")
            .arg("PX")
            .arg(TTL_MS);
        let acquired = matches!(set.query_async::<Value>(&mut conn).await, Ok(Value::Okay));
        let mut release = redis::cmd("EVALSHA");
        release.arg(&self.sha).arg(1).arg(&key).arg(&token[..]);
        acquired && release.query_async::<Value>(&mut conn).await.is_ok()
    }
}

/// Measures the floor and this crate on a cluster started here, and adds their rows.
pub(super) async fn cluster_cycle(plan: &Plan, table: &mut Table) {
    let cluster = tokio::task::spawn_blocking(|| super::support::topology::Cluster::start(3))
        .await
        .expect("start the cluster");
    let urls = cluster.urls();
    let mut conn = redis::cluster::ClusterClient::new(urls.clone())
        .expect("cluster URLs")
        .get_async_connection()
        .await
        .expect("connect to the cluster");
    let sha: String = redis::cmd("SCRIPT")
        .arg("LOAD")
        .arg(RELEASE_SCRIPT)
        .query_async(&mut conn)
        .await
        .expect("SCRIPT LOAD on every node");
    let redlock = Locks::from(
        Redlock::from_nodes([Node::cluster(&urls)])
            .ttl(TTL)
            .build()
            .await
            .expect("build the Redlock client"),
    );
    let lockers = [
        Arc::new(Locker::ClusterFloor(ClusterFloor { conn, sha })),
        Arc::new(Locker::Crate(redlock)),
    ];

    let mut serial: Vec<Samples> = lockers.iter().map(|_| Samples::default()).collect();
    for locker in &lockers {
        for _ in 0..plan.serial_warmup {
            locker.cycle(&next_resource()).await;
        }
    }
    for i in 0..plan.serial_iters {
        for j in 0..lockers.len() {
            let k = (i + j) % lockers.len();
            let resource = next_resource();
            let start = Instant::now();
            let ok = lockers[k].cycle(&resource).await;
            serial[k].record(start.elapsed(), ok);
        }
    }
    let mut rates: Vec<Rate> = lockers.iter().map(|_| Rate::default()).collect();
    for _ in 0..plan.rounds {
        for (locker, rate) in lockers.iter().zip(&mut rates) {
            let (count, errors) = cycle_round(locker, plan.warmup, plan.round_time()).await;
            rate.record(count, errors, plan.round_time());
        }
    }

    let floor_p50 = serial[0].percentile(50.0);
    table.section(&format!(
        "4. lock cycle on a Redis Cluster (3 primaries + 3 replicas; one Redlock node): serial p50/p99 over {} cycles; rate with {} tasks over {:.1} s",
        plan.serial_iters,
        super::LOCK_TASKS,
        plan.duration.as_secs_f64(),
    ));
    for (i, locker) in lockers.iter().enumerate() {
        let p50 = serial[i].percentile(50.0);
        table.row(Row {
            case: format!("{} (cluster)", locker.name()),
            nodes: "1 cluster".to_owned(),
            p50: Some(p50),
            p99: Some(serial[i].percentile(99.0)),
            rate: Some(rates[i].per_second()),
            p50_ratio: Some(ratio(p50, floor_p50)),
            rate_ratio: Some(rates[i].paired_ratio(&rates[0])),
            spread: Some(rates[i].spread()),
            errors: serial[i].errors + rates[i].errors,
            notes: String::new(),
        });
    }
    drop(cluster);
}
