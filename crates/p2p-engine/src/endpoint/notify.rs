//! Notifications, one-sided transfers at an offset, and calls for callers
//! that poll (the C API).

use super::*;
use std::ops::Range;

/// Items of one one-sided request when a transfer has more. A request is
/// planned, sent, admitted by the target (every item checked) and cleared
/// before its bytes move: a transfer of 131,072 blocks (vLLM's KV lists)
/// as two requests of 65,536 moved nothing for the first ~30 ms; in parts
/// of 8,192 its first bytes move after a sixteenth of that, and the later
/// parts are posted and admitted while they do. At most
/// [`crate::wire::MAX_RMA_ITEMS`].
pub(crate) const RMA_PART: usize = 8_192;
const _: () = assert!(RMA_PART <= crate::wire::MAX_RMA_ITEMS);

/// The item ranges of a one-sided transfer of `n` items: parts of
/// [`RMA_PART`] items (all of them in one request up to that). A first part
/// of 1,024 items, the parts then doubling, moved no figure on 2 × H200
/// (NIXL 131,072 × 4 KiB: the first bytes wait for the target's check of
/// the first request, but the transfer's time is lost after that).
fn part_ranges(n: usize) -> Vec<Range<usize>> {
    (0..n)
        .step_by(RMA_PART)
        .map(|at| at..(at + RMA_PART).min(n))
        .collect()
}

/// Notifications, one-sided transfers at an offset, and calls for callers
/// that poll (the C API).
impl Endpoint {
    /// The name sent with this endpoint's notifications.
    pub fn name(&self) -> &str {
        &self.inner.name
    }

    pub(super) fn check_notif(msg: &[u8]) -> Result<()> {
        if msg.len() > crate::wire::MAX_NOTIF {
            return Err(Error::invalid(format!(
                "notification of {} bytes exceeds the limit of {} bytes",
                msg.len(),
                crate::wire::MAX_NOTIF
            )));
        }
        Ok(())
    }

    /// Sends `msg` (at most [`crate::notif::MAX_NOTIF`] bytes) to the peer of
    /// `conn`; the peer's [`Endpoint::get_notifs`] returns it with our name.
    pub fn send_notif(&self, conn: u64, msg: &[u8]) -> Result<()> {
        Self::check_notif(msg)?;
        self.conn(conn)?.send_notif(&self.inner.name, msg)
    }

    /// Takes every notification received so far, oldest first.
    pub fn get_notifs(&self) -> Vec<Notif> {
        self.inner.notifs.drain()
    }

    /// One-sided write (`read == false`) or read of `bufs[i]` to or from
    /// `remote[i].1` bytes into the range `remote[i].0` names. With `notif`,
    /// the message is sent to the peer once the transfer has ended well:
    /// after a write, once the peer has every byte (its `WriteDone` came);
    /// after a read, once every byte has landed here.
    pub fn rma_async(
        &self,
        conn: u64,
        read: bool,
        bufs: &[Buf],
        remote: &[(RemoteDesc, u64)],
        notif: Option<&[u8]>,
    ) -> Result<u64> {
        if let Some(m) = notif {
            Self::check_notif(m)?;
        }
        let clock = crate::net::timing::Steps::start(tracing::enabled!(tracing::Level::TRACE));
        let c = self.conn(conn)?;
        if remote.len() != bufs.len() {
            return Err(Error::invalid(format!(
                "{} local buffers but {} remote descriptors",
                bufs.len(),
                remote.len()
            )));
        }
        // Every piece is checked before any is posted: a bad one fails the
        // call with no byte moved.
        for (i, (b, (d, off))) in bufs.iter().zip(remote).enumerate() {
            let fits = off
                .checked_add(b.len as u64)
                .is_some_and(|end| end <= d.len);
            if !fits {
                return Err(Error::invalid(format!(
                    "piece {i}: {} bytes at offset {off} do not fit the {} bytes the peer's descriptor names",
                    b.len, d.len
                )));
            }
        }
        let part = |r: Range<usize>| {
            let items = bufs[r.clone()]
                .iter()
                .zip(&remote[r.clone()])
                .map(|(b, (d, off))| RmaItem {
                    token: d.token,
                    addr: d.addr + off,
                    len: b.len as u64,
                })
                .collect();
            let regions = remote[r.clone()].iter().map(|(d, _)| d.region).collect();
            Ok((self.resolve_local(&bufs[r])?, items, regions))
        };
        let t = self.post_rma_any(&c, read, bufs, part, clock)?;
        if let Some(m) = notif {
            c.watch(
                &t,
                crate::transfer::Watch::Notify {
                    name: self.inner.name.clone(),
                    msg: m.to_vec(),
                },
            );
        }
        Ok(self.publish(t))
    }

    /// A one-sided transfer of `bufs` (up to
    /// [`crate::wire::MAX_RMA_PIECES`]) on connection `c`, its peer's side
    /// made a part at a time by `part` (our side resolved, the peer's
    /// items, their region ids): one request, or parts under one transfer
    /// ([`part_ranges`]). Every one-sided call goes through here, so
    /// that none sends a request larger than the peer accepts. Our buffers
    /// are checked before any part is made; a part is made and posted
    /// before the next is made, so that the first bytes move while the
    /// later parts are (and no list as long as the call's is built).
    pub(super) fn post_rma_any(
        &self,
        c: &Arc<Conn>,
        read: bool,
        bufs: &[Buf],
        mut part: impl FnMut(Range<usize>) -> Result<RmaPart>,
        clock: crate::net::timing::Steps,
    ) -> Result<Arc<Transfer>> {
        let n = bufs.len();
        if n > crate::wire::MAX_RMA_PIECES {
            return Err(Error::invalid(format!(
                "{n} pieces in one transfer; at most {} (post several)",
                crate::wire::MAX_RMA_PIECES
            )));
        }
        self.check_local(bufs)?;
        let mut steps = PostSteps {
            checked: clock.at(),
            ..PostSteps::default()
        };
        let mut post = |r: Range<usize>, id: u64| {
            let t0 = clock.at();
            let (local, items, regions) = part(r)?;
            let t1 = clock.at();
            let t = c.post_rma(id, read, local, items, &regions);
            steps.made += t1 - t0;
            steps.requests += clock.at() - t1;
            t
        };
        let ranges = part_ranges(n);
        let t = if let [r] = &ranges[..] {
            post(r.clone(), self.next_xfer())?
        } else {
            self.post_rma_parts(c, ranges, &mut post)?
        };
        trace_posted(&t, n, steps);
        Ok(t)
    }

    /// A one-sided transfer in parts (`ranges` of its items, several): one
    /// request per part, each posted by `post` as soon as it is made, under
    /// one transfer that ends once every part has ended (so that no byte of
    /// any part touches the buffers after it is reported), failed if any
    /// part failed. Cancelling it lets the parts run to their ends.
    fn post_rma_parts(
        &self,
        c: &Arc<Conn>,
        ranges: Vec<Range<usize>>,
        post: &mut impl FnMut(Range<usize>, u64) -> Result<Arc<Transfer>>,
    ) -> Result<Arc<Transfer>> {
        let parts = ranges.len();
        let whole = Transfer::new(self.next_xfer(), c.id, parts, Vec::new());
        for (i, r) in ranges.into_iter().enumerate() {
            let part = match post(r, self.next_xfer()) {
                Ok(p) => p,
                Err(e) => {
                    // The parts posted so far run on; this one and the ones
                    // after it never start.
                    let why = Failure::Lost(format!(
                        "part {} of {parts} could not be posted: {e}",
                        i + 1
                    ));
                    whole.poison(why);
                    for _ in i..parts {
                        whole.complete_one();
                    }
                    if i == 0 {
                        return Err(e);
                    }
                    return Ok(whole);
                }
            };
            tracing::trace!(xfer = part.id, whole = whole.id, "lat: part of");
            part.part_of(whole.clone());
        }
        Ok(whole)
    }

    /// [`Endpoint::write_async`] with an optional notification sent once
    /// the peer has every byte.
    pub fn write_async_with_notif(
        &self,
        conn: u64,
        bufs: &[Buf],
        metas: &[FifoItem],
        notif: Option<&[u8]>,
    ) -> Result<u64> {
        let remote: Vec<_> = metas.iter().map(|m| (RemoteDesc::from(m), 0)).collect();
        self.rma_async(conn, false, bufs, &remote, notif)
    }

    /// [`Endpoint::read_async`] with an optional notification sent to the
    /// data's owner once every byte has landed here.
    pub fn read_async_with_notif(
        &self,
        conn: u64,
        bufs: &[Buf],
        metas: &[FifoItem],
        notif: Option<&[u8]>,
    ) -> Result<u64> {
        let remote: Vec<_> = metas.iter().map(|m| (RemoteDesc::from(m), 0)).collect();
        self.rma_async(conn, true, bufs, &remote, notif)
    }

    /// Offers `[ptr, ptr+len)` of region `mr` (any size) to every peer,
    /// connected now or later, until the region is deregistered.
    pub fn export_range(&self, mr: u64, ptr: u64, len: usize) -> Result<DescEntry> {
        let token = self.inner.registry.advertise(mr, ptr, len, None)?;
        Ok(DescEntry {
            addr: ptr,
            size: len as u64,
            mr_id: mr,
            token,
        })
    }

    /// The address and length of a registered region.
    pub fn region(&self, mr: u64) -> Result<(u64, usize)> {
        let r = self.inner.registry.get(mr)?;
        Ok((r.addr, r.len))
    }

    /// Stops tracking a transfer: it runs to its end on its own (its
    /// buffers stay in use until then; deregistration waits for them).
    pub fn release(&self, xfer: u64) -> Result<()> {
        self.inner
            .transfers
            .lock()
            .remove(&xfer)
            .map(|_| ())
            .ok_or_else(|| Error::invalid(format!("unknown transfer id {xfer}")))
    }

    /// The next connection from a peer if one comes within `timeout`
    /// (zero: only one already pending).
    pub fn try_accept(&self, timeout: Duration) -> Result<Option<Accepted>> {
        let Some(deadline) = crate::timeout::deadline_after(timeout) else {
            // Beyond the clock: no limit.
            return self.accept(None).map(Some);
        };
        let mut q = self.inner.accepted.lock();
        loop {
            if let Some(id) = q.pop_front() {
                drop(q);
                let conn = self.conn(id)?;
                return Ok(Some(Accepted {
                    conn: id,
                    ip: conn.peer.ip(),
                    gpu_index: conn.remote_gpu,
                }));
            }
            if Instant::now() >= deadline
                || self
                    .inner
                    .accepted_cv
                    .wait_until(&mut q, deadline)
                    .timed_out()
                    && q.is_empty()
            {
                return Ok(None);
            }
        }
    }
}

/// One part of a one-sided transfer, as [`Conn::post_rma`] takes it: our
/// runs resolved, the peer's items, each item's region id on the peer.
pub(super) type RmaPart = (crate::pieces::Pieces, Vec<RmaItem>, Vec<u64>);

/// Where a one-sided posting's time went (traced only).
#[derive(Default)]
struct PostSteps {
    /// From the call to every piece checked.
    checked: std::time::Duration,
    /// Making the parts (the peer's items, our buffers resolved).
    made: std::time::Duration,
    /// Posting their requests.
    requests: std::time::Duration,
}

/// Traces where a one-sided posting's time went (with each request's own
/// steps, `lat: request posted`; `benchmarks/rma_timeline.py --posting`
/// reads both): checking every piece, making the parts, their requests.
fn trace_posted(t: &Transfer, pieces: usize, steps: PostSteps) {
    tracing::trace!(
        xfer = t.id,
        pieces,
        checks_us = steps.checked.as_micros() as u64,
        parts_us = steps.made.as_micros() as u64,
        requests_us = steps.requests.as_micros() as u64,
        "lat: rma posted"
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parts_cover_every_item_once_and_none_beyond_the_request_bound() {
        for n in [
            1,
            RMA_PART,
            RMA_PART + 1,
            3 * RMA_PART + 7,
            131_072,
            crate::wire::MAX_RMA_PIECES,
        ] {
            let r = part_ranges(n);
            assert_eq!(r[0].start, 0);
            assert_eq!(r.last().unwrap().end, n);
            assert!(
                r.windows(2).all(|w| w[0].end == w[1].start),
                "{n}: contiguous"
            );
            assert!(
                r.iter().all(|p| !p.is_empty() && p.len() <= RMA_PART),
                "{n}"
            );
            assert_eq!(r.len(), n.div_ceil(RMA_PART), "{n}");
        }
    }
}
