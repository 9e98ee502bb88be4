//! Property tests on random valid training graphs: both reference schedules always pass the
//! simulator, and every graph survives the JSON and flat-array round trips.

use hrockmate_core::arrays::{
    graph_from_arrays, graph_to_arrays, schedule_from_arrays, schedule_to_arrays,
};
use hrockmate_core::graph::Phase;
use hrockmate_core::io::{graph_to_json, parse_graph_json, validate};
use hrockmate_core::schedule::{Schedule, Step};
use hrockmate_core::schedules::{recompute_all, store_all};
use hrockmate_core::simulate::simulate;
use hrockmate_core::testgen::{random_training_graph, shuffle_ops, GenParams};
use proptest::prelude::*;

fn params() -> impl Strategy<Value = GenParams> {
    (
        0usize..40,
        0usize..5,
        1usize..5,
        1usize..12,
        0.0f64..0.5,
        0.0f64..0.5,
        0.0f64..0.3,
        0.0f64..0.2,
        any::<bool>(),
    )
        .prop_map(
            |(
                n_forward,
                n_params,
                max_inputs,
                window,
                view_prob,
                multi_output_prob,
                buffer_prob,
                extra_output_prob,
                input_grad,
            )| GenParams {
                n_forward,
                n_params,
                max_inputs,
                window,
                view_prob,
                multi_output_prob,
                buffer_prob,
                extra_output_prob,
                input_grad,
                ..GenParams::default()
            },
        )
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 200, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn reference_schedules_are_valid(seed in any::<u64>(), p in params(), shuffle in any::<bool>()) {
        let mut g = random_training_graph(seed, &p);
        if shuffle {
            g = shuffle_ops(&g, seed ^ 1);
        }
        prop_assert!(validate(&g).is_ok(), "{:?}", validate(&g));
        let sa = simulate(&g, &store_all(&g));
        prop_assert!(sa.is_ok(), "store_all: {}", sa.unwrap_err());
        let sa = sa.unwrap();
        prop_assert!(sa.compute_count.iter().all(|&c| c == 1));
        let ra = simulate(&g, &recompute_all(&g).unwrap());
        prop_assert!(ra.is_ok(), "recompute_all: {}", ra.unwrap_err());
        let ra = ra.unwrap();
        // Every op runs at least once, so recompute-all never costs less.
        prop_assert!(ra.time >= sa.time - 1e-9);
        prop_assert!(ra.compute_count.iter().all(|&c| c >= 1));
        // Nothing but outputs (and their storages) survives the recompute-all forward.
        prop_assert!(ra.bytes_after_forward <= sa.bytes_after_forward);
        for (o, op) in g.ops.iter().enumerate() {
            if op.phase == Phase::Backward {
                prop_assert_eq!(ra.compute_count[o], 1);
            }
        }
    }

    #[test]
    fn simulator_detects_dropped_computes_and_keeps_frees_monotone(seed in any::<u64>(), p in params(), pick in any::<usize>()) {
        let g = random_training_graph(seed, &p);
        let s = store_all(&g);
        let base = simulate(&g, &s).unwrap();
        let k = pick % s.steps.len();
        let mut steps = s.steps.clone();
        let removed = steps.remove(k);
        let forward_len = if k < s.forward_len { s.forward_len - 1 } else { s.forward_len };
        let cut = Schedule { steps, forward_len };
        match removed {
            // Every op's outputs are read, freed or required, so dropping a compute is caught.
            Step::Compute(_) => {
                let e = simulate(&g, &cut);
                prop_assert!(e.is_err(), "dropping step {} went unnoticed", k);
                prop_assert!(e.unwrap_err().step >= k);
            }
            // Keeping a tensor longer never lowers memory at any later step.
            Step::Free(_) => {
                let r = simulate(&g, &cut);
                prop_assert!(r.is_ok(), "{}", r.unwrap_err());
                let r = r.unwrap();
                prop_assert!(r.peak_bytes >= base.peak_bytes);
                prop_assert_eq!(r.time, base.time);
            }
        }
    }

    #[test]
    fn graphs_round_trip(seed in any::<u64>(), p in params()) {
        let g = random_training_graph(seed, &p);
        let back = parse_graph_json(&graph_to_json(&g)).unwrap();
        prop_assert_eq!(&back, &g);
        let names_t: Vec<String> = g.tensors.iter().map(|t| t.name.clone()).collect();
        let names_o: Vec<String> = g.ops.iter().map(|o| o.name.clone()).collect();
        let mut from_arrays = graph_from_arrays(&graph_to_arrays(&g), Some(&names_t), Some(&names_o)).unwrap();
        // Fields outside the flat form: target, module, shapes.
        for (a, b) in from_arrays.ops.iter_mut().zip(&g.ops) {
            a.target = b.target.clone();
        }
        prop_assert_eq!(&from_arrays.tensors, &g.tensors);
        prop_assert_eq!(&from_arrays.ops, &g.ops);
        let s = store_all(&g);
        let (k, i, f) = schedule_to_arrays(&s);
        prop_assert_eq!(schedule_from_arrays(&k, &i, f as i64).unwrap(), s);
    }
}
