//! Bounded work (docs/graph-ir.md, "Limits"): byte sums are exact or the graph is refused,
//! Rotor's tables fit their bound or the call is refused, and long native work stops at its
//! time limit or when cancelled.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use hrockmate_core::graph::Role;
use hrockmate_core::io::{parse_graph_json, parse_schedule_json, validate};
use hrockmate_core::limits::{Stop, Stopped, MAX_GRAPH_BYTES};
use hrockmate_core::literature::chain::rotor_within;
use hrockmate_core::literature::rotor::{
    fit_slots, solve_within, table_bytes, Bounds, Chain, Stage, StateOption, MIN_SLOTS,
};
use hrockmate_core::literature::twremat::twremat_points_within;
use hrockmate_core::literature::LiteratureError;
use hrockmate_core::partition::synthetic::chain;
use hrockmate_core::schedule::{Schedule, Step};
use hrockmate_core::schedules::{recompute_all, store_all};
use hrockmate_core::simulate::{simulate, simulate_within, SimulateError};
use hrockmate_core::testgen::{random_training_graph, GenParams, Rng};
use hrockmate_core::graph::Graph;
use proptest::prelude::*;

/// A chain model of `n` stages (one option each), sizes in bytes.
fn uniform_chain(n: usize, bytes: u64) -> Chain {
    let option = StateOption { fwd_time: 1.0, state_bytes: 2 * bytes, fwd_overhead: 0, bwd_time: 2.0, bwd_overhead: 0 };
    let stage = Stage { fwd_time: 1.0, out_bytes: bytes, grad_bytes: bytes, fwd_overhead: 0, options: vec![option] };
    Chain { input_bytes: bytes, final_grad_bytes: bytes, stages: vec![stage; n] }
}

#[test]
fn rotor_reduces_its_slots_to_fit_the_table_bound() {
    assert_eq!(fit_slots(50, 500, u64::MAX).unwrap(), 500);
    let bound = 1 << 20;
    let slots = fit_slots(50, 500, bound).unwrap();
    assert!((MIN_SLOTS..500).contains(&slots), "{slots}");
    assert!(table_bytes(50, slots) <= u128::from(bound) && table_bytes(50, slots + 1) > u128::from(bound));
    // The program runs with those slots and still meets the limit.
    let c = uniform_chain(50, 1000);
    let sol = solve_within(&c, 60_000, 500, &Bounds { max_table_bytes: bound, stop: Stop::never() }).unwrap();
    assert_eq!(sol.slots, slots);
    assert!(sol.peak_bytes <= 60_000);
    // Asked for fewer slots than the floor: those are kept.
    assert_eq!(fit_slots(50, 4, bound).unwrap(), 4);
}

#[test]
fn rotor_on_10k_stages_is_refused_quickly_with_the_sizes_named() {
    let start = Instant::now();
    let err = fit_slots(10_000, 500, 1 << 30).unwrap_err();
    let msg = err.to_string();
    assert!(matches!(err, LiteratureError::TooLarge(_)));
    assert!(msg.contains("Rotor on 10000 stages needs 9.50 GiB") && msg.contains("1.00 GiB allowed"), "{msg}");
    // On the graph, the refusal comes before the chain model is built.
    let g = chain(10_000, 3);
    let err = rotor_within(&g, u64::MAX >> 4, 500, &Bounds::default()).unwrap_err();
    assert!(matches!(err, LiteratureError::TooLarge(_)), "{err}");
    assert!(start.elapsed().as_secs_f64() < 10.0);
}

#[test]
fn rotor_stops_at_its_time_limit_and_when_cancelled() {
    let c = uniform_chain(400, 1000);
    let limit = 30_000;
    let start = Instant::now();
    let bounds = Bounds { max_table_bytes: 1 << 26, stop: Stop::new(None, Some(0.2)).unwrap() };
    match solve_within(&c, limit, 500, &bounds) {
        Err(LiteratureError::Stopped(Stopped::TimeLimit { seconds })) => assert_eq!(seconds, 0.2),
        other => panic!("expected the time limit, got {other:?}"),
    }
    assert!(start.elapsed().as_secs_f64() < 2.0, "{:?}", start.elapsed());
    let cancel = AtomicBool::new(true);
    let bounds = Bounds { max_table_bytes: 1 << 26, stop: Stop::new(Some(&cancel), None).unwrap() };
    assert!(matches!(solve_within(&c, limit, 500, &bounds), Err(LiteratureError::Stopped(Stopped::Cancelled))));
    cancel.store(false, Ordering::Relaxed);
    let err = rotor_within(&chain(300, 1), 1 << 40, 500, &Bounds { max_table_bytes: 1 << 30, stop: Stop::new(None, Some(0.0)).unwrap() });
    assert!(matches!(err, Err(LiteratureError::Stopped(Stopped::TimeLimit { .. }))), "{err:?}");
}

#[test]
fn rotor_chains_whose_sizes_overflow_are_refused() {
    let mut c = uniform_chain(3, 1000);
    c.stages[1].out_bytes = MAX_GRAPH_BYTES;
    match solve_within(&c, u64::MAX, 100, &Bounds::default()) {
        Err(LiteratureError::InvalidArgument(m)) => assert!(m.contains("past 2^62-1 bytes (4 EiB) at stage 2"), "{m}"),
        other => panic!("expected invalid argument, got {other:?}"),
    }
}

#[test]
fn twremat_and_simulate_stop_when_asked() {
    let g = chain(3_000, 2);
    let stop = Stop::new(None, Some(0.0)).unwrap();
    let err = twremat_points_within(&g, None, None, &stop).unwrap_err();
    assert!(matches!(err, LiteratureError::Stopped(Stopped::TimeLimit { .. })), "{err}");
    let s = recompute_all(&chain(400, 2)).unwrap();
    assert!(s.steps.len() > 65_536);
    let cancel = AtomicBool::new(true);
    let err = simulate_within(&chain(400, 2), &s, &Stop::new(Some(&cancel), None).unwrap()).unwrap_err();
    assert_eq!(err, SimulateError::Stopped(Stopped::Cancelled));
}

#[test]
fn sizes_past_int64_are_refused_at_parse_time() {
    let graph = |bytes: &str| {
        format!(
            r#"{{"format": "hrockmate-graph", "version": 1, "tensors": [
                {{"name": "x", "bytes": 8, "role": "input"}},
                {{"name": "y", "bytes": {bytes}, "role": "output"}}],
              "ops": [{{"name": "f", "phase": "forward", "time": 1.0, "inputs": [0], "outputs": [1]}}]}}"#
        )
    };
    assert!(parse_graph_json(&graph("4611686018427387000")).is_ok());
    for big in ["9223372036854775808", "18446744073709551615", "9.3e18"] {
        let msg = parse_graph_json(&graph(big)).unwrap_err().to_string();
        assert!(msg.contains("tensor 1 'y': field 'bytes': expected an integer >= 0 (at most 2^63-1)"), "{msg}");
    }
    // Within int64, but past the sum the core adds up exactly.
    let msg = parse_graph_json(&graph("9223372036854775807")).unwrap_err().to_string();
    assert!(msg.contains("tensor 1 'y': field 'bytes': is 9223372036854775807, which takes the graph's sizes past 2^62-1"), "{msg}");
    let schedule = |id: &str| {
        format!(r#"{{"format": "hrockmate-schedule", "version": 1, "forward_len": 0, "steps": [["compute", {id}]]}}"#)
    };
    assert!(parse_schedule_json(&schedule("9223372036854775807")).is_ok());
    let msg = parse_schedule_json(&schedule("9223372036854775808")).unwrap_err().to_string();
    assert!(msg.contains("step 0: id 9223372036854775808 is out of range (ids are at most 2^63-1)"), "{msg}");
}

/// The simulator's memory model for graphs without views, in u128: during a compute step, what
/// is alive plus the new outputs, recomputed duplicates and the workspace; after a free, what
/// is alive. Pre-existing tensors are never counted.
fn reference_timeline(g: &Graph, s: &Schedule) -> Vec<u128> {
    let mut alive: Vec<bool> = g.tensors.iter().map(|t| t.role.is_preexisting()).collect();
    let counted = |t: usize| !g.tensors[t].role.is_preexisting();
    let mut current: u128 = 0;
    let mut timeline = Vec::new();
    for step in &s.steps {
        match *step {
            Step::Compute(o) => {
                let op = &g.ops[o];
                let (mut new, mut transient) = (0u128, u128::from(op.workspace));
                for &t in &op.outputs {
                    let bytes = u128::from(g.tensors[t].bytes);
                    if counted(t) && alive[t] {
                        transient += bytes;
                    } else if counted(t) {
                        new += bytes;
                    }
                    alive[t] = true;
                }
                timeline.push(current + new + transient);
                current += new;
            }
            Step::Free(t) => {
                alive[t] = false;
                current -= u128::from(g.tensors[t].bytes);
                timeline.push(current);
            }
        }
    }
    timeline
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, failure_persistence: None, ..ProptestConfig::default() })]

    /// Byte sizes near the limits (each a share of MAX_GRAPH_BYTES around its fair share, some
    /// near u64::MAX): the graph either simulates exactly (the u128 reference) or is refused
    /// with an error naming a tensor or op, exactly when its sizes pass the documented bound.
    #[test]
    fn huge_sizes_simulate_exactly_or_are_refused(seed in any::<u64>(), n in 2usize..30, spread in 1u64..4, near_max in 0u32..8) {
        let p = GenParams { n_forward: n, n_params: 2, view_prob: 0.0, workspace_prob: 0.3, ..GenParams::default() };
        let mut g = random_training_graph(seed, &p);
        let mut rng = Rng::new(seed ^ 0x5eed);
        let sized = g.tensors.len() + g.ops.iter().filter(|o| o.workspace > 0).count();
        let share = MAX_GRAPH_BYTES / sized as u64;
        let size = |rng: &mut Rng| {
            if rng.below(1024) < near_max as usize {
                u64::MAX - rng.range(0, 1 << 20)
            } else {
                // Around the fair share: the sum lands on either side of the bound.
                share / 2 + rng.range(0, share / 2 * spread)
            }
        };
        for t in 0..g.tensors.len() {
            g.tensors[t].bytes = size(&mut rng);
        }
        for o in 0..g.ops.len() {
            if g.ops[o].workspace > 0 {
                g.ops[o].workspace = size(&mut rng);
            }
        }
        let total: u128 = g.tensors.iter().map(|t| u128::from(t.bytes)).sum::<u128>()
            + g.ops.iter().map(|o| u128::from(o.workspace)).sum::<u128>();
        match validate(&g) {
            Err(e) => {
                let msg = e.to_string();
                prop_assert!(total > u128::from(MAX_GRAPH_BYTES), "refused within the bound: {msg}");
                prop_assert!(msg.contains("past 2^62-1 bytes") && (msg.starts_with("tensor ") || msg.starts_with("op ")), "{msg}");
            }
            Ok(()) => {
                prop_assert!(total <= u128::from(MAX_GRAPH_BYTES));
                for s in [store_all(&g), recompute_all(&g).unwrap()] {
                    let sim = simulate(&g, &s).unwrap();
                    let want = reference_timeline(&g, &s);
                    let got: Vec<u128> = sim.timeline.iter().map(|&b| u128::from(b)).collect();
                    prop_assert_eq!(&got, &want);
                    prop_assert_eq!(u128::from(sim.peak_bytes), want.iter().copied().max().unwrap_or(0));
                    prop_assert!(sim.peak_bytes <= i64::MAX as u64);
                }
            }
        }
    }
}

#[test]
fn the_bound_is_reached_exactly() {
    // A graph whose sizes add up to the bound exactly is accepted; one byte more is refused.
    let mut g = chain(3, 1);
    for t in &mut g.tensors {
        t.bytes = 0;
    }
    let out = g.tensors.iter().position(|t| t.role == Role::Output).unwrap();
    g.tensors[out].bytes = MAX_GRAPH_BYTES;
    validate(&g).unwrap();
    let sim = simulate(&g, &store_all(&g)).unwrap();
    assert_eq!(sim.peak_bytes, MAX_GRAPH_BYTES);
    g.tensors[0].bytes = 1;
    assert!(validate(&g).unwrap_err().to_string().contains("past 2^62-1 bytes"));
}
