//! Bounce pools and the layout of a received message in them.
//!
//! A pool is cut into blocks of [`BLOCK_PAGES`] 4 KiB pages; a message
//! takes whole blocks (handed out in shuffled order) and its fragments are
//! scattered over their pages: every 4 KiB piece of the message gets its own
//! page in a shuffled order, at a random offset inside the page when it is
//! shorter than a page, and some pieces are split in two, the halves on
//! different pages, so fragments are unaligned to each other and to the
//! destination, as the TCPX NIC leaves them. One pool per GPU (and one host
//! pool) is shared by all receive comms, as NCCL expects.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use ncclnet_abi::{LoadMeta, NET_UNPACK_MAX_SLICE_PAGES, NET_UNPACK_PAGE_SIZE};
use parking_lot::{Condvar, Mutex};

pub const PAGE: usize = NET_UNPACK_PAGE_SIZE;
/// Pages per block (256 KiB).
pub const BLOCK_PAGES: usize = 64;
pub const BLOCK: usize = BLOCK_PAGES * PAGE;

/// xorshift64*: small, seedable, good enough to shuffle pages.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed | 1)
    }
    pub fn next_u64(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    /// Uniform in `0..n` (n > 0).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n.max(1)
    }
    pub fn shuffle<T>(&mut self, v: &mut [T]) {
        for i in (1..v.len()).rev() {
            v.swap(i, self.below(i as u64 + 1) as usize);
        }
    }
}

/// One fragment of a planned message: `len` bytes of the message at
/// `dst_off`, stored in page `page` (an index into the message's pages) at
/// `in_page`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Frag {
    pub dst_off: u64,
    pub len: u32,
    pub page: u32,
    pub in_page: u32,
}

/// How a message of `len` bytes is scattered: its fragments in message
/// order, each on a page of its own (`pages` = fragment count). Errors when
/// it needs more than 2048 fragments (TCPX exits on that).
pub fn plan(len: usize, split_pct: u32, rng: &mut Rng) -> Result<Vec<Frag>, String> {
    let pieces = len.div_ceil(PAGE);
    if pieces > NET_UNPACK_MAX_SLICE_PAGES {
        return Err(format!(
            "a message of {len} bytes needs {pieces} fragments; TCPX allows {NET_UNPACK_MAX_SLICE_PAGES} per receive (keep receives ≤ 4 MiB)"
        ));
    }
    let mut budget = NET_UNPACK_MAX_SLICE_PAGES - pieces;
    let mut frags = Vec::with_capacity(pieces + pieces / 4 + 1);
    for i in 0..pieces {
        let off = i * PAGE;
        let l = PAGE.min(len - off);
        if l >= 2 && budget > 0 && rng.below(100) < u64::from(split_pct) {
            budget -= 1;
            let cut = 1 + rng.below(l as u64 - 1) as usize;
            frags.push((off, cut));
            frags.push((off + cut, l - cut));
        } else {
            frags.push((off, l));
        }
    }
    let mut pages: Vec<u32> = (0..frags.len() as u32).collect();
    rng.shuffle(&mut pages);
    Ok(frags
        .into_iter()
        .zip(pages)
        .map(|((d, l), page)| Frag {
            dst_off: d as u64,
            len: l as u32,
            page,
            in_page: rng.below((PAGE - l) as u64 + 1) as u32,
        })
        .collect())
}

/// Blocks a plan needs.
pub fn blocks_for(frags: &[Frag]) -> usize {
    frags.len().div_ceil(BLOCK_PAGES)
}

/// Where page `page` of a message lies in the pool, given its blocks.
pub fn page_offset(blocks: &[u32], page: u32) -> usize {
    let p = page as usize;
    blocks[p / BLOCK_PAGES] as usize * BLOCK + (p % BLOCK_PAGES) * PAGE
}

/// The loadMeta entries of a plan placed in `blocks`, in shuffled order.
pub fn load_metas(frags: &[Frag], blocks: &[u32], rng: &mut Rng) -> Vec<LoadMeta> {
    let mut v: Vec<LoadMeta> = frags
        .iter()
        .map(|f| LoadMeta {
            src_off: (page_offset(blocks, f.page) + f.in_page as usize) as u32,
            len: f.len,
            dst_off: f.dst_off,
        })
        .collect();
    rng.shuffle(&mut v);
    v
}

/// Where a pool's memory is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PoolKind {
    Host,
    Gpu(i32),
}

/// A pool of bounce blocks. `base` is a host address or a device address.
pub struct BouncePool {
    pub kind: PoolKind,
    pub base: u64,
    pub blocks: usize,
    free: Mutex<Vec<u32>>,
    cv: Condvar,
    _mem: Box<dyn Send + Sync>,
}

impl BouncePool {
    /// A pool over `bytes` of memory at `base`, kept alive by `mem`.
    pub fn new(
        kind: PoolKind,
        base: u64,
        bytes: usize,
        mem: Box<dyn Send + Sync>,
        rng: &mut Rng,
    ) -> Self {
        let blocks = bytes / BLOCK;
        let mut free: Vec<u32> = (0..blocks as u32).collect();
        rng.shuffle(&mut free);
        BouncePool {
            kind,
            base,
            blocks,
            free: Mutex::new(free),
            cv: Condvar::new(),
            _mem: mem,
        }
    }

    /// Takes `n` blocks, waiting while others hold them; gives up when
    /// `closing` is set.
    pub fn take(self: &Arc<Self>, n: usize, closing: &AtomicBool) -> Result<Lease, String> {
        self.fits(n)?;
        let mut free = self.free.lock();
        loop {
            if let Some(l) = self.grab(&mut free, n) {
                return Ok(l);
            }
            if closing.load(Ordering::Acquire) {
                return Err("comm closed".into());
            }
            self.cv.wait_for(&mut free, Duration::from_millis(50));
        }
    }

    /// Takes `n` blocks if they are free now.
    pub fn try_take(self: &Arc<Self>, n: usize) -> Result<Option<Lease>, String> {
        self.fits(n)?;
        Ok(self.grab(&mut self.free.lock(), n))
    }

    fn fits(&self, n: usize) -> Result<(), String> {
        if n > self.blocks {
            return Err(format!(
                "a message needs {n} bounce blocks of {BLOCK} bytes; the pool has {} (raise NCCL_NET_EMU_POOL_MB)",
                self.blocks
            ));
        }
        Ok(())
    }

    fn grab(self: &Arc<Self>, free: &mut Vec<u32>, n: usize) -> Option<Lease> {
        let at = free.len().checked_sub(n)?;
        Some(Lease {
            pool: self.clone(),
            blocks: free.split_off(at),
        })
    }

    pub fn free_blocks(&self) -> usize {
        self.free.lock().len()
    }
}

/// Blocks held by one received message until `irecvConsumed`.
pub struct Lease {
    pool: Arc<BouncePool>,
    pub blocks: Vec<u32>,
}

impl Drop for Lease {
    fn drop(&mut self) {
        let mut free = self.pool.free.lock();
        free.extend(self.blocks.drain(..));
        drop(free);
        self.pool.cv.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plans_cover_the_message_once_on_distinct_pages() {
        let mut rng = Rng::new(5);
        for &len in &[0usize, 1, 100, 4096, 4097, 65536 + 3, 4 << 20, 8 << 20] {
            let frags = plan(len, 25, &mut rng).unwrap();
            let mut covered = vec![0u8; len];
            let mut pages = std::collections::HashSet::new();
            for f in &frags {
                assert!(f.len >= 1 && f.in_page as usize + f.len as usize <= PAGE);
                assert!(pages.insert(f.page), "one fragment per page");
                for b in &mut covered[f.dst_off as usize..f.dst_off as usize + f.len as usize] {
                    *b += 1;
                }
            }
            assert!(covered.iter().all(|&c| c == 1), "len {len}");
            assert!(frags.len() <= NET_UNPACK_MAX_SLICE_PAGES);
            assert_eq!(pages.len(), frags.len());
            assert!(pages.iter().all(|&p| (p as usize) < frags.len()));
        }
        assert!(plan((8 << 20) + 1, 25, &mut rng).is_err());
    }

    #[test]
    fn load_metas_stay_inside_their_blocks() {
        let mut rng = Rng::new(9);
        let frags = plan(1 << 20, 50, &mut rng).unwrap();
        let blocks = vec![7u32, 2, 11, 0, 5, 9, 3, 14];
        assert!(blocks_for(&frags) <= blocks.len());
        let metas = load_metas(&frags, &blocks, &mut rng);
        assert_eq!(metas.len(), frags.len());
        for m in &metas {
            let block = m.src_off as usize / BLOCK;
            assert!(blocks.contains(&(block as u32)));
            assert_eq!(
                (m.src_off as usize % PAGE + m.len as usize - 1) / PAGE,
                0,
                "a fragment stays inside its page"
            );
        }
    }

    #[test]
    fn leases_return_their_blocks() {
        let mut rng = Rng::new(1);
        let pool = Arc::new(BouncePool::new(
            PoolKind::Host,
            0,
            4 * BLOCK,
            Box::new(()),
            &mut rng,
        ));
        let closing = AtomicBool::new(false);
        let a = pool.take(3, &closing).unwrap();
        assert_eq!(pool.free_blocks(), 1);
        assert!(pool.take(5, &closing).is_err());
        assert!(pool.try_take(2).unwrap().is_none(), "one block is free");
        let b = pool.try_take(1).unwrap().expect("one block is free");
        assert_eq!(pool.free_blocks(), 0);
        drop(b);
        closing.store(true, Ordering::Release);
        assert!(pool.take(2, &closing).is_err());
        drop(a);
        assert_eq!(pool.free_blocks(), 4);
    }
}
