/*
 * verbs_ctl.c - verbs control path: devices, ports, GIDs, PD, CQ, MR, RC QP set-up and
 * teardown. Everything here may allocate and block; nothing here is on the hot path
 * (that is verbs_dp.c). Return conventions are those of dp.h.
 */
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <time.h>
#include <unistd.h>

#include "verbs_internal.h"

/* Layouts shared with the TCP provider and cffi; changing them breaks both. */
_Static_assert(sizeof(struct dp_item) == 40, "struct dp_item layout is part of the ABI");
_Static_assert(sizeof(struct dp_wc) == 24, "struct dp_wc layout is part of the ABI");
_Static_assert((int)DP_ACCESS_LOCAL_WRITE == (int)IBV_ACCESS_LOCAL_WRITE &&
               (int)DP_ACCESS_REMOTE_WRITE == (int)IBV_ACCESS_REMOTE_WRITE &&
               (int)DP_ACCESS_REMOTE_READ == (int)IBV_ACCESS_REMOTE_READ,
               "dp_access mirrors ibv_access_flags");
_Static_assert(IBV_WC_SUCCESS == 0 && IBV_WC_LOC_PROT_ERR == 4 && IBV_WC_WR_FLUSH_ERR == 5 &&
               IBV_WC_REM_ACCESS_ERR == 10 && IBV_WC_RETRY_EXC_ERR == 12,
               "dp_wc.status uses ibv_wc_status numbering");
_Static_assert(IBV_QPS_RESET == 0 && IBV_QPS_RTS == 3 && IBV_QPS_ERR == 6,
               "dp_qp_state returns ibv_qp_state numbering");
/* Ring indices are masked, and a sequence number's generation field must leave room. */
_Static_assert((DP_MAX_SEND_WR & (DP_MAX_SEND_WR - 1)) == 0, "DP_MAX_SEND_WR is a power of 2");
_Static_assert(DP_DEFAULT_SEND_WR <= DP_MAX_SEND_WR, "default chain within the bound");
_Static_assert(DP_SEQ_GEN_SHIFT >= 32 && DP_SEQ_GEN_SHIFT < 64, "sequence split");

#define DP_ERR_NULL(e) do { errno = (e); return NULL; } while (0)

int dp_has_dmabuf(void)
{
#ifdef DP_HAVE_DMABUF
    return 1;
#else
    return 0;
#endif
}

/* ------------------------------------------------------------------ devices */

int dp_device_list(char *names, uint32_t stride, uint32_t max)
{
    int n = 0;
    struct ibv_device **list;

    if ((names == NULL && max > 0) || (max > 0 && stride == 0))
        return -EINVAL;
    list = ibv_get_device_list(&n);
    if (list == NULL)
        /* libibverbs says ENOSYS when the kernel has no verbs at all: no devices. */
        return errno == ENOSYS ? 0 : -(errno ? errno : EIO);
    int count = 0;
    for (int i = 0; i < n && (uint32_t)count < max; i++, count++)
        snprintf(names + (size_t)count * stride, stride, "%s", ibv_get_device_name(list[i]));
    ibv_free_device_list(list);
    return count;
}

static int has_active_port(struct ibv_context *ibv)
{
    struct ibv_device_attr da;
    struct ibv_port_attr pa;

    if (ibv_query_device(ibv, &da))
        return 0;
    for (uint8_t p = 1; p <= da.phys_port_cnt; p++)
        if (ibv_query_port(ibv, p, &pa) == 0 && pa.state == IBV_PORT_ACTIVE)
            return 1;
    return 0;
}

dp_ctx *dp_ctx_open(const char *name)
{
    int n = 0, err = ENODEV;
    struct ibv_device **list = ibv_get_device_list(&n);
    struct ibv_context *found = NULL;
    const char *found_name = NULL;

    if (list == NULL)
        DP_ERR_NULL(errno == ENOSYS || errno == 0 ? ENODEV : errno);
    for (int i = 0; i < n && found == NULL; i++) {
        const char *dn = ibv_get_device_name(list[i]);
        int want_any = name == NULL || name[0] == '\0';

        if (!want_any && strcmp(dn, name) != 0)
            continue;
        struct ibv_context *ibv = ibv_open_device(list[i]);
        if (ibv == NULL) {
            err = errno ? errno : EIO;
            continue;
        }
        if (want_any && !has_active_port(ibv)) {
            ibv_close_device(ibv);
            continue;
        }
        found = ibv;
        found_name = dn;
    }
    dp_ctx *ctx = NULL;
    if (found != NULL) {
        ctx = calloc(1, sizeof(*ctx));
        if (ctx == NULL) {
            ibv_close_device(found);
            err = ENOMEM;
        } else {
            ctx->ibv = found;
            snprintf(ctx->name, sizeof(ctx->name), "%s", found_name);
        }
    }
    ibv_free_device_list(list);
    if (ctx == NULL)
        errno = err;
    return ctx;
}

int dp_ctx_close(dp_ctx *ctx)
{
    if (ctx == NULL)
        return -EINVAL;
    if (ctx->children)
        return -EBUSY;
    int rc = ibv_close_device(ctx->ibv);
    if (rc)
        return -(errno ? errno : EIO);
    free(ctx);
    return 0;
}

int dp_ctx_name(dp_ctx *ctx, char *buf, uint32_t len)
{
    if (ctx == NULL || buf == NULL || len == 0)
        return -EINVAL;
    if (strlen(ctx->name) >= len)
        return -ENOSPC;
    memcpy(buf, ctx->name, strlen(ctx->name) + 1);
    return 0;
}

static uint32_t mtu_bytes(enum ibv_mtu m)
{
    return m >= IBV_MTU_256 && m <= IBV_MTU_4096 ? 128u << m : 0;
}

static enum ibv_mtu mtu_enum(uint32_t bytes)
{
    enum ibv_mtu m = IBV_MTU_256;
    while (m < IBV_MTU_4096 && (128u << (m + 1)) <= bytes)
        m++;
    return m;
}

int dp_port_query(dp_ctx *ctx, uint8_t port, struct dp_port_info *out)
{
    struct ibv_port_attr pa;

    if (ctx == NULL || out == NULL || port == 0)
        return -EINVAL;
    int rc = ibv_query_port(ctx->ibv, port, &pa);
    if (rc)
        return -rc;
    out->state = pa.state;
    out->max_mtu = mtu_bytes(pa.max_mtu);
    out->active_mtu = mtu_bytes(pa.active_mtu);
    out->link_layer = pa.link_layer == IBV_LINK_LAYER_ETHERNET ? 2 : 1;
    out->gid_tbl_len = (uint32_t)pa.gid_tbl_len;
    out->lid = pa.lid;
    return 0;
}

#ifndef DP_HAVE_QUERY_GID_EX
/* Older rdma-core: the GID type lives in sysfs ("IB/RoCE v1" or "RoCE v2"). */
static int gid_type_sysfs(const char *dev, uint8_t port, uint32_t index, uint32_t *type)
{
    char path[256], buf[32] = {0};

    snprintf(path, sizeof(path), "/sys/class/infiniband/%s/ports/%u/gid_attrs/types/%u",
             dev, port, index);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return -errno;
    ssize_t r = read(fd, buf, sizeof(buf) - 1);
    int err = r < 0 ? errno : 0;
    close(fd);
    if (r < 0)
        return err == EINVAL ? -ENODATA : -err;   /* EINVAL = empty slot */
    *type = strstr(buf, "v2") != NULL ? 1 : 0;
    return 0;
}
#endif

int dp_gid_query(dp_ctx *ctx, uint8_t port, uint32_t index, struct dp_gid_info *out)
{
    struct ibv_port_attr pa;

    if (ctx == NULL || out == NULL || port == 0)
        return -EINVAL;
    int rc = ibv_query_port(ctx->ibv, port, &pa);
    if (rc)
        return -rc;
    if (index >= (uint32_t)pa.gid_tbl_len)
        return -ENODATA;
    memset(out, 0, sizeof(*out));
    out->index = index;
#ifdef DP_HAVE_QUERY_GID_EX
    struct ibv_gid_entry e;
    rc = ibv_query_gid_ex(ctx->ibv, port, index, &e, 0);
    if (rc == ENODATA || rc == -ENODATA)
        return 0;                       /* an empty slot: valid = 0 */
    if (rc)
        return -abs(rc);
    memcpy(out->gid, e.gid.raw, 16);
    out->type = e.gid_type == IBV_GID_TYPE_ROCE_V2 ? 1 : 0;
    out->valid = 1;
#else
    union ibv_gid g;
    static const uint8_t zero[16];
    if (ibv_query_gid(ctx->ibv, port, (int)index, &g))
        return -(errno ? errno : EIO);
    if (memcmp(g.raw, zero, 16) == 0)
        return 0;
    memcpy(out->gid, g.raw, 16);
    if (pa.link_layer == IBV_LINK_LAYER_ETHERNET) {
        rc = gid_type_sysfs(ctx->name, port, index, &out->type);
        if (rc == -ENODATA)
            return 0;
        if (rc)
            return rc;
    }
    out->valid = 1;
#endif
    return 0;
}

/* ------------------------------------------------------------------ PD, CQ, MR */

dp_pd *dp_pd_alloc(dp_ctx *ctx)
{
    if (ctx == NULL)
        DP_ERR_NULL(EINVAL);
    dp_pd *pd = calloc(1, sizeof(*pd));
    if (pd == NULL)
        DP_ERR_NULL(ENOMEM);
    pd->ibv = ibv_alloc_pd(ctx->ibv);
    if (pd->ibv == NULL) {
        int e = errno ? errno : EIO;
        free(pd);
        DP_ERR_NULL(e);
    }
    pd->ctx = ctx;
    ctx->children++;
    return pd;
}

int dp_pd_free(dp_pd *pd)
{
    if (pd == NULL)
        return -EINVAL;
    if (pd->children)
        return -EBUSY;
    int rc = ibv_dealloc_pd(pd->ibv);
    if (rc)
        return -abs(rc);
    pd->ctx->children--;
    free(pd);
    return 0;
}

dp_cq *dp_cq_create(dp_ctx *ctx, uint32_t depth)
{
    if (ctx == NULL || depth == 0 || depth > INT_MAX)
        DP_ERR_NULL(EINVAL);
    dp_cq *cq = calloc(1, sizeof(*cq));
    if (cq == NULL)
        DP_ERR_NULL(ENOMEM);
    cq->ibv = ibv_create_cq(ctx->ibv, (int)depth, NULL, NULL, 0);
    if (cq->ibv == NULL) {
        int e = errno ? errno : EIO;
        free(cq);
        DP_ERR_NULL(e);
    }
    cq->ctx = ctx;
    cq->depth = depth;
    cq->capacity = (uint32_t)cq->ibv->cqe;
    ctx->children++;
    return cq;
}

int dp_cq_destroy(dp_cq *cq)
{
    if (cq == NULL)
        return -EINVAL;
    if (cq->children)
        return -EBUSY;
    int rc = ibv_destroy_cq(cq->ibv);
    if (rc)
        return -abs(rc);
    cq->ctx->children--;
    free(cq->qps);
    free(cq);
    return 0;
}

static dp_mr *mr_wrap(dp_pd *pd, struct ibv_mr *m, struct dp_mr_info *out)
{
    if (m == NULL)
        DP_ERR_NULL(errno ? errno : EIO);
    dp_mr *mr = calloc(1, sizeof(*mr));
    if (mr == NULL) {
        ibv_dereg_mr(m);
        DP_ERR_NULL(ENOMEM);
    }
    mr->ibv = m;
    mr->pd = pd;
    pd->children++;
    if (out != NULL) {
        out->addr = (uint64_t)(uintptr_t)m->addr;
        out->length = m->length;
        out->lkey = m->lkey;
        out->rkey = m->rkey;
    }
    return mr;
}

dp_mr *dp_mr_reg(dp_pd *pd, void *addr, uint64_t length, uint32_t access,
                 struct dp_mr_info *out)
{
    if (pd == NULL || length == 0)
        DP_ERR_NULL(EINVAL);
    errno = 0;
    return mr_wrap(pd, ibv_reg_mr(pd->ibv, addr, (size_t)length, (int)access), out);
}

dp_mr *dp_mr_reg_dmabuf(dp_pd *pd, int fd, uint64_t offset, uint64_t length,
                        uint64_t iova, uint32_t access, struct dp_mr_info *out)
{
    if (pd == NULL || length == 0 || fd < 0)
        DP_ERR_NULL(EINVAL);
#ifdef DP_HAVE_DMABUF
    errno = 0;
    dp_mr *mr = mr_wrap(pd, ibv_reg_dmabuf_mr(pd->ibv, offset, (size_t)length, iova, fd,
                                              (int)access), out);
    if (mr != NULL && out != NULL)
        out->addr = iova;   /* remote peers address a dma-buf MR by its iova */
    return mr;
#else
    (void)offset; (void)iova; (void)access; (void)out;
    DP_ERR_NULL(EOPNOTSUPP);
#endif
}

int dp_mr_dereg(dp_mr *mr)
{
    if (mr == NULL)
        return -EINVAL;
    int rc = ibv_dereg_mr(mr->ibv);
    if (rc)
        return -abs(rc);
    mr->pd->children--;
    free(mr);
    return 0;
}

/* ------------------------------------------------------------------ QP */

static uint32_t random_psn(void)
{
    uint32_t r;
    if (getrandom(&r, sizeof(r), GRND_NONBLOCK) != (ssize_t)sizeof(r)) {
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        r = (uint32_t)ts.tv_nsec * 2654435761u;
    }
    return r & 0xffffff;
}

static int cfg_defaults(const struct dp_qp_cfg *in, struct dp_qp_cfg *c)
{
    *c = *in;
    if (c->max_send_wr == 0)
        c->max_send_wr = DP_DEFAULT_SEND_WR;
    if (c->max_recv_wr == 0)
        c->max_recv_wr = 1;
    if (c->port == 0)
        c->port = 1;
    if (c->hop_limit == 0)
        c->hop_limit = DP_DEFAULT_HOP_LIMIT;
    if (c->timeout == 0)
        c->timeout = DP_DEFAULT_TIMEOUT;
    if (c->retry_cnt == 0)
        c->retry_cnt = DP_DEFAULT_RETRY;
    if (c->rnr_retry == 0)
        c->rnr_retry = DP_DEFAULT_RETRY;
    if (c->max_send_wr > DP_MAX_SEND_WR || c->service_level > 15 || c->retry_cnt > 7 ||
        c->rnr_retry > 7 || c->timeout > 31 || c->gid_index < -1 ||
        (c->path_mtu != 0 && (c->path_mtu < 256 || c->path_mtu > 4096)))
        return -EINVAL;
    return 0;
}

/* Make the CQ able to hold a flush of every WR of every QP attached to it, so an error
 * (which completes unsignalled WRs too) can never overflow it. */
static int cq_attach(dp_cq *cq, dp_qp *qp)
{
    uint64_t need = cq->reserved + qp->cfg.max_send_wr + qp->cfg.max_recv_wr;
    if (need > cq->capacity) {
        if (need > INT_MAX)
            return -EINVAL;
        int rc = ibv_resize_cq(cq->ibv, (int)need);
        if (rc)
            return -abs(rc);
        cq->capacity = (uint32_t)cq->ibv->cqe;
    }
    if (cq == qp->send_cq) {
        if (cq->n_qps == cq->cap_qps) {
            uint32_t cap = cq->cap_qps ? cq->cap_qps * 2 : 8;
            dp_qp **t = realloc(cq->qps, cap * sizeof(*t));
            if (t == NULL)
                return -ENOMEM;
            cq->qps = t;
            cq->cap_qps = cap;
        }
        cq->qps[cq->n_qps++] = qp;
    }
    cq->reserved = need;
    cq->children++;
    return 0;
}

static void cq_detach(dp_cq *cq, dp_qp *qp)
{
    for (uint32_t i = 0; i < cq->n_qps; i++)
        if (cq->qps[i] == qp) {
            cq->qps[i] = cq->qps[--cq->n_qps];
            break;
        }
    if (cq->last == qp)
        cq->last = NULL;
    cq->reserved -= qp->cfg.max_send_wr + qp->cfg.max_recv_wr;
    cq->children--;
}

static void qp_free(dp_qp *qp)
{
    free(qp->wrs);
    free(qp->sges);
    free(qp->ring);
    free(qp);
}

dp_qp *dp_qp_create(dp_pd *pd, dp_cq *send_cq, dp_cq *recv_cq, const struct dp_qp_cfg *cfg)
{
    static _Atomic uint64_t generation = 1;
    struct dp_qp_cfg c;

    if (pd == NULL || send_cq == NULL || recv_cq == NULL || cfg == NULL)
        DP_ERR_NULL(EINVAL);
    if (send_cq->ctx != pd->ctx || recv_cq->ctx != pd->ctx)
        DP_ERR_NULL(EINVAL);
    int rc = cfg_defaults(cfg, &c);
    if (rc)
        DP_ERR_NULL(-rc);
    dp_qp *qp = calloc(1, sizeof(*qp));
    if (qp == NULL)
        DP_ERR_NULL(ENOMEM);
    uint32_t ring = 1;
    while (ring < c.max_send_wr)
        ring <<= 1;
    qp->wrs = calloc(c.max_send_wr, sizeof(*qp->wrs));
    qp->sges = calloc(c.max_send_wr, sizeof(*qp->sges));
    qp->ring = calloc(ring, sizeof(*qp->ring));
    if (qp->wrs == NULL || qp->sges == NULL || qp->ring == NULL) {
        qp_free(qp);
        DP_ERR_NULL(ENOMEM);
    }
    qp->ring_mask = ring - 1;
    /* The chain is linked once; a post only fills fields and cuts it at n. */
    for (uint32_t i = 0; i < c.max_send_wr; i++) {
        qp->wrs[i].next = i + 1 < c.max_send_wr ? &qp->wrs[i + 1] : NULL;
        qp->wrs[i].sg_list = &qp->sges[i];
        qp->wrs[i].num_sge = 1;
        qp->wrs[i].opcode = IBV_WR_RDMA_WRITE;
    }

    struct ibv_qp_init_attr ia = {
        .send_cq = send_cq->ibv,
        .recv_cq = recv_cq->ibv,
        .cap = {
            .max_send_wr = c.max_send_wr,
            .max_recv_wr = c.max_recv_wr,
            .max_send_sge = 1,
            .max_recv_sge = 1,
            .max_inline_data = c.max_inline,
        },
        .qp_type = IBV_QPT_RC,
        .sq_sig_all = 0,
    };
    qp->ibv = ibv_create_qp(pd->ibv, &ia);
    if (qp->ibv == NULL) {
        int e = errno ? errno : EIO;
        qp_free(qp);
        DP_ERR_NULL(e);
    }
    qp->pd = pd;
    qp->send_cq = send_cq;
    qp->recv_cq = recv_cq;
    qp->cfg = c;
    qp->cfg.max_inline = ia.cap.max_inline_data < c.max_inline ? ia.cap.max_inline_data
                                                                : c.max_inline;
    qp->qp_num = qp->ibv->qp_num;
    qp->psn = random_psn();
    qp->state = IBV_QPS_RESET;
    qp->head = qp->tail = atomic_fetch_add(&generation, 1) << DP_SEQ_GEN_SHIFT;

    rc = cq_attach(send_cq, qp);
    if (rc == 0 && recv_cq != send_cq) {
        rc = cq_attach(recv_cq, qp);
        if (rc)
            cq_detach(send_cq, qp);
    }
    if (rc) {
        ibv_destroy_qp(qp->ibv);
        qp_free(qp);
        DP_ERR_NULL(-rc);
    }
    pd->children++;
    return qp;
}

int dp_qp_destroy(dp_qp *qp)
{
    if (qp == NULL)
        return -EINVAL;
    int rc = ibv_destroy_qp(qp->ibv);
    if (rc)
        return -abs(rc);
    dp_qp_drop_credits(qp);
    cq_detach(qp->send_cq, qp);
    if (qp->recv_cq != qp->send_cq)
        cq_detach(qp->recv_cq, qp);
    qp->pd->children--;
    qp_free(qp);
    return 0;
}

int dp_qp_num(dp_qp *qp)
{
    return qp == NULL ? -EINVAL : (int)qp->qp_num;
}

int dp_qp_lane(dp_qp *qp, uint8_t *sl, uint8_t *traffic_class)
{
    struct ibv_qp_attr a;
    struct ibv_qp_init_attr ia;

    if (qp == NULL || sl == NULL || traffic_class == NULL)
        return -EINVAL;
    int rc = ibv_query_qp(qp->ibv, &a, IBV_QP_AV, &ia);
    if (rc)
        return -abs(rc);
    *sl = a.ah_attr.sl;
    *traffic_class = a.ah_attr.is_global ? a.ah_attr.grh.traffic_class : 0;
    return 0;
}

int dp_qp_state(dp_qp *qp)
{
    struct ibv_qp_attr a;
    struct ibv_qp_init_attr ia;

    if (qp == NULL)
        return -EINVAL;
    int rc = ibv_query_qp(qp->ibv, &a, IBV_QP_STATE, &ia);
    if (rc)
        return -abs(rc);
    return (int)a.qp_state;
}

int dp_qp_outstanding(dp_qp *qp)
{
    return qp == NULL ? -EINVAL : (int)(qp->head - qp->tail);
}

static int local_gid(dp_qp *qp, uint8_t gid[16])
{
    union ibv_gid g;

    memset(gid, 0, 16);
    if (qp->cfg.gid_index < 0)
        return 0;
    if (ibv_query_gid(qp->pd->ctx->ibv, qp->cfg.port, qp->cfg.gid_index, &g))
        return -(errno ? errno : EIO);
    memcpy(gid, g.raw, 16);
    return 0;
}

int dp_qp_endpoint(dp_qp *qp, struct dp_qp_endpoint *out)
{
    struct ibv_port_attr pa;

    if (qp == NULL || out == NULL)
        return -EINVAL;
    int rc = ibv_query_port(qp->pd->ctx->ibv, qp->cfg.port, &pa);
    if (rc)
        return -abs(rc);
    memset(out, 0, sizeof(*out));
    out->qpn = qp->qp_num;
    out->psn = qp->psn;
    out->lid = pa.lid;
    out->mtu = qp->cfg.path_mtu ? qp->cfg.path_mtu : mtu_bytes(pa.active_mtu);
    return local_gid(qp, out->gid);
}

static int modify(dp_qp *qp, struct ibv_qp_attr *a, int mask)
{
    int rc = ibv_modify_qp(qp->ibv, a, mask);
    if (rc)
        return -abs(rc);
    qp->state = a->qp_state;
    return 0;
}

int dp_qp_connect(dp_qp *qp, const struct dp_qp_endpoint *remote)
{
    struct ibv_port_attr pa;
    int rc;

    if (qp == NULL || remote == NULL || remote->qpn > 0xffffff || remote->psn > 0xffffff)
        return -EINVAL;
    if (qp->state != IBV_QPS_RESET && qp->state != IBV_QPS_INIT)
        return -EISCONN;
    rc = ibv_query_port(qp->pd->ctx->ibv, qp->cfg.port, &pa);
    if (rc)
        return -abs(rc);
    uint32_t mtu = qp->cfg.path_mtu ? qp->cfg.path_mtu : mtu_bytes(pa.active_mtu);
    if (remote->mtu != 0 && remote->mtu < mtu)
        mtu = remote->mtu;

    if (qp->state == IBV_QPS_RESET) {
        struct ibv_qp_attr init = {
            .qp_state = IBV_QPS_INIT,
            .pkey_index = 0,
            .port_num = qp->cfg.port,
            .qp_access_flags = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE |
                               IBV_ACCESS_REMOTE_READ,
        };
        rc = modify(qp, &init, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT |
                    IBV_QP_ACCESS_FLAGS);
        if (rc)
            return rc;
    }

    struct ibv_qp_attr rtr = {
        .qp_state = IBV_QPS_RTR,
        .path_mtu = mtu_enum(mtu),
        .dest_qp_num = remote->qpn,
        .rq_psn = remote->psn,
        .max_dest_rd_atomic = 1,
        .min_rnr_timer = 12,
        .ah_attr = {
            .dlid = (uint16_t)remote->lid,
            .sl = qp->cfg.service_level,
            .port_num = qp->cfg.port,
        },
    };
    if (qp->cfg.gid_index >= 0) {
        rtr.ah_attr.is_global = 1;
        memcpy(rtr.ah_attr.grh.dgid.raw, remote->gid, 16);
        rtr.ah_attr.grh.sgid_index = (uint8_t)qp->cfg.gid_index;
        rtr.ah_attr.grh.hop_limit = qp->cfg.hop_limit;
        rtr.ah_attr.grh.traffic_class = qp->cfg.traffic_class;
    }
    rc = modify(qp, &rtr, IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN |
                IBV_QP_RQ_PSN | IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER);
    if (rc)
        return rc;

    struct ibv_qp_attr rts = {
        .qp_state = IBV_QPS_RTS,
        .timeout = qp->cfg.timeout,
        .retry_cnt = qp->cfg.retry_cnt,
        .rnr_retry = qp->cfg.rnr_retry,
        .sq_psn = qp->psn,
        .max_rd_atomic = 1,
    };
    return modify(qp, &rts, IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT |
                  IBV_QP_RNR_RETRY | IBV_QP_SQ_PSN | IBV_QP_MAX_QP_RD_ATOMIC);
}

int dp_qp_reset(dp_qp *qp)
{
    struct ibv_qp_attr a = { .qp_state = IBV_QPS_RESET };

    if (qp == NULL)
        return -EINVAL;
    int rc = modify(qp, &a, IBV_QP_STATE);
    if (rc)
        return rc;
    dp_qp_drop_credits(qp);
    qp->psn = random_psn();
    return 0;
}
