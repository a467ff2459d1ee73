/*
 * tcp_scope.c - the TCP provider's scope: which windows of a scoped region each admitted
 * peer may WRITE into (dp.h, "Scope"). The owner grants a peer one request's memory and
 * ungrants it when the request ends; the target (tcp_target.c) looks a WRITE's range up
 * here before any byte lands and rechecks the grant around every recvmsg into it.
 *
 * The table: max_grants slots under the engine's rwlock (grant and ungrant take it for
 * writing, so an ungrant waits out a recvmsg into its windows), chained per peer tag in
 * TCP_GRANT_BUCKETS buckets. A lookup walks the writer's bucket (its own grants: about
 * one per request in flight from it) and binary-searches a grant's sorted windows; the
 * connection's last grant is tried first, since a request's WRITEs come in a run.
 */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "tcp_internal.h"

static int win_cmp(const void *a, const void *b)
{
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

/* Does grant g (of the right peer and key) hold [addr, addr + len) in one window? */
static int grant_covers(const struct tcp_grant *g, uint64_t addr, uint64_t len)
{
    uint32_t lo = 0, hi = g->n;          /* the last window starting at or before addr */
    while (hi - lo > 1) {
        uint32_t mid = lo + (hi - lo) / 2;
        if (g->win[2 * mid] <= addr)
            lo = mid;
        else
            hi = mid;
    }
    return g->win[2 * lo] <= addr && addr < g->win[2 * lo + 1] &&
           len <= g->win[2 * lo + 1] - addr;
}

uint32_t tcp_scope_find(const dp_tcp *eng, uint32_t peer, const struct tcp_region *r,
                        uint64_t addr, uint64_t len, uint32_t hint)
{
    if (hint < eng->max_grants) {
        const struct tcp_grant *g = &eng->grants[hint];
        if (g->live && g->peer == peer && g->key == r->key && grant_covers(g, addr, len))
            return hint + 1;
    }
    for (uint32_t s = eng->grant_heads[peer % TCP_GRANT_BUCKETS]; s; s = eng->grants[s - 1].next) {
        const struct tcp_grant *g = &eng->grants[s - 1];
        if (g->peer == peer && g->key == r->key && grant_covers(g, addr, len))
            return s;
    }
    return 0;
}

int dp_tcp_grant(dp_tcp *eng, uint32_t peer, uint32_t rkey, const uint64_t *ranges,
                 uint32_t n, uint32_t *out_id)
{
    if (!eng || !ranges || !out_id || n == 0 || n > DP_TCP_MAX_WINDOWS)
        return -EINVAL;
    uint64_t *win = malloc((size_t)n * 2 * sizeof *win);
    if (!win)
        return -ENOMEM;
    for (uint32_t i = 0; i < n; i++) {
        uint64_t a = ranges[2 * i], l = ranges[2 * i + 1];
        if (l == 0 || a + l < a) {
            free(win);
            return -EINVAL;
        }
        win[2 * i] = a;
        win[2 * i + 1] = a + l;
    }
    qsort(win, n, 2 * sizeof *win, win_cmp);
    uint32_t m = 0;                      /* merge windows that touch or overlap */
    for (uint32_t i = 0; i < n; i++) {
        if (m && win[2 * i] <= win[2 * (m - 1) + 1]) {
            if (win[2 * i + 1] > win[2 * (m - 1) + 1])
                win[2 * (m - 1) + 1] = win[2 * i + 1];
        } else {
            win[2 * m] = win[2 * i];
            win[2 * m + 1] = win[2 * i + 1];
            m++;
        }
    }
    pthread_rwlock_wrlock(&eng->lock);
    int rc = 0;
    const struct tcp_region *r = region_find(eng, rkey);
    uint32_t slot = 0;
    if (!r) {
        rc = -ENOENT;
    } else if (!(r->access & DP_TCP_SCOPED) ||
               !region_covers(r, win[0], win[2 * m - 1] - win[0])) {
        rc = -EINVAL;                    /* sorted and merged: the first and last bound it */
    } else {
        while (slot < eng->max_grants && eng->grants[slot].live)
            slot++;
        if (slot == eng->max_grants)
            rc = -ENOSPC;
    }
    if (rc) {
        pthread_rwlock_unlock(&eng->lock);
        free(win);
        return rc;
    }
    struct tcp_grant *g = &eng->grants[slot];
    g->gen = (uint16_t)(g->gen == 0xffff ? 1 : g->gen + 1);
    g->id = (uint32_t)g->gen << 16 | slot;
    g->peer = peer;
    g->key = rkey;
    g->n = m;
    g->win = win;
    g->live = 1;
    uint32_t *head = &eng->grant_heads[peer % TCP_GRANT_BUCKETS];
    g->next = *head;
    *head = slot + 1;
    *out_id = g->id;
    pthread_rwlock_unlock(&eng->lock);
    return 0;
}

int dp_tcp_ungrant(dp_tcp *eng, uint32_t id)
{
    if (!eng)
        return -EINVAL;
    uint32_t slot = id & 0xffff;
    uint64_t *win = NULL;
    pthread_rwlock_wrlock(&eng->lock);
    if (!tcp_scope_live(eng, slot, id)) {
        pthread_rwlock_unlock(&eng->lock);
        return -ENOENT;
    }
    struct tcp_grant *g = &eng->grants[slot];
    for (uint32_t *p = &eng->grant_heads[g->peer % TCP_GRANT_BUCKETS]; *p;
         p = &eng->grants[*p - 1].next) {
        if (*p == slot + 1) {
            *p = g->next;
            break;
        }
    }
    win = g->win;
    g->win = NULL;
    g->n = 0;
    g->next = 0;
    g->live = 0;
    pthread_rwlock_unlock(&eng->lock);
    free(win);
    return 0;
}

void tcp_scope_free(dp_tcp *eng)
{
    if (!eng->grants)
        return;
    for (uint32_t i = 0; i < eng->max_grants; i++)
        free(eng->grants[i].win);
    free(eng->grants);
    eng->grants = NULL;
}
