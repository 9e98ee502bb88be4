//! Balanced separators from a tree decomposition built by min-degree elimination.
//!
//! Eliminating a vertex `v` creates the bag `{v} ∪ N(v)` and turns `N(v)` into a clique; the
//! parent of that bag is the bag of the neighbour eliminated next. The bags form a tree
//! decomposition whose width is the largest bag minus one. Walking from the root towards the
//! child holding more than half of the vertices ends at a bag whose removal leaves components of
//! at most half the vertices each (every vertex not in the bag has all its bags on one side).

use std::collections::{BTreeSet, HashSet};

use crate::limits::{Stop, Stopped};

/// Vertices whose degree exceeds this are not eliminated: they all go into one final bag. This
/// bounds the fill-in work on dense graphs (the result stays a valid tree decomposition).
pub const MAX_ELIMINATION_DEGREE: usize = 128;

/// A balanced separator of the subgraph induced by `verts` in the undirected graph `adj`
/// (neighbour lists over global vertex ids; `verts` distinct). Every connected component of
/// `verts` minus the returned set has at most `verts.len() / 2` vertices. Empty when `verts`
/// already splits into such components (or has at most one vertex). Polls `stop` while it
/// eliminates vertices.
pub fn balanced_separator(adj: &[Vec<usize>], verts: &[usize], stop: &Stop) -> Result<Vec<usize>, Stopped> {
    let n = verts.len();
    if n <= 1 {
        return Ok(Vec::new());
    }
    let local: std::collections::HashMap<usize, usize> =
        verts.iter().enumerate().map(|(i, &v)| (v, i)).collect();
    let mut nbrs: Vec<HashSet<usize>> = verts
        .iter()
        .map(|&v| adj[v].iter().filter_map(|u| local.get(u).copied()).filter(|&u| u != local[&v]).collect())
        .collect();

    // Min-degree elimination.
    let mut queue: BTreeSet<(usize, usize)> = (0..n).map(|i| (nbrs[i].len(), i)).collect();
    let mut order: Vec<usize> = Vec::with_capacity(n);
    let mut bags: Vec<Vec<usize>> = vec![Vec::new(); n];
    let mut eliminated = vec![false; n];
    while let Some(&(deg, v)) = queue.iter().next() {
        if deg > MAX_ELIMINATION_DEGREE {
            break;
        }
        if order.len() % 1024 == 1023 {
            stop.check()?;
        }
        queue.remove(&(deg, v));
        eliminated[v] = true;
        order.push(v);
        let nv: Vec<usize> = nbrs[v].iter().copied().collect();
        for &u in &nv {
            queue.remove(&(nbrs[u].len(), u));
            nbrs[u].remove(&v);
        }
        for (i, &a) in nv.iter().enumerate() {
            for &b in &nv[i + 1..] {
                nbrs[a].insert(b);
                nbrs[b].insert(a);
            }
        }
        for &u in &nv {
            queue.insert((nbrs[u].len(), u));
        }
        bags[v] = nv;
    }
    // Tree nodes: one per eliminated vertex, plus one final node `rest` holding every vertex not
    // eliminated (possibly empty; it then only joins the trees of a disconnected graph).
    let rest: Vec<usize> = (0..n).filter(|&v| !eliminated[v]).collect();
    let rest_node = n;
    let mut pos = vec![usize::MAX; n];
    for (i, &v) in order.iter().enumerate() {
        pos[v] = i;
    }
    let parent = |v: usize| -> usize {
        bags[v]
            .iter()
            .copied()
            .min_by_key(|&u| pos[u])
            .map_or(rest_node, |u| if eliminated[u] { u } else { rest_node })
    };
    let mut weight = vec![0usize; n + 1];
    let mut children: Vec<Vec<usize>> = vec![Vec::new(); n + 1];
    for &v in &order {
        weight[v] += 1;
        let p = parent(v);
        weight[p] += weight[v];
        children[p].push(v);
    }
    weight[rest_node] += rest.len();

    let half = n / 2;
    let mut node = rest_node;
    while let Some(&c) = children[node].iter().find(|&&c| weight[c] > half) {
        node = c;
    }
    let sep: Vec<usize> = if node == rest_node {
        rest
    } else {
        std::iter::once(node).chain(bags[node].iter().copied()).collect()
    };
    let mut out: Vec<usize> = sep.into_iter().map(|i| verts[i]).collect();
    out.sort_unstable();
    Ok(out)
}

/// Connected components of the subgraph induced by `verts` (a subset of the vertices of `adj`),
/// each sorted; `mark` is scratch space of `adj.len()` entries, all `false` on entry and exit.
pub fn components(adj: &[Vec<usize>], verts: &[usize], mark: &mut [u8]) -> Vec<Vec<usize>> {
    const MEMBER: u8 = 1;
    const SEEN: u8 = 2;
    for &v in verts {
        mark[v] = MEMBER;
    }
    let mut comps = Vec::new();
    for &start in verts {
        if mark[start] != MEMBER {
            continue;
        }
        mark[start] = SEEN;
        let mut comp = vec![start];
        let mut i = 0;
        while i < comp.len() {
            let v = comp[i];
            i += 1;
            for &u in &adj[v] {
                if mark[u] == MEMBER {
                    mark[u] = SEEN;
                    comp.push(u);
                }
            }
        }
        comp.sort_unstable();
        comps.push(comp);
    }
    for &v in verts {
        mark[v] = 0;
    }
    comps
}

#[cfg(test)]
mod tests {
    use super::*;

    fn undirected(n: usize, edges: &[(usize, usize)]) -> Vec<Vec<usize>> {
        let mut adj = vec![Vec::new(); n];
        for &(a, b) in edges {
            adj[a].push(b);
            adj[b].push(a);
        }
        adj
    }

    fn check_balanced(adj: &[Vec<usize>], verts: &[usize]) -> Vec<usize> {
        let sep = balanced_separator(adj, verts, &Stop::never()).unwrap();
        let rest: Vec<usize> = verts.iter().copied().filter(|v| !sep.contains(v)).collect();
        let mut mark = vec![0u8; adj.len()];
        for c in components(adj, &rest, &mut mark) {
            assert!(c.len() <= verts.len() / 2, "component {c:?} of {verts:?} after removing {sep:?}");
        }
        sep
    }

    #[test]
    fn path_is_split_in_the_middle_by_one_vertex() {
        let n = 31;
        let adj = undirected(n, &(0..n - 1).map(|i| (i, i + 1)).collect::<Vec<_>>());
        let verts: Vec<usize> = (0..n).collect();
        let sep = check_balanced(&adj, &verts);
        assert!(sep.len() <= 2, "{sep:?}");
    }

    #[test]
    fn grid_and_clique_get_balanced_separators() {
        let w = 6;
        let mut edges = Vec::new();
        for r in 0..w {
            for c in 0..w {
                if c + 1 < w {
                    edges.push((r * w + c, r * w + c + 1));
                }
                if r + 1 < w {
                    edges.push((r * w + c, (r + 1) * w + c));
                }
            }
        }
        let adj = undirected(w * w, &edges);
        let verts: Vec<usize> = (0..w * w).collect();
        let sep = check_balanced(&adj, &verts);
        assert!(sep.len() <= 2 * w, "grid separator too large: {sep:?}");
        // A subset: the first three rows.
        check_balanced(&adj, &(0..3 * w).collect::<Vec<_>>());

        let k = 7;
        let clique: Vec<(usize, usize)> = (0..k).flat_map(|a| (a + 1..k).map(move |b| (a, b))).collect();
        let adj = undirected(k, &clique);
        let sep = check_balanced(&adj, &(0..k).collect::<Vec<_>>());
        // What is left of a clique is one component, so at least half of it must go.
        assert!(sep.len() >= k - k / 2, "{sep:?}");
    }

    #[test]
    fn disconnected_small_parts_need_no_separator() {
        let adj = undirected(6, &[(0, 1), (2, 3), (4, 5)]);
        let sep = check_balanced(&adj, &(0..6).collect::<Vec<_>>());
        assert!(sep.is_empty(), "{sep:?}");
    }
}
