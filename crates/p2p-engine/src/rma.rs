//! Runs of one-sided items: consecutive items that are contiguous on both
//! sides travel as one message. A KV cache laid out in one tensor often
//! hands `writev` hundreds of blocks that sit back to back on both ends;
//! without runs each block costs a message, a request and a completion of
//! its own.
//!
//! The initiator plans the runs (it alone knows both sides' addresses and
//! regions) and sends them with the request; the target checks every item
//! on its own, then that each run is contiguous inside one of its regions.

use crate::net::MemRef;
use crate::pieces::Pieces;
use crate::wire::RmaItem;

/// Groups items into runs: item i joins item i-1 when its local range
/// starts where the previous ended in the same local region, and its
/// remote range starts where the previous ended in the same remote region
/// (`remote_region[i]`, the peer's id for it).
pub fn plan_runs(local: &Pieces, remote: &[RmaItem], remote_region: &[u64]) -> Vec<u32> {
    let mut runs: Vec<u32> = Vec::new();
    let mut prev: Option<(&MemRef, u64)> = None;
    for (i, (b, rb)) in local.iter().enumerate() {
        let joins = prev.is_some_and(|(a, ra)| {
            let (x, y) = (remote.get(i - 1), remote.get(i));
            ra == rb.id
                && a.kind == b.kind
                && a.addr.checked_add(a.len as u64) == Some(b.addr)
                && remote_region.get(i - 1) == remote_region.get(i)
                && x.zip(y)
                    .is_some_and(|(x, y)| x.addr.checked_add(x.len) == Some(y.addr))
                && runs.last().is_some_and(|&n| n < u32::MAX)
        });
        match runs.last_mut() {
            Some(n) if joins => *n += 1,
            _ => runs.push(1),
        }
        prev = Some((b, rb.id));
    }
    runs
}

/// Why runs of items do not merge.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RunError {
    #[error("fewer items than the runs cover")]
    TooFewItems,
    #[error("more items than the runs cover")]
    TooManyItems,
    #[error("item {0} is not contiguous with the item before it in one region")]
    NotContiguous(usize),
}

/// Merges each run of items into one range. Err names the first item that
/// is not contiguous with its run or lies in another region.
pub fn merge_runs(items: Pieces, runs: &[u32]) -> Result<Pieces, RunError> {
    if runs.len() == items.len() && runs.iter().all(|&n| n == 1) {
        // Nothing merges (blocks scattered on one side, as KV blocks are):
        // the items as they are, not a copy of each.
        return Ok(items);
    }
    let mut out = Pieces::with_capacity(runs.len());
    let mut it = items.iter().enumerate();
    for &n in runs {
        let Some((_, (&first, r))) = it.next() else {
            return Err(RunError::TooFewItems);
        };
        let mut m = first;
        for _ in 1..n {
            let Some((i, (b, rb))) = it.next() else {
                return Err(RunError::TooFewItems);
            };
            if rb.id != r.id || b.kind != m.kind || m.addr.checked_add(m.len as u64) != Some(b.addr)
            {
                return Err(RunError::NotContiguous(i));
            }
            m.len += b.len;
        }
        out.push(m, r);
    }
    if it.next().is_some() {
        return Err(RunError::TooManyItems);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::{MemKind, Region};
    use crate::wire::Token;
    use std::sync::Arc;

    fn mem(addr: u64, len: usize) -> MemRef {
        MemRef {
            addr,
            len,
            kind: MemKind::Host,
        }
    }

    fn item(addr: u64, len: u64) -> RmaItem {
        RmaItem {
            token: Token {
                id: addr,
                secret: 1,
            },
            addr,
            len,
        }
    }

    #[test]
    fn runs_join_only_what_is_contiguous_on_both_sides() {
        let (r1, r2) = (region(1), region(2));
        let pieces = |v: &[(MemRef, &Arc<Region>)]| -> Pieces {
            v.iter().map(|(m, r)| (*m, (*r).clone())).collect()
        };
        // Blocks back to back on both sides: one run.
        let mems: Vec<MemRef> = (0..4).map(|i| mem(1000 + i * 10, 10)).collect();
        let local = pieces(&mems.iter().map(|m| (*m, &r1)).collect::<Vec<_>>());
        let remote: Vec<_> = (0..4).map(|i| item(5000 + i * 10, 10)).collect();
        assert_eq!(plan_runs(&local, &remote, &[7; 4]), vec![4]);
        // Remote order scrambled: nothing joins.
        let scrambled: Vec<_> = [3, 2, 1, 0]
            .iter()
            .map(|&i| item(5000 + i * 10, 10))
            .collect();
        assert_eq!(plan_runs(&local, &scrambled, &[7; 4]), vec![1, 1, 1, 1]);
        // A break in the local side, in the remote regions, and in the local
        // region splits the run there.
        let mut gap = mems.clone();
        gap[2].addr += 1;
        gap[3].addr += 1;
        let gap = pieces(&gap.iter().map(|m| (*m, &r1)).collect::<Vec<_>>());
        assert_eq!(plan_runs(&gap, &remote, &[7; 4]), vec![2, 2]);
        assert_eq!(plan_runs(&local, &remote, &[7, 7, 8, 8]), vec![2, 2]);
        let other = pieces(&[
            (mems[0], &r1),
            (mems[1], &r2),
            (mems[2], &r2),
            (mems[3], &r2),
        ]);
        assert_eq!(plan_runs(&other, &remote, &[7; 4]), vec![1, 3]);
        assert!(plan_runs(&Pieces::default(), &[], &[]).is_empty());
        // Fewer remote items than pieces: the pieces without one join nothing.
        assert_eq!(plan_runs(&local, &remote[..2], &[7; 2]), vec![2, 1, 1]);
    }

    fn region(id: u64) -> Arc<Region> {
        Arc::new(Region {
            id,
            addr: 0,
            len: 1 << 20,
            kind: MemKind::Host,
        })
    }

    #[test]
    fn merge_checks_contiguity_and_region() {
        let (a, b) = (region(1), region(2));
        let items: Pieces = [
            (mem(0, 10), a.clone()),
            (mem(10, 20), a.clone()),
            (mem(100, 5), a.clone()),
        ]
        .into_iter()
        .collect();
        let merged = merge_runs(items.clone(), &[2, 1]).unwrap();
        assert_eq!(merged.len(), 2);
        assert_eq!((merged.mems()[0].addr, merged.mems()[0].len), (0, 30));
        assert_eq!((merged.mems()[1].addr, merged.mems()[1].len), (100, 5));
        // A run over a gap, or over two regions, is refused.
        assert_eq!(
            merge_runs(items.clone(), &[3]).unwrap_err(),
            RunError::NotContiguous(2)
        );
        let two: Pieces = [(mem(0, 10), a), (mem(10, 10), b)].into_iter().collect();
        assert!(merge_runs(two, &[2]).is_err());
        // Runs that do not cover the items exactly.
        assert!(merge_runs(items.clone(), &[1, 1]).is_err());
        assert!(merge_runs(items, &[2, 2]).is_err());
    }
}
