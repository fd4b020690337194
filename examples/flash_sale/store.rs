//! The stock store of the `flash_sale` example: in process, on the first Redis node, or on
//! a Redis Cluster; every Redis command bounded by [`NODE_TIMEOUT`].

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use redis::AsyncCommands;
use redis::aio::ConnectionManager;
use tower_redlock::Problem;

use super::NODE_TIMEOUT;

/// Stock and sold counts, per item.
#[derive(Clone)]
pub(crate) enum Store {
    Memory(Arc<Mutex<HashMap<String, (i64, i64)>>>),
    Redis(ConnectionManager),
    #[cfg(feature = "cluster-async")]
    Cluster(redis::cluster_async::ClusterConnection),
}

/// The stock and sold counts of `item` on a Redis node or cluster.
async fn redis_get(
    conn: &mut (impl redis::aio::ConnectionLike + Send + Sync),
    item: &str,
) -> Result<Option<(i64, i64)>, StoreError> {
    let stock: Option<i64> = bounded(conn.get(format!("flash_sale:{item}:stock"))).await?;
    let sold: Option<i64> = bounded(conn.get(format!("flash_sale:{item}:sold"))).await?;
    Ok(stock.map(|stock| (stock, sold.unwrap_or(0))))
}

async fn redis_set(
    conn: &mut (impl redis::aio::ConnectionLike + Send + Sync),
    item: &str,
    stock: i64,
    sold: i64,
) -> Result<(), StoreError> {
    let () = bounded(conn.set(format!("flash_sale:{item}:stock"), stock)).await?;
    let () = bounded(conn.set(format!("flash_sale:{item}:sold"), sold)).await?;
    Ok(())
}

/// Why the stock store could not answer.
#[derive(Debug)]
pub(crate) enum StoreError {
    Redis(redis::RedisError),
    /// No answer within [`NODE_TIMEOUT`].
    Timeout,
}

impl std::fmt::Display for StoreError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            StoreError::Redis(e) => e.fmt(f),
            StoreError::Timeout => write!(f, "no answer within {NODE_TIMEOUT:?}"),
        }
    }
}

/// One command to the stock node, given [`NODE_TIMEOUT`] to answer. `ConnectionManager`
/// has no deadline of its own: while its node is replaced by something that is not Redis,
/// it keeps reconnecting, and a command would wait for seconds.
pub(crate) async fn bounded<T>(
    command: impl Future<Output = Result<T, redis::RedisError>>,
) -> Result<T, StoreError> {
    match tokio::time::timeout(NODE_TIMEOUT, command).await {
        Ok(answer) => answer.map_err(StoreError::Redis),
        Err(_) => Err(StoreError::Timeout),
    }
}

impl Store {
    /// Whether the stock's node answers `PING` within [`NODE_TIMEOUT`].
    pub(crate) async fn ready(&self) -> bool {
        let ping = redis::cmd("PING");
        match self {
            Store::Memory(_) => true,
            Store::Redis(conn) => bounded(ping.query_async::<()>(&mut conn.clone()))
                .await
                .is_ok(),
            #[cfg(feature = "cluster-async")]
            Store::Cluster(conn) => bounded(ping.query_async::<()>(&mut conn.clone()))
                .await
                .is_ok(),
        }
    }

    pub(crate) async fn get(&self, item: &str) -> Result<Option<(i64, i64)>, StoreError> {
        match self {
            Store::Memory(map) => Ok(map.lock().unwrap().get(item).copied()),
            Store::Redis(conn) => redis_get(&mut conn.clone(), item).await,
            #[cfg(feature = "cluster-async")]
            Store::Cluster(conn) => redis_get(&mut conn.clone(), item).await,
        }
    }

    pub(crate) async fn set(&self, item: &str, stock: i64, sold: i64) -> Result<(), StoreError> {
        match self {
            Store::Memory(map) => {
                map.lock().unwrap().insert(item.to_owned(), (stock, sold));
                Ok(())
            }
            Store::Redis(conn) => redis_set(&mut conn.clone(), item, stock, sold).await,
            #[cfg(feature = "cluster-async")]
            Store::Cluster(conn) => redis_set(&mut conn.clone(), item, stock, sold).await,
        }
    }
}

pub(crate) fn store_error(e: StoreError) -> Response {
    tracing::error!(error = %e, "store unavailable");
    Problem::new(
        StatusCode::SERVICE_UNAVAILABLE,
        "The stock store is unavailable.",
    )
    .into_response()
}
