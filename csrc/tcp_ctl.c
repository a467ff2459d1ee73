/*
 * tcp_ctl.c - the TCP provider's control side: the engine (listener + server thread),
 * the region table, CQs, and connection create/connect/reset/destroy. The data path
 * (post, poll, the target's receive state machine) is in tcp_dp.c.
 *
 * Server thread: one per engine, blocked in epoll_wait on the listening socket, an
 * eventfd that dp_tcp_destroy writes to stop it, and the accepted sockets (level-
 * triggered). It owns the accepted sockets outright; the only state it shares is the
 * region table, under eng->lock. Connections closed while handling one epoll batch are
 * freed after the batch, so a later event of that batch never reads freed memory.
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
    DEFAULT_MAX_SEND_WR = 256,
    MAX_SEND_WR = 65536,
    LISTEN_BACKLOG = 256,
    ACCEPT_PAUSE_MS = 100,   /* how long the listener is ignored after EMFILE and the like */
};

int tcp_now_ns(int64_t *out)
{
    struct timespec ts;
    if (clock_gettime(CLOCK_MONOTONIC, &ts) < 0)
        return -1;
    *out = (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
    return 0;
}

/* Latency over Nagle; optional fixed buffers (else the kernel autotunes them). */
static void tune_socket(int fd, uint32_t sockbuf, uint32_t user_timeout_ms)
{
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    if (sockbuf) {
        int v = (int)sockbuf;
        setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &v, sizeof v);
        setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &v, sizeof v);
    }
    if (user_timeout_ms) {
        unsigned int v = user_timeout_ms;
        setsockopt(fd, IPPROTO_TCP, TCP_USER_TIMEOUT, &v, sizeof v);
    }
}

/* getaddrinfo's EAI_* as an errno. */
static int resolve(const char *host, uint16_t port, int passive, struct addrinfo **out)
{
    char svc[8];
    snprintf(svc, sizeof svc, "%u", port);
    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM,
                             .ai_flags = AI_NUMERICSERV | (passive ? AI_PASSIVE : 0)};
    int rc = getaddrinfo(host && *host ? host : NULL, svc, &hints, out);
    if (rc == 0)
        return 0;
    if (rc == EAI_SYSTEM)
        return errno ? errno : EIO;
    return rc == EAI_MEMORY ? ENOMEM : EADDRNOTAVAIL;
}

/* The pending FIFO: accepted, not yet admitted, in accept (= deadline) order. */
static void pend_add(dp_tcp *eng, struct tcp_srv_conn *c)
{
    c->pend_prev = eng->pend_tail;
    c->pend_next = NULL;
    if (eng->pend_tail)
        eng->pend_tail->pend_next = c;
    else
        eng->pend_head = c;
    eng->pend_tail = c;
    eng->n_pending++;
}

static void pend_del(dp_tcp *eng, struct tcp_srv_conn *c)
{
    if (c->pend_prev)
        c->pend_prev->pend_next = c->pend_next;
    else
        eng->pend_head = c->pend_next;
    if (c->pend_next)
        c->pend_next->pend_prev = c->pend_prev;
    else
        eng->pend_tail = c->pend_prev;
    c->pend_prev = c->pend_next = NULL;
    eng->n_pending--;
}

static void srv_close(dp_tcp *eng, struct tcp_srv_conn *c, struct tcp_srv_conn **dead)
{
    if (!c->admitted) {
        pend_del(eng, c);
        TCP_STAT_ADD(eng, conns_refused, 1);
    }
    epoll_ctl(eng->epfd, EPOLL_CTL_DEL, c->fd, NULL);
    close(c->fd);
    c->fd = -1;
    if (c->prev)
        c->prev->next = c->next;
    else
        eng->srv_conns = c->next;
    if (c->next)
        c->next->prev = c->prev;
    c->prev = NULL;
    c->next = *dead;
    *dead = c;
}

static void srv_set_events(dp_tcp *eng, struct tcp_srv_conn *c, uint32_t events)
{
    if (c->events == events)
        return;
    struct epoll_event ev = {.events = events, .data.ptr = c};
    if (epoll_ctl(eng->epfd, EPOLL_CTL_MOD, c->fd, &ev) == 0)
        c->events = events;
}

/* Out of descriptors (or memory): the connection stays queued, so the level-triggered
 * listener would wake the server thread at once, for ever, at full CPU. Stop watching it
 * for ACCEPT_PAUSE_MS (server_main watches it again), as libuv and nginx do. */
static void srv_pause_accept(dp_tcp *eng)
{
    struct epoll_event ev = {.events = 0, .data.ptr = eng};
    int64_t now;
    if (tcp_now_ns(&now) < 0 || epoll_ctl(eng->epfd, EPOLL_CTL_MOD, eng->listen_fd, &ev) < 0)
        return;
    eng->accept_resume_ns = now + (int64_t)ACCEPT_PAUSE_MS * 1000000;
}

/* The epoll_wait timeout: -1, or the ms until a paused listener is watched again (0
 * when that is due: it is then re-armed here) or the oldest pending handshake expires. */
static int srv_timeout_ms(dp_tcp *eng)
{
    int64_t now;
    if (tcp_now_ns(&now) < 0)
        return ACCEPT_PAUSE_MS;
    int64_t until = -1;
    if (eng->accept_resume_ns) {
        if (now < eng->accept_resume_ns) {
            until = eng->accept_resume_ns;
        } else {
            struct epoll_event ev = {.events = EPOLLIN, .data.ptr = eng};
            if (epoll_ctl(eng->epfd, EPOLL_CTL_MOD, eng->listen_fd, &ev) < 0)
                until = now + (int64_t)ACCEPT_PAUSE_MS * 1000000;  /* retry, keep it */
            else
                eng->accept_resume_ns = 0;
        }
    }
    if (eng->pend_head && (until < 0 || eng->pend_head->deadline_ns < until))
        until = eng->pend_head->deadline_ns;
    if (until < 0)
        return -1;
    return until <= now ? 0 : (int)((until - now + 999999) / 1000000);
}

/* Close pending connections whose handshake time is up (oldest first). */
static void srv_expire_pending(dp_tcp *eng, struct tcp_srv_conn **dead)
{
    int64_t now;
    if (tcp_now_ns(&now) < 0)
        return;
    while (eng->pend_head && eng->pend_head->deadline_ns <= now)
        srv_close(eng, eng->pend_head, dead);
}

/* A new connection: served at once on an open engine; else challenged, unless
 * max_pending handshakes are under way (then closed: a flood of idle connections holds
 * at most max_pending descriptors, each for at most the handshake timeout). */
static int srv_greet(dp_tcp *eng, struct tcp_srv_conn *c)
{
    if (eng->flags & DP_TCP_OPEN) {
        c->admitted = 1;
        return 0;
    }
    if (eng->n_pending >= eng->max_pending)
        return -1;
    struct tcp_challenge ch = {.magic = htole32(TCP_CHALLENGE_MAGIC)};
    int64_t now;
    if (tcp_random(c->nonce, sizeof c->nonce) || tcp_now_ns(&now) < 0)
        return -1;
    memcpy(ch.nonce, c->nonce, sizeof ch.nonce);
    if (send(c->fd, &ch, sizeof ch, MSG_DONTWAIT | MSG_NOSIGNAL) != (ssize_t)sizeof ch)
        return -1;
    c->deadline_ns = tcp_deadline(now, (int64_t)eng->handshake_timeout_ms * 1000000);
    pend_add(eng, c);
    return 0;
}

static void srv_accept(dp_tcp *eng)
{
    for (;;) {
        int fd = accept4(eng->listen_fd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (fd < 0) {
            /* EAGAIN: done; ECONNABORTED and the like: the peer retries */
            if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM)
                srv_pause_accept(eng);
            return;
        }
        struct tcp_srv_conn *c = calloc(1, sizeof *c);
        if (!c) {
            close(fd);
            continue;
        }
        tune_socket(fd, eng->sockbuf, 0);
        c->fd = fd;
        c->events = EPOLLIN;
        TCP_STAT_ADD(eng, conns_accepted, 1);
        if (srv_greet(eng, c) < 0) {
            close(fd);
            free(c);
            TCP_STAT_ADD(eng, conns_refused, 1);
            continue;
        }
        c->next = eng->srv_conns;
        if (c->next)
            c->next->prev = c;
        eng->srv_conns = c;
        struct epoll_event ev = {.events = EPOLLIN, .data.ptr = c};
        if (epoll_ctl(eng->epfd, EPOLL_CTL_ADD, fd, &ev) < 0) {
            struct tcp_srv_conn *dead = NULL;
            srv_close(eng, c, &dead);
            free(dead);
        }
    }
}

static void *server_main(void *arg)
{
    dp_tcp *eng = arg;
    struct epoll_event ev[TCP_EVENTS];
    for (;;) {
        int k = epoll_wait(eng->epfd, ev, TCP_EVENTS, srv_timeout_ms(eng));
        if (k < 0 && errno != EINTR)
            break;
        struct tcp_srv_conn *dead = NULL;
        srv_expire_pending(eng, &dead);
        for (int i = 0; i < k; i++) {
            void *p = ev[i].data.ptr;
            if (p == &eng->wake_fd)
                goto out;
            if (p == eng) {
                srv_accept(eng);
                continue;
            }
            struct tcp_srv_conn *c = p;
            if (c->fd < 0)
                continue;    /* closed earlier in this batch */
            if (!c->admitted) {
                int h = tcp_srv_handshake(eng, c);
                if (h < 0) {
                    srv_close(eng, c, &dead);
                } else if (h > 0) {
                    pend_del(eng, c);    /* counted admitted by the handshake */
                }
                continue;
            }
            int rc = 0;
            if (c->events & EPOLLOUT) {    /* paused until the acks drain */
                rc = tcp_srv_flush_acks(c);
                if (rc == 0)
                    srv_set_events(eng, c, EPOLLIN);
            }
            if (rc == 0)
                rc = tcp_srv_readable(eng, c);
            if (rc < 0)
                srv_close(eng, c, &dead);
            else if (rc > 0 && c->events != EPOLLOUT) {
                TCP_STAT_ADD(eng, ack_stalls, 1);
                srv_set_events(eng, c, EPOLLOUT);
            }
        }
        while (dead) {
            struct tcp_srv_conn *c = dead;
            dead = c->next;
            free(c);
        }
    }
out:
    while (eng->srv_conns) {
        struct tcp_srv_conn *dead = NULL;
        srv_close(eng, eng->srv_conns, &dead);
        free(dead);
    }
    return NULL;
}

static int listen_on(dp_tcp *eng, const char *host, uint16_t port)
{
    struct addrinfo *ai;
    int err = resolve(host, port, 1, &ai);
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
    if (c.max_regions > 0xffff || c.sockbuf_bytes > (1u << 30) || (c.flags & ~DP_TCP_OPEN) ||
        c.max_credentials > 0xffff || c.max_pending > 65536 ||
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
    eng->handshake_timeout_ms = c.handshake_timeout_ms;
    eng->max_conns_per_peer = c.max_conns_per_peer;
    eng->max_creds = c.max_credentials;
    pthread_mutex_init(&eng->cred_lock, NULL);
    pthread_rwlockattr_t attr;
    pthread_rwlockattr_init(&attr);
    /* reg/dereg must not starve behind the server thread's back-to-back read locks */
    pthread_rwlockattr_setkind_np(&attr, PTHREAD_RWLOCK_PREFER_WRITER_NONRECURSIVE_NP);
    pthread_rwlock_init(&eng->lock, &attr);
    pthread_rwlockattr_destroy(&attr);
    eng->regions = calloc(c.max_regions, sizeof *eng->regions);
    eng->creds = calloc(c.max_credentials, sizeof *eng->creds);
    eng->discard = malloc(TCP_DISCARD);
    int err = ENOMEM;
    if (!eng->regions || !eng->creds || !eng->discard)
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
    err = pthread_create(&eng->thread, NULL, server_main, eng);
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
                              DP_ACCESS_REMOTE_READ)) ||
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
    tune_socket(fd, cfg->sockbuf_bytes, cfg->user_timeout_ms);
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
    int err = resolve(host, port, 0, &ai);
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
         * work requests. A fence relies on it (dualpath/engine/fence.py). */
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
