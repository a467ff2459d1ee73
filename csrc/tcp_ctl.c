/*
 * tcp_ctl.c - the TCP provider's control side: the engine (its listener; the server
 * thread it starts is tcp_target.c's), the region table, CQs, and connection
 * create/connect/reset/destroy. The initiator's data path (post, poll) is in tcp_dp.c.
 */
#include <endian.h>
#include <errno.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "tcp_internal.h"

enum {
    DEFAULT_MAX_REGIONS = 1024,
    DEFAULT_MAX_PENDING = 64,
    DEFAULT_HANDSHAKE_MS = 2000,
    DEFAULT_CONNS_PER_PEER = 16,
    DEFAULT_MAX_CREDS = 4096,
    DEFAULT_MAX_GRANTS = 4096,
    DEFAULT_MAX_SEND_WR = 256,
    MAX_SEND_WR = 65536,
    LISTEN_BACKLOG = 256,
};

static int listen_on(dp_tcp *eng, const char *host, uint16_t port)
{
    struct addrinfo *ai;
    int err = tcp_resolve(host, port, 1, &ai);
    if (err)
        return err;
    err = EADDRNOTAVAIL;
    for (struct addrinfo *a = ai; a; a = a->ai_next) {
        int fd = socket(a->ai_family, a->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC,
                        a->ai_protocol);
        if (fd < 0) {
            err = errno;
            continue;
        }
        int one = 1;
        setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
        if (bind(fd, a->ai_addr, a->ai_addrlen) == 0 && listen(fd, LISTEN_BACKLOG) == 0) {
            eng->listen_fd = fd;
            err = 0;
            break;
        }
        err = errno;
        close(fd);
    }
    freeaddrinfo(ai);
    if (err)
        return err;
    struct sockaddr_storage ss;
    socklen_t len = sizeof ss;
    if (getsockname(eng->listen_fd, (struct sockaddr *)&ss, &len) < 0)
        return errno;
    eng->port = ntohs(ss.ss_family == AF_INET6 ? ((struct sockaddr_in6 *)&ss)->sin6_port
                                               : ((struct sockaddr_in *)&ss)->sin_port);
    return 0;
}

static void engine_free(dp_tcp *eng)
{
    if (eng->listen_fd >= 0)
        close(eng->listen_fd);
    if (eng->epfd >= 0)
        close(eng->epfd);
    if (eng->wake_fd >= 0)
        close(eng->wake_fd);
    pthread_rwlock_destroy(&eng->lock);
    pthread_mutex_destroy(&eng->cred_lock);
    if (eng->creds)
        explicit_bzero(eng->creds, (size_t)eng->max_creds * sizeof *eng->creds);
    free(eng->creds);
    tcp_scope_free(eng);
    free(eng->regions);
    free(eng->discard);
    free(eng);
}

dp_tcp *dp_tcp_create(const char *host, uint16_t port, const struct dp_tcp_cfg *cfg)
{
    struct dp_tcp_cfg c = cfg ? *cfg : (struct dp_tcp_cfg){0};
    if (!c.max_regions)
        c.max_regions = DEFAULT_MAX_REGIONS;
    if (!c.max_pending)
        c.max_pending = DEFAULT_MAX_PENDING;
    if (!c.handshake_timeout_ms)
        c.handshake_timeout_ms = DEFAULT_HANDSHAKE_MS;
    if (!c.max_conns_per_peer)
        c.max_conns_per_peer = DEFAULT_CONNS_PER_PEER;
    if (!c.max_credentials)
        c.max_credentials = DEFAULT_MAX_CREDS;
    if (!c.max_grants)
        c.max_grants = DEFAULT_MAX_GRANTS;
    if (!c.max_pending_per_addr)
        c.max_pending_per_addr = c.max_pending / 8 ? c.max_pending / 8 : 1;
    if (c.max_regions > 0xffff || c.sockbuf_bytes > (1u << 30) || (c.flags & ~DP_TCP_OPEN) ||
        c.max_credentials > 0xffff || c.max_pending > 65536 || c.max_grants > 0xffff ||
        c.max_pending_per_addr > c.max_pending ||
        c.handshake_timeout_ms > 3600000) {
        errno = EINVAL;
        return NULL;
    }
    dp_tcp *eng = calloc(1, sizeof *eng);
    if (!eng)
        return NULL;
    eng->listen_fd = eng->epfd = eng->wake_fd = -1;
    eng->max_regions = c.max_regions;
    eng->sockbuf = c.sockbuf_bytes;
    eng->flags = c.flags;
    eng->max_pending = c.max_pending;
    eng->max_pending_per_addr = c.max_pending_per_addr;
    eng->handshake_timeout_ms = c.handshake_timeout_ms;
    eng->max_conns_per_peer = c.max_conns_per_peer;
    eng->max_creds = c.max_credentials;
    eng->max_grants = c.max_grants;
    pthread_mutex_init(&eng->cred_lock, NULL);
    pthread_rwlockattr_t attr;
    pthread_rwlockattr_init(&attr);
    /* reg/dereg must not starve behind the server thread's back-to-back read locks */
    pthread_rwlockattr_setkind_np(&attr, PTHREAD_RWLOCK_PREFER_WRITER_NONRECURSIVE_NP);
    pthread_rwlock_init(&eng->lock, &attr);
    pthread_rwlockattr_destroy(&attr);
    eng->regions = calloc(c.max_regions, sizeof *eng->regions);
    eng->creds = calloc(c.max_credentials, sizeof *eng->creds);
    eng->grants = calloc(c.max_grants, sizeof *eng->grants);
    eng->discard = malloc(TCP_DISCARD);
    int err = ENOMEM;
    if (!eng->regions || !eng->creds || !eng->grants || !eng->discard)
        goto fail;
    err = listen_on(eng, host, port);
    if (err)
        goto fail;
    eng->epfd = epoll_create1(EPOLL_CLOEXEC);
    eng->wake_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (eng->epfd < 0 || eng->wake_fd < 0) {
        err = errno;
        goto fail;
    }
    struct epoll_event ev_listen = {.events = EPOLLIN, .data.ptr = eng};
    struct epoll_event ev_wake = {.events = EPOLLIN, .data.ptr = &eng->wake_fd};
    if (epoll_ctl(eng->epfd, EPOLL_CTL_ADD, eng->listen_fd, &ev_listen) < 0 ||
        epoll_ctl(eng->epfd, EPOLL_CTL_ADD, eng->wake_fd, &ev_wake) < 0) {
        err = errno;
        goto fail;
    }
    /* The server thread takes no signals: they belong to the embedding process's threads. */
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    err = pthread_create(&eng->thread, NULL, tcp_target_main, eng);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    if (err)
        goto fail;
    eng->thread_started = 1;
    return eng;
fail:
    engine_free(eng);
    errno = err;
    return NULL;
}

int dp_tcp_stats(dp_tcp *eng, struct dp_tcp_stats *out)
{
    if (!eng || !out)
        return -EINVAL;
    out->conns_accepted = __atomic_load_n(&eng->stats.conns_accepted, __ATOMIC_RELAXED);
    out->conns_admitted = __atomic_load_n(&eng->stats.conns_admitted, __ATOMIC_RELAXED);
    out->conns_refused = __atomic_load_n(&eng->stats.conns_refused, __ATOMIC_RELAXED);
    out->writes = __atomic_load_n(&eng->stats.writes, __ATOMIC_RELAXED);
    out->bytes = __atomic_load_n(&eng->stats.bytes, __ATOMIC_RELAXED);
    out->refused = __atomic_load_n(&eng->stats.refused, __ATOMIC_RELAXED);
    out->flushed = __atomic_load_n(&eng->stats.flushed, __ATOMIC_RELAXED);
    out->ack_stalls = __atomic_load_n(&eng->stats.ack_stalls, __ATOMIC_RELAXED);
    out->out_of_scope = __atomic_load_n(&eng->stats.out_of_scope, __ATOMIC_RELAXED);
    return 0;
}

int dp_tcp_admit(dp_tcp *eng, uint32_t peer, const uint8_t *secret, uint32_t *out_id)
{
    if (!eng || !secret || !out_id)
        return -EINVAL;
    pthread_mutex_lock(&eng->cred_lock);
    uint32_t slot = 0;
    while (slot < eng->max_creds && eng->creds[slot].live)
        slot++;
    if (slot == eng->max_creds) {
        pthread_mutex_unlock(&eng->cred_lock);
        return -ENOSPC;
    }
    struct tcp_cred *cr = &eng->creds[slot];
    cr->gen = (uint16_t)(cr->gen == 0xffff ? 1 : cr->gen + 1);
    cr->id = (uint32_t)cr->gen << 16 | slot;
    cr->peer = peer;
    memcpy(cr->secret, secret, DP_TCP_SECRET_BYTES);
    cr->live = 1;
    *out_id = cr->id;
    pthread_mutex_unlock(&eng->cred_lock);
    return 0;
}

int dp_tcp_revoke(dp_tcp *eng, uint32_t id)
{
    if (!eng)
        return -EINVAL;
    uint32_t slot = id & 0xffff;
    int rc = -ENOENT;
    pthread_mutex_lock(&eng->cred_lock);
    if (slot < eng->max_creds && eng->creds[slot].live && eng->creds[slot].id == id) {
        eng->creds[slot].live = 0;
        explicit_bzero(eng->creds[slot].secret, DP_TCP_SECRET_BYTES);
        rc = 0;
    }
    pthread_mutex_unlock(&eng->cred_lock);
    return rc;
}

int dp_tcp_port(dp_tcp *eng)
{
    return eng ? eng->port : -EINVAL;
}

int dp_tcp_destroy(dp_tcp *eng)
{
    if (!eng)
        return -EINVAL;
    if (__atomic_load_n(&eng->n_mrs, __ATOMIC_ACQUIRE) ||
        __atomic_load_n(&eng->n_cqs, __ATOMIC_ACQUIRE) ||
        __atomic_load_n(&eng->n_conns, __ATOMIC_ACQUIRE))
        return -EBUSY;
    if (eng->thread_started) {
        uint64_t one = 1;
        if (write(eng->wake_fd, &one, sizeof one) < 0)
            return -errno;
        pthread_join(eng->thread, NULL);
    }
    engine_free(eng);
    return 0;
}

/* ------------------------------------------------------------------ regions */

dp_tcp_mr *dp_tcp_mr_reg(dp_tcp *eng, void *addr, uint64_t length, uint32_t access,
                         struct dp_mr_info *out)
{
    if (!eng || !addr || !length || !out ||
        (access & ~(uint32_t)(DP_ACCESS_LOCAL_WRITE | DP_ACCESS_REMOTE_WRITE |
                              DP_ACCESS_REMOTE_READ | DP_TCP_SCOPED)) ||
        (uintptr_t)addr + length < (uintptr_t)addr) {
        errno = EINVAL;
        return NULL;
    }
    dp_tcp_mr *mr = malloc(sizeof *mr);
    if (!mr)
        return NULL;
    pthread_rwlock_wrlock(&eng->lock);
    uint32_t slot = 0;
    while (slot < eng->max_regions && eng->regions[slot].live)
        slot++;
    if (slot == eng->max_regions) {
        pthread_rwlock_unlock(&eng->lock);
        free(mr);
        errno = ENOSPC;
        return NULL;
    }
    struct tcp_region *r = &eng->regions[slot];
    /* A random key: a peer cannot guess one from another, nor count them. Nonzero, unlike
     * every live region's, unlike this slot's last (a stale key never matches). */
    uint32_t key = 0;
    for (;;) {
        if (tcp_random(&key, sizeof key) < 0) {
            int err = errno;
            pthread_rwlock_unlock(&eng->lock);
            free(mr);
            errno = err;
            return NULL;
        }
        int clash = key == 0 || key == r->key;
        for (uint32_t i = 0; i < eng->hi_slot && !clash; i++)
            clash = eng->regions[i].live && eng->regions[i].key == key;
        if (!clash)
            break;
    }
    r->key = key;
    r->addr = (uint64_t)(uintptr_t)addr;
    r->length = length;
    r->access = access;
    r->live = 1;
    if (slot >= eng->hi_slot)
        eng->hi_slot = slot + 1;
    pthread_rwlock_unlock(&eng->lock);
    mr->eng = eng;
    mr->slot = slot;
    mr->rkey = key;
    out->addr = (uint64_t)(uintptr_t)addr;
    out->length = length;
    out->lkey = out->rkey = key;
    __atomic_add_fetch(&eng->n_mrs, 1, __ATOMIC_RELEASE);
    return mr;
}

int dp_tcp_mr_dereg(dp_tcp_mr *mr)
{
    if (!mr)
        return -EINVAL;
    dp_tcp *eng = mr->eng;
    /* The write lock waits out any recvmsg into this region (they hold the read lock). */
    pthread_rwlock_wrlock(&eng->lock);
    eng->regions[mr->slot].live = 0;
    pthread_rwlock_unlock(&eng->lock);
    __atomic_sub_fetch(&eng->n_mrs, 1, __ATOMIC_RELEASE);
    free(mr);
    return 0;
}

/* ------------------------------------------------------------------ CQs */

dp_tcp_cq *dp_tcp_cq_create(dp_tcp *eng, uint32_t depth)
{
    if (!eng || depth == 0 || depth > (1u << 30)) {
        errno = EINVAL;
        return NULL;
    }
    dp_tcp_cq *cq = calloc(1, sizeof *cq);
    if (!cq)
        return NULL;
    cq->eng = eng;
    cq->depth = depth;
    cq->epfd = epoll_create1(EPOLL_CLOEXEC);
    cq->wake_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    struct epoll_event ev = {.events = EPOLLIN, .data.ptr = NULL};
    if (cq->epfd < 0 || cq->wake_fd < 0 ||
        epoll_ctl(cq->epfd, EPOLL_CTL_ADD, cq->wake_fd, &ev) < 0) {
        int err = errno;
        if (cq->epfd >= 0)
            close(cq->epfd);
        if (cq->wake_fd >= 0)
            close(cq->wake_fd);
        free(cq);
        errno = err;
        return NULL;
    }
    __atomic_add_fetch(&eng->n_cqs, 1, __ATOMIC_RELEASE);
    return cq;
}

int dp_tcp_cq_destroy(dp_tcp_cq *cq)
{
    if (!cq)
        return -EINVAL;
    if (__atomic_load_n(&cq->n_conns, __ATOMIC_ACQUIRE))
        return -EBUSY;
    close(cq->epfd);
    close(cq->wake_fd);
    __atomic_sub_fetch(&cq->eng->n_cqs, 1, __ATOMIC_RELEASE);
    free(cq);
    return 0;
}

int dp_tcp_cq_wake(dp_tcp_cq *cq)
{
    if (!cq)
        return -EINVAL;
    uint64_t one = 1;
    /* EAGAIN means the counter is saturated: a wake-up is pending anyway. */
    if (write(cq->wake_fd, &one, sizeof one) < 0 && errno != EAGAIN)
        return -errno;
    return 0;
}

/* ------------------------------------------------------------------ connections */

dp_tcp_conn *dp_tcp_conn_create(dp_tcp *eng, dp_tcp_cq *cq, const struct dp_tcp_conn_cfg *cfg)
{
    struct dp_tcp_conn_cfg c = cfg ? *cfg : (struct dp_tcp_conn_cfg){0};
    if (!c.max_send_wr)
        c.max_send_wr = DEFAULT_MAX_SEND_WR;
    if (!eng || !cq || cq->eng != eng || c.max_send_wr > MAX_SEND_WR ||
        c.sockbuf_bytes > (1u << 30)) {
        errno = EINVAL;
        return NULL;
    }
    uint32_t slots = 1;
    while (slots < c.max_send_wr)
        slots <<= 1;
    dp_tcp_conn *conn = calloc(1, sizeof *conn);
    if (!conn)
        return NULL;
    conn->ring = calloc(slots, sizeof *conn->ring);
    conn->iov = calloc(TCP_IOV_MAX, sizeof *conn->iov);
    if (!conn->ring || !conn->iov) {
        free(conn->ring);
        free(conn->iov);
        free(conn);
        errno = ENOMEM;
        return NULL;
    }
    conn->eng = eng;
    conn->cq = cq;
    conn->cfg = c;
    conn->mask = slots - 1;
    conn->fd = -1;
    conn->state = TCP_RESET;
    conn->id = __atomic_add_fetch(&eng->next_conn_id, 1, __ATOMIC_RELAXED);
    __atomic_add_fetch(&eng->n_conns, 1, __ATOMIC_RELEASE);
    __atomic_add_fetch(&cq->n_conns, 1, __ATOMIC_RELEASE);
    return conn;
}

/* A non-blocking connect bounded by the deadline; the socket stays non-blocking. */
static int connect_one(const struct addrinfo *a, const struct dp_tcp_conn_cfg *cfg,
                       int64_t deadline, int *out_fd)
{
    int fd = socket(a->ai_family, a->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC,
                    a->ai_protocol);
    if (fd < 0)
        return errno;
    tcp_tune_socket(fd, cfg->sockbuf_bytes, cfg->user_timeout_ms);
    int err = 0;
    if (connect(fd, a->ai_addr, a->ai_addrlen) < 0) {
        err = errno;
        while (err == EINPROGRESS || err == EINTR) {
            int64_t now = 0;
            if (tcp_now_ns(&now) < 0 || now >= deadline) {
                err = ETIMEDOUT;
                break;
            }
            struct pollfd p = {.fd = fd, .events = POLLOUT};
            int64_t ms = (deadline - now + 999999) / 1000000;
            int k = poll(&p, 1, ms > 1000000 ? 1000000 : (int)ms);
            if (k < 0) {
                err = errno;
                continue;
            }
            if (k == 0)
                continue;
            socklen_t len = sizeof err;
            if (getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len) < 0)
                err = errno;
        }
    }
    if (err) {
        close(fd);
        return err;
    }
    *out_fd = fd;
    return 0;
}

int dp_tcp_conn_set_credential(dp_tcp_conn *conn, uint32_t id, const uint8_t *secret)
{
    if (!conn || !secret)
        return -EINVAL;
    conn->cred_id = id;
    memcpy(conn->cred_secret, secret, DP_TCP_SECRET_BYTES);
    conn->has_cred = 1;
    return 0;
}

int dp_tcp_conn_connect(dp_tcp_conn *conn, const char *host, uint16_t port, int64_t timeout_ns)
{
    if (!conn || !host || !port)
        return -EINVAL;
    if (conn->state != TCP_RESET)
        return -EISCONN;
    int64_t now;
    if (tcp_now_ns(&now) < 0)
        return -errno;
    int64_t deadline = tcp_deadline(now, timeout_ns);
    struct addrinfo *ai;
    int err = tcp_resolve(host, port, 0, &ai);
    if (err)
        return -err;
    int fd = -1;
    err = EADDRNOTAVAIL;
    for (struct addrinfo *a = ai; a && fd < 0; a = a->ai_next)
        err = connect_one(a, &conn->cfg, deadline, &fd);
    freeaddrinfo(ai);
    int had_cred = conn->has_cred;
    conn->has_cred = 0;                 /* single use, like the target's credential */
    if (fd < 0)
        return -err;
    if (had_cred) {
        int rc = tcp_conn_handshake(conn, fd, deadline);
        explicit_bzero(conn->cred_secret, sizeof conn->cred_secret);
        if (rc) {
            close(fd);
            return rc;
        }
    }
    conn->fd = fd;
    conn->state = TCP_RTS;
    /* Last: from here on the CQ's poller sees this connection's events. */
    struct epoll_event ev = {.events = EPOLLIN | EPOLLOUT | EPOLLRDHUP | EPOLLET,
                             .data.ptr = conn};
    if (epoll_ctl(conn->cq->epfd, EPOLL_CTL_ADD, fd, &ev) < 0) {
        err = errno;
        close(fd);
        conn->fd = -1;
        conn->state = TCP_RESET;
        return -err;
    }
    return 0;
}

int dp_tcp_conn_connect_self(dp_tcp_conn *conn)
{
    if (!conn)
        return -EINVAL;
    if (conn->state != TCP_RESET)
        return -EISCONN;
    conn->self = 1;
    conn->self_status = 0;
    conn->self_sig_done = 0;
    conn->self_done = conn->tail;
    conn->state = TCP_RTS;
    return 0;
}

int dp_tcp_conn_reset(dp_tcp_conn *conn)
{
    if (!conn)
        return -EINVAL;
    if (conn->fd >= 0) {
        /* An abortive close (RST): bytes still queued for the peer are discarded, not
         * delivered after the caller gave their WRITEs up, as a QP reset flushes its
         * work requests. A fence relies on it (dualpath/paths/fence.py). */
        struct linger lg = {.l_onoff = 1, .l_linger = 0};
        (void)setsockopt(conn->fd, SOL_SOCKET, SO_LINGER, &lg, sizeof lg);
        epoll_ctl(conn->cq->epfd, EPOLL_CTL_DEL, conn->fd, NULL);
        close(conn->fd);
        conn->fd = -1;
    }
    /* Touch the CQ only when needed: a connection in RESET (never connected, or already
     * reset) can then be reset or destroyed while another thread polls (dp.h). */
    tcp_ready_remove(conn);
    if (conn->sig_outstanding) {
        conn->cq->sig_outstanding -= conn->sig_outstanding;
        conn->sig_outstanding = 0;
    }
    conn->head = conn->send_idx = conn->tail;
    conn->send_off = 0;
    conn->unsig_run = 0;
    conn->tx_blocked = conn->tx_stopped = conn->rx_more = 0;
    conn->ack_pos = conn->ack_len = 0;
    conn->fail_status = 0;
    conn->fail_errno = 0;
    conn->self = 0;
    conn->self_status = 0;
    conn->self_sig_done = 0;
    conn->self_done = conn->tail;
    conn->state = TCP_RESET;
    return 0;
}

int dp_tcp_conn_state(dp_tcp_conn *conn)
{
    return conn ? conn->state : -EINVAL;
}

int dp_tcp_conn_outstanding(dp_tcp_conn *conn)
{
    return conn ? (int)(conn->tail - conn->head) : -EINVAL;
}

int dp_tcp_conn_id(dp_tcp_conn *conn)
{
    return conn ? (int)conn->id : -EINVAL;
}

int dp_tcp_conn_destroy(dp_tcp_conn *conn)
{
    if (!conn)
        return -EINVAL;
    dp_tcp_conn_reset(conn);
    __atomic_sub_fetch(&conn->cq->n_conns, 1, __ATOMIC_RELEASE);
    __atomic_sub_fetch(&conn->eng->n_conns, 1, __ATOMIC_RELEASE);
    free(conn->ring);
    free(conn->iov);
    free(conn);
    return 0;
}
