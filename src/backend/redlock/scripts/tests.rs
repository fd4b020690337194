use super::*;

#[test]
fn aux_keys_carry_the_lock_key_as_their_hash_tag() {
    let key = "tower-redlock:/items:42";
    assert_eq!(
        Auxiliary::waiters(key).to_string(),
        "{tower-redlock:/items:42}:waiters"
    );
    assert_eq!(
        Auxiliary::fence(key).to_string(),
        "{tower-redlock:/items:42}:fence"
    );
    let readers = crate::lease::readers_key("p:k");
    assert_eq!(*readers, Auxiliary::readers("p:k").to_string());
    assert_eq!(
        Auxiliary::writer_waiting("p:k").to_string(),
        "{p:k}:writer-waiting"
    );
}

#[test]
fn attempt_replies_decode_to_a_counter_a_holders_ttl_or_a_bad_counter() {
    let keys: [Arc<str>; 2] = ["a".into(), "b".into()];
    let decode = |reply| {
        Attempted::decode(reply, &keys).map_err(|e| match e {
            NodeFailureReason::InvalidFencingCounter { key } => key,
            other => panic!("{other:?}"),
        })
    };
    assert_eq!(decode((1, 0)), Ok(Attempted::Set(0)));
    assert_eq!(decode((1, 7)), Ok(Attempted::Set(7)));
    assert_eq!(decode((0, -1)), Ok(Attempted::Held { pttl_ms: -1 }));
    assert_eq!(decode((0, 5000)), Ok(Attempted::Held { pttl_ms: 5000 }));
    assert_eq!(decode((-1, 2)), Err("{b}:fence".to_owned()));
    // An index out of range names the first key rather than failing.
    assert_eq!(decode((-1, 9)), Err("{a}:fence".to_owned()));
    assert_eq!(decode((-1, i64::MIN)), Err("{a}:fence".to_owned()));
}
