//! Other clients' locks on the same keys: a real redis-py `Lock` (Python) holds the key
//! while our waiter waits. Its value must stay as it wrote it, its release must succeed,
//! and our waiter must get the lock soon after.
//!
//! Needs `python3` with the `redis` package (`python3 -m pip install redis`; scripts/test
//! installs it).

use crate::support;

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::time::{Duration, Instant};

use support::{RedisNode, calls, eventually, exists, get};
use tower_redlock::Redlock;
use tower_redlock::{LockRequest, Locks};

/// Holds a redis-py lock until told to release it on stdin; reports on stdout.
const HOLDER: &str = r#"
import sys
import redis

port, name = int(sys.argv[1]), sys.argv[2]
lock = redis.Redis(host="127.0.0.1", port=port).lock(name, timeout=30)
if not lock.acquire(blocking=False):
    print("not-acquired", flush=True)
    sys.exit(1)
print("locked", lock.local.token.decode(), flush=True)
sys.stdin.readline()
try:
    lock.release()
    print("released", flush=True)
except Exception as e:
    print("release-failed", type(e).__name__, e, flush=True)
"#;

struct PythonHolder {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
}

impl PythonHolder {
    /// Starts a redis-py lock holder on `name`; panics with how to install what is missing.
    fn start(node: &RedisNode, name: &str) -> Self {
        let probe = Command::new("python3")
            .args(["-c", "import redis"])
            .output();
        match probe {
            Ok(out) if out.status.success() => {}
            Ok(out) => panic!(
                "python3 is there but the redis package is not ({}): install it with \
                 `python3 -m pip install redis`, or run scripts/test, which does",
                String::from_utf8_lossy(&out.stderr).trim()
            ),
            Err(e) => panic!(
                "python3 is not installed ({e}): this test drives redis-py's Lock. Install \
                 Python 3 (Debian/Ubuntu: `apt-get install python3 python3-pip`) and \
                 `python3 -m pip install redis`"
            ),
        }
        let mut child = Command::new("python3")
            .args(["-c", HOLDER, &node.port().to_string(), name])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("start python3");
        let stdin = child.stdin.take().unwrap();
        let stdout = BufReader::new(child.stdout.take().unwrap());
        Self {
            child,
            stdin,
            stdout,
        }
    }

    fn line(&mut self) -> String {
        let mut line = String::new();
        self.stdout.read_line(&mut line).expect("read from python3");
        line.trim().to_owned()
    }
}

impl Drop for PythonHolder {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_py_lock_is_left_alone_while_we_wait_and_then_handed_over() {
    let node = RedisNode::start();
    let key = "jobs:nightly";
    let mut holder = PythonHolder::start(&node, key);
    let locked = holder.line();
    let token = locked
        .strip_prefix("locked ")
        .unwrap_or_else(|| panic!("redis-py did not take the lock: {locked:?}"))
        .to_owned();
    assert_eq!(get(&node, key).await.as_deref(), Some(token.as_str()));

    // Our side, with the prefix set to match the Python lock's name.
    let r = Locks::from(
        Redlock::builder([node.url()])
            .prefix("jobs:")
            .ttl(Duration::from_secs(10))
            .node_timeout(Duration::from_millis(200))
            .build()
            .await
            .unwrap(),
    );
    let waiter = tokio::spawn({
        let r = r.clone();
        async move {
            let lease = r
                .acquire(LockRequest::new("nightly").wait(Duration::from_secs(15)))
                .await;
            (lease, Instant::now())
        }
    });
    // The waiter's first attempt (a refused `SET NX PX`, beside redis-py's own `SET`,
    // then the holder's `PTTL`), then two more once subscribed (one script each, which
    // also sets the waiters' mark).
    let retried = eventually(Duration::from_secs(5), || async {
        calls(&node, "set").await >= 2 && calls(&node, "evalsha").await >= 2
    })
    .await;
    assert!(retried, "the waiter did not try again");
    assert_eq!(
        get(&node, key).await.as_deref(),
        Some(token.as_str()),
        "the waiter modified redis-py's lock value"
    );
    assert!(
        exists(&node, "jobs:{jobs:nightly}:waiters").await,
        "the waiter set no mark beside the lock"
    );

    writeln!(holder.stdin, "release").unwrap();
    let released = holder.line();
    let released_at = Instant::now();
    assert_eq!(released, "released", "redis-py's release failed");
    let (lease, acquired_at) = tokio::time::timeout(Duration::from_secs(10), waiter)
        .await
        .expect("the waiter returns")
        .unwrap();
    let lease = lease.expect("our waiter gets the lock after redis-py's release");
    let delay = acquired_at.saturating_duration_since(released_at);
    eprintln!("handed over {delay:?} after redis-py's release");
    // redis-py publishes nothing: the fallback timer (at most about 1.1 s) wakes us.
    assert!(
        delay < Duration::from_secs(2),
        "handed over after {delay:?}"
    );
    assert_eq!(lease.key(), key);
    r.unlock(lease).await.unwrap();
}
