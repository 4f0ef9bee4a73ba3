//! A list of pieces of registered memory and the regions that hold them.
//!
//! A region's handle (`Arc<Region>`) is what keeps it registered while a
//! transfer uses it: deregistration waits until no handle but the
//! registry's is left. A list of KV blocks names one region 131,072 times;
//! holding a handle per piece cost an atomic increment and decrement per
//! piece, on a count every I/O worker touches too (a quarter of a long
//! list's posting time). [`Pieces`] holds one handle per run of
//! consecutive pieces in one region, and hands each piece's region out by
//! reference.

use std::ops::Range;
use std::sync::Arc;

use crate::memory::Region;
use crate::net::MemRef;

/// Pieces of memory in order, each with the region that holds it.
#[derive(Debug, Clone, Default)]
pub struct Pieces {
    mems: Vec<MemRef>,
    /// One entry per run of consecutive pieces in one region: the index of
    /// the run's first piece and the region. Starts at 0 and rises.
    runs: Vec<(usize, Arc<Region>)>,
}

impl Pieces {
    /// An empty list with room for `n` pieces.
    pub fn with_capacity(n: usize) -> Self {
        Pieces {
            mems: Vec::with_capacity(n),
            runs: Vec::new(),
        }
    }

    /// One piece.
    pub fn one(mem: MemRef, region: Arc<Region>) -> Self {
        Pieces {
            mems: vec![mem],
            runs: vec![(0, region)],
        }
    }

    /// Appends `mem`, held by `region`: a new handle only where the region
    /// differs from the last piece's.
    pub fn push(&mut self, mem: MemRef, region: &Arc<Region>) {
        if !self
            .runs
            .last()
            .is_some_and(|(_, r)| Arc::ptr_eq(r, region))
        {
            self.runs.push((self.mems.len(), region.clone()));
        }
        self.mems.push(mem);
    }

    pub fn len(&self) -> usize {
        self.mems.len()
    }

    pub fn is_empty(&self) -> bool {
        self.mems.is_empty()
    }

    /// The pieces' memory, in order.
    pub fn mems(&self) -> &[MemRef] {
        &self.mems
    }

    /// The total byte length.
    pub fn total(&self) -> usize {
        self.mems.iter().map(|m| m.len).sum()
    }

    /// Each piece with its region, in order.
    pub fn iter(&self) -> Iter<'_> {
        Iter {
            pieces: self,
            at: 0,
            run: 0,
        }
    }

    /// Piece `i` and its region.
    pub fn get(&self, i: usize) -> Option<(&MemRef, &Arc<Region>)> {
        let m = self.mems.get(i)?;
        Some((m, self.region_at(i)))
    }

    /// The region of piece `i` (which exists).
    fn region_at(&self, i: usize) -> &Arc<Region> {
        let k = self.runs.partition_point(|(start, _)| *start <= i);
        &self.runs[k - 1].1
    }

    /// The regions, each once per run of pieces in it (what a transfer
    /// holds until it ends).
    pub fn regions(&self) -> Vec<Arc<Region>> {
        self.runs.iter().map(|(_, r)| r.clone()).collect()
    }

    /// A copy of pieces `range` (which lies inside the list), holding their
    /// regions once per run.
    pub fn slice(&self, range: Range<usize>) -> Pieces {
        let mut out = Pieces::with_capacity(range.len());
        if range.is_empty() {
            return out;
        }
        let first = self
            .runs
            .partition_point(|(start, _)| *start <= range.start)
            - 1;
        for (k, (start, r)) in self.runs.iter().enumerate().skip(first) {
            if *start >= range.end {
                break;
            }
            let end = self.runs.get(k + 1).map_or(self.mems.len(), |n| n.0);
            let (a, b) = ((*start).max(range.start), end.min(range.end));
            out.runs.push((a - range.start, r.clone()));
            out.mems.extend_from_slice(&self.mems[a..b]);
        }
        out
    }
}

/// The pieces of a [`Pieces`] with their regions, in order.
pub struct Iter<'a> {
    pieces: &'a Pieces,
    at: usize,
    run: usize,
}

impl<'a> Iterator for Iter<'a> {
    type Item = (&'a MemRef, &'a Arc<Region>);

    fn next(&mut self) -> Option<Self::Item> {
        let p = self.pieces;
        let m = p.mems.get(self.at)?;
        while p
            .runs
            .get(self.run + 1)
            .is_some_and(|(start, _)| *start <= self.at)
        {
            self.run += 1;
        }
        self.at += 1;
        Some((m, &p.runs[self.run].1))
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        let n = self.pieces.mems.len() - self.at;
        (n, Some(n))
    }
}

impl<'a> IntoIterator for &'a Pieces {
    type Item = (&'a MemRef, &'a Arc<Region>);
    type IntoIter = Iter<'a>;

    fn into_iter(self) -> Iter<'a> {
        self.iter()
    }
}

impl FromIterator<(MemRef, Arc<Region>)> for Pieces {
    fn from_iter<I: IntoIterator<Item = (MemRef, Arc<Region>)>>(iter: I) -> Self {
        let mut out = Pieces::default();
        for (m, r) in iter {
            out.push(m, &r);
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::MemKind;

    fn region(id: u64) -> Arc<Region> {
        Arc::new(Region {
            id,
            addr: 0,
            len: 1 << 30,
            kind: MemKind::Host,
        })
    }

    fn mem(addr: u64) -> MemRef {
        MemRef {
            addr,
            len: 10,
            kind: MemKind::Host,
        }
    }

    #[test]
    fn a_region_is_held_once_per_run_and_each_piece_finds_its_own() {
        let (a, b) = (region(1), region(2));
        let mut p = Pieces::with_capacity(6);
        for (i, r) in [&a, &a, &b, &b, &b, &a].into_iter().enumerate() {
            p.push(mem(i as u64 * 10), r);
        }
        assert_eq!(p.len(), 6);
        assert_eq!(p.total(), 60);
        // Three runs: a, b, a. The registry's handle plus two of ours on a.
        assert_eq!(p.regions().len(), 3);
        assert_eq!(Arc::strong_count(&a), 1 + 2);
        assert_eq!(Arc::strong_count(&b), 1 + 1);
        let ids: Vec<(u64, u64)> = p.iter().map(|(m, r)| (m.addr, r.id)).collect();
        assert_eq!(ids, [(0, 1), (10, 1), (20, 2), (30, 2), (40, 2), (50, 1)]);
        for (i, &(addr, id)) in ids.iter().enumerate() {
            let (m, r) = p.get(i).unwrap();
            assert_eq!((m.addr, r.id), (addr, id));
        }
        assert!(p.get(6).is_none());
        // Any slice sees the same pieces and regions.
        for s in 0..=6 {
            for e in s..=6 {
                let q = p.slice(s..e);
                let got: Vec<(u64, u64)> = q.iter().map(|(m, r)| (m.addr, r.id)).collect();
                assert_eq!(got, ids[s..e], "slice {s}..{e}");
                assert_eq!(q.len(), e - s);
            }
        }
        drop(p);
        assert_eq!((Arc::strong_count(&a), Arc::strong_count(&b)), (1, 1));
    }

    #[test]
    fn a_long_list_in_one_region_holds_it_once() {
        let r = region(7);
        let p: Pieces = (0..131_072u64)
            .map(|i| (mem(i * 4096), r.clone()))
            .collect();
        assert_eq!(Arc::strong_count(&r), 2);
        assert_eq!(p.iter().count(), 131_072);
        assert!(Pieces::default().iter().next().is_none());
        assert!(Pieces::default().slice(0..0).is_empty());
    }
}
