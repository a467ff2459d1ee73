/*
 * tcp_dp.c - the TCP provider's initiator data path: post / poll / wait. The target's
 * receive path is tcp_target.c's, control tcp_ctl.c's. Nothing here allocates.
 *
 * Initiator: a post validates each item's local range against the engine's regions
 * (one read lock per batch), fills ring slots (the 32-byte header lives in the slot, so
 * it can be sent from there) and sends as much as the socket takes with ONE gathered
 * sendmsg of header/payload pairs. What the socket does not take is sent from poll/wait
 * when epoll (edge-triggered) says the socket drained. Acks are read in bulk into
 * ackbuf and turned into completions in order; a completion retires the acked item and
 * every unsignalled one before it, exactly like an RC send queue.
 */
#include <endian.h>
#include <errno.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "tcp_internal.h"

/* ------------------------------------------------------------------ initiator */

static void ready_add(dp_tcp_conn *c)
{
    if (c->on_ready)
        return;
    c->on_ready = 1;
    c->ready_next = c->cq->ready;
    c->cq->ready = c;
}

void tcp_ready_remove(dp_tcp_conn *c)
{
    if (!c->on_ready)
        return;
    for (dp_tcp_conn **p = &c->cq->ready; *p; p = &(*p)->ready_next) {
        if (*p == c) {
            *p = c->ready_next;
            break;
        }
    }
    c->on_ready = 0;
    c->ready_next = NULL;
}

/* RTS -> ERR: the socket goes; every outstanding item will be completed by take_flush,
 * the first with `status` (vendor_err = err). */
void tcp_conn_fail(dp_tcp_conn *c, int32_t status, uint32_t err)
{
    if (c->state != TCP_RTS)
        return;
    if (c->fd >= 0) {
        epoll_ctl(c->cq->epfd, EPOLL_CTL_DEL, c->fd, NULL);
        close(c->fd);
        c->fd = -1;
    }
    c->state = TCP_ERR;
    c->fail_status = status;
    c->fail_errno = err;
    c->rx_more = 0;
    c->tx_blocked = 0;
    ready_add(c);
}

static inline uint64_t wqe_wire_bytes(const struct tcp_wqe *w)
{
    return sizeof w->hdr + (w->hdr.op == TCP_OP_WRITE ? w->length : 0);
}

/* Account `r` bytes sent from the cursor (send_idx, send_off). */
static void send_advance(dp_tcp_conn *c, size_t r)
{
    while (r > 0) {
        const struct tcp_wqe *w = &c->ring[c->send_idx & c->mask];
        uint64_t rest = wqe_wire_bytes(w) - c->send_off;
        if (r < rest) {
            c->send_off += r;
            return;
        }
        r -= rest;
        c->send_off = 0;
        c->send_idx++;
        if (w->hdr.op == TCP_OP_LOCERR)
            c->tx_stopped = 1;
    }
}

/* Send queued items until the socket is full: header/payload pairs gathered into one
 * sendmsg per TCP_IOV_MAX/2 items. Stops after a LOCERR item (nothing may follow it). */
static void send_progress(dp_tcp_conn *c)
{
    while (c->state == TCP_RTS && !c->tx_blocked && !c->tx_stopped && c->send_idx != c->tail) {
        struct iovec *iov = c->iov;
        uint32_t niov = 0;
        size_t total = 0;
        uint64_t off = c->send_off;
        for (uint64_t i = c->send_idx; i != c->tail && niov + 2 <= TCP_IOV_MAX; i++) {
            struct tcp_wqe *w = &c->ring[i & c->mask];
            uint64_t plen = w->hdr.op == TCP_OP_WRITE ? w->length : 0;
            if (off < sizeof w->hdr) {
                iov[niov].iov_base = (uint8_t *)&w->hdr + off;
                iov[niov].iov_len = sizeof w->hdr - off;
                total += iov[niov++].iov_len;
                off = 0;
            } else {
                off -= sizeof w->hdr;
            }
            if (plen > off) {
                iov[niov].iov_base = (uint8_t *)(uintptr_t)w->local_addr + off;
                iov[niov].iov_len = plen - off;
                total += iov[niov++].iov_len;
            }
            off = 0;
            if (w->hdr.op == TCP_OP_LOCERR)
                break;
        }
        struct msghdr msg = {.msg_iov = iov, .msg_iovlen = niov};
        ssize_t r = sendmsg(c->fd, &msg, MSG_DONTWAIT | MSG_NOSIGNAL);
        if (r < 0) {
            if (errno == EINTR)
                continue;
            if (errno == EAGAIN || errno == EWOULDBLOCK) {
                c->tx_blocked = 1;
                return;
            }
            tcp_conn_fail(c, TCP_WC_RETRY_EXC_ERR, (uint32_t)errno);
            return;
        }
        send_advance(c, (size_t)r);
        if ((size_t)r < total) {
            /* A short non-blocking send set SOCK_NOSPACE: EPOLLOUT follows when it drains. */
            c->tx_blocked = 1;
            return;
        }
    }
}

static inline void retire_through(dp_tcp_conn *c, uint64_t idx)
{
    if (c->ring[idx & c->mask].signalled) {
        c->sig_outstanding--;
        c->cq->sig_outstanding--;
    }
    c->head = idx + 1;
}

/* One ack from ackbuf -> 0 or 1 completion. */
static uint32_t take_ack(dp_tcp_conn *c, struct dp_wc *wc)
{
    struct tcp_ack a;
    memcpy(&a, c->ackbuf + c->ack_pos, sizeof a);
    c->ack_pos += sizeof a;
    uint64_t seq = le64toh(a.seq);
    int32_t status = (int32_t)le32toh((uint32_t)a.status);
    const struct tcp_wqe *w = &c->ring[seq & c->mask];
    /* A failure may be acked as soon as its header arrived, before all its payload. */
    uint64_t sent_end = c->send_idx + (c->send_off > 0);
    if (seq < c->head || seq >= sent_end || (status == TCP_WC_SUCCESS && !w->signalled)) {
        c->ack_pos = c->ack_len;
        tcp_conn_fail(c, TCP_WC_RETRY_EXC_ERR, EPROTO);
        return 0;
    }
    wc->wr_id = w->wr_id;
    wc->status = status;
    wc->qp_num = c->id;
    wc->retired = (uint32_t)(seq - c->head + 1);
    wc->vendor_err = 0;
    retire_through(c, seq);
    if (status != TCP_WC_SUCCESS) {
        /* The target dropped the rest of the stream: everything later is flushed. */
        c->ack_pos = c->ack_len;
        tcp_conn_fail(c, TCP_WC_WR_FLUSH_ERR, 0);
    }
    return 1;
}

/* In ERR: complete the oldest outstanding signalled item (and the unsignalled ones
 * before it) without the peer. */
static void take_flush(dp_tcp_conn *c, struct dp_wc *wc)
{
    uint64_t j = c->head;
    while (j + 1 < c->tail && !c->ring[j & c->mask].signalled)
        j++;
    const struct tcp_wqe *w = &c->ring[j & c->mask];
    wc->wr_id = w->wr_id;
    wc->status = c->fail_status;
    wc->qp_num = c->id;
    wc->retired = (uint32_t)(j - c->head + 1);
    wc->vendor_err = c->fail_errno;
    c->fail_status = TCP_WC_WR_FLUSH_ERR;
    retire_through(c, j);
}

static void read_acks(dp_tcp_conn *c)
{
    if (c->ack_pos > 0) {
        memmove(c->ackbuf, c->ackbuf + c->ack_pos, c->ack_len - c->ack_pos);
        c->ack_len -= c->ack_pos;
        c->ack_pos = 0;
    }
    size_t room = sizeof c->ackbuf - c->ack_len;
    ssize_t r = recv(c->fd, c->ackbuf + c->ack_len, room, MSG_DONTWAIT);
    if (r > 0) {
        c->ack_len += (uint32_t)r;
        if ((size_t)r < room)
            c->rx_more = 0;    /* drained: the next arrival raises a new edge */
    } else if (r == 0) {
        tcp_conn_fail(c, TCP_WC_RETRY_EXC_ERR, ECONNRESET);
    } else if (errno == EAGAIN || errno == EWOULDBLOCK) {
        c->rx_more = 0;
    } else if (errno != EINTR) {
        tcp_conn_fail(c, TCP_WC_RETRY_EXC_ERR, (uint32_t)errno);
    }
}

/* A connection to itself: the oldest copied signalled item -> its completion; else the
 * failed item (retiring the unsignalled ones copied before it), and the rest flushed. */
static uint32_t self_take(dp_tcp_conn *c, struct dp_wc *wc)
{
    uint64_t j = c->head;
    int32_t status = TCP_WC_SUCCESS;
    if (c->self_sig_done) {
        while (!c->ring[j & c->mask].signalled)
            j++;
        c->self_sig_done--;
    } else {
        j = c->self_done;
        status = c->self_status;
        c->self_status = 0;
    }
    wc->wr_id = c->ring[j & c->mask].wr_id;
    wc->status = status;
    wc->qp_num = c->id;
    wc->retired = (uint32_t)(j - c->head + 1);
    wc->vendor_err = 0;
    retire_through(c, j);
    if (status != TCP_WC_SUCCESS)
        tcp_conn_fail(c, TCP_WC_WR_FLUSH_ERR, 0);
    return 1;
}

static inline int self_has_work(const dp_tcp_conn *c)
{
    return c->self && c->state == TCP_RTS && (c->self_sig_done || c->self_status);
}

/* Post on a connection to itself: copy items [tail, tail + k), already in the ring, until
 * one fails. Each item is checked and copied under the region table's read lock, taken
 * per item (a dereg waits for one copy, not a batch); both regions are checked then, so
 * neither can go while it is copied. */
static void self_copy(dp_tcp_conn *c, const struct dp_item *items, uint64_t k)
{
    dp_tcp *eng = c->eng;
    for (uint64_t i = 0; i < k && !c->self_status; i++) {
        const struct dp_item *it = &items[i];
        const struct tcp_wqe *w = &c->ring[(c->tail + i) & c->mask];
        pthread_rwlock_rdlock(&eng->lock);
        const struct tcp_region *l = region_find(eng, it->lkey);
        const struct tcp_region *r = region_find(eng, it->rkey);
        int32_t status = TCP_WC_LOC_PROT_ERR;
        if (w->hdr.op == TCP_OP_WRITE && l && region_covers(l, it->local_addr, it->length))
            status = r && (r->access & DP_ACCESS_REMOTE_WRITE) &&
                             region_covers(r, it->remote_addr, it->length)
                         ? TCP_WC_SUCCESS : TCP_WC_REM_ACCESS_ERR;
        if (status == TCP_WC_SUCCESS && it->length)
            memmove((void *)(uintptr_t)it->remote_addr, (const void *)(uintptr_t)it->local_addr,
                    it->length);
        pthread_rwlock_unlock(&eng->lock);
        if (status != TCP_WC_SUCCESS) {
            c->self_status = status;
            c->self_done = c->tail + i;
            break;
        }
        c->self_done = c->tail + i + 1;
        c->self_sig_done += w->signalled;
    }
}

static inline int conn_has_work(const dp_tcp_conn *c)
{
    return self_has_work(c) || c->ack_len - c->ack_pos >= sizeof(struct tcp_ack) ||
           (c->state == TCP_RTS && c->rx_more) || (c->state == TCP_ERR && c->head != c->tail);
}

static uint32_t conn_drain(dp_tcp_conn *c, struct dp_wc *out, uint32_t max)
{
    uint32_t n = 0;
    while (n < max) {
        if (self_has_work(c))
            n += self_take(c, &out[n]);
        else if (c->ack_len - c->ack_pos >= sizeof(struct tcp_ack))
            n += take_ack(c, &out[n]);
        else if (c->state == TCP_RTS && c->rx_more)
            read_acks(c);
        else if (c->state == TCP_ERR && c->head != c->tail)
            take_flush(c, &out[n++]);
        else
            break;
    }
    return n;
}

static uint32_t drain_ready(dp_tcp_cq *cq, struct dp_wc *out, uint32_t max)
{
    uint32_t n = 0;
    dp_tcp_conn *list = cq->ready;
    cq->ready = NULL;
    while (list) {
        dp_tcp_conn *c = list;
        list = c->ready_next;
        c->on_ready = 0;
        c->ready_next = NULL;
        if (n < max)
            n += conn_drain(c, out + n, max - n);
        if (conn_has_work(c))
            ready_add(c);
    }
    return n;
}

/* epoll_pwait2 (ns resolution) where the kernel has it, epoll_wait (ms, rounded up) else. */
static int cq_epoll(dp_tcp_cq *cq, struct epoll_event *ev, int64_t timeout_ns)
{
    static int no_pwait2;
    if (!no_pwait2) {
        struct timespec ts = {.tv_sec = timeout_ns / 1000000000,
                              .tv_nsec = timeout_ns % 1000000000};
        int k = epoll_pwait2(cq->epfd, ev, TCP_EVENTS, &ts, NULL);
        if (k >= 0 || errno != ENOSYS)
            return k;
        no_pwait2 = 1;
    }
    int64_t ms = (timeout_ns + 999999) / 1000000;
    return epoll_wait(cq->epfd, ev, TCP_EVENTS, ms > 1000000 ? 1000000 : (int)ms);
}

/* Wait up to timeout_ns for socket events and act on them: send on EPOLLOUT, mark the
 * connection for reading on anything else. */
static void cq_collect(dp_tcp_cq *cq, int64_t timeout_ns)
{
    struct epoll_event ev[TCP_EVENTS];
    int k = cq_epoll(cq, ev, timeout_ns);
    for (int i = 0; i < k; i++) {
        dp_tcp_conn *c = ev[i].data.ptr;
        if (!c) {
            uint64_t v;
            if (read(cq->wake_fd, &v, sizeof v) < 0) { /* already cleared */ }
            cq->woken = 1;
            continue;
        }
        if (c->state != TCP_RTS)
            continue;
        if (ev[i].events & EPOLLOUT) {
            c->tx_blocked = 0;
            send_progress(c);
        }
        if (ev[i].events & (EPOLLIN | EPOLLRDHUP | EPOLLHUP | EPOLLERR)) {
            c->rx_more = 1;
            ready_add(c);
        }
    }
}

int dp_tcp_post_write(dp_tcp_conn *c, const struct dp_item *items, uint32_t n,
                      uint32_t signal_every, uint32_t *n_posted)
{
    if (n_posted)
        *n_posted = 0;
    if (!c || (!items && n) || !n_posted || signal_every == 0)
        return -EINVAL;
    if (c->state == TCP_RESET)
        return -ENOTCONN;
    if (n == 0)
        return 0;
    dp_tcp_cq *cq = c->cq;
    uint64_t k = c->cfg.max_send_wr - (c->tail - c->head);
    if (k > n)
        k = n;
    /* The last posted item is signalled, so k items need ceil((run + k) / every)
     * signalled slots on the CQ (run capped below `every`: the first one then signals). */
    uint64_t run = c->unsig_run < signal_every ? c->unsig_run : signal_every - 1;
    uint64_t by_cq = (uint64_t)(cq->depth - cq->sig_outstanding) * signal_every;
    by_cq = by_cq > run ? by_cq - run : 0;
    if (k > by_cq)
        k = by_cq;
    if (k == 0)
        return -EAGAIN;

    dp_tcp *eng = c->eng;
    uint32_t nsig = 0;
    pthread_rwlock_rdlock(&eng->lock);
    for (uint64_t i = 0; i < k; i++) {
        const struct dp_item *it = &items[i];
        struct tcp_wqe *w = &c->ring[(c->tail + i) & c->mask];
        const struct tcp_region *r = region_find(eng, it->lkey);
        int ok = r && region_covers(r, it->local_addr, it->length);
        int sig = ++c->unsig_run >= signal_every || i + 1 == k;
        if (sig)
            c->unsig_run = 0;
        w->hdr.magic = TCP_MAGIC;
        w->hdr.op = ok ? TCP_OP_WRITE : TCP_OP_LOCERR;
        w->hdr.signalled = (uint8_t)sig;
        w->hdr.length = htole32(ok ? it->length : 0);
        w->hdr.rkey = htole32(it->rkey);
        w->hdr.remote_addr = htole64(it->remote_addr);
        w->hdr.seq = htole64(c->tail + i);
        w->local_addr = it->local_addr;
        w->wr_id = it->wr_id;
        w->length = it->length;
        w->signalled = (uint8_t)sig;
        nsig += (uint32_t)sig;
    }
    pthread_rwlock_unlock(&eng->lock);
    if (c->self && c->state == TCP_RTS)
        self_copy(c, items, k);
    c->tail += k;
    c->sig_outstanding += nsig;
    cq->sig_outstanding += nsig;
    *n_posted = (uint32_t)k;
    if (c->self && c->state == TCP_RTS) {
        c->send_idx = c->tail;        /* nothing to send: copied (or refused) already */
        if (self_has_work(c))
            ready_add(c);
    } else if (c->state == TCP_RTS) {
        send_progress(c);
    } else {
        ready_add(c);    /* ERR: flushed by the next poll, as verbs does */
    }
    return k < n ? -EAGAIN : 0;
}

int dp_tcp_cq_poll(dp_tcp_cq *cq, struct dp_wc *out, uint32_t max)
{
    if (!cq || (!out && max))
        return -EINVAL;
    if (max == 0)
        return 0;
    uint32_t n = drain_ready(cq, out, max);
    if (n < max) {
        cq_collect(cq, 0);
        n += drain_ready(cq, out + n, max - n);
    }
    return (int)n;
}

int dp_tcp_cq_wait(dp_tcp_cq *cq, struct dp_wc *out, uint32_t max, int64_t timeout_ns)
{
    int64_t now, deadline;
    if (tcp_now_ns(&now) < 0)
        return -errno;
    deadline = tcp_deadline(now, timeout_ns);
    for (;;) {
        int n = dp_tcp_cq_poll(cq, out, max);
        if (n != 0 || cq->woken) {
            cq->woken = 0;
            return n;
        }
        if (tcp_now_ns(&now) < 0)
            return -errno;
        if (now >= deadline)
            return 0;
        cq_collect(cq, deadline - now);
    }
}
