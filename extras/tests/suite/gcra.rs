//! GCRA (`Quota::gcra`) on one Redis node and in process: the burst, the steady rate, the
//! bound `burst + rate × t` over any interval of a run, two replicas sharing one limit,
//! the server's clock, and the layer's answers.

use crate::support;

use std::time::{Duration, Instant};

use axum::Router;
use axum::routing::get;
use support::{RedisNode, pttl, serve};
use tower_redlock::{MemoryRateLimiter, Quota, RateLimitLayer, RateLimiter, RedisRateLimiter};

async fn redis(node: &RedisNode) -> RateLimiter {
    RateLimiter::from(
        RedisRateLimiter::builder(node.url())
            .timeout(Duration::from_secs(2))
            .build()
            .await
            .unwrap(),
    )
}

fn memory() -> RateLimiter {
    RateLimiter::from(MemoryRateLimiter::new())
}

/// A burst of `burst` passes at once, the next is refused with a retry of at most one
/// emission, and what is left of the burst counts down.
async fn burst_then_refusal(limiter: RateLimiter) {
    // One every 100 ms, bursts of 4.
    let quota = Quota::gcra(10, Duration::from_secs(1), 4).unwrap();
    let mut left = Vec::new();
    for _ in 0..4 {
        let usage = limiter.hit("client", quota).await.unwrap();
        assert!(!usage.is_exceeded());
        left.push(usage.remaining());
    }
    assert_eq!(left, [3, 2, 1, 0]);
    let refused = limiter.hit("client", quota).await.unwrap();
    assert!(refused.is_exceeded());
    assert!(refused.retry_after() > Duration::ZERO);
    assert!(
        refused.retry_after() <= Duration::from_millis(100),
        "{refused:?}"
    );
    assert!(refused.reset_after() <= Duration::from_millis(400));
    // Another key has its own burst.
    assert!(!limiter.hit("other", quota).await.unwrap().is_exceeded());
}

#[tokio::test]
async fn a_burst_passes_then_the_next_waits_one_emission_in_process() {
    burst_then_refusal(memory()).await;
}

#[tokio::test]
async fn a_burst_passes_then_the_next_waits_one_emission_on_redis() {
    let node = RedisNode::start();
    burst_then_refusal(redis(&node).await).await;
}

/// Requests as fast as the limiter answers, from `limiters` in turn, for `run`: in every
/// interval between two allowed requests, at most `burst + t / emission` pass (one more
/// for the clock readings around each call), and the steady rate is reached.
///
/// The rate is reached only while requests keep coming: a pause between two readings of
/// the limiter's clock (the test descheduled on a loaded machine, between two calls or
/// within one) longer than the burst's worth of emissions loses the allowance earned
/// beyond the burst, and the lower bound leaves that out. A call reads the clock between
/// its send and its answer, so two readings are at most the previous send and this
/// answer apart.
async fn never_over_burst_plus_rate(limiters: &[RateLimiter], run: Duration) {
    let emission = Duration::from_millis(20);
    let burst = 5;
    let quota = Quota::gcra(50, Duration::from_secs(1), burst).unwrap();
    let start = Instant::now();
    // For each allowed request: the time before it was sent and after it was answered.
    let mut allowed: Vec<(Instant, Instant)> = Vec::new();
    let mut calls = 0usize;
    // Allowance lost to pauses between calls, in requests.
    let mut lost = 0.0;
    let mut previous_sent = start;
    while start.elapsed() < run {
        let limiter = &limiters[calls % limiters.len()];
        calls += 1;
        let sent = Instant::now();
        let usage = limiter.hit("steady", quota).await.unwrap();
        let answered = Instant::now();
        let pause = (answered - previous_sent).as_secs_f64() / emission.as_secs_f64();
        // Less than one request's allowance was left when the pause began.
        lost += (pause + 1.0 - burst as f64).max(0.0);
        previous_sent = sent;
        if !usage.is_exceeded() {
            allowed.push((sent, answered));
        }
    }
    let elapsed = start.elapsed();
    assert!(
        calls > allowed.len() * 2,
        "the run pressed the limit: {calls} calls"
    );
    for i in 0..allowed.len() {
        for j in i..allowed.len() {
            // The allowed requests i..=j were decided within (sent_i, answered_j).
            let t = allowed[j].1 - allowed[i].0;
            let bound = burst as f64 + t.as_secs_f64() / emission.as_secs_f64() + 1.0;
            let passed = (j - i + 1) as f64;
            assert!(
                passed <= bound,
                "{passed} passed within {t:?}, bound {bound}"
            );
        }
    }
    let expected = burst as f64 + elapsed.as_secs_f64() / emission.as_secs_f64() - lost;
    assert!(
        allowed.len() as f64 >= expected - 3.0,
        "{} allowed in {elapsed:?}, the rate allows {expected} ({lost:.1} lost to pauses)",
        allowed.len()
    );
}

#[tokio::test]
async fn never_more_than_burst_plus_rate_in_any_interval_in_process() {
    never_over_burst_plus_rate(&[memory()], Duration::from_millis(1_500)).await;
}

#[tokio::test]
async fn never_more_than_burst_plus_rate_in_any_interval_on_redis() {
    let node = RedisNode::start();
    never_over_burst_plus_rate(&[redis(&node).await], Duration::from_millis(1_500)).await;
}

/// A client that asks again the moment it may, on `quota` (a burst of 2 or more), until
/// `passes` requests passed: the instants (µs) at which they could pass, on a clock that
/// runs with the server's and skips ahead, without sleeping.
///
/// After a refusal, the key's arrival time is moved back by the refusal's retry delay,
/// which is to the store what that delay passing is, and the clock skips it. A request
/// passes when the arrival time is at most the burst's tolerance ahead, so it could have
/// passed from the instant that the arrival time, read before it, less the tolerance
/// says (and not before the previous one): that instant is recorded, free of this
/// test's own round trips. With a burst of 2 or more the arrival time stays ahead of the
/// server's clock, so each pass moves it by exactly one emission from where it was, as
/// it would have at that instant.
async fn greedy_run_on_redis(node: &RedisNode, quota: Quota, passes: usize) -> Vec<u64> {
    let limiter = redis(node).await;
    let key = "tower-redlock-rate:greedy";
    let rewind = redis::Script::new(
        r"
local t = tonumber(redis.call('GET', KEYS[1])) - tonumber(ARGV[1])
redis.call('SET', KEYS[1], string.format('%d', t), 'KEEPTTL')
return t
",
    );
    let burst = quota.burst().unwrap();
    let mut conn = node.conn().await;
    let _: () = redis::cmd("DEL")
        .arg(key)
        .query_async(&mut conn)
        .await
        .unwrap();
    // The time skipped, the stored arrival time, the instants of the passes, and how far
    // each pass moves the arrival time (the emission interval, as the store has it).
    let (mut skipped, mut tat, mut passed) = (0u64, None::<u64>, Vec::<u64>::new());
    let mut emission = None;
    while passed.len() < passes {
        let usage = limiter.hit("greedy", quota).await.unwrap();
        if usage.is_exceeded() {
            let retry = u64::try_from(usage.retry_after().as_micros()).unwrap();
            assert!(retry > 0);
            let moved: u64 = rewind
                .key(key)
                .arg(retry)
                .invoke_async(&mut conn)
                .await
                .unwrap();
            skipped += retry;
            tat = Some(moved);
            continue;
        }
        let after: u64 = support::get(node, key).await.unwrap().parse().unwrap();
        let at = match tat {
            // The first: when the server counted it.
            None => after - u64::try_from(usage.reset_after().as_micros()).unwrap(),
            Some(before) => {
                // Always the same step: the arrival time stayed ahead of the clock.
                let step = *emission.get_or_insert(after - before);
                assert_eq!(after - before, step, "one emission per pass");
                // It passed once the arrival time was at most the tolerance ahead.
                before - step * (burst - 1)
            }
        };
        let at = (at + skipped).max(passed.last().copied().unwrap_or(0));
        passed.push(at);
        tat = Some(after);
    }
    passed
}

#[tokio::test]
async fn never_more_than_burst_plus_rate_for_rates_that_do_not_divide_the_window_on_redis() {
    // 3 per second passed 201 times in 66.67 s (against 200.9998) when the emission
    // interval was rounded down to 333,333 µs.
    let node = RedisNode::start();
    for text in ["3/1s burst 2", "7/1s burst 4", "11/1h burst 3"] {
        let quota: Quota = text.parse().unwrap();
        let window = u64::try_from(quota.window().as_micros()).unwrap();
        let (limit, burst) = (quota.limit(), quota.burst().unwrap());
        let passed = greedy_run_on_redis(&node, quota, 250).await;
        // In every interval [a, b] between two passes, at most burst + (b - a) × rate:
        // (n - burst) × window <= (b - a) × limit, in integers.
        for (i, a) in passed.iter().enumerate() {
            for (j, b) in passed.iter().enumerate().skip(i) {
                let n = (j - i + 1) as u64;
                assert!(
                    n.saturating_sub(burst) * window <= (b - a) * limit,
                    "{text}: {n} passed in {} µs",
                    b - a
                );
            }
        }
        // And the run pressed the limit: the last pass could pass within one emission of
        // when the rate allows it.
        let last = passed[249] - passed[0];
        let due = (250 - burst) * window / limit;
        assert!(last <= due + window.div_ceil(limit), "{text}: {last} µs");
    }
}

#[tokio::test]
async fn two_replicas_share_one_limit_on_redis() {
    let node = RedisNode::start();
    // Two clients with their own connections, as two replicas of a service.
    let (a, b) = (redis(&node).await, redis(&node).await);
    let quota = Quota::gcra(1, Duration::from_secs(60), 3).unwrap();
    let mut passed = 0;
    for i in 0..10 {
        let limiter = if i % 2 == 0 { &a } else { &b };
        if !limiter.hit("tenant", quota).await.unwrap().is_exceeded() {
            passed += 1;
        }
    }
    assert_eq!(passed, 3, "one burst for both replicas");
    // And over a steady run, one rate for both.
    never_over_burst_plus_rate(&[a, b], Duration::from_millis(1_000)).await;
}

#[tokio::test]
async fn the_arrival_time_is_on_the_servers_clock_and_expires() {
    let node = RedisNode::start();
    let limiter = redis(&node).await;
    let quota = Quota::gcra(1, Duration::from_secs(10), 2).unwrap();
    limiter.hit("clock", quota).await.unwrap();
    let mut conn = node.conn().await;
    let (secs, micros): (u64, u64) = redis::cmd("TIME").query_async(&mut conn).await.unwrap();
    let server_now = secs * 1_000_000 + micros;
    let tat: String = redis::cmd("GET")
        .arg("tower-redlock-rate:clock")
        .query_async(&mut conn)
        .await
        .unwrap();
    let tat: u64 = tat
        .parse()
        .expect("an integer, not a float's exponent form");
    // One emission (10 s) ahead of the server's clock, whatever this process's clock says.
    let ahead = tat - server_now;
    assert!(
        (9_000_000..=10_000_000).contains(&ahead),
        "{ahead} µs ahead of the server"
    );
    let pttl = pttl(&node, "tower-redlock-rate:clock").await;
    assert!(
        (9_000..=10_000).contains(&pttl),
        "expires with its arrival time: {pttl}"
    );
}

#[tokio::test]
async fn a_value_it_did_not_write_is_left_alone() {
    let node = RedisNode::start();
    let limiter = redis(&node).await;
    let mut conn = node.conn().await;
    let _: () = redis::cmd("SET")
        .arg("tower-redlock-rate:foreign")
        .arg("not a time")
        .query_async(&mut conn)
        .await
        .unwrap();
    let quota = Quota::gcra(1, Duration::from_secs(1), 1).unwrap();
    assert!(limiter.hit("foreign", quota).await.is_err());
    assert_eq!(
        support::get(&node, "tower-redlock-rate:foreign")
            .await
            .as_deref(),
        Some("not a time")
    );
}

/// The layer with a GCRA quota: 429 with `Retry-After` and the burst as the policy.
async fn layer_answers(limiter: RateLimiter) {
    let quota = Quota::gcra(1, Duration::from_secs(2), 2).unwrap();
    let app = Router::new()
        .route("/", get(|| async { "ok" }))
        .layer(RateLimitLayer::by_header("x-tenant", quota).backend(limiter));
    let base = serve(app).await;
    let client = reqwest::Client::new();
    let get = || client.get(&base).header("x-tenant", "acme").send();
    let first = get().await.unwrap();
    assert_eq!(first.status(), 200);
    assert_eq!(first.headers()["ratelimit-policy"], "\"default\";q=2;w=4");
    assert_eq!(first.headers()["ratelimit"], "\"default\";r=1;t=2");
    assert_eq!(get().await.unwrap().status(), 200);
    let refused = get().await.unwrap();
    assert_eq!(refused.status(), 429);
    assert_eq!(refused.headers()["retry-after"], "2");
    assert_eq!(refused.headers()["ratelimit"], "\"default\";r=0;t=4");
}

#[tokio::test]
async fn the_layer_answers_429_with_the_burst_as_its_policy_in_process() {
    layer_answers(memory()).await;
}

#[tokio::test]
async fn the_layer_answers_429_with_the_burst_as_its_policy_on_redis() {
    let node = RedisNode::start();
    layer_answers(redis(&node).await).await;
}
