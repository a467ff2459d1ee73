/*
 * store_io.c - batched block-file reads for the BlockStore: openat2 beneath the store's
 * root (no symlink anywhere on the way), a regular-file check, O_DIRECT, then every
 * file's scatter read on one io_uring ring, `depth` in flight and refilled as they
 * complete. Mechanism only: what a failure means (a miss, an unsafe path, a filesystem
 * without O_DIRECT) is the caller's (dualpath/storage/store.py).
 *
 * The ring is set up per call with the raw syscalls (no liburing): a batch is a
 * request's hit blocks, megabytes, against which ~20 us of setup is noise, and no ring
 * outlives the call (nothing to own, nothing to close).
 */
#include "dp.h"

#include <errno.h>
#include <fcntl.h>
#include <linux/io_uring.h>
#include <linux/openat2.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>
#include <openssl/crypto.h>
#include <xxhash.h>
#if defined(__x86_64__)
/* Debian's libxxhash picks XXH3's widest vector unit (AVX2, AVX-512) at run time only
 * through its _dispatch entry points; this header maps the plain names onto them (its
 * baseline build is SSE2: ~1/3 of the speed here). */
#include <xxh_x86dispatch.h>
#endif

struct ring {
    int fd;
    void *sq_ptr, *cq_ptr;
    size_t sq_len, cq_len, sqes_len;
    unsigned *sq_head, *sq_tail, *sq_mask, *sq_array;
    unsigned *cq_head, *cq_tail, *cq_mask;
    struct io_uring_sqe *sqes;
    struct io_uring_cqe *cqes;
};

static void ring_close(struct ring *r)
{
    if (r->sqes && r->sqes != MAP_FAILED)
        munmap(r->sqes, r->sqes_len);
    if (r->cq_ptr && r->cq_ptr != MAP_FAILED && r->cq_ptr != r->sq_ptr)
        munmap(r->cq_ptr, r->cq_len);
    if (r->sq_ptr && r->sq_ptr != MAP_FAILED)
        munmap(r->sq_ptr, r->sq_len);
    if (r->fd >= 0)
        close(r->fd);
}

static int ring_open(struct ring *r, unsigned entries)
{
    struct io_uring_params p;
    memset(&p, 0, sizeof(p));
    memset(r, 0, sizeof(*r));
    r->fd = (int)syscall(__NR_io_uring_setup, entries, &p);
    if (r->fd < 0)
        return -errno;
    r->sq_len = p.sq_off.array + p.sq_entries * sizeof(unsigned);
    r->cq_len = p.cq_off.cqes + p.cq_entries * sizeof(struct io_uring_cqe);
    if (p.features & IORING_FEAT_SINGLE_MMAP) {
        if (r->cq_len > r->sq_len)
            r->sq_len = r->cq_len;
        r->cq_len = r->sq_len;
    }
    r->sq_ptr = mmap(NULL, r->sq_len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE,
                     r->fd, IORING_OFF_SQ_RING);
    if (r->sq_ptr == MAP_FAILED)
        goto fail;
    if (p.features & IORING_FEAT_SINGLE_MMAP) {
        r->cq_ptr = r->sq_ptr;
    } else {
        r->cq_ptr = mmap(NULL, r->cq_len, PROT_READ | PROT_WRITE,
                         MAP_SHARED | MAP_POPULATE, r->fd, IORING_OFF_CQ_RING);
        if (r->cq_ptr == MAP_FAILED)
            goto fail;
    }
    r->sqes_len = p.sq_entries * sizeof(struct io_uring_sqe);
    r->sqes = mmap(NULL, r->sqes_len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE,
                   r->fd, IORING_OFF_SQES);
    if (r->sqes == MAP_FAILED)
        goto fail;
    char *sq = r->sq_ptr, *cq = r->cq_ptr;
    r->sq_head = (unsigned *)(sq + p.sq_off.head);
    r->sq_tail = (unsigned *)(sq + p.sq_off.tail);
    r->sq_mask = (unsigned *)(sq + p.sq_off.ring_mask);
    r->sq_array = (unsigned *)(sq + p.sq_off.array);
    r->cq_head = (unsigned *)(cq + p.cq_off.head);
    r->cq_tail = (unsigned *)(cq + p.cq_off.tail);
    r->cq_mask = (unsigned *)(cq + p.cq_off.ring_mask);
    r->cqes = (struct io_uring_cqe *)(cq + p.cq_off.cqes);
    return 0;
fail:;
    int e = errno;
    ring_close(r);
    return -e;
}

/* Open item `it`'s file beneath root_fd as a regular file (O_DIRECT with `direct`);
 * the fd, or -1 with it->err/stage set. */
static int open_block(int root_fd, struct dp_sio_item *it, int direct)
{
    struct open_how how;
    memset(&how, 0, sizeof(how));
    /* O_NONBLOCK: a FIFO planted in place of a block cannot block the open. */
    how.flags = O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK;
    how.resolve = RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS;
    int fd = (int)syscall(__NR_openat2, root_fd, it->path, &how, sizeof(how));
    if (fd < 0) {
        it->err = errno;
        it->stage = DP_SIO_OPEN;
        return -1;
    }
    struct stat st;
    if (fstat(fd, &st) != 0) {
        it->err = errno;
        it->stage = DP_SIO_OPEN;
        close(fd);
        return -1;
    }
    if (!S_ISREG(st.st_mode)) {
        it->err = S_ISDIR(st.st_mode) ? EISDIR : ENXIO;
        it->stage = DP_SIO_NOT_REGULAR;
        close(fd);
        return -1;
    }
    int flags = O_RDONLY | (direct ? O_DIRECT : 0);   /* drops O_NONBLOCK */
    if (fcntl(fd, F_SETFL, flags) != 0) {
        it->err = errno;
        it->stage = DP_SIO_DIRECT;
        close(fd);
        return -1;
    }
    return fd;
}

/* One file in flight: its descriptor and what is left of its scatter list. */
struct flight {
    int fd;
    struct dp_sio_item *item;
    struct iovec iov[3];
    uint32_t niov;
};

static void prep_readv(struct ring *r, struct flight *f, uint64_t off, uint64_t slot)
{
    unsigned tail = *r->sq_tail;                 /* only we write it */
    unsigned idx = tail & *r->sq_mask;
    struct io_uring_sqe *sqe = &r->sqes[idx];
    memset(sqe, 0, sizeof(*sqe));
    sqe->opcode = IORING_OP_READV;
    sqe->fd = f->fd;
    sqe->addr = (uint64_t)(uintptr_t)f->iov;
    sqe->len = f->niov;
    sqe->off = off;
    sqe->user_data = slot;
    r->sq_array[idx] = idx;
    __atomic_store_n(r->sq_tail, tail + 1, __ATOMIC_RELEASE);
}

/* SQEs queued that the kernel has not taken yet (an enter cut short by a signal leaves
 * some: the next enter submits them). */
static unsigned unsubmitted(struct ring *r)
{
    return *r->sq_tail - __atomic_load_n(r->sq_head, __ATOMIC_ACQUIRE);
}

/* Drop `done` bytes from the front of f's scatter list. */
static void advance(struct flight *f, uint64_t done)
{
    uint32_t k = 0;
    while (k < f->niov && done >= f->iov[k].iov_len)
        done -= f->iov[k++].iov_len;
    memmove(f->iov, f->iov + k, (f->niov - k) * sizeof(struct iovec));
    f->niov -= k;
    if (f->niov && done) {
        f->iov[0].iov_base = (char *)f->iov[0].iov_base + done;
        f->iov[0].iov_len -= done;
    }
}

/* The check of file bytes [hash_skip, hash_skip + hash_len) of a read item, across its
 * buffers (the payload of a block read with O_DIRECT ends in the tail page): without a
 * secret their XXH3-64; with one the block tag of the header's first DP_TAG_HEAD bytes
 * and that range instead (it catches every accident the digest would, and forgeries),
 * a cache-sized piece at a time. */
#define PASS_PIECE (64u << 10)

static void hash_item(XXH3_state_t *st, struct dp_sio_item *it, const uint8_t *secret,
                      uint32_t secret_len)
{
    uint64_t skip = it->hash_skip, left = it->hash_len;
    if (!left || (uint64_t)it->got < skip + left)
        return;
    const uint8_t *head = it->bufs[0];
    struct dp_tag t = {NULL};
    int tagging = 0;                       /* 1 tag, 0 digest, -1 neither (libcrypto failed:
                                            * the caller computes what is missing) */
    if (secret && it->lens[0] >= DP_TAG_HEAD + DP_TAG_BYTES &&
        dp_tag_begin(&t, secret, secret_len, head + DP_TAG_HEAD - DP_TAG_NONCE) == 0)
        tagging = dp_tag_update(&t, head, DP_TAG_HEAD) == 0 ? 1 : -1;
    if (tagging == 0)
        XXH3_64bits_reset(st);
    for (uint32_t k = 0; k < it->nbufs && left; k++) {
        uint64_t len = it->lens[k];
        if (skip >= len) {
            skip -= len;
            continue;
        }
        uint64_t take = len - skip < left ? len - skip : left;
        const char *p = (const char *)it->bufs[k] + skip;
        for (uint64_t off = 0; off < take; off += PASS_PIECE) {
            uint64_t piece = take - off < PASS_PIECE ? take - off : PASS_PIECE;
            if (tagging == 0)
                XXH3_64bits_update(st, p + off, piece);
            else if (tagging > 0 && dp_tag_update(&t, p + off, piece) != 0)
                tagging = -1;
        }
        left -= take;
        skip = 0;
    }
    if (!t.ctx) {
        it->hash = XXH3_64bits_digest(st);
        it->hashed = 1;
        return;
    }
    uint8_t tag[DP_TAG_BYTES];
    if (dp_tag_end(&t, tag) == 0 && tagging > 0)
        it->tag = CRYPTO_memcmp(tag, head + DP_TAG_HEAD, DP_TAG_BYTES) == 0 ? 1 : -1;
}

/* A ring that outlives one batch (dp_sio_ring_*): its reads in flight, one slot each,
 * and the items handed over but not yet opened (a FIFO of `cap` pointers). */
struct dp_sio_ring {
    struct ring r;
    int root_fd;
    int direct;
    uint32_t depth;
    uint32_t nfree, inflight;
    struct flight *fl;
    uint32_t *free_slots;
    struct dp_sio_item **fifo;
    uint32_t cap, first, queued;  /* fifo[first .. first + queued) mod cap */
    uint8_t *secret;              /* a copy, wiped at destroy */
    uint32_t secret_len;
    XXH3_state_t *hst;            /* opaque in the shared library's ABI */
};

dp_sio_ring *dp_sio_ring_create(int root_fd, uint32_t depth, uint32_t backlog, int direct,
                                const uint8_t *secret, uint32_t secret_len)
{
    if (depth == 0 || depth > 4096 || backlog == 0 || backlog > (1u << 24) ||
        (secret_len && !secret)) {
        errno = EINVAL;
        return NULL;
    }
    /* openat2 is probed here, not per file: a kernel without it (ENOSYS) or a seccomp
     * filter that refuses it (EPERM) fails the create, before any file is touched. Once
     * it worked it is taken to work for the process (a ring per batch no longer pays an
     * open and close; threads that race here probe twice, harmlessly), and only the root
     * is checked: a directory (ENOTDIR, EBADF otherwise, as the probe said). */
    static _Atomic int openat2_works;
    if (openat2_works) {
        struct stat st;
        if (fstat(root_fd, &st) != 0)
            return NULL;
        if (!S_ISDIR(st.st_mode)) {
            errno = ENOTDIR;
            return NULL;
        }
    } else {
        struct open_how how;
        memset(&how, 0, sizeof(how));
        how.flags = O_RDONLY | O_CLOEXEC | O_DIRECTORY;
        how.resolve = RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS;
        int probe = (int)syscall(__NR_openat2, root_fd, ".", &how, sizeof(how));
        if (probe < 0)
            return NULL;
        close(probe);
        openat2_works = 1;
    }
    dp_sio_ring *g = calloc(1, sizeof(*g));
    if (!g) {
        errno = ENOMEM;
        return NULL;
    }
    unsigned entries = 1;
    while (entries < depth)
        entries <<= 1;
    int rc = ring_open(&g->r, entries);
    if (rc < 0) {
        free(g);
        errno = -rc;
        return NULL;
    }
    g->root_fd = root_fd;
    g->direct = direct;
    g->depth = depth;
    g->cap = backlog;
    g->fl = calloc(depth, sizeof(*g->fl));
    g->free_slots = calloc(depth, sizeof(*g->free_slots));
    g->fifo = calloc(backlog, sizeof(*g->fifo));
    g->hst = XXH3_createState();
    if (secret_len) {
        g->secret = malloc(secret_len);
        if (g->secret)
            memcpy(g->secret, secret, secret_len);
        g->secret_len = secret_len;
    }
    if (!g->fl || !g->free_slots || !g->fifo || !g->hst || (secret_len && !g->secret)) {
        dp_sio_ring_destroy(g);
        errno = ENOMEM;
        return NULL;
    }
    for (uint32_t s = 0; s < depth; s++)
        g->free_slots[s] = depth - 1 - s;
    g->nfree = depth;
    return g;
}

int dp_sio_ring_destroy(dp_sio_ring *g)
{
    if (!g)
        return 0;
    if (g->inflight || g->queued)
        return -EBUSY;
    ring_close(&g->r);
    free(g->fl);
    free(g->free_slots);
    free(g->fifo);
    XXH3_freeState(g->hst);
    if (g->secret) {
        OPENSSL_cleanse(g->secret, g->secret_len);
        free(g->secret);
    }
    free(g);
    return 0;
}

int dp_sio_ring_push(dp_sio_ring *g, struct dp_sio_item *items, uint32_t n)
{
    if (!g || (n && !items))
        return -EINVAL;
    for (uint32_t i = 0; i < n; i++)
        if (!items[i].path || items[i].nbufs < 1 || items[i].nbufs > 3)
            return -EINVAL;
    uint32_t take = g->cap - g->queued < n ? g->cap - g->queued : n;
    for (uint32_t i = 0; i < take; i++)
        g->fifo[(g->first + g->queued++) % g->cap] = &items[i];
    return (int)take;
}

int dp_sio_ring_inflight(dp_sio_ring *g)
{
    return (int)(g->inflight + g->queued);
}

/* The FIFO's oldest item, taken off it (g->queued > 0). */
static struct dp_sio_item *fifo_pop(dp_sio_ring *g)
{
    struct dp_sio_item *it = g->fifo[g->first];
    g->first = (g->first + 1) % g->cap;
    g->queued--;
    return it;
}

/* Open and queue the FIFO's items while slots are free (a file that cannot be opened is
 * done at once, into done[], while done[] has room for it beside a full reap). */
static void take(dp_sio_ring *g, struct dp_sio_item **done, uint32_t *ndone,
                 uint32_t max_done)
{
    struct ring *r = &g->r;
    while (g->nfree && g->queued && *ndone + g->depth < max_done) {
        struct dp_sio_item *it = fifo_pop(g);
        it->err = 0;
        it->stage = DP_SIO_OK;
        it->got = 0;
        it->hashed = 0;
        it->tag = 0;
        int fd = open_block(g->root_fd, it, g->direct);
        if (fd < 0) {
            done[(*ndone)++] = it;
            continue;
        }
        uint32_t s = g->free_slots[--g->nfree];
        struct flight *f = &g->fl[s];
        f->fd = fd;
        f->item = it;
        f->niov = it->nbufs;
        for (uint32_t k = 0; k < it->nbufs; k++) {
            f->iov[k].iov_base = it->bufs[k];
            f->iov[k].iov_len = it->lens[k];
        }
        prep_readv(r, f, 0, s);
        g->inflight++;
    }
}

/* Reap the completions the ring holds: finished files into done[]; a short buffered
 * read is queued again for its rest. */
static void reap(dp_sio_ring *g, struct dp_sio_item **done, uint32_t *ndone)
{
    struct ring *r = &g->r;
    unsigned head = *r->cq_head;
    unsigned tail = __atomic_load_n(r->cq_tail, __ATOMIC_ACQUIRE);
    for (; head != tail; head++) {
        struct io_uring_cqe *cqe = &r->cqes[head & *r->cq_mask];
        uint32_t s = (uint32_t)cqe->user_data;
        struct flight *f = &g->fl[s];
        struct dp_sio_item *it = f->item;
        int res = cqe->res;
        int more = 0;
        if (res < 0) {
            it->err = -res;
            it->stage = DP_SIO_READ;
        } else if (res > 0) {
            uint64_t asked = 0;
            for (uint32_t k = 0; k < f->niov; k++)
                asked += f->iov[k].iov_len;
            it->got += res;
            advance(f, (uint64_t)res);
            /* Short: buffered, read the rest; O_DIRECT, the end of the file (the next
             * offset would not be aligned anyway). */
            more = f->niov > 0 && !(g->direct && (uint64_t)res < asked);
        }                                          /* res == 0: end of file */
        if (more) {
            prep_readv(r, f, (uint64_t)it->got, s);   /* goes with the next enter */
            continue;
        }
        close(f->fd);
        done[(*ndone)++] = it;
        g->free_slots[g->nfree++] = s;
        g->inflight--;
    }
    __atomic_store_n(r->cq_head, head, __ATOMIC_RELEASE);
}

int dp_sio_ring_step(dp_sio_ring *g, struct dp_sio_item **done, uint32_t max_done, int wait)
{
    if (!g || !done || max_done < 2 * g->depth)
        return -EINVAL;
    struct ring *r = &g->r;
    uint32_t ndone = 0;
    int err = 0;
    take(g, done, &ndone, max_done);
    int block = wait && g->inflight && ndone == 0;
    if (block || unsubmitted(r)) {
        int got = (int)syscall(__NR_io_uring_enter, r->fd, unsubmitted(r), block ? 1 : 0,
                               block ? IORING_ENTER_GETEVENTS : 0, NULL, 0);
        if (got < 0 && errno != EINTR && errno != EAGAIN && errno != EBUSY)
            err = -errno;                 /* not expected of a valid ring; the reads in
                                           * flight stay in flight: step again */
    }
    uint32_t first = ndone;
    reap(g, done, &ndone);
    /* Slots freed by this reap are refilled and submitted before the files that landed
     * are hashed: the disk reads the next files while this thread hashes (hashing first
     * left it idle for a hash per landing). */
    if (ndone > first && g->queued) {
        take(g, done, &ndone, max_done);
        if (unsubmitted(r))
            syscall(__NR_io_uring_enter, r->fd, unsubmitted(r), 0, 0, NULL, 0);
    }
    for (uint32_t k = 0; k < ndone; k++)
        if (!done[k]->err)
            hash_item(g->hst, done[k], g->secret, g->secret_len);
    return ndone || !err ? (int)ndone : err;
}

int dp_sio_read(int root_fd, struct dp_sio_item *items, uint32_t n, uint32_t depth,
                int direct, const uint8_t *secret, uint32_t secret_len)
{
    if ((n && !items) || depth == 0 || depth > 4096)
        return -EINVAL;
    if (n == 0)
        return 0;
    dp_sio_ring *g = dp_sio_ring_create(root_fd, depth > n ? n : depth, n, direct, secret,
                                        secret_len);
    if (!g)
        return -errno;
    uint32_t max_done = g->depth + (n > g->depth ? n : g->depth);
    struct dp_sio_item **done = malloc(max_done * sizeof(*done));
    if (!done) {
        dp_sio_ring_destroy(g);
        return -ENOMEM;
    }
    int rc = dp_sio_ring_push(g, items, n);  /* the backlog holds all n: every item or none */
    if (rc < 0 || (uint32_t)rc != n) {
        free(done);
        dp_sio_ring_destroy(g);
        return rc < 0 ? rc : -EINVAL;
    }
    rc = 0;
    uint32_t landed = 0;
    while (landed < n) {
        int got = dp_sio_ring_step(g, done, max_done, 1);
        if (got < 0) {
            /* Queue nothing more; the reads in flight still land in the callers'
             * buffers, so reap every one of them before returning. */
            if (rc == 0)
                rc = got;
            for (; g->queued; landed++) {
                struct dp_sio_item *it = fifo_pop(g);
                it->err = -rc;
                it->stage = DP_SIO_READ;
            }
            struct timespec ts = {0, 50000};
            nanosleep(&ts, NULL);
            continue;
        }
        landed += (uint32_t)got;
    }
    free(done);
    dp_sio_ring_destroy(g);
    return rc;
}
