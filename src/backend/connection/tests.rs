use super::*;

fn reply(resp: &str) -> Value {
    redis::parse_redis_value(resp.as_bytes()).expect("a RESP reply")
}

#[test]
fn a_replica_is_recognised_in_its_plain_and_its_script_reply() {
    // Redis 7 and Valkey: the error as it is.
    let plain = reply("-READONLY You can't write against a read only replica.\r\n");
    // Redis 6.2: a script's write, wrapped.
    let wrapped = reply(
        "-ERR Error running script (call to f_df28cbe6f0a1b8e6de63a4496b1f820c521a85b8): \
         @user_script:1: @user_script: 1: -READONLY You can't write against a read only \
         replica. \r\n",
    );
    assert!(plain.read_only().is_some());
    assert!(wrapped.read_only().is_some());
    assert!(vec![Value::Okay, wrapped].read_only().is_some());
}

#[test]
fn other_error_replies_say_nothing_against_the_connection() {
    for other in [
        "-ERR unknown command 'FOO'\r\n",
        "-ERR Error running script (call to f_0): @user_script:1: WRONGTYPE Operation \
         against a key holding the wrong kind of value\r\n",
        "-NOSCRIPT No matching script.\r\n",
    ] {
        assert!(reply(other).read_only().is_none(), "{other}");
        let error = redis::RedisError::from(match reply(other) {
            Value::ServerError(e) => e,
            _ => unreachable!("an error reply"),
        });
        assert!(is_reply(&error), "{other}");
    }
    let Value::ServerError(e) = reply("-READONLY You can't write.\r\n") else {
        unreachable!("an error reply")
    };
    assert!(!is_reply(&redis::RedisError::from(e)));
}
