//! Log lines carry a key's scope and a short hash, never its value: a lost lease, a
//! fencing counter another client wrote, and a failed acquisition, at the default level.
//! Alone in its test binary: `log_full_keys` applies to the whole process.

// A test stops on what it did not expect: its unwraps, indexes and panics are assertions.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing,
    clippy::panic
)]

mod support;

use std::time::Duration;

use support::{Logs, RedisNode};
use tower_redlock::{LockError, Locks, Redlock, Renewal};

const SECRET: &str = "acct-8675309";

async fn set(node: &RedisNode, key: &str, value: &str) {
    let mut conn = node.conn().await;
    let _: () = redis::cmd("SET")
        .arg(key)
        .arg(value)
        .arg("PX")
        .arg(30_000)
        .query_async(&mut conn)
        .await
        .unwrap();
}

#[tokio::test]
async fn no_key_value_in_any_log_line_by_default_and_the_whole_key_when_asked() {
    let (logs, _guard) = Logs::capture();

    let node = RedisNode::start();
    let locks = Locks::from(
        Redlock::builder([node.url()])
            .ttl(Duration::from_millis(900))
            .fencing_tokens(true)
            .retry_count(0)
            .build()
            .await
            .unwrap(),
    );
    let resource = format!("accounts:{SECRET}");
    let key = format!("tower-redlock:{resource}");

    // A lease lost while its work runs: another holder takes the key.
    let work = locks.with_lock(
        resource.as_str(),
        Renewal::default().every(Duration::from_millis(100)),
        |status| async move { tokio::time::timeout(Duration::from_secs(5), status.lost()).await },
    );
    let thief = async {
        tokio::time::sleep(Duration::from_millis(50)).await;
        set(&node, &key, "another-holder").await;
    };
    let (result, ()) = tokio::join!(work, thief);
    assert!(matches!(result, Err(LockError::Lost)), "{result:?}");
    // A fencing counter that another client wrote, in the error an application logs.
    redis::cmd("DEL")
        .arg(&key)
        .query_async::<()>(&mut node.conn().await)
        .await
        .unwrap();
    set(
        &node,
        &format!("tower-redlock:{{{key}}}:fence"),
        "not a number",
    )
    .await;
    let failed = locks.try_lock(&resource).await;
    assert!(failed.is_err(), "{failed:?}");
    tracing::warn!(error = %failed.unwrap_err(), "as an application logs it");

    let text = logs.text();
    assert!(
        text.contains("lost: renewal found the token gone"),
        "{text}"
    );
    assert!(
        text.contains("does not hold an integer below 2^53"),
        "{text}"
    );
    assert!(text.contains("accounts:#"), "the scope and a hash: {text}");
    assert!(!text.contains(SECRET), "a key value in the log: {text}");

    // Asked for, the whole key.
    tower_redlock::log_full_keys(true);
    let failed = locks.try_lock(&resource).await.unwrap_err();
    tracing::warn!(error = %failed, "with the whole key");
    tower_redlock::log_full_keys(false);
    assert!(logs.text().contains(SECRET));
}
