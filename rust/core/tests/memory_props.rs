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
}
