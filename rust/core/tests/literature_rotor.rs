//! Rotor's dynamic program against an exhaustive search of every operation sequence on tiny
//! chains, and its memory guarantee.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};

use hrockmate_core::literature::rotor::{min_memory, peak_of, solve, Chain, Stage};
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
    let st = |k: usize| &chain.stages[k - 1];
    let x = |k: usize| if k == 0 { chain.input_bytes } else { st(k).out_bytes };
    let xb = |k: usize| st(k).state_bytes.max(st(k).out_bytes);
    let g = |k: usize| if k == l { chain.final_grad_bytes } else { st(k + 1).grad_bytes };
    // State: stored outputs (bit k for a_k, k >= 1), stored full states (bit k), gradient index,
    // pinned outputs (bit k), stage of the last Forward if only frees followed it (else 0).
    type State = (u32, u32, usize, u32, usize);
    let mem = |(a, ab, d, _, _): State| -> u64 {
        let mut m = x(0) + g(d);
        for k in 1..=l {
            if a >> k & 1 == 1 {
                m += x(k);
            }
            if ab >> k & 1 == 1 {
                m += xb(k);
            }
        }
        m
    };
    let start: State = (0, 0, l, 0, 0);
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
        let (a, ab, d, pin, last) = s;
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
                next.push(((a | 1 << k, ab, d, p, k), cur + x(k) + st(k).fwd_overhead, st(k).fwd_time as u64));
                next.push(((a, ab | 1 << k, d, p, 0), cur + xb(k) + st(k).fwd_all_overhead, st(k).fwd_all_time as u64));
            }
            let pinned = pin >> k & 1 == 1 && d > k;
            if a >> k & 1 == 1 && ab >> (k + 1) & 1 == 0 && !pinned {
                next.push(((a & !(1 << k), ab, d, pin & !(1 << k), last), cur, 0));
            }
        }
        if ab >> d & 1 == 1 && input(d) {
            next.push(((a, ab & !(1 << d), d - 1, pin, 0), cur + st(d).grad_bytes + st(d).bwd_overhead, st(d).bwd_time as u64));
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

fn chain_strategy(max_len: usize) -> impl Strategy<Value = Chain> {
    let stage = (1u32..6, 0u32..3, 1u32..6, 0u64..6, 0u64..6, 0u64..4, 0u64..3, 0u64..3, 0u64..3).prop_map(
        |(f, extra, b, out, state_extra, grad, fo, foa, bo)| Stage {
            fwd_time: f as f64,
            fwd_all_time: (f + extra) as f64,
            bwd_time: b as f64,
            out_bytes: out,
            state_bytes: out + state_extra,
            grad_bytes: grad,
            fwd_overhead: fo,
            fwd_all_overhead: foa,
            bwd_overhead: bo,
        },
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
        let min = min_memory(&chain);
        let limit = min.saturating_sub(3) + extra;
        let brute = brute_force(&chain, limit);
        // One byte per slot: no rounding, so the program is exact.
        match solve(&chain, limit, limit.max(1) as usize) {
            Ok(sol) => {
                let (peak, time) = peak_of(&chain, &sol.ops).unwrap();
                prop_assert!(peak <= limit, "peak {} over limit {}", peak, limit);
                prop_assert_eq!(peak, sol.peak_bytes);
                prop_assert_eq!(Some(time as u64), brute, "limit {} ops {:?}", limit, sol.ops);
            }
            Err(LiteratureError::Infeasible { min_bytes, .. }) => {
                prop_assert_eq!(brute, None, "the program found nothing within {} but a sequence exists", limit);
                prop_assert_eq!(min_bytes, min);
                prop_assert!(limit < min);
            }
            Err(e) => prop_assert!(false, "{}", e),
        }
        // The reported minimum is feasible.
        prop_assert!(brute_force(&chain, min).is_some());
    }

    #[test]
    fn coarse_slots_never_exceed_the_limit(chain in chain_strategy(8), factor in 1u64..4, slots in 1usize..40) {
        let limit = min_memory(&chain) * factor + 1;
        if let Ok(sol) = solve(&chain, limit, slots) {
            let (peak, _) = peak_of(&chain, &sol.ops).unwrap();
            prop_assert!(peak <= limit);
        }
    }
}

#[test]
fn homogeneous_chain_trades_time_for_memory() {
    let stage = Stage {
        fwd_time: 1.0,
        fwd_all_time: 1.0,
        bwd_time: 2.0,
        out_bytes: 10,
        state_bytes: 10,
        grad_bytes: 10,
        fwd_overhead: 0,
        fwd_all_overhead: 0,
        bwd_overhead: 0,
    };
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
    let min = min_memory(&chain);
    match solve(&chain, min - 1, 1000) {
        Err(LiteratureError::Infeasible { min_bytes, .. }) => assert_eq!(min_bytes, min),
        other => panic!("expected infeasible below {min}, got {other:?}"),
    }
    assert!(solve(&chain, min, min as usize).is_ok());
}
