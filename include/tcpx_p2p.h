/*
 * tcpx_p2p.h: the C API of the tcpx-p2p transfer engine (libtcpx_p2p.so).
 *
 * One endpoint owns a control listener, a net (multi-stream TCP sockets, or
 * an ncclNet plugin such as GPUDirect-TCPX), a memory registry and its
 * connections. Peers connect to each other by metadata (an opaque byte
 * string one side hands the other out of band), register memory (host or
 * CUDA), hand out 64-byte remote descriptors of the ranges a peer may touch,
 * and move bytes one-sided (write into / read from a peer's descriptor) or
 * two-sided (send matched by the peer's recv, in posting order).
 *
 * Conventions
 *  - Every function returns a tcpx_status_t (0 = success) unless it says
 *    otherwise. On a failure the reason is kept for the calling thread:
 *    tcpx_last_error() returns it.
 *  - Handles (tcpx_config_t, tcpx_endpoint_t, tcpx_notifs_t) are opaque;
 *    each has one function that frees it. Ids (connections, memory
 *    registrations, transfers) are uint64_t values handed out by the
 *    endpoint.
 *  - Every pointer argument is checked: NULL where an object is required
 *    gives TCPX_ERR_INVALID_ARGUMENT, never a crash. Output arguments are
 *    written only on success.
 *  - No call lets a Rust panic cross into C: one that panics returns
 *    TCPX_ERR_PANIC (and the endpoint should then be destroyed).
 *  - Timeouts are in milliseconds; a negative timeout waits without limit,
 *    and so does one of more than 10^12 ms (about 31 years).
 *
 * Threading
 *  - Every function on one endpoint may be called from any thread and from
 *    many threads at once, except tcpx_endpoint_destroy, which must not run
 *    beside another call on the same endpoint.
 *  - A tcpx_config_t is not shared between threads while it is being set.
 *  - The last error is per thread.
 *
 * Memory
 *  - Memory given to tcpx_reg must stay valid until tcpx_dereg returns.
 *  - A buffer of a posted transfer must stay untouched (sender) / unread
 *    (receiver) until the transfer has ended (tcpx_poll or tcpx_wait
 *    returned something other than TCPX_AGAIN / TCPX_ERR_TIMEOUT).
 */
#ifndef TCPX_P2P_H
#define TCPX_P2P_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Bytes of a remote descriptor (tcpx_advertise, tcpx_export). */
#define TCPX_DESC_LEN 64
/* Most bytes of an endpoint's metadata (IPv6, 255-byte GPU bus id). */
#define TCPX_METADATA_MAX 274
/* Most bytes of one notification's message; longer ones are refused with
 * TCPX_ERR_INVALID_ARGUMENT. */
#define TCPX_NOTIF_MAX (1024 * 1024)
/* Most bytes of an endpoint name (the sender name notifications carry). */
#define TCPX_NAME_MAX 256
/* Most pieces of one vector transfer. */
#define TCPX_IOV_MAX 16777216
/* Bytes of tcpx_accepted_t.ip, NUL included. */
#define TCPX_IP_LEN 64

/*
 * Status codes. Non-negative values are not failures: TCPX_OK, and
 * TCPX_AGAIN for "not yet" (a transfer still running, no pending peer).
 */
typedef enum tcpx_status {
    /* Success. */
    TCPX_OK = 0,
    /* Not yet: the transfer is still running (tcpx_poll) or no peer is
     * waiting to be accepted (tcpx_try_accept). Try again later. */
    TCPX_AGAIN = 1,
    /* The caller's mistake: a NULL or bad pointer, a size out of range, a
     * buffer outside its registration, a message over TCPX_NOTIF_MAX. */
    TCPX_ERR_INVALID_ARGUMENT = -1,
    /* A connection, registration or transfer id this endpoint does not know
     * (never handed out, disconnected or deregistered here, or a transfer
     * already reported done or failed). */
    TCPX_ERR_UNKNOWN_ID = -2,
    /* Malformed bytes given by the caller (metadata, remote descriptor). */
    TCPX_ERR_MALFORMED = -3,
    /* A connection could not be made (nobody listening, handshake refused,
     * authentication token mismatch, timeout). */
    TCPX_ERR_CONNECT = -4,
    /* The peer refused the request (e.g. a range it never advertised);
     * nothing was written. */
    TCPX_ERR_REFUSED = -5,
    /* The connection is gone: the peer closed, crashed or went silent past
     * the deadline (its id keeps giving this). */
    TCPX_ERR_CONNECTION_LOST = -6,
    /* The transport (socket net or ncclNet plugin) failed. */
    TCPX_ERR_NET = -7,
    /* The local CUDA driver failed, or CUDA is missing where needed. */
    TCPX_ERR_CUDA = -8,
    /* A local operating-system call failed (bind, spawn, ...). */
    TCPX_ERR_IO = -9,
    /* A bad setting: an unknown key or a value out of range. */
    TCPX_ERR_CONFIG = -10,
    /* A blocking call's timeout passed. After tcpx_wait the transfer is
     * still running and its id still valid. */
    TCPX_ERR_TIMEOUT = -11,
    /* An output buffer is too small; the size needed was written to the
     * length argument. */
    TCPX_ERR_BUFFER_TOO_SMALL = -12,
    /* A bug: a panic was caught at the API boundary. */
    TCPX_ERR_PANIC = -13,
    /* Any other engine failure (see tcpx_last_error). */
    TCPX_ERR_INTERNAL = -14,
    /* The transfer was cancelled (tcpx_cancel) before its data moved. */
    TCPX_ERR_CANCELLED = -15
} tcpx_status_t;

/* Opaque handles. */
typedef struct tcpx_config tcpx_config_t;
typedef struct tcpx_endpoint tcpx_endpoint_t;
typedef struct tcpx_notifs tcpx_notifs_t;

/* A local buffer: len bytes at ptr inside registration mr. */
typedef struct tcpx_buf {
    uint64_t mr;
    void *ptr;
    size_t len;
} tcpx_buf_t;

/* One piece of a one-sided transfer: len bytes at ptr inside local
 * registration mr, to or from the range starting remote_offset bytes into
 * what the remote descriptor desc (TCPX_DESC_LEN bytes, from the peer's
 * tcpx_advertise or tcpx_export) names. desc is only read during the call. */
typedef struct tcpx_rma_iov {
    uint64_t mr;
    void *ptr;
    size_t len;
    const uint8_t *desc;
    uint64_t remote_offset;
} tcpx_rma_iov_t;

/* A connection accepted from a peer. */
typedef struct tcpx_accepted {
    uint64_t conn;
    /* The peer's GPU index (-1: none). */
    int32_t remote_gpu;
    /* The peer's IP address, NUL-terminated. */
    char ip[TCPX_IP_LEN];
} tcpx_accepted_t;

/* A view of one received notification. The pointers stay valid until the
 * tcpx_notifs_t it came from is freed; name and msg are not NUL-terminated. */
typedef struct tcpx_notif {
    /* The connection it arrived on. */
    uint64_t conn;
    /* The sender's endpoint name (as the sender configured it). */
    const char *name;
    size_t name_len;
    const uint8_t *msg;
    size_t msg_len;
} tcpx_notif_t;

/* ------------------------------------------------------------ library */

/* The library's version, e.g. "0.1.0" (static string). */
const char *tcpx_version(void);

/* A short static description of a status code ("invalid argument", ...). */
const char *tcpx_status_str(tcpx_status_t status);

/* The calling thread's last failure, NUL-terminated; "" if none. The
 * pointer is valid until the next tcpx_ call on this thread. */
const char *tcpx_last_error(void);

/* ------------------------------------------------------------- config */

/* A new configuration holding the engine's defaults overridden by the
 * TCPX_P2P_* environment variables (README). Fails with TCPX_ERR_CONFIG on
 * a bad environment variable. */
tcpx_status_t tcpx_config_new(tcpx_config_t **out);

/* Sets one key (both strings NUL-terminated). Keys:
 *   "net"                 "socket" or "plugin" (channels and chunk take
 *                         that net's defaults unless set by key or by
 *                         environment variable)
 *   "plugin_path"         ncclNet plugin path (net=plugin)
 *   "streams"             TCP streams per socket-net comm (1..64)
 *   "channels"            channels per connection (1..32)
 *   "chunk"               request size posted to the net ("8M", 4K..1G)
 *   "interface"           interface to advertise and listen on ("ifname" too)
 *   "port"                control listener port (0: any)
 *   "auth_token"          shared secret peers must present ("" = none)
 *   "gpu"                 GPU index of the endpoint (-1: none, host only)
 *   "name"                endpoint name sent with notifications
 *                         (default: hostname:port), at most TCPX_NAME_MAX
 *   "deadline_ms"         silence after which a connection fails
 *   "keepalive_ms"        keep-alive interval
 *   "connect_timeout_ms"  connect + handshake deadline
 * An unknown key or bad value gives TCPX_ERR_CONFIG. */
tcpx_status_t tcpx_config_set(tcpx_config_t *cfg, const char *key, const char *value);

/* Frees a configuration (NULL: nothing). */
void tcpx_config_free(tcpx_config_t *cfg);

/* ----------------------------------------------------------- endpoint */

/* Creates an endpoint from cfg (cfg is copied and may be freed after).
 * Its listener is up when this returns: peers may connect at once, and
 * connections are accepted in the background. */
tcpx_status_t tcpx_endpoint_create(const tcpx_config_t *cfg, tcpx_endpoint_t **out);

/* Closes every connection (transfers in flight fail), stops the endpoint's
 * threads and frees it (NULL: nothing). */
void tcpx_endpoint_destroy(tcpx_endpoint_t *ep);

/* The endpoint's metadata (what a peer passes to tcpx_connect_metadata):
 * at most TCPX_METADATA_MAX bytes. *len: in, the capacity of buf; out, the
 * bytes written (or needed, with TCPX_ERR_BUFFER_TOO_SMALL). */
tcpx_status_t tcpx_endpoint_metadata(const tcpx_endpoint_t *ep, uint8_t *buf, size_t *len);

/* The endpoint's name, NUL-terminated into buf of cap bytes. */
tcpx_status_t tcpx_endpoint_name(const tcpx_endpoint_t *ep, char *buf, size_t cap);

/* The control listener's port. */
tcpx_status_t tcpx_endpoint_port(const tcpx_endpoint_t *ep, uint16_t *port);

/* --------------------------------------------------------- connections */

/* Connects to the endpoint whose metadata this is (blocking, within the
 * configured connect timeout). A second call with the same metadata while
 * the connection is up returns the same id. */
tcpx_status_t tcpx_connect_metadata(tcpx_endpoint_t *ep, const uint8_t *metadata, size_t len,
                                    uint64_t *conn);

/* Connects to the endpoint listening at ip:port (ip NUL-terminated). */
tcpx_status_t tcpx_connect(tcpx_endpoint_t *ep, const char *ip, uint16_t port, uint64_t *conn);

/* Waits up to timeout_ms for the next peer that connected to us.
 * TCPX_ERR_TIMEOUT when none came in time. */
tcpx_status_t tcpx_accept(tcpx_endpoint_t *ep, int64_t timeout_ms, tcpx_accepted_t *out);

/* Takes the next peer that connected to us without waiting: TCPX_OK, or
 * TCPX_AGAIN when none is pending. */
tcpx_status_t tcpx_try_accept(tcpx_endpoint_t *ep, tcpx_accepted_t *out);

/* Closes a connection: what is in flight on it fails. */
tcpx_status_t tcpx_disconnect(tcpx_endpoint_t *ep, uint64_t conn);

/* -------------------------------------------------------------- memory */

/* Registers len bytes at ptr (host memory, or CUDA device memory found by
 * asking CUDA about the pointer). */
tcpx_status_t tcpx_reg(tcpx_endpoint_t *ep, void *ptr, size_t len, uint64_t *mr);

/* Deregisters: its descriptors stop working at once; waits (up to 10 s)
 * for transfers still using it. */
tcpx_status_t tcpx_dereg(tcpx_endpoint_t *ep, uint64_t mr);

/* A remote descriptor (TCPX_DESC_LEN bytes into desc_out) offering
 * [ptr, ptr+len) of registration mr to the peer of conn only; len must be
 * below 4 GiB. The peer may read and write exactly that range. */
tcpx_status_t tcpx_advertise(tcpx_endpoint_t *ep, uint64_t conn, uint64_t mr, void *ptr,
                             size_t len, uint8_t *desc_out);

/* n descriptors, one per buffer, into desc_out (n * TCPX_DESC_LEN bytes). */
tcpx_status_t tcpx_advertisev(tcpx_endpoint_t *ep, uint64_t conn, const tcpx_buf_t *bufs,
                              size_t n, uint8_t *desc_out);

/* A remote descriptor of the whole registration mr (any size), usable by
 * every peer connected now or later, until mr is deregistered. */
tcpx_status_t tcpx_export(tcpx_endpoint_t *ep, uint64_t mr, uint8_t *desc_out);

/* The address and length of the range a remote descriptor names. */
tcpx_status_t tcpx_desc_info(const uint8_t *desc, uint64_t *addr, uint64_t *len);

/* ------------------------------------------------------------ transfers */
/* Each posts at once and returns its transfer id in *xfer; tcpx_poll or
 * tcpx_wait reports its end. notif (notif_len bytes, at most
 * TCPX_NOTIF_MAX; NULL for none) is a notification sent once the transfer
 * has ended well: after a write, to the destination once every byte has
 * landed there; after a read, to the data's owner once every byte has
 * landed here. A failed transfer sends no notification. */

/* One-sided write of len bytes at ptr (registration mr) to remote_offset
 * bytes into the range desc names. */
tcpx_status_t tcpx_write_async(tcpx_endpoint_t *ep, uint64_t conn, uint64_t mr, void *ptr,
                               size_t len, const uint8_t *desc, uint64_t remote_offset,
                               const void *notif, size_t notif_len, uint64_t *xfer);

/* One-sided read into len bytes at ptr from remote_offset bytes into the
 * range desc names. */
tcpx_status_t tcpx_read_async(tcpx_endpoint_t *ep, uint64_t conn, uint64_t mr, void *ptr,
                              size_t len, const uint8_t *desc, uint64_t remote_offset,
                              const void *notif, size_t notif_len, uint64_t *xfer);

/* Vector forms: n pieces (1 <= n <= TCPX_IOV_MAX), one transfer id, one
 * notification after all of them. */
tcpx_status_t tcpx_writev_async(tcpx_endpoint_t *ep, uint64_t conn, const tcpx_rma_iov_t *iov,
                                size_t n, const void *notif, size_t notif_len, uint64_t *xfer);
tcpx_status_t tcpx_readv_async(tcpx_endpoint_t *ep, uint64_t conn, const tcpx_rma_iov_t *iov,
                               size_t n, const void *notif, size_t notif_len, uint64_t *xfer);

/* Two-sided: n buffers sent as n messages, matched in posting order by the
 * peer's tcpx_recv_async of the same sizes. A send completes once its bytes
 * are out of the caller's buffers; the receiver acknowledges each message,
 * and closing the connection or the endpoint first waits (up to the
 * liveness deadline) for those acknowledgements. A receive's size is a
 * capacity, clamped to what is registered from its pointer. */
tcpx_status_t tcpx_send_async(tcpx_endpoint_t *ep, uint64_t conn, const tcpx_buf_t *bufs,
                              size_t n, uint64_t *xfer);
tcpx_status_t tcpx_recv_async(tcpx_endpoint_t *ep, uint64_t conn, const tcpx_buf_t *bufs,
                              size_t n, uint64_t *xfer);

/* TCPX_OK once the transfer is done (its id is then forgotten), TCPX_AGAIN
 * while it runs, or the failure (its id is then forgotten too). */
tcpx_status_t tcpx_poll(tcpx_endpoint_t *ep, uint64_t xfer);

/* Waits up to timeout_ms for the transfer to end: TCPX_OK, its failure, or
 * TCPX_ERR_TIMEOUT (still running; the id stays valid). */
tcpx_status_t tcpx_wait(tcpx_endpoint_t *ep, uint64_t xfer, int64_t timeout_ms);

/* Forgets a transfer without waiting for it: it runs to its end (or fails
 * with its connection) on its own; its buffers must stay valid until then
 * (tcpx_dereg waits for it). Use it to give up on a transfer. */
tcpx_status_t tcpx_release(tcpx_endpoint_t *ep, uint64_t xfer);

/* Gives a transfer up and waits up to timeout_ms (negative: no limit) for
 * it to end. If none of its data has moved (a write the peer has not
 * cleared yet, a small read not yet answered) it is called back at once;
 * data already in flight cannot be, and runs to its end. TCPX_OK: it has
 * ended, cancelled or not; no byte of it touches its buffers any more and
 * its id is forgotten. TCPX_ERR_TIMEOUT: still moving data (the id stays
 * valid). The connection and its other transfers go on. */
tcpx_status_t tcpx_cancel(tcpx_endpoint_t *ep, uint64_t xfer, int64_t timeout_ms);

/* -------------------------------------------------------- notifications */

/* Sends a notification of len bytes (at most TCPX_NOTIF_MAX) to the peer
 * of conn, carrying this endpoint's name. */
tcpx_status_t tcpx_send_notif(tcpx_endpoint_t *ep, uint64_t conn, const void *msg, size_t len);

/* Takes every notification received so far (oldest first) into a list
 * (possibly empty) that the caller frees with tcpx_notifs_free. The
 * endpoint queues at most 65,536 notifications or 64 MiB of messages; a
 * peer whose notification would go past that has its connection failed. */
tcpx_status_t tcpx_get_notifs(tcpx_endpoint_t *ep, tcpx_notifs_t **out);

/* The number of notifications in a list (0 for NULL). */
size_t tcpx_notifs_count(const tcpx_notifs_t *list);

/* A view of notification i of a list (valid until the list is freed). */
tcpx_status_t tcpx_notifs_at(const tcpx_notifs_t *list, size_t i, tcpx_notif_t *out);

/* Frees a list (NULL: nothing). */
void tcpx_notifs_free(tcpx_notifs_t *list);

#ifdef __cplusplus
}
#endif

#endif /* TCPX_P2P_H */
