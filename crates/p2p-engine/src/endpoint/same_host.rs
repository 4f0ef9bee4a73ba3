//! Same-host calls on the endpoint: `connect_local` / `accept_local`
//! (see `crate::local`) and the `*_ipc` calls, which run as ordinary
//! transfers on any connection of the same-host net.

use super::*;
use crate::transfer::Watch;

impl Endpoint {
    /// The connection `id` the `*_ipc` calls run on: one whose data rides
    /// the same-host net (made by `connect_local` / `accept_local`, or by
    /// `connect` / `accept` between endpoints of this machine with
    /// TCPX_P2P_SAME_HOST_NET=1).
    fn ipc_conn(&self, id: u64) -> Result<Arc<Conn>> {
        let c = self.conn(id)?;
        if c.net != crate::net::same_host::NET {
            return Err(Error::invalid(format!(
                "connection {id} is not a same-host connection (made by connect_local/accept_local, \
                 or by connect/accept between endpoints of this machine with TCPX_P2P_SAME_HOST_NET=1)"
            )));
        }
        Ok(c)
    }

    /// Registers `bufs` (memory the `*_ipc` calls take unregistered) for
    /// one call: the buffers, and the regions to forget once the call's
    /// requests are posted (its transfer holds them until it ends).
    fn for_call(&self, bufs: &[(u64, usize)]) -> Result<(Vec<Buf>, Vec<u64>)> {
        let mut out = Vec::with_capacity(bufs.len());
        let mut ids = Vec::with_capacity(bufs.len());
        for &(ptr, len) in bufs {
            match self.inner.registry.register(ptr, len) {
                Ok(r) => {
                    ids.push(r.id);
                    out.push(Buf { mr: r.id, ptr, len });
                }
                Err(e) => {
                    self.forget_all(ids);
                    return Err(e);
                }
            }
        }
        Ok((out, ids))
    }

    fn forget_all(&self, ids: Vec<u64>) {
        for id in ids {
            self.inner.registry.forget(id);
        }
    }

    /// The call's registrations `ids` once its transfer (`posted`) is on
    /// its way: out of our records now (the transfer holds its regions),
    /// and out of the connection's comms once it has ended.
    fn forget_after(&self, conn: u64, posted: &Result<u64>, ids: Vec<u64>) {
        if let Ok(x) = posted {
            let t = self.inner.transfers.lock().get(x).cloned();
            if let (Some(t), Ok(c)) = (t, self.conn(conn)) {
                c.watch(
                    &t,
                    Watch::Forget {
                        regions: ids.clone(),
                    },
                );
            }
        }
        self.forget_all(ids);
    }

    /// A `*_ipc` write or read on a connection of the same-host net: the
    /// descriptors are `advertise_ipc`'s of that connection, our buffers
    /// registered for the call.
    fn ipc_rma(
        &self,
        conn: u64,
        read: bool,
        bufs: &[(u64, usize)],
        infos: &[&[u8]],
    ) -> Result<u64> {
        self.ipc_conn(conn)?;
        if bufs.len() != infos.len() {
            return Err(Error::invalid(format!(
                "{} buffers but {} descriptors",
                bufs.len(),
                infos.len()
            )));
        }
        let metas = infos
            .iter()
            .enumerate()
            .map(|(i, d)| {
                FifoItem::decode(d).map_err(|e| {
                    Error::invalid(format!(
                        "descriptor {i} is not one advertise_ipc gave on a connection of the same-host net: {e}"
                    ))
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let (ours, ids) = self.for_call(bufs)?;
        let r = self.fifo_rma(conn, read, &ours, &metas);
        self.forget_after(conn, &r, ids);
        r
    }

    /// A `send_ipc` / `recv_ipc` on a connection of the same-host net.
    fn ipc_msg(&self, conn: u64, send: bool, ptr: u64, len: usize) -> Result<u64> {
        self.ipc_conn(conn)?;
        let (ours, ids) = self.for_call(&[(ptr, len)])?;
        let r = if send {
            self.send_async(conn, &ours)
        } else {
            self.recv_async(conn, &ours)
        };
        self.forget_after(conn, &r, ids);
        r
    }

    /// Connects to an endpoint of this host (see [`LocalPeer`]): a
    /// connection whose control connection is a Unix stream and whose data
    /// rides the same-host net.
    pub fn connect_local(&self, peer: &LocalPeer) -> Result<u64> {
        self.inner.local.connect(peer)
    }

    /// Waits for the next same-host connection (None: forever).
    pub fn accept_local(&self, timeout: Option<Duration>) -> Result<AcceptedLocal> {
        self.inner.local.accept(timeout)
    }

    /// An opaque descriptor offering `[ptr, ptr+len)` (host or GPU memory,
    /// registered or not) to the peer of local connection `conn`, for as
    /// long as the connection lives.
    pub fn advertise_ipc(&self, conn: u64, ptr: u64, len: usize) -> Result<Vec<u8>> {
        let c = self.ipc_conn(conn)?;
        // A registration of its own, kept as long as the connection, and
        // leased to the peer at once, for reads and writes.
        let r = self.inner.registry.register(ptr, len)?;
        let d = c
            .keep_ipc_region(r.id)
            .and_then(|()| self.advertise_item(Some(conn), r.id, ptr, len));
        match d {
            Ok(item) => {
                c.lease_ipc(item.token);
                Ok(item.to_bytes().to_vec())
            }
            Err(e) => {
                self.inner.registry.forget(r.id);
                Err(e)
            }
        }
    }

    /// One-sided write of local buffers `(ptr, len)` (unregistered) into the
    /// ranges the peer advertised with `advertise_ipc`; returns a transfer id.
    pub fn write_ipc_async(
        &self,
        conn: u64,
        bufs: &[(u64, usize)],
        infos: &[&[u8]],
    ) -> Result<u64> {
        self.ipc_rma(conn, false, bufs, infos)
    }

    /// One-sided read from the peer's `advertise_ipc` ranges; a transfer id.
    pub fn read_ipc_async(&self, conn: u64, bufs: &[(u64, usize)], infos: &[&[u8]]) -> Result<u64> {
        self.ipc_rma(conn, true, bufs, infos)
    }

    /// Blocking [`Endpoint::write_ipc_async`]: a write into a record the
    /// peer leased is one copy, on the calling thread when the connection's
    /// engine is free.
    pub fn write_ipc(&self, conn: u64, bufs: &[(u64, usize)], infos: &[&[u8]]) -> Result<()> {
        self.wait_transfer(self.write_ipc_async(conn, bufs, infos)?)
    }

    /// Blocking [`Endpoint::read_ipc_async`].
    pub fn read_ipc(&self, conn: u64, bufs: &[(u64, usize)], infos: &[&[u8]]) -> Result<()> {
        self.wait_transfer(self.read_ipc_async(conn, bufs, infos)?)
    }

    /// Two-sided send of `[ptr, ptr+len)` (unregistered) on a same-host
    /// connection, matched with the peer's receives in posting order.
    pub fn send_ipc_async(&self, conn: u64, ptr: u64, len: usize) -> Result<u64> {
        self.ipc_msg(conn, true, ptr, len)
    }

    /// Two-sided receive into `[ptr, ptr+len)` (unregistered).
    pub fn recv_ipc_async(&self, conn: u64, ptr: u64, len: usize) -> Result<u64> {
        self.ipc_msg(conn, false, ptr, len)
    }
}
