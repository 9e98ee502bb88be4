//! Alternative partitioner: cut a topological order of the units into consecutive intervals of
//! at most `max_size` units, choosing the cut points where the fewest bytes are alive
//! (dynamic programming over the order). Intervals of a topological order are always convex,
//! so the quotient stays acyclic; on chain-like graphs the cuts land on articulation points.

use super::{PartitionConfig, Partitioner, UnitDag};

#[derive(Debug, Clone, Copy, Default)]
pub struct TopoInterval;

impl Partitioner for TopoInterval {
    fn name(&self) -> &'static str {
        "topo_interval"
    }

    fn group(&self, dag: &UnitDag, max_size: usize, _cfg: &PartitionConfig) -> Vec<Vec<usize>> {
        let n = dag.n;
        if n < 2 {
            return Vec::new();
        }
        // crossing[i]: bytes alive across the cut between positions i and i + 1
        let mut diff = vec![0i128; n + 1];
        for t in &dag.tensors {
            let p = dag.pos[t.producer];
            let last = t
                .fwd_consumers
                .iter()
                .chain(&t.bwd_consumers)
                .map(|&c| dag.pos[c])
                .max()
                .unwrap_or(p);
            let last = if t.external { n - 1 } else { last };
            if last > p {
                diff[p] += t.bytes as i128;
                diff[last] -= t.bytes as i128;
            }
        }
        let mut crossing = vec![0u64; n];
        let mut run = 0i128;
        for i in 0..n {
            run += diff[i];
            crossing[i] = run.max(0) as u64;
        }
        // best[j]: min total cut bytes for positions [0, j) cut into intervals of <= max_size
        let mut best = vec![u128::MAX; n + 1];
        let mut from = vec![0usize; n + 1];
        best[0] = 0;
        for j in 1..=n {
            let cut = if j < n { crossing[j - 1] as u128 } else { 0 };
            for i in j.saturating_sub(max_size)..j {
                if best[i] == u128::MAX {
                    continue;
                }
                // +1 per interval: at equal bytes prefer fewer, larger intervals
                let c = best[i] + cut + 1;
                if c < best[j] {
                    best[j] = c;
                    from[j] = i;
                }
            }
        }
        let mut groups = Vec::new();
        let mut j = n;
        while j > 0 {
            let i = from[j];
            if j - i >= 2 {
                groups.push(dag.topo[i..j].to_vec());
            }
            j = i;
        }
        groups.reverse();
        groups
    }
}
