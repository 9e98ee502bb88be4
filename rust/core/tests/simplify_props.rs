//! Simplification keeps the store-all and recompute-all schedules' peak and time, and expanded
//! schedules of the simplified graph are valid on the original with the same numbers.

use hrockmate_core::graph::Graph;
use hrockmate_core::schedules::{recompute_all, store_all};
use hrockmate_core::simplify::{simplify, SimplifyConfig};
use hrockmate_core::simulate::simulate;
use hrockmate_core::testgen::{random_training_graph, GenParams};
use proptest::prelude::*;

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-9 * a.abs().max(b.abs()).max(1.0)
}

fn graph_with_free_views(seed: u64, n: usize) -> Graph {
    let mut g = random_training_graph(seed, &GenParams { n_forward: n, view_prob: 0.3, ..GenParams::default() });
    // views from the generator have a measured time; make some of them free so they fold
    for op in g.ops.iter_mut() {
        if op.outputs.iter().all(|&t| g.tensors[t].alias_of.is_some()) && !seed.is_multiple_of(3) {
            op.time = 0.0;
            op.workspace = 0;
        }
    }
    g
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn simplification_keeps_reference_schedules(seed in any::<u64>(), n in 1usize..40) {
        let g = graph_with_free_views(seed, n);
        hrockmate_core::io::validate(&g).unwrap();
        let s = simplify(&g, &SimplifyConfig::default());
        hrockmate_core::io::validate(&s.graph).map_err(|e| TestCaseError::fail(e.to_string()))?;
        prop_assert!(s.graph.ops.len() <= g.ops.len());
        for which in ["store_all", "recompute_all"] {
            let make = |x: &Graph| if which == "store_all" { store_all(x) } else { recompute_all(x).unwrap() };
            let a = simulate(&g, &make(&g)).unwrap();
            let sched = make(&s.graph);
            let b = simulate(&s.graph, &sched).map_err(|e| TestCaseError::fail(e.to_string()))?;
            prop_assert_eq!(a.peak_bytes, b.peak_bytes, "{} peak", which);
            prop_assert!(close(a.time, b.time), "{} time {} vs {}", which, a.time, b.time);
            // the expanded schedule runs on the original graph with the same numbers
            let back = s.expand_schedule(&g, &sched).unwrap();
            let c = simulate(&g, &back).map_err(|e| TestCaseError::fail(format!("{which} expanded: {e}")))?;
            prop_assert_eq!(c.peak_bytes, b.peak_bytes, "{} expanded peak", which);
            prop_assert!(close(c.time, b.time));
        }
    }
}
