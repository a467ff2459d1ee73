/*
 * tcp_target.c - the TCP provider's target: the engine's server thread and the receive
 * path it runs. Control (the engine, regions, CQs, the initiator's connections) is in
 * tcp_ctl.c, the initiator's data path in tcp_dp.c, admission in tcp_auth.c.
 *
 * Server thread: one per engine, blocked in epoll_wait on the listening socket, an
 * eventfd that dp_tcp_destroy writes to stop it, and the accepted sockets (level-
 * triggered). It owns the accepted sockets outright; the only state it shares is the
 * region table, under eng->lock. Connections closed while handling one epoll batch are
 * freed after the batch, so a later event of that batch never reads freed memory.
 *
 * Receive path: per accepted socket a small state machine: read a header, check it, then
 * recvmsg the payload straight into the region with the next header in the same call
 * ([payload rest][next header] iovecs), so a small WRITE costs one recvmsg and a large
 * one no copy beyond the kernel's. The region is rechecked under the table's read lock
 * around every recvmsg into it, so a dereg can never race a write into freed memory. A
 * scoped region (DP_TCP_SCOPED) also needs a window granted to the writer's peer tag
 * (tcp_scope.c), found before the payload is aimed and rechecked with the region, so
 * an ungrant stops a WRITE under way.
 */
#include <endian.h>
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <netinet/in.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <unistd.h>

#include "tcp_internal.h"

enum {
    ACCEPT_PAUSE_MS = 100,   /* how long the listener is ignored after EMFILE and the like */
};

/* ------------------------------------------------------------------ receive path */

static inline void srv_ack(struct tcp_srv_conn *c, int32_t status)
{
    struct tcp_ack *a = &c->acks[c->ack_n++];
    a->seq = htole64(c->cur_seq);
    a->status = (int32_t)htole32((uint32_t)status);
    a->_pad = 0;
}

/* The current item failed: ack it with `status` and drop the rest of the stream. */
static inline void srv_fail(struct tcp_srv_conn *c, int32_t status)
{
    srv_ack(c, status);
    c->flushing = 1;
    c->dst = NULL;
}

static inline void srv_item_done(dp_tcp *eng, struct tcp_srv_conn *c)
{
    if (c->flushing)
        return;
    TCP_STAT_ADD(eng, writes, 1);
    TCP_STAT_ADD(eng, bytes, c->cur_len);
    if (c->cur_signalled)
        srv_ack(c, TCP_WC_SUCCESS);
}

/* A whole header is in c->hdr: check it and aim the payload. -1 = protocol violation. */
static int srv_begin(dp_tcp *eng, struct tcp_srv_conn *c)
{
    const struct tcp_req_hdr *h = &c->hdr;
    if (h->magic != TCP_MAGIC || (h->op != TCP_OP_WRITE && h->op != TCP_OP_LOCERR))
        return -1;
    c->cur_seq = le64toh(h->seq);
    c->cur_signalled = h->signalled;
    c->left = c->cur_len = le32toh(h->length);
    c->dst = NULL;
    if (c->flushing) {
        TCP_STAT_ADD(eng, flushed, 1);      /* drained silently */
    } else if (h->op == TCP_OP_LOCERR) {
        srv_fail(c, TCP_WC_LOC_PROT_ERR);
    } else {
        uint64_t addr = le64toh(h->remote_addr);
        uint32_t key = le32toh(h->rkey);
        pthread_rwlock_rdlock(&eng->lock);
        const struct tcp_region *r = region_find(eng, key);
        int ok = r && (r->access & DP_ACCESS_REMOTE_WRITE) && region_covers(r, addr, c->left);
        uint32_t g = 0, scoped = ok && (r->access & DP_TCP_SCOPED) &&
                                !(c->peer & DP_TCP_PEER_TRUSTED);
        if (scoped) {
            g = tcp_scope_find(eng, c->peer, r, addr, c->left, c->grant);
            ok = g != 0;
        }
        if (ok) {
            c->dst = (uint8_t *)(uintptr_t)addr;
            c->slot = (uint32_t)(r - eng->regions);
            c->key = key;
            c->grant = g ? g - 1 : c->grant;
            c->grant_id = g ? eng->grants[g - 1].id : 0;
        }
        pthread_rwlock_unlock(&eng->lock);
        if (!ok) {
            TCP_STAT_ADD(eng, refused, 1);
            if (scoped)
                TCP_STAT_ADD(eng, out_of_scope, 1);
            srv_fail(c, TCP_WC_REM_ACCESS_ERR);
        }
    }
    if (c->left == 0)
        srv_item_done(eng, c);
    return 0;
}

static int srv_flush_acks(struct tcp_srv_conn *c)
{
    size_t total = (size_t)c->ack_n * sizeof(struct tcp_ack);
    while (c->ack_off < total) {
        ssize_t r = send(c->fd, (uint8_t *)c->acks + c->ack_off, total - c->ack_off,
                         MSG_DONTWAIT | MSG_NOSIGNAL);
        if (r < 0) {
            if (errno == EINTR)
                continue;
            return errno == EAGAIN || errno == EWOULDBLOCK ? 1 : -1;
        }
        c->ack_off += (uint32_t)r;
    }
    c->ack_n = 0;
    c->ack_off = 0;
    return 0;
}

/* Serve a readable socket: 0 = keep reading, 1 = acks are stuck (wait for EPOLLOUT
 * before reading more), -1 = close it (EOF, error, protocol violation). */
static int srv_readable(dp_tcp *eng, struct tcp_srv_conn *c)
{
    for (int iter = 0; iter < TCP_SRV_BUDGET; iter++) {
        if (c->ack_n + 2 > TCP_SRV_ACKS) {     /* one recvmsg queues at most two acks */
            int f = srv_flush_acks(c);
            if (f != 0)
                return f;
        }
        struct iovec iov[2];
        int niov = 1, into_region = 0;
        if (c->left) {
            uint64_t chunk = c->left;
            if (c->dst) {
                into_region = 1;
                if (chunk > (1u << 30))
                    chunk = 1u << 30;
                iov[0].iov_base = c->dst;
            } else {
                if (chunk > TCP_DISCARD)
                    chunk = TCP_DISCARD;
                iov[0].iov_base = eng->discard;
            }
            iov[0].iov_len = chunk;
            if (chunk == c->left) {            /* the next header may ride along */
                iov[1].iov_base = &c->hdr;
                iov[1].iov_len = sizeof c->hdr;
                niov = 2;
            }
        } else {
            iov[0].iov_base = (uint8_t *)&c->hdr + c->hdr_got;
            iov[0].iov_len = sizeof c->hdr - c->hdr_got;
        }
        size_t want = iov[0].iov_len + (niov == 2 ? iov[1].iov_len : 0);
        if (into_region) {
            pthread_rwlock_rdlock(&eng->lock);
            const struct tcp_region *r = &eng->regions[c->slot];
            int ungranted = c->grant_id && !tcp_scope_live(eng, c->grant, c->grant_id);
            if (!r->live || r->key != c->key || ungranted) {  /* dereg'd/ungranted mid-WRITE */
                pthread_rwlock_unlock(&eng->lock);
                TCP_STAT_ADD(eng, refused, 1);
                if (ungranted)
                    TCP_STAT_ADD(eng, out_of_scope, 1);
                srv_fail(c, TCP_WC_REM_ACCESS_ERR);
                continue;
            }
        }
        struct msghdr msg = {.msg_iov = iov, .msg_iovlen = (size_t)niov};
        ssize_t r = recvmsg(c->fd, &msg, MSG_DONTWAIT);
        int err = errno;
        if (into_region)
            pthread_rwlock_unlock(&eng->lock);
        if (r == 0)
            return -1;
        if (r < 0) {
            if (err == EINTR)
                continue;
            if (err == EAGAIN || err == EWOULDBLOCK)
                break;
            return -1;
        }
        size_t got = (size_t)r;
        if (c->left) {
            size_t k = got < iov[0].iov_len ? got : iov[0].iov_len;
            c->left -= k;
            if (c->dst)
                c->dst += k;
            got -= k;
            if (c->left == 0)
                srv_item_done(eng, c);
        }
        c->hdr_got += (uint32_t)got;
        if (c->hdr_got == sizeof c->hdr) {
            c->hdr_got = 0;
            if (srv_begin(eng, c) < 0)
                return -1;
        }
        if ((size_t)r < want)
            break;      /* the socket is empty: level-triggered epoll calls again */
    }
    return srv_flush_acks(c);
}

/* ------------------------------------------------------------------ server thread */

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
 * for ACCEPT_PAUSE_MS (tcp_target_main watches it again), as libuv and nginx do. */
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

/* Handshakes under way from c's source address (a walk of at most max_pending). */
static uint32_t pend_from(const dp_tcp *eng, const struct tcp_srv_conn *c)
{
    uint32_t n = 0;
    for (const struct tcp_srv_conn *p = eng->pend_head; p; p = p->pend_next)
        n += p->addr_len == c->addr_len && !memcmp(p->addr, c->addr, c->addr_len);
    return n;
}

/* A new connection: served at once on an open engine; else challenged, unless
 * max_pending handshakes are under way, or max_pending_per_addr from its address (then
 * closed: a flood of idle connections holds at most max_pending descriptors, each for
 * at most the handshake timeout, and one address at most its share of them). */
static int srv_greet(dp_tcp *eng, struct tcp_srv_conn *c)
{
    if (eng->flags & DP_TCP_OPEN) {
        c->admitted = 1;
        return 0;
    }
    if (eng->n_pending >= eng->max_pending || pend_from(eng, c) >= eng->max_pending_per_addr)
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

/* The source address of an accepted connection, as compared by pend_from. */
static void srv_addr(struct tcp_srv_conn *c, const struct sockaddr_storage *ss)
{
    if (ss->ss_family == AF_INET) {
        memcpy(c->addr, &((const struct sockaddr_in *)ss)->sin_addr, 4);
        c->addr_len = 4;
    } else if (ss->ss_family == AF_INET6) {
        memcpy(c->addr, &((const struct sockaddr_in6 *)ss)->sin6_addr, 16);
        c->addr_len = 16;
    }
}

static void srv_accept(dp_tcp *eng)
{
    for (;;) {
        struct sockaddr_storage ss = {0};
        socklen_t ss_len = sizeof ss;
        int fd = accept4(eng->listen_fd, (struct sockaddr *)&ss, &ss_len,
                         SOCK_NONBLOCK | SOCK_CLOEXEC);
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
        tcp_tune_socket(fd, eng->sockbuf, 0);
        srv_addr(c, &ss);
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

void *tcp_target_main(void *arg)
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
                rc = srv_flush_acks(c);
                if (rc == 0)
                    srv_set_events(eng, c, EPOLLIN);
            }
            if (rc == 0)
                rc = srv_readable(eng, c);
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
