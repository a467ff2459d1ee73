/*
 * verbs_dp.c - the verbs data path: post a batch of RDMA WRITEs over the QP's prebuilt
 * chain with one ibv_post_send, and poll completions into the caller's array. No
 * allocation, no locks; one thread at a time per QP and its CQ (dp.h). The sequence
 * numbering and the credit ring are described in verbs_internal.h.
 */
#include <errno.h>
#include <sched.h>
#include <stdlib.h>
#include <time.h>

#include "verbs_internal.h"

/* ibv_wc entries fetched per ibv_poll_cq call, on the stack. */
#define DP_POLL_BATCH 32
/* Empty polls in dp_cq_wait before it starts yielding the CPU between polls. */
#define DP_SPIN_BEFORE_YIELD 1024

void dp_qp_drop_credits(dp_qp *qp)
{
    qp->send_cq->sig_outstanding -= (uint32_t)(qp->sig_posted - qp->sig_retired);
    qp->sig_retired = qp->sig_posted;
    qp->tail = qp->head;
    qp->since_signal = 0;
}

/* How many of `want` WRs fit the credits: the QP's free slots, and a signalled count
 * within the CQ's free depth. With c WRs since the last signal, every N-th signalled and
 * the last one always signalled, k WRs need ceil((c + k) / N) signals; the largest k
 * needing at most r signals is r * N - c. c counts against the previous post's N, so it
 * may be >= this N (the first WR then signals): it counts as N - 1, or r * N - c would
 * wrap and let every WR of the post signal past the CQ's depth. */
static uint32_t credit_limit(const dp_qp *qp, uint32_t want, uint32_t every)
{
    uint32_t qp_room = qp->cfg.max_send_wr - (uint32_t)(qp->head - qp->tail);
    uint32_t sig_room = qp->send_cq->depth - qp->send_cq->sig_outstanding;
    uint64_t k = want < qp_room ? want : qp_room;
    uint32_t since = qp->since_signal < every ? qp->since_signal : every - 1;
    uint64_t by_cq = (uint64_t)sig_room * every - since;

    if (sig_room == 0)
        return 0;
    return (uint32_t)(k < by_cq ? k : by_cq);
}

int dp_qp_post_write(dp_qp *qp, const struct dp_item *items, uint32_t n,
                     uint32_t signal_every, uint32_t *n_posted)
{
    if (n_posted != NULL)
        *n_posted = 0;
    if (qp == NULL || (items == NULL && n > 0) || signal_every == 0 || n_posted == NULL)
        return -EINVAL;
    if (n == 0)
        return 0;
    /* Our own guard: some providers (rxe) queue WRs on a RESET QP and fail only at the
     * doorbell, leaving them to run after a later connect. */
    if (qp->state != IBV_QPS_RTS)
        return -EINVAL;

    uint32_t k = credit_limit(qp, n, signal_every);
    if (k == 0)
        return -EAGAIN;

    struct ibv_send_wr *wr = qp->wrs;
    struct ibv_sge *sge = qp->sges;
    uint64_t seq = qp->head;
    uint64_t sig = qp->sig_posted;
    uint32_t since = qp->since_signal;
    uint32_t inline_max = qp->cfg.max_inline;

    /* The post's last WR is signalled unless the caller opted out, and always when it
     * fills the QP: otherwise no completion could ever retire the unsignalled tail. */
    int fills = qp->head + k - qp->tail == qp->cfg.max_send_wr;
    int last_signal = fills || !(items[k - 1].flags & DP_ITEM_UNSIGNALLED_LAST);

    for (uint32_t i = 0; i < k; i++, seq++) {
        const struct dp_item *it = &items[i];
        int signalled = ++since >= signal_every || (i + 1 == k && last_signal);

        since = signalled ? 0 : since;
        sig += (uint64_t)signalled;
        sge[i].addr = it->local_addr;
        sge[i].length = it->length;
        sge[i].lkey = it->lkey;
        wr[i].wr_id = seq;
        wr[i].wr.rdma.remote_addr = it->remote_addr;
        wr[i].wr.rdma.rkey = it->rkey;
        wr[i].send_flags = (signalled ? IBV_SEND_SIGNALED : 0) |
                           (it->length <= inline_max ? IBV_SEND_INLINE : 0);
        qp->ring[seq & qp->ring_mask].wr_id = it->wr_id;
        qp->ring[seq & qp->ring_mask].sig_prefix = sig;
    }

    struct ibv_send_wr *bad = NULL;
    struct ibv_send_wr *cut = wr[k - 1].next;
    wr[k - 1].next = NULL;
    int rc = ibv_post_send(qp->ibv, wr, &bad);
    wr[k - 1].next = cut;

    uint32_t went = k;
    if (rc) {
        /* bad == NULL: the provider queued every WR and failed later (rxe's doorbell);
         * they are in the send queue, so they are counted as posted. */
        if (bad != NULL)
            went = (uint32_t)(bad - wr);
        rc = -abs(rc);
        if (went < k) {
            /* Recount what did go out: the signals among the first `went`, and the WRs
             * after the last signalled one. */
            sig = went ? qp->ring[(qp->head + went - 1) & qp->ring_mask].sig_prefix
                       : qp->sig_posted;
            since = qp->since_signal;
            for (uint32_t i = 0; i < went; i++)
                since = (wr[i].send_flags & IBV_SEND_SIGNALED) ? 0 : since + 1;
        }
    } else if (k < n) {
        rc = -EAGAIN;
    }
    qp->send_cq->sig_outstanding += (uint32_t)(sig - qp->sig_posted);
    qp->sig_posted = sig;
    qp->since_signal = since;
    qp->head += went;
    *n_posted = went;
    return rc;
}

static dp_qp *cq_lookup(dp_cq *cq, uint32_t qp_num)
{
    if (cq->last != NULL && cq->last->qp_num == qp_num)
        return cq->last;
    for (uint32_t i = 0; i < cq->n_qps; i++)
        if (cq->qps[i]->qp_num == qp_num)
            return cq->last = cq->qps[i];
    return NULL;
}

/* Turn one ibv completion into a dp_wc and return its credits; 0 when it is stale (a QP
 * reset or destroyed since it was posted) or not ours (a receive). */
static int retire(dp_cq *cq, const struct ibv_wc *wc, struct dp_wc *out)
{
    dp_qp *qp = cq_lookup(cq, wc->qp_num);
    uint64_t seq = wc->wr_id;

    if (qp == NULL || (wc->status == IBV_WC_SUCCESS && (wc->opcode & IBV_WC_RECV)) ||
        seq < qp->tail || seq >= qp->head)
        return 0;
    const struct dp_slot *s = &qp->ring[seq & qp->ring_mask];
    out->wr_id = s->wr_id;
    out->status = (int32_t)wc->status;
    out->qp_num = wc->qp_num;
    out->retired = (uint32_t)(seq + 1 - qp->tail);
    out->vendor_err = wc->vendor_err;
    cq->sig_outstanding -= (uint32_t)(s->sig_prefix - qp->sig_retired);
    qp->sig_retired = s->sig_prefix;
    qp->tail = seq + 1;
    return 1;
}

int dp_cq_poll(dp_cq *cq, struct dp_wc *out, uint32_t max)
{
    struct ibv_wc wc[DP_POLL_BATCH];
    uint32_t got = 0;

    if (cq == NULL || (out == NULL && max > 0))
        return -EINVAL;
    while (got < max) {
        int want = max - got < DP_POLL_BATCH ? (int)(max - got) : DP_POLL_BATCH;
        int r = ibv_poll_cq(cq->ibv, want, wc);
        if (r < 0)
            return got ? (int)got : -EIO;
        for (int i = 0; i < r; i++)
            got += (uint32_t)retire(cq, &wc[i], &out[got]);
        if (r < want)
            break;
    }
    return (int)got;
}

static int64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

int dp_cq_wait(dp_cq *cq, struct dp_wc *out, uint32_t max, int64_t timeout_ns)
{
    if (cq == NULL || out == NULL || max == 0 || timeout_ns < 0)
        return -EINVAL;
    /* Saturate: a huge timeout (INT64_MAX = "for ever") must not wrap into the past. */
    int64_t now = now_ns();
    int64_t deadline = timeout_ns > INT64_MAX - now ? INT64_MAX : now + timeout_ns;
    for (uint32_t spins = 0;; spins++) {
        int r = dp_cq_poll(cq, out, max);
        if (r != 0)
            return r;
        if (now_ns() >= deadline)
            return 0;
        /* On a shared or emulated CPU (rxe's responder runs in the kernel) a pure spin
         * would starve the very work it waits for. */
        if (spins >= DP_SPIN_BEFORE_YIELD)
            sched_yield();
    }
}
