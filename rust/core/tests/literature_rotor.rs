//! Rotor's dynamic program against an exhaustive search of every operation sequence on tiny
//! chains (one or several state options per stage), and its memory guarantee.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};

use hrockmate_core::literature::rotor::{
    min_memory, op_options, peak_of, solve, solve_refined, Bounds, Chain, ChainOp, Stage, StateOption,
};
use hrockmate_core::literature::LiteratureError;
use proptest::prelude::*;

/// Least total time over the persistent operation sequences of the chain model with every
/// step's memory within `limit` (Dijkstra over stored sets), or None. Times must be whole numbers.
///
/// Persistent: a stored output that served as the starting point of a recomputation (a forward
/// of the next stage that does not directly follow its own computation) stays stored until the
/// backward of the next stage has run. Without this rule an exhaustive search can beat the
/// program by dropping a starting point early and recomputing it later, which is outside the
/// class of strategies that Rotor optimises over.
fn brute_force(chain: &Chain, limit: u64) -> Option<u64> {
    let l = chain.stages.len();
    assert!(l <= 8 && chain.stages.iter().all(|s| s.options.len() <= 16));
    let st = |k: usize| &chain.stages[k - 1];
    let x = |k: usize| if k == 0 { chain.input_bytes } else { st(k).out_bytes };
    let xb = |k: usize, o: usize| st(k).options[o].state_bytes.max(st(k).out_bytes);
    let g = |k: usize| if k == l { chain.final_grad_bytes } else { st(k + 1).grad_bytes };
    // State: stored outputs (bit k for a_k, k >= 1), stored full states (bit k), gradient index,
    // pinned outputs (bit k), stage of the last Forward if only frees followed it (else 0),
    // option of each stored full state (4 bits per stage, bits 4k..4k+4; 0 when not stored).
    type State = (u32, u32, usize, u32, usize, u64);
    let opt_of = |opts: u64, k: usize| (opts >> (4 * k) & 0xf) as usize;
    let mem = |(a, ab, d, _, _, opts): State| -> u64 {
        let mut m = x(0) + g(d);
        for k in 1..=l {
            if a >> k & 1 == 1 {
                m += x(k);
            }
            if ab >> k & 1 == 1 {
                m += xb(k, opt_of(opts, k));
            }
        }
        m
    };
    let start: State = (0, 0, l, 0, 0, 0);
    if mem(start) > limit {
        return None;
    }
    let mut best: HashMap<State, u64> = HashMap::new();
    let mut heap = BinaryHeap::new();
    heap.push(Reverse((0u64, start)));
    best.insert(start, 0);
    while let Some(Reverse((cost, s))) = heap.pop() {
        if best.get(&s).is_some_and(|&c| c < cost) {
            continue;
        }
        let (a, ab, d, pin, last, opts) = s;
        if d == 0 {
            return Some(cost);
        }
        let cur = mem(s);
        let input = |k: usize| k == 1 || (a >> (k - 1) & 1 == 1) || (ab >> (k - 1) & 1 == 1);
        // Starting a forward from a stored output that was not just computed pins it.
        let pin_for = |k: usize| {
            if k >= 2 && a >> (k - 1) & 1 == 1 && last != k - 1 {
                pin | 1 << (k - 1)
            } else {
                pin
            }
        };
        let mut next: Vec<(State, u64, u64)> = Vec::new(); // (state, peak, time)
        for k in 1..=d {
            let stored = (a >> k & 1 == 1) || (ab >> k & 1 == 1);
            if input(k) && !stored {
                let p = pin_for(k);
                next.push(((a | 1 << k, ab, d, p, k, opts), cur + x(k) + st(k).fwd_overhead, st(k).fwd_time as u64));
                for (o, opt) in st(k).options.iter().enumerate() {
                    let with = opts | (o as u64) << (4 * k);
                    next.push(((a, ab | 1 << k, d, p, 0, with), cur + xb(k, o) + opt.fwd_overhead, opt.fwd_time as u64));
                }
            }
            let pinned = pin >> k & 1 == 1 && d > k;
            if a >> k & 1 == 1 && ab >> (k + 1) & 1 == 0 && !pinned {
                next.push(((a & !(1 << k), ab, d, pin & !(1 << k), last, opts), cur, 0));
            }
        }
        if ab >> d & 1 == 1 && input(d) {
            let o = opt_of(opts, d);
            let opt = &st(d).options[o];
            let without = opts & !(0xf << (4 * d));
            next.push((
                (a, ab & !(1 << d), d - 1, pin, 0, without),
                cur + st(d).grad_bytes + opt.bwd_overhead,
                opt.bwd_time as u64,
            ));
        }
        for (ns, peak, t) in next {
            if peak > limit || mem(ns) > limit {
                continue;
            }
            let c = cost + t;
            if best.get(&ns).is_none_or(|&old| c < old) {
                best.insert(ns, c);
                heap.push(Reverse((c, ns)));
            }
        }
    }
    None
}

/// A stage with a single state option (the model of the paper).
#[allow(clippy::too_many_arguments)]
fn single(fwd: u32, fwd_all: u32, bwd: u32, out: u64, state: u64, grad: u64, fo: u64, foa: u64, bo: u64) -> Stage {
    Stage {
        fwd_time: fwd as f64,
        out_bytes: out,
        grad_bytes: grad,
        fwd_overhead: fo,
        options: vec![StateOption {
            fwd_time: fwd_all as f64,
            state_bytes: state,
            fwd_overhead: foa,
            bwd_time: bwd as f64,
            bwd_overhead: bo,
        }],
    }
}

fn chain_strategy(max_len: usize) -> impl Strategy<Value = Chain> {
    let stage = (1u32..6, 0u32..3, 1u32..6, 0u64..6, 0u64..6, 0u64..4, 0u64..3, 0u64..3, 0u64..3).prop_map(
        |(f, extra, b, out, state_extra, grad, fo, foa, bo)| single(f, f + extra, b, out, out + state_extra, grad, fo, foa, bo),
    );
    (0u64..4, 0u64..4, prop::collection::vec(stage, 1..=max_len)).prop_map(|(input_bytes, final_grad_bytes, stages)| Chain {
        input_bytes,
        final_grad_bytes,
        stages,
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    #[test]
    fn dp_matches_exhaustive_search_on_tiny_chains(chain in chain_strategy(4), extra in 0u64..25) {
        matches_exhaustive_search(&chain, extra)?;
    }

    #[test]
    fn coarse_slots_never_exceed_the_limit(chain in chain_strategy(8), factor in 1u64..4, slots in 1usize..40) {
        let limit = min_memory(&chain).unwrap() * factor + 1;
        if let Ok(sol) = solve(&chain, limit, slots) {
            let (peak, _) = peak_of(&chain, &sol.ops).unwrap();
            prop_assert!(peak <= limit);
        }
    }
}

#[test]
fn homogeneous_chain_trades_time_for_memory() {
    let stage = single(1, 1, 2, 10, 10, 10, 0, 0, 0);
    let chain = Chain { input_bytes: 10, final_grad_bytes: 10, stages: vec![stage; 16] };
    let all = solve(&chain, 10_000, 1000).unwrap();
    assert_eq!(all.time, 16.0 * 3.0, "enough memory: no recomputation");
    let mut last_time = all.time;
    let mut last_limit = u64::MAX;
    for limit in [150u64, 100, 70, 50] {
        let sol = solve(&chain, limit, limit as usize).unwrap();
        assert!(sol.peak_bytes <= limit);
        assert!(sol.time >= last_time, "less memory cannot be faster");
        assert!(limit < last_limit);
        last_time = sol.time;
        last_limit = limit;
    }
    assert!(last_time > all.time);
    let min = min_memory(&chain).unwrap();
    match solve(&chain, min - 1, 1000) {
        Err(LiteratureError::Infeasible { min_bytes, .. }) => assert_eq!(min_bytes, min),
        other => panic!("expected infeasible below {min}, got {other:?}"),
    }
    assert!(solve(&chain, min, min as usize).is_ok());
}

/// Chains whose stages have `1..=max_opts` state options (whole-number times).
fn options_chain_strategy(max_len: usize, min_opts: usize, max_opts: usize) -> impl Strategy<Value = Chain> {
    let option = (1u32..6, 0u64..6, 0u64..3, 1u32..8, 0u64..3).prop_map(|(f, state_extra, foa, b, bo)| StateOption {
        fwd_time: f as f64,
        state_bytes: state_extra,
        fwd_overhead: foa,
        bwd_time: b as f64,
        bwd_overhead: bo,
    });
    let stage = (1u32..6, 0u64..6, 0u64..4, 0u64..3, prop::collection::vec(option, min_opts..=max_opts)).prop_map(
        |(f, out, grad, fo, mut options)| {
            // State sizes are drawn on top of the output (the model raises smaller ones anyway).
            for o in &mut options {
                o.state_bytes += out;
            }
            Stage { fwd_time: f as f64, out_bytes: out, grad_bytes: grad, fwd_overhead: fo, options }
        },
    );
    (0u64..4, 0u64..4, prop::collection::vec(stage, 1..=max_len)).prop_map(|(input_bytes, final_grad_bytes, stages)| Chain {
        input_bytes,
        final_grad_bytes,
        stages,
    })
}

/// The chain with only option `pick[k] % options` kept for each stage `k`.
fn restricted(chain: &Chain, pick: &[usize]) -> Chain {
    let mut c = chain.clone();
    for (k, st) in c.stages.iter_mut().enumerate() {
        let o = pick[k] % st.options.len();
        st.options = vec![st.options[o].clone()];
    }
    c
}

/// Each `ForwardAll` and `Backward` of `ops` with its option, as `peak_of` resolves them.
fn check_options(chain: &Chain, ops: &[ChainOp]) -> Result<(), TestCaseError> {
    let opts = op_options(ops);
    for (op, o) in ops.iter().zip(&opts) {
        match *op {
            ChainOp::ForwardAll(k, oo) => {
                prop_assert_eq!(*o, Some(oo));
                prop_assert!(oo < chain.stages[k - 1].options.len());
            }
            ChainOp::Backward(_) => prop_assert!(o.is_some(), "backward without a stored state in {:?}", ops),
            _ => prop_assert_eq!(*o, None),
        }
    }
    Ok(())
}

/// The program at a limit near the chain's minimum, with one byte per slot (no rounding, so it
/// is exact), against exhaustive search: same time or both infeasible, a valid peak within the
/// limit, consistent option choices, and a feasible reported minimum.
fn matches_exhaustive_search(chain: &Chain, extra: u64) -> Result<(), TestCaseError> {
    let min = min_memory(chain).unwrap();
    let limit = min.saturating_sub(3) + extra;
    let brute = brute_force(chain, limit);
    match solve(chain, limit, limit.max(1) as usize) {
        Ok(sol) => {
            let (peak, time) = peak_of(chain, &sol.ops).unwrap();
            prop_assert!(peak <= limit, "peak {} over limit {}", peak, limit);
            prop_assert_eq!(peak, sol.peak_bytes);
            prop_assert_eq!(Some(time as u64), brute, "limit {} ops {:?}", limit, sol.ops);
            check_options(chain, &sol.ops)?;
        }
        Err(LiteratureError::Infeasible { min_bytes, .. }) => {
            prop_assert_eq!(brute, None, "the program found nothing within {} but a sequence exists", limit);
            prop_assert_eq!(min_bytes, min);
            prop_assert!(limit < min);
        }
        Err(e) => prop_assert!(false, "{}", e),
    }
    // The reported minimum is feasible.
    prop_assert!(brute_force(chain, min).is_some());
    Ok(())
}


proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    #[test]
    fn options_dp_matches_exhaustive_search_on_tiny_chains(chain in options_chain_strategy(3, 2, 2), extra in 0u64..25) {
        matches_exhaustive_search(&chain, extra)?;
    }

    #[test]
    fn options_are_never_slower_than_one_option_per_stage(
        chain in options_chain_strategy(7, 1, 3),
        pick in prop::collection::vec(0usize..3, 7),
        extra in 0u64..40,
        slots in prop_oneof![Just(0usize), 1usize..60],
    ) {
        let one = restricted(&chain, &pick);
        let min = min_memory(&chain).unwrap();
        prop_assert!(min <= min_memory(&one).unwrap());
        let limit = min + extra;
        // 0: one byte per slot (exact).
        let slots = if slots == 0 { limit.max(1) as usize } else { slots };
        let many = solve(&chain, limit, slots);
        if let Ok(sol) = &many {
            let (peak, time) = peak_of(&chain, &sol.ops).unwrap();
            prop_assert!(peak <= limit, "peak {} over limit {}", peak, limit);
            prop_assert_eq!((peak, time), (sol.peak_bytes, sol.time));
            check_options(&chain, &sol.ops)?;
        }
        match solve(&one, limit, slots) {
            Ok(r) => {
                let sol = many.expect("options cannot lose a limit that one option per stage meets");
                prop_assert!(sol.time <= r.time, "{} slower than {} with one option per stage", sol.time, r.time);
            }
            Err(LiteratureError::Infeasible { .. }) => {}
            Err(e) => prop_assert!(false, "{}", e),
        }
        // Refining the slots always meets a limit the exact model meets.
        if slots < limit as usize {
            let sol = solve_refined(&chain, limit, slots, &Bounds::default()).unwrap();
            prop_assert!(sol.peak_bytes <= limit);
        }
    }

    #[test]
    fn one_option_per_stage_is_the_single_option_model(chain in chain_strategy(6), pick in prop::collection::vec(0usize..3, 6)) {
        // Duplicating an option changes nothing (ties go to the first option).
        let mut doubled = chain.clone();
        for st in &mut doubled.stages {
            let o = st.options[0].clone();
            st.options.push(o);
        }
        let limit = min_memory(&chain).unwrap() + 5;
        prop_assert_eq!(min_memory(&doubled).unwrap(), min_memory(&chain).unwrap());
        let a = solve(&chain, limit, 20).map(|s| (s.ops, s.time, s.peak_bytes));
        let b = solve(&doubled, limit, 20).map(|s| (s.ops, s.time, s.peak_bytes));
        prop_assert_eq!(&a, &b);
        prop_assert_eq!(solve(&restricted(&doubled, &pick), limit, 20).map(|s| (s.ops, s.time, s.peak_bytes)), a);
    }
}

/// A stage whose cheap-to-compute state does not fit: the program takes the small option.
fn two_option_chain() -> Chain {
    let plain = |state: u64| single(1, 1, 1, 10, state, 10, 0, 0, 0);
    let mut middle = plain(100);
    middle.options.push(StateOption { fwd_time: 1.0, state_bytes: 20, fwd_overhead: 0, bwd_time: 3.0, bwd_overhead: 0 });
    Chain { input_bytes: 10, final_grad_bytes: 10, stages: vec![plain(10), middle, plain(10)] }
}

#[test]
fn a_small_option_makes_a_tight_limit_feasible() {
    let chain = two_option_chain();
    let big = restricted(&chain, &[0, 0, 0]);
    let small = restricted(&chain, &[0, 1, 0]);
    assert!(min_memory(&chain).unwrap() < min_memory(&big).unwrap());
    assert_eq!(min_memory(&chain).unwrap(), min_memory(&small).unwrap());
    // Plenty of memory: everything stored, with the fast option.
    let all = solve(&chain, 10_000, 10_000).unwrap();
    assert_eq!(all.time, 6.0);
    assert!(all.ops.contains(&ChainOp::ForwardAll(2, 0)));
    // Below what the big state needs: option 1 in the middle.
    let limit = min_memory(&big).unwrap() - 1;
    assert!(matches!(solve(&big, limit, limit as usize), Err(LiteratureError::Infeasible { .. })));
    let sol = solve(&chain, limit, limit as usize).unwrap();
    assert!(sol.peak_bytes <= limit);
    assert!(sol.ops.contains(&ChainOp::ForwardAll(2, 1)), "{:?}", sol.ops);
    let opts = op_options(&sol.ops);
    let back = sol.ops.iter().position(|&op| op == ChainOp::Backward(2)).unwrap();
    assert_eq!(opts[back], Some(1));
    assert_eq!(peak_of(&chain, &sol.ops).unwrap(), (sol.peak_bytes, sol.time));
    match solve(&chain, min_memory(&chain).unwrap() - 1, 1000) {
        Err(LiteratureError::Infeasible { min_bytes, .. }) => assert_eq!(min_bytes, min_memory(&chain).unwrap()),
        other => panic!("expected infeasible, got {other:?}"),
    }
}

#[test]
fn bad_options_are_rejected_with_the_stage_named() {
    let mut chain = two_option_chain();
    chain.stages[1].options[1].bwd_time = -1.0;
    match solve(&chain, 1000, 100) {
        Err(LiteratureError::InvalidArgument(m)) => assert!(m.contains("stage 2 option 1: bwd_time"), "{m}"),
        other => panic!("expected invalid argument, got {other:?}"),
    }
    chain.stages[1].options.clear();
    match solve(&chain, 1000, 100) {
        Err(LiteratureError::InvalidArgument(m)) => assert!(m.contains("stage 2 has no state option"), "{m}"),
        other => panic!("expected invalid argument, got {other:?}"),
    }
    match min_memory(&chain) {
        Err(LiteratureError::InvalidArgument(m)) => assert!(m.contains("stage 2 has no state option"), "{m}"),
        other => panic!("expected invalid argument, got {other:?}"),
    }
    let chain = two_option_chain();
    let err = peak_of(&chain, &[ChainOp::ForwardAll(1, 1)]).unwrap_err();
    assert!(err.contains("no such option"), "{err}");
}
