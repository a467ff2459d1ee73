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
    uint32_t flags;        /* enum dp_item_flags; 0 for the default */
    uint64_t wr_id;        /* caller's id: returned by the completion that retires it */
};

/* dp_item.flags. UNSIGNALLED_LAST: when this item ends a post, do not signal it just for
 * that (it is signalled only when the signal_every count falls on it, or when it fills
 * the QP's credits, so unsignalled WRs can always be retired). For callers that stream
 * single-WR posts and want ib_write_bw's CQ moderation; the caller then must signal the
 * last WR it waits for (post it without the flag). The TCP provider ignores flags. */
enum dp_item_flags {
    DP_ITEM_UNSIGNALLED_LAST = 1
};

/* Fill `n` items for one post from rows of (local offset, remote offset, length), 3
 * uint64 each: item k WRITEs length bytes from local_base + its local offset (lkey) to
 * remote_base + its remote offset (rkey), wr_id first_wr_id + k, flags 0. The engine
 * checked every range when the rows were planned; no allocation, any thread. */
void dp_items_fill(struct dp_item *out, uint32_t n, const uint64_t *rows,
                   uint64_t local_base, uint32_t lkey, uint64_t remote_base,
                   uint32_t rkey, uint64_t first_wr_id);
/* The same, item k's rkey rkeys[k] (a peer's scoped region: a window per granted run). */
void dp_items_fill_keyed(struct dp_item *out, uint32_t n, const uint64_t *rows,
                         uint64_t local_base, uint32_t lkey, uint64_t remote_base,
                         const uint32_t *rkeys, uint64_t first_wr_id);

/* One side of a layer move (runs.c): unit u's segment s of layer l sits at
 * bases[l * nseg + s] + (u / group) * group_stride + (u % group) * unit_stride, and
 * units[i] holds the request's tokens [(i0 + i) * unit_tokens, ...) where i0 is the
 * first unit the move touches. */
struct dp_run_side {
    const int64_t *units;
    const int64_t *bases;         /* layers x nseg: a plane base plus a segment offset */
    uint64_t unit_stride;
    uint64_t group;               /* >= 1 */
    uint64_t group_stride;
    uint64_t num_units;
};

/* The WRITE runs of layer `layer`, tokens [first, stop), as rows of (src offset, dst
 * offset, length) into out (cap rows), unit-major then segment order, neighbours
 * contiguous on both sides merged. Returns the rows, -ENOSPC when cap is short of
 * (units touched x nseg), -ERANGE for a unit outside its side (out[0] = the unit,
 * out[1] = 0 source / 1 target), -EINVAL. */
int64_t dp_layer_runs(const struct dp_run_side *src, const struct dp_run_side *dst,
                      const uint64_t *row_bytes, uint32_t nseg, uint32_t layer,
                      uint64_t unit_tokens, uint64_t first, uint64_t stop, uint64_t *out,
                      uint64_t cap);

/* Rows of (local offset, remote offset, length) checked against both regions and cut
 * into slices of at most slice_bytes, in order, into out (cap rows). Returns the slices,
 * -ERANGE (bad[0] = the first item empty or past a region), -ENOSPC (bad[0] = the rows
 * needed), -EINVAL. */
int64_t dp_plan_rows(const uint64_t *items, uint64_t n, uint64_t slice_bytes,
                     uint64_t local_length, uint64_t remote_length, uint64_t *out,
                     uint64_t cap, uint64_t *bad);

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
/* [int] The lane the QP's address vector carries once connected (ibv_query_qp): its SL
 * and, with a GRH, its traffic class (0 without one). */
int dp_qp_lane(dp_qp *qp, uint8_t *sl, uint8_t *traffic_class);
/* [count] WRs posted and not yet retired. */
int dp_qp_outstanding(dp_qp *qp);
/* [count] The QP number. */
int dp_qp_num(dp_qp *qp);
/* [int] */
int dp_qp_destroy(dp_qp *qp);

/* ------------------------------------------------------------------ verbs: data path */

/* [int] Post `n` RDMA WRITEs with ONE ibv_post_send (one doorbell) using the QP's
 * prebuilt chain; no allocation. Every `signal_every`-th WR (counted across posts on
 * this QP) and the batch's last WR (unless DP_ITEM_UNSIGNALLED_LAST) are signalled. Credits: never more than max_send_wr
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

/* ------------------------------------------------------------------ TCP provider */
/*
 * The verbs WRITE data path's semantics over TCP sockets, for hosts without an RDMA
 * device (and for loopback tests). Same items, completions, statuses, credits and
 * return conventions as dp_qp_post_write / dp_cq_poll; the handles map one to one:
 *
 *   dp_tcp       an engine ("device + PD + target"): a listening socket, the region table
 *                (rkey == lkey, assigned here) and a server thread (epoll) that serves
 *                peers' WRITEs into this engine's regions.
 *   dp_tcp_mr    a registered region of an engine.
 *   dp_tcp_cq    completions of the connections created on it (an epoll set).
 *   dp_tcp_conn  an initiator connection to a remote engine (an RC QP).
 *
 * Admission (unless the engine is created DP_TCP_OPEN): a peer's connection is served
 * only after a challenge-response with a per-connection credential the engine issued
 * (dp_tcp_admit; the owner hands it to the peer over its authenticated control plane).
 * On accept the target sends a 24-byte challenge (magic, 16 random bytes); the initiator
 * answers with a 56-byte hello (magic, credential id, its own 16 random bytes,
 * HMAC-SHA256 under the credential's secret of both nonces and the id); the target
 * checks the MAC in constant time and answers with its own 32-byte HMAC (the initiator
 * then knows the target holds the secret too). A credential admits one connection and
 * is consumed by it. Anything else - a bad magic, id, MAC, a silence past the handshake
 * timeout, more than max_pending handshakes at once, more than max_conns_per_peer
 * admitted connections of the credential's peer - closes the connection without a byte
 * of answer: an unadmitted peer learns nothing (no status tells a bad key from a bad
 * address). rkeys are random 32-bit values, not sequential.
 *
 * Wire (both ends run this code; little-endian): each WRITE is a 32-byte header (op,
 * signalled flag, length, rkey, remote addr, sequence number) and its payload. The target
 * checks rkey, REMOTE_WRITE access and bounds BEFORE writing, then receives the payload
 * straight into the region (no bounce copy); an invalid WRITE's payload is drained and
 * discarded. The target acks signalled WRITEs and every failure (status 10
 * REM_ACCESS_ERR; the sequence number maps back to the wr_id, which never leaves the
 * initiator). After a failure the target drops the rest of that connection, and the
 * initiator completes every later item with 5 WR_FLUSH_ERR: an RC QP in ERR. An item
 * whose local range is outside a region of the initiator's engine (lkey, bounds) is not
 * sent: it completes with 4 LOC_PROT_ERR in order, after the items before it. A dead
 * peer (EOF, reset, TCP user timeout) completes the first outstanding item with
 * 12 RETRY_EXC_ERR (vendor_err = errno) and the rest with WR_FLUSH_ERR. reset + connect
 * recovers, like dp_qp_reset + dp_qp_connect.
 *
 * Connection states (dp_tcp_conn_state, ibv_qp_state numbering): 0 RESET --connect-->
 * 3 RTS --failure--> 6 ERR --reset--> 0 RESET. A post in RESET fails with ENOTCONN; a
 * post in ERR is accepted and flushed (as verbs does).
 *
 * Progress: the initiator's bytes move only inside post, poll and wait (one gathered
 * sendmsg per batch where the socket takes it; the rest when the socket drains), so the
 * owner's data-path thread must keep polling while items are outstanding. The memory of
 * an item must stay valid until the completion that retires it (as with verbs).
 *
 * Threads: the server thread is internal; it touches only the region table (under a
 * rwlock) and its accepted sockets. Post on a connection and poll/wait/reset/destroy of
 * it and its CQ: one thread at a time (the data-path thread). dp_tcp_conn_connect may run
 * on another thread while the CQ is polled, as long as nothing posts on that connection
 * meanwhile. dp_tcp_cq_wake: any thread, any time. reg/dereg: any thread.
 */

typedef struct dp_tcp dp_tcp;
typedef struct dp_tcp_mr dp_tcp_mr;
typedef struct dp_tcp_cq dp_tcp_cq;
typedef struct dp_tcp_conn dp_tcp_conn;

enum {
    DP_TCP_SECRET_BYTES = 16,     /* a credential's secret (128 bits) */
    DP_TCP_OPEN = 1,              /* dp_tcp_cfg.flags: no admission (benchmarks only) */
    DP_TCP_SCOPED = 1 << 16,      /* dp_tcp_mr_reg access: peers WRITE only into windows
                                     granted to them (dp_tcp_grant) */
    DP_TCP_PEER_TRUSTED = 1 << 30,    /* a peer tag with this bit (dp_tcp_admit) is the
                                         owner's own (its worker): no scope applies */
    DP_TCP_MAX_WINDOWS = 1 << 20, /* windows per grant */
};

/* Engine configuration; zero fields take the defaults in brackets. */
struct dp_tcp_cfg {
    uint32_t max_regions;    /* region table slots [1024], at most 65535 */
    uint32_t sockbuf_bytes;  /* SO_SNDBUF/SO_RCVBUF of accepted sockets [0 = autotuning] */
    uint32_t flags;          /* DP_TCP_OPEN or 0 [0: admission required] */
    uint32_t max_pending;    /* connections accepted but not yet admitted, at most [64];
                                beyond it a new one is closed at once */
    uint32_t handshake_timeout_ms;  /* a pending connection silent this long is closed
                                       [2000] */
    uint32_t max_conns_per_peer;    /* admitted connections per peer tag [16] */
    uint32_t max_credentials;       /* issued, not yet used credentials [4096] */
    uint32_t max_pending_per_addr;  /* of max_pending, those one source address may hold
                                       [max_pending / 8, at least 1]: a flood from one
                                       address cannot starve admitted peers' handshakes */
    uint32_t max_grants;            /* live grants (dp_tcp_grant) [4096], at most 65535 */
};

/* [handle] Listen on host:port (numeric or resolvable host; port 0 = any free port, see
 * dp_tcp_port) and start the server thread. cfg may be NULL. */
dp_tcp *dp_tcp_create(const char *host, uint16_t port, const struct dp_tcp_cfg *cfg);
/* [count] The bound TCP port. */
int dp_tcp_port(dp_tcp *eng);
/* Target-side counters of an engine, since create (monotonic). */
struct dp_tcp_stats {
    uint64_t conns_accepted;
    uint64_t conns_admitted;  /* passed the challenge-response */
    uint64_t conns_refused;   /* closed unadmitted: bad hello, timeout, a cap reached */
    uint64_t writes;          /* WRITEs that landed */
    uint64_t bytes;           /* their payload bytes */
    uint64_t refused;         /* WRITEs refused (rkey, access, bounds, dereg) */
    uint64_t flushed;         /* WRITEs dropped after a failure on their connection */
    uint64_t ack_stalls;      /* times a socket stopped being read because its acks
                                 could not be sent (the initiator is not polling) */
    uint64_t out_of_scope;    /* of `refused`: WRITEs into a scoped region outside the
                                 writer's granted windows (or after their ungrant) */
};
/* [int] Read the counters (any thread; each value is read atomically). */
int dp_tcp_stats(dp_tcp *eng, struct dp_tcp_stats *out);
/* [int] Issue a credential for one connection of the peer tagged `peer` (the caller's
 * name for a peer; it bounds admitted connections per peer): `secret` is
 * DP_TCP_SECRET_BYTES the caller drew at random; *out_id gets the id the peer presents.
 * ENOSPC when max_credentials are outstanding. Any thread. */
int dp_tcp_admit(dp_tcp *eng, uint32_t peer, const uint8_t *secret, uint32_t *out_id);
/* [int] Withdraw an unused credential (ENOENT when unknown or already used). Any thread.
 * Connections it admitted stay up. */
int dp_tcp_revoke(dp_tcp *eng, uint32_t id);
/* Scope (per-request windows). A region registered with DP_TCP_SCOPED takes a peer's
 * WRITE only where a grant of that peer's tag covers it whole: the owner grants a peer the
 * windows of one request's memory when the request is assigned to it and ungrants them
 * when the request ends, so an admitted peer cannot write into memory serving another
 * request (nor, after the ungrant, an old attempt into memory that serves a new one).
 * A refused WRITE completes REM_ACCESS_ERR like a bad rkey. Connections of a tag with
 * DP_TCP_PEER_TRUSTED, and the engine's own connect_self copies, are not scoped.
 *
 * [int] Grant peer tag `peer` the n windows `ranges` (n pairs of address, length; each
 * inside the region whose rkey is `rkey`, which must be live and scoped; they may touch
 * or overlap) of that region; *out_id names the grant. EINVAL: n is 0 or over
 * DP_TCP_MAX_WINDOWS, a window is empty or outside the region, the region is not scoped;
 * ENOENT: no live region has that rkey; ENOSPC: max_grants are live. Any thread. */
int dp_tcp_grant(dp_tcp *eng, uint32_t peer, uint32_t rkey, const uint64_t *ranges,
                 uint32_t n, uint32_t *out_id);
/* [int] End a grant (ENOENT when unknown or ended). When it returns no byte lands in
 * its windows any more, a WRITE under way included (its rest is refused). Any thread. */
int dp_tcp_ungrant(dp_tcp *eng, uint32_t id);
/* [int] Stop the server thread (closing accepted sockets) and free the engine; its
 * regions, CQs and connections must be gone (EBUSY otherwise). */
int dp_tcp_destroy(dp_tcp *eng);

/* [handle] Register host memory (the caller keeps it alive until dereg); out gets
 * addr/length and lkey == rkey. ENOSPC when the table is full. A WRITE into it needs
 * DP_ACCESS_REMOTE_WRITE; a WRITE from it needs nothing. */
dp_tcp_mr *dp_tcp_mr_reg(dp_tcp *eng, void *addr, uint64_t length, uint32_t access,
                         struct dp_mr_info *out);
/* [int] After it returns no WRITE lands in the region: one in progress completes with
 * REM_ACCESS_ERR at its initiator. */
int dp_tcp_mr_dereg(dp_tcp_mr *mr);

/* [handle] A CQ; posts never let more than `depth` signalled items be outstanding on it.
 * [int] destroy: its connections must be gone (EBUSY). */
dp_tcp_cq *dp_tcp_cq_create(dp_tcp *eng, uint32_t depth);
int dp_tcp_cq_destroy(dp_tcp_cq *cq);

/* Connection configuration; zero fields take the defaults in brackets. */
struct dp_tcp_conn_cfg {
    uint32_t max_send_wr;     /* [256] items outstanding (the credits), at most 65536 */
    uint32_t sockbuf_bytes;   /* SO_SNDBUF/SO_RCVBUF [0 = autotuning] */
    uint32_t user_timeout_ms; /* TCP_USER_TIMEOUT: data unacknowledged this long kills
                                 the connection [0 = kernel default] */
    uint32_t _pad;
};

/* [handle] A connection in RESET whose completions go to `cq`. cfg may be NULL. */
dp_tcp_conn *dp_tcp_conn_create(dp_tcp *eng, dp_tcp_cq *cq, const struct dp_tcp_conn_cfg *cfg);
/* [int] The credential (id, DP_TCP_SECRET_BYTES secret) the next connect presents; the
 * target issued it. Without one, connect does no handshake (a DP_TCP_OPEN target). */
int dp_tcp_conn_set_credential(dp_tcp_conn *conn, uint32_t id, const uint8_t *secret);
/* [int] RESET -> RTS: connect to the engine listening on host:port and, with a
 * credential, pass its challenge-response, all within timeout_ns (ETIMEDOUT; ECONNRESET
 * when the target closed the handshake: refused; EACCES when the target's answer does
 * not prove it holds the secret; ECONNREFUSED etc. as the socket says; EISCONN when not
 * in RESET). The credential is cleared: each connect needs a fresh one. */
int dp_tcp_conn_connect(dp_tcp_conn *conn, const char *host, uint16_t port,
                        int64_t timeout_ns);
/* [int] RESET -> RTS without a socket: a connection of this engine to itself. A post
 * then copies each item in the posting thread (memmove, under the region table's read
 * lock) into this engine's own regions, with the checks the target makes on a socket —
 * the rkey names a live region with remote write that covers the range, else
 * REM_ACCESS_ERR (and LOC_PROT_ERR for a bad lkey) — and completions come from the next
 * poll as over a socket (in order, the rest flushed after a failure). No credential: it
 * reaches no memory but the engine's own. EISCONN when not in RESET. */
int dp_tcp_conn_connect_self(dp_tcp_conn *conn);
/* [int] Any state -> RESET (recovery): the socket is closed abortively (RST: bytes still
 * queued for the peer are discarded, not delivered), outstanding items and their credits
 * are dropped without completions. Connect again afterwards. */
int dp_tcp_conn_reset(dp_tcp_conn *conn);
/* [count] State: 0 RESET, 3 RTS, 6 ERR. */
int dp_tcp_conn_state(dp_tcp_conn *conn);
/* [count] Items posted and not yet retired. */
int dp_tcp_conn_outstanding(dp_tcp_conn *conn);
/* [count] The connection id reported in dp_wc.qp_num (unique per engine, kept by reset). */
int dp_tcp_conn_id(dp_tcp_conn *conn);
/* [int] Reset and free. Reset and destroy of a connection in RESET (never connected, or
 * already reset on the data-path thread) may run on any thread: they then leave the CQ
 * alone. A connected one, even idle, is in the CQ's epoll set and may be on its ready
 * list (an EOF, a failure), so the poller could still be handling it: reset or destroy
 * it on the data-path thread. */
int dp_tcp_conn_destroy(dp_tcp_conn *conn);

/* [int] As dp_qp_post_write: post `n` WRITEs, sent with one gathered sendmsg (one
 * "doorbell") where the socket takes them; every `signal_every`-th item (counted across
 * posts) and the batch's last posted item are signalled; never more than max_send_wr
 * items outstanding nor more signalled ones than the CQ's depth; no allocation.
 * Returns 0 when all n were accepted; -EAGAIN when credits ran out after *n_posted items;
 * -ENOTCONN in RESET; -EINVAL for bad arguments (*n_posted = 0). Socket failures are
 * reported by completions, not here. */
int dp_tcp_post_write(dp_tcp_conn *conn, const struct dp_item *items, uint32_t n,
                      uint32_t signal_every, uint32_t *n_posted);

/* [count] Move bytes and collect up to `max` completions of the CQ's connections without
 * blocking; returns their credits. */
int dp_tcp_cq_poll(dp_tcp_cq *cq, struct dp_wc *out, uint32_t max);
/* [count] Sleep in epoll until at least one completion, timeout_ns elapsed, or
 * dp_tcp_cq_wake (0 for the last two). */
int dp_tcp_cq_wait(dp_tcp_cq *cq, struct dp_wc *out, uint32_t max, int64_t timeout_ns);
/* [int] Make a dp_tcp_cq_wait in progress (or the next one) return. Any thread. */
int dp_tcp_cq_wake(dp_tcp_cq *cq);

/* ------------------------------------------------------------------ store reads */

/* One block-file read of a batch (dp_sio_read): the file `path`, relative to the
 * store's root descriptor, opened beneath it without following any symlink and only if
 * it is a regular file, read from offset 0 into up to 3 buffers in order (header, body,
 * tail: a scatter list), then closed. Outcome in `got` (bytes read, the whole file or
 * less) and `err` (0, or the errno of the failing `stage`). */
struct dp_sio_item {
    const char *path;
    void *bufs[3];
    uint64_t lens[3];
    uint32_t nbufs;        /* 1..3 */
    uint64_t hash_skip;    /* XXH3-64 of file bytes [hash_skip, hash_skip + hash_len), */
    uint64_t hash_len;     /*   computed as the file lands (0: none; with a secret the */
    uint64_t hash;         /*   tag below instead) ... out: here, when all were read */
    int32_t err;           /* out: 0 or errno */
    int32_t stage;         /* out: enum dp_sio_stage where err was raised */
    int32_t hashed;        /* out: 1 when `hash` holds the digest */
    int32_t tag;           /* out, when dp_sio_read has a secret: 1 when the block tag of
                            * file bytes [0, DP_TAG_HEAD) and the hash range equals the
                            * one stored at [DP_TAG_HEAD, +DP_TAG_BYTES) (bufs[0] holds
                            * both), -1 when it differs, 0 when not computed */
    int64_t got;           /* out: bytes read */
};

enum dp_sio_stage {
    DP_SIO_OK = 0,
    DP_SIO_OPEN = 1,       /* ENOENT: no block; ELOOP/EXDEV/ENOTDIR: a path that
                              leaves the store or crosses a symlink */
    DP_SIO_NOT_REGULAR = 2,/* err = EISDIR or ENXIO: a directory, FIFO... in place of it */
    DP_SIO_DIRECT = 3,     /* O_DIRECT refused by the filesystem (EINVAL) */
    DP_SIO_READ = 4        /* the read itself (EINVAL with O_DIRECT: misaligned/refused) */
};

/* [int] Read a batch of `n` block files beneath `root_fd`: files opened in turn, their
 * reads submitted to one io_uring ring with at most `depth` in flight (refilled as they
 * complete), one io_uring_enter per refill; each file's hash range is hashed once the
 * slots its landing freed are refilled and submitted, while the others are in flight
 * (a dp_sio_ring used once, below). With `direct` each file is read with
 * O_DIRECT (every buffer address and length must then be 4096-aligned). With `secret`
 * (the cluster key, or NULL) each file's block tag is checked in the same pass. Per-item
 * outcomes in the items; returns 0, or -ENOSYS/-EPERM when the kernel has no io_uring
 * or openat2 for us (nothing was read: use a thread pool), -EINVAL for bad arguments.
 * Blocking; any thread; no state kept between calls but dp_sio_ring_create's note that
 * openat2 works. */
int dp_sio_read(int root_fd, struct dp_sio_item *items, uint32_t n, uint32_t depth,
                int direct, const uint8_t *secret, uint32_t secret_len);

/* A read ring that outlives one batch, for a reader thread that streams block reads:
 * batches are pushed as they come into its backlog and each slot is refilled from it as
 * its read lands, so the disk never waits for a batch's slowest read nor for the caller
 * between batches. Same items, checks and hashing as dp_sio_read (built on it).
 * Threads: create and destroy on any thread; push and step on one thread at a time (the
 * ring's reader thread). An item pushed belongs to the ring until a step returns it in
 * `done`: keep it, its path and its buffers alive and untouched until then. */
typedef struct dp_sio_ring dp_sio_ring;

/* [handle] A ring of `depth` (1..4096) reads in flight and a backlog of `backlog` items
 * pushed but not yet opened, beneath `root_fd` (kept open by the caller until destroy),
 * O_DIRECT with `direct`, the block tag checked with `secret` (copied; NULL = none).
 * ENOSYS/EPERM when the kernel has no io_uring or openat2 for us (a seccomp filter says
 * EPERM; openat2 is probed here, before any file, until it first works in the process;
 * after that the root is only checked to be a directory: ENOTDIR, EBADF): use a thread
 * pool; EINVAL for bad arguments. */
dp_sio_ring *dp_sio_ring_create(int root_fd, uint32_t depth, uint32_t backlog, int direct,
                                const uint8_t *secret, uint32_t secret_len);
/* [int] Free the ring; -EBUSY while items are queued or in flight (step until none). */
int dp_sio_ring_destroy(dp_sio_ring *ring);
/* [count] Append items[0..n) to the backlog, in order, as far as it has room: how many
 * (the rest were not touched: push them again later). -EINVAL for a bad item (nothing
 * pushed). No I/O. */
int dp_sio_ring_push(dp_sio_ring *ring, struct dp_sio_item *items, uint32_t n);
/* [count] Items pushed and not yet returned by a step (queued or in flight). */
int dp_sio_ring_inflight(dp_sio_ring *ring);
/* [count] One turn of the reader: open and queue backlog items while slots are free,
 * wait for a landing when `wait` and nothing else is done, reap what landed, refill the
 * slots it freed from the backlog and submit them, and only then hash the files that
 * landed (the disk reads the next files meanwhile). Returns how many items are done,
 * their pointers in done[0..count) (outcome in each item, as dp_sio_read; a file that
 * could not be opened is done at once); max_done >= 2 * depth. -EINVAL for bad
 * arguments; another -errno when io_uring_enter failed and nothing was done (reads in
 * flight stay in flight: step again). Blocking only with `wait`. */
int dp_sio_ring_step(dp_sio_ring *ring, struct dp_sio_item **done, uint32_t max_done,
                     int wait);

/* ------------------------------------------------------------------ block tags */

/* The keyed integrity tag of a block file, format 2 (csrc/block_tag.c): Poly1305 under
 * BLAKE2b-256(key = secret[:64], label || nonce) over the header's first DP_TAG_HEAD
 * bytes (the nonce is their last DP_TAG_NONCE) and the payload. */
enum dp_tag_sizes {
    DP_TAG_BYTES = 16,     /* the tag, stored at header bytes [DP_TAG_HEAD, +16) */
    DP_TAG_NONCE = 16,     /* the per-write random nonce, header bytes [112, 128) */
    DP_TAG_HEAD = 128      /* header bytes the tag covers: a multiple of Poly1305's 16-byte
                            * block, so the payload is fed on the block boundary (off it,
                            * libcrypto's Poly1305 runs at half speed) */
};

/* [int] The tag of `head` (>= DP_TAG_HEAD bytes) and `payload` into `out`
 * (DP_TAG_BYTES). -EINVAL for a secret under 32 bytes, -ENOSYS for a libcrypto without
 * BLAKE2BMAC or POLY1305, -EIO when it fails. Any thread; no state. */
int dp_block_tag(const uint8_t *secret, uint32_t secret_len, const void *head,
                 const void *payload, uint64_t payload_len, uint8_t *out);

/* DP_CDEF_END */

/* Not for cffi: the same tag computed piecewise (store_io.c hashes a read as it lands).
 * begin -> update* -> end; end frees the state whatever it returns. [int] each. */
struct dp_tag {
    void *ctx;
};
int dp_tag_begin(struct dp_tag *t, const uint8_t *secret, uint32_t secret_len,
                 const uint8_t *nonce);
int dp_tag_update(struct dp_tag *t, const void *data, uint64_t len);
int dp_tag_end(struct dp_tag *t, uint8_t *out);

#endif /* DP_H */
