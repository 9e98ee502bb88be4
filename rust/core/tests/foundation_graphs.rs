//! The node-link test graphs (the repository's, and third-party ones when present): all parse,
//! validate, and both reference schedules are valid with the expected memory/time relation.

mod common;

use hrockmate_core::graph::{Phase, Role};
use hrockmate_core::io::{graph_to_json, parse_graph_json};
use hrockmate_core::schedules::{recompute_all, store_all};
use hrockmate_core::simulate::simulate;

#[test]
fn every_node_link_graph_reads_and_round_trips() {
    for path in common::corpus_files() {
        let text = std::fs::read_to_string(&path).unwrap();
        let g = parse_graph_json(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        let name = path.file_name().unwrap().to_string_lossy().to_string();
        assert_eq!(g.time_unit, "units", "{name}");
        assert!(g.num_ops() >= 45, "{name}: {} ops", g.num_ops());
        let oplog = name.ends_with("_oplog.json");
        let again = parse_graph_json(&graph_to_json(&g)).unwrap();
        assert_eq!(again, g, "{name}: IR JSON round trip changed the graph");
        if name.starts_with("random_layered") {
            assert!(g.ops.iter().all(|o| o.phase == Phase::Forward), "{name}");
            assert!(g.tensors.iter().any(|t| t.role == Role::Output), "{name}");
        } else if oplog {
            // Operator logs carry no forward/backward pairing, only the phase flags.
            assert!(g.ops.iter().all(|o| o.differentiates.is_none()), "{name}");
            assert!(g.ops.iter().any(|o| o.phase == Phase::Backward), "{name}");
        } else {
            let loss = g.ops.iter().find(|o| o.name == "Loss").expect("Loss node");
            assert_eq!(loss.phase, Phase::Backward);
            assert_eq!(loss.differentiates, None);
            // Every other backward node differentiates its forward twin.
            for o in g
                .ops
                .iter()
                .filter(|o| o.phase == Phase::Backward && o.name != "Loss")
            {
                let f = o
                    .differentiates
                    .unwrap_or_else(|| panic!("{name}: {} differentiates nothing", o.name));
                assert_eq!(format!("{}_backward", g.ops[f].name), o.name);
            }
            let grads = g
                .tensors
                .iter()
                .filter(|t| t.role == Role::InputGrad)
                .count();
            assert_eq!(grads, 1, "{name}: one backward sink");
        }
    }
}

#[test]
fn reference_schedules_on_node_link_graphs() {
    for path in common::corpus_files() {
        let name = path.file_name().unwrap().to_string_lossy().to_string();
        let g = parse_graph_json(&std::fs::read_to_string(&path).unwrap()).unwrap();
        let sa = simulate(&g, &store_all(&g)).unwrap_or_else(|e| panic!("{name}: store_all: {e}"));
        let ra = simulate(&g, &recompute_all(&g).unwrap())
            .unwrap_or_else(|e| panic!("{name}: recompute_all: {e}"));
        let total: f64 = g.ops.iter().map(|o| o.time).sum();
        assert!(
            (sa.time - total).abs() <= 1e-9 * total.max(1.0),
            "{name}: store_all runs each op once"
        );
        assert!(sa.compute_count.iter().all(|&c| c == 1), "{name}");
        assert!(
            ra.peak_bytes <= sa.peak_bytes,
            "{name}: recompute-all peak {} > store-all {}",
            ra.peak_bytes,
            sa.peak_bytes
        );
        let has_backward = g.ops.iter().any(|o| o.phase == Phase::Backward);
        if has_backward {
            assert!(ra.time > sa.time, "{name}: recompute-all must cost more");
            assert!(ra.bytes_after_forward < sa.bytes_after_forward, "{name}");
        }
        eprintln!(
            "{name}: ops {} store-all peak {} time {} | recompute-all peak {} time {}",
            g.num_ops(),
            sa.peak_bytes,
            sa.time,
            ra.peak_bytes,
            ra.time
        );
    }
}

#[test]
fn simulator_scales_to_100k_ops() {
    use hrockmate_core::testgen::{random_training_graph, GenParams};
    let p = GenParams {
        n_forward: 45_000,
        n_params: 64,
        ..GenParams::default()
    };
    let g = random_training_graph(7, &p);
    assert!(g.num_ops() >= 100_000, "{} ops", g.num_ops());
    let s = store_all(&g);
    let t0 = std::time::Instant::now();
    let r = simulate(&g, &s).expect("store_all is valid");
    let elapsed = t0.elapsed();
    assert_eq!(r.timeline.len(), s.steps.len());
    eprintln!(
        "simulate: {} ops, {} steps in {:?}",
        g.num_ops(),
        s.steps.len(),
        elapsed
    );
    // Release builds take a few milliseconds; the bound leaves room for debug builds.
    assert!(elapsed.as_secs_f64() < 2.0, "simulate took {elapsed:?}");
}
