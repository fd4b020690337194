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
fn lead<'a>(holders: &'a LocalHolders, key: &'a Arc<str>, waiting: bool) -> FlightGuard<'a> {
    let Admission::Lead(guard) = holders.enter(key, waiting) else {
        panic!("the attempt leads");
    };
    guard
}

/// The flight an attempt must follow.
fn follow(holders: &LocalHolders, key: &Arc<str>) -> Arc<Flight> {
    let Admission::Follow(flight) = holders.enter(key, false) else {
        panic!("the attempt follows");
    };
    flight
}

#[tokio::test]
async fn attempts_during_a_flight_share_its_outcome_and_then_see_the_holder() {
    let holders = LocalHolders::default();
    let key = key();
    let guard = lead(&holders, &key, false);
    let flight = follow(&holders, &key);
    let waiting = tokio::spawn({
        let flight = flight.clone();
        async move { flight.outcome().await }
    });
    let held = lease(&key, Duration::from_secs(10));
    guard.finish(&Ok(held.clone()));
    assert!(matches!(waiting.await.unwrap(), Outcome::Won));
    assert!(matches!(holders.enter(&key, false), Admission::Held { .. }));
    assert!(holders.holder(&key).is_some());
    // Released: gone at once, and a free key leads again.
    assert!(holders.released(&key, held.token, "p:"));
    assert!(!holders.contains(&key));
    assert!(matches!(holders.enter(&key, false), Admission::Lead(_)));
}

#[tokio::test]
async fn the_followers_of_a_displaced_plain_attempt_follow_the_waiting_one() {
    let holders = LocalHolders::default();
    let key = key();
    let plain = lead(&holders, &key, false);
    let flight = follow(&holders, &key);
    let waiting = lead(&holders, &key, true);
    // Told at once: they enter again and follow the waiting attempt.
    assert!(matches!(flight.outcome().await, Outcome::Abandoned));
    let flight = follow(&holders, &key);
    // The displaced attempt, refused, leaves the waiting one's slot alone.
    plain.finish(&Err(LockError::Taken {
        retry_after: Duration::from_secs(1),
    }));
    assert!(holders.contains(&key));
    waiting.finish(&Err(LockError::Taken {
        retry_after: Duration::from_secs(2),
    }));
    assert!(matches!(flight.outcome().await, Outcome::Taken(d) if d == Duration::from_secs(2)));
    assert!(!holders.contains(&key));
}

#[tokio::test]
async fn a_lease_that_takes_another_attempts_slot_tells_its_followers() {
    let holders = LocalHolders::default();
    let key = key();
    let plain = lead(&holders, &key, false);
    let _waiting = lead(&holders, &key, true);
    let flight = follow(&holders, &key);
    // The displaced plain attempt wins after all: its lease is the holder, and the
    // waiting attempt's followers find it when they look again.
    plain.finish(&Ok(lease(&key, Duration::from_secs(10))));
    assert!(matches!(flight.outcome().await, Outcome::Won));
    assert!(matches!(holders.enter(&key, false), Admission::Held { .. }));
}

#[test]
fn a_cancelled_flight_frees_the_slot() {
    let holders = LocalHolders::default();
    let key = key();
    let guard = holders.enter(&key, false);
    let flight = follow(&holders, &key);
    drop(guard);
    assert!(!holders.contains(&key));
    assert!(matches!(*flight.lock(), Some(Outcome::Abandoned)));
}

#[test]
fn a_holder_leaves_when_lost_or_expired_and_moves_when_renewed() {
    let holders = LocalHolders::default();
    let key = key();
    let guard = lead(&holders, &key, false);
    let held = lease(&key, Duration::from_millis(1));
    guard.finish(&Ok(held.clone()));
    // Another token does not touch it.
    holders.lost(&key, Token::random());
    assert!(holders.contains(&key));
    holders.renewed(&key, held.token, Instant::now() + Duration::from_secs(5));
    assert!(holders.holder(&key).is_some(), "renewed");
    holders.lost(&key, held.token);
    assert!(holders.holder(&key).is_none(), "lost");

    let guard = lead(&holders, &key, false);
    guard.finish(&Ok(lease(&key, Duration::ZERO)));
    assert!(holders.holder(&key).is_none(), "expired");
    assert!(matches!(holders.enter(&key, false), Admission::Lead(_)));
}
