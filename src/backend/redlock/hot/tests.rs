use super::*;

fn lease(key: &Arc<str>, valid_for: Duration) -> Lease {
    Lease {
        key: key.clone(),
        shape: crate::lease::Shape::Lock,
        token: Token::random(),
        ttl: valid_for,
        valid_until: Instant::now() + valid_for,
        fencing_token: None,
        backend: 0,
        reentered: false,
    }
}

fn key() -> Arc<str> {
    Arc::from("p:k")
}

/// The guard of an attempt that must lead.
fn lead<'a>(hot: &'a HotKeys, key: &'a Arc<str>, waiting: bool) -> FlightGuard<'a> {
    let Admission::Lead(guard) = hot.enter(key, waiting) else {
        panic!("the attempt leads");
    };
    guard
}

/// The flight an attempt must follow.
fn follow(hot: &HotKeys, key: &Arc<str>) -> Arc<Flight> {
    let Admission::Follow(flight) = hot.enter(key, false) else {
        panic!("the attempt follows");
    };
    flight
}

#[tokio::test]
async fn attempts_during_a_flight_share_its_outcome_and_then_see_the_holder() {
    let hot = HotKeys::default();
    let key = key();
    let guard = lead(&hot, &key, false);
    let flight = follow(&hot, &key);
    let waiting = tokio::spawn({
        let flight = flight.clone();
        async move { flight.outcome().await }
    });
    let held = lease(&key, Duration::from_secs(10));
    guard.finish(&Ok(held.clone()));
    assert!(matches!(waiting.await.unwrap(), Outcome::Won));
    assert!(matches!(hot.enter(&key, false), Admission::Held { .. }));
    assert!(hot.holder(&key).is_some());
    // Released: gone at once, and a free key leads again.
    assert!(hot.released(&key, held.token, "p:"));
    assert!(!hot.contains(&key));
    assert!(matches!(hot.enter(&key, false), Admission::Lead(_)));
}

#[test]
fn a_waiting_attempt_does_not_follow_a_plain_one() {
    let hot = HotKeys::default();
    let key = key();
    let _plain = hot.enter(&key, false);
    let waiting = hot.enter(&key, true);
    assert!(matches!(waiting, Admission::Lead(_)));
    // A plain attempt follows the waiting one.
    assert!(matches!(hot.enter(&key, false), Admission::Follow(_)));
}

#[tokio::test]
async fn the_followers_of_a_displaced_plain_attempt_follow_the_waiting_one() {
    let hot = HotKeys::default();
    let key = key();
    let plain = lead(&hot, &key, false);
    let flight = follow(&hot, &key);
    let waiting = lead(&hot, &key, true);
    // Told at once: they enter again and follow the waiting attempt.
    assert!(matches!(flight.outcome().await, Outcome::Abandoned));
    let flight = follow(&hot, &key);
    // The displaced attempt, refused, leaves the waiting one's slot alone.
    plain.finish(&Err(LockError::Taken {
        retry_after: Duration::from_secs(1),
    }));
    assert!(hot.contains(&key));
    waiting.finish(&Err(LockError::Taken {
        retry_after: Duration::from_secs(2),
    }));
    assert!(matches!(flight.outcome().await, Outcome::Taken(d) if d == Duration::from_secs(2)));
    assert!(!hot.contains(&key));
}

#[tokio::test]
async fn a_lease_that_takes_another_attempts_slot_tells_its_followers() {
    let hot = HotKeys::default();
    let key = key();
    let plain = lead(&hot, &key, false);
    let _waiting = lead(&hot, &key, true);
    let flight = follow(&hot, &key);
    // The displaced plain attempt wins after all: its lease is the holder, and the
    // waiting attempt's followers find it when they look again.
    plain.finish(&Ok(lease(&key, Duration::from_secs(10))));
    assert!(matches!(flight.outcome().await, Outcome::Won));
    assert!(matches!(hot.enter(&key, false), Admission::Held { .. }));
}

#[test]
fn a_cancelled_flight_frees_the_slot() {
    let hot = HotKeys::default();
    let key = key();
    let guard = hot.enter(&key, false);
    let flight = follow(&hot, &key);
    drop(guard);
    assert!(!hot.contains(&key));
    assert!(matches!(*flight.lock(), Some(Outcome::Abandoned)));
}

#[test]
fn a_holder_leaves_when_lost_or_expired_and_moves_when_renewed() {
    let hot = HotKeys::default();
    let key = key();
    let guard = lead(&hot, &key, false);
    let held = lease(&key, Duration::from_millis(1));
    guard.finish(&Ok(held.clone()));
    // Another token does not touch it.
    hot.lost(&key, Token::random());
    assert!(hot.contains(&key));
    hot.renewed(&key, held.token, Instant::now() + Duration::from_secs(5));
    assert!(hot.holder(&key).is_some(), "renewed");
    hot.lost(&key, held.token);
    assert!(hot.holder(&key).is_none(), "lost");

    let guard = lead(&hot, &key, false);
    guard.finish(&Ok(lease(&key, Duration::ZERO)));
    assert!(hot.holder(&key).is_none(), "expired");
    assert!(matches!(hot.enter(&key, false), Admission::Lead(_)));
}
