//! What the in-process rate-limit store costs at its cap: the bytes it keeps allocated,
//! counted by a counting allocator (`allocation-counter`; requested sizes, without the
//! allocator's own overhead of about 8 to 16 bytes per allocation).
//!
//! Run with `cargo test -p extras --test suite memory_store:: -- --nocapture` to see the
//! figures.

use allocation_counter::{AllocationInfo, measure};
use tower_redlock::{MemoryRateLimiter, Quota, RateLimitError};

/// Sends one request for each of `ids` clients, each with a new id, as a client rotating
/// its id does; returns the allocations the store kept.
fn rotate_ids(limiter: &MemoryRateLimiter, ids: usize, key: impl Fn(usize) -> String) -> i64 {
    let quota: Quota = "10/3600".parse().unwrap();
    let keys: Vec<String> = (0..ids).map(key).collect();
    let info: AllocationInfo = measure(|| {
        for key in &keys {
            match limiter.hit(key, quota) {
                Ok(_) | Err(RateLimitError::StoreFull { .. }) => {}
                Err(e) => panic!("{e}"),
            }
        }
    });
    info.bytes_current
}

#[test]
fn the_store_at_its_default_cap_keeps_about_13_mb_for_20_byte_keys() {
    let cap = MemoryRateLimiter::DEFAULT_MAX_KEYS;
    let limiter = MemoryRateLimiter::new();
    // Twice as many ids as the cap: the second half finds the store full.
    let bytes = rotate_ids(&limiter, 2 * cap, |i| format!("buy:id:{i:013}"));
    assert_eq!(limiter.len(), cap);
    let per_window = bytes / cap as i64;
    println!(
        "{cap} windows of 20-byte keys: {bytes} bytes ({:.1} MB), {per_window} bytes per window",
        bytes as f64 / 1e6
    );
    assert!(
        (100..=140).contains(&per_window),
        "{per_window} bytes per window: update the figures in MemoryRateLimiter's docs"
    );
    assert!(bytes <= 14_000_000, "{bytes} bytes at the cap");
}

#[test]
fn a_window_of_the_longest_layer_key_costs_about_400_bytes() {
    // The longest key a layer makes: a scope, a tag, and a 256-byte value.
    let windows = 10_000;
    let limiter = MemoryRateLimiter::with_max_keys(windows);
    let bytes = rotate_ids(&limiter, windows, |i| format!("buy:id:{i:0256}"));
    assert_eq!(limiter.len(), windows);
    let per_window = bytes / windows as i64;
    println!("{windows} windows of 263-byte keys: {bytes} bytes, {per_window} bytes per window");
    assert!(
        (350..=420).contains(&per_window),
        "{per_window} bytes per window: update the figures in MemoryRateLimiter's docs"
    );
}
