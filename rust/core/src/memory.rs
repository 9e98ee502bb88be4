//! The storage rules of docs/graph-ir.md, written once: which storage instance each alive tensor
//! holds and how many bytes the held instances take. The simulator (`simulate`) checks a whole
//! schedule with them; the planner measures its schedule fragments with them
//! ([`fragment_peak`]), so a plan the level model accepts is measured as the simulator measures.
//!
//! Rules: a tensor that owns its storage (no `alias_of`) gets a new instance each time it is
//! produced; a view produced while a tensor of its storage is alive shares that one's instance
//! (else it gets a new instance of its storage's bytes). An instance counts while at least one
//! alive tensor holds it. Producing an output that is already alive makes a temporary copy,
//! counted during the step only. Tensors whose storage is not counted (pre-existing tensors; in
//! a fragment, storages the fragment does not own) are alive without bytes.

use std::collections::{HashMap, HashSet};

use crate::graph::{Graph, OpId, TensorId};
use crate::schedule::Step;

/// Slot value of a tensor that is not alive.
pub const NOT_ALIVE: u32 = u32::MAX;
/// Slot value of an alive tensor that holds no counted storage.
pub const UNCOUNTED: u32 = u32::MAX - 1;

/// Per tensor, the instance it holds ([`NOT_ALIVE`] when not alive): a dense vector for whole
/// schedules, a map for fragments that touch few of a large graph's tensors.
pub trait Slots {
    fn get(&self, t: TensorId) -> u32;
    fn set(&mut self, t: TensorId, inst: u32);
}

impl Slots for Vec<u32> {
    fn get(&self, t: TensorId) -> u32 {
        self[t]
    }
    fn set(&mut self, t: TensorId, inst: u32) {
        self[t] = inst;
    }
}

impl Slots for HashMap<TensorId, u32> {
    fn get(&self, t: TensorId) -> u32 {
        self.get(&t).copied().unwrap_or(NOT_ALIVE)
    }
    fn set(&mut self, t: TensorId, inst: u32) {
        if inst == NOT_ALIVE {
            self.remove(&t);
        } else {
            self.insert(t, inst);
        }
    }
}

/// Alive tensors, their storage instances and the bytes held.
pub struct Memory<S: Slots> {
    pub slots: S,
    inst_bytes: Vec<u64>,
    inst_refs: Vec<u32>,
    held: u64,
}

impl<S: Slots> Memory<S> {
    pub fn new(slots: S) -> Self {
        Memory {
            slots,
            inst_bytes: Vec::new(),
            inst_refs: Vec::new(),
            held: 0,
        }
    }

    /// Bytes of the instances held by alive tensors.
    pub fn held(&self) -> u64 {
        self.held
    }

    pub fn is_alive(&self, t: TensorId) -> bool {
        self.slots.get(t) != NOT_ALIVE
    }

    /// The instance `t` holds: an index, [`UNCOUNTED`] or [`NOT_ALIVE`].
    pub fn instance(&self, t: TensorId) -> u32 {
        self.slots.get(t)
    }

    pub fn instance_bytes(&self, inst: u32) -> u64 {
        self.inst_bytes[inst as usize]
    }

    /// `t` becomes alive holding a new instance of `bytes`.
    pub fn hold_new(&mut self, t: TensorId, bytes: u64) -> u32 {
        let inst = self.inst_bytes.len() as u32;
        self.inst_bytes.push(bytes);
        self.inst_refs.push(0);
        self.hold(t, inst);
        inst
    }

    /// `t` becomes alive holding `inst` (an instance index, or [`UNCOUNTED`]).
    pub fn hold(&mut self, t: TensorId, inst: u32) {
        if inst != UNCOUNTED {
            let i = inst as usize;
            if self.inst_refs[i] == 0 {
                self.held += self.inst_bytes[i];
            }
            self.inst_refs[i] += 1;
        }
        self.slots.set(t, inst);
    }

    /// `t` stops being alive; false when it was not alive.
    pub fn release(&mut self, t: TensorId) -> bool {
        let inst = self.slots.get(t);
        if inst == NOT_ALIVE {
            return false;
        }
        self.slots.set(t, NOT_ALIVE);
        if inst != UNCOUNTED {
            let i = inst as usize;
            self.inst_refs[i] -= 1;
            if self.inst_refs[i] == 0 {
                self.held -= self.inst_bytes[i];
            }
        }
        true
    }

    /// Run `op`: its outputs that are not alive become alive (storage owners first, so that a
    /// view of another output shares it). Returns the memory during the step: what is held
    /// afterwards, plus temporary copies of outputs that were alive already, plus workspace.
    /// `counted(root)`: whether a storage rooted at `root` counts.
    pub fn compute(
        &mut self,
        g: &Graph,
        roots: &[TensorId],
        op: OpId,
        counted: impl Fn(TensorId) -> bool,
    ) -> u64 {
        let op = &g.ops[op];
        let mut copies = 0u64;
        let owners = op
            .outputs
            .iter()
            .filter(|&&t| g.tensors[t].alias_of.is_none());
        let views = op
            .outputs
            .iter()
            .filter(|&&t| g.tensors[t].alias_of.is_some());
        for &t in owners.chain(views) {
            let root = roots[t];
            let is_view = g.tensors[t].alias_of.is_some();
            if self.is_alive(t) {
                if !is_view && counted(root) {
                    copies += g.tensors[root].bytes;
                }
                continue;
            }
            if is_view {
                let shared = self.view_instance(g, roots, op.inputs.iter().chain(&op.outputs), t);
                if shared != NOT_ALIVE {
                    self.hold(t, shared);
                    continue;
                }
            }
            if counted(root) {
                self.hold_new(t, g.tensors[root].bytes);
            } else {
                self.hold(t, UNCOUNTED);
            }
        }
        self.held + copies + op.workspace
    }

    /// The instance a new view `t` shares (possibly UNCOUNTED): that of an alive tensor of the
    /// op with the same storage, else of the closest alive tensor up its alias chain; NOT_ALIVE
    /// when none is.
    fn view_instance<'a>(
        &self,
        g: &Graph,
        roots: &[TensorId],
        op_tensors: impl Iterator<Item = &'a TensorId>,
        t: TensorId,
    ) -> u32 {
        let same = op_tensors
            .copied()
            .map(|x| (x, self.slots.get(x)))
            .find(|&(x, inst)| x != t && roots[x] == roots[t] && inst != NOT_ALIVE);
        if let Some((_, inst)) = same {
            return inst;
        }
        let mut cur = g.tensors[t].alias_of;
        while let Some(b) = cur {
            let inst = self.slots.get(b);
            if inst != NOT_ALIVE {
                return inst;
            }
            cur = g.tensors[b].alias_of;
        }
        NOT_ALIVE
    }
}

/// A tensor alive at a fragment's start or end: (tensor, storage instance id, instance bytes).
/// Tensors with the same instance id share one storage, counted once; those with 0 bytes hold
/// nothing counted (at the end they carry [`UNCOUNTED_ID`]).
pub type HeldTensor = (TensorId, i64, u64);

/// The instance id of alive tensors that hold nothing counted at a fragment's end.
pub const UNCOUNTED_ID: i64 = i64::MIN;

/// Peak memory of a schedule fragment and what is alive at its end.
#[derive(Debug, Clone, PartialEq)]
pub struct FragmentResult {
    pub peak: u64,
    pub end: Vec<HeldTensor>,
    /// Per step, the memory while it runs: a compute's peak, or what is held before a free (a
    /// storage released by a step still counts during it).
    pub during: Vec<u64>,
    /// Per instance of `start` whose last holder went inside the fragment: (the caller's id,
    /// the step after which it went; -1 before the first).
    pub released: Vec<(i64, i64)>,
}

/// The peak bytes over `steps` of the storages rooted in `counted`, starting from `start`
/// (alive before the fragment; instance ids are the caller's); `dying` tensors are released
/// after the step that reads them last (at once when no step reads them). New instances get
/// ids above every id in `start`.
pub fn fragment_peak(
    g: &Graph,
    roots: &[TensorId],
    steps: &[Step],
    counted: &HashSet<TensorId>,
    start: &[HeldTensor],
    dying: &[TensorId],
) -> FragmentResult {
    // step after which each dying tensor is read no more (None: never read)
    let mut last: HashMap<TensorId, Option<usize>> = dying.iter().map(|&t| (t, None)).collect();
    for (s, step) in steps.iter().enumerate() {
        if let Step::Compute(j) = *step {
            for x in &g.ops[j].inputs {
                if let Some(l) = last.get_mut(x) {
                    *l = Some(s);
                }
            }
        }
    }
    let mut mem = Memory::new(HashMap::<TensorId, u32>::new());
    let mut caller_id: Vec<i64> = Vec::new(); // instance index -> the caller's id
    let mut index_of: HashMap<i64, u32> = HashMap::new();
    let mut gone_at_once: Vec<i64> = Vec::new();
    for &(t, id, bytes) in start {
        if matches!(last.get(&t), Some(None)) {
            if bytes > 0 {
                gone_at_once.push(id);
            }
            continue; // a dying tensor the fragment never reads is gone at once
        }
        if bytes == 0 {
            mem.hold(t, UNCOUNTED);
            continue;
        }
        let inst = match index_of.get(&id) {
            Some(&inst) => inst,
            None => {
                let inst = mem.inst_bytes.len() as u32;
                mem.inst_bytes.push(bytes);
                mem.inst_refs.push(0);
                caller_id.push(id);
                index_of.insert(id, inst);
                inst
            }
        };
        mem.hold(t, inst);
    }
    let mut released_after: HashMap<usize, Vec<TensorId>> = HashMap::new();
    for (&t, &l) in &last {
        if let Some(s) = l {
            released_after.entry(s).or_default().push(t);
        }
    }
    let counts = |root: TensorId| counted.contains(&root);
    let n_start = caller_id.len();
    gone_at_once.sort_unstable();
    gone_at_once.dedup();
    let mut released: Vec<(i64, i64)> = gone_at_once
        .into_iter()
        .filter(|id| !index_of.contains_key(id))
        .map(|id| (id, -1))
        .collect();
    // releases `t` after step `s`; a start instance whose last holder it was is reported (only
    // the released tensor's instance is looked at: a start instance goes at most once, as no
    // tensor can share it again once none holds it)
    let release = |mem: &mut Memory<HashMap<TensorId, u32>>,
                   released: &mut Vec<(i64, i64)>,
                   t: TensorId,
                   s: usize| {
        let inst = Slots::get(&mem.slots, t);
        if mem.release(t)
            && inst != UNCOUNTED
            && (inst as usize) < n_start
            && mem.inst_refs[inst as usize] == 0
        {
            released.push((caller_id[inst as usize], s as i64));
        }
    };
    let mut during = Vec::with_capacity(steps.len());
    let mut peak = mem.held();
    for (s, step) in steps.iter().enumerate() {
        let before = mem.held();
        match *step {
            Step::Compute(j) => {
                // inputs the fragment did not make or receive are alive outside it: held, without
                // bytes, for the step (a view of one shares that outside storage)
                let outside: Vec<TensorId> = g.ops[j]
                    .inputs
                    .iter()
                    .copied()
                    .filter(|&x| !mem.is_alive(x))
                    .collect();
                for &x in &outside {
                    mem.hold(x, UNCOUNTED);
                }
                let running = mem.compute(g, roots, j, counts);
                during.push(running.max(before));
                peak = peak.max(running);
                for &x in &outside {
                    mem.release(x);
                }
                for &t in released_after.get(&s).into_iter().flatten() {
                    release(&mut mem, &mut released, t, s);
                }
            }
            Step::Free(t) => {
                during.push(before);
                release(&mut mem, &mut released, t, s);
            }
        }
        peak = peak.max(mem.held());
    }
    let fresh = start
        .iter()
        .map(|h| h.1)
        .max()
        .unwrap_or(0)
        .max(0)
        .saturating_add(1);
    let mut end: Vec<HeldTensor> = mem
        .slots
        .iter()
        .map(|(&t, &inst)| {
            if inst == UNCOUNTED {
                (t, UNCOUNTED_ID, 0)
            } else if (inst as usize) < n_start {
                (t, caller_id[inst as usize], mem.inst_bytes[inst as usize])
            } else {
                (
                    t,
                    fresh + (inst as usize - n_start) as i64,
                    mem.inst_bytes[inst as usize],
                )
            }
        })
        .collect();
    end.sort_unstable();
    FragmentResult {
        peak,
        end,
        during,
        released,
    }
}
