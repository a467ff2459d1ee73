/*
 * verbs_internal.h - the structs behind dp.h's opaque verbs handles, shared by the
 * control file (verbs_ctl.c) and the data path (verbs_dp.c). Not exported.
 *
 * Sequence numbers: every WR a QP posts gets a 64-bit sequence number, carried as the
 * ibv wr_id. The QP holds [tail, head): posted and not yet retired. A completion for
 * sequence s retires tail..s (RC send completions arrive in order). Sequences never
 * restart: a QP starts at (creation generation << DP_SEQ_GEN_SHIFT) and dp_qp_reset
 * moves tail up to head, so a completion left in the CQ from before a reset, or from a
 * destroyed QP whose qp_num was reused, has s < tail and is discarded.
 */
#ifndef DP_VERBS_INTERNAL_H
#define DP_VERBS_INTERNAL_H

#include <infiniband/verbs.h>

#include "dp.h"

/* Bits of a sequence number that count WRs inside one QP's life: 2^44 WRs is about
 * 20 days at 10 M WR/s before a QP's numbers could reach its successors' range. */
#define DP_SEQ_GEN_SHIFT 44

/* The largest chain one QP may carry (max_send_wr); a sanity bound, far above what
 * any NIC supports. */
#define DP_MAX_SEND_WR 65536u
#define DP_DEFAULT_SEND_WR 256u
#define DP_DEFAULT_HOP_LIMIT 64
#define DP_DEFAULT_TIMEOUT 14
#define DP_DEFAULT_RETRY 7
#define DP_NAME_MAX 64

struct dp_ctx {
    struct ibv_context *ibv;
    char name[DP_NAME_MAX];
    uint32_t children;          /* live PDs + CQs */
};

struct dp_pd {
    struct ibv_pd *ibv;
    dp_ctx *ctx;
    uint32_t children;          /* live QPs + MRs */
};

struct dp_cq {
    struct ibv_cq *ibv;
    dp_ctx *ctx;
    uint32_t depth;             /* credit: signalled WRs outstanding on this CQ */
    uint32_t sig_outstanding;   /* signalled WRs posted to QPs using it, not completed */
    uint32_t capacity;          /* CQEs the ibv CQ holds (>= depth, grown on attach) */
    uint64_t reserved;          /* sum of attached QPs' max_send_wr + max_recv_wr */
    uint32_t children;          /* QPs using it as send or recv CQ */
    uint32_t n_qps, cap_qps;    /* table of QPs sending on it, for credit return */
    dp_qp **qps;
    dp_qp *last;                /* last QP looked up: completions come in runs */
};

/* One ring slot per outstanding WR, indexed by seq & ring_mask. */
struct dp_slot {
    uint64_t wr_id;             /* caller's id */
    uint64_t sig_prefix;        /* signalled WRs posted on this QP up to and including it */
};

struct dp_qp {
    struct ibv_qp *ibv;
    dp_pd *pd;
    dp_cq *send_cq, *recv_cq;
    struct dp_qp_cfg cfg;       /* with defaults filled in */
    uint32_t qp_num;
    uint32_t psn;               /* our send PSN for the next connect */
    int state;                  /* last state we moved it to (ibv_qp_state) */

    /* data path (one thread at a time, see dp.h) */
    uint64_t head, tail;        /* sequence numbers: next to post, oldest not retired */
    uint64_t sig_posted;        /* signalled WRs ever posted */
    uint64_t sig_retired;       /* signalled WRs ever retired (or dropped by reset) */
    uint32_t since_signal;      /* WRs posted since the last signalled one */
    uint32_t ring_mask;
    struct dp_slot *ring;
    struct ibv_send_wr *wrs;    /* prebuilt chain of cfg.max_send_wr, linked once */
    struct ibv_sge *sges;
};

struct dp_mr {
    struct ibv_mr *ibv;
    dp_pd *pd;
};

/* verbs_dp.c: retire credits of a QP being reset or destroyed (control thread). */
void dp_qp_drop_credits(dp_qp *qp);

#endif /* DP_VERBS_INTERNAL_H */
