//! TW-Remat on random training graphs, long chains and the third-party graphs: every schedule is
//! valid under the simulator, depth limit 0 is store-all, and deeper recursion trades memory
//! for recomputation.

mod common;

use hrockmate_core::graph::Phase;
use hrockmate_core::io::parse_graph_json;
use hrockmate_core::literature::twremat::{twremat_points, TwRemat};
use hrockmate_core::partition::synthetic;
use hrockmate_core::schedules::store_all;
use hrockmate_core::simulate::simulate;
use hrockmate_core::testgen::{random_training_graph, GenParams};
use proptest::prelude::*;

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    #[test]
    fn every_depth_gives_a_valid_schedule_and_depth_zero_is_store_all(
        seed in 0u64..1_000_000,
        n_forward in 0usize..40,
        window in 1usize..10,
        max_inputs in 1usize..4,
    ) {
        let p = GenParams { n_forward, window, max_inputs, ..GenParams::default() };
        let g = random_training_graph(seed, &p);
        let tw = TwRemat::new(&g);
        let base = simulate(&g, &store_all(&g)).unwrap();
        for depth in 0..=tw.height() + 1 {
            let s = tw.schedule(&g, depth).unwrap();
            let sim = simulate(&g, &s).unwrap_or_else(|e| panic!("seed {seed} depth {depth}: {e}"));
            // Backward ops run once; forward ops at least once.
            for (o, op) in g.ops.iter().enumerate() {
                if op.phase == Phase::Backward {
                    prop_assert_eq!(sim.compute_count[o], 1);
                }
            }
            prop_assert!(sim.time >= base.time - 1e-9 * base.time.abs());
            if depth == 0 {
                prop_assert_eq!(sim.peak_bytes, base.peak_bytes, "seed {}", seed);
                prop_assert!((sim.time - base.time).abs() <= 1e-9 * base.time.abs());
            }
        }
    }
}

#[test]
fn long_chain_memory_drops_with_depth_and_full_recursion_is_logarithmic() {
    let n = 256;
    let g = synthetic::chain(n, 7);
    let points = twremat_points(&g, None).unwrap();
    assert!(points.len() >= 4, "expected several points, got {}", points.len());
    let first = &points[0].sim;
    let last = &points.last().unwrap().sim;
    let store = simulate(&g, &store_all(&g)).unwrap();
    assert_eq!(first.peak_bytes, store.peak_bytes);
    assert!(
        last.peak_bytes * 4 < first.peak_bytes,
        "full recursion peak {} vs store-all {}",
        last.peak_bytes,
        first.peak_bytes
    );
    // Full recursion on a chain recomputes O(n log n) forward ops, not O(n^2).
    let computes: u32 = last.compute_count.iter().sum();
    let log_n = (n as f64).log2();
    assert!(
        (computes as f64) < 3.0 * n as f64 * log_n,
        "{computes} compute steps for a chain of {n}"
    );
}

#[test]
fn node_link_graphs_get_several_valid_points() {
    for path in common::corpus_files() {
        let g = parse_graph_json(&std::fs::read_to_string(&path).unwrap()).unwrap();
        let points = twremat_points(&g, None).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        let store = simulate(&g, &store_all(&g)).unwrap();
        assert_eq!(points[0].sim.peak_bytes, store.peak_bytes, "{}", path.display());
        for p in &points {
            eprintln!(
                "{}: depth {} peak {:.3} of store-all, time {:.3}x",
                path.file_name().unwrap().to_string_lossy(),
                p.depth_limit,
                p.sim.peak_bytes as f64 / store.peak_bytes as f64,
                p.sim.time / store.time
            );
        }
        let has_backward = g.ops.iter().any(|o| o.phase == Phase::Backward);
        if has_backward {
            let best = points.iter().map(|p| p.sim.peak_bytes).min().unwrap();
            assert!(best < store.peak_bytes, "{}: no point below store-all", path.display());
        }
    }
}
