//! Property tests of partitioning and leaf options on random training graphs.

mod common;

use std::sync::atomic::AtomicBool;

use hrockmate_core::graph::{Graph, Phase};
use hrockmate_core::options::{enumerate_all, validate_option, OptionsConfig};
use hrockmate_core::partition::{build_hierarchy, partitioner_by_name, Hierarchy, PartitionConfig};
use hrockmate_core::testgen::{random_training_graph, GenParams};
use proptest::prelude::*;

fn check_partition(g: &Graph, h: &Hierarchy, cfg: &PartitionConfig) -> Result<(), TestCaseError> {
    // every op in exactly one leaf, or among the root's own backward ops
    let mut seen = vec![0u32; g.ops.len()];
    for c in h.leaves() {
        prop_assert!(c.children.len() <= cfg.max_size, "leaf {} has {} children", c.id, c.children.len());
        prop_assert!(c.children.iter().all(|o| c.fwd_ops.contains(o)), "leaf children are its forward ops");
        for &o in c.fwd_ops.iter().chain(&c.bwd_ops) {
            seen[o] += 1;
        }
    }
    for &o in &h.clusters[h.root].own_bwd_ops {
        prop_assert_eq!(g.ops[o].phase, Phase::Backward);
        seen[o] += 1;
    }
    prop_assert!(seen.iter().all(|&s| s == 1), "coverage {:?}", seen);
    for c in &h.clusters {
        if c.id != h.root && !c.is_leaf {
            prop_assert!(c.children.len() <= cfg.max_size);
        }
        if !c.is_leaf {
            for &k in &c.children {
                prop_assert!(h.clusters[k].level < c.level, "hierarchy levels must decrease downwards");
                prop_assert_eq!(h.clusters[k].parent, Some(c.id));
            }
        }
    }
    // the quotient of the forward graph by the root's children is acyclic: each child's
    // forward ops form a convex set, checked by a topological sort of the children
    let producer = g.producers();
    let mut owner = vec![usize::MAX; g.ops.len()];
    for (i, &k) in h.clusters[h.root].children.iter().enumerate() {
        for &o in &h.clusters[k].fwd_ops {
            owner[o] = i;
        }
    }
    let n = h.clusters[h.root].children.len();
    let mut succ = vec![Vec::new(); n];
    let mut indeg = vec![0usize; n];
    for (o, op) in g.ops.iter().enumerate() {
        if op.phase != Phase::Forward {
            continue;
        }
        for &t in &op.inputs {
            if let Some(p) = producer[t] {
                let (a, b) = (owner[p], owner[o]);
                if a != b && a != usize::MAX && b != usize::MAX && !succ[a].contains(&b) {
                    succ[a].push(b);
                    indeg[b] += 1;
                }
            }
        }
    }
    let mut stack: Vec<usize> = (0..n).filter(|&i| indeg[i] == 0).collect();
    let mut done = 0;
    while let Some(u) = stack.pop() {
        done += 1;
        for &v in &succ[u] {
            indeg[v] -= 1;
            if indeg[v] == 0 {
                stack.push(v);
            }
        }
    }
    prop_assert_eq!(done, n, "the top-level quotient graph has a cycle");
    Ok(())
}

/// Independent check of fragment atomicity: inside every non-leaf cluster, the graph of
/// (child, phase) nodes plus own backward ops with the data dependencies is acyclic.
fn fragments_acyclic(g: &Graph, h: &Hierarchy) -> Result<(), TestCaseError> {
    let producer = g.producers();
    for c in h.clusters.iter().filter(|c| !c.is_leaf) {
        let mut node = std::collections::HashMap::new();
        for (k, &ch) in c.children.iter().enumerate() {
            for &o in &h.clusters[ch].fwd_ops {
                node.insert(o, 2 * k);
            }
            for &o in &h.clusters[ch].bwd_ops {
                node.insert(o, 2 * k + 1);
            }
        }
        for (i, &o) in c.own_bwd_ops.iter().enumerate() {
            node.insert(o, 2 * c.children.len() + i);
        }
        let n = 2 * c.children.len() + c.own_bwd_ops.len();
        let mut succ = vec![std::collections::BTreeSet::new(); n];
        for k in 0..c.children.len() {
            succ[2 * k].insert(2 * k + 1);
        }
        for (&o, &b) in &node {
            for &t in &g.ops[o].inputs {
                if let Some(a) = producer[t].and_then(|p| node.get(&p)) {
                    if *a != b {
                        succ[*a].insert(b);
                    }
                }
            }
        }
        let mut indeg = vec![0usize; n];
        for s in &succ {
            for &v in s {
                indeg[v] += 1;
            }
        }
        let mut stack: Vec<usize> = (0..n).filter(|&i| indeg[i] == 0).collect();
        let mut done = 0;
        while let Some(u) = stack.pop() {
            done += 1;
            for &v in &succ[u] {
                indeg[v] -= 1;
                if indeg[v] == 0 {
                    stack.push(v);
                }
            }
        }
        prop_assert_eq!(done, n, "cluster {}: fragments of its children form a cycle", c.id);
    }
    Ok(())
}

const PARTITIONERS: [&str; 3] = ["contiguous", "bottom_up", "topo_interval"];

/// Contiguous targets whose groups (up to 1.4x the target) fit in `max_size`.
fn sized(max_size: usize) -> PartitionConfig {
    let target = (max_size * 5 / 7).max(1);
    PartitionConfig { leaf_size: target, group_size: target.max(2), ..PartitionConfig::default() }
}

fn params() -> impl Strategy<Value = (u64, usize, usize, usize)> {
    (any::<u64>(), 1usize..60, 2usize..8, 0usize..3)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 192, ..ProptestConfig::default() })]

    #[test]
    fn partition_covers_and_respects_limits((seed, n, max_size, which) in params()) {
        let g = random_training_graph(seed, &GenParams { n_forward: n, ..GenParams::default() });
        let cfg = PartitionConfig { max_size, top_max_size: max_size + 2, ..sized(max_size) };
        let p = partitioner_by_name(PARTITIONERS[which]).unwrap();
        let h = build_hierarchy(&g, p.as_ref(), &cfg).unwrap();
        check_partition(&g, &h, &cfg)?;
        h.check_fragment_order(&g).map_err(TestCaseError::fail)?;
        fragments_acyclic(&g, &h)?;
    }

    #[test]
    fn every_option_is_a_valid_schedule((seed, n, max_size, which) in params()) {
        let g = random_training_graph(seed, &GenParams { n_forward: n.min(30), ..GenParams::default() });
        let cfg = PartitionConfig { max_size, top_max_size: 8, ..sized(max_size) };
        let p = partitioner_by_name(PARTITIONERS[which]).unwrap();
        let h = build_hierarchy(&g, p.as_ref(), &cfg).unwrap();
        let all = enumerate_all(&g, &h, &OptionsConfig::default(), &AtomicBool::new(false)).unwrap();
        for c in h.leaves() {
            let opts = &all.options[c.id];
            prop_assert!(!opts.is_empty());
            let min_time = opts.iter().map(|o| o.bwd_time).fold(f64::INFINITY, f64::min);
            let bwd: f64 = c.bwd_ops.iter().map(|&o| g.ops[o].time).sum();
            prop_assert!((min_time - bwd).abs() <= 1e-9 * bwd.max(1.0), "store-all missing in leaf {}", c.id);
            for o in opts {
                let sim = validate_option(&g, &h, c.id, o).map_err(TestCaseError::fail)?;
                prop_assert!((sim.time - o.fwd_time - o.bwd_time).abs() <= 1e-9 * sim.time.max(1.0));
            }
        }
    }
}

/// The repository's node-link graphs, plus the third-party ones when present.
fn real_graphs() -> Vec<(String, Graph)> {
    common::corpus_files().iter().map(|p| (common::file_name(p), common::load(p))).collect()
}

#[test]
fn real_graphs_partition_and_enumerate() {
    let cfg = PartitionConfig::default();
    for (name, g) in real_graphs() {
        for which in PARTITIONERS {
            let p = partitioner_by_name(which).unwrap();
            let h = build_hierarchy(&g, p.as_ref(), &cfg).unwrap();
            check_partition(&g, &h, &cfg).unwrap_or_else(|e| panic!("{name} {which}: {e}"));
            h.check_fragment_order(&g).unwrap_or_else(|e| panic!("{name} {which}: {e}"));
            fragments_acyclic(&g, &h).unwrap_or_else(|e| panic!("{name} {which}: {e}"));
            let all = enumerate_all(&g, &h, &OptionsConfig::default(), &AtomicBool::new(false)).unwrap();
            for c in h.leaves() {
                assert!(all.exact[c.id], "{name} {which}: leaf {} is not exact", c.id);
                for o in &all.options[c.id] {
                    validate_option(&g, &h, c.id, o).unwrap_or_else(|e| panic!("{name} {which} leaf {}: {e}", c.id));
                }
            }
        }
    }
}
