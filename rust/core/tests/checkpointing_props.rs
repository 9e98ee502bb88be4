//! Per-block checkpointing (`hrockmate_core::checkpointing`): every block count gives a schedule
//! the simulator accepts, in which each backward op runs once and the forward segment runs only
//! forward ops; keeping every forward value recomputes nothing; blocks given by a label per op
//! (per-layer checkpointing) are contiguous runs and never run the unlabelled ops again; the
//! budgeted sweep keeps exactly the fastest schedule within the budget.

use hrockmate_core::checkpointing::{block_checkpoint, checkpoint_candidates, checkpoint_points, CheckpointFacts};
use hrockmate_core::graph::Phase;
use hrockmate_core::limits::Stop;
use hrockmate_core::schedule::Step;
use hrockmate_core::schedules::store_all;
use hrockmate_core::simulate::simulate;
use hrockmate_core::testgen::{random_training_graph, shuffle_ops, GenParams};
use proptest::prelude::*;

proptest! {
    #![proptest_config(ProptestConfig { cases: 150, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn block_checkpoint_schedules_are_valid(
        seed in any::<u64>(),
        n_forward in 1usize..40,
        view_prob in 0.0f64..0.5,
        multi_output_prob in 0.0f64..0.4,
        blocks in 1usize..12,
        shuffled in any::<bool>(),
    ) {
        let p = GenParams { n_forward, view_prob, multi_output_prob, ..GenParams::default() };
        let mut g = random_training_graph(seed, &p);
        if shuffled {
            g = shuffle_ops(&g, seed ^ 0x5eed);
        }
        let facts = CheckpointFacts::new(&g);
        let block_of = facts.contiguous_blocks(g.ops.len(), blocks);
        let s = block_checkpoint(&g, &facts, &block_of, &[], &Stop::never()).unwrap();
        let sim = simulate(&g, &s).unwrap();
        let store = simulate(&g, &store_all(&g)).unwrap();
        prop_assert!(sim.time >= store.time * (1.0 - 1e-9));
        for (o, op) in g.ops.iter().enumerate() {
            if op.phase == Phase::Backward {
                prop_assert_eq!(sim.compute_count[o], 1, "backward op {} runs once", o);
            }
        }
        for step in &s.steps[..s.forward_len] {
            if let Step::Compute(o) = *step {
                prop_assert_eq!(g.ops[o].phase, Phase::Forward);
            }
        }
        // keeping every forward value: nothing is recomputed
        let all: Vec<usize> = (0..g.tensors.len()).collect();
        let kept = block_checkpoint(&g, &facts, &block_of, &all, &Stop::never()).unwrap();
        let ksim = simulate(&g, &kept).unwrap();
        prop_assert!(ksim.compute_count.iter().all(|&c| c == 1));
    }

    #[test]
    fn labelled_blocks_are_contiguous_runs_and_give_valid_schedules(
        seed in any::<u64>(),
        n_forward in 1usize..40,
        layer_len in 1usize..8,
        outside in 0usize..6,
        shuffled in any::<bool>(),
    ) {
        let p = GenParams { n_forward, ..GenParams::default() };
        let mut g = random_training_graph(seed, &p);
        if shuffled {
            g = shuffle_ops(&g, seed ^ 0x5eed);
        }
        let facts = CheckpointFacts::new(&g);
        // layers of `layer_len` forward ops after `outside` unlabelled ones, and the last
        // `outside` unlabelled too (an embedding before the layers, a head after them)
        let n = facts.fwd.len();
        let mut label = vec![-1i64; g.ops.len()];
        for (k, &o) in facts.fwd.iter().enumerate() {
            if k >= outside && k + outside < n {
                label[o] = ((k - outside) / layer_len) as i64;
            }
        }
        let (block_of, unlabelled) = facts.labelled_blocks(&label);
        // blocks are numbered along the forward order, one per run of a label
        let blocks: Vec<usize> = facts.fwd.iter().map(|&o| block_of[o]).collect();
        prop_assert!(blocks.windows(2).all(|w| w[1] == w[0] || w[1] == w[0] + 1));
        for w in facts.fwd.windows(2) {
            prop_assert_eq!(block_of[w[0]] == block_of[w[1]], label[w[0]] == label[w[1]]);
        }
        prop_assert_eq!(unlabelled.len(), facts.fwd.iter().filter(|&&o| label[o] < 0).count());
        let mut keep: Vec<usize> = unlabelled.iter().flat_map(|&o| g.ops[o].outputs.clone()).collect();
        keep.sort_unstable();
        keep.dedup();
        let s = block_checkpoint(&g, &facts, &block_of, &keep, &Stop::never()).unwrap();
        let sim = simulate(&g, &s).unwrap();
        for (o, op) in g.ops.iter().enumerate() {
            if op.phase == Phase::Backward || label[o] < 0 {
                // (what runs outside the layers keeps all it makes: it never runs again)
                prop_assert_eq!(sim.compute_count[o], 1, "op {} runs once", o);
            }
        }
    }

    #[test]
    fn the_budgeted_sweep_keeps_the_fastest_schedule_within_the_budget(
        seed in any::<u64>(),
        n_forward in 1usize..40,
        pick in 0.0f64..1.0,
    ) {
        let g = random_training_graph(seed, &GenParams { n_forward, ..GenParams::default() });
        let all = checkpoint_points(&g, &[], None, None, &Stop::never()).unwrap();
        let n_fwd = g.ops.iter().filter(|o| o.phase == Phase::Forward).count();
        prop_assert_eq!(all.iter().map(|p| p.blocks).collect::<Vec<_>>(), checkpoint_candidates(n_fwd));
        prop_assert!(all.iter().all(|p| p.schedule.is_some()));
        let mut peaks: Vec<u64> = all.iter().map(|p| p.peak_bytes).collect();
        peaks.sort_unstable();
        let budget = peaks[((peaks.len() - 1) as f64 * pick) as usize];
        let some = checkpoint_points(&g, &[], Some(budget), None, &Stop::never()).unwrap();
        let kept: Vec<_> = some.iter().filter(|p| p.schedule.is_some()).collect();
        prop_assert_eq!(kept.len(), 1);
        let fastest = all.iter().filter(|p| p.peak_bytes <= budget).map(|p| p.time).fold(f64::INFINITY, f64::min);
        prop_assert_eq!(kept[0].time, fastest);
        prop_assert_eq!(simulate(&g, kept[0].schedule.as_ref().unwrap()).unwrap().peak_bytes, kept[0].peak_bytes);
    }
}

#[test]
fn a_spent_time_limit_still_runs_the_count_nearest_the_square_root() {
    let g = random_training_graph(7, &GenParams { n_forward: 50, ..GenParams::default() });
    let points = checkpoint_points(&g, &[], None, Some(0.0), &Stop::never()).unwrap();
    let n_fwd = g.ops.iter().filter(|o| o.phase == Phase::Forward).count();
    assert_eq!(points.len(), 1);
    assert_eq!(points[0].blocks, (n_fwd as f64).sqrt().round() as usize);
}

#[test]
fn cancellation_stops_the_sweep() {
    use std::sync::atomic::AtomicBool;
    let g = random_training_graph(3, &GenParams { n_forward: 30, ..GenParams::default() });
    let flag = AtomicBool::new(true);
    let stop = Stop::new(Some(&flag), None).unwrap();
    assert!(checkpoint_points(&g, &[], None, None, &stop).is_err());
}
