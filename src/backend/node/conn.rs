//! An open connection to a node, whatever its topology.

#[cfg(feature = "cluster-async")]
use redis::aio::ConnectionLike;
use redis::aio::MultiplexedConnection;
use redis::{Cmd, Pipeline, RedisResult, Value};

/// An open connection to a [`Node`](super::Node): cheap to clone, multiplexed.
#[derive(Clone)]
pub(crate) enum Conn {
    Single(MultiplexedConnection),
    #[cfg(feature = "cluster-async")]
    Cluster(redis::cluster_async::ClusterConnection),
}

impl Conn {
    /// Sends one command and reads its reply: straight on a single server's multiplexed
    /// connection (no boxed future), routed by the cluster client on a cluster.
    pub(crate) async fn send(&mut self, cmd: &Cmd) -> RedisResult<Value> {
        match self {
            Conn::Single(conn) => conn.send_packed_command(cmd).await,
            #[cfg(feature = "cluster-async")]
            Conn::Cluster(conn) => conn.req_packed_command(cmd).await,
        }
    }

    /// Loads `script` (`SCRIPT LOAD`; on a cluster, on every primary).
    pub(crate) async fn load(&mut self, script: &redis::Script) -> RedisResult<String> {
        match self {
            Conn::Single(conn) => script.load_async(conn).await,
            #[cfg(feature = "cluster-async")]
            Conn::Cluster(conn) => script.load_async(conn).await,
        }
    }

    /// Sends a pipeline and reads `count` replies from `offset` on.
    pub(crate) async fn send_pipeline(
        &mut self,
        pipeline: &Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisResult<Vec<Value>> {
        match self {
            Conn::Single(conn) => conn.send_packed_commands(pipeline, offset, count).await,
            #[cfg(feature = "cluster-async")]
            Conn::Cluster(conn) => conn.req_packed_commands(pipeline, offset, count).await,
        }
    }
}
