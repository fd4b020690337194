use super::*;

#[test]
fn aux_keys_begin_with_the_prefix_and_carry_the_lock_key_as_their_hash_tag() {
    let (prefix, key) = ("tower-redlock:", "tower-redlock:/items:42");
    assert_eq!(
        Auxiliary::of(Beside::Waiters, prefix, key).to_string(),
        "tower-redlock:{tower-redlock:/items:42}:waiters"
    );
    assert_eq!(
        Auxiliary::of(Beside::Fence, prefix, key).to_string(),
        "tower-redlock:{tower-redlock:/items:42}:fence"
    );
    assert_eq!(
        Auxiliary::of(Beside::Holder, prefix, key).to_string(),
        "tower-redlock:{tower-redlock:/items:42}:holder"
    );
    assert_eq!(
        released(prefix, key).to_string(),
        "tower-redlock:{tower-redlock:/items:42}:released"
    );
    let readers = crate::lease::readers_key("p:", "p:k");
    assert_eq!(
        *readers,
        Auxiliary::of(Beside::Readers, "p:", "p:k").to_string()
    );
    assert_eq!(
        Auxiliary::of(Beside::WriterWaiting, "p:", "p:k").to_string(),
        "p:{p:k}:writer-waiting"
    );
}

#[test]
fn attempt_replies_decode_to_a_counter_a_holders_ttl_or_a_bad_counter() {
    let keys: [Arc<str>; 2] = ["p:a".into(), "p:b".into()];
    let decode = |reply| {
        Attempted::decode(reply, "p:", &keys).map_err(|e| match e {
            NodeFailureReason::InvalidFencingCounter { key } => key,
            other => panic!("{other:?}"),
        })
    };
    assert_eq!(decode((1, 0)), Ok(Attempted::Set(0)));
    assert_eq!(decode((1, 7)), Ok(Attempted::Set(7)));
    assert_eq!(decode((0, -1)), Ok(Attempted::Held { pttl_ms: -1 }));
    assert_eq!(decode((0, 5000)), Ok(Attempted::Held { pttl_ms: 5000 }));
    assert_eq!(decode((-1, 2)), Err("p:{p:b}:fence".to_owned()));
    // An index out of range names the first key rather than failing.
    assert_eq!(decode((-1, 9)), Err("p:{p:a}:fence".to_owned()));
    assert_eq!(decode((-1, i64::MIN)), Err("p:{p:a}:fence".to_owned()));
}
