use super::synthetic;
use super::*;

fn check_hierarchy(g: &Graph, h: &Hierarchy, cfg: &PartitionConfig) {
    // every op in exactly one leaf (or the root for unanchored backward ops)
    let mut seen = vec![0usize; g.ops.len()];
    for c in h.leaves() {
        for &o in c.fwd_ops.iter().chain(&c.bwd_ops) {
            seen[o] += 1;
        }
        assert!(c.children.len() <= cfg.max_size);
    }
    for &o in &h.clusters[h.root].own_bwd_ops {
        seen[o] += 1;
    }
    assert!(seen.iter().all(|&s| s == 1), "op coverage {:?}", seen);
    assert!(h.clusters[h.root].children.len() <= cfg.top_max_size.max(cfg.max_size));
    for c in &h.clusters {
        if !c.is_leaf {
            for &k in &c.children {
                assert_eq!(h.clusters[k].parent, Some(c.id));
                assert!(h.clusters[k].level < c.level);
            }
        }
    }
}

#[test]
fn chain_partitions_within_limits() {
    let g = synthetic::chain(200, 1);
    let cfg = PartitionConfig::default();
    for p in [&BottomUp as &dyn Partitioner, &TopoInterval] {
        let h = build_hierarchy(&g, p, &cfg).unwrap();
        check_hierarchy(&g, &h, &cfg);
        assert!(h.depth() >= 2);
    }
}

#[test]
fn random_dag_partitions_within_limits() {
    let g = synthetic::random_dag(500, 8, 3);
    let cfg = PartitionConfig { max_size: 6, top_max_size: 10, ..Default::default() };
    for p in [&BottomUp as &dyn Partitioner, &TopoInterval] {
        let h = build_hierarchy(&g, p, &cfg).unwrap();
        check_hierarchy(&g, &h, &cfg);
    }
}

#[test]
fn repeated_blocks_share_a_representative() {
    // a chain with identical sizes and times: many leaves must be equivalent
    let n = 120;
    let preds: Vec<Vec<usize>> = (0..n).map(|i| if i == 0 { vec![] } else { vec![i - 1] }).collect();
    let g = synthetic::training_graph("rep", &preds, &vec![4096; n], &vec![1.0; n]);
    let h = build_hierarchy(&g, &TopoInterval, &PartitionConfig { max_size: 6, ..Default::default() }).unwrap();
    let leaves: Vec<&Cluster> = h.leaves().collect();
    let reps: std::collections::HashSet<usize> = leaves.iter().map(|c| c.representative).collect();
    assert!(reps.len() < leaves.len() / 2, "{} classes for {} leaves", reps.len(), leaves.len());
    // correspondence maps ops of equal targets onto each other
    let a = leaves.iter().find(|c| c.representative != c.id).unwrap();
    let (ops, _) = h.correspondence(&g, a.representative, a.id).unwrap();
    for (x, y) in ops {
        assert_eq!(g.ops[x].target, g.ops[y].target);
        assert_eq!(g.ops[x].phase, g.ops[y].phase);
    }
}

#[test]
fn bad_config_is_rejected() {
    let g = synthetic::chain(5, 1);
    let err = build_hierarchy(&g, &BottomUp, &PartitionConfig { max_size: 1, ..Default::default() }).unwrap_err();
    assert!(err.to_string().contains("max_size"));
    assert!(partitioner_by_name("nope").is_err());
}

#[test]
fn scrambled_differentiates_make_no_backward_cycle() {
    // forward chain f0..f3 (leaves {f0, f1} and {f2, f3}); the backward ops' `differentiates`
    // are scrambled so that, leaf by leaf, A's backward would need B's and B's A's. The owner
    // rule puts b0 no later than b3, which it reads, so both sit in A and no cycle forms.
    use crate::graph::{Op, Tensor};
    let t = |name: &str, role: Role| Tensor { name: name.into(), bytes: 10, role, alias_of: None, grad_of: None, updates: None, shape: None, dtype: None };
    let op = |name: &str, phase: Phase, inputs: Vec<usize>, outputs: Vec<usize>, diff: Option<usize>| Op {
        name: name.into(),
        target: name.into(),
        phase,
        time: 1.0,
        workspace: 0,
        inputs,
        outputs,
        differentiates: diff,
        random: false,
        mutates_buffer: false,
        module: String::new(),
    };
    let mut g = Graph { name: "cyc".into(), time_unit: "s".into(), ..Default::default() };
    g.tensors = vec![
        t("x", Role::Input),
        t("a0", Role::Activation),
        t("a1", Role::Activation),
        t("a2", Role::Activation),
        t("loss", Role::Output),
        t("dloss", Role::Tangent),
        t("g3", Role::Activation),
        t("g0", Role::Activation),
        t("gx", Role::InputGrad),
    ];
    g.ops = vec![
        op("f0", Phase::Forward, vec![0], vec![1], None),
        op("f1", Phase::Forward, vec![1], vec![2], None),
        op("f2", Phase::Forward, vec![2], vec![3], None),
        op("f3", Phase::Forward, vec![3], vec![4], None),
        op("b3", Phase::Backward, vec![5], vec![6], Some(0)),
        op("b0", Phase::Backward, vec![6], vec![7], Some(3)),
        op("b1", Phase::Backward, vec![7], vec![8], Some(1)),
    ];
    crate::io::validate(&g).unwrap();
    let cfg = PartitionConfig { max_size: 2, top_max_size: 2, ..Default::default() };
    let h = build_hierarchy(&g, &TopoInterval, &cfg).unwrap();
    h.check_fragment_order(&g).unwrap();
    assert!(h.clusters[h.root].own_bwd_ops.is_empty());
    assert_eq!(h.op_cluster[5], h.op_cluster[0], "b0 joins the leaf of b3, which it reads");
    assert_ne!(h.op_cluster[5], h.op_cluster[3]);
    check_hierarchy(&g, &h, &cfg);
}
