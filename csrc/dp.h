/*
 * dp.h - the DualPath C data plane API, written for cffi first.
 *
 * Everything between DP_CDEF_BEGIN and DP_CDEF_END is parsed by cffi (see
 * dualpath/_native/build.py): opaque handles, caller-allocated structs, fixed-width
 * integers, no macros, no bitfields. Every exported symbol has the dp_ prefix.
 * C is mechanism only: retries, slicing, device choice, timeouts policy live in Python.
 *
 * Return conventions (each function says which one it uses):
 *   [int]     0 on success or -errno.
 *   [count]   a count >= 0 on success or -errno.
 *   [handle]  a handle, or NULL with errno set.
 *
 * Ownership: a handle is owned by whoever created it and is destroyed exactly once by
 * its matching destroy/free/close call; children (QP, MR, CQ) must be destroyed before
 * their parent (PD, context). Caller-allocated structs are only read or written during
 * the call.
 *
 * Threads: control functions (open/create/destroy/connect/reset) may be called from any
 * thread but not concurrently on the same handle. On one QP, post and the poll of its CQ
 * must be called from one thread at a time (the owner's data-path thread); cffi releases
 * the GIL around every call, so a busy poll never blocks Python.
 */
#ifndef DP_H
#define DP_H

#include <stddef.h>
#include <stdint.h>

/* DP_CDEF_BEGIN */

/* ------------------------------------------------------------------ common */

/* The package version this object was built from (static string; any thread). */
const char *dp_version(void);

/* 1 when built against an rdma-core that has ibv_reg_dmabuf_mr, else 0. */
int dp_has_dmabuf(void);

/* One RDMA WRITE (or TCP one-sided write): a contiguous local range to a remote one. */
struct dp_item {
    uint64_t local_addr;   /* inside a local MR whose lkey is `lkey` */
    uint64_t remote_addr;  /* inside the peer's MR whose rkey is `rkey` */
    uint32_t length;       /* bytes, > 0 */
    uint32_t lkey;
    uint32_t rkey;
    uint32_t flags;        /* reserved: 0 */
    uint64_t wr_id;        /* caller's id: returned by the completion that retires it */
};

/* One completion. status uses ibv_wc_status numbering for both providers:
 * 0 success, 4 LOC_PROT_ERR, 5 WR_FLUSH_ERR, 9 REM_INV_REQ_ERR, 10 REM_ACCESS_ERR,
 * 12 RETRY_EXC_ERR, 13 RNR_RETRY_EXC_ERR, ... */
struct dp_wc {
    uint64_t wr_id;        /* the completed item's wr_id: the signalled one; with an
                              error status the item that failed or was flushed (rxe
                              flushes unsignalled items too, each retiring itself) */
    int32_t status;
    uint32_t qp_num;       /* which QP (or TCP connection id) it belongs to */
    uint32_t retired;      /* items of that QP this completion retires: the signalled
                              one and every unsignalled one posted before it */
    uint32_t vendor_err;
};

/* ------------------------------------------------------------------ verbs: devices */

typedef struct dp_ctx dp_ctx;
typedef struct dp_pd dp_pd;
typedef struct dp_cq dp_cq;
typedef struct dp_qp dp_qp;
typedef struct dp_mr dp_mr;

/* [count] Names of RDMA devices, `stride` bytes each (NUL-terminated), at most `max`. */
int dp_device_list(char *names, uint32_t stride, uint32_t max);

/* [handle] Open a device by name; name NULL or "" = the first one with an ACTIVE port
 * (ENODEV when there is none). */
dp_ctx *dp_ctx_open(const char *name);
/* [int] Close a context; its PDs and CQs must be gone (EBUSY otherwise). */
int dp_ctx_close(dp_ctx *ctx);
/* [int] The device's name into buf. */
int dp_ctx_name(dp_ctx *ctx, char *buf, uint32_t len);

struct dp_port_info {
    uint32_t state;        /* ibv_port_state: 4 = ACTIVE */
    uint32_t max_mtu;      /* bytes */
    uint32_t active_mtu;   /* bytes */
    uint32_t link_layer;   /* 1 = InfiniBand, 2 = Ethernet */
    uint32_t gid_tbl_len;
    uint32_t lid;
};
/* [int] */
int dp_port_query(dp_ctx *ctx, uint8_t port, struct dp_port_info *out);

struct dp_gid_info {
    uint8_t gid[16];
    uint32_t index;
    uint32_t type;         /* 0 = IB / RoCE v1, 1 = RoCE v2 */
    uint32_t valid;        /* 0 for an empty table slot */
};
/* [int] One GID table entry; -ENODATA past the table. */
int dp_gid_query(dp_ctx *ctx, uint8_t port, uint32_t index, struct dp_gid_info *out);

/* ------------------------------------------------------------------ verbs: resources */

/* [handle] / [int] */
dp_pd *dp_pd_alloc(dp_ctx *ctx);
int dp_pd_free(dp_pd *pd);

/* [handle] A CQ of `depth` entries; posts never let more signalled WRs be outstanding
 * on it than that. [int] destroy: its QPs must be gone (EBUSY). */
dp_cq *dp_cq_create(dp_ctx *ctx, uint32_t depth);
int dp_cq_destroy(dp_cq *cq);

/* Access bits (same values as ibv_access_flags). */
enum dp_access {
    DP_ACCESS_LOCAL_WRITE = 1,
    DP_ACCESS_REMOTE_WRITE = 2,
    DP_ACCESS_REMOTE_READ = 4
};

struct dp_mr_info {
    uint64_t addr;
    uint64_t length;
    uint32_t lkey;
    uint32_t rkey;
};
/* [handle] Register host memory. The caller keeps the memory alive until dereg. */
dp_mr *dp_mr_reg(dp_pd *pd, void *addr, uint64_t length, uint32_t access,
                 struct dp_mr_info *out);
/* [handle] Register a dma-buf (GPU memory); EOPNOTSUPP when dp_has_dmabuf() is 0. */
dp_mr *dp_mr_reg_dmabuf(dp_pd *pd, int fd, uint64_t offset, uint64_t length,
                        uint64_t iova, uint32_t access, struct dp_mr_info *out);
/* [int] */
int dp_mr_dereg(dp_mr *mr);

/* RC QP configuration; zero fields take the defaults in brackets. */
struct dp_qp_cfg {
    uint32_t max_send_wr;    /* [256] also the longest chain one post can carry */
    uint32_t max_recv_wr;    /* [1] */
    uint32_t max_inline;     /* [0] */
    uint32_t path_mtu;       /* bytes 256..4096 [0 = the port's active MTU] */
    int32_t gid_index;       /* local GID index for RoCE; -1 = none (InfiniBand LID) */
    uint8_t port;            /* [1] */
    uint8_t service_level;   /* IB SL of the lane, 0..15 */
    uint8_t traffic_class;   /* GRH traffic class; DSCP = traffic_class >> 2 */
    uint8_t hop_limit;       /* [64] */
    uint8_t timeout;         /* local ACK timeout exponent [14] */
    uint8_t retry_cnt;       /* [7] */
    uint8_t rnr_retry;       /* [7] */
    uint8_t _pad;
};

/* What a peer needs to connect to a QP (exchanged over the control plane). */
struct dp_qp_endpoint {
    uint32_t qpn;
    uint32_t psn;
    uint32_t lid;
    uint32_t mtu;            /* bytes; connect uses min(local, remote) */
    uint8_t gid[16];
};

/* [handle] An RC QP in RESET with its prebuilt WR/SGE chain of max_send_wr entries
 * (EINVAL for a cfg out of range). Its CQs are grown (ibv_resize_cq) to hold a flush of
 * every WR of every QP on them, so an error can never overflow a CQ. Creating or
 * destroying a QP edits its CQs' QP tables: not while another thread polls them. */
dp_qp *dp_qp_create(dp_pd *pd, dp_cq *send_cq, dp_cq *recv_cq, const struct dp_qp_cfg *cfg);
/* [int] Local endpoint info for the peer. */
int dp_qp_endpoint(dp_qp *qp, struct dp_qp_endpoint *out);
/* [int] RESET/INIT -> INIT -> RTR -> RTS towards `remote`, with the cfg's service level
 * and (when gid_index >= 0) a GRH of its traffic class, hop limit and sgid_index; path
 * MTU min(local, remote). -EISCONN when already past INIT (reset first). */
int dp_qp_connect(dp_qp *qp, const struct dp_qp_endpoint *remote);
/* [int] Move to RESET (recovery): outstanding credits are dropped, a new PSN is chosen;
 * connect again afterwards. Completions still in the CQ for this QP are discarded by the
 * next poll (they occupy CQ entries until then: poll before posting again). */
int dp_qp_reset(dp_qp *qp);
/* [count] Current ibv_qp_state (0 RESET, 1 INIT, 2 RTR, 3 RTS, 4 SQD, 5 SQE, 6 ERR). */
int dp_qp_state(dp_qp *qp);
/* [count] WRs posted and not yet retired. */
int dp_qp_outstanding(dp_qp *qp);
/* [count] The QP number. */
int dp_qp_num(dp_qp *qp);
/* [int] */
int dp_qp_destroy(dp_qp *qp);

/* ------------------------------------------------------------------ verbs: data path */

/* [int] Post `n` RDMA WRITEs with ONE ibv_post_send (one doorbell) using the QP's
 * prebuilt chain; no allocation. Every `signal_every`-th WR (counted across posts on
 * this QP) and the batch's last WR are signalled. Credits: never more than max_send_wr
 * WRs outstanding on the QP nor more signalled WRs than the CQ's depth.
 * Returns 0 when all n went out; -EAGAIN when credits ran out after *n_posted items
 * (a normal partial result: poll, then post the rest); any other -errno when
 * ibv_post_send failed, with *n_posted = the items that did go out (the rest did not;
 * a provider that fails without naming bad_wr has queued them all: all count as posted).
 * -EINVAL, nothing posted, when the QP is not in RTS (a provider may queue WRs on a RESET
 * QP and run them after a later connect) or signal_every is 0. */
int dp_qp_post_write(dp_qp *qp, const struct dp_item *items, uint32_t n,
                     uint32_t signal_every, uint32_t *n_posted);

/* [count] Poll up to `max` completions into the caller's array without blocking;
 * returns credits to their QPs. Completions from before a QP's last reset, of destroyed
 * QPs, and of receives are discarded, not counted. -EIO when ibv_poll_cq fails first. */
int dp_cq_poll(dp_cq *cq, struct dp_wc *out, uint32_t max);

/* [count] Busy-poll until at least one completion or `timeout_ns` elapsed (0 then);
 * after a short spin it yields the CPU between polls. timeout_ns < 0: -EINVAL. */
int dp_cq_wait(dp_cq *cq, struct dp_wc *out, uint32_t max, int64_t timeout_ns);

/* DP_CDEF_END */

#endif /* DP_H */
