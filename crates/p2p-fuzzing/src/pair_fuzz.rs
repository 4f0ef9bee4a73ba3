//! The connection pair's harness ([`proto_pair`]): two machines wired
//! together in memory ([`crate::pair::Pair`]), driven by a program read
//! from the input: each side posts writes, reads (over the net or inline),
//! sends and receives, cancels and notifies; frames are delivered and
//! messages moved one at a time in the order the input picks; time moves;
//! and a peer may send frames of its own making (answers to requests it
//! never got, acknowledgements of messages never sent, inline data of any
//! length).
//!
//! After each step: no panic, and what each side holds for its peer stays
//! within its limits. At the end: no byte outside what a side advertised
//! or chose as a destination changed, the source memory is untouched; and
//! when no frame was forged, every one-sided transfer has ended, and every
//! transfer that ended well (and whose destination nothing else shares)
//! carries exactly the bytes of its source.

use tcpx_p2p::fuzzing::{Failure, Limits, Set};
use tcpx_p2p_wire::{Control, RmaItem};

use crate::bytes::Bytes;
use crate::pair::{Dir, End, Frame, Pair, Side};

/// Each side's memory: `[0, PEER)` is advertised to the peer (in part),
/// `[PEER, SRC)` takes our reads and receives, `[SRC, MEM)` is the source
/// of what we write and send (never written).
const MEM: usize = 64 << 10;
const PEER: usize = 16 << 10;
const SRC: usize = 32 << 10;
/// The advertisements each side makes for its peer: (offset, length).
const ADVERTS: [(usize, usize); 3] = [(0, 8192), (8192, 100), (12288, 4096)];
/// Limits small enough for short inputs to reach them.
pub const PAIR_LIMITS: Limits = Limits {
    max_requests: 4,
    max_items: 64,
};
/// Steps of one run at most.
const STEPS: usize = 512;
/// Message lengths the program picks from (both sides alike, so that
/// sends and receives often agree).
const LENS: [usize; 6] = [0, 1, 100, 4096, 5000, 9000];

/// What a run saw, for the stable harness's counts.
#[derive(Debug, Default, Clone, Copy)]
pub struct PairSeen {
    pub steps: u64,
    /// Transfers that ended well, failed, and were refused.
    pub done: u64,
    pub failed: u64,
    pub refused: u64,
    /// Runs whose connection failed.
    pub broken: u64,
    /// Transfers whose bytes were compared with their source.
    pub checked: u64,
    /// Of those, writes the target pulled and reads copied from a grant.
    pub checked_pulled: u64,
    /// Reads copied from leases with no request, writes copied into
    /// them, and revokes answered.
    pub leased: u64,
    pub leased_writes: u64,
    pub revoked: u64,
}

/// A transfer the harness posted: who posted it, where its bytes come
/// from and land, to compare at the end.
struct Posted {
    side: Dir,
    id: u64,
    /// (side holding it, offset, length): source and destination.
    src: (Dir, usize),
    dst: (Dir, usize),
    len: usize,
}

fn side(p: &mut Pair, d: Dir) -> &mut Side {
    match d {
        Dir::AtoB => &mut p.a,
        Dir::BtoA => &mut p.b,
    }
}

fn other(d: Dir) -> Dir {
    match d {
        Dir::AtoB => Dir::BtoA,
        Dir::BtoA => Dir::AtoB,
    }
}

/// The peer's connection id as the advertiser sees it.
fn conn_of(d: Dir) -> u64 {
    match d {
        Dir::AtoB => 1,
        Dir::BtoA => 2,
    }
}

/// Advertisements a side made once for its peer, by (peer's connection,
/// advertisement): reads of them again and again are what leases serve.
type Standing = std::collections::HashMap<(u64, usize), RmaItem>;

/// A window into one of the peer's advertisements (sometimes past its end,
/// or with a forged token; often under an advertisement made before,
/// which may be a record leased for writes as it was made).
fn remote_item(
    b: &mut Bytes,
    peer: &mut Side,
    peer_conn: u64,
    standing: &mut Standing,
) -> (RmaItem, usize) {
    let which = b.u8() as usize % ADVERTS.len();
    let (off, len) = ADVERTS[which];
    let at = (b.u16() as usize) % len;
    let n = 1 + (b.u16() as usize) % (len - at);
    let item = match b.u8() % 16 {
        // A window of the advertisement made before for the whole range.
        3..=8 => {
            let record = b.u8() & 1 == 1;
            let whole = *standing.entry((peer_conn, which)).or_insert_with(|| {
                if record {
                    peer.advertise_leased(off, len)
                } else {
                    peer.advertise(off, len, Some(peer_conn))
                }
            });
            RmaItem {
                token: whole.token,
                addr: whole.addr + at as u64,
                len: n as u64,
            }
        }
        // Past the advertisement's end.
        0 => {
            let mut it = peer.advertise(off + at, n, Some(peer_conn));
            it.len += 1 + u64::from(b.u8());
            it
        }
        // A made-up token.
        1 => peer.forged(off + at, n as u64),
        // Made for another connection.
        2 => peer.advertise(off + at, n, Some(99)),
        _ => peer.advertise(off + at, n, Some(peer_conn)),
    };
    (item, off + at)
}

/// A frame a hostile peer makes.
fn forged_frame(b: &mut Bytes) -> Frame {
    let xfer = u64::from(b.u8() % 16);
    let m = match b.u8() % 8 {
        0 => Control::WriteCts { xfer },
        1 => Control::WriteDone { xfer },
        2 => Control::ReadAck { xfer },
        3 => Control::Refused {
            xfer,
            reason: "forged".into(),
        },
        4 => Control::MsgDone {
            count: u64::from(b.u8() % 8),
        },
        5 => Control::ReadData {
            xfer,
            len: u32::from(b.u16()) % 8192,
        },
        6 => Control::KeepAlive,
        _ => Control::Notif {
            name: "x".into(),
            msg: vec![b.u8(); usize::from(b.u8())],
        },
    };
    let mut body = Vec::new();
    m.encode(&mut body);
    // Payload bytes after it: often the right count for inline data, not
    // always.
    let payload = match (&m, b.u8() % 4) {
        (Control::ReadData { len, .. }, 0..=2) => vec![0xEE; *len as usize],
        (_, 3) => vec![0xEE; usize::from(b.u8())],
        _ => Vec::new(),
    };
    Frame { body, payload }
}

/// Runs one input. Panics on any broken invariant (that is the finding).
pub fn proto_pair(data: &[u8]) -> PairSeen {
    let mut seen = PairSeen::default();
    let mut b = Bytes(data);
    // The first byte picks the inline limit and whether writes are pulled
    // (as on the same-host net).
    let mode = b.u8() as usize;
    let mut p = if mode / 3 % 2 == 1 {
        Pair::pulling(MEM, PAIR_LIMITS)
    } else {
        Pair::with_limits(MEM, PAIR_LIMITS)
    };
    let pulling = mode / 3 % 2 == 1;
    let inline = [0, 4096, 1 << 20][mode % 3];
    p.a.inline_max = inline;
    p.b.inline_max = inline;
    for s in [&mut p.a, &mut p.b] {
        for (i, x) in s.mem[SRC..].iter_mut().enumerate() {
            *x = (i as u8).wrapping_mul(13) | 1;
        }
    }
    let src_a = p.a.mem[SRC..].to_vec();
    let src_b = p.b.mem[SRC..].to_vec();
    let mut posted: Vec<Posted> = Vec::new();
    // Where receives land: (side, offset, length).
    let mut received: Vec<(Dir, usize, usize)> = Vec::new();
    // Messages sent and receives posted each way (index 0: a to b): the
    // k-th of each takes the k-th length of the run's sequence, so that
    // they mostly agree; now and then one does not.
    let mut sent = [0usize; 2];
    let mut recvd = [0usize; 2];
    let salt = b.u8() as usize;
    let seq_len = |k: usize| LENS[(k * 7 + salt) % LENS.len()];
    let mut forged = false;
    let mut now = 0u64;
    let mut standing = Standing::new();
    for _ in 0..STEPS {
        if b.done() {
            break;
        }
        seen.steps += 1;
        let op = b.u8();
        let d = if op & 0x80 == 0 { Dir::AtoB } else { Dir::BtoA };
        match op % 12 {
            // One-sided: a write or a read by side `d` of its peer's memory.
            0..=2 => {
                let read = op % 12 == 1;
                let (item, roff) = {
                    let peer = side(&mut p, other(d));
                    remote_item(&mut b, peer, conn_of(other(d)), &mut standing)
                };
                // The caller's lengths match its descriptors (the endpoint
                // checks that); the claim may still be refused by the peer.
                let len = item.len as usize;
                let local = if read {
                    PEER + (b.u16() as usize) % (SRC - PEER - len)
                } else {
                    SRC + (b.u16() as usize) % (MEM - SRC - len)
                };
                if let Some(id) = side(&mut p, d).rma(read, &[(local, len)], vec![item]) {
                    // The destination of a read is ours, of a write the peer's.
                    let (src, dst) = if read {
                        ((other(d), roff), (d, local))
                    } else {
                        ((d, local), (other(d), roff))
                    };
                    posted.push(Posted {
                        side: d,
                        id,
                        src,
                        dst,
                        len,
                    });
                }
            }
            // Two-sided: `d` sends, or its peer posts a receive.
            3 => {
                let pick = b.u8();
                let k = &mut sent[d as usize];
                let len = if pick % 32 == 0 {
                    LENS[pick as usize / 32 % LENS.len()]
                } else {
                    seq_len(*k)
                };
                *k += 1;
                let at = SRC + (b.u16() as usize) % (MEM - SRC - len);
                let _ = side(&mut p, d).send(&[(at, len)]);
            }
            4 => {
                let pick = b.u8();
                let k = &mut recvd[d as usize];
                let len = if pick % 32 == 0 {
                    LENS[pick as usize / 32 % LENS.len()]
                } else {
                    seq_len(*k)
                };
                *k += 1;
                let at = PEER + (b.u16() as usize) % (SRC - PEER - len);
                if side(&mut p, other(d)).recv(&[(at, len)]).is_some() {
                    received.push((other(d), at, len));
                }
            }
            // A control frame delivered, or a message moved.
            5 | 6 => {
                p.deliver(d);
            }
            7 => match b.u8() % 4 {
                0 => {
                    p.move_one(d, Set::Msg);
                }
                1 => {
                    p.move_one(d, Set::Rma);
                }
                2 => {
                    p.pull_one(d);
                }
                _ => {
                    p.push_one(d);
                }
            },
            8 => {
                let id = u64::from(b.u8() % 32);
                side(&mut p, d).cancel(id);
            }
            9 => side(&mut p, d).notify("n", &[b.u8(); 3]),
            10 => {
                now += u64::from(b.u8());
                side(&mut p, d).tick(now, 1000, 10_000);
            }
            _ => match b.u8() % 64 {
                0 => {
                    forged = true;
                    let f = forged_frame(&mut b);
                    p.inject(d, f);
                }
                // `d` deregisters: the leases of its memory are revoked.
                1..=4 => side(&mut p, d).revoke_leases(),
                _ => {
                    p.settle();
                }
            },
        }
        for s in [&p.a, &p.b] {
            let (_, requests, pieces) = s.proto.held();
            assert!(
                requests <= PAIR_LIMITS.max_requests,
                "{requests} requests held"
            );
            assert!(pieces <= PAIR_LIMITS.max_items, "{pieces} pieces held");
        }
    }
    p.settle();
    // The sources were never written; nothing outside what was advertised
    // or chosen as a destination changed.
    assert!(p.a.mem[SRC..] == src_a[..], "a's source memory changed");
    assert!(p.b.mem[SRC..] == src_b[..], "b's source memory changed");
    for s in [&p.a, &p.b] {
        for (i, &x) in s.mem[..PEER].iter().enumerate() {
            let advertised = ADVERTS.iter().any(|&(o, l)| (o..o + l).contains(&i));
            assert!(
                advertised || x == 0,
                "{}: byte {i} changed, never advertised",
                s.name
            );
        }
    }
    let broken = p.a.failed.is_some() || p.b.failed.is_some();
    seen.broken += u64::from(broken);
    seen.leased += p.a.leased_reads + p.b.leased_reads;
    seen.leased_writes += p.a.leased_writes + p.b.leased_writes;
    seen.revoked += p.a.revokes_answered + p.b.revokes_answered;
    for s in [&p.a, &p.b] {
        for x in s.xfers.values() {
            match &x.end {
                End::Done => seen.done += 1,
                End::Failed(Failure::Refused(_)) => seen.refused += 1,
                End::Failed(_) => seen.failed += 1,
                End::Pending => {}
            }
        }
    }
    if forged {
        return seen;
    }
    for (i, t) in posted.iter().enumerate() {
        let end = match t.side {
            Dir::AtoB => p.a.end_of(t.id),
            Dir::BtoA => p.b.end_of(t.id),
        };
        if !broken {
            assert!(end != End::Pending, "a one-sided transfer never ended");
        }
        if end != End::Done {
            continue;
        }
        // Compared only where no other transfer lands in the same bytes,
        // or in the bytes this one reads.
        let overlaps = |a: (Dir, usize), b: (Dir, usize), n: usize| {
            a.0 == b.0 && a.1 < b.1 + n && b.1 < a.1 + t.len
        };
        let shared = posted
            .iter()
            .enumerate()
            .filter(|&(j, _)| j != i)
            .map(|(_, u)| (u.dst, u.len))
            .chain(received.iter().map(|&(d, at, n)| ((d, at), n)))
            .any(|(dst, n)| overlaps(t.dst, dst, n) || overlaps(t.src, dst, n));
        if shared {
            continue;
        }
        let mem = |d: Dir| match d {
            Dir::AtoB => &p.a.mem,
            Dir::BtoA => &p.b.mem,
        };
        let got = &mem(t.dst.0)[t.dst.1..t.dst.1 + t.len];
        let want = &mem(t.src.0)[t.src.1..t.src.1 + t.len];
        assert!(
            got == want,
            "a finished transfer's {} bytes at {:?} differ from its source at {:?} (inline up to {inline})",
            t.len,
            t.dst,
            t.src
        );
        seen.checked += 1;
        seen.checked_pulled += u64::from(pulling);
    }
    seen
}
