use super::*;
use crate::partition::{build_hierarchy, synthetic, PartitionConfig, TopoInterval};

fn leaf_setup(n: usize, max_size: usize) -> (Graph, Hierarchy) {
    let g = synthetic::chain(n, 7);
    let h = build_hierarchy(&g, &TopoInterval, &PartitionConfig { max_size, ..Default::default() }).unwrap();
    (g, h)
}

#[test]
fn chain_leaf_has_store_and_recompute_all() {
    let (g, h) = leaf_setup(12, 6);
    let leaf = h.leaves().next().unwrap().id;
    let (opts, exact) = enumerate_leaf(&g, &h, leaf, &OptionsConfig::default()).unwrap();
    assert!(exact);
    assert!(opts.len() >= 2, "{} options", opts.len());
    let bwd_only: f64 = h.clusters[leaf].bwd_ops.iter().map(|&o| g.ops[o].time).sum();
    let fastest = opts.iter().map(|o| o.bwd_time).fold(f64::INFINITY, f64::min);
    assert!((fastest - bwd_only).abs() < 1e-9, "store-all bwd time {fastest} != {bwd_only}");
    assert!(opts.iter().any(|o| o.saved_bytes == 0), "recompute-all missing");
    for (i, o) in opts.iter().enumerate() {
        let sim = validate_option(&g, &h, leaf, o).unwrap();
        assert!((sim.time - o.fwd_time - o.bwd_time).abs() < 1e-9);
        if i > 0 {
            // a Pareto front: more memory buys less time
            assert!(o.saved_bytes > opts[i - 1].saved_bytes && o.bwd_time < opts[i - 1].bwd_time);
        }
    }
}

#[test]
fn identical_leaves_get_mapped_options() {
    let n = 60;
    let preds: Vec<Vec<usize>> = (0..n).map(|i| if i == 0 { vec![] } else { vec![i - 1] }).collect();
    let g = synthetic::training_graph("rep", &preds, &vec![1024; n], &vec![1.0; n]);
    let h = build_hierarchy(&g, &TopoInterval, &PartitionConfig { max_size: 6, ..Default::default() }).unwrap();
    let all = enumerate_all(&g, &h, &OptionsConfig::default(), &AtomicBool::new(false)).unwrap();
    for c in h.leaves() {
        assert!(!all.options[c.id].is_empty());
        for o in &all.options[c.id] {
            validate_option(&g, &h, c.id, o).unwrap();
        }
    }
}

#[test]
fn non_leaf_is_rejected() {
    let (g, h) = leaf_setup(30, 4);
    let err = enumerate_leaf(&g, &h, h.root, &OptionsConfig::default()).unwrap_err();
    assert!(err.to_string().contains("not a leaf"));
}

#[test]
fn branch_and_bound_finds_the_exact_front() {
    use crate::testgen::{random_training_graph, GenParams};
    let mut compared = 0;
    for seed in 0..80u64 {
        let g = random_training_graph(seed, &GenParams { n_forward: 24, ..GenParams::default() });
        let h = build_hierarchy(&g, &crate::partition::BottomUp, &PartitionConfig { max_size: 8, ..Default::default() }).unwrap();
        let ctx = Ctx::new(&g);
        for c in h.leaves() {
            let leaf = Leaf::new(&g, &h, c.id, &ctx);
            let cands: Vec<usize> = leaf.candidates.iter().copied().filter(|&x| leaf.bytes[x] > 0).collect();
            if cands.len() > 12 {
                continue;
            }
            let mut all = Vec::new();
            for mask in 0u32..(1 << cands.len()) {
                let mut keep = vec![false; leaf.tensors.len()];
                for (i, &x) in cands.iter().enumerate() {
                    keep[x] = mask >> i & 1 == 1;
                }
                let ev = evaluate(&leaf, &keep, None);
                all.push(Point { keep, ev });
            }
            let brute: Vec<(u64, u64)> = pareto(all).iter().map(|p| (p.ev.saved_bytes, p.ev.bwd_time.to_bits())).collect();
            let (front, exact) = search(&leaf, &OptionsConfig::default(), &AtomicBool::new(false));
            assert!(exact);
            let got: Vec<(u64, u64)> = front.iter().map(|p| (p.ev.saved_bytes, p.ev.bwd_time.to_bits())).collect();
            assert_eq!(got, brute, "seed {seed} leaf {}", c.id);
            compared += (cands.len() >= 3) as usize;
        }
    }
    assert!(compared >= 20, "only {compared} leaves with >= 3 candidates were compared");
}
