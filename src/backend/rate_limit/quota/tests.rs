use super::*;

#[test]
fn new_refuses_zero_limit_and_bad_windows() {
    assert_eq!(
        Quota::new(0, Duration::from_secs(1)),
        Err(QuotaError::ZeroLimit)
    );
    for bad in [
        Duration::from_micros(999),
        MAX_WINDOW + Duration::from_millis(1),
    ] {
        let quota = Quota::new(1, bad);
        assert!(
            matches!(quota, Err(QuotaError::InvalidWindow(_))),
            "{bad:?}"
        );
    }
    assert!(Quota::new(1, MAX_WINDOW).is_ok());
    assert_eq!(
        Quota::new(1, Duration::MAX),
        Err(QuotaError::InvalidWindow(Duration::from_millis(u64::MAX)))
    );
}

#[test]
fn parses_limit_slash_seconds_and_units() {
    let q = |s: &str| s.parse::<Quota>().unwrap();
    assert_eq!(
        q("100/60"),
        Quota::new(100, Duration::from_secs(60)).unwrap()
    );
    assert_eq!(q(" 100 / 60 "), q("100/60"));
    assert_eq!(q("100/60s"), q("100/60"));
    assert_eq!(q("100/1m"), q("100/60"));
    assert_eq!(q("5/250ms").window(), Duration::from_millis(250));
    assert_eq!(q("1/2h").window(), Duration::from_secs(7200));
    assert_eq!(q("1/1d").window(), Duration::from_secs(86_400));
}

#[test]
fn rejects_malformed_text() {
    for bad in [
        "", "100", "/60", "100/", "x/60", "100/x", "-1/60", "+1/60", "100/60y", "100/1.5", "1/60/2",
    ] {
        assert!(
            matches!(bad.parse::<Quota>(), Err(QuotaError::Malformed(_))),
            "{bad:?}"
        );
    }
    assert_eq!("0/60".parse::<Quota>(), Err(QuotaError::ZeroLimit));
    for bad in ["1/0", "1/99999999999999999d", "1/50d"] {
        let parsed = bad.parse::<Quota>();
        assert!(matches!(parsed, Err(QuotaError::InvalidWindow(_))), "{bad}");
    }
}

#[test]
fn display_round_trips() {
    for text in ["100/60", "5/250ms", "7/1500ms", "1/86400"] {
        let quota: Quota = text.parse().unwrap();
        assert_eq!(quota.to_string(), text);
        assert_eq!(quota.to_string().parse::<Quota>().unwrap(), quota);
    }
}

#[test]
fn gcra_quotas_check_their_rate_and_burst() {
    let q = Quota::gcra(10, Duration::from_secs(1), 20).unwrap();
    assert_eq!((q.emission_us(), q.tolerance_us()), (100_000, 1_900_000));
    assert_eq!(q.policy(), (20, 2));
    assert_eq!(q.to_string(), "10/1 burst 20");
    assert_eq!("10/1 burst 20".parse::<Quota>().unwrap(), q);
    assert_eq!(
        Quota::gcra(1, Duration::from_secs(1), 0),
        Err(QuotaError::InvalidBurst(0))
    );
    assert!(matches!(
        Quota::gcra(1_000_001, Duration::from_secs(1), 1),
        Err(QuotaError::RateTooHigh { .. })
    ));
    assert_eq!(
        Quota::gcra(1, MAX_WINDOW, u64::MAX),
        Err(QuotaError::InvalidBurst(u64::MAX))
    );
    assert!(matches!(
        "10/1 burst x".parse::<Quota>(),
        Err(QuotaError::Malformed(_))
    ));
    // A fixed window's policy is its limit and window.
    assert_eq!("100/60".parse::<Quota>().unwrap().policy(), (100, 60));
    // Its window in whole seconds, rounded up.
    assert_eq!("1/1500ms".parse::<Quota>().unwrap().policy(), (1, 2));
    assert_eq!("1/1ms".parse::<Quota>().unwrap().policy(), (1, 1));
}

#[test]
fn a_quota_error_returned_from_main_prints_its_message() {
    let error = "100/60y".parse::<Quota>().unwrap_err();
    let boxed: Box<dyn std::error::Error> = Box::new(error.clone());
    assert_eq!(format!("{boxed:?}"), error.to_string());
    assert_eq!(
        format!("Error: {boxed:?}"),
        "Error: invalid rate limit \"100/60y\": use LIMIT/SECONDS such as 100/60, or a unit: \
         100/1m, 10/500ms, 1000/1h, 10000/1d"
    );
}

#[test]
fn the_emission_interval_is_rounded_up_to_whole_microseconds() {
    // (quota, emission in µs): never shorter than window / limit, at most 1 µs longer.
    for (text, emission) in [
        ("3/1s burst 1", 333_334),
        ("7/1s burst 4", 142_858),
        ("999/7s burst 10", 7_008),
        ("10/1s burst 20", 100_000),
        ("1000/1s burst 1", 1_000),
    ] {
        let quota: Quota = text.parse().unwrap();
        assert_eq!(quota.emission_us(), emission, "{text}");
        let (window, limit) = (micros(quota.window()), quota.limit());
        assert!(emission * limit >= window, "{text}");
        assert!((emission - 1) * limit < window, "{text}");
        let burst = quota.burst().unwrap();
        assert_eq!(quota.tolerance_us(), emission * (burst - 1), "{text}");
    }
}

#[test]
fn usage_remaining_never_underflows() {
    let usage = Usage::fixed(5, 3, Duration::from_secs(1));
    assert_eq!(usage.remaining(), 0);
    assert!(usage.is_exceeded());
    let usage = Usage::fixed(3, 3, Duration::from_secs(1));
    assert_eq!(usage.remaining(), 0);
    assert!(!usage.is_exceeded());
}
