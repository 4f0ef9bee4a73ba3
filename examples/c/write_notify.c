/*
 * write_notify.c: one process offers a buffer, another writes 4 MiB into it
 * with a notification attached; the first checks every byte once the
 * notification has come. The two processes (fork) pass the metadata and the
 * 64-byte descriptor through a pipe; every wait is bounded.
 *
 *   cc -std=c11 -I include examples/c/write_notify.c \
 *      -L target/run/release -ltcpx_p2p -Wl,-rpath,"$PWD/target/run/release" \
 *      -o write_notify
 *   ./write_notify [interface]        (default: lo)
 */
#define _POSIX_C_SOURCE 200809L
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "tcpx_p2p.h"

#define LEN (4u << 20)
#define TIMEOUT_MS 30000

/* Prints the failed call with the library's reason and exits. */
static void check(tcpx_status_t s, const char *what) {
    if (s != TCPX_OK) {
        fprintf(stderr, "%s: %s (%s)\n", what, tcpx_status_str(s), tcpx_last_error());
        exit(1);
    }
}

static void put(int fd, const void *p, size_t n) {
    if (write(fd, p, n) != (ssize_t)n) {
        perror("pipe write");
        exit(1);
    }
}

static void get(int fd, void *p, size_t n) {
    size_t got = 0;
    while (got < n) {
        ssize_t r = read(fd, (char *)p + got, n - got);
        if (r <= 0) {
            fprintf(stderr, "pipe read: the other process went away\n");
            exit(1);
        }
        got += (size_t)r;
    }
}

static uint8_t pattern(size_t i) { return (uint8_t)(i * 2654435761u >> 24); }

static void sleep_1ms(void) {
    struct timespec t = {0, 1000000};
    nanosleep(&t, NULL);
}

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec / 1e9;
}

static tcpx_endpoint_t *open_endpoint(const char *ifname, const char *name) {
    tcpx_config_t *cfg;
    tcpx_endpoint_t *ep;
    check(tcpx_config_new(&cfg), "config");       /* defaults + TCPX_P2P_* env */
    check(tcpx_config_set(cfg, "interface", ifname), "config interface");
    check(tcpx_config_set(cfg, "name", name), "config name");
    check(tcpx_endpoint_create(cfg, &ep), "endpoint");
    tcpx_config_free(cfg);
    return ep;
}

/* The target: hands out its metadata and a descriptor, waits for the data. */
static int target(const char *ifname, int to_writer) {
    tcpx_endpoint_t *ep = open_endpoint(ifname, "target");
    uint8_t md[TCPX_METADATA_MAX], desc[TCPX_DESC_LEN];
    size_t mdlen = sizeof md;
    uint8_t *buf = calloc(LEN, 1);
    uint64_t mr;
    tcpx_accepted_t peer;

    check(tcpx_endpoint_metadata(ep, md, &mdlen), "metadata");
    put(to_writer, &mdlen, sizeof mdlen);
    put(to_writer, md, mdlen);
    check(tcpx_accept(ep, TIMEOUT_MS, &peer), "accept");
    check(tcpx_reg(ep, buf, LEN, &mr), "reg");
    check(tcpx_advertise(ep, peer.conn, mr, buf, LEN, desc), "advertise"); /* this peer, these bytes */
    put(to_writer, desc, sizeof desc);

    /* Every byte is in buf once the notification shows. */
    double deadline = now_s() + TIMEOUT_MS / 1000.0;
    size_t n = 0;
    while (n == 0) {
        tcpx_notifs_t *list;
        check(tcpx_get_notifs(ep, &list), "get_notifs");
        n = tcpx_notifs_count(list);
        for (size_t i = 0; i < n; i++) {
            tcpx_notif_t nf;
            check(tcpx_notifs_at(list, i, &nf), "notifs_at");
            printf("target: notification from %.*s: %.*s\n", (int)nf.name_len, nf.name,
                   (int)nf.msg_len, (const char *)nf.msg);
        }
        tcpx_notifs_free(list);
        if (n == 0 && now_s() > deadline) {
            fprintf(stderr, "target: no notification within %d ms\n", TIMEOUT_MS);
            return 1;
        }
        if (n == 0) sleep_1ms();
    }
    size_t bad = 0;
    for (size_t i = 0; i < LEN; i++) bad += buf[i] != pattern(i);
    printf("target: %u bytes landed, %zu differ\n", LEN, bad);
    check(tcpx_dereg(ep, mr), "dereg");
    tcpx_endpoint_destroy(ep);
    free(buf);
    return bad == 0 ? 0 : 1;
}

/* The writer. */
static int writer(const char *ifname, int from_target) {
    tcpx_endpoint_t *ep = open_endpoint(ifname, "writer");
    uint8_t md[TCPX_METADATA_MAX], desc[TCPX_DESC_LEN];
    size_t mdlen;
    uint8_t *src = malloc(LEN);
    uint64_t conn, mr, xfer;

    for (size_t i = 0; i < LEN; i++) src[i] = pattern(i);
    get(from_target, &mdlen, sizeof mdlen);
    if (mdlen > sizeof md) {
        fprintf(stderr, "writer: metadata of %zu bytes is too long\n", mdlen);
        return 1;
    }
    get(from_target, md, mdlen);
    check(tcpx_connect_metadata(ep, md, mdlen, &conn), "connect");
    get(from_target, desc, sizeof desc);
    check(tcpx_reg(ep, src, LEN, &mr), "reg");

    double t0 = now_s();
    check(tcpx_write_async(ep, conn, mr, src, LEN, desc, /* remote_offset */ 0, "done", 4, &xfer),
          "write");
    check(tcpx_wait(ep, xfer, TIMEOUT_MS), "wait");
    double dt = now_s() - t0;
    printf("writer: wrote %u bytes in %.3f ms (%.2f GB/s)\n", LEN, dt * 1e3, LEN / dt / 1e9);
    check(tcpx_dereg(ep, mr), "dereg");
    tcpx_endpoint_destroy(ep);
    free(src);
    return 0;
}

int main(int argc, char **argv) {
    const char *ifname = argc > 1 ? argv[1] : "lo";
    int fds[2];
    if (pipe(fds) != 0) {
        perror("pipe");
        return 1;
    }
    pid_t pid = fork();
    if (pid < 0) {
        perror("fork");
        return 1;
    }
    if (pid == 0) {
        close(fds[1]);
        _exit(writer(ifname, fds[0]));
    }
    close(fds[0]);
    int rc = target(ifname, fds[1]);
    close(fds[1]);
    int st;
    if (waitpid(pid, &st, 0) != pid || !WIFEXITED(st) || WEXITSTATUS(st) != 0) {
        fprintf(stderr, "the writer process failed\n");
        rc = 1;
    }
    printf("%s\n", rc == 0 ? "write_notify: OK" : "write_notify: FAILED");
    return rc;
}
