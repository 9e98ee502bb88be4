//! Chain detection and Rotor schedules on IR graphs: Checkmate's VGG chains, synthetic chains
//! and random training graphs. Every schedule is valid under the simulator and its peak is
//! within the budget.

mod common;

use hrockmate_core::graph::Graph;
use hrockmate_core::literature::chain::{is_chain, rotor, ChainStructure};
use hrockmate_core::literature::LiteratureError;
use hrockmate_core::partition::synthetic;
use hrockmate_core::schedules::store_all;
use hrockmate_core::simulate::simulate;
use hrockmate_core::testgen::{random_training_graph, GenParams};
use proptest::prelude::*;

/// Rotor at a range of budgets between its minimum and store-all: valid, within budget, and
/// never slower with more memory.
fn sweep(g: &Graph, label: &str, budgets: u64, slots: usize) -> Vec<(u64, u64, f64)> {
    let store = simulate(g, &store_all(g)).unwrap();
    let min = match rotor(g, 0, slots) {
        Err(LiteratureError::Infeasible { min_bytes, .. }) => min_bytes,
        other => panic!("{label}: expected infeasible at 0 bytes, got {other:?}"),
    };
    let mut out = Vec::new();
    let mut last_time = f64::INFINITY;
    for i in 0..=budgets {
        let budget = min + (store.peak_bytes.saturating_sub(min)) * i / budgets + i;
        match rotor(g, budget, slots) {
            Ok((_, sim)) => {
                assert!(sim.peak_bytes <= budget, "{label}: peak {} over budget {budget}", sim.peak_bytes);
                assert!(sim.time <= last_time * (1.0 + 1e-9), "{label}: more memory made it slower");
                last_time = sim.time;
                out.push((budget, sim.peak_bytes, sim.time));
            }
            // Slot rounding can make budgets just above the exact minimum infeasible.
            Err(LiteratureError::Infeasible { min_bytes, .. }) if budget < min_bytes + min_bytes / 20 => {}
            Err(e) => panic!("{label}: budget {budget}: {e}"),
        }
    }
    assert!(!out.is_empty(), "{label}: no feasible budget");
    out
}

#[test]
fn vgg_chains_are_chains_and_rotor_saves_memory() {
    let mut graphs = vec![("vgg_like_train.json".to_string(), common::load_repo("vgg_like_train.json"))];
    if let Some(dir) = common::third_party_graphs_dir() {
        for name in ["vgg16_train.json", "vgg19_train.json"] {
            graphs.push((name.to_string(), common::load(&dir.join(name))));
        }
    }
    for (name, g) in graphs {
        let cs = ChainStructure::detect(&g).unwrap();
        assert!(cs.len() >= 15, "{name}: only {} stages", cs.len());
        let points = sweep(&g, &name, 4, 200);
        let store = simulate(&g, &store_all(&g)).unwrap();
        let (_, peak, time) = points[0];
        eprintln!("{name}: {} stages, lowest rotor peak {:.3} of store-all at {:.3}x time", cs.len(),
            peak as f64 / store.peak_bytes as f64, time / store.time);
        // No schedule can go below the largest single step (an op's inputs and outputs).
        let step_bound = g
            .ops
            .iter()
            .map(|o| o.inputs.iter().chain(&o.outputs).map(|&t| g.tensors[t].bytes).sum::<u64>())
            .max()
            .unwrap();
        assert!(peak < store.peak_bytes && time > store.time, "{name}: no trade-off");
        assert!(
            (peak as f64) < 1.05 * step_bound as f64,
            "{name}: rotor's lowest peak {peak} vs the largest step {step_bound}"
        );
        // A little above the store-all peak (slot rounding), rotor recomputes nothing.
        let (_, sim) = rotor(&g, store.peak_bytes + store.peak_bytes / 8, 500).unwrap();
        assert!(sim.time <= store.time * 1.0001, "{name}: {} vs {}", sim.time, store.time);
    }
}

#[test]
fn every_training_graph_gets_a_structure_or_a_clear_error() {
    for path in common::corpus_files() {
        let name = common::file_name(&path);
        let g = common::load(&path);
        if !g.ops.iter().any(|o| o.phase == hrockmate_core::graph::Phase::Backward) {
            continue; // forward-only graphs have no training chain
        }
        match ChainStructure::detect(&g) {
            Ok(cs) => {
                eprintln!("{name}: {} stages", cs.len());
                let store = simulate(&g, &store_all(&g)).unwrap();
                let min = match rotor(&g, 0, 40) {
                    Err(LiteratureError::Infeasible { min_bytes, .. }) => min_bytes,
                    other => panic!("{name}: expected infeasible at 0 bytes, got {other:?}"),
                };
                assert!(min <= store.peak_bytes, "{name}: minimum {min} above store-all {}", store.peak_bytes);
                let budget = min + (store.peak_bytes - min) / 2 + min / 8;
                let (_, sim) = rotor(&g, budget, 40).unwrap_or_else(|e| panic!("{name}: {e}"));
                assert!(sim.peak_bytes <= budget);
            }
            Err(e) => {
                eprintln!("{name}: {e}");
                assert!(e.to_string().contains("not a chain"));
            }
        }
    }
}

#[test]
fn synthetic_chain_is_detected_with_one_stage_per_layer() {
    let g = synthetic::chain(40, 3);
    assert!(is_chain(&g));
    let cs = ChainStructure::detect(&g).unwrap();
    assert!(cs.len() >= 20, "{} stages", cs.len());
    sweep(&g, "chain40", 3, 100);
}

#[test]
fn unet_is_not_a_useful_chain_or_gets_valid_schedules() {
    let g = synthetic::unet(16, 5);
    if let Ok(cs) = ChainStructure::detect(&g) {
        assert!(cs.len() >= 2);
        sweep(&g, "unet16", 3, 100);
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(40))]

    #[test]
    fn rotor_schedules_of_random_graphs_are_valid_and_within_budget(
        seed in 0u64..1_000_000,
        n_forward in 1usize..30,
        window in 1usize..4,
        frac in 0.0f64..1.2,
    ) {
        let p = GenParams { n_forward, window, max_inputs: 2, ..GenParams::default() };
        let g = random_training_graph(seed, &p);
        let Ok(_) = ChainStructure::detect(&g) else { return Ok(()) };
        let store = simulate(&g, &store_all(&g)).unwrap();
        let budget = (store.peak_bytes as f64 * frac) as u64;
        match rotor(&g, budget, 200) {
            Ok((s, sim)) => {
                prop_assert!(sim.peak_bytes <= budget);
                prop_assert_eq!(simulate(&g, &s).unwrap().peak_bytes, sim.peak_bytes);
            }
            Err(LiteratureError::Infeasible { min_bytes, .. }) => {
                prop_assert!(min_bytes > budget || frac < 1.0, "infeasible at {} with min {}", budget, min_bytes);
            }
            Err(e) => prop_assert!(false, "seed {}: {}", seed, e),
        }
    }
}
