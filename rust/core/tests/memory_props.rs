//! The planner's fragment measurement and the simulator share one set of storage rules
//! (`hrockmate_core::memory`): a whole valid schedule measured as a fragment has the simulator's
//! peak, and so does the same schedule cut in two, the second part starting from what the first
//! left alive.

use std::collections::HashSet;

use hrockmate_core::memory::fragment_peak;
use hrockmate_core::schedules::{recompute_all, store_all};
use hrockmate_core::simulate::simulate;
use hrockmate_core::testgen::{random_training_graph, GenParams};
use proptest::prelude::*;

proptest! {
    #![proptest_config(ProptestConfig { cases: 200, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn fragments_are_measured_as_the_simulator_measures(
        seed in any::<u64>(),
        n_forward in 1usize..30,
        view_prob in 0.0f64..0.5,
        multi_output_prob in 0.0f64..0.4,
        cut in 0.0f64..1.0,
        recompute in any::<bool>(),
    ) {
        let p = GenParams { n_forward, view_prob, multi_output_prob, ..GenParams::default() };
        let g = random_training_graph(seed, &p);
        let s = if recompute { recompute_all(&g).unwrap() } else { store_all(&g) };
        let sim = simulate(&g, &s).unwrap();
        let roots = g.storage_roots();
        let counted: HashSet<usize> = (0..g.tensors.len())
            .filter(|&t| roots[t] == t && !g.tensors[t].role.is_preexisting())
            .collect();
        let whole = fragment_peak(&g, &roots, &s.steps, &counted, &[], &[]);
        prop_assert_eq!(whole.peak, sim.peak_bytes);
        // the memory while each step runs: the peak is the largest
        prop_assert_eq!(whole.during.len(), s.steps.len());
        prop_assert_eq!(whole.during.iter().copied().max().unwrap_or(0), whole.peak);

        let k = ((s.steps.len() as f64) * cut) as usize;
        let first = fragment_peak(&g, &roots, &s.steps[..k], &counted, &[], &[]);
        let second = fragment_peak(&g, &roots, &s.steps[k..], &counted, &first.end, &[]);
        prop_assert_eq!(first.peak.max(second.peak), sim.peak_bytes);
        // what the forward segment leaves alive, as the simulator counts it
        let fwd = fragment_peak(&g, &roots, &s.steps[..s.forward_len], &counted, &[], &[]);
        let held: u64 = fwd.end.iter().map(|h| (h.1, h.2)).collect::<HashSet<_>>()
            .iter().map(|h| h.1).sum();
        prop_assert_eq!(held, sim.bytes_after_forward);
        prop_assert_eq!(fwd.peak, sim.forward_peak);
    }

    #[test]
    fn a_dying_start_storage_is_released_after_its_last_read(
        seed in any::<u64>(),
        n_forward in 2usize..30,
        view_prob in 0.0f64..0.5,
        cut in 0.0f64..1.0,
    ) {
        let p = GenParams { n_forward, view_prob, ..GenParams::default() };
        let g = random_training_graph(seed, &p);
        let s = store_all(&g);
        let roots = g.storage_roots();
        let counted: HashSet<usize> = (0..g.tensors.len())
            .filter(|&t| roots[t] == t && !g.tensors[t].role.is_preexisting())
            .collect();
        let k = ((s.forward_len as f64) * cut) as usize;
        let first = fragment_peak(&g, &roots, &s.steps[..k], &counted, &[], &[]);
        let rest = &s.steps[k..];
        // every counted tensor alive at the cut dies after its last read in the rest
        let dying: Vec<usize> = first.end.iter().filter(|h| h.2 > 0).map(|h| h.0).collect();
        let r = fragment_peak(&g, &roots, rest, &counted, &first.end, &dying);
        let plain = fragment_peak(&g, &roots, rest, &counted, &first.end, &[]);
        prop_assert!(r.peak <= plain.peak);
        for &(id, step) in &r.released {
            // the storage's tensors among the start are read no more after that step
            let holders: Vec<usize> = first.end.iter().filter(|h| h.1 == id).map(|h| h.0).collect();
            prop_assert!(!holders.is_empty());
            let read_later = rest.iter().enumerate().skip((step + 1) as usize).any(|(_, st)| {
                matches!(*st, hrockmate_core::schedule::Step::Compute(j)
                         if g.ops[j].inputs.iter().any(|x| holders.contains(x)))
            });
            prop_assert!(!read_later);
            // and counted while that step runs, not after
            if step >= 0 {
                let bytes = first.end.iter().find(|h| h.1 == id).unwrap().2;
                prop_assert!(r.during[step as usize] >= bytes);
            }
        }
        // an instance released by nobody is alive at the end
        let ended: HashSet<i64> = r.end.iter().map(|h| h.1).collect();
        let gone: HashSet<i64> = r.released.iter().map(|h| h.0).collect();
        for h in first.end.iter().filter(|h| h.2 > 0) {
            prop_assert!(ended.contains(&h.1) != gone.contains(&h.1));
        }
    }
}
