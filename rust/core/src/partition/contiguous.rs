//! The default partitioner: cut the forward ops' topological order into consecutive groups of
//! about a target size (`leaf_size` ops for leaves, then about `group_size` clusters per level),
//! each cut where the fewest bytes produced before it are read by forward ops after it.
//!
//! Repeated layers get repeated cuts: among cut points with equally few bytes crossing, one
//! whose surroundings (the kinds of the units around it) look like those of an earlier cut wins,
//! then the farthest. In a run of equal layers every group then spans the same stretch of
//! layers, so equal groups have equal options and are solved once.

use std::collections::hash_map::DefaultHasher;
use std::collections::{HashMap, HashSet};
use std::hash::{Hash, Hasher};

use super::{PartitionConfig, Partitioner, UnitDag};

#[derive(Debug, Clone, Copy, Default)]
pub struct Contiguous;

impl Partitioner for Contiguous {
    fn name(&self) -> &'static str {
        "contiguous"
    }

    fn index_order(&self) -> bool {
        true
    }

    fn group(&self, dag: &UnitDag, max_size: usize, cfg: &PartitionConfig) -> Vec<Vec<usize>> {
        let n = dag.n;
        let target = if dag.round == 0 {
            cfg.leaf_size.max(1)
        } else {
            let groups = (n.div_ceil(cfg.group_size.max(1))).max(2);
            round_half_even(n as f64 / groups as f64).max(1)
        };
        let starts = cut_points(&forward_crossing(dag), &dag.kinds, target, max_size);
        let mut groups = Vec::new();
        for (k, &a) in starts.iter().enumerate() {
            let b = starts.get(k + 1).copied().unwrap_or(n);
            if b - a >= 2 {
                groups.push((a..b).map(|i| dag.topo[i]).collect());
            }
        }
        groups
    }
}

/// Rounding with halves to the even neighbour (as Python's `round` does), for the target group
/// size of an upper round: the trees this partitioner makes, and the tests that pin them,
/// depend on this rounding.
fn round_half_even(x: f64) -> usize {
    let r = x.round();
    let r = if (x - x.trunc()).abs() == 0.5 && r % 2.0 != 0.0 { r - 1.0 } else { r };
    r.max(0.0) as usize
}

/// cross[c]: bytes of the storages produced by units before position c and read (through any
/// of their views) by a forward op of a unit at or after it, for c in 0..=n.
fn forward_crossing(dag: &UnitDag) -> Vec<u64> {
    let n = dag.n;
    // per storage: (first producing position, last forward reading position, bytes)
    let mut span: HashMap<usize, (usize, usize, u64)> = HashMap::new();
    for t in &dag.tensors {
        let p = dag.pos[t.producer];
        let last = t.fwd_consumers.iter().map(|&c| dag.pos[c]).max().unwrap_or(p);
        let e = span.entry(t.storage).or_insert((p, last, t.bytes));
        e.0 = e.0.min(p);
        e.1 = e.1.max(last);
    }
    let mut delta = vec![0i128; n + 2];
    for &(first, last, bytes) in span.values() {
        if last > first {
            delta[first + 1] += bytes as i128;
            delta[last + 1] -= bytes as i128;
        }
    }
    let mut cross = Vec::with_capacity(n + 1);
    let mut acc = 0i128;
    for d in delta.iter().take(n + 1) {
        acc += d;
        cross.push(acc.max(0) as u64);
    }
    cross
}

/// Starts of consecutive groups of about `target` units over positions 0..n (the first is 0).
/// A group spans 0.6x to 1.4x the target, and at most `max_size` units; the cut inside that
/// window has the fewest bytes crossing, then a context seen at an earlier cut, then the
/// farthest position.
fn cut_points(cross: &[u64], kinds: &[u64], target: usize, max_size: usize) -> Vec<usize> {
    let n = cross.len() - 1;
    let w = target.max(1);
    let context: Vec<u64> = (0..=n)
        .map(|c| {
            let mut h = DefaultHasher::new();
            kinds[c.saturating_sub(w)..(c + w).min(n)].hash(&mut h);
            h.finish()
        })
        .collect();
    let hi_size = (1.4 * target as f64).min(max_size.max(1) as f64);
    let lo_size = (0.6 * target as f64).min(hi_size);
    let mut seen: HashSet<u64> = HashSet::new();
    let mut starts = vec![0];
    let mut k = 0;
    loop {
        let (mut acc, mut lo, mut hi) = (0usize, None, None);
        let mut j = k;
        while j < n {
            acc += 1;
            j += 1;
            if acc as f64 >= lo_size && lo.is_none() {
                lo = Some(j);
            }
            if acc as f64 >= hi_size {
                hi = Some(j);
                break;
            }
        }
        if j >= n && (lo.is_none() || (acc as f64) < hi_size) {
            break; // the rest fits in one group
        }
        let (lo, hi) = (lo.unwrap_or(j), hi.unwrap_or(j));
        let best = (lo..=hi)
            .min_by_key(|&c| {
                let bytes = if c < n { cross[c] } else { 0 };
                (bytes, !seen.contains(&context[c]), std::cmp::Reverse(c))
            })
            .expect("the window is not empty");
        if best >= n {
            break;
        }
        seen.insert(context[best]);
        starts.push(best);
        k = best;
    }
    starts
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cuts_fall_where_little_crosses() {
        // 12 units, target 4: positions 4 and 8 have nothing crossing
        let mut cross = vec![10u64; 13];
        cross[0] = 0;
        cross[4] = 0;
        cross[8] = 0;
        let starts = cut_points(&cross, &[0; 12], 4, 20);
        assert_eq!(starts, vec![0, 4, 8]);
    }

    #[test]
    fn equal_crossings_repeat_the_structure() {
        // period-3 layers, all cuts equal: the cuts repeat with period 3 once one is seen
        let kinds: Vec<u64> = (0..30).map(|i| (i % 3) as u64).collect();
        let starts = cut_points(&[0; 31], &kinds, 4, 20);
        let offsets: HashSet<usize> = starts[1..].iter().map(|s| s % 3).collect();
        assert_eq!(offsets.len(), 1, "cuts {starts:?}");
        assert!(starts.windows(2).all(|w| w[1] - w[0] <= 6 && w[1] - w[0] >= 2));
    }

    #[test]
    fn groups_stay_within_max_size() {
        // target 20 with max_size 20: groups of up to 20, not 28 (which the driver would drop,
        // leaving single-op leaves)
        let starts = cut_points(&[0; 101], &[0; 100], 20, 20);
        assert!(starts.len() >= 5, "cuts {starts:?}");
        let mut bounds = starts.clone();
        bounds.push(100);
        assert!(bounds.windows(2).all(|w| w[1] - w[0] <= 20 && w[1] - w[0] >= 12), "cuts {starts:?}");
    }

    #[test]
    fn rounding_matches_half_to_even() {
        assert_eq!(round_half_even(2.5), 2);
        assert_eq!(round_half_even(3.5), 4);
        assert_eq!(round_half_even(3.4), 3);
    }
}
