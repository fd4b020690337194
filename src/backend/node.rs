//! [`Node`]: where one of the crate's Redis nodes lives, in any topology redis-rs speaks
//! to: a single server, a Redis Cluster (feature `cluster-async`), a Sentinel-managed
//! primary (feature `sentinel`), each over TLS with a custom root CA (feature `tls`).

use std::fmt;
use std::time::Duration;

use futures_util::FutureExt;
use futures_util::future::BoxFuture;
use redis::{AsyncConnectionConfig, Client, RedisError};

mod ack;
mod conn;
pub(crate) use ack::ReplicaAck;
pub(crate) use conn::Conn;

/// One of the crate's Redis nodes: a Redlock node ([`Redlock::from_nodes`]) or the rate
/// limiter's store ([`RedisRateLimiter::from_node`]), whatever its topology.
///
/// - [`Node::url`], [`Node::client`]: one Redis server (`redis://`, or `rediss://` with
///   the `tls` feature), as [`Redlock::builder`] takes.
/// - [`Node::cluster`] (feature `cluster-async`): one Redis Cluster; every script keeps
///   its keys in one hash slot, so each runs on the shard that owns it.
/// - [`Node::sentinel`] (feature `sentinel`): the primary of a Sentinel service.
///
/// Whatever the topology, the node's connection is replaced after any failure (see
/// [`RedlockBuilder::node_timeout`]), made anew from the seed nodes or the sentinels: after
/// a failover, requests reach the new primary about 100 ms and one connection after its
/// promotion.
///
/// An invalid URL is reported by the `build` of the builder that takes the node, as
/// [`ConfigError::InvalidUrl`](crate::ConfigError::InvalidUrl).
///
/// [`Redlock::from_nodes`]: crate::Redlock::from_nodes
/// [`Redlock::builder`]: crate::Redlock::builder
/// [`RedisRateLimiter::from_node`]: crate::RedisRateLimiter::from_node
/// [`RedlockBuilder::node_timeout`]: crate::RedlockBuilder::node_timeout
#[must_use]
pub struct Node {
    kind: Result<Topology, RedisError>,
    #[cfg(feature = "tls")]
    root_ca: Option<Vec<u8>>,
    ack: Option<ReplicaAck>,
}

#[allow(clippy::large_enum_variant)] // Made once per node.
enum Topology {
    Single(Client),
    #[cfg(feature = "cluster-async")]
    Cluster(Vec<redis::ConnectionInfo>),
    #[cfg(feature = "sentinel")]
    Sentinel {
        sentinels: Vec<redis::ConnectionInfo>,
        service: String,
    },
    /// A ready cluster or Sentinel client, used as it is, and its label.
    #[cfg(any(feature = "cluster-async", feature = "sentinel"))]
    Ready(Endpoint, &'static str),
}

impl fmt::Debug for Node {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let label = match &self.kind {
            Ok(kind) => kind.label(),
            Err(e) => format!("invalid: {e}"),
        };
        f.debug_struct("Node").field("node", &label).finish()
    }
}

impl Node {
    /// One Redis server: `redis://[[user]:password@]host:port[/db]`, or with the `tls`
    /// feature `rediss://...` (verified against the system's roots, or [`root_ca`]).
    ///
    /// [`root_ca`]: Node::root_ca
    pub fn url(url: impl AsRef<str>) -> Self {
        Self::of(Client::open(url.as_ref()).map(Topology::Single))
    }

    /// One Redis server, from a ready redis-rs client.
    pub fn client(client: Client) -> Self {
        Self::of(Ok(Topology::Single(client)))
    }

    /// One Redis Cluster, given by the URLs of some of its nodes (seeds; one that answers
    /// is enough). Credentials and TLS come from the first URL. Commands go to the primary
    /// that owns each key's slot; release notifications subscribe on the first seed that
    /// answers.
    ///
    /// A cluster is one Redlock vote, and replicates asynchronously: a primary that fails
    /// before its replica got a lock hands over a shard without it (the Redis docs,
    /// "Distributed Locks with Redis"). Use N independent clusters for Redlock's guarantee.
    #[cfg(feature = "cluster-async")]
    #[cfg_attr(docsrs, doc(cfg(feature = "cluster-async")))]
    pub fn cluster<I>(urls: I) -> Self
    where
        I: IntoIterator,
        I::Item: AsRef<str>,
    {
        Self::of(infos(urls).map(Topology::Cluster))
    }

    /// One Redis Cluster, from a ready redis-rs cluster client with its own settings.
    /// Waiters are not notified of releases on it (its seed nodes are unknown): they
    /// re-try on their fallback timer (the holder's remaining TTL, at most 1 s).
    #[cfg(feature = "cluster-async")]
    #[cfg_attr(docsrs, doc(cfg(feature = "cluster-async")))]
    pub fn cluster_client(client: redis::cluster::ClusterClient) -> Self {
        let seeds = Vec::new();
        Self::of(Ok(Topology::Ready(
            Endpoint::Cluster { client, seeds },
            "cluster",
        )))
    }

    /// The primary of the Sentinel service `service_name`, asked of the sentinels at
    /// `sentinel_urls` (`redis://host:26379`, with the sentinels' credentials). The primary
    /// is reached with database 0, no credentials, and TLS when the first URL is
    /// `rediss://`; for other settings, use [`Node::sentinel_client`].
    ///
    /// After a failover, the connection to the old primary fails (or answers `READONLY`)
    /// and is replaced by one to the primary the sentinels name then.
    #[cfg(feature = "sentinel")]
    #[cfg_attr(docsrs, doc(cfg(feature = "sentinel")))]
    pub fn sentinel<I>(sentinel_urls: I, service_name: impl Into<String>) -> Self
    where
        I: IntoIterator,
        I::Item: AsRef<str>,
    {
        let service = service_name.into();
        Self::of(infos(sentinel_urls).map(|sentinels| Topology::Sentinel { sentinels, service }))
    }

    /// The primary of a Sentinel service, from a ready redis-rs Sentinel client (built
    /// for [`SentinelServerType::Master`](redis::sentinel::SentinelServerType::Master)).
    #[cfg(feature = "sentinel")]
    #[cfg_attr(docsrs, doc(cfg(feature = "sentinel")))]
    pub fn sentinel_client(client: redis::sentinel::SentinelClient) -> Self {
        let client = std::sync::Arc::new(tokio::sync::Mutex::new(client));
        Self::of(Ok(Topology::Ready(
            Endpoint::Sentinel(client),
            "sentinel service",
        )))
    }

    /// Trust this root certificate (PEM) for the node's `rediss://` connections instead of
    /// the system's roots (the default): for a private CA. Applies to [`Node::url`],
    /// [`Node::cluster`] and [`Node::sentinel`]; ready clients keep their own settings.
    /// rustls uses its `ring` provider; with another provider enabled too, install one as
    /// the process default before building.
    #[cfg(feature = "tls")]
    #[cfg_attr(docsrs, doc(cfg(feature = "tls")))]
    pub fn root_ca(mut self, pem: impl Into<Vec<u8>>) -> Self {
        self.root_ca = Some(pem.into());
        self
    }

    fn of(kind: Result<Topology, RedisError>) -> Self {
        Self {
            kind,
            #[cfg(feature = "tls")]
            root_ca: None,
            ack: None,
        }
    }

    /// The node's connector, its connection attempts bounded by `connect_timeout`.
    pub(crate) fn connector(self, connect_timeout: Duration) -> Result<Connector, RedisError> {
        let kind = self.kind?;
        let label = kind.label();
        #[cfg(feature = "tls")]
        let certs = self.root_ca.map(|root| redis::TlsCertificates {
            client_tls: None,
            root_cert: Some(root),
        });
        let target = match kind {
            Topology::Single(client) => {
                #[cfg(feature = "tls")]
                let client = match certs {
                    Some(certs) => {
                        Client::build_with_tls(client.get_connection_info().clone(), certs)?
                    }
                    None => client,
                };
                Endpoint::Single(client)
            }
            #[cfg(feature = "cluster-async")]
            Topology::Cluster(infos) => {
                let builder = redis::cluster::ClusterClientBuilder::new(infos.clone())
                    .connection_timeout(connect_timeout)
                    // Commands are bounded by their callers; a shard that stays failed
                    // has the whole connection replaced (see `connection.rs`).
                    .retries(2)
                    .min_retry_wait(10)
                    .max_retry_wait(100);
                #[cfg(feature = "tls")]
                let builder = match &certs {
                    Some(certs) => builder.certs(certs.clone()),
                    None => builder,
                };
                let seeds = infos
                    .into_iter()
                    .map(|info| {
                        #[cfg(feature = "tls")]
                        if let Some(certs) = &certs {
                            return Client::build_with_tls(info, certs.clone());
                        }
                        Client::open(info)
                    })
                    .collect::<Result<_, _>>()?;
                Endpoint::Cluster {
                    client: builder.build()?,
                    seeds,
                }
            }
            #[cfg(feature = "sentinel")]
            Topology::Sentinel { sentinels, service } => {
                use redis::sentinel::{SentinelClientBuilder, SentinelServerType};
                let addrs = sentinels.iter().map(|info| info.addr().clone());
                let mut builder =
                    SentinelClientBuilder::new(addrs, &service, SentinelServerType::Master)?;
                if let Some(first) = sentinels.first() {
                    let settings = first.redis_settings();
                    if let Some(user) = settings.username() {
                        builder = builder.set_client_to_sentinel_username(user);
                    }
                    if let Some(password) = settings.password() {
                        builder = builder.set_client_to_sentinel_password(password);
                    }
                    if matches!(first.addr(), redis::ConnectionAddr::TcpTls { .. }) {
                        builder = builder
                            .set_client_to_redis_tls_mode(redis::TlsMode::Secure)
                            .set_client_to_sentinel_tls_mode(redis::TlsMode::Secure);
                    }
                }
                #[cfg(feature = "tls")]
                if let Some(certs) = certs {
                    builder = builder
                        .set_client_to_redis_certificates(certs.clone())
                        .set_client_to_sentinel_certificates(certs);
                }
                Endpoint::Sentinel(std::sync::Arc::new(tokio::sync::Mutex::new(
                    builder.build()?,
                )))
            }
            #[cfg(any(feature = "cluster-async", feature = "sentinel"))]
            Topology::Ready(endpoint, _) => endpoint,
        };
        Ok(Connector {
            target,
            label,
            connect_timeout,
            ack: self.ack.filter(|ack| ack.replicas > 0 || ack.fsync),
        })
    }
}

impl Topology {
    /// A label for logs and errors: addresses only, never credentials.
    fn label(&self) -> String {
        match self {
            Topology::Single(client) => client.get_connection_info().addr().to_string(),
            #[cfg(feature = "cluster-async")]
            Topology::Cluster(infos) => {
                let addrs: Vec<_> = infos.iter().map(|i| i.addr().to_string()).collect();
                format!("cluster [{}]", addrs.join(", "))
            }
            #[cfg(feature = "sentinel")]
            Topology::Sentinel { service, .. } => format!("sentinel service {service}"),
            #[cfg(any(feature = "cluster-async", feature = "sentinel"))]
            Topology::Ready(_, label) => (*label).to_owned(),
        }
    }
}

/// Parses seed or sentinel URLs.
#[cfg(any(feature = "cluster-async", feature = "sentinel"))]
fn infos<I>(urls: I) -> Result<Vec<redis::ConnectionInfo>, RedisError>
where
    I: IntoIterator,
    I::Item: AsRef<str>,
{
    use redis::IntoConnectionInfo;
    urls.into_iter()
        .map(|url| url.as_ref().into_connection_info())
        .collect()
}

/// Makes connections (and subscriber connections) to one [`Node`].
#[derive(Clone)]
pub(crate) struct Connector {
    target: Endpoint,
    pub(crate) label: String,
    connect_timeout: Duration,
    /// The acknowledgements the node's granting writes wait for, if any.
    #[cfg_attr(not(feature = "lock"), allow(dead_code))]
    pub(crate) ack: Option<ReplicaAck>,
}

#[allow(clippy::large_enum_variant)] // Made once per node.
#[derive(Clone)]
enum Endpoint {
    Single(Client),
    #[cfg(feature = "cluster-async")]
    Cluster {
        client: redis::cluster::ClusterClient,
        /// For subscriber connections: a cluster-wide `PUBLISH` reaches every node.
        #[cfg_attr(
            not(any(feature = "lock", feature = "concurrency-limit")),
            allow(dead_code)
        )]
        seeds: Vec<Client>,
    },
    #[cfg(feature = "sentinel")]
    Sentinel(std::sync::Arc<tokio::sync::Mutex<redis::sentinel::SentinelClient>>),
}

impl fmt::Debug for Connector {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Connector")
            .field("node", &self.label)
            .finish_non_exhaustive()
    }
}

/// `connect` bounded by `timeout`; `what` names it in the error.
async fn bounded<T>(
    what: &str,
    timeout: Duration,
    connect: impl Future<Output = Result<T, RedisError>>,
) -> Result<T, RedisError> {
    let result = tokio::time::timeout(timeout, connect).await;
    result.unwrap_or_else(|_| {
        Err(RedisError::from(std::io::Error::new(
            std::io::ErrorKind::TimedOut,
            format!("{what}: no connection within {timeout:?}"),
        )))
    })
}

impl Connector {
    /// Whether the node is a Redis Cluster.
    #[cfg(all(feature = "cluster-async", feature = "lock"))]
    pub(crate) fn is_cluster(&self) -> bool {
        matches!(self.target, Endpoint::Cluster { .. })
    }

    /// The database number commands run on (0 on a cluster or through Sentinel).
    pub(crate) fn db(&self) -> i64 {
        match &self.target {
            Endpoint::Single(client) => client.get_connection_info().redis_settings().db(),
            #[cfg(any(feature = "cluster-async", feature = "sentinel"))]
            _ => 0,
        }
    }

    /// One connection attempt, handshake included, bounded by the connect timeout.
    pub(crate) fn connect(
        &self,
        config: &AsyncConnectionConfig,
    ) -> BoxFuture<'static, Result<Conn, RedisError>> {
        let (target, config, timeout) = (self.target.clone(), config.clone(), self.connect_timeout);
        async move {
            Ok(match target {
                Endpoint::Single(client) => {
                    let connect = client.get_multiplexed_async_connection_with_config(&config);
                    Conn::Single(bounded("connection", timeout, connect).await?)
                }
                #[cfg(feature = "cluster-async")]
                Endpoint::Cluster { client, .. } => {
                    let connect = client.get_async_connection();
                    Conn::Cluster(bounded("cluster", timeout, connect).await?)
                }
                #[cfg(feature = "sentinel")]
                Endpoint::Sentinel(client) => {
                    let connect = async {
                        let primary = client.lock().await.async_get_client().await?;
                        primary
                            .get_multiplexed_async_connection_with_config(&config)
                            .await
                    };
                    Conn::Single(bounded("sentinel", timeout, connect).await?)
                }
            })
        }
        .boxed()
    }

    /// A subscriber connection: to the server, the first seed node that answers, or the
    /// Sentinel service's current primary.
    #[cfg(any(feature = "lock", feature = "concurrency-limit"))]
    pub(crate) async fn pubsub(&self) -> Result<redis::aio::PubSub, RedisError> {
        match &self.target {
            Endpoint::Single(client) => client.get_async_pubsub().await,
            #[cfg(feature = "cluster-async")]
            Endpoint::Cluster { seeds, .. } => {
                let mut last = RedisError::from((
                    redis::ErrorKind::InvalidClientConfig,
                    "no seed node known for release notifications",
                ));
                // Each seed gets its share of the connect timeout: a silent one does not
                // keep the others from being tried.
                let share = u32::try_from(seeds.len()).unwrap_or(u32::MAX).max(1);
                let each = (self.connect_timeout / share).max(Duration::from_millis(50));
                for seed in seeds {
                    match bounded("subscriber", each, seed.get_async_pubsub()).await {
                        Ok(pubsub) => return Ok(pubsub),
                        Err(e) => last = e,
                    }
                }
                Err(last)
            }
            #[cfg(feature = "sentinel")]
            Endpoint::Sentinel(client) => {
                let primary = client.lock().await.async_get_client().await?;
                primary.get_async_pubsub().await
            }
        }
    }
}
