//! The `flash_sale` example on a Redis Cluster (`REDIS_CLUSTER`, with the `cluster-async`
//! feature): the locks, the stock and the limits all on one cluster.

use tower_redlock::{ConcurrencyLimiter, Locks, RateLimiter};
#[cfg(feature = "cluster-async")]
use tower_redlock::{RedisConcurrencyLimiter, RedisRateLimiter, Redlock};

#[cfg(feature = "cluster-async")]
use super::NODE_TIMEOUT;
use super::Store;

/// The locks (one Redlock node: the cluster), the stock and the rate limit, all on one
/// Redis Cluster.
#[cfg(feature = "cluster-async")]
pub(crate) async fn cluster_backends(
    urls: &[String],
) -> Result<(Locks, Store, RateLimiter), Box<dyn std::error::Error>> {
    use tower_redlock::Node;
    let redlock = Redlock::from_nodes([Node::cluster(urls)])
        .node_timeout(NODE_TIMEOUT)
        .build()
        .await?;
    let data = redis::cluster::ClusterClient::builder(urls.iter().map(String::as_str))
        .connection_timeout(NODE_TIMEOUT)
        .build()?
        .get_async_connection()
        .await?;
    let limiter = RedisRateLimiter::from_node(Node::cluster(urls))
        .build()
        .await?;
    Ok((
        Locks::from(redlock),
        Store::Cluster(data),
        RateLimiter::from(limiter),
    ))
}

/// The permits of `MAX_CONCURRENT_BUYS` on the Redis Cluster of `urls`.
#[cfg(feature = "cluster-async")]
pub(crate) async fn cluster_permits(
    urls: &[String],
) -> Result<ConcurrencyLimiter, Box<dyn std::error::Error>> {
    let node = tower_redlock::Node::cluster(urls);
    Ok(RedisConcurrencyLimiter::from_node(node)
        .build()
        .await?
        .into())
}

#[cfg(not(feature = "cluster-async"))]
pub(crate) async fn cluster_permits(
    _urls: &[String],
) -> Result<ConcurrencyLimiter, Box<dyn std::error::Error>> {
    Err("REDIS_CLUSTER needs the cluster-async feature: cargo run --features cluster-async --example flash_sale".into())
}

#[cfg(not(feature = "cluster-async"))]
pub(crate) async fn cluster_backends(
    _urls: &[String],
) -> Result<(Locks, Store, RateLimiter), Box<dyn std::error::Error>> {
    Err("REDIS_CLUSTER needs the cluster-async feature: cargo run --features cluster-async --example flash_sale".into())
}
