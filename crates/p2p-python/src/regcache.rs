//! The registration cache behind `register_memory`, as UCCL keeps one:
//! registering exactly the same range again (the same tensor) gives a new
//! handle (`mr_id`, a region of its own that local calls may use) but the
//! same keys (`lkeys`, `rkeys`): a peer holding the first descriptor and one
//! holding the second present the same token. The keys stay valid while any
//! handle of the range is registered; the last `deregister_memory` (or
//! `dereg`) of a handle removes them.
//!
//! Only an identical `(ptr, size)` shares keys. A sub-range of a registered
//! tensor gets keys of its own: a token bounds exactly its range, so sharing
//! the whole tensor's token would let a peer given the slice reach the rest.

use std::collections::{HashMap, HashSet};

use tcpx_p2p::Token;

struct Entry {
    /// The region whose exported token the keys carry.
    base: u64,
    token: Token,
    /// Handles given out and not yet released (the base among them until
    /// it is released itself).
    live: HashSet<u64>,
}

/// Cached registrations by `(ptr, size)`.
#[derive(Default)]
pub struct RegCache {
    entries: HashMap<(u64, usize), Entry>,
    by_handle: HashMap<u64, (u64, usize)>,
}

impl RegCache {
    /// The keys of a live registration of exactly `[ptr, ptr+size)`:
    /// `(base region, token)`.
    pub fn keys(&self, ptr: u64, size: usize) -> Option<(u64, Token)> {
        self.entries.get(&(ptr, size)).map(|e| (e.base, e.token))
    }

    /// Records a first registration of the range (`mr` is its base).
    pub fn insert(&mut self, ptr: u64, size: usize, mr: u64, token: Token) {
        self.entries.insert(
            (ptr, size),
            Entry {
                base: mr,
                token,
                live: HashSet::from([mr]),
            },
        );
        self.by_handle.insert(mr, (ptr, size));
    }

    /// Records one more handle of an already cached range.
    pub fn add_handle(&mut self, ptr: u64, size: usize, mr: u64) {
        if let Some(e) = self.entries.get_mut(&(ptr, size)) {
            e.live.insert(mr);
            self.by_handle.insert(mr, (ptr, size));
        }
    }

    /// Releases handle `mr`: the regions to deregister now (the handle's
    /// own unless it is the base, and the base once no handle is left).
    /// None when `mr` is not a cached handle.
    pub fn release(&mut self, mr: u64) -> Option<Vec<u64>> {
        let key = self.by_handle.remove(&mr)?;
        let e = self.entries.get_mut(&key)?;
        e.live.remove(&mr);
        let mut out = Vec::new();
        if mr != e.base {
            out.push(mr);
        }
        if e.live.is_empty() {
            out.push(e.base);
            self.entries.remove(&key);
        }
        Some(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shared_keys_released_by_the_last_handle() {
        let mut c = RegCache::default();
        let t = Token { id: 9, secret: 99 };
        assert!(c.keys(100, 10).is_none());
        c.insert(100, 10, 1, t);
        assert_eq!(c.keys(100, 10), Some((1, t)));
        assert!(c.keys(100, 11).is_none(), "only the identical range");
        c.add_handle(100, 10, 2);
        // The base released first: kept (its token is the keys), nothing
        // deregistered yet.
        assert_eq!(c.release(1), Some(vec![]));
        assert_eq!(c.keys(100, 10), Some((1, t)));
        c.add_handle(100, 10, 3);
        assert_eq!(c.release(2), Some(vec![2]));
        // The last handle takes the base with it.
        assert_eq!(c.release(3), Some(vec![3, 1]));
        assert!(c.keys(100, 10).is_none());
        assert_eq!(c.release(3), None, "released twice");
        assert_eq!(c.release(77), None, "never cached");
    }

    #[test]
    fn base_released_last() {
        let mut c = RegCache::default();
        c.insert(5, 5, 10, Token { id: 1, secret: 2 });
        c.add_handle(5, 5, 11);
        assert_eq!(c.release(11), Some(vec![11]));
        assert_eq!(c.release(10), Some(vec![10]));
        assert!(c.keys(5, 5).is_none());
    }
}
