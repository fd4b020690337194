//! The lease lifecycle against a model (`proptest-state-machine`): random sequences of
//! acquisitions (one attempt, `try_lock`, a short wait, a waiter woken by a release),
//! extensions, releases, lapses of time past the TTL, guards (`with_lock`, renewed by its
//! watchdog), requests through a `LockLayer` whose handler reenters its lease, and (on
//! Redis) nodes killed, restarted empty, paused and resumed, on the in-process store and on
//! real Redis with 1 and 3 nodes. Two clients share the keys: on Redis two `Redlock`s (one
//! with fencing tokens, one without), in process two handles on one `MemoryLocks` with
//! fencing tokens.
//!
//! After every step, against the model (`model.rs`):
//! - never two holders of a key while both leases are valid (and the older one still
//!   holds a quorum: a node restarted empty may forget a lease, the documented hazard);
//! - fencing tokens of a key only increase (while a quorum of counters survives);
//! - no `Expired` from an extension, a release or a renewal while the lease is valid;
//! - no key left behind after a release that succeeded (read on each node over a direct
//!   connection; in process, `inspect`);
//! - no renewal after a release (the crate's `tower_redlock.extend` spans, counted per key);
//! - and, where the model knows the key is free, no "taken" (a wait whose deadline is past
//!   the holder's validity gets the key; a parked waiter is woken by the release).
//!
//! Bounded for the default run: `LEASE_MODEL_CASES` cases (default 6 on Redis, 16 in
//! process) of up to `LEASE_MODEL_STEPS` steps (default 24). `scripts/verify` runs a longer
//! campaign. Failures are shrunk and saved to `extras/tests/proptest-regressions/`, replayed first on
//! the next run.

// Items shared by this module's files, none used outside it.
#![allow(unreachable_pub)]

use std::marker::PhantomData;
use std::time::Duration;

use proptest::prelude::*;
use proptest::sample::Index;
use proptest::strategy::Union;
use proptest::test_runner::{Config, FileFailurePersistence};
use proptest_state_machine::{ReferenceStateMachine, StateMachineTest, prop_state_machine};

mod model;
mod probe;
mod steps;
mod sut;

use sut::Sut;

/// The keys the steps pick from, and the clients.
pub const KEYS: usize = 2;
pub const CLIENTS: usize = 2;

/// Where the locks live: `NODES` Redis nodes, or 0 for the in-process store.
pub trait Topology: 'static {
    const NODES: usize;
}

pub struct Memory;
pub struct OneNode;
pub struct ThreeNodes;

impl Topology for Memory {
    const NODES: usize = 0;
}
impl Topology for OneNode {
    const NODES: usize = 1;
}
impl Topology for ThreeNodes {
    const NODES: usize = 3;
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Node {
    Up,
    /// Stopped (SIGSTOP): connections open, nothing answers, nothing forgotten.
    Paused,
    /// Killed (SIGKILL): everything it stored is gone.
    Down,
}

/// A span of time, relative to the TTL.
#[derive(Clone, Copy, Debug)]
pub enum Span {
    Tick,
    Quarter,
    PastTtl,
}

impl Span {
    pub fn of(self, ttl: Duration) -> Duration {
        match self {
            Span::Tick => Duration::from_millis(3),
            Span::Quarter => ttl / 4,
            Span::PastTtl => ttl + Duration::from_millis(20),
        }
    }
}

#[derive(Clone, Debug)]
pub enum Step {
    Acquire {
        client: usize,
        key: usize,
    },
    TryLock {
        client: usize,
        key: usize,
    },
    Wait {
        client: usize,
        key: usize,
        within: Span,
    },
    WaitForRelease {
        client: usize,
        lease: Index,
    },
    Extend {
        lease: Index,
    },
    Unlock {
        lease: Index,
    },
    Sleep {
        span: Span,
    },
    Guard {
        client: usize,
        key: usize,
    },
    EndGuard {
        guard: Index,
    },
    Request {
        client: usize,
        key: usize,
    },
    Kill {
        node: usize,
    },
    Restart {
        node: usize,
    },
    Pause {
        node: usize,
    },
    Resume {
        node: usize,
    },
}

/// What the generator needs to know: the nodes' states.
#[derive(Clone, Debug)]
pub struct Reference {
    pub nodes: Vec<Node>,
}

pub struct LeaseMachine<T>(PhantomData<T>);

/// A step on one node.
type NodeStep = fn(usize) -> Step;

fn span() -> impl Strategy<Value = Span> {
    prop_oneof![2 => Just(Span::Tick), 2 => Just(Span::Quarter), 1 => Just(Span::PastTtl)]
}

impl<T: Topology> ReferenceStateMachine for LeaseMachine<T> {
    type State = Reference;
    type Transition = Step;

    fn init_state() -> BoxedStrategy<Reference> {
        Just(Reference {
            nodes: vec![Node::Up; T::NODES],
        })
        .boxed()
    }

    fn transitions(state: &Reference) -> BoxedStrategy<Step> {
        let client = || 0..CLIENTS;
        let ck = || (0..CLIENTS, 0..KEYS);
        let index = any::<Index>;
        let mut steps: Vec<(u32, BoxedStrategy<Step>)> = vec![
            (
                8,
                ck().prop_map(|(client, key)| Step::Acquire { client, key })
                    .boxed(),
            ),
            (
                4,
                ck().prop_map(|(client, key)| Step::TryLock { client, key })
                    .boxed(),
            ),
            (
                4,
                (ck(), span())
                    .prop_map(|((client, key), within)| Step::Wait {
                        client,
                        key,
                        within,
                    })
                    .boxed(),
            ),
            (
                2,
                (client(), index())
                    .prop_map(|(client, lease)| Step::WaitForRelease { client, lease })
                    .boxed(),
            ),
            (6, index().prop_map(|lease| Step::Extend { lease }).boxed()),
            (6, index().prop_map(|lease| Step::Unlock { lease }).boxed()),
            (6, span().prop_map(|span| Step::Sleep { span }).boxed()),
            (
                2,
                ck().prop_map(|(client, key)| Step::Guard { client, key })
                    .boxed(),
            ),
            (
                2,
                index().prop_map(|guard| Step::EndGuard { guard }).boxed(),
            ),
            (
                2,
                ck().prop_map(|(client, key)| Step::Request { client, key })
                    .boxed(),
            ),
        ];
        let with = |wanted: &[Node]| -> Vec<usize> {
            (0..state.nodes.len())
                .filter(|n| wanted.contains(&state.nodes[*n]))
                .collect()
        };
        // About one step in ten is a node's.
        let node_steps: [(u32, Vec<usize>, NodeStep); 4] = [
            (1, with(&[Node::Up, Node::Paused]), |node| Step::Kill {
                node,
            }),
            (1, with(&[Node::Up, Node::Paused, Node::Down]), |node| {
                Step::Restart { node }
            }),
            (1, with(&[Node::Up]), |node| Step::Pause { node }),
            (3, with(&[Node::Paused]), |node| Step::Resume { node }),
        ];
        for (weight, nodes, make) in node_steps {
            if !nodes.is_empty() {
                steps.push((
                    weight,
                    proptest::sample::select(nodes).prop_map(make).boxed(),
                ));
            }
        }
        Union::new_weighted(steps).boxed()
    }

    fn apply(mut state: Reference, step: &Step) -> Reference {
        match *step {
            Step::Kill { node } => state.nodes[node] = Node::Down,
            Step::Restart { node } | Step::Resume { node } => state.nodes[node] = Node::Up,
            Step::Pause { node } => state.nodes[node] = Node::Paused,
            _ => {}
        }
        state
    }

    fn preconditions(state: &Reference, step: &Step) -> bool {
        let is = |node: usize, wanted: &[Node]| {
            state.nodes.get(node).is_some_and(|n| wanted.contains(n))
        };
        match *step {
            Step::Kill { node } => is(node, &[Node::Up, Node::Paused]),
            Step::Restart { node } => is(node, &[Node::Up, Node::Paused, Node::Down]),
            Step::Pause { node } => is(node, &[Node::Up]),
            Step::Resume { node } => is(node, &[Node::Paused]),
            _ => true,
        }
    }
}

pub struct LeaseModel<T>(PhantomData<T>);

impl<T: Topology> StateMachineTest for LeaseModel<T> {
    type SystemUnderTest = Sut;
    type Reference = LeaseMachine<T>;

    fn init_test(_: &Reference) -> Sut {
        Sut::start(T::NODES)
    }

    fn apply(mut sut: Sut, _: &Reference, step: Step) -> Sut {
        sut.run(&step);
        sut
    }

    fn check_invariants(sut: &Sut, _: &Reference) {
        sut.check();
    }

    fn teardown(sut: Sut, _: Reference) {
        sut.finish();
    }
}

fn env(name: &str, default: u32) -> u32 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// Cases and shrinking bounded for the default run; failures saved beside this file.
fn config(default_cases: u32) -> Config {
    Config {
        cases: env("LEASE_MODEL_CASES", default_cases),
        max_shrink_iters: env("LEASE_MODEL_SHRINK", 200),
        failure_persistence: Some(Box::new(FileFailurePersistence::SourceParallel(
            "proptest-regressions",
        ))),
        ..Config::default()
    }
}

fn steps() -> std::ops::Range<usize> {
    1..env("LEASE_MODEL_STEPS", 24) as usize + 1
}

prop_state_machine! {
    #![proptest_config(config(16))]
    #[test]
    fn in_process(sequential steps() => LeaseModel<Memory>);
}

prop_state_machine! {
    #![proptest_config(config(6))]
    #[test]
    fn redis_one_node(sequential steps() => LeaseModel<OneNode>);

    #[test]
    fn redis_three_nodes(sequential steps() => LeaseModel<ThreeNodes>);
}
