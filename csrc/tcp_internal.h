/*
 * tcp_internal.h - shared by the TCP provider's files: tcp_ctl.c (control: engine,
 * regions, CQs, connect/reset), tcp_dp.c (the initiator's data path: post, poll, wait),
 * tcp_target.c (the server thread: accept, admission, the receive path), tcp_auth.c
 * (the handshake) and tcp_sock.c (clock, socket options, resolution). Not part of the
 * FFI.
 */
#ifndef DP_TCP_INTERNAL_H
#define DP_TCP_INTERNAL_H

#include <netdb.h>
#include <pthread.h>
#include <stdint.h>
#include <sys/uio.h>

#include "dp.h"

/* ibv_wc_status numbering (dp.h). */
enum {
    TCP_WC_SUCCESS = 0,
    TCP_WC_LOC_PROT_ERR = 4,
    TCP_WC_WR_FLUSH_ERR = 5,
    TCP_WC_REM_ACCESS_ERR = 10,
    TCP_WC_RETRY_EXC_ERR = 12,
};

/* ibv_qp_state numbering (dp.h). */
enum { TCP_RESET = 0, TCP_RTS = 3, TCP_ERR = 6 };

enum {
    TCP_MAGIC = 0xd7,        /* first header byte: a stray client is cut off, not obeyed */
    TCP_OP_WRITE = 1,        /* header + `length` payload bytes into (rkey, remote_addr) */
    TCP_OP_LOCERR = 2,       /* no payload: "fail here with LOC_PROT_ERR" (an ordered
                                barrier so the items before it still complete first) */
};

/* One request on the wire: 32 bytes, little-endian. */
struct tcp_req_hdr {
    uint8_t magic;
    uint8_t op;
    uint8_t signalled;       /* 1: ack on success (failures are always acked) */
    uint8_t _pad0;
    uint32_t length;         /* payload bytes */
    uint32_t rkey;
    uint32_t _pad1;
    uint64_t remote_addr;
    uint64_t seq;            /* the initiator's ring position; the wr_id stays home */
};
_Static_assert(sizeof(struct tcp_req_hdr) == 32, "wire header is 32 bytes");

/* Admission handshake (dp.h): challenge (target), hello (initiator), welcome (target). */
enum { TCP_NONCE = 16, TCP_MAC = 32, TCP_CHALLENGE_MAGIC = 0x31435044u, /* "DPC1" */
       TCP_HELLO_MAGIC = 0x31485044u /* "DPH1" */ };
struct tcp_challenge {
    uint32_t magic;
    uint32_t _pad;
    uint8_t nonce[TCP_NONCE];
};
_Static_assert(sizeof(struct tcp_challenge) == 24, "challenge is 24 bytes");
struct tcp_hello {
    uint32_t magic;
    uint32_t cred_id;
    uint8_t nonce[TCP_NONCE];
    uint8_t mac[TCP_MAC];
};
_Static_assert(sizeof(struct tcp_hello) == 56, "hello is 56 bytes");

/* One ack on the wire: 16 bytes, little-endian. */
struct tcp_ack {
    uint64_t seq;
    int32_t status;          /* ibv_wc_status numbering */
    uint32_t _pad;
};
_Static_assert(sizeof(struct tcp_ack) == 16, "wire ack is 16 bytes");

enum {
    TCP_IOV_MAX = 1024,                  /* entries per sendmsg (Linux UIO_MAXIOV) */
    TCP_ACKBUF = 4096 * 16,              /* initiator: ack bytes read per recv */
    TCP_SRV_ACKS = 1024,                 /* target: acks queued per connection */
    TCP_DISCARD = 64 * 1024,             /* target: drain buffer for invalid WRITEs */
    TCP_SRV_BUDGET = 64,                 /* target: recvmsg calls per connection per
                                            wake-up, so one busy peer cannot starve others */
    TCP_EVENTS = 64,
};
_Static_assert(TCP_IOV_MAX % 2 == 0, "a header and its payload share a sendmsg");

/* A region table slot. key: random, nonzero, unique among live regions and never the
 * slot's previous one (the lkey and the rkey). */
struct tcp_region {
    uint64_t addr;
    uint64_t length;
    uint32_t access;
    uint32_t key;
    uint8_t live;
};

/* A grant (tcp_scope.c): the windows of one region that one peer tag may WRITE into,
 * sorted, disjoint [start, end) address pairs. id = gen << 16 | slot. Under eng->lock. */
struct tcp_grant {
    uint32_t id;
    uint32_t peer;
    uint32_t key;                    /* the region's rkey when granted */
    uint32_t n;                      /* windows */
    uint64_t *win;                   /* 2 * n: start, end */
    uint32_t next;                   /* the next grant of its bucket (slot + 1; 0 = end) */
    uint16_t gen;
    uint8_t live;
};

enum { TCP_GRANT_BUCKETS = 256 };    /* grants hashed by peer tag */

/* An issued credential: id = gen << 16 | slot (not secret), the secret, the peer tag. */
struct tcp_cred {
    uint32_t id;
    uint32_t peer;
    uint16_t gen;
    uint8_t live;
    uint8_t secret[DP_TCP_SECRET_BYTES];
};

/* A connection accepted by the server thread (the target side of a peer's dp_tcp_conn).
 * Owned and touched only by the server thread. */
struct tcp_srv_conn {
    int fd;
    uint32_t events;                 /* the epoll interest currently set */
    uint8_t admitted;                /* passed the handshake (or the engine is open) */
    uint32_t peer;                   /* the credential's peer tag, once admitted */
    int64_t deadline_ns;             /* pending: closed unadmitted after this */
    uint8_t nonce[TCP_NONCE];        /* pending: the challenge sent */
    uint32_t hello_got;              /* pending: bytes of the hello read so far */
    struct tcp_hello hello;
    struct tcp_srv_conn *pend_prev, *pend_next;   /* pending FIFO (by deadline) */
    uint8_t addr[16];                /* the source address (IPv4 in its first 4 bytes) */
    uint8_t addr_len;
    struct tcp_req_hdr hdr;          /* the header being read */
    uint32_t hdr_got;                /* bytes of it read so far */
    uint64_t left;                   /* payload bytes of the current item still to read */
    uint8_t *dst;                    /* where they go: the region, or NULL = discard */
    uint32_t slot;                   /* the current item's region, rechecked per recv */
    uint32_t key;
    uint32_t grant;                  /* the current item's window (scoped region): its
                                        grant's table slot, rechecked per recv */
    uint32_t grant_id;               /* 0: the region is not scoped */
    uint8_t cur_signalled;
    uint8_t flushing;                /* after a failure: drain everything, ack nothing */
    uint64_t cur_seq;
    uint64_t cur_len;
    uint32_t ack_n;                  /* acks queued */
    uint32_t ack_off;                /* bytes of them already sent */
    struct tcp_ack acks[TCP_SRV_ACKS];
    struct tcp_srv_conn *prev, *next;
};

struct dp_tcp {
    int listen_fd;
    int epfd;                        /* server thread's epoll set */
    int wake_fd;                     /* eventfd: tells the server thread to exit */
    uint16_t port;
    uint32_t sockbuf;
    pthread_t thread;
    int thread_started;
    pthread_rwlock_t lock;           /* the region table: readers = server thread while
                                        writing into a region, posts validating lkeys;
                                        writers = reg/dereg */
    struct tcp_region *regions;
    uint32_t max_regions;
    uint32_t hi_slot;                /* slots [0, hi_slot) may be live (under lock) */
    uint32_t flags;                  /* DP_TCP_OPEN */
    uint32_t max_pending, handshake_timeout_ms, max_conns_per_peer, max_pending_per_addr;
    struct tcp_grant *grants;        /* under lock (tcp_scope.c) */
    uint32_t max_grants;
    uint32_t grant_heads[TCP_GRANT_BUCKETS];   /* slot + 1 of a bucket's first grant */
    pthread_mutex_t cred_lock;       /* the credential table: admit/revoke (any thread),
                                        the server thread's check */
    struct tcp_cred *creds;
    uint32_t max_creds;
    struct tcp_srv_conn *pend_head, *pend_tail;   /* server thread only */
    uint32_t n_pending;                            /* server thread only */
    uint32_t n_mrs, n_cqs, n_conns;  /* children alive (atomics) */
    uint32_t next_conn_id;           /* atomic */
    struct dp_tcp_stats stats;       /* written by the server thread (relaxed atomics) */
    struct tcp_srv_conn *srv_conns;  /* server thread only */
    int64_t accept_resume_ns;        /* server thread: 0, or when to watch the listener
                                        again after accept ran out of descriptors */
    uint8_t *discard;                /* server thread only */
};

struct dp_tcp_mr {
    dp_tcp *eng;
    uint32_t slot;
    uint32_t rkey;
};

struct dp_tcp_cq {
    dp_tcp *eng;
    int epfd;                        /* the connections' sockets (edge-triggered) + wake */
    int wake_fd;                     /* eventfd written by dp_tcp_cq_wake */
    uint32_t depth;
    uint32_t sig_outstanding;        /* signalled items outstanding on all connections */
    uint32_t n_conns;                /* atomic */
    int woken;
    dp_tcp_conn *ready;              /* connections with work that needs no new event */
};

/* A posted item: the header is sent from here, so it lives until retired. */
struct tcp_wqe {
    struct tcp_req_hdr hdr;
    uint64_t local_addr;
    uint64_t wr_id;
    uint32_t length;
    uint8_t signalled;
};

struct dp_tcp_conn {
    dp_tcp *eng;
    dp_tcp_cq *cq;
    uint32_t id;
    int fd;
    int state;
    struct dp_tcp_conn_cfg cfg;
    uint8_t has_cred;                /* a credential for the next connect */
    uint32_t cred_id;
    uint8_t cred_secret[DP_TCP_SECRET_BYTES];
    /* The ring of posted items: [head, send_idx) fully sent and awaiting retirement,
     * send_idx partly sent (send_off bytes of header + payload), [send_idx, tail) queued.
     * Indices count up forever; slot = index & mask. */
    struct tcp_wqe *ring;
    uint32_t mask;
    uint64_t head, send_idx, tail;
    uint64_t send_off;
    uint32_t unsig_run;              /* unsignalled items since the last signalled one */
    uint32_t sig_outstanding;
    uint8_t tx_blocked;              /* the socket said EAGAIN: wait for EPOLLOUT */
    uint8_t tx_stopped;              /* a LOCERR went out: send nothing more */
    uint8_t rx_more;                 /* the socket may hold unread acks */
    uint8_t on_ready;
    int32_t fail_status;             /* status of the first synthesised completion */
    uint32_t fail_errno;
    dp_tcp_conn *ready_next;
    struct iovec *iov;               /* TCP_IOV_MAX entries, built per sendmsg */
    uint32_t ack_pos, ack_len;       /* unread bytes of ackbuf are [ack_pos, ack_len) */
    uint8_t ackbuf[TCP_ACKBUF];
    /* A connection to this engine itself (dp_tcp_conn_connect_self): posts copy; items
     * [head, self_done) were copied, self_sig_done of them signalled and not completed;
     * self_status != 0: item self_done failed with it (nothing after it was copied). */
    uint8_t self;
    int32_t self_status;
    uint64_t self_done;
    uint32_t self_sig_done;
};

/* Server-thread counter bump; readers use __atomic_load_n. */
#define TCP_STAT_ADD(eng, field, n) \
    __atomic_store_n(&(eng)->stats.field, (eng)->stats.field + (n), __ATOMIC_RELAXED)

/* now + timeout, with a negative timeout as 0 and no overflow for a huge one. */
static inline int64_t tcp_deadline(int64_t now, int64_t timeout_ns)
{
    if (timeout_ns <= 0)
        return now;
    return timeout_ns > INT64_MAX - now ? INT64_MAX : now + timeout_ns;
}

/* The region table. Caller holds eng->lock (read or write). Keys are random
 * (tcp_ctl.c). Used by the initiator (local ranges) and the target (rkeys): a scan of
 * the slots in use, a handful in practice (one per registered buffer), per WRITE. */
static inline const struct tcp_region *region_find(const dp_tcp *eng, uint32_t key)
{
    if (key == 0)
        return NULL;
    for (uint32_t i = 0; i < eng->hi_slot; i++) {
        const struct tcp_region *r = &eng->regions[i];
        if (r->key == key && r->live)
            return r;
    }
    return NULL;
}

static inline int region_covers(const struct tcp_region *r, uint64_t addr, uint64_t len)
{
    return addr >= r->addr && len <= r->length && addr - r->addr <= r->length - len;
}

/* tcp_scope.c: may a connection of peer tag `peer` WRITE [addr, addr + len) into the
 * scoped region r? Its grant's slot + 1 (0: no window covers it). Caller holds eng->lock;
 * *hint is the slot to try first (the connection's last). */
uint32_t tcp_scope_find(const dp_tcp *eng, uint32_t peer, const struct tcp_region *r,
                        uint64_t addr, uint64_t len, uint32_t hint);
/* The grant in `slot` still has id `id` (not ungranted since). Caller holds eng->lock. */
static inline int tcp_scope_live(const dp_tcp *eng, uint32_t slot, uint32_t id)
{
    return slot < eng->max_grants && eng->grants[slot].live && eng->grants[slot].id == id;
}
void tcp_scope_free(dp_tcp *eng);

/* The files call downward only: tcp_ctl.c -> tcp_target.c, tcp_dp.c, tcp_auth.c ->
 * tcp_sock.c; tcp_target.c -> tcp_auth.c -> tcp_sock.c; tcp_dp.c -> tcp_sock.c;
 * tcp_target.c, tcp_ctl.c -> tcp_scope.c. */

/* tcp_sock.c: the clock, socket options, name resolution. */
int tcp_now_ns(int64_t *out);
void tcp_tune_socket(int fd, uint32_t sockbuf, uint32_t user_timeout_ms);
int tcp_resolve(const char *host, uint16_t port, int passive, struct addrinfo **out);
/* tcp_auth.c: the handshake's MAC (HMAC-SHA256 of the transcript) and random bytes. */
void tcp_auth_mac(const uint8_t secret[DP_TCP_SECRET_BYTES], char role,
                  const uint8_t nonce_t[TCP_NONCE], const uint8_t nonce_i[TCP_NONCE],
                  uint32_t cred_id, uint8_t out[TCP_MAC]);
int tcp_auth_equal(const uint8_t *a, const uint8_t *b, size_t n);
int tcp_random(void *buf, size_t n);
/* Target: 0 = keep reading (not done), 1 = admitted, -1 = close it. */
int tcp_srv_handshake(dp_tcp *eng, struct tcp_srv_conn *c);
/* Initiator: the handshake on a connected socket, bounded by deadline; 0 / -errno. */
int tcp_conn_handshake(dp_tcp_conn *conn, int fd, int64_t deadline);
/* tcp_target.c: the engine's server thread (pthread_create'd by dp_tcp_create). */
void *tcp_target_main(void *eng);
/* tcp_dp.c: the initiator's side of a connection, for tcp_ctl.c's reset/destroy. */
void tcp_conn_fail(dp_tcp_conn *conn, int32_t status, uint32_t err);
void tcp_ready_remove(dp_tcp_conn *conn);

#endif /* DP_TCP_INTERNAL_H */
