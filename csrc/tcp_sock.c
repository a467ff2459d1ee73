/*
 * tcp_sock.c - what every part of the TCP provider uses of the system: the monotonic
 * clock, socket options, name resolution. Calls nothing else of the provider.
 */
#include <errno.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdio.h>
#include <sys/socket.h>
#include <time.h>

#include "tcp_internal.h"

int tcp_now_ns(int64_t *out)
{
    struct timespec ts;
    if (clock_gettime(CLOCK_MONOTONIC, &ts) < 0)
        return -1;
    *out = (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
    return 0;
}

/* Latency over Nagle; optional fixed buffers (else the kernel autotunes them). */
void tcp_tune_socket(int fd, uint32_t sockbuf, uint32_t user_timeout_ms)
{
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    if (sockbuf) {
        int v = (int)sockbuf;
        setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &v, sizeof v);
        setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &v, sizeof v);
    }
    if (user_timeout_ms) {
        unsigned int v = user_timeout_ms;
        setsockopt(fd, IPPROTO_TCP, TCP_USER_TIMEOUT, &v, sizeof v);
    }
}

/* getaddrinfo's EAI_* as an errno. */
int tcp_resolve(const char *host, uint16_t port, int passive, struct addrinfo **out)
{
    char svc[8];
    snprintf(svc, sizeof svc, "%u", port);
    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM,
                             .ai_flags = AI_NUMERICSERV | (passive ? AI_PASSIVE : 0)};
    int rc = getaddrinfo(host && *host ? host : NULL, svc, &hints, out);
    if (rc == 0)
        return 0;
    if (rc == EAI_SYSTEM)
        return errno ? errno : EIO;
    return rc == EAI_MEMORY ? ENOMEM : EADDRNOTAVAIL;
}
