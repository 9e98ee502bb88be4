//! H-Rockmate's bottom-up grouping: candidate groups are sequences (chains) and flows
//! (single-entry/single-exit regions between a node and its immediate post-dominator), each in
//! up to four variants (with or without its source, with or without its sink); candidates are
//! scored by `-(in + out) * |G|^alpha` and picked greedily, best first, without overlap.
//! Units that no sequence or flow covers (dense DAGs, where every flow is too big) may also
//! join a neighbour: each convex edge `{u, v}` touching such a unit is a candidate too, so every
//! round makes progress.

use super::{PartitionConfig, Partitioner, ScoreScratch, UnitDag};

#[derive(Debug, Clone, Copy, Default)]
pub struct BottomUp;

impl Partitioner for BottomUp {
    fn name(&self) -> &'static str {
        "bottom_up"
    }

    fn group(&self, dag: &UnitDag, max_size: usize, cfg: &PartitionConfig) -> Vec<Vec<usize>> {
        let mut cands = Candidates::default();
        sequence_candidates(dag, max_size, &mut cands);
        flow_candidates(dag, max_size, &mut cands);
        edge_candidates(dag, &mut cands);

        let mut scratch = ScoreScratch::default();
        let mut scored: Vec<(f64, usize)> = (0..cands.len()).map(|i| (dag.score(cands.get(i), cfg.alpha, &mut scratch), i)).collect();
        // best score first; on ties the larger group (more progress), then the earlier one
        scored.sort_by(|a, b| {
            let (ca, cb) = (cands.get(a.1), cands.get(b.1));
            b.0.total_cmp(&a.0).then(cb.len().cmp(&ca.len())).then(dag.pos[ca[0]].cmp(&dag.pos[cb[0]]))
        });
        let mut taken = vec![false; dag.n];
        let mut out = Vec::new();
        for (_, i) in scored {
            let c = cands.get(i);
            if c.iter().any(|&u| taken[u]) {
                continue;
            }
            for &u in c {
                taken[u] = true;
            }
            out.push(c.to_vec());
        }
        out
    }
}

/// Candidate groups stored flat (one allocation for all of them).
#[derive(Default)]
struct Candidates {
    items: Vec<usize>,
    ends: Vec<usize>,
}

impl Candidates {
    fn len(&self) -> usize {
        self.ends.len()
    }
    fn get(&self, i: usize) -> &[usize] {
        let start = if i == 0 { 0 } else { self.ends[i - 1] };
        &self.items[start..self.ends[i]]
    }
    fn push(&mut self, group: &[usize]) {
        self.items.extend_from_slice(group);
        self.ends.push(self.items.len());
    }
    fn last(&self) -> Option<&[usize]> {
        (!self.ends.is_empty()).then(|| self.get(self.ends.len() - 1))
    }
}

/// Push `group` with its source and/or sink removed (variants of size 2..=max_size).
fn push_variants(group: &[usize], max_size: usize, out: &mut Candidates) {
    let n = group.len();
    for (lo, hi) in [(0, n), (1, n), (0, n.saturating_sub(1)), (1, n.saturating_sub(1))] {
        if hi > lo && hi - lo >= 2 && hi - lo <= max_size && (lo, hi) != (1, 1) {
            let v = &group[lo..hi];
            if out.last() != Some(v) {
                out.push(v);
            }
        }
    }
}

/// Maximal chains (u -> v with u's only successor v and v's only predecessor u). Chains longer
/// than the limit are cut where the least bytes cross (dynamic programming).
fn sequence_candidates(dag: &UnitDag, max_size: usize, out: &mut Candidates) {
    let links = |u: usize| dag.succ[u].len() == 1 && dag.pred[dag.succ[u][0]].len() == 1;
    for &start in &dag.topo {
        // a chain starts where no chain link comes in
        let starts = !(dag.pred[start].len() == 1 && links(dag.pred[start][0]));
        if !starts || !links(start) {
            continue;
        }
        let mut chain = vec![start];
        let mut u = start;
        while links(u) {
            u = dag.succ[u][0];
            chain.push(u);
        }
        if chain.len() <= max_size {
            push_variants(&chain, max_size, out);
        } else {
            for seg in split_chain(dag, &chain, max_size) {
                push_variants(&seg, max_size, out);
            }
        }
    }
}

/// Cut a long chain into segments of at most `max_size` minimising the bytes crossing the cuts.
fn split_chain(dag: &UnitDag, chain: &[usize], max_size: usize) -> Vec<Vec<usize>> {
    let n = chain.len();
    // cut_cost[i]: bytes produced by chain[i] and read by chain[i + 1]
    let cut_cost: Vec<u64> = (0..n - 1)
        .map(|i| {
            dag.produces[chain[i]]
                .iter()
                .map(|&ti| &dag.tensors[ti])
                .filter(|t| t.fwd_consumers.contains(&chain[i + 1]))
                .map(|t| t.bytes)
                .sum()
        })
        .collect();
    // best[j]: min cost to split chain[..j] with a cut after j - 1 (or j == n)
    let mut best = vec![u64::MAX; n + 1];
    let mut from = vec![0usize; n + 1];
    best[0] = 0;
    for j in 1..=n {
        let cost_j = if j < n { cut_cost[j - 1] } else { 0 };
        for i in j.saturating_sub(max_size)..j {
            if best[i] == u64::MAX {
                continue;
            }
            // one extra unit per segment so that, at equal bytes, fewer segments win
            let c = best[i].saturating_add(cost_j).saturating_add(1);
            if c < best[j] {
                best[j] = c;
                from[j] = i;
            }
        }
    }
    let mut segs = Vec::new();
    let mut j = n;
    while j > 0 {
        let i = from[j];
        segs.push(chain[i..j].to_vec());
        j = i;
    }
    segs.reverse();
    segs
}

/// Immediate post-dominator of each unit (`dag.n` stands for the virtual exit).
fn post_dominators(dag: &UnitDag) -> Vec<usize> {
    let exit = dag.n;
    let mut ipdom = vec![exit; dag.n];
    let pos = |u: usize| if u == exit { usize::MAX } else { dag.pos[u] };
    for &u in dag.topo.iter().rev() {
        let mut it = dag.succ[u].iter();
        let Some(&first) = it.next() else { continue };
        let mut d = first;
        for &s in it {
            let (mut a, mut b) = (d, s);
            while a != b {
                if pos(a) < pos(b) {
                    a = ipdom[a];
                } else {
                    b = ipdom[b];
                }
            }
            d = a;
            if d == exit {
                break;
            }
        }
        ipdom[u] = d;
    }
    ipdom
}

/// Regions from a branching unit to its immediate post-dominator, when small enough.
fn flow_candidates(dag: &UnitDag, max_size: usize, out: &mut Candidates) {
    let ipdom = post_dominators(dag);
    let mut stamp = vec![usize::MAX; dag.n];
    for s in 0..dag.n {
        if dag.succ[s].len() < 2 || ipdom[s] == dag.n {
            continue;
        }
        let t = ipdom[s];
        let mut region = vec![s];
        stamp[s] = s;
        let mut i = 0;
        let mut too_big = false;
        while i < region.len() {
            let u = region[i];
            i += 1;
            if u == t {
                continue;
            }
            for &v in &dag.succ[u] {
                if stamp[v] != s {
                    stamp[v] = s;
                    region.push(v);
                    if region.len() > max_size + 2 {
                        too_big = true;
                        break;
                    }
                }
            }
            if too_big {
                break;
            }
        }
        if too_big {
            continue;
        }
        // order: source first, sink last, the rest topologically
        region.sort_by_key(|&u| dag.pos[u]);
        push_variants(&region, max_size, out);
    }
}

/// Edges `u -> v` with no other path from u to v, for units no other candidate covers.
fn edge_candidates(dag: &UnitDag, out: &mut Candidates) {
    const SEARCH_LIMIT: usize = 64;
    let mut covered = vec![false; dag.n];
    for &u in &out.items {
        covered[u] = true;
    }
    let mut stamp = vec![usize::MAX; dag.n];
    let mut stack = Vec::new();
    for u in 0..dag.n {
        for &v in &dag.succ[u] {
            if covered[u] && covered[v] {
                continue;
            }
            // search from u's other successors for v, only among units placed before v
            stack.clear();
            let mark = u.wrapping_mul(dag.n.max(1)).wrapping_add(v);
            let mut steps = 0;
            let mut convex = true;
            for &w in &dag.succ[u] {
                if w != v && dag.pos[w] < dag.pos[v] {
                    stamp[w] = mark;
                    stack.push(w);
                }
            }
            while let Some(w) = stack.pop() {
                steps += 1;
                if steps > SEARCH_LIMIT || dag.succ[w].contains(&v) {
                    convex = false;
                    break;
                }
                for &x in &dag.succ[w] {
                    if stamp[x] != mark && dag.pos[x] < dag.pos[v] {
                        stamp[x] = mark;
                        stack.push(x);
                    }
                }
            }
            if convex {
                out.push(&[u, v]);
            }
        }
    }
}
