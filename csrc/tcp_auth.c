/*
 * tcp_auth.c - admission of TCP provider connections (dp.h, "Admission"): the MAC of the
 * handshake transcript, the target's half (run by the engine's server thread on a
 * pending connection) and the initiator's half (run inside dp_tcp_conn_connect).
 *
 * MAC = HMAC-SHA256(secret, "dualpath-tcp-v1" | role | nonce_target | nonce_initiator |
 * cred_id as 4 bytes LE), role 'I' for the hello and 'T' for the welcome, so neither can
 * be replayed as the other, and both nonces are fresh per connection, so no transcript
 * can be replayed at all. Comparisons are constant-time (CRYPTO_memcmp).
 */
#include <endian.h>
#include <errno.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <poll.h>
#include <string.h>
#include <sys/random.h>
#include <sys/socket.h>

#include "tcp_internal.h"

static const char LABEL[] = "dualpath-tcp-v1";

void tcp_auth_mac(const uint8_t secret[DP_TCP_SECRET_BYTES], char role,
                  const uint8_t nonce_t[TCP_NONCE], const uint8_t nonce_i[TCP_NONCE],
                  uint32_t cred_id, uint8_t out[TCP_MAC])
{
    uint8_t msg[sizeof LABEL + 2 * TCP_NONCE + 4];
    size_t n = 0;
    memcpy(msg, LABEL, sizeof LABEL - 1);
    n += sizeof LABEL - 1;
    msg[n++] = (uint8_t)role;
    memcpy(msg + n, nonce_t, TCP_NONCE);
    n += TCP_NONCE;
    memcpy(msg + n, nonce_i, TCP_NONCE);
    n += TCP_NONCE;
    uint32_t id = htole32(cred_id);
    memcpy(msg + n, &id, 4);
    n += 4;
    unsigned int len = TCP_MAC;
    if (!HMAC(EVP_sha256(), secret, DP_TCP_SECRET_BYTES, msg, n, out, &len))
        memset(out, 0, TCP_MAC);    /* never matches a peer's (nonzero w.p. 1) MAC */
}

int tcp_auth_equal(const uint8_t *a, const uint8_t *b, size_t n)
{
    return CRYPTO_memcmp(a, b, n) == 0;
}

int tcp_random(void *buf, size_t n)
{
    uint8_t *p = buf;
    while (n) {
        ssize_t r = getrandom(p, n, 0);
        if (r < 0) {
            if (errno == EINTR)
                continue;
            return -errno;
        }
        p += r;
        n -= (size_t)r;
    }
    return 0;
}

/* ------------------------------------------------------------------ target */

int tcp_srv_handshake(dp_tcp *eng, struct tcp_srv_conn *c)
{
    uint8_t *buf = (uint8_t *)&c->hello;
    while (c->hello_got < sizeof c->hello) {
        ssize_t r = recv(c->fd, buf + c->hello_got, sizeof c->hello - c->hello_got,
                         MSG_DONTWAIT);
        if (r == 0)
            return -1;
        if (r < 0) {
            if (errno == EINTR)
                continue;
            return errno == EAGAIN || errno == EWOULDBLOCK ? 0 : -1;
        }
        c->hello_got += (uint32_t)r;
    }
    if (le32toh(c->hello.magic) != TCP_HELLO_MAGIC)
        return -1;
    uint32_t id = le32toh(c->hello.cred_id);
    uint32_t slot = id & 0xffff;
    uint8_t secret[DP_TCP_SECRET_BYTES];
    uint32_t peer;
    int found = 0;
    pthread_mutex_lock(&eng->cred_lock);
    if (slot < eng->max_creds && eng->creds[slot].live && eng->creds[slot].id == id) {
        memcpy(secret, eng->creds[slot].secret, sizeof secret);
        peer = eng->creds[slot].peer;
        found = 1;
    }
    pthread_mutex_unlock(&eng->cred_lock);
    uint8_t want[TCP_MAC];
    /* The MAC is computed even for an unknown id, so timing says nothing about ids. */
    tcp_auth_mac(found ? secret : (const uint8_t *)c->nonce, 'I', c->nonce, c->hello.nonce,
                 id, want);
    if (!found || !tcp_auth_equal(want, c->hello.mac, TCP_MAC))
        return -1;
    uint32_t mine = 0;
    for (struct tcp_srv_conn *o = eng->srv_conns; o; o = o->next)
        mine += o->admitted && o->peer == peer;
    if (mine >= eng->max_conns_per_peer)
        return -1;
    pthread_mutex_lock(&eng->cred_lock);     /* consume it: one connection per credential */
    found = eng->creds[slot].live && eng->creds[slot].id == id;
    eng->creds[slot].live = 0;
    pthread_mutex_unlock(&eng->cred_lock);
    if (!found)
        return -1;                           /* revoked meanwhile */
    uint8_t welcome[TCP_MAC];
    tcp_auth_mac(secret, 'T', c->nonce, c->hello.nonce, id, welcome);
    memset(secret, 0, sizeof secret);
    /* Counted before the welcome leaves: a peer that has read it must see itself in the
     * stats (counted after, a stats() call racing the send missed it). A welcome that
     * can't be sent takes the count back; the caller then closes the connection as
     * refused (still pending: admitted is set only once the welcome is out). */
    TCP_STAT_ADD(eng, conns_admitted, 1);
    if (send(c->fd, welcome, sizeof welcome, MSG_DONTWAIT | MSG_NOSIGNAL) !=
        (ssize_t)sizeof welcome) {
        TCP_STAT_ADD(eng, conns_admitted, -1);
        return -1;
    }
    c->admitted = 1;
    c->peer = peer;
    return 1;
}

/* ------------------------------------------------------------------ initiator */

/* Move exactly n bytes (send or recv) on a non-blocking socket before the deadline. */
static int io_full(int fd, void *buf, size_t n, int64_t deadline, int sending)
{
    uint8_t *p = buf;
    while (n) {
        ssize_t r = sending ? send(fd, p, n, MSG_DONTWAIT | MSG_NOSIGNAL)
                            : recv(fd, p, n, MSG_DONTWAIT);
        if (r > 0) {
            p += r;
            n -= (size_t)r;
            continue;
        }
        if (r == 0)
            return -ECONNRESET;              /* the target closed: not admitted */
        if (errno == EINTR)
            continue;
        if (errno != EAGAIN && errno != EWOULDBLOCK)
            return errno == EPIPE ? -ECONNRESET : -errno;
        int64_t now;
        if (tcp_now_ns(&now) < 0)
            return -errno;
        if (now >= deadline)
            return -ETIMEDOUT;
        struct pollfd pf = {.fd = fd, .events = sending ? POLLOUT : POLLIN};
        int64_t ms = (deadline - now + 999999) / 1000000;
        if (poll(&pf, 1, ms > 1000000 ? 1000000 : (int)ms) < 0 && errno != EINTR)
            return -errno;
    }
    return 0;
}

int tcp_conn_handshake(dp_tcp_conn *conn, int fd, int64_t deadline)
{
    struct tcp_challenge ch;
    int rc = io_full(fd, &ch, sizeof ch, deadline, 0);
    if (rc)
        return rc;
    if (le32toh(ch.magic) != TCP_CHALLENGE_MAGIC)
        return -EPROTO;
    struct tcp_hello h = {.magic = htole32(TCP_HELLO_MAGIC), .cred_id = htole32(conn->cred_id)};
    rc = tcp_random(h.nonce, sizeof h.nonce);
    if (rc)
        return rc;
    tcp_auth_mac(conn->cred_secret, 'I', ch.nonce, h.nonce, conn->cred_id, h.mac);
    rc = io_full(fd, &h, sizeof h, deadline, 1);
    if (rc)
        return rc;
    uint8_t got[TCP_MAC], want[TCP_MAC];
    rc = io_full(fd, got, sizeof got, deadline, 0);
    if (rc)
        return rc;
    tcp_auth_mac(conn->cred_secret, 'T', ch.nonce, h.nonce, conn->cred_id, want);
    return tcp_auth_equal(got, want, TCP_MAC) ? 0 : -EACCES;
}
