/*
 * The C API end to end: two processes (fork) on 127.0.0.1, host memory,
 * metadata and descriptors passed through pipes. Process A writes, reads,
 * sends and notifies; process B is the target and checks what landed.
 * Every transfer's bytes are checked (FNV-1a checksums and memcmp), and bad
 * arguments must give their status codes.
 *
 *   capi_test            run the test (exit 0: passed)
 *   capi_test --layout   print the header's constants and struct layouts
 */
#include <errno.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "tcpx_p2p.h"

static const char *who = "?";

#define FAIL(...)                                              \
    do {                                                       \
        fprintf(stderr, "[%s] %s:%d: ", who, __FILE__, __LINE__); \
        fprintf(stderr, __VA_ARGS__);                          \
        fprintf(stderr, "\n");                                 \
        exit(1);                                               \
    } while (0)

/* A call that must succeed. */
#define OK(call)                                                                \
    do {                                                                        \
        tcpx_status_t s_ = (call);                                              \
        if (s_ != TCPX_OK)                                                      \
            FAIL("%s -> %d (%s): %s", #call, (int)s_, tcpx_status_str(s_),      \
                 tcpx_last_error());                                            \
    } while (0)

/* A call that must return `want`. */
#define EXPECT(want, call)                                                      \
    do {                                                                        \
        tcpx_status_t s_ = (call);                                              \
        if (s_ != (want))                                                       \
            FAIL("%s -> %d (%s), wanted %s (%d); last error: %s", #call,        \
                 (int)s_, tcpx_status_str(s_), #want, (int)(want),              \
                 tcpx_last_error());                                            \
    } while (0)

#define CHECK(cond)                                 \
    do {                                            \
        if (!(cond))                                \
            FAIL("check failed: %s", #cond);        \
    } while (0)

#define MiB (1024u * 1024u)

/* ------------------------------------------------------------ helpers */

static uint64_t fnv1a(const uint8_t *p, size_t n) {
    uint64_t h = 0xcbf29ce484222325ull;
    for (size_t i = 0; i < n; i++) {
        h ^= p[i];
        h *= 0x100000001b3ull;
    }
    return h;
}

/* Deterministic bytes, different per seed; `off` is where in the stream
 * the first byte sits (so that both sides can rebuild any range). */
static void pattern(uint8_t *p, size_t n, size_t off, uint8_t seed) {
    for (size_t i = 0; i < n; i++)
        p[i] = (uint8_t)(((uint32_t)(off + i) * 2654435761u) >> 13) ^ seed;
}

/* The range holds the pattern: checksum and bytes. */
static void expect_pattern(const uint8_t *p, size_t n, size_t off, uint8_t seed, const char *what) {
    uint8_t *want = malloc(n ? n : 1);
    CHECK(want != NULL);
    pattern(want, n, off, seed);
    if (fnv1a(p, n) != fnv1a(want, n) || memcmp(p, want, n) != 0)
        FAIL("%s: bytes differ (checksum %016llx, wanted %016llx)", what,
             (unsigned long long)fnv1a(p, n), (unsigned long long)fnv1a(want, n));
    free(want);
}

static void put(int fd, const void *p, uint32_t n) {
    const uint8_t *b = (const uint8_t *)&n;
    for (size_t done = 0; done < 4;) {
        ssize_t k = write(fd, b + done, 4 - done);
        if (k <= 0) FAIL("pipe write");
        done += (size_t)k;
    }
    for (size_t done = 0; done < n;) {
        ssize_t k = write(fd, (const uint8_t *)p + done, n - done);
        if (k <= 0) FAIL("pipe write");
        done += (size_t)k;
    }
}

/* Reads one message into buf (cap bytes); returns its length. */
static uint32_t get(int fd, void *buf, uint32_t cap) {
    uint32_t n = 0;
    for (size_t done = 0; done < 4;) {
        ssize_t k = read(fd, (uint8_t *)&n + done, 4 - done);
        if (k <= 0) FAIL("pipe read (peer gone?)");
        done += (size_t)k;
    }
    if (n > cap) FAIL("pipe message of %u bytes > %u", n, cap);
    for (size_t done = 0; done < n;) {
        ssize_t k = read(fd, (uint8_t *)buf + done, n - done);
        if (k <= 0) FAIL("pipe read");
        done += (size_t)k;
    }
    return n;
}

static void sleep_ms(long ms) {
    struct timespec t = {ms / 1000, (ms % 1000) * 1000000L};
    nanosleep(&t, NULL);
}

static tcpx_endpoint_t *make_endpoint(const char *name) {
    tcpx_config_t *cfg = NULL;
    OK(tcpx_config_new(&cfg));
    OK(tcpx_config_set(cfg, "interface", "lo"));
    OK(tcpx_config_set(cfg, "net", "socket"));
    OK(tcpx_config_set(cfg, "streams", "2"));
    OK(tcpx_config_set(cfg, "chunk", "256K"));
    OK(tcpx_config_set(cfg, "gpu", "-1"));
    OK(tcpx_config_set(cfg, "name", name));
    EXPECT(TCPX_ERR_CONFIG, tcpx_config_set(cfg, "colour", "blue"));
    EXPECT(TCPX_ERR_CONFIG, tcpx_config_set(cfg, "streams", "0"));
    EXPECT(TCPX_ERR_INVALID_ARGUMENT, tcpx_config_set(cfg, NULL, "1"));
    tcpx_endpoint_t *ep = NULL;
    OK(tcpx_endpoint_create(cfg, &ep));
    tcpx_config_free(cfg);
    CHECK(ep != NULL);
    char got[TCPX_NAME_MAX + 1];
    OK(tcpx_endpoint_name(ep, got, sizeof got));
    CHECK(strcmp(got, name) == 0);
    return ep;
}

/* Waits (up to 20 s) for the next notification; copies its message into
 * msg (cap bytes) and its sender's name into name; returns the length. */
static size_t next_notif(tcpx_endpoint_t *ep, uint64_t *conn, char *name, uint8_t *msg, size_t cap) {
    static tcpx_notifs_t *list = NULL;
    static size_t at = 0;
    for (int tries = 0; tries < 20000; tries++) {
        if (list != NULL && at < tcpx_notifs_count(list)) {
            tcpx_notif_t n;
            OK(tcpx_notifs_at(list, at++, &n));
            CHECK(n.msg_len <= cap && n.name_len <= TCPX_NAME_MAX);
            memcpy(msg, n.msg, n.msg_len);
            memcpy(name, n.name, n.name_len);
            name[n.name_len] = 0;
            *conn = n.conn;
            return n.msg_len;
        }
        tcpx_notifs_free(list);
        list = NULL;
        at = 0;
        OK(tcpx_get_notifs(ep, &list));
        if (tcpx_notifs_count(list) == 0) sleep_ms(1);
    }
    FAIL("no notification within 20 s");
}

/* The next notification must be `want` from `from` on `conn`. */
static void expect_notif(tcpx_endpoint_t *ep, uint64_t conn, const char *from, const char *want) {
    static uint8_t msg[256];
    char name[TCPX_NAME_MAX + 1];
    uint64_t c = 0;
    size_t n = next_notif(ep, &c, name, msg, sizeof msg);
    if (n != strlen(want) || memcmp(msg, want, n) != 0 || strcmp(name, from) != 0 || c != conn)
        FAIL("notification %.*s from %s on %llu, wanted %s from %s on %llu", (int)n, (const char *)msg,
             name, (unsigned long long)c, want, from, (unsigned long long)conn);
}

/* ---------------------------------------------------------- process B */

/* Target: registers memory, hands out descriptors, checks what lands. */
static void run_b(int rd, int wr) {
    who = "B";
    tcpx_endpoint_t *ep = make_endpoint("proc-B");
    uint8_t md[TCPX_METADATA_MAX];
    size_t mdlen = sizeof md;
    OK(tcpx_endpoint_metadata(ep, md, &mdlen));
    put(wr, md, (uint32_t)mdlen);

    tcpx_accepted_t acc;
    OK(tcpx_accept(ep, 20000, &acc));
    CHECK(strcmp(acc.ip, "127.0.0.1") == 0);
    CHECK(acc.remote_gpu == -1);
    uint64_t conn = acc.conn;
    EXPECT(TCPX_AGAIN, tcpx_try_accept(ep, &acc));

    /* An advertised 1 MiB target and a 4 MiB exported region. */
    uint8_t *tgt = calloc(1, MiB);
    uint8_t *exp = malloc(4 * MiB);
    CHECK(tgt && exp);
    pattern(exp, 4 * MiB, 0, 2);
    uint64_t mr_tgt, mr_exp;
    OK(tcpx_reg(ep, tgt, MiB, &mr_tgt));
    OK(tcpx_reg(ep, exp, 4 * MiB, &mr_exp));
    uint8_t descs[2 * TCPX_DESC_LEN];
    OK(tcpx_advertise(ep, conn, mr_tgt, tgt, MiB, descs));
    OK(tcpx_export(ep, mr_exp, descs + TCPX_DESC_LEN));
    uint64_t a, l;
    OK(tcpx_desc_info(descs, &a, &l));
    CHECK(a == (uint64_t)(uintptr_t)tgt && l == MiB);
    OK(tcpx_desc_info(descs + TCPX_DESC_LEN, &a, &l));
    CHECK(a == (uint64_t)(uintptr_t)exp && l == 4 * MiB);
    put(wr, descs, sizeof descs);

    /* 1. A's write: every byte is there when its notification shows. */
    expect_notif(ep, conn, "proc-A", "w1");
    expect_pattern(tgt, MiB, 0, 1, "write before its notification");

    /* 2. A's read of our export: we, the owner, hear when it is done. */
    expect_notif(ep, conn, "proc-A", "r1");

    /* 3. A's vector write into the export at three offsets. */
    expect_notif(ep, conn, "proc-A", "v1");
    expect_pattern(exp, 1000, 0, 3, "piece 0");
    expect_pattern(exp + 100000, 5000, 100000, 3, "piece 1");
    expect_pattern(exp + 3 * MiB, 65536, 3 * MiB, 3, "piece 2");
    expect_pattern(exp + 1000, 100000 - 1000, 1000, 2, "between pieces 0 and 1");
    {
        uint8_t want[4096];
        pattern(want, sizeof want, 2 * MiB, 8);
        for (int i = 0; i < 20000 && memcmp(exp + 2 * MiB, want, sizeof want) != 0; i++) sleep_ms(1);
        expect_pattern(exp + 2 * MiB, 4096, 2 * MiB, 8, "released write");
    }

    /* 4. A forged descriptor was refused: nothing landed, no notification
     * came for it (the next one is the notification sent alone). */
    expect_notif(ep, conn, "proc-A", "hello");
    expect_pattern(tgt, MiB, 0, 1, "target after the refused write");
    OK(tcpx_send_notif(ep, conn, "bye", 3));

    /* 5. A notification larger than 64 KiB. */
    {
        static uint8_t big[70000];
        char name[TCPX_NAME_MAX + 1];
        uint64_t c;
        size_t n = next_notif(ep, &c, name, big, sizeof big);
        CHECK(n == sizeof big && c == conn && strcmp(name, "proc-A") == 0);
        expect_pattern(big, n, 0, 7, "large notification");
    }

    /* 6. Two-sided: two messages into two buffers. */
    uint8_t *r0 = calloc(1, 300000), *r1 = calloc(1, 17);
    CHECK(r0 && r1);
    uint64_t m0, m1, xfer;
    OK(tcpx_reg(ep, r0, 300000, &m0));
    OK(tcpx_reg(ep, r1, 17, &m1));
    tcpx_buf_t rb[2] = {{m0, r0, 300000}, {m1, r1, 17}};
    OK(tcpx_recv_async(ep, conn, rb, 2, &xfer));
    OK(tcpx_wait(ep, xfer, 20000));
    expect_pattern(r0, 300000, 0, 5, "recv 0");
    expect_pattern(r1, 17, 0, 6, "recv 1");

    /* Bad arguments on this side. */
    EXPECT(TCPX_ERR_UNKNOWN_ID, tcpx_disconnect(ep, 4242));
    EXPECT(TCPX_ERR_UNKNOWN_ID, tcpx_advertise(ep, conn, 4242, tgt, 16, descs));
    EXPECT(TCPX_ERR_INVALID_ARGUMENT, tcpx_advertise(ep, conn, mr_tgt, tgt + 16, MiB, descs));

    /* Done: wait for A to finish before closing. */
    char done[8];
    get(rd, done, sizeof done);
    /* A disconnects after "done": our side then reports the connection lost. */
    tcpx_status_t s = TCPX_OK;
    for (int i = 0; i < 20000 && s == TCPX_OK; i++) {
        s = tcpx_send_notif(ep, conn, "x", 1);
        if (s == TCPX_OK) sleep_ms(1);
    }
    EXPECT(TCPX_ERR_CONNECTION_LOST, s);
    OK(tcpx_dereg(ep, mr_tgt));
    OK(tcpx_dereg(ep, mr_exp));
    OK(tcpx_dereg(ep, m0));
    OK(tcpx_dereg(ep, m1));
    tcpx_endpoint_destroy(ep);
    free(tgt);
    free(exp);
    free(r0);
    free(r1);
}

/* ---------------------------------------------------------- process A */

static void run_a(int rd, int wr) {
    who = "A";
    tcpx_endpoint_t *ep = make_endpoint("proc-A");
    uint8_t md[TCPX_METADATA_MAX];
    uint32_t mdlen = get(rd, md, sizeof md);
    uint64_t conn, again;
    OK(tcpx_connect_metadata(ep, md, mdlen, &conn));
    OK(tcpx_connect_metadata(ep, md, mdlen, &again));
    CHECK(again == conn);
    uint8_t descs[2 * TCPX_DESC_LEN];
    CHECK(get(rd, descs, sizeof descs) == sizeof descs);
    const uint8_t *d_tgt = descs, *d_exp = descs + TCPX_DESC_LEN;

    uint8_t *src = malloc(MiB), *back = calloc(1, MiB);
    CHECK(src && back);
    uint64_t mr_src, mr_back, xfer;
    OK(tcpx_reg(ep, src, MiB, &mr_src));
    OK(tcpx_reg(ep, back, MiB, &mr_back));

    /* 1. One-sided write with a notification. */
    pattern(src, MiB, 0, 1);
    OK(tcpx_write_async(ep, conn, mr_src, src, MiB, d_tgt, 0, "w1", 2, &xfer));
    /* a timeout past the engine's longest waits without limit (no overflow) */
    OK(tcpx_wait(ep, xfer, INT64_MAX));

    /* 2. One-sided read at an offset into the export, with a notification. */
    OK(tcpx_read_async(ep, conn, mr_back, back, MiB, d_exp, 4096, "r1", 2, &xfer));
    tcpx_status_t s;
    while ((s = tcpx_poll(ep, xfer)) == TCPX_AGAIN) sleep_ms(1);
    EXPECT(TCPX_OK, s);
    expect_pattern(back, MiB, 4096, 2, "read");
    EXPECT(TCPX_ERR_UNKNOWN_ID, tcpx_poll(ep, xfer)); /* forgotten once done */

    /* A write given up at once (tcpx_release) still lands (B watches for
     * it); its id is forgotten. */
    uint8_t *rel = malloc(4096);
    uint64_t mr_rel;
    CHECK(rel != NULL);
    pattern(rel, 4096, 2 * MiB, 8);
    OK(tcpx_reg(ep, rel, 4096, &mr_rel));
    OK(tcpx_write_async(ep, conn, mr_rel, rel, 4096, d_exp, 2 * MiB, NULL, 0, &xfer));
    OK(tcpx_release(ep, xfer));
    EXPECT(TCPX_ERR_UNKNOWN_ID, tcpx_poll(ep, xfer));

    /* A write cancelled at once ends (called back, or run to its end); its
     * id is forgotten and the connection goes on (the steps below use it).
     * Into a part of the export nothing below reads. */
    uint64_t can;
    OK(tcpx_write_async(ep, conn, mr_src, src, 65536, d_exp, 2 * MiB + 65536, NULL, 0, &can));
    OK(tcpx_cancel(ep, can, 20000));
    EXPECT(TCPX_ERR_UNKNOWN_ID, tcpx_poll(ep, can));

    /* 3. Vectors: three pieces at offsets into the export, then read back. */
    size_t offs[3] = {0, 100000, 3 * MiB}, lens[3] = {1000, 5000, 65536};
    tcpx_rma_iov_t iov[3];
    size_t at = 0;
    for (int i = 0; i < 3; i++) {
        pattern(src + at, lens[i], offs[i], 3);
        iov[i] = (tcpx_rma_iov_t){mr_src, src + at, lens[i], d_exp, offs[i]};
        at += lens[i];
    }
    OK(tcpx_writev_async(ep, conn, iov, 3, "v1", 2, &xfer));
    OK(tcpx_wait(ep, xfer, 20000));
    memset(back, 0, MiB);
    at = 0;
    for (int i = 0; i < 3; i++) {
        iov[i].mr = mr_back;
        iov[i].ptr = back + at;
        at += lens[i];
    }
    OK(tcpx_readv_async(ep, conn, iov, 3, NULL, 0, &xfer));
    OK(tcpx_wait(ep, xfer, 20000));
    CHECK(memcmp(back, src, at) == 0 && fnv1a(back, at) == fnv1a(src, at));

    /* 4. A forged descriptor (secret changed): refused, nothing lands, its
     * notification is never sent. Then a notification alone, and B's. */
    uint8_t forged[TCPX_DESC_LEN];
    memcpy(forged, d_tgt, TCPX_DESC_LEN);
    forged[48] ^= 0x5a;
    pattern(src, MiB, 0, 4);
    OK(tcpx_write_async(ep, conn, mr_src, src, 4096, forged, 0, "forged", 6, &xfer));
    EXPECT(TCPX_ERR_REFUSED, tcpx_wait(ep, xfer, 20000));
    CHECK(strlen(tcpx_last_error()) > 0);
    OK(tcpx_send_notif(ep, conn, "hello", 5));
    expect_notif(ep, conn, "proc-B", "bye");

    /* 5. A notification over 64 KiB; one over the limit is refused. */
    {
        static uint8_t big[70000];
        pattern(big, sizeof big, 0, 7);
        OK(tcpx_send_notif(ep, conn, big, sizeof big));
        uint8_t *huge = malloc(TCPX_NOTIF_MAX + 1);
        CHECK(huge != NULL);
        EXPECT(TCPX_ERR_INVALID_ARGUMENT, tcpx_send_notif(ep, conn, huge, TCPX_NOTIF_MAX + 1));
        EXPECT(TCPX_ERR_INVALID_ARGUMENT,
               tcpx_write_async(ep, conn, mr_src, src, 16, d_tgt, 0, huge, TCPX_NOTIF_MAX + 1, &xfer));
        free(huge);
    }

    /* 6. Two-sided send of two buffers. */
    pattern(src, 300000, 0, 5);
    pattern(src + 300000, 17, 0, 6);
    tcpx_buf_t sb[2] = {{mr_src, src, 300000}, {mr_src, src + 300000, 17}};
    OK(tcpx_send_async(ep, conn, sb, 2, &xfer));
    OK(tcpx_wait(ep, xfer, 20000));

    /* 7. Bad arguments. */
    uint64_t id;
    uint8_t zero[TCPX_DESC_LEN] = {0};
    EXPECT(TCPX_ERR_INVALID_ARGUMENT, tcpx_reg(NULL, src, 16, &id));
    EXPECT(TCPX_ERR_INVALID_ARGUMENT, tcpx_reg(ep, NULL, 16, &id));
    EXPECT(TCPX_ERR_INVALID_ARGUMENT, tcpx_reg(ep, src, 16, NULL));
    EXPECT(TCPX_ERR_INVALID_ARGUMENT, tcpx_write_async(ep, conn, mr_src, src, 16, d_tgt, 0, NULL, 0, NULL));
    EXPECT(TCPX_ERR_INVALID_ARGUMENT, tcpx_write_async(ep, conn, mr_src, src, 16, NULL, 0, NULL, 0, &xfer));
    EXPECT(TCPX_ERR_INVALID_ARGUMENT, tcpx_write_async(ep, conn, mr_src, src, 16, d_tgt, 0, NULL, 5, &xfer));
    EXPECT(TCPX_ERR_INVALID_ARGUMENT, tcpx_writev_async(ep, conn, NULL, 2, NULL, 0, &xfer));
    EXPECT(TCPX_ERR_INVALID_ARGUMENT, tcpx_writev_async(ep, conn, iov, 0, NULL, 0, &xfer));
    {
        /* one piece more than a transfer may carry */
        size_t n = TCPX_IOV_MAX + 1;
        /* refused by the count alone, before any piece is read */
        tcpx_rma_iov_t *many = calloc(n, sizeof *many);
        CHECK(many != NULL);
        EXPECT(TCPX_ERR_INVALID_ARGUMENT, tcpx_writev_async(ep, conn, many, n, NULL, 0, &xfer));
        free(many);
    }
    EXPECT(TCPX_ERR_MALFORMED, tcpx_write_async(ep, conn, mr_src, src, 16, zero, 0, NULL, 0, &xfer));
    EXPECT(TCPX_ERR_MALFORMED, tcpx_desc_info(zero, &id, &id));
    /* past the local registration; past the remote range */
    EXPECT(TCPX_ERR_INVALID_ARGUMENT, tcpx_write_async(ep, conn, mr_src, src + 16, MiB, d_tgt, 0, NULL, 0, &xfer));
    EXPECT(TCPX_ERR_INVALID_ARGUMENT, tcpx_write_async(ep, conn, mr_src, src, 4096, d_tgt, MiB - 100, NULL, 0, &xfer));
    EXPECT(TCPX_ERR_UNKNOWN_ID, tcpx_write_async(ep, 999, mr_src, src, 16, d_tgt, 0, NULL, 0, &xfer));
    EXPECT(TCPX_ERR_UNKNOWN_ID, tcpx_write_async(ep, conn, 999, src, 16, d_tgt, 0, NULL, 0, &xfer));
    EXPECT(TCPX_ERR_UNKNOWN_ID, tcpx_send_async(ep, 999, sb, 1, &xfer));
    EXPECT(TCPX_ERR_UNKNOWN_ID, tcpx_send_notif(ep, 999, "x", 1));
    EXPECT(TCPX_ERR_UNKNOWN_ID, tcpx_poll(ep, 123456));
    EXPECT(TCPX_ERR_UNKNOWN_ID, tcpx_wait(ep, 123456, 10));
    EXPECT(TCPX_ERR_UNKNOWN_ID, tcpx_release(ep, 123456));
    EXPECT(TCPX_ERR_UNKNOWN_ID, tcpx_cancel(ep, 123456, 0));
    /* hostile timeouts: an error code, never TCPX_ERR_PANIC */
    {
        const int64_t hostile[] = {INT64_MIN, -1, INT64_MAX, INT64_MAX - 1, 1000000000001LL};
        for (size_t i = 0; i < sizeof hostile / sizeof hostile[0]; i++) {
            EXPECT(TCPX_ERR_UNKNOWN_ID, tcpx_wait(ep, 123456, hostile[i]));
            EXPECT(TCPX_ERR_UNKNOWN_ID, tcpx_cancel(ep, 123456, hostile[i]));
        }
    }
    EXPECT(TCPX_ERR_UNKNOWN_ID, tcpx_dereg(ep, 999));
    EXPECT(TCPX_ERR_INVALID_ARGUMENT, tcpx_send_notif(ep, conn, NULL, 3));
    EXPECT(TCPX_ERR_INVALID_ARGUMENT, tcpx_get_notifs(ep, NULL));
    EXPECT(TCPX_ERR_INVALID_ARGUMENT, tcpx_notifs_at(NULL, 0, NULL));
    CHECK(tcpx_notifs_count(NULL) == 0);
    EXPECT(TCPX_ERR_INVALID_ARGUMENT, tcpx_connect(ep, "not an ip", 1, &id));
    EXPECT(TCPX_ERR_MALFORMED, tcpx_connect_metadata(ep, zero, 3, &id));
    EXPECT(TCPX_AGAIN, tcpx_try_accept(ep, &(tcpx_accepted_t){0}));
    EXPECT(TCPX_ERR_TIMEOUT, tcpx_accept(ep, 10, &(tcpx_accepted_t){0}));
    {
        uint8_t small[4];
        size_t n = sizeof small;
        EXPECT(TCPX_ERR_BUFFER_TOO_SMALL, tcpx_endpoint_metadata(ep, small, &n));
        CHECK(n > sizeof small && n <= TCPX_METADATA_MAX);
        char name[3];
        EXPECT(TCPX_ERR_BUFFER_TOO_SMALL, tcpx_endpoint_name(ep, name, sizeof name));
    }
    /* a handle that is not one */
    {
        uint64_t fake[8] = {0};
        EXPECT(TCPX_ERR_INVALID_ARGUMENT, tcpx_poll((tcpx_endpoint_t *)fake, 1));
    }
    CHECK(strcmp(tcpx_status_str(TCPX_ERR_UNKNOWN_ID), "unknown id") == 0);
    CHECK(strlen(tcpx_version()) > 0);
    tcpx_endpoint_destroy(NULL);
    tcpx_notifs_free(NULL);
    tcpx_config_free(NULL);

    put(wr, "done", 4);
    OK(tcpx_disconnect(ep, conn));
    EXPECT(TCPX_ERR_UNKNOWN_ID, tcpx_send_notif(ep, conn, "x", 1));
    OK(tcpx_dereg(ep, mr_src));
    OK(tcpx_dereg(ep, mr_back));
    OK(tcpx_dereg(ep, mr_rel));
    tcpx_endpoint_destroy(ep);
    free(rel);
    free(src);
    free(back);
}

static void layout(void) {
#define P(name, v) printf("%s %llu\n", name, (unsigned long long)(v))
    P("TCPX_DESC_LEN", TCPX_DESC_LEN);
    P("TCPX_METADATA_MAX", TCPX_METADATA_MAX);
    P("TCPX_NOTIF_MAX", TCPX_NOTIF_MAX);
    P("TCPX_NAME_MAX", TCPX_NAME_MAX);
    P("TCPX_IP_LEN", TCPX_IP_LEN);
    P("TCPX_IOV_MAX", TCPX_IOV_MAX);
    P("sizeof(tcpx_status_t)", sizeof(tcpx_status_t));
    P("sizeof(tcpx_buf_t)", sizeof(tcpx_buf_t));
    P("offsetof(tcpx_buf_t,len)", offsetof(tcpx_buf_t, len));
    P("sizeof(tcpx_rma_iov_t)", sizeof(tcpx_rma_iov_t));
    P("offsetof(tcpx_rma_iov_t,desc)", offsetof(tcpx_rma_iov_t, desc));
    P("offsetof(tcpx_rma_iov_t,remote_offset)", offsetof(tcpx_rma_iov_t, remote_offset));
    P("sizeof(tcpx_accepted_t)", sizeof(tcpx_accepted_t));
    P("offsetof(tcpx_accepted_t,remote_gpu)", offsetof(tcpx_accepted_t, remote_gpu));
    P("offsetof(tcpx_accepted_t,ip)", offsetof(tcpx_accepted_t, ip));
    P("sizeof(tcpx_notif_t)", sizeof(tcpx_notif_t));
    P("offsetof(tcpx_notif_t,name_len)", offsetof(tcpx_notif_t, name_len));
    P("offsetof(tcpx_notif_t,msg_len)", offsetof(tcpx_notif_t, msg_len));
#undef P
}

int main(int argc, char **argv) {
    if (argc > 1 && strcmp(argv[1], "--layout") == 0) {
        layout();
        return 0;
    }
    alarm(120); /* never hang: the test ends by itself */
    int a2b[2], b2a[2];
    if (pipe(a2b) || pipe(b2a)) FAIL("pipe: %s", strerror(errno));
    pid_t child = fork();
    if (child < 0) FAIL("fork: %s", strerror(errno));
    if (child == 0) {
        alarm(120);
        close(a2b[1]);
        close(b2a[0]);
        run_b(a2b[0], b2a[1]);
        exit(0);
    }
    close(a2b[0]);
    close(b2a[1]);
    run_a(b2a[0], a2b[1]);
    int st = 0;
    if (waitpid(child, &st, 0) != child) FAIL("waitpid: %s", strerror(errno));
    if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) FAIL("process B failed (status %d)", st);
    printf("capi_test: passed\n");
    return 0;
}
